"""Where a serving step's time goes: one `Model.forward_batch` of N sequences' single tokens (the step
`strata serve --batch N` runs while N requests decode), per stage, for N = 1, 2, 4, 8; and the bytes
such a step must read, so the best possible ratio of N streams over one is known.

    python benchmarks/batch_step.py PACK [--streams 1,2,4,8] [--steps 8] [--rounds 3] [--threads 2]

Each N decodes --steps greedy steps of N sequences side by side (each after its own 8-token prompt);
the configurations are interleaved round by round and each N keeps its fastest round (the machine
may be shared). Stages come from benchmarks/decode.py's timers around the model's own blocks.

Bytes per step: every dense weight once (the LM head, mixers, hyper-connections, PLE, shared expert,
routers: the same for any N), plus the distinct routed experts the N tokens chose in each layer
(counted in the run), plus N embedding and PLE rows, plus N recurrent states (each GDN layer's delta
rule reads and writes its sequence's state: 3 MB per layer at seed-4l's widths). A step that only streamed its weights would take
bytes / bandwidth, so N streams can give at most N x bytes(1) / bytes(N) times one stream's tok/s:
that column says how much of the target the router leaves reachable.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
_clock = time.perf_counter

STAGES = {  # report row: the timer keys (decode.instrument's) it sums
    "routed experts": ("experts",),
    "LM head": ("head",),
    "mixers (GDN, QSA)": ("mixer",),
    "shared expert": ("shared",),
    "router": ("router",),
    "PLE": ("ple",),
    "hyper-connections": ("residual",),
}


def run(model, timers, n: int, steps: int, distinct: list[int]) -> tuple[float, dict[str, float], float]:
    """(seconds per step, seconds per step by stage, mean distinct experts per layer) of N sequences."""
    g = model.geometry
    rng = np.random.default_rng(n)
    sessions = [model.new_session(8 + steps + 1) for _ in range(n)]
    logits = [model.forward_batch([s], [rng.integers(300, g.n_vocab, 8).tolist()], [1])[0][0] for s in sessions]
    timers.reset()
    distinct.clear()
    t0 = _clock()
    for _ in range(steps):
        toks = [[int(np.argmax(x))] for x in logits]
        logits = [x[0] for x in model.forward_batch(sessions, toks, [1] * n)]
    total = (_clock() - t0) / steps
    sec = defaultdict(float)
    for (kind, l), v in timers.sec.items():
        sec[kind] += v / steps
    for kind in list(sec):  # innermost attribution, as decode.py: shared = MoE forward - router - routed
        if kind == "moe":
            sec["shared"] += sec.pop("moe") - sec["router"] - sec["experts"]
    by_stage = {name: sum(sec.get(k, 0.0) for k in keys) for name, keys in STAGES.items()}
    by_stage["other"] = total - sum(by_stage.values())
    return total, by_stage, float(np.mean(distinct)) if distinct else 0.0


def step_bytes(model, n: int, experts_per_layer: float) -> float:
    """Bytes a step of n tokens reads (module docstring), from decode.py's per-token accounting."""
    from decode import bytes_per_token

    from strata.engine.model import gdn_state_bytes

    g, pack = model.geometry, model.pack
    per = bytes_per_token(model)
    expert = sum(sum(a.nbytes for a in pack.expert(l, 0)) for l in range(g.n_layer)) / g.n_layer
    routed = sum(v for (k, _), v in per.items() if k == "experts")
    rows = per[("other", None)]  # the embedding row
    if pack.ple is not None:
        rows += len(model.ple) * g.ple_n_heads * pack.ple.row_bytes
    dense = sum(per.values()) - routed - rows
    # each sequence's recurrent state, read and written once per step by its delta rule
    state = sum(2 * gdn_state_bytes(g) for l in range(g.n_layer) if not g.is_full_attention(l))
    return dense + n * (rows + state) + g.n_layer * experts_per_layer * expert


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("pack", type=Path)
    ap.add_argument("--streams", default="1,2,4,8", help="comma-separated sequence counts")
    ap.add_argument("--steps", type=int, default=8, help="decode steps timed per configuration and round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--clock", default="wall", choices=("wall", "cpu"),
                    help="cpu: this process's CPU time (all its threads) instead of wall time, for a machine "
                         "other work keeps busy (at 1 thread the two agree on an idle machine)")
    a = ap.parse_args(argv)
    streams = [int(x) for x in a.streams.split(",")]

    import decode
    from decode import instrument, machine, pretouch

    global _clock
    if a.clock == "cpu":  # the stage timers read decode.py's `time.perf_counter`: the same clock for both
        _clock = time.process_time
        decode.time = SimpleNamespace(perf_counter=time.process_time)

    from strata.engine.kernels import cpu
    from strata.engine.model import Model
    from strata.engine.pack_reader import Pack

    cpu.set_threads(a.threads)
    model = Model(Pack.open(a.pack))
    g = model.geometry
    print(f"read every expert byte, the PLE table and the embeddings once: {pretouch(model):.1f} s", file=sys.stderr)
    timers = instrument(model)
    distinct: list[int] = []
    for moe in model.moes:  # count the distinct experts each layer's step reads
        routed, one = moe.routed, moe._token_products
        moe.routed = lambda be, x, experts, rows, starts, f=routed: distinct.append(len(experts)) or f(be, x, experts, rows, starts)

        def token_products(x, top, f=one):  # (one sequence's token: its experts, unless it falls back to routed)
            out = f(x, top)
            if out is not None:
                distinct.append(len(top))
            return out

        moe._token_products = token_products
    for n in streams:  # compile (or load) every kernel the steps take, before timing
        run(model, timers, n, 1, distinct)
    best: dict[int, tuple[float, dict[str, float], float]] = {}
    for r in range(a.rounds):
        for n in streams:
            res = run(model, timers, n, a.steps, distinct)
            if n not in best or res[0] < best[n][0]:
                best[n] = res
            print(f"round {r + 1}: {n} sequences {1e3 * res[0]:.1f} ms/step", file=sys.stderr)
    one = best[streams[0]]
    print(f"{a.pack.name}: {g.arch}, {g.n_layer} layers, {g.n_expert} experts top-{g.n_expert_used}; {a.threads} threads; "
          f"{a.clock} clock; "
          f"{a.steps} steps, fastest of {a.rounds} rounds; {machine()}")
    print()
    print("| ms per step | " + " | ".join(f"{n} seq" for n in streams) + f" | {streams[-1]} vs {streams[0]} |")
    print("|---|" + "---|" * (len(streams) + 1))
    for name in [*STAGES, "other"]:
        ms = [1e3 * best[n][1][name] for n in streams]
        ratio = f"{ms[-1] / ms[0]:.1f}x" if ms[0] > 0 else "-"
        print(f"| {name} | " + " | ".join(f"{x:.1f}" for x in ms) + f" | {ratio} |")
    tot = [1e3 * best[n][0] for n in streams]
    print("| whole step | " + " | ".join(f"{x:.1f}" for x in tot) + f" | {tot[-1] / tot[0]:.1f}x |")
    print()
    print("| sequences | distinct experts per layer | MB read per step | aggregate tok/s | vs 1 | best possible if bandwidth-bound |")
    print("|---|---|---|---|---|---|")
    b1 = step_bytes(model, streams[0], one[2])
    for n in streams:
        b = step_bytes(model, n, best[n][2])
        print(f"| {n} | {best[n][2]:.1f} | {b / 1e6:.0f} | {n / best[n][0]:.2f} | {n * one[0] / streams[0] / best[n][0]:.2f}x "
              f"| {n * b1 / streams[0] / b:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

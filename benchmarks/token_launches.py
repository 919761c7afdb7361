"""Where a decode token's wall time goes, launch by launch: every kernel launch the CPU token path
makes from Python timed, and the time between launches (the host's Python and numpy) summed.

    python benchmarks/token_launches.py [--arch qwen4exp] [--preset seed-4l] [--threads 8,1] [--tokens 12] [--top 30]

Wrapped for the run (nothing in engine/ is changed; the wrappers are removed at the end): each numba
kernel in the token path's modules' globals (dispatchers and row kernels, found by type, so a new
kernel is counted without a list to keep), `cpu.TokenProducts.__call__` (a call site's planned
products, labelled by their matrices' MB), `cpu.matmul_grouped` (the routed experts, labelled by type
and shape) and `ops.delta_rule_step`. A launch inside another counts once, in the outer one's total.
Bytes: the weights a launch reads (a product's matrices; a grouped call's matrices; the delta rule's
state, read and written), so GB/s says how near a launch is to the read bandwidth at that thread
count. Each wrapper costs ~1 us a call, a few percent of a seed-4l token.

2026-12-04, the H200's host at 8 threads: 3.06 of 18.95 ms between launches, a layer's router beside
its shared expert at 29 GB/s where the other products read 51-63 (docs/performance.md, session 27).
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

import decode as D


class Launches(D.Timers):
    """Timers around the launches (decode.py's patching and undoing), with calls and bytes per label
    and the time spent inside any of them (the outermost only)."""

    def __init__(self):
        super().__init__()
        self.acc: dict[str, list] = {}  # label -> [calls, seconds, bytes]
        self.depth, self.inside = 0, 0.0

    def time_launch(self, obj, name: str, label, nbytes=None) -> None:
        fn = getattr(obj, name)

        def timed(*a, **k):
            self.depth += 1
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                dt = time.perf_counter() - t0
                self.depth -= 1
                e = self.acc.setdefault(label(*a) if callable(label) else label, [0, 0.0, 0])
                e[0] += 1
                e[1] += dt
                if nbytes is not None:
                    e[2] += nbytes(*a)
                if self.depth == 0:
                    self.inside += dt

        self.patch(obj, name, timed)

    def reset(self) -> None:
        self.acc.clear()
        self.inside = 0.0


def instrument() -> Launches:
    from numba.core.dispatcher import Dispatcher

    from strata.engine import backend, hyper, kvcache, moe, ops, ple, qsa
    from strata.engine import model as M
    from strata.engine.kernels import actq, cpu, delta, jit

    t = Launches()
    for mod in (hyper, ops, moe, qsa, ple, M, backend, kvcache, cpu, delta, actq):
        for k, v in list(vars(mod).items()):
            if isinstance(v, Dispatcher):
                t.time_launch(mod, k, f"{mod.__name__.split('.')[-1]}.{k}")
            elif isinstance(v, jit.RowKernel):  # (its variants: a caller may take one by name)
                for variant in ("serial", "parallel"):
                    t.time_launch(v, variant, f"{mod.__name__.split('.')[-1]}.{k}")
    t.time_launch(cpu.TokenProducts, "__call__", lambda self, *a: "products " + " + ".join(f"{r.nbytes / 1e6:.1f} MB" for r, _ in self.static),
           lambda self, *a: sum(r.nbytes for r, _ in self.static))
    t.time_launch(cpu, "matmul_grouped", lambda raw, type_id, n_in, n_out, offsets, *a, **k: f"grouped {cpu.ggml_type(type_id).name} {n_in} x {n_out}",
           lambda raw, type_id, n_in, n_out, offsets, *a, **k: len(offsets) * cpu.ggml_type(type_id).nbytes((n_in, n_out)))
    t.time_launch(ops, "delta_rule_step", "ops.delta_rule_step (state)", lambda S, *a: 2 * S.nbytes)
    return t


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", default="qwen4exp", choices=("qwen4exp", "qwen35moe"))
    ap.add_argument("--preset", default=D.PRESET, help="synthetic model preset (tools/synth.py)")
    ap.add_argument("--threads", default="8,1", help="comma-separated thread counts, each timed in turn")
    ap.add_argument("--tokens", type=int, default=12, help="token steps timed at each count (as many again before, untimed)")
    ap.add_argument("--top", type=int, default=30, help="rows of each table")
    args = ap.parse_args(argv)
    counts = [int(x) for x in args.threads.split(",")]

    from tabulate import tabulate

    from strata.engine.kernels import cpu
    from strata.engine.model import Model
    from strata.engine.pack_reader import Pack

    model = Model(Pack.open(D.ensure_pack(args.arch, args.preset)))
    model.warm_up(prompt_path=False)
    D.pretouch(model)
    ids = np.random.default_rng(0).integers(0, model.geometry.n_vocab, 8 + 2 * args.tokens * len(counts)).tolist()
    s = model.new_session(len(ids) + 1)
    for tok in ids[:8]:
        model.step(s, tok)
    pos = 8
    t = instrument()  # after the warm-up: every kernel is compiled (a wrapper in a module's globals would not be)
    print(f"{D.machine()}; {args.preset} {args.arch}, {args.tokens} token steps at each count")
    try:
        for n in counts:
            cpu.set_threads(n)
            for tok in ids[pos : pos + args.tokens]:
                model.step(s, tok)
            pos += args.tokens
            t.reset()
            t0 = time.perf_counter()
            for tok in ids[pos : pos + args.tokens]:
                model.step(s, tok)
            wall = (time.perf_counter() - t0) / args.tokens
            pos += args.tokens
            inside = t.inside / args.tokens
            rows = []
            for label, (c, sec, b) in sorted(t.acc.items(), key=lambda kv: -kv[1][1])[: args.top]:
                rows.append([label, f"{c / args.tokens:.1f}", f"{1e6 * sec / args.tokens:.0f}", f"{1e6 * sec / c:.1f}",
                             f"{b / c / 1e6:.2f}" if b else "", f"{b / sec / 1e9:.1f}" if b else ""])
            print(f"\n{n} threads: {1e3 * wall:.2f} ms a token (timed), {1e3 * inside:.2f} ms in launches, "
                  f"{1e3 * (wall - inside):.2f} ms between them")
            print(tabulate(rows, headers=["launch", "calls/token", "us/token", "us/call", "MB/call", "GB/s"], tablefmt="github",
                           disable_numparse=True))
    finally:
        D.uninstrument(t)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(D.REPO / "benchmarks"))
    sys.exit(main())

"""Serving benchmark: aggregate decode tok/s and time to first token at 1, 2, 4 and 8 concurrent
streams through `strata serve`'s scheduler (`--batch N` = the number of streams), on one pack.

    python benchmarks/serve_streams.py PACK [--streams 1,2,4,8] [--prompt 64] [--tokens 32] [--chunk 1024]
                                       [--threads N] [--device cpu|gpu [--gpu-step host|device]] [--rounds 2]
                                       [--spec N [--drafters oracle,right:0.7,right:0.43] [--verify batch,slot]]

Each configuration submits N requests at once (distinct random prompts of --prompt token ids, --tokens
greedy tokens each, EOS ignored) to a scheduler with --batch N over the same loaded model, and times:
  aggregate tok/s   all streams' generated tokens / the wall time from the first token of the
                    batch to the last (decode only: the prompts are fed before it)
  time to first     per request, from the submit to its first sampled token (prompt chunks of every
                    request are fed side by side, so this grows with N)
With --clock cpu both are in seconds of the process's CPU time (a machine other work keeps busy).
The ratio is each N's aggregate over N = 1's, measured in the same run (best of --rounds rounds,
the configurations interleaved round by round). Every request's tokens must equal its tokens at
N = 1 (the benchmark fails otherwise). The scheduler is the server's without HTTP: the figures are
the engine's and the worker's, not the network's.

With --spec N each stream count runs with --spec 0 and then with each drafter (the --spec 0 run's
tokens named right with probability P: engine/speculative.py ReferenceDrafter; or the pack's MTP
block, its requests' chains drafted together or apart: mtp, mtp-apart) verified with
--batch-mtp ("batch": every request's verify rows in one forward) and per request ("slot"); the
table gives each against --spec 0 at the same stream count.

--device gpu --gpu-step device serves as `strata serve --gpu-step device` does: the tier places
as many sessions as the most streams (with --spec, their snapshots), and the requests run in them
(engine/tier/sessions.py).
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path

import numpy as np

CLOCK = time.perf_counter  # --clock cpu: time.process_time


def run_streams(model, tok, n: int, prompts, tokens: int, chunk: int, ctx: int, spec: int = 0, batch_mtp: bool = False,
                drafter=None, sessions=None):
    from strata.engine.sampling import SamplerParams
    from strata.engine.scheduler import ConversationCache, Job, Scheduler, run_and_wait

    stamps: list[list[float]] = [[] for _ in range(n)]  # each request's token times (worker thread)
    sch = Scheduler(model, tok, max_context=ctx, kv="f16", chunk=chunk, max_queue=n, cache=ConversationCache(0, 0),
                    batch=n, spec=spec, batch_mtp=batch_mtp, drafter=drafter, sessions=sessions)
    jobs = [Job(prompt=prompts[i], max_tokens=tokens, params=SamplerParams(temperature=0), ignore_eos=True,
                on_token=lambda _t, k=i: stamps[k].append(CLOCK())) for i in range(n)]
    t0 = CLOCK()
    done = []
    threads = [threading.Thread(target=lambda j=j: done.append(run_and_wait(sch, j, 3600))) for j in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    sch.close()
    first = [s[0] - t0 for s in stamps]
    decode = max(s[-1] for s in stamps) - max(s[0] for s in stamps)
    decoded = sum(len(s) - 1 for s in stamps)  # tokens after each stream's first, in the decode window
    return decoded / decode if decode > 0 else float("nan"), first, [j.result.tokens.tolist() for j in jobs]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("pack", type=Path)
    ap.add_argument("--streams", default="1,2,4,8", help="comma-separated stream counts")
    ap.add_argument("--prompt", type=int, default=64, help="prompt tokens per request")
    ap.add_argument("--tokens", type=int, default=32, help="generated tokens per request")
    ap.add_argument("--chunk", type=int, default=1024, help="the prompt path's chunk")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--device", default="cpu", choices=("cpu", "gpu"))
    ap.add_argument("--gpu-step", default="host", choices=("host", "device"), help="with --device gpu: strata serve's "
                    "--gpu-step")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--clock", default="wall", choices=("wall", "cpu"),
                    help="cpu: the process's CPU time instead of wall time, for a machine other work keeps busy "
                         "(use it with --threads 1: idle OpenMP threads spin and would count)")
    ap.add_argument("--spec", type=int, default=0, help="also run each stream count with --spec N (table: against "
                    "--spec 0 at the same count)")
    ap.add_argument("--drafters", default="oracle,right:0.7,right:0.43",
                    help="with --spec: drafters from the --spec 0 tokens (oracle, wrong, right:P), or the pack's MTP "
                    "block: mtp (the requests' chains through the head together), mtp-apart (each on its own); "
                    "comma-separated")
    ap.add_argument("--verify", default="batch,slot", help="with --spec: batch (--batch-mtp: every request's verify "
                    "rows in one forward) and/or slot (each request's own forward)")
    a = ap.parse_args(argv)
    if a.spec:
        return spec_main(a)
    global CLOCK
    if a.clock == "cpu":
        CLOCK = time.process_time
    streams = [int(x) for x in a.streams.split(",")]

    from strata.engine.cli import load_model, start_tier
    from strata.engine.tokenizer import Tokenizer

    p, model, load_s = load_model(a.pack, None, None, a.threads, "serve_streams", a.chunk if a.chunk > 1 else 0)
    tok, g = Tokenizer.load(a.pack / "tokenizer.txt"), p.geometry
    ctx = a.prompt + a.tokens + 1
    tier, sessions = start(model, a, ctx, max(streams))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(300, g.n_vocab, a.prompt).tolist() for _ in range(max(streams))]
    best: dict[int, float] = {}
    ttft: dict[int, list[float]] = {}
    alone: dict[int, list[int]] = {}  # request i's tokens the first time it ran
    for r in range(a.rounds):
        for n in streams:
            tps, first, toks = run_streams(model, tok, n, prompts, a.tokens, a.chunk, ctx, sessions=sessions)
            for i, t in enumerate(toks):
                if alone.setdefault(i, t) != t:
                    print(f"serve_streams: request {i}'s tokens at {n} streams differ from its tokens before",
                          file=sys.stderr)
                    return 1
            if tps > best.get(n, 0):
                best[n], ttft[n] = tps, first
            print(f"round {r + 1}: {n} streams {tps:.2f} tok/s aggregate", file=sys.stderr)
    if tier is not None:
        tier.stop()
    base = best[streams[0]]
    print(f"{a.pack.name}: {g.arch}, {g.n_layer} layers, {g.n_expert} experts top-{g.n_expert_used}; "
          f"{where(a)}{'' if a.threads is None else f', {a.threads} threads'}; prompt {a.prompt}, {a.tokens} tokens "
          f"per stream, chunk {a.chunk}, --kv f16, best of {a.rounds}, {a.clock} clock")
    print()
    print("| streams | aggregate decode tok/s | vs 1 stream | time to first token (median, max) |")
    print("|---|---|---|---|")
    for n in streams:
        f = sorted(ttft[n])
        print(f"| {n} | {best[n]:.2f} | {best[n] / base:.2f}x | {f[len(f) // 2]:.2f} s, {f[-1]:.2f} s |")
    return 0


def start(model, a, ctx: int, most: int, spec: int = 0):
    """--device gpu: the GPU tier (the device step's: `most` sessions placed, each with `spec`
    snapshots) and where the requests' sessions come from (None: new ones); else (None, None)."""
    if a.device != "gpu":
        return None, None
    from strata.engine.cli import serve_sessions, start_tier

    tier = start_tier(model, "gpu", max_context=ctx, kv="f16", chunk=a.chunk, who="serve_streams", step=a.gpu_step,
                      spec=spec, batch=most)
    return tier, serve_sessions(model, tier)


def where(a) -> str:
    return a.device + (", --gpu-step device" if a.device == "gpu" and a.gpu_step == "device" else "")


def spec_main(a) -> int:
    """--spec N: every stream count with --spec 0 (the baseline, and the tokens the drafters draft from)
    and with each drafter and verification, interleaved round by round; the tokens of every run
    must equal --spec 0's."""
    global CLOCK
    if a.clock == "cpu":
        CLOCK = time.process_time
    from strata.engine.cli import load_model
    from strata.engine import speculative
    from strata.engine.speculative import ReferenceDrafter, parse_drafter
    from strata.engine.tokenizer import Tokenizer

    streams = [int(x) for x in a.streams.split(",")]
    # mtp: the pack's MTP block (the requests' chains through the head together); mtp-apart: each chain
    # on its own (STRATA_DRAFT_TOGETHER=0's path); else a ReferenceDrafter right with probability P
    drafters = [(d, d if d in ("mtp", "mtp-apart") else parse_drafter(d)[1]) for d in a.drafters.split(",")]
    modes = a.verify.split(",")
    if not set(modes) <= {"batch", "slot"}:
        print(f"serve_streams: --verify {a.verify!r}: expected batch and/or slot", file=sys.stderr)
        return 2
    p, model, _ = load_model(a.pack, None, None, a.threads, "serve_streams", a.chunk if a.chunk > 1 else 0)
    tok, g = Tokenizer.load(a.pack / "tokenizer.txt"), p.geometry
    ctx = a.prompt + a.tokens + 1
    tier, sessions = start(model, a, ctx, max(streams), a.spec)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(300, g.n_vocab, a.prompt).tolist() for _ in range(max(streams))]
    ref: dict[tuple, np.ndarray] = {}
    configs = [("--spec 0", None, None)] + [(f"{d} {m}", pr, m) for d, pr in drafters for m in modes]
    tps: dict[tuple[str, int], list[float]] = {}
    for r in range(a.rounds):
        for n in streams:
            for name, pr, mode in configs:
                drafter = None if pr is None or isinstance(pr, str) else \
                    (lambda job, sampler, pr=pr: ReferenceDrafter(ref[tuple(job.prompt)], g.n_vocab, pr,
                                                                    seed=int(job.prompt[0])))
                speculative.DRAFT_TOGETHER = pr != "mtp-apart"
                t, _, toks = run_streams(model, tok, n, prompts, a.tokens, a.chunk, ctx, 0 if pr is None else a.spec,
                                         mode == "batch", drafter, sessions)
                speculative.DRAFT_TOGETHER = True
                for i, x in enumerate(toks):
                    key = tuple(prompts[i])
                    if pr is None and key not in ref:
                        ref[key] = np.array(prompts[i] + x)
                    if x != ref[key][a.prompt:].tolist():
                        print(f"serve_streams: request {i}'s tokens ({name}, {n} streams) differ from --spec 0's",
                              file=sys.stderr)
                        return 1
                tps.setdefault((name, n), []).append(t)
                print(f"round {r + 1}: {n} streams, {name}: {t:.2f} tok/s aggregate", file=sys.stderr)
    if tier is not None:
        tier.stop()
    print(f"{a.pack.name}: {g.arch}, {g.n_layer} layers; {where(a)}{'' if a.threads is None else f', {a.threads} threads'}; "
          f"prompt {a.prompt}, {a.tokens} tokens per stream, --spec {a.spec}, chunk {a.chunk}, --kv f16, "
          f"{a.rounds} rounds (interleaved), {a.clock} clock; aggregate decode tok/s, best (median), and the best "
          "against --spec 0's best at the same stream count")
    print()
    print("| streams | " + " | ".join(c[0] for c in configs) + " |")
    print("|---|" + "---|" * len(configs))
    for n in streams:
        base = max(tps[("--spec 0", n)])
        cells = []
        for name, _, _ in configs:
            v = sorted(tps[(name, n)])
            cells.append(f"{v[-1]:.2f} ({v[len(v) // 2]:.2f}) {v[-1] / base:.2f}x")
        print(f"| {n} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The routed experts' kernels on a pack's real expert tensors: GB/s of weight bytes read per
second of CPU time, per layer (each layer's gate/up and down types), for the three calls the
engine makes:

- matvec:  one expert's gate [n_embd -> n_ff], one token (cpu.matvec), expert after expert;
- decode:  one decode step's routed experts: gate and up of k experts, one token each, in one
           grouped call, then their down projections in another (moe.MoE.products, T = 1);
- serve8:  a serving step of 8 sequences: 8 tokens x k experts, the experts they share grouped
           (an expert chosen twice gets 2 tokens), gate+up then down;
- few3:    k experts of 3 tokens each (the experts a serving step's streams share; routers that
           agree more than random choices give more of them), gate+up then down.

    python benchmarks/expert_kernels.py PACK [--rounds 5] [--layers 0,1,2,3] [--threads 1]

CPU time of the process (time.process_time) at 1 thread by default: the machine may be shared and
the CPU clock is what a thread's work costs whoever else runs. Each call is timed over a pool of
distinct experts (larger than the caches: the engine reads each expert from memory once per
token); the table gives the best and the median over --rounds passes. Expert choices are random
(seeded), not the router's: the kernels' cost does not depend on which experts they are.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))


def _pass(fn, calls) -> float:
    t0 = time.process_time()
    for c in calls:
        fn(*c)
    return time.process_time() - t0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("pack")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--layers", default="")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--calls", type=int, default=48, help="calls per pass (distinct experts)")
    a = ap.parse_args(argv)

    from strata.engine.kernels import cpu
    from strata.engine.kernels.actq import ActQ, quantize_act
    from strata.engine.pack_reader import Pack

    cpu.set_threads(a.threads)
    pack = Pack.open(a.pack)
    g = pack.geometry
    E, F, k = g.n_embd, g.n_ff_exp, g.n_expert_used
    layers = [int(s) for s in a.layers.split(",")] if a.layers else list(range(g.n_layer))
    rng = np.random.default_rng(0)
    x = quantize_act(rng.standard_normal(E).astype(np.float32))
    h = quantize_act(rng.standard_normal(F).astype(np.float32))
    rows = []
    for layer in layers:
        gu, dt = pack.expert_types(layer)
        span, g_at, u_at = pack.expert_gate_up(layer)
        _, _, down_all = pack.expert_tensors(layer)
        gb, db = gu.nbytes((E, F)), dt.nbytes((F, E))
        out1 = np.empty(F, np.float32)

        def matvec(e):
            cpu.matvec(span[g_at + e * gb : g_at + (e + 1) * gb], gu.id, E, F, x, out1)

        def gu_only(experts, tokens):
            starts = np.concatenate(([0], np.cumsum(tokens))).astype(np.int64)
            N = int(starts[-1])
            both = ActQ(np.repeat(x.q[None], 2 * N, 0), np.repeat(x.d[None], 2 * N, 0), np.repeat(x.s16[None], 2 * N, 0))
            at = experts.astype(np.int64) * gb
            cpu.matmul_grouped(span, gu.id, E, F, np.concatenate([g_at + at, u_at + at]), both, np.concatenate([starts, starts[1:] + N]))

        def down_only(experts, tokens):
            starts = np.concatenate(([0], np.cumsum(tokens))).astype(np.int64)
            N = int(starts[-1])
            ha = ActQ(np.repeat(h.q[None], N, 0), np.repeat(h.d[None], N, 0), np.repeat(h.s16[None], N, 0))
            cpu.matmul_grouped(down_all, dt.id, F, E, experts.astype(np.int64) * db, ha, starts)

        def serve8():
            top = np.stack([rng.choice(g.n_expert, k, replace=False) for _ in range(8)])
            ex, cnt = np.unique(top, return_counts=True)
            return ex, cnt

        mv_calls = [(int(e),) for e in rng.permutation(g.n_expert)[: a.calls]]
        dec_calls = [(np.sort(rng.choice(g.n_expert, k, replace=False)), np.ones(k, np.int64)) for _ in range(a.calls)]
        srv_calls = [serve8() for _ in range(max(4, a.calls // 6))]
        few_calls = [(c[0], np.full(k, 3, np.int64)) for c in dec_calls[: max(4, a.calls // 3)]]
        cases = [
            ("matvec gate", gu.name, matvec, mv_calls, gb),
            ("decode gate+up", gu.name, gu_only, dec_calls, 2 * k * gb),
            ("decode down", dt.name, down_only, dec_calls, k * db),
            ("serve8 gate+up", gu.name, gu_only, srv_calls, None),
            ("serve8 down", dt.name, down_only, srv_calls, None),
            ("few3 gate+up", gu.name, gu_only, few_calls, 2 * k * gb),
            ("few3 down", dt.name, down_only, few_calls, k * db),
        ]
        for name, tname, fn, calls, per in cases:
            fn(*calls[0])  # compile or load
            if per is None:  # distinct experts per call
                nbytes = sum(len(c[0]) for c in calls) * (2 * gb if "gate" in name else db)
            else:
                nbytes = per * len(calls)
            times = sorted(_pass(fn, calls) for _ in range(a.rounds))
            best, med = times[0], times[len(times) // 2]
            rows.append((layer, name, tname, 1e3 * best / len(calls), 1e3 * med / len(calls), nbytes / best / 1e9, nbytes / med / 1e9))
            print(f"layer {layer} {name:15s} {tname:8s} {rows[-1][3]:8.3f} ms/call (median {rows[-1][4]:8.3f})  "
                  f"{rows[-1][5]:6.2f} GB/s (median {rows[-1][6]:6.2f})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

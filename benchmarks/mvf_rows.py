"""A verify's few-row products on a card: the one-row kernel's NT rows (mv<T, KPL, 0, NT>, the
engine's for 2-4 rows of a matrix of few weight rows) against the few-row kernel (mvf) with 1-4
weight rows a warp.

    python3 benchmarks/mvf_rows.py [--types Q6_K,Q4_K,Q8_0,...] [--tokens 1,2,3,4]

Why: a verify of 1 + 2 rows on the device step reads every weight once, as a token step does, yet its
Q6_K products (the LM head among them) took 1.9x the token step's on mvf (session 37, an H200). mvf
gave a warp one row: each lane loaded its act-blocks of every activation row for that one row, and
the warp waited on one row's blocks at a time. mvf<T, R> gives a warp R rows: a lane loads an
act-block of the activations once for R rows and has R rows' weight blocks in flight. A row's
arithmetic does not change (the same lane order, the same fold): the last column compares the bits.

Then mvf still took 1.34x the one-row mv's time for 3 rows of a Q6_K head and 1.7-2.2x on the
small products (an H200, 2026-12-06): its weight blocks come straight from global memory, a warp's
loads one row group at a time. mv<T, KPL, 0, NT> is the token step's kernel given NT activation rows:
each weight row staged (the next step's copy in flight while this one computes) and decoded once
for all NT, each row's activation in registers. It won on few weight rows and lost on many
(session 41, docs/performance.md), so the engine takes it where mvf would give a warp one row.

For each block type and shape (a head, a dense projection, a small one) and token count: microseconds
per product (CUDA events around a captured graph of the products, weights cycled past 3x the L2 so
that each is read from memory, as a verify reads them) on mv<T, KPL, 0, NT> ("mv NT", forced on every shape; the 1-token row: mv, the token step's kernel,
which every cell is against), then on mvf with R chosen by the
engine (gpu._mvf_rows, "auto") and with each R forced. Last, each mv NT kernel's registers and local
(spilled) bytes a thread. The modules are compiled first, side by side (the GPU tier's compile_ahead).
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
SHAPES = {"head": (2560, 248320), "dense": (2560, 12288), "small": (2560, 1024)}
ROWS = (-1, 0, 1, 2, 3, 4)  # -1: mv<T, KPL, 0, NT>; 0: mvf, the engine's choice of R


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--types", default="Q6_K,Q4_K,Q8_0,Q5_0,IQ4_NL,IQ3_XXS")
    ap.add_argument("--tokens", default="1,2,3,4")
    a = ap.parse_args(argv)
    sys.path.insert(0, str(REPO / "benchmarks"))
    from kernels_gpu import Bench

    from strata.engine.kernels import gpu
    from strata.engine.kernels.actq import is_wide
    from strata.engine.tier import compile_ahead
    from strata.index_format.ggml_types import ggml_type

    types = a.types.split(",")
    tokens = sorted({1} | {int(v) for v in a.tokens.split(",")})  # (1: the mv baseline each row is against)
    t0 = time.perf_counter()
    keys = types + [name + gpu.ROWS for name in types]
    compile_ahead.ahead(keys, compile_ahead.card_of_runtime(gpu.runtime()), print)
    for key in keys:
        gpu.compile_module(key)
    print(f"{len(types)} modules ready in {time.perf_counter() - t0:.0f} s; {gpu.available()[1]}")
    b = Bench()
    cp, kernels = b.cp, set()
    label = {-1: "mv NT", 0: "auto"}
    head = f"{'product':>22} " + " ".join(f"{label.get(r, 'R=' + str(r)) + ' us':>9} {'/1':>5}" for r in ROWS)
    print(head + "  kernel (mv NT)        bits")
    for name in types:
        t = ggml_type(name)
        for shape, (n_in, n_out) in SHAPES.items():
            one = t.nbytes((n_in, n_out))
            ws = [b.weight(t, n_in, n_out, 100 + i) for i in range(max(1, -(-3 * b.l2 // one)))]
            base = None
            # (the wide form, actq.WIDE: a row's two planes; on mvf both planes as 2 NT rows, then combine16)
            for n_tok, wide in [(n, False) for n in tokens] + [(n, True) for n in tokens if is_wide(t)]:
                x = cp.asarray(np.random.default_rng(n_tok).standard_normal((n_tok, n_in)).astype(np.float32))
                act = gpu.quantize_act16_gpu(x) if wide else gpu.quantize_act_gpu(x)
                cells, bits, kernel = [], set(), ""
                for r in ROWS if n_tok > 1 else (0,):
                    gpu.MVF_ROWS, gpu.MVT_TOKENS = max(r, 0), gpu.MVT_MOST if r < 0 else 1
                    if r < 0 and gpu._mv_launch(t.id, n_in, n_out, n_tok, wide, share=1) is None:
                        cells.append(f"{'-':>9} {'':>5}")  # (more act-blocks a lane than mv NT holds)
                        continue
                    gpu._plans.clear()
                    outs = [cp.empty((n_tok, n_out), cp.float32) for _ in ws]
                    # (mv NT: its launch forced on any weight rows, share=1; the engine takes it on few)
                    plan = gpu._mv_launch(t.id, n_in, n_out, n_tok, wide, share=1) if r < 0 else None
                    if plan is not None:
                        kernel = plan[1]
                        kernels.add(kernel)
                        a16 = act.planes if wide else act
                        w_args = [(w.rest, w.scales if w.scales is not None else w.rest) for w in ws]
                        calls = [(lambda wa=wa, o=o: gpu.runtime().launch(plan[0], plan[1], plan[2], plan[3], wa + (a16.q, a16.d, a16.s16, o, np.int32(n_out), np.int32(n_in // 32)) + plan[5], plan[4]))
                                 for wa, o in zip(w_args, outs)] * max(1, -(-8 // len(ws)))
                    else:
                        calls = [(lambda w=w, o=o: gpu.matmul(w, act, o)) for w, o in zip(ws, outs)] * max(1, -(-8 // len(ws)))
                        if n_tok == 1:
                            kernel = (gpu._wide_mv_plan(t.id, n_in, n_out, 1) if wide else gpu._quant_plan(t.id, n_in, n_out, 1))[1]
                            kernels.add(kernel)
                    sec, _ = b.per_call(calls)
                    bits.add(hashlib.sha256(b"".join(cp.asnumpy(o).tobytes() for o in outs)).hexdigest())
                    us = sec * 1e6
                    base = us if n_tok == 1 else base
                    cells.append(f"{us:9.1f} {us / base:4.2f}x")
                cells += [f"{'':>9} {'':>5}"] * (len(ROWS) - len(cells))
                print(f"{name + ' ' + shape + ' ' + str(n_tok) + (' wide' if wide else ''):>22} " + " ".join(cells)
                      + f"  {kernel:<20}  {'same' if len(bits) == 1 else 'DIFFERENT'}", flush=True)
    gpu.MVF_ROWS, gpu.MVT_TOKENS = 0, gpu.MVT_MOST
    print(f"\n{'kernel':>20} {'registers':>9} {'local B':>7}  (a thread; local: spilled)")
    for kernel in sorted(kernels):
        t = ggml_type(int(kernel[3 : kernel.index(",")]))
        fn = gpu._module(t.name + (gpu.ROWS if kernel.count(",") >= 3 else "")).mod.get_function(kernel)  # (NT rows: gpu.ROWS's)
        print(f"{kernel:>20} {fn.num_regs:>9} {fn.local_size_bytes:>7}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The few-row kernel (mvf, a verify's products) with 1-4 weight rows a warp, on a card.

    python3 benchmarks/mvf_rows.py [--types Q6_K,Q4_K,Q8_0,...] [--tokens 1,2,3,4]

Why: a verify of 1 + 2 rows on the device step reads every weight once, as a token step does, yet its
Q6_K products (the LM head among them) took 1.9x the token step's on mvf (session 37, an H200). mvf
gave a warp one row: each lane loaded its act-blocks of every activation row for that one row, and
the warp waited on one row's blocks at a time. mvf<T, R> gives a warp R rows: a lane loads an
act-block of the activations once for R rows and has R rows' weight blocks in flight. A row's
arithmetic does not change (the same lane order, the same fold): the last column compares the bits.

For each block type and shape (a head, a dense projection, a small one) and token count: microseconds
per product (CUDA events around a captured graph of the products, weights cycled past 3x the L2 so
that each is read from memory, as a verify reads them) with R chosen by the engine (gpu._mvf_rows,
"auto") and with each R forced, each against the 1-token product (mv, the token step's kernel).
The modules are compiled first, side by side (the GPU tier's compile_ahead).
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
ROWS = (0, 1, 2, 3, 4)  # 0: the engine's choice


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--types", default="Q6_K,Q4_K,Q8_0,Q5_0,IQ4_NL,IQ3_XXS")
    ap.add_argument("--tokens", default="1,2,3,4")
    a = ap.parse_args(argv)
    sys.path.insert(0, str(REPO / "benchmarks"))
    from kernels_gpu import Bench

    from strata.engine.kernels import gpu
    from strata.engine.tier import compile_ahead
    from strata.index_format.ggml_types import ggml_type

    types = a.types.split(",")
    tokens = sorted({1} | {int(v) for v in a.tokens.split(",")})  # (1: the mv baseline each row is against)
    t0 = time.perf_counter()
    compile_ahead.ahead(types, compile_ahead.card_of_runtime(gpu.runtime()), print)
    for name in types:
        gpu.compile_module(name)
    print(f"{len(types)} modules ready in {time.perf_counter() - t0:.0f} s; {gpu.available()[1]}")
    b = Bench()
    cp = b.cp
    head = f"{'product':>22} " + " ".join(f"{('auto' if r == 0 else 'R=' + str(r)) + ' us':>9} {'/1':>5}" for r in ROWS)
    print(head + "  kernel (auto)  bits")
    for name in types:
        t = ggml_type(name)
        for label, (n_in, n_out) in SHAPES.items():
            one = t.nbytes((n_in, n_out))
            ws = [b.weight(t, n_in, n_out, 100 + i) for i in range(max(1, -(-3 * b.l2 // one)))]
            base = None
            for n_tok in tokens:
                x = cp.asarray(np.random.default_rng(n_tok).standard_normal((n_tok, n_in)).astype(np.float32))
                act = gpu.quantize_act_gpu(x)
                cells, bits, kernel = [], set(), ""
                for r in ROWS if n_tok > 1 else (0,):
                    gpu.MVF_ROWS = r
                    gpu._plans.clear()
                    outs = [cp.empty((n_tok, n_out), cp.float32) for _ in ws]
                    calls = [(lambda w=w, o=o: gpu.matmul(w, act, o)) for w, o in zip(ws, outs)] * max(1, -(-8 // len(ws)))
                    sec, _ = b.per_call(calls)
                    if r == 0:
                        kernel = gpu._quant_plan(t.id, n_in, n_out, n_tok)[1]
                    bits.add(hashlib.sha256(b"".join(cp.asnumpy(o).tobytes() for o in outs)).hexdigest())
                    us = sec * 1e6
                    base = us if n_tok == 1 else base
                    cells.append(f"{us:9.1f} {us / base:4.2f}x")
                cells += [f"{'':>9} {'':>5}"] * (len(ROWS) - len(cells))
                print(f"{name + ' ' + label + ' ' + str(n_tok):>22} " + " ".join(cells)
                      + f"  {kernel:<13}  {'same' if len(bits) == 1 else 'DIFFERENT'}", flush=True)
    gpu.MVF_ROWS = 0
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The CPU prompt path with its row-wise kernels' rows across the threads (jit.RowKernel, from
jit.PARALLEL_ROWS rows) against the same kernels serial, on the `seed-4l` synthetic model: one
process, one chunk of --tokens a round, the two settings alternating round by round (the first round
of each is the warm-up's).

    python benchmarks/row_kernels.py [--arch qwen4exp] [--threads 2] [--tokens 1024] [--rounds 8]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", default="qwen4exp", choices=("qwen4exp", "qwen35moe"))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=8)
    args = ap.parse_args(argv)

    from decode import ensure_pack

    from strata.engine.kernels import cpu, jit
    from strata.engine.model import Model
    from strata.engine.ops import reuse_freed_memory, single_blas_thread
    from strata.engine.pack_reader import Pack

    single_blas_thread()
    reuse_freed_memory()
    model = Model(Pack.open(ensure_pack(args.arch)))
    model.warm_up()
    cpu.set_threads(args.threads)
    toks = np.random.default_rng(1).integers(3, model.geometry.n_vocab, args.tokens).tolist()
    settings = {"serial rows": 10**9, "rows across threads": jit.PARALLEL_ROWS}
    got = {name: [] for name in settings}
    for r in range(args.rounds):
        for name in settings if r % 2 == 0 else reversed(settings):
            jit.PARALLEL_ROWS = settings[name]
            s = model.new_session(args.tokens + 1, "f16")
            t0 = time.perf_counter()
            model.forward(s, toks, n_logits=1)
            got[name].append(args.tokens / (time.perf_counter() - t0))
    jit.PARALLEL_ROWS = settings["rows across threads"]
    med = {name: float(np.median(v[1:] if len(v) > 1 else v)) for name, v in got.items()}
    print(f"{args.arch} seed-4l, a {args.tokens}-token chunk, {args.threads} threads, {args.rounds} rounds alternating (tok/s)")
    for name, v in got.items():
        print(f"  {name:<20} {' '.join(f'{x:.1f}' for x in v)}  median (rounds 2+) {med[name]:.1f}")
    print(f"  ratio {med['rows across threads'] / med['serial rows']:.3f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The prompt path's chunked delta rule (ops.chunk_delta_rule), before and after its forward
substitution became one GIL-free kernel per range of heads (kernels/delta.substitute), in one
process, rounds interleaved, at each thread count and job count asked.

Before: the substitution as numpy did it, two small calls per row of a sub-chunk for every range of
heads (a [1, i] x [i, dv + dk] product, then a subtract), each holding the GIL for its dispatch, so
the heads' Python threads queued on it. After: one call per sub-chunk and range of heads.

    python benchmarks/delta_rule.py [--threads 1,2,4,8] [--jobs 4] [--lengths 512,4096] [--rounds 5]

The shapes are seed-4l's (and the production model's) Gated DeltaNet layer: 48 value heads and 16
key heads of 128, one layer per call; random l2-normalised q and k, decays in (-0.1, 0]. "diff" is
the largest |after - before| of the output over its largest |value|: the two sum the substitution
in different orders (numpy's BLAS chose its own), so they differ by float rounding only.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time

import numpy as np

from strata.engine import ops
from strata.engine.kernels import cpu, delta

F32 = np.float32
NV, NK, D = 48, 16, 128  # seed-4l's GDN heads (the production geometry's)


def numpy_substitute(L, X, r) -> None:
    """The substitution as it was (main at bc1abb2): per row, one batched product and a subtract."""
    row = np.empty((X.shape[0], 1, X.shape[2]), F32)
    for i in range(1, X.shape[1]):
        np.matmul(L[:, i : i + 1, :i], X[:, :i], out=row)
        np.subtract(X[:, i], row[:, 0], out=X[:, i])


@contextlib.contextmanager
def before():
    saved = delta.substitute
    delta.substitute = numpy_substitute
    try:
        yield
    finally:
        delta.substitute = saved


def inputs(T: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((T, NK, D)).astype(F32)
    k = rng.standard_normal((T, NK, D)).astype(F32)
    q /= np.linalg.norm(q, axis=-1, keepdims=True)
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    q *= F32(D**-0.5)
    v = rng.standard_normal((T, NV, D)).astype(F32)
    g = (-rng.random((T, NV)) * 0.1).astype(F32)
    beta = rng.random((T, NV)).astype(F32)
    S0 = (rng.standard_normal((NV, D, D)) * 0.01).astype(F32)
    return S0, q, k, v, g, beta


def timed(S0, q, k, v, g, beta) -> tuple[float, np.ndarray]:
    S = S0.copy()
    t = time.perf_counter()
    o = ops.chunk_delta_rule(S, q, k, v, g, beta)
    return time.perf_counter() - t, o


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", default="1,2", help="comma-separated thread counts")
    ap.add_argument("--jobs", default=str(ops.DELTA_JOBS), help="comma-separated caps on the rule's jobs (ops.DELTA_JOBS)")
    ap.add_argument("--lengths", default="512,4096", help="comma-separated prompt lengths (tokens)")
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args(argv)
    ops.single_blas_thread()
    from decode import machine  # (benchmarks/ is on the path when this runs as a script)

    print(f"{machine()}; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {a.rounds} rounds, before and after alternating")
    print("| tokens | threads | jobs | before ms (median / best) | after ms (median / best) | speed-up (medians) | diff |")
    print("|---|---|---|---|---|---|---|")
    for T in (int(x) for x in a.lengths.split(",")):
        args = inputs(T)
        for th in (int(x) for x in a.threads.split(",")):
            cpu.set_threads(th)
            for jobs in (int(x) for x in a.jobs.split(",")):
                ops.DELTA_JOBS = jobs
                with before():
                    timed(*args)  # warm: the pool's threads started, the kernel loaded
                timed(*args)
                was, now = [], []
                for _ in range(a.rounds):
                    with before():
                        t, ref = timed(*args)
                    was.append(t)
                    t, got = timed(*args)
                    now.append(t)
                diff = float(np.abs(got - ref).max() / np.abs(ref).max())
                mw, mn = statistics.median(was), statistics.median(now)
                print(f"| {T} | {th} | {jobs} | {mw * 1e3:.1f} / {min(was) * 1e3:.1f} | {mn * 1e3:.1f} / {min(now) * 1e3:.1f} "
                      f"| {mw / mn:.2f}x | {diff:.1e} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

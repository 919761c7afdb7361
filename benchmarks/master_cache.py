"""What a parallel product's stream costs the host work after it, when the main thread streams its
share and when it does not.

    python benchmarks/master_cache.py [--threads 8] [--mb 64] [--repeat 40]

The token path's Python between two kernels runs on the main thread, which is also OpenMP's
thread 0 and streams its share of every product. A numpy step that takes ~16 us on warm caches
took ~140-220 us right after such a stream on the 2-core VM (docs/performance.md, session 28). Here
one buffer of --mb MB is summed by a Numba parallel kernel two ways, and a fixed host step (the
RMSNorm of one token's QSA queries, 32 heads of 256, as the engine computes it) is timed right
after each:
- every thread streams (thread 0, the main thread, included), --threads threads;
- only the other threads stream: --threads + 1 threads, thread 0 takes no share.
Where the second form is far cheaper, a token path whose main thread only orchestrates (one
thread more than the streaming ones) would spend less time between launches. On a host with spare
cores that is a design to measure; on 2 cores it would cost half the streaming threads.
"""

from __future__ import annotations

import argparse
import sys
import time

import numba
import numpy as np
from numba import njit, prange

F32 = np.float32


@njit(nogil=True)
def _sum(a):
    s = np.uint64(0)
    for i in range(a.size):
        s += a[i]
    return s


@njit(parallel=True, nogil=True)
def _stream(a, skip_main):
    # the streaming threads each sum one contiguous share of a; with skip_main thread 0 (the main
    # thread) takes none and the others split it
    n = a.size
    T = numba.get_num_threads()
    first = 1 if skip_main else 0
    W = T - first
    out = np.zeros(T, np.uint64)
    for t in prange(T):
        me = numba.get_thread_id()
        if me >= first:
            k = me - first
            out[me] = _sum(a[k * n // W : (k + 1) * n // W])
    return out.sum()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=8, help="streaming threads")
    ap.add_argument("--mb", type=int, default=64, help="MB streamed before each host step")
    ap.add_argument("--repeat", type=int, default=40)
    args = ap.parse_args(argv)
    from tabulate import tabulate

    from strata.engine import ops

    sys.path.insert(0, __file__.rsplit("/", 1)[0])
    import decode as D

    rng = np.random.default_rng(0)
    qg, gain = rng.random((1, 32, 512), dtype=F32), rng.random(256, dtype=F32)
    buf = np.ones(args.mb << 20, np.uint8)
    want = int(buf.size)

    def host() -> float:
        t0 = time.perf_counter()
        ops.rmsnorm(qg[:, :, :256], gain, 1e-6, group=256, f32_sums=True)
        return time.perf_counter() - t0

    sides = (("no stream before (warm)", None, args.threads),
             (f"{args.threads} threads stream, the main thread too", False, args.threads),
             (f"{args.threads} threads stream, the main thread not ({args.threads + 1} threads)", True, args.threads + 1))
    rows = []
    for name, skip, n in sides:
        if n > numba.config.NUMBA_NUM_THREADS:
            rows.append([name, "", "", f"needs {n} threads, numba has {numba.config.NUMBA_NUM_THREADS}"])
            continue
        numba.set_num_threads(n)
        if skip is not None and int(_stream(buf, skip)) != want:
            print("master_cache.py: the stream's sum is wrong", file=sys.stderr)
            return 1
        hs, ss = [], []
        for _ in range(args.repeat):
            if skip is not None:
                t0 = time.perf_counter()
                _stream(buf, skip)
                ss.append(time.perf_counter() - t0)
            hs.append(host())
        rows.append([name, f"{1e6 * np.median(hs):.1f}", f"{1e3 * np.median(ss):.2f}" if ss else "", ""])
    print(f"{D.machine()}; {args.mb} MB streamed, then one host step (the RMSNorm of 32 x 256 values); medians of {args.repeat}")
    print(tabulate(rows, headers=["before the host step", "host step us", "stream ms", ""], tablefmt="github", disable_numparse=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())

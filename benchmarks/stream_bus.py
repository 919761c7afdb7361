"""How fast a layer's routed experts can reach the device from the mapped GGUF: the rates that decide
how a prompt chunk streams the experts the GPU does not hold (engine/tier/staging.py).

    python3 benchmarks/stream_bus.py [--arch qwen4exp] [--threads 1,2,4,8] [--layers 2]

On the `seed-4l` pack (synthesized once under .cache/bench/ as benchmarks/decode.py does), page cache
warm (every expert byte read once first), each of a layer's three expert tensors whole:

    pageable        cudaMemcpy straight from the mapping (the driver stages it)
    memcpy N        the host copies the mapping into pinned memory on N threads (numpy, GIL released)
    pinned DMA      pinned memory -> device (the bus alone)
    memcpy N + DMA  the two in pieces, the DMA of piece i beside the host's copy of piece i + 1
    registered      cudaHostRegister of the mapping (read-only), then DMA from it; the registration's
                    time is its own column

Each rate is GB/s of the GGUF's bytes, the best of --repeat. Nothing here is a test: where a
method is refused (a registration of file pages can be), the row says so.
"""

from __future__ import annotations

import argparse
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))


def best(fn, repeat: int) -> float:
    t = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        t = min(t, time.perf_counter() - t0)
    return t


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", default="qwen4exp", choices=["qwen4exp", "qwen35moe"])
    ap.add_argument("--preset", default="seed-4l")
    ap.add_argument("--threads", default="1,2,4,8")
    ap.add_argument("--layers", type=int, default=2, help="layers timed (each layer's three tensors)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--piece-mib", type=int, default=32, help="piece of the pipelined memcpy + DMA")
    args = ap.parse_args()

    import cupy as cp
    from decode import ensure_pack
    from tabulate import tabulate

    from strata.engine.pack_reader import Pack

    pack = Pack.open(ensure_pack(args.arch, args.preset))
    g = pack.geometry
    tensors = [t for l in range(min(args.layers, g.n_layer)) for t in pack.expert_tensors(l)]
    total = sum(t.nbytes for t in tensors)
    for t in tensors:  # page cache warm
        np.bitwise_xor.reduce(t)
    largest = max(t.nbytes for t in tensors)
    dev = cp.empty(largest, cp.uint8)
    pinned_mem = cp.cuda.alloc_pinned_memory(largest)
    pinned = np.frombuffer(pinned_mem, np.uint8, largest)
    stream = cp.cuda.Stream(non_blocking=True)
    rows = []
    gbs = lambda s: f"{total / s / 1e9:.2f}"  # noqa: E731

    def pageable():
        for t in tensors:
            dev[: t.nbytes].set(t)
        cp.cuda.runtime.deviceSynchronize()

    rows.append(("pageable cudaMemcpy from the mapping", "-", gbs(best(pageable, args.repeat))))

    def pinned_dma():
        for t in tensors:
            dev[: t.nbytes].set(pinned[: t.nbytes], stream=stream)
        stream.synchronize()

    dma = best(pinned_dma, args.repeat)
    for n in [int(x) for x in args.threads.split(",")]:
        pool = ThreadPoolExecutor(n)

        def memcpy(t, out, pool=pool, n=n):
            step = -(-t.nbytes // n)
            list(pool.map(lambda i: np.copyto(out[i : i + step], t[i : i + step]), range(0, t.nbytes, step)))

        rows.append((f"memcpy into pinned, {n} threads", "-", gbs(best(lambda: [memcpy(t, pinned) for t in tensors], args.repeat))))
        piece = args.piece_mib << 20
        done = [cp.cuda.Event() for _ in range(2)]
        half = largest // 2 // 4096 * 4096

        def pipelined(memcpy=memcpy):
            k = 0
            for t in tensors:
                for a in range(0, t.nbytes, piece):
                    b = min(t.nbytes, a + piece)
                    slot = k % 2
                    done[slot].synchronize()  # this half of pinned is free again
                    host = pinned[slot * half : slot * half + (b - a)]
                    memcpy(t[a:b], host)
                    dev[a:b].set(host, stream=stream)
                    done[slot].record(stream)
                    k += 1
            stream.synchronize()

        if piece <= half:
            rows.append((f"memcpy {n} threads + DMA, {args.piece_mib} MiB pieces", "-", gbs(best(pipelined, args.repeat))))
        pool.shutdown()
    rows.append(("pinned DMA (the bus)", "-", gbs(dma)))

    # the mapping registered: DMA straight from the page cache, no host copy
    rt = cp.cuda.runtime
    flags = getattr(rt, "cudaHostRegisterReadOnly", 8)
    reg_s, regd = 0.0, []
    try:
        # one page-aligned range over every tensor timed (neighbours share pages: registering each
        # alone would register a shared page twice, which CUDA refuses)
        page = 4096
        lo = min(t.ctypes.data for t in tensors) // page * page
        hi = -(-max(t.ctypes.data + t.nbytes for t in tensors) // page) * page
        t0 = time.perf_counter()
        rt.hostRegister(lo, hi - lo, flags)
        regd.append(lo)
        reg_s = time.perf_counter() - t0

        def registered():
            for t in tensors:
                dev[: t.nbytes].set(t, stream=stream)  # (CuPy: an async copy; the memory is pinned now)
            stream.synchronize()

        rows.append(("registered mapping, DMA", f"{reg_s * 1e3:.0f} ms for {(hi - lo) / 1e9:.2f} GB",
                     gbs(best(registered, args.repeat))))
    except Exception as e:  # noqa: BLE001 - a refusal is a result here
        rows.append(("registered mapping, DMA", f"refused: {type(e).__name__}: {e}", "-"))
    finally:
        t0 = time.perf_counter()
        for ptr in regd:
            rt.hostUnregister(ptr)
        if regd:
            rows.append(("(unregister)", f"{(time.perf_counter() - t0) * 1e3:.0f} ms", "-"))
    print(f"{args.arch} {args.preset}: {len(tensors)} expert tensors of {args.layers} layers, {total / 1e9:.2f} GB")
    print(tabulate(rows, headers=["method", "setup", "GB/s"], tablefmt="github"))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""CPU kernel benchmark: weight bytes per second of `matvec`, against the memory read bandwidth
measured in the same run at the same thread count.

    python benchmarks/kernels.py [--threads 2] [--types Q8_0,Q4_0,...] [--pool-mib 512] [--no-head]
    python benchmarks/kernels.py --serial-sweep [--threads 2] [--types Q4_0,IQ2_XXS]

Expert shapes (types with 256-element blocks only in the 2560-element-row shape: 640 is not a
whole number of their blocks, so they never hold a down projection) are timed over a pool of
distinct random experts larger than the caches, as the engine reads them (each expert once per
token, from the mapped GGUF); the head shape is one matrix bigger than any cache. "naive" is
gguf-py's dequantize followed by a numpy matmul on one expert (ours for Q2_0, which gguf 0.19.0
does not know; numpy's BLAS may use more threads). Targets at 2 threads, expert shapes:
Q8_0 / Q4_0 / Q2_0 >= 50% of the read bandwidth, IQ4_NL and the IQ2/IQ3 types >= 20%.

Every call is timed; the table gives a percentile of the call times (--percentile, 10 by
default) and the median, and the read bandwidth is the same percentile over 32 MiB pieces of a
streaming read. Why not the best pass: on a machine shared with other work a parallel call waits
for the scheduler to run its other thread (4-8 ms when the cores are busy, measured), and a pass
of hundreds of calls nearly always meets some. The CPU and the load average are printed: when
the load exceeds the free cores, even the 10th percentile means little at 2 threads.
--serial-sweep times the serial and the parallel kernel on growing matrices that stay in cache
(the measurement behind cpu.SERIAL_BELOW).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

HOT = ("Q8_0", "Q4_0", "Q2_0", "IQ2_XXS", "IQ2_XS", "IQ3_XXS", "IQ4_NL", "Q4_K", "Q6_K")
TARGET = {"Q8_0": 0.5, "Q4_0": 0.5, "Q2_0": 0.5, "IQ4_NL": 0.2, "IQ2_XXS": 0.2, "IQ2_XS": 0.2, "IQ2_S": 0.2, "IQ3_XXS": 0.2, "IQ3_S": 0.2}
EXPERT_SHAPES = ((2560, 640), (640, 2560))  # (n_in, n_out): gate/up rows of 2560, down rows of 640
HEAD_SHAPE = (2560, 248320)
HEAD_TYPES = ("Q6_K", "Q8_0", "Q4_K")


def random_blocks(t, n_bytes: int, rng) -> np.ndarray:
    """Random bytes with finite, moderate fp16 scales: whole blocks, any number of tensors."""
    if not t.quantized:
        v = (rng.standard_normal(n_bytes // t.type_size) * 0.05).astype(np.float32)
        if t.name == "F16":
            v = v.astype(np.float16)
        elif t.name == "BF16":
            v = (v.view(np.uint32) >> 16).astype(np.uint16)
        return v.view(np.uint8)
    raw = np.frombuffer(rng.bytes(n_bytes), np.uint8).copy()
    blocks = raw.reshape(-1, t.type_size)
    halves = (rng.standard_normal((blocks.shape[0], max(1, t.n_scales))) * 0.05).astype(np.float16)
    at = 0
    for off, n in t.fp16_fields:
        blocks[:, off : off + 2 * n] = halves[:, at : at + n].view(np.uint8)
        at += n
    if t.name == "IQ1_M":
        words = blocks[:, 48:56].copy().view(np.uint16) & np.uint16(0x0FFF)
        d = np.abs(halves[:, 0]).view(np.uint16)
        for i in range(4):
            words[:, i] |= ((d >> np.uint16(4 * i)) & np.uint16(15)) << np.uint16(12)
        blocks[:, 48:56] = words.view(np.uint8)
    return raw


def _pct(times: list[float], pct: float) -> float:
    ts = sorted(times)
    return ts[min(len(ts) - 1, int(len(ts) * pct / 100))]


def stream_bandwidth(buf: np.ndarray, repeat: int, pct: float) -> float:
    """Bytes per second of a parallel int64 sum at the kernels' thread count: the buffer is read
    in 32 MiB pieces, `repeat` times, and a piece's time is the `pct` percentile (as the kernels')."""
    from numba import njit, prange

    @njit(parallel=True, nogil=True)
    def _sum(a, n_chunks):
        per = a.size // n_chunks
        out = np.zeros(n_chunks, np.int64)
        for c in prange(n_chunks):
            acc = 0
            part = a[c * per : (c + 1) * per]
            for j in range(part.size):
                acc += part[j]
            out[c] = acc
        return out.sum()

    piece = 4 << 20  # int64 values: 32 MiB
    v = buf[: buf.size // 8 * 8].view(np.int64)
    pieces = [v[i : i + piece] for i in range(0, v.size - piece + 1, piece)]
    _sum(pieces[0], 64)
    times = [_timed(lambda: _sum(p, 64)) for _ in range(repeat) for p in pieces]
    return pieces[0].nbytes / _pct(times, pct)


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def bench_matvec(t, n_in: int, n_out: int, pool: np.ndarray, repeat: int) -> list[float]:
    """Seconds of each matvec over `repeat` passes through the pool of distinct matrices."""
    from strata.engine.kernels import cpu
    from strata.engine.kernels.actq import quantize_act

    size = t.nbytes((n_in, n_out))
    n_mats = pool.size // size
    x = np.random.default_rng(0).standard_normal(n_in).astype(np.float32)
    act = quantize_act(x) if t.quantized else x
    out = np.empty(n_out, np.float32)
    cpu.matvec(pool[:size], t.id, n_in, n_out, act, out)  # compile or load
    mats = [pool[m * size : (m + 1) * size] for m in range(n_mats)]
    return [_timed(lambda: cpu.matvec(w, t.id, n_in, n_out, act, out)) for _ in range(repeat) for w in mats]


def bench_naive(t, n_in: int, n_out: int, raw: np.ndarray, repeat: int) -> float | None:
    import gguf
    from gguf import quants

    from strata.engine.kernels import reference

    x = np.random.default_rng(0).standard_normal(n_in).astype(np.float32)
    if t.name in gguf.GGMLQuantizationType.__members__:
        qt = gguf.GGMLQuantizationType[t.name]
        deq = lambda: quants.dequantize(raw.reshape(n_out, -1), qt)
    else:
        deq = lambda: reference.dequantize(raw, t.id, n_in * n_out).reshape(n_out, n_in)
    return min(_timed(lambda: deq() @ x) for _ in range(repeat))


def serial_sweep(names: list[str], threads: int, repeat: int) -> None:
    """Serial vs parallel kernel per call on matrices of 2560-element rows that stay in cache:
    the best and the median of many calls (the median shows what a busy machine adds)."""
    from strata.engine.kernels import cpu
    from strata.engine.kernels.actq import quantize_act
    from strata.index_format.ggml_types import BY_NAME

    n_in = 2560
    x32 = np.random.default_rng(1).standard_normal(n_in).astype(np.float32)
    xq = quantize_act(x32)
    below = cpu.SERIAL_BELOW
    print(f"{'type':8} {'rows':>5} {'MACs':>9}   serial best / median us   {threads} threads best / median us")
    try:
        for name in names:
            t = BY_NAME[name]
            x = xq if t.quantized else x32
            for n_out in (8, 16, 32, 64, 128, 256, 512, 1024):
                raw = random_blocks(t, t.nbytes((n_in, n_out)), np.random.default_rng(0))
                out = np.empty(n_out, np.float32)
                cells = []
                for cpu.SERIAL_BELOW in (1 << 62, 0):
                    cpu.matvec(raw, t.id, n_in, n_out, x, out)
                    ts = sorted(_timed(lambda: cpu.matvec(raw, t.id, n_in, n_out, x, out)) for _ in range(100 * repeat))
                    cells.append(f"{ts[0] * 1e6:9.1f} / {ts[len(ts) // 2] * 1e6:9.1f}")
                print(f"{name:8} {n_out:5} {n_in * n_out:9}   {cells[0]}   {cells[1]}", flush=True)
    finally:
        cpu.SERIAL_BELOW = below


def _machine() -> str:
    model = "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), model)
    except OSError:
        pass
    return f"{model}, {os.cpu_count()} logical CPUs, load average {os.getloadavg()[0]:.2f}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--types", default=",".join(HOT), help="comma-separated GGML type names, or 'all'")
    ap.add_argument("--pool-mib", type=int, default=512, help="distinct expert bytes cycled through (beat the caches)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--percentile", type=float, default=10, help="per-call time reported (10: robust to a busy machine's stalls; 50: median)")
    ap.add_argument("--no-head", action="store_true", help="skip the 248320 x 2560 head shape")
    ap.add_argument("--no-naive", action="store_true")
    ap.add_argument("--serial-sweep", action="store_true", help="time serial vs parallel kernels on small matrices, then stop")
    args = ap.parse_args(argv)

    from tabulate import tabulate

    from strata.engine.kernels import cpu
    from strata.index_format.ggml_types import BY_NAME, TYPES, ggml_type

    cpu.set_threads(args.threads)
    names = [t.name for t in TYPES] if args.types == "all" else [ggml_type(n.strip(), where="--types").name for n in args.types.split(",")]
    print(_machine(), flush=True)
    if args.serial_sweep:
        serial_sweep(names, args.threads, args.repeat)
        return 0
    rng = np.random.default_rng(0)
    pool_bytes = args.pool_mib << 20
    stream_buf = np.frombuffer(rng.bytes(pool_bytes), np.uint8)
    bw = stream_bandwidth(stream_buf, args.repeat, args.percentile)
    del stream_buf
    print(f"memory read bandwidth (parallel int64 sum, {args.threads} threads, p{args.percentile:g} of 32 MiB pieces): {bw / 1e9:.2f} GB/s", flush=True)

    rows = []
    for name in names:
        t = BY_NAME[name]
        shapes = list(EXPERT_SHAPES) + ([HEAD_SHAPE] if name in HEAD_TYPES and not args.no_head else [])
        for n_in, n_out in shapes:
            if n_in % t.block_size:  # a 640-element row is not whole 256-blocks: such types never hold down
                continue
            size = t.nbytes((n_in, n_out))
            n_mats = max(1, pool_bytes // size)
            pool = random_blocks(t, n_mats * size, rng)
            times = bench_matvec(t, n_in, n_out, pool, args.repeat)
            sec, median = _pct(times, args.percentile), _pct(times, 50)
            naive = None if (args.no_naive or not t.quantized or (n_in, n_out) == HEAD_SHAPE) else bench_naive(t, n_in, n_out, pool[:size], 2)
            rate = size / sec
            goal = TARGET.get(name) if (n_in, n_out) in EXPERT_SHAPES else None
            rows.append([
                name, f"{n_out} x {n_in}", f"{size / 2**20:.2f}", f"{sec * 1e6:.1f}", f"{median * 1e6:.1f}", f"{rate / 1e9:.2f}",
                f"{100 * rate / bw:.0f}%", "-" if naive is None else f"{naive * 1e3:.2f}",
                "-" if naive is None else f"{naive / sec:.0f}x",
                "" if goal is None else (f">= {goal:.0%}: " + ("met" if rate / bw >= goal else "BELOW")),
            ])  # fmt: skip
            print(" | ".join(rows[-1]), flush=True)
            del pool
    print(f"\nload average after: {os.getloadavg()[0]:.2f}\n")
    pn = f"p{args.percentile:g}"
    print(tabulate(rows, headers=["type", "rows x row", "MiB", f"us ({pn})", "us (median)", f"GB/s ({pn})", "of read bw", "naive ms", "speedup", "target"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())

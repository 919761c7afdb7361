"""CPU kernel benchmark: weight bytes per second of `matvec`, against the memory read bandwidth
measured in the same run at the same thread count.

    python benchmarks/kernels.py [--threads 2] [--types Q8_0,Q4_0,...] [--pool-mib 512] [--no-head]

Expert shapes (types with 256-element blocks only in the 2560-element-row shape: 640 is not a
whole number of their blocks, so they never hold a down projection) are timed over a pool of distinct random experts larger than the caches, as the
engine reads them (each expert once per token, from the mapped GGUF); the head shape is one
matrix bigger than any cache. "naive" is gguf-py's dequantize followed by a numpy matmul on one
expert (ours for Q2_0, which gguf 0.19.0 does not know; numpy's BLAS may use more threads). Targets at 2 threads, expert shapes:
Q8_0 / Q4_0 / Q2_0 >= 50% of the read bandwidth, IQ4_NL and the IQ2/IQ3 types >= 20%.
"""

from __future__ import annotations

import argparse
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


def stream_bandwidth(buf: np.ndarray, repeat: int) -> float:
    """Bytes per second of a parallel int64 sum over buf at the kernels' thread count."""
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

    v = buf[: buf.size // 8 * 8].view(np.int64)
    _sum(v, 64)
    return v.nbytes / min(_timed(lambda: _sum(v, 64)) for _ in range(repeat))


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def bench_matvec(t, n_in: int, n_out: int, pool: np.ndarray, repeat: int) -> float:
    """Seconds per matvec, best pass over the whole pool of distinct matrices."""
    from strata.engine.kernels import cpu
    from strata.engine.kernels.actq import quantize_act

    size = t.nbytes((n_in, n_out))
    n_mats = pool.size // size
    x = np.random.default_rng(0).standard_normal(n_in).astype(np.float32)
    act = quantize_act(x) if t.quantized else x
    out = np.empty(n_out, np.float32)
    cpu.matvec(pool[:size], t.id, n_in, n_out, act, out)  # compile

    def one_pass():
        for m in range(n_mats):
            cpu.matvec(pool[m * size : (m + 1) * size], t.id, n_in, n_out, act, out)

    return min(_timed(one_pass) for _ in range(repeat)) / n_mats


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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--types", default=",".join(HOT), help="comma-separated GGML type names, or 'all'")
    ap.add_argument("--pool-mib", type=int, default=512, help="distinct expert bytes cycled through (beat the caches)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--no-head", action="store_true", help="skip the 248320 x 2560 head shape")
    ap.add_argument("--no-naive", action="store_true")
    args = ap.parse_args(argv)

    from tabulate import tabulate

    from strata.engine.kernels import cpu
    from strata.index_format.ggml_types import BY_NAME, TYPES, ggml_type

    cpu.set_threads(args.threads)
    names = [t.name for t in TYPES] if args.types == "all" else [ggml_type(n.strip(), where="--types").name for n in args.types.split(",")]
    rng = np.random.default_rng(0)
    pool_bytes = args.pool_mib << 20
    stream_buf = np.frombuffer(rng.bytes(pool_bytes), np.uint8)
    bw = stream_bandwidth(stream_buf, args.repeat)
    del stream_buf
    print(f"memory read bandwidth (parallel int64 sum over {args.pool_mib} MiB, {args.threads} threads): {bw / 1e9:.2f} GB/s", flush=True)

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
            sec = bench_matvec(t, n_in, n_out, pool, args.repeat)
            naive = None if (args.no_naive or not t.quantized or (n_in, n_out) == HEAD_SHAPE) else bench_naive(t, n_in, n_out, pool[:size], 2)
            rate = size / sec
            goal = TARGET.get(name) if (n_in, n_out) in EXPERT_SHAPES else None
            rows.append([
                name, f"{n_out} x {n_in}", f"{size / 2**20:.2f}", f"{sec * 1e6:.1f}", f"{rate / 1e9:.2f}",
                f"{100 * rate / bw:.0f}%", "-" if naive is None else f"{naive * 1e3:.2f}",
                "-" if naive is None else f"{naive / sec:.0f}x",
                "" if goal is None else (f">= {goal:.0%}: " + ("met" if rate / bw >= goal else "BELOW")),
            ])  # fmt: skip
            print(" | ".join(rows[-1]), flush=True)
            del pool
    print()
    print(tabulate(rows, headers=["type", "rows x row", "MiB", "us/matvec", "GB/s", "of read bw", "naive ms", "speedup", "target"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())

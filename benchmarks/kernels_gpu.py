"""GPU kernel benchmark: weight bytes per second of `gpu.matvec`, per block type, against the
device's streaming-read bandwidth measured in the same run.

    python benchmarks/kernels_gpu.py [--types all|Q8_0,Q6_K,...] [--md FILE] [--matmul] [--grouped] [--no-matvec]

Reference bandwidth: a pure read kernel (16-byte loads, XOR-reduced so they are not dropped)
over a 4 GiB buffer, best of 5; a device-to-device copy is printed beside it (read + write
bytes). Bytes per matvec are the engine-form planes the kernel reads (GpuWeight.nbytes: the
widened f32 scales included).

Shapes: the head (248320 rows of 2560) is one matrix larger than the L2. The expert shapes (640
rows of 2560: gate/up; 2560 rows of 640: down, not for 256-element block types, which never hold
a down projection) are a few MB each, so they are timed over a pool of distinct experts larger
than 3x the L2, as the engine meets them. Launches are captured in a CUDA graph and replayed,
timed with CUDA events: a Python launch takes longer than a small matvec runs. Issue target: every type >= 60% of the read bandwidth on the
head shape. Weights are random bytes and scales (timing does not depend on the values).

--matmul adds a prompt chunk's dense projection: `gpu.matmul` of MATMUL_TOKENS tokens through one
MATMUL (n_in, n_out) weight, microseconds per product (all its launches) and tokens per second,
for a block type on each batched kernel: mm (__dp4a, a warp per row), mmq and mmt (the int8 tensor
cores; mmt in block tiles), whichever gpu.MMA_TYPES / MMT_TYPES say a run takes (STRATA_MMA,
STRATA_MMT; gpu.MMAX_TYPES, STRATA_MMAX, for the grouped ones); "mmq/mm", "mmt/mm" < 1: faster than
mm; "same bits": the three outputs bit for bit.
--matmul-tokens sets its tokens; --gemm adds the cuBLAS route of the device step's prompt (gpu.gemm_products:
the weight and the ActQ's values as f16 pairs, two GEMMs with f32 accumulation; not the same bits,
so its largest difference from mmt's output, over that output's largest value, is printed instead).
--grouped adds a prompt chunk's routed experts: one `gpu.grouped_products` launch over
GROUPED_EXPERTS distinct experts of the gate/up shape (and of the down shape, rounded up to whole
blocks) at each GROUPED_PAIRS range of pairs an expert (seeded: 5-20, a 256-token prompt's ~5 a
top-10 expert; 64-96, a 4096-token one's ~80), on each grouped kernel (GROUPED_KERNELS, gpu.grouped_kernel's choices:
mmx, mmqx, mmqw, mmqk, and shape: the default choice by the product's shape and the pairs an expert,
gpu.SHAPE_TYPES; --grouped-kernels picks, the first the baseline), microseconds per launch, each kernel's time over mmx's, and whether all gave the same bits.
--few adds the few-row products: `gpu.matmul` of 1, 2, 4 and 8 tokens through the FEW weight (qwen4exp's
hyper-connection down, rows longer than mv holds) on mvf (gpu.MVF_TOKENS 8) and on mmq (0),
microseconds per product (mvf takes 2-8 tokens by default since verify_profile.py timed a verify's rows on it).
--no-matvec leaves out the matvec columns (the head and expert matvecs), for the batched kernels alone.
mmq's knobs (environment, docs/gpu-kernels.md): STRATA_MQ_WARPS (warps a block, compiled; 4),
STRATA_MQ_MINB (blocks a multiprocessor its registers are bounded for; 1), STRATA_MQX_WARPS
(mmqx's warps a block, at most STRATA_MQ_WARPS; 4), STRATA_MQW_UNROLL (decode entries an mmqw lane
has in flight, compiled; 4), STRATA_MQK_NT (n-tiles of 8 tokens an mmqk warp holds over one decode,
compiled; 1), STRATA_MQK_MINB (blocks a multiprocessor mmqk's registers are bounded for; 1);
mmt's: STRATA_MT_WR / STRATA_MT_WC (warps along rows / tokens; 2 / 2), STRATA_MT_KS (entries a step; 8),
STRATA_MT_MINB (blocks a multiprocessor its registers are bounded for; 1).

--fmm times the batched float product instead (F32 routers, the shared expert's one-row gate, the
BF16/F16 GDN gates; FMM_SHAPES at FMM_TOKENS tokens): the kernel before (gpu.use_fmm("8x8"): fmm,
64 tokens a launch) against the tiled one ("tiles": fmt), microseconds per product (all its
launches, from a CUDA graph), the speed-up, whether the two outputs are the same bits, and the
tiled plan (kernel, grid).
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

HEAD = (2560, 248320)  # (n_in, n_out)
EXPERTS = {"gate/up": (2560, 640), "down": (640, 2560)}
MATMUL = (2560, 8192)  # (n_in, n_out) of --matmul: seed-4l qwen35moe's widest dense projection
MATMUL_TOKENS = 256
FEW = (10240, 320)  # (n_in, n_out) of --few: qwen4exp's hyper-connection down (4 streams of 2560 in)
FEW_TOKENS = (1, 2, 4, 8)
GROUPED_EXPERTS = 128  # a 256-token chunk routed to 8 experts of 256: ~2000 pairs over ~128-256 experts
GROUPED_PAIRS = ((5, 20), (64, 96))  # pairs an expert (inclusive), one table column group each
GROUPED_KERNELS = ("mmx", "mmqx", "mmqw", "mmqk", "shape")  # gpu.grouped_kernel's choices ("shape": by shape and pairs, the default)
TARGET = 0.60
# (type, n_in, n_out) of the float products of a prompt chunk (seed-4l qwen35moe, n_embd 2048)
FMM_SHAPES = {
    "router": ("F32", 2048, 256),
    "shared-expert gate": ("F32", 2048, 1),
    "GDN alpha/beta": ("BF16", 2048, 32),
    "GDN alpha/beta (F16 file)": ("F16", 2048, 32),
}
FMM_TOKENS = (256, 4096)

_BENCH_SRC = r"""
extern "C" __global__ void read_xor(const uint4* __restrict__ p, unsigned long long n, unsigned* out) {
    unsigned acc = 0;
    const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        const uint4 v = __ldg(p + i);
        acc ^= v.x ^ v.y ^ v.z ^ v.w;
    }
    if (acc == 0x9e3779b9u) out[0] = acc;  // practically never: keeps the loads
}

extern "C" __global__ void fill_hash(unsigned* p, unsigned long long n, unsigned seed) {
    const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        unsigned x = (unsigned)i * 0x9e3779b9u ^ seed ^ (unsigned)(i >> 32);
        x ^= x >> 16; x *= 0x85ebca6bu; x ^= x >> 13; x *= 0xc2b2ae35u; x ^= x >> 16;
        p[i] = x;
    }
}
"""


class Bench:
    def __init__(self) -> None:
        import cupy as cp

        from strata.engine.kernels import gpu

        self.cp, self.gpu = cp, gpu
        self.mod = cp.RawModule(code=_BENCH_SRC)
        dev = cp.cuda.Device()
        self.n_sm = dev.attributes["MultiProcessorCount"]
        self.l2 = dev.attributes["L2CacheSize"]
        self.name = gpu.available()[1]

    def random_bytes(self, n: int, seed: int):
        cp = self.cp
        words = cp.empty(-(-n // 4), cp.uint32)
        self.mod.get_function("fill_hash")((self.n_sm * 8,), (256,), (words, np.uint64(words.size), np.uint32(seed)))
        return words.view(cp.uint8)[:n]

    def elapsed(self, fn, reps: int) -> float:
        """Seconds per call, from CUDA events around `reps` back-to-back calls (after a warm-up)."""
        cp = self.cp
        fn()
        start, stop = cp.cuda.Event(), cp.cuda.Event()
        start.record()
        for _ in range(reps):
            fn()
        stop.record()
        stop.synchronize()
        return cp.cuda.get_elapsed_time(start, stop) / 1e3 / reps

    def read_bandwidth(self, nbytes: int = 4 << 30) -> float:
        buf = self.random_bytes(nbytes, 1).view(self.cp.uint32)
        out = self.cp.zeros(1, self.cp.uint32)
        n = np.uint64(nbytes // 16)
        fn = lambda: self.mod.get_function("read_xor")((self.n_sm * 16,), (512,), (buf, n, out))
        return nbytes / min(self.elapsed(fn, 3) for _ in range(5))

    def copy_bandwidth(self, nbytes: int = 2 << 30) -> float:
        src, dst = self.random_bytes(nbytes, 2), self.cp.empty(nbytes, self.cp.uint8)
        fn = lambda: dst.data.copy_from_device(src.data, nbytes)
        return 2 * nbytes / min(self.elapsed(fn, 3) for _ in range(3))

    def weight(self, t, n_in: int, n_out: int, seed: int):
        """A GpuWeight of random bytes built on the device (scales: finite, moderate)."""
        cp, gpu = self.cp, self.gpu
        blocks = t.nbytes((n_in, n_out)) // t.type_size
        if not t.quantized:
            vals = self.random_bytes(n_in * n_out * t.type_size, seed).view(cp.float32 if t.name == "F32" else cp.uint16)
            return gpu.GpuWeight(t.id, n_in, n_out, values=vals)
        scales = cp.full(blocks * t.n_scales, 0.01, cp.float32) if t.n_scales else None
        return gpu.GpuWeight(t.id, n_in, n_out, rest=self.random_bytes(blocks * t.rest_bytes, seed), scales=scales)

    def activation(self, t, n_in: int):
        x = self.cp.asarray(np.random.default_rng(0).standard_normal(n_in).astype(np.float32))
        return self.gpu.quantize_act_gpu(x) if t.quantized else x

    def per_call(self, calls: list) -> tuple[float, bool]:
        """(seconds per call, graph used): the calls captured once in a CUDA graph and replayed.
        A Python launch (~20 us) takes longer than a small matvec runs; the graph measures the GPU."""
        cp = self.cp
        for c in calls:  # compiles and loads the modules before any capture
            c()
        try:
            stream = cp.cuda.Stream(non_blocking=True)
            with stream:
                stream.begin_capture()
                for c in calls:
                    c()
                graph = stream.end_capture()
            run, graphed = (lambda: graph.launch(stream)), True
        except Exception:  # no graph capture in this CuPy: plain launches, overhead included
            stream, graphed = cp.cuda.get_current_stream(), False
            run = lambda: [c() for c in calls]
        with stream:
            sec = min(self.elapsed(run, 3) for _ in range(3))
        return sec / len(calls), graphed

    def matvec_rate(self, t, n_in: int, n_out: int) -> tuple[float, int, bool]:
        """(seconds per matvec, bytes per matvec, graph used), cycling through enough distinct
        matrices to exceed 3x the L2 (one, for the head) and at least 8 launches."""
        one = t.nbytes((n_in, n_out))
        ws = [self.weight(t, n_in, n_out, 100 + i) for i in range(max(1, -(-3 * self.l2 // one)))]
        a, out = self.activation(t, n_in), self.cp.empty(n_out, self.cp.float32)
        calls = [(lambda w=w: self.gpu.matvec(w, a, out)) for w in ws] * max(1, -(-8 // len(ws)))
        sec, graphed = self.per_call(calls)
        return sec, ws[0].nbytes, graphed

    def kernels(self, mma: bool, tiled: bool = False) -> None:
        """The batched kernel of the next launches: mmq / mmqx for every block type (tiled: mmt for the
        dense ones), or mm / mmx."""
        gpu = self.gpu
        gpu.MMA_TYPES = gpu.MMAX_TYPES = gpu._mma_types("all" if mma else "none", frozenset())
        gpu.MMT_TYPES = gpu._mma_types("all" if tiled else "none", frozenset())
        gpu.MMT_MIN_TILES = gpu.MMT_MIN_BLOCKS = 0  # the kernel itself, whatever the shape (not its size rule)
        gpu.MMQW_TYPES = gpu.MMQK_TYPES = gpu.SHAPE_TYPES = frozenset()
        gpu._plans.clear()  # the launch plans name the kernel

    def grouped_kernel(self, kind: str) -> None:
        """The grouped kernel of the next grouped_products launches, for every block type."""
        gpu, every = self.gpu, self.gpu._mma_types("all", frozenset())
        gpu.MMAX_TYPES = every if kind == "mmqx" else frozenset()
        gpu.MMQW_TYPES = every if kind == "mmqw" else frozenset()
        gpu.MMQK_TYPES = every if kind == "mmqk" else frozenset()
        gpu.SHAPE_TYPES = every if kind == "shape" else frozenset()
        gpu._plans.clear()

    def grouped_rate(self, t, n_in: int, n_out: int, counts, down: bool = False) -> tuple[float, bool, object]:
        """(seconds per grouped_products launch, graph used, the output's bits): one tile table over
        len(counts) distinct experts, expert g on counts[g] pairs (pair p reads activation row p,
        writes output row p); down: the experts' down product (the choice by shape reads it, and the
        mean of counts)."""
        cp, gpu = self.cp, self.gpu
        ws = [self.weight(t, n_in, n_out, 300 + i) for i in range(len(counts))]
        firsts = np.concatenate(([0], np.cumsum(counts)[:-1]))
        tiles = gpu.tile_rows(ws, firsts, counts, [0] * len(ws))
        n = int(sum(counts))
        x = gpu.quantize_act_gpu(cp.asarray(np.random.default_rng(1).standard_normal((n, n_in)).astype(np.float32)))
        out, dev_tiles = cp.empty((n, n_out), cp.float32), cp.asarray(tiles)
        sec, graphed = self.per_call([lambda: gpu.grouped_products(t.id, n_in, n_out, dev_tiles, len(tiles), x, None, None, out, down=down,
                                                                  pairs=float(np.mean(counts)))] * 4)
        return sec, graphed, out.view(cp.uint32).copy()

    def matmul_rate(self, t, n_in: int, n_out: int, n_tok: int) -> tuple[float, bool, object]:
        """(seconds per matmul of n_tok tokens, graph used, the output's bits) on one weight (a prompt chunk's
        projection: its weight stays in the L2 across the launches, as the engine meets it)."""
        w = self.weight(t, n_in, n_out, 7)
        x = self.cp.asarray(np.random.default_rng(0).standard_normal((n_tok, n_in)).astype(np.float32))
        a = self.gpu.quantize_act_gpu(x) if t.quantized else x
        out = self.cp.empty((n_tok, n_out), self.cp.float32)
        sec, graphed = self.per_call([lambda: self.gpu.matmul(w, a, out)] * 4)
        return sec, graphed, out.view(self.cp.uint32).copy()

    def gemm_rate(self, t, n_in: int, n_out: int, n_tok: int, mmt_bits) -> tuple[float, float]:
        """(seconds per gemm_products of n_tok tokens, its largest difference from the batched
        kernel's output over that output's largest value): the cuBLAS route, timed by CUDA events
        around plain launches (no graph: cuBLAS makes its own workspace on first use), the same
        weight and activations as matmul_rate's."""
        cp, gpu = self.cp, self.gpu
        w = self.weight(t, n_in, n_out, 7)
        x = cp.asarray(np.random.default_rng(0).standard_normal((n_tok, n_in)).astype(np.float32))
        a = gpu.quantize_act_gpu(x)
        out = cp.empty((n_tok, n_out), cp.float32)
        xh, wh = cp.empty(2 * n_tok * n_in, cp.uint16), cp.empty(gpu.GEMM_SLAB_BYTES // 2, cp.uint16)
        sec = min(self.elapsed(lambda: gpu.gemm_products(w, a, out, xh, wh), 8) for _ in range(3))
        ref = mmt_bits.view(cp.float32)
        return sec, float(cp.abs(out - ref).max() / cp.abs(ref).max())

    def few_rows(self, few: bool) -> None:
        """The kernel of the next few-row products: mvf up to 8 rows, or none (mmq for every block type)."""
        self.kernels(True)
        self.gpu.MVF_TOKENS = 8 if few else 0

    def float_weight(self, t, n_in: int, n_out: int, seed: int):
        """A GpuWeight of finite random values (the bit comparison of two kernels means something)."""
        v = (np.random.default_rng(seed).standard_normal(n_in * n_out) * 0.05).astype(np.float32)
        vals = v if t.name == "F32" else v.astype(np.float16).view(np.uint16) if t.name == "F16" else (v.view(np.uint32) >> 16).astype(np.uint16)
        return self.gpu.GpuWeight(t.id, n_in, n_out, values=self.cp.asarray(vals))

    def fmm_rows(self) -> tuple[list, bool]:
        """Rows of the --fmm table: each FMM_SHAPES product at each FMM_TOKENS, old against new."""
        from strata.index_format.ggml_types import ggml_type

        cp, gpu = self.cp, self.gpu
        rows, graphed_all, before = [], True, gpu.FMM
        try:
            for label, (tname, n_in, n_out) in FMM_SHAPES.items():
                t = ggml_type(tname)
                w = self.float_weight(t, n_in, n_out, 11)
                for n_tok in FMM_TOKENS:
                    x = cp.asarray(np.random.default_rng(n_tok).standard_normal((n_tok, n_in)).astype(np.float32))
                    got = {}
                    for kind in ("8x8", "tiles"):
                        gpu.use_fmm(kind)
                        out = cp.empty((n_tok, n_out), cp.float32)
                        sec, graphed = self.per_call([lambda: gpu.matmul(w, x, out)] * 4)
                        graphed_all &= graphed
                        got[kind] = (sec, out.view(cp.uint32).copy())
                    mod, name, grid, block, _, extra = gpu._float_plan(t.id, n_in, n_out, n_tok)
                    (old, y_old), (new, y_new) = got["8x8"], got["tiles"]
                    same = bool(cp.all(y_old == y_new))
                    rows.append([label, f"{tname} {n_out}x{n_in}", n_tok, f"{old * 1e6:.1f}", f"{new * 1e6:.1f}",
                                 f"{old / new:.2f}x", "yes" if same else "NO", f"{name} grid {grid}x{block}"])
                    print(" | ".join(str(c) for c in rows[-1]), flush=True)
        finally:
            gpu.use_fmm(before)
        return rows, graphed_all


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--types", default="all", help="comma-separated GGML type names, or 'all'")
    ap.add_argument("--md", help="also write the table (markdown) and the summary to this file")
    ap.add_argument("--matmul", action="store_true", help=f"also time a {MATMUL_TOKENS}-token matmul of {MATMUL[1]} x {MATMUL[0]} per type, on mm, mmq and mmt")
    ap.add_argument("--matmul-shape", metavar="OUTxIN", help="--matmul's weight: rows x row length (a multiple of 32; "
                    "types of longer blocks get no figure), "
                    f"instead of {MATMUL[1]}x{MATMUL[0]}")
    ap.add_argument("--matmul-tokens", type=int, default=MATMUL_TOKENS, help="--matmul's tokens (a prompt chunk's rows)")
    ap.add_argument("--gemm", action="store_true", help="with --matmul: also time the cuBLAS route (gpu.gemm_products: f16 pairs, "
                    "two GEMMs) and give its largest difference from the batched kernels' output")
    ap.add_argument("--grouped", action="store_true", help=f"also time one grouped-experts launch ({GROUPED_EXPERTS} experts at {GROUPED_PAIRS} pairs each) per type, on each grouped kernel")
    ap.add_argument("--grouped-kernels", default=",".join(GROUPED_KERNELS), help="the grouped kernels --grouped times (the first is the baseline)")
    ap.add_argument("--few", action="store_true", help=f"also time {', '.join(map(str, FEW_TOKENS))}-token products of "
                    f"{FEW[1]} x {FEW[0]} per block type, on mvf and on mmq")
    ap.add_argument("--no-matvec", action="store_true", help="leave out the head and expert matvecs")
    ap.add_argument("--fmm", action="store_true", help="time the batched float product, the kernel before against the tiled one, instead")
    args = ap.parse_args(argv)
    matmul = MATMUL  # (n_in, n_out); --matmul-shape's instead
    if args.matmul_shape:
        try:
            n_out, n_in = (int(v) for v in args.matmul_shape.lower().split("x"))
        except ValueError:
            ap.error(f"--matmul-shape {args.matmul_shape!r}: expected OUTxIN, two positive integers (e.g. 10240x320)")
        if n_out <= 0 or n_in <= 0 or n_in % 32:
            ap.error(f"--matmul-shape {args.matmul_shape!r}: the row length {n_in} must be a positive multiple of 32 (a block)")
        matmul = (n_in, n_out)

    from tabulate import tabulate

    from strata.engine.kernels import gpu
    from strata.index_format.ggml_types import TYPES, ggml_type

    ok, why = gpu.available()
    if not ok:
        print(f"kernels_gpu: not run: {why}", file=sys.stderr)
        return 2
    names = [t.name for t in TYPES] if args.types == "all" else [ggml_type(n.strip(), where="--types").name for n in args.types.split(",")]
    t0 = time.perf_counter()
    b = Bench()
    bw, copy_bw = b.read_bandwidth(), b.copy_bandwidth()
    head_line = f"{b.name}, {b.n_sm} SMs, L2 {b.l2 >> 20} MiB: streaming read {bw / 1e9:.0f} GB/s (read kernel, 4 GiB); d2d copy {copy_bw / 1e9:.0f} GB/s (read + write bytes)"
    print(head_line, flush=True)
    if args.fmm:
        return _fmm_table(b, head_line, args.md, t0)

    rows, misses, different, graphed_all = [], [], [], True
    kinds = [k.strip() for k in args.grouped_kernels.split(",")]
    if any(k not in GROUPED_KERNELS for k in kinds):
        ap.error(f"--grouped-kernels: {args.grouped_kernels}; choose from {','.join(GROUPED_KERNELS)}")
    pair_counts = [np.random.default_rng(0).integers(lo, hi + 1, GROUPED_EXPERTS) for lo, hi in GROUPED_PAIRS]
    for name in names:
        t = ggml_type(name)
        row = [name]
        if not args.no_matvec:
            sec, nbytes, graphed = b.matvec_rate(t, *HEAD)
            graphed_all &= graphed
            ratio = nbytes / sec / bw
            row += [f"{nbytes / 2**20:.0f}", f"{sec * 1e6:.0f}", f"{nbytes / sec / 1e9:.0f}", f"{100 * ratio:.0f}%"]
            if ratio < TARGET:
                misses.append(f"{name} {100 * ratio:.0f}%")
            for n_in, n_out in EXPERTS.values():
                if n_in % t.block_size:
                    row += ["-", "-"]
                    continue
                esec, ebytes, graphed = b.matvec_rate(t, n_in, n_out)
                graphed_all &= graphed
                row += [f"{esec * 1e6:.1f}", f"{100 * ebytes / esec / bw:.0f}%"]
        n_tok = args.matmul_tokens
        if args.matmul and matmul[0] % t.block_size:
            row += ["-"] * (10 if args.gemm else 7)
        elif args.matmul:
            both, bits = [], []
            for mma, tiled in ((False, False), (True, False), (True, True)) if t.quantized else ((False, False),):
                b.kernels(mma, tiled)
                msec, graphed, out = b.matmul_rate(t, *matmul, n_tok)
                graphed_all &= graphed
                both.append(msec)
                bits.append(out)
            row += [f"{both[0] * 1e6:.0f}", f"{n_tok / both[0]:.0f}"]
            if t.quantized:
                same = all(bool(b.cp.array_equal(bits[0], o)) for o in bits[1:])
                if not same:
                    different.append(f"{name} dense {matmul[1]}x{matmul[0]}")
                row += [f"{both[1] * 1e6:.0f}", f"{both[1] / both[0]:.2f}", f"{both[2] * 1e6:.0f}", f"{both[2] / both[0]:.2f}",
                        "yes" if same else "NO"]
                if args.gemm:
                    gsec, gerr = b.gemm_rate(t, *matmul, n_tok, bits[2])
                    row += [f"{gsec * 1e6:.0f}", f"{gsec / min(both[1:]):.2f}", f"{gerr:.1e}"]
            else:
                row += ["-"] * (8 if args.gemm else 5)
        if args.grouped:
            for counts in pair_counts:
                for shape, (n_in, n_out) in EXPERTS.items():
                    n_in = -(-n_in // t.block_size) * t.block_size
                    if not t.quantized:
                        row += ["-"] * (2 * len(kinds))
                        continue
                    secs, bits = [], []
                    for kind in kinds:
                        b.grouped_kernel(kind)
                        gsec, graphed, out = b.grouped_rate(t, n_in, n_out, counts, down=shape == "down")
                        graphed_all &= graphed
                        secs.append(gsec)
                        bits.append(out)
                    same = all(bool(b.cp.array_equal(bits[0], o)) for o in bits[1:])
                    if not same:
                        different.append(f"{name} {n_out}x{n_in} at {counts.min()}-{counts.max()} pairs")
                    row += [f"{secs[0] * 1e6:.0f}"] + [f"{s_ * 1e6:.0f}" for s_ in secs[1:]]
                    row += [f"{s_ / secs[0]:.2f}" for s_ in secs[1:]] + ["yes" if same else "NO"]
        if args.few:
            for n_tok in FEW_TOKENS:
                if not t.quantized or FEW[0] % t.block_size:
                    row += ["-", "-"]
                    continue
                both = []
                for few in (True, False):
                    b.few_rows(few)
                    fsec, graphed, _ = b.matmul_rate(t, *FEW, n_tok)
                    graphed_all &= graphed
                    both.append(fsec)
                row += [f"{both[0] * 1e6:.1f}", f"{both[1] * 1e6:.1f}"]
        rows.append(row)
        print(" | ".join(row), flush=True)
        b.cp.get_default_memory_pool().free_all_blocks()

    headers = ["type"]
    if not args.no_matvec:
        headers += ["head MiB", "head us", "head GB/s", "head % read", "gate/up us", "% read", "down us", "% read"]
    if args.matmul:
        headers += [f"mm {args.matmul_tokens}x{matmul[1]}x{matmul[0]} us", "tok/s", "mmq us", "mmq/mm", "mmt us", "mmt/mm", "same bits"]
        if args.gemm:
            headers += ["gemm us", "gemm / best of mmq, mmt", "gemm max |diff| / max |mmt|"]
    if args.grouped:
        for lo, hi in GROUPED_PAIRS:
            for what, (n_in, n_out) in EXPERTS.items():
                headers += [f"{kinds[0]} {what} {n_out}x{n_in} {lo}-{hi} pairs us"] + [f"{k} us" for k in kinds[1:]]
                headers += [f"{k}/{kinds[0]}" for k in kinds[1:]] + ["same bits"]
    if args.few:
        for n_tok in FEW_TOKENS:
            headers += [f"mvf {n_tok}x{FEW[1]}x{FEW[0]} us", "mmq us"]
    table = tabulate(rows, headers=headers)
    summary = ("summary: the batched kernels alone (--no-matvec)" if args.no_matvec else (
        f"summary: head {HEAD[1]}x{HEAD[0]} matvec: {len(rows) - len(misses)}/{len(rows)} types >= {TARGET:.0%} of the "
        f"{bw / 1e9:.0f} GB/s streaming read" + (f"; below: {', '.join(misses)}" if misses else "")))
    if different:
        summary += f"; the kernels gave DIFFERENT BITS: {', '.join(different)}"
    summary += (
        ("" if graphed_all else " (times include Python launch overhead: no CUDA graph capture)")
        + f" [{time.perf_counter() - t0:.0f} s]"
    )  # fmt: skip
    print()
    print(table)
    print(summary)
    if args.md:
        with open(args.md, "w") as f:
            f.write(f"{head_line}\n\n{tabulate(rows, headers=headers, tablefmt='github')}\n\n{summary}\n")
    return 1 if different else 0


def _fmm_table(b: Bench, head_line: str, md: str | None, t0: float) -> int:
    from tabulate import tabulate

    rows, graphed = b.fmm_rows()
    headers = ["product", "weight", "tokens", "8x8 us", "tiles us", "speed-up", "same bits", "tiles plan"]
    bad = [f"{r[0]} T={r[2]}" for r in rows if r[6] != "yes"]
    summary = (
        f"summary: the tiled float product {min(float(r[5][:-1]) for r in rows):.2f}x .. "
        f"{max(float(r[5][:-1]) for r in rows):.2f}x the 8x8 kernel's speed; "
        + (f"DIFFERENT BITS: {', '.join(bad)}" if bad else "the same bits in every case")
        + ("" if graphed else " (times include Python launch overhead: no CUDA graph capture)")
        + f" [{time.perf_counter() - t0:.0f} s]"
    )  # fmt: skip
    print()
    print(tabulate(rows, headers=headers))
    print(summary)
    if md:
        with open(md, "w") as f:
            f.write(f"{head_line}\n\n{tabulate(rows, headers=headers, tablefmt='github')}\n\n{summary}\n")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

"""CuPy GPU kernels: W x on device-resident ENGINE FORM planes, bit-identical to the CPU (S3, S10).

A GPU hit and a CPU miss of the same expert must give the same bits (B2), so the kernels in
gpu_kernels.cu do exactly the arithmetic of reference.dot_reference (docs/kernels.md): per act-block
an exact integer sum and one f32 expression, lane l of a warp adding act-blocks l, l + 32, ... in
order, then the fixed fold of the 32 lanes. ActQ is computed on the device to the bit of
actq.quantize_act.

    w = upload(raw, type_id, n_in, n_out)      # pack bytes -> engine form on the device, once
    a = quantize_act_gpu(x_dev)                # f32 [T, n_in] or [n_in] on the device -> GpuActQ
    y = matmul(w, a)                           # f32 [T, n_out] on the device (matvec: [n_out])

F32/F16/BF16 weights take the f32 activations themselves (no ActQ), as on the CPU. The types of
actq.WIDE take the wide form (quantize_act16_gpu -> GpuActQ16): one token through the matvec
kernel that reads both planes (mv<T, KPL, 1>), more as 2T tokens of one launch, then the
combine16 kernel, as cpu.py does it.

Device work goes through a small runtime object (CuPy by default); `use_runtime` swaps it, which
the tests do to run this module and the CUDA source on the host (tests/gpu_emu.py).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from strata.index_format.ggml_types import TYPES, GGMLType, ggml_type

from . import iq_tables as T
from .actq import QA, ActQ, ActQ16, NonFiniteActivation, is_wide
from .engine_form import align, narrow, planes, widen

SOURCE = Path(__file__).with_name("gpu_kernels.cu")
# --fmad=false: no FMA contraction (a fused a*b+c rounds differently). The kernels' f32 operations
# are inline PTX anyway, which no flag changes: CuPy appends -ftz=true to every compile.
OPTIONS = ("--std=c++17", "--fmad=false")
for _knob in ("STRATA_MV_STEP", "STRATA_MQ_WARPS", "STRATA_MQ_MINB", "STRATA_MQW_WARPS", "STRATA_MQW_UNROLL", "STRATA_MQK_NT", "STRATA_MQK_MINB",
              "STRATA_MT_WR", "STRATA_MT_WC", "STRATA_MT_KS", "STRATA_MT_MINB"):  # a benchmark's knobs (gpu_kernels.cu):
    if os.environ.get(_knob):  # the matvec's staged bytes per warp step; mmq's warps and blocks per multiprocessor;
        # mmqw's warps and decode entries in flight; mmqk's n-tiles over one decode and blocks per multiprocessor;
        # mmt's warps along the rows and along the tokens, entries a step and blocks per multiprocessor
        OPTIONS += (f"-D{_knob}={int(os.environ[_knob])}",)
KPLS = (1, 2, 3, 4, 6, 8)  # act-blocks per lane the matvec kernel holds: rows up to 8192 elements
MAX_TOKENS = 64  # tokens per matmul pass (shared-memory accumulators); more are done in groups
# Tokens one mmq launch of matmul may take (STRATA_MMQ_LAUNCH_TOKENS; mm keeps MAX_TOKENS a launch):
# mmq holds nothing per token across its items (a block's item is 16 rows x 8 warps tokens, grid-stride
# over all of them), so one launch covers every 64-token tile of a dense product with each tile's
# arithmetic as its own launch would do it: the same bits, a launch a product where a 4096-token prompt
# made 64 (1600 launches of the seed-4l prompt's dense products). <= MAX_TOKENS: a launch a 64 as before.
MMQ_LAUNCH_TOKENS = int(os.environ.get("STRATA_MMQ_LAUNCH_TOKENS", "4096"))
if MMQ_LAUNCH_TOKENS < 1:
    raise ValueError(f"STRATA_MMQ_LAUNCH_TOKENS={MMQ_LAUNCH_TOKENS}: expected >= 1")
# The most activation rows a product gives the few-row kernel (mvf, gpu_kernels.cu: at most its
# MVF_TOKENS, 8) in place of the batched one; a single row always takes it when mv cannot hold the
# row (the H200: mmq's one-token tile ran 107 us for qwen4exp's 320 x 10240 hyper-connection down).
# 8: a speculative verify's 2-4 rows took mmq, whose 16 x 8-token tile left them ~30 us a product on
# an H100 (2026-12-05, the demo qwen35moe: a captured verify of 1 + 2 rows 1.57 ms of device time
# with mmq, 0.86 with mvf, the token step 0.62; benchmarks/verify_profile.py). Its rows have the
# token step's bits (tests/gpu/test_device_spec.py). STRATA_MVF_TOKENS=1: only a row mv cannot hold;
# 0: never, the batched kernel as before. A verify's LM head alone back on mmq (its 3 rows of a
# Q6_K 248320 x 2560) was timed and removed: seed-4l qwen35moe's verify graph of 1 + 2 rows 1.56 ms
# with it, 1.05 without, an H200, 2026-12-06.
MVF_TOKENS = int(os.environ.get("STRATA_MVF_TOKENS", "8"))
if not 0 <= MVF_TOKENS <= 8:
    raise ValueError(f"STRATA_MVF_TOKENS={MVF_TOKENS}: expected 0 to 8 (the few-row kernel's registers)")
# The most activation rows the one-row kernel takes at once (mv<T, KPL, WIDE, NT>, gpu_kernels.cu:
# its weight rows staged and decoded once for all NT rows, each row's activation in registers), for
# a product of few weight rows: those mvf would give a warp one row (_mvf_rows; their warps too few
# to fill the card with more), and while planes x NT x KPL <= MVT_ACT (the registers of 16
# act-blocks a lane, what the wide form's mv<T, 8, 1> holds, and 2 more: seed-4l's wide 3-row
# products, 2 planes x 3 rows x 3 act-blocks); else mvf. On an H100 (benchmarks/mvf_rows.py,
# 2026-12-06), us for 3 rows of 1024 x 2560, against mvf (the one-row mv 3.2-3.3):
#   Q6_K 4.4 (mvf 5.6), Q8_0 3.4 (5.0), Q8_0's wide form 3.8 (8.6: both planes as 6 rows)
# and on many rows slower (12288 x 2560: Q6_K 33.8 against 18.1; a Q6_K head 331 against 260: 156
# registers a thread, the occupancy lost). The same bits as mv's and mvf's. But a whole captured
# verify was not faster for it: seed-4l qwen35moe, an H100, one call (2026-12-06 19:59 UTC,
# benchmarks/verify_profile.py), graph ms with STRATA_MVT_TOKENS=4 against =1: token step 0.757 /
# 0.754, verify 1+1 0.973 / 0.949, verify 1+2 1.111 / 1.087 (and 1.108 / 1.096 on two other H100s
# the same day). So the default is 1 (never: mvf, as before it); 2 to MVT_MOST takes the NT rows
# (and the tier's startup then compiles their modules, gpu.ROWS, with --spec).
MVT_TOKENS = int(os.environ.get("STRATA_MVT_TOKENS", "1"))
MVT_MOST, MVT_ACT = 4, 18
if not 1 <= MVT_TOKENS <= MVT_MOST:
    raise ValueError(f"STRATA_MVT_TOKENS={MVT_TOKENS}: expected 1 to {MVT_MOST} (the one-row kernel's registers)")
# Weight rows an mvf warp takes at once (mvf<T, R>, gpu_kernels.cu): the most that still leaves
# MVF_TASKS_PER_SM warps' worth of rows a multiprocessor, at most MVF_ROWS_MOST of the type (_mvf_rows).
# On an H200 (benchmarks/mvf_rows.py, 2026-12-06), 3-row products, us against the 1-row mv's:
#   Q6_K 248320 x 2560 (a head)  R = 1 380, 2 275, 3 247, 4 237 (mv 176)
#   Q6_K  12288 x 2560           R = 1 25.2, 2 18.5, 3 16.8, 4 19.0 (mv 15.0)
#   Q6_K   1024 x 2560           R = 1 5.4, 2 6.1, 3 6.7, 4 8.3 (mv 3.1)
#   Q8_0 248320 x 2560           R = 1 207, 2 182, 3 212, 4 199 (mv 170)
# (Q4_K as Q6_K.) So a warp's share is about 24 tasks a multiprocessor at the best R, and Q8_0, whose
# blocks decode cheaply, gains from 2 rows only. STRATA_MVF_ROWS=N takes N rows always (the benchmark's).
MVF_ROWS_ALL = (1, 2, 3, 4)
MVF_TASKS_PER_SM = 24
MVF_ROWS_MOST = {"Q8_0": 2}  # else 4
MVF_ROWS = int(os.environ.get("STRATA_MVF_ROWS", "0"))
if MVF_ROWS and MVF_ROWS not in MVF_ROWS_ALL:
    raise ValueError(f"STRATA_MVF_ROWS={MVF_ROWS}: expected one of {MVF_ROWS_ALL} (unset: chosen by the shape)")
SMEM_LIMIT = 48 * 1024  # dynamic shared memory a block may take without an opt-in
SHARED_TABLE_ROWS = 64  # rows per thread block from which an IQ grid is copied to shared memory
NO_BAD = np.uint64(0xFFFFFFFFFFFFFFFF)
_FLOAT_KIND = {"F32": 0, "F16": 1, "BF16": 2}


def _mma_types(spec: str | None, default: frozenset[str], var: str = "STRATA_MMA") -> frozenset[str]:
    """Block types from a setting: unset -> `default`, "0" or "none" -> none, "all" -> every block
    type, else type names "Q4_K,Q6_K"."""
    if spec is None or spec == "":
        return default
    if spec.strip().lower() in ("0", "none"):
        return frozenset()
    if spec.strip().lower() == "all":
        return frozenset(t.name for t in TYPES if t.quantized)
    return frozenset(ggml_type(n.strip(), where=var).name for n in spec.split(","))


# The block types whose batched products take the int8 tensor-core kernels (mm's bits): MMA_TYPES
# for a chunk's dense products (matmul: mmq, else mm), MMAX_TYPES for its grouped experts
# (grouped_products: mmqx, else mmx). Measured on the H200 (2026-12-02, benchmarks/kernels_gpu.py
# and the seed-4l prompt by kernel): mmq took 0.37-0.53x mm's time on every type tried (Q4_K,
# Q6_K, Q8_0, Q2_0, IQ3_XXS; the prompt's dense products 14.5 -> 8.2 ms), so every type; mmqx beat
# mmx only on Q8_0 (4.9 against 6.2 ms a prompt) and lost on the others (Q4_K 9.5 against 3.8 ms,
# IQ3_XXS 8.6 against 3.5: a grouped tile of 5-20 pairs leaves most of a block's warps idle after the
# decode), so Q8_0 alone. STRATA_MMA / STRATA_MMAX choose per process (a test or benchmark may set
# them, then drop `_plans`).
# (STRATA_GROUPED: "shape", the default, or "types": see MMQK_TYPES below.)
GROUPED = os.environ.get("STRATA_GROUPED", "shape") or "shape"
if GROUPED not in ("shape", "types"):
    raise ValueError(f"STRATA_GROUPED={GROUPED!r}: expected shape or types")
_EVERY = frozenset(t.name for t in TYPES if t.quantized)
MMA_TYPES = _mma_types(os.environ.get("STRATA_MMA"), _EVERY)
MMAX_TYPES = _mma_types(os.environ.get("STRATA_MMAX"), frozenset() if GROUPED == "shape" else frozenset({"Q8_0"}), "STRATA_MMAX")
# The block types whose grouped products take mmqw (the tensor cores with every warp on its own 16
# rows: gpu_kernels.cu says why), ahead of MMAX_TYPES: none unless STRATA_MMQW names them (the same
# forms as STRATA_MMAX); the choice by shape takes it for every down product.
MMQW_TYPES = _mma_types(os.environ.get("STRATA_MMQW"), frozenset(), "STRATA_MMQW")
# ... and mmqk (the chunk's act-blocks split between a block's four warps), ahead of both. Timed on
# the H200 (2026-12-02, benchmarks/kernels_gpu.py --grouped, 128 experts at 5-20 pairs; mmqk / mmx):
# gate/up 0.43 (Q8_0), 0.91 (Q6_K), 0.81 (Q2_0), 0.90 (IQ3_XXS), 1.06 (Q4_K); down 0.34-0.73 on all
# five (mmqw best there). At 64-96 pairs (a 4096-token prompt) mmqx is faster still on gate/up
# (0.28-0.82 against mmqk's 0.35-1.00). STRATA_MMQK (the same forms as STRATA_MMAX).
#
# The default is the choice by shape (STRATA_GROUPED=shape, `grouped_kernel`): a down product (its
# input the experts' intermediate) takes mmqw, a gate/up product mmqk where the chunk has fewer than
# GROUPED_MMQX_PAIRS pairs an expert on average, else mmqx. A type named by an explicit STRATA_MMQK /
# STRATA_MMQW / STRATA_MMAX still takes that family whatever the shape (in that order);
# STRATA_GROUPED=types is the choice by type alone as before it (MMQK_TYPES every type unless
# STRATA_MMQK says otherwise, MMAX_TYPES Q8_0). Every one of these kernels gives mm's bits (the
# same terms in the same order, folded in the same tree: tests/gpu/test_device_prompt.py), so the
# choice moves time only.
MMQK_TYPES = _mma_types(os.environ.get("STRATA_MMQK"), frozenset() if GROUPED == "shape" else _EVERY, "STRATA_MMQK")
# The block types whose grouped kernel is chosen by shape (after the explicit sets above).
SHAPE_TYPES = _EVERY if GROUPED == "shape" else frozenset()
# Mean pairs an expert from which a gate/up product takes mmqx in place of mmqk (STRATA_GROUPED=shape).
GROUPED_MMQX_PAIRS = float(os.environ.get("STRATA_GROUPED_MMQX_PAIRS", "40"))
# Warps of an mmqx block (at most the compiled STRATA_MQ_WARPS): a grouped tile has 5-20 pairs where
# a prompt's dense product has 64 a launch, so the card may prefer fewer (a benchmark's knob).
MMQX_WARPS = int(os.environ.get("STRATA_MQX_WARPS", "4"))
# The block types whose chunk products (gpu.matmul) take mmt, the tiled form, in place of mmq (both
# mm's bits: gpu_kernels.cu says how and why). STRATA_MMT (the same forms as STRATA_MMAX); mmt's block
# tile is MT_ROWS = 32 MT_WR rows x MT_TOKS = 16 MT_WC tokens (STRATA_MT_WR / STRATA_MT_WC, compiled in).
MMT_TYPES = _mma_types(os.environ.get("STRATA_MMT"), _EVERY, "STRATA_MMT")
# mmt takes a product only where it has at least MMT_MIN_TILES block tiles a multiprocessor
# (STRATA_MMT_MIN_TILES), else mmq: at 241 registers a thread two of its blocks fit a multiprocessor,
# and each stages its entries and then computes (no double buffer), so a grid of few tiles leaves the
# card waiting on loads. The H200, 2026-12-03, qwen4exp's 256-token prompt by kernel, mmq -> mmt:
# Q5_0 10240 rows (1280 tiles) 3.65 -> 3.30 ms, Q4_0 (768 tiles) 0.99 -> 0.87, IQ4_NL 2.45 -> 2.43,
# IQ4_XS 0.58 -> 0.92, Q8_0 x20 (the hyper-connections' few rows) 2.58 -> 4.51; a 256 x 8192 x 2560
# product alone (kernels_gpu.py --matmul) 0.87-0.90x mmq's time.
MMT_MIN_TILES = float(os.environ.get("STRATA_MMT_MIN_TILES", "4"))
# ... and only for rows of at least MMT_MIN_BLOCKS act-blocks (STRATA_MMT_MIN_BLOCKS): a tile walks the
# 32 leaves of fold's tree whatever the row's length (staging, barriers, the stack), so a row of 10
# act-blocks pays for 32. The H200, 2026-12-03, qwen4exp's 256-token prompt under the tile rule alone:
# its nine Q8_0 products of 320-long rows (the hyper-connections' up, 10240 rows) took 1.76 ms on mmt
# where mmq had taken ~1.27; alone (kernels_gpu.py --matmul-shape 10240x320) mmq 86 us, mmt 137.
MMT_MIN_BLOCKS = int(os.environ.get("STRATA_MMT_MIN_BLOCKS", "32"))
MT_WR, MT_WC = int(os.environ.get("STRATA_MT_WR", "2")), int(os.environ.get("STRATA_MT_WC", "2"))
MT_ROWS, MT_TOKS = 32 * MT_WR, 16 * MT_WC
_HAS_MIN = {"Q4_1", "Q5_1", "Q2_K", "Q4_K", "Q5_K"}  # docs/kernels.md: the types with a min term


class GpuUnavailable(RuntimeError):
    """No usable CUDA device or no CuPy: the engine runs on the CPU instead (B5)."""


def available() -> tuple[bool, str]:
    """(True, device name) when CuPy imports and sees a CUDA device, else (False, why not)."""
    try:
        import cupy
    except Exception as e:  # ImportError, or a CUDA library that fails to load
        return False, f"CuPy is not importable ({type(e).__name__}: {e})"
    try:
        n = cupy.cuda.runtime.getDeviceCount()
        if n == 0:
            return False, "CuPy sees no CUDA device"
        name = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)["name"]
    except Exception as e:
        return False, f"no usable CUDA device ({type(e).__name__}: {e})"
    return True, name.decode() if isinstance(name, bytes) else str(name)


# ---------------------------------------------------------------------------------------------
# runtimes: where arrays live and how kernels are compiled and launched


# cuBLAS's enumerations (cublas_api.h, library_types.h), for GemmEx through CuPy's binding
_CUDA_R_16F, _CUDA_R_32F, _CUBLAS_COMPUTE_32F, _CUBLAS_GEMM_DEFAULT = 2, 0, 68, -1


class CupyRuntime:
    """Arrays are CuPy arrays on the current device; kernels run on the current stream."""

    def __init__(self) -> None:
        ok, why = available()
        if not ok:
            raise GpuUnavailable(why)
        import cupy

        self.cp = self.xp = cupy  # xp: the array module of this runtime's arrays (the device step computes with it)
        self.n_sm = cupy.cuda.Device().attributes["MultiProcessorCount"]
        self._functions: dict[tuple[Any, str], Any] = {}  # (module, kernel): the module object itself, so no id is reused
        self._cublas, self._ab = None, {}  # gemm_f16's binding and its (alpha, beta) host arrays
        self.registered: list[tuple[int, int]] = []  # register_host's [start, end) host ranges, until unregistered

    def to_device(self, a: np.ndarray):
        return self.cp.asarray(np.ascontiguousarray(a))

    def empty(self, shape, dtype):
        return self.cp.empty(shape, dtype)

    def to_host(self, a) -> np.ndarray:
        return self.cp.asnumpy(a)

    def is_array(self, a) -> bool:
        return isinstance(a, self.cp.ndarray)

    def ptr(self, a) -> int:
        return a.data.ptr

    def compile(self, names: list[str], source: Path = SOURCE):
        mod = self.cp.RawModule(code=source.read_text(), options=OPTIONS, name_expressions=names)
        mod.compile()
        return mod

    def launch(self, mod, name: str, grid: int, block: int, args: tuple, smem: int = 0) -> None:
        # the function objects are kept: RawModule.get_function costs microseconds a call, and the
        # GPU tier's token path launches a few hundred kernels a token
        fn = self._functions.get((mod, name))
        if fn is None:
            fn = self._functions[(mod, name)] = mod.get_function(name)
        fn((grid,), (block,), args, shared_mem=smem)

    def set_global(self, mod, name: str, host: np.ndarray) -> None:
        dev = self.cp.ndarray(host.shape, host.dtype, memptr=mod.get_global(name))
        dev.set(np.ascontiguousarray(host))

    def capturing(self) -> bool:
        """Whether the current stream is being captured into a graph (Stream.is_capturing, or the
        runtime's cudaStreamIsCapturing where a CuPy's Stream has no such method)."""
        stream = self.cp.cuda.get_current_stream()
        method = getattr(stream, "is_capturing", None)
        if method is not None:
            return bool(method())
        return self.cp.cuda.runtime.streamIsCapturing(stream.ptr) != 0

    def cublas_held(self) -> bool:
        """Whether gemm_f16 ran in this process: cuBLAS's handle, workspace and first kernels are
        allocated already (they stay until the process ends)."""
        return self._cublas is not None

    def gemm_f16(self, x, w, out, alpha: float, beta: float) -> None:
        """out f32 [T, R] = alpha x w^T + beta out for x f16 [T, K] and w f16 [R, K], each with its
        rows of K contiguous (any row stride: a column slab of a wider output, half of a wider row):
        cuBLAS's GemmEx with f32 accumulation (CUBLAS_COMPUTE_32F), on the current stream."""
        if self._cublas is None:  # (a few microseconds a call saved: a prompt makes hundreds)
            from cupy_backends.cuda.libs import cublas

            self._cublas = cublas
        cublas = self._cublas
        handle = self.cp.cuda.device.get_cublas_handle()
        cublas.setStream(handle, self.cp.cuda.get_current_stream().ptr)
        cublas.setPointerMode(handle, 0)  # CUBLAS_POINTER_MODE_HOST: alpha and beta read from host memory
        T, K = x.shape
        R = w.shape[0]
        ab = self._ab.get((alpha, beta))
        if ab is None:  # kept: the host memory cuBLAS reads alpha and beta from (also in a captured graph)
            ab = self._ab[(alpha, beta)] = np.array([alpha, beta], np.float32)
        # column-major: out^T [R, T] = op(w) [R, K] x [K, T]; w's and x's rows are columns of K
        cublas.gemmEx(handle, 1, 0, R, T, K, ab.ctypes.data, w.data.ptr, _CUDA_R_16F, w.strides[0] // 2,
                      x.data.ptr, _CUDA_R_16F, x.strides[0] // 2, ab.ctypes.data + 4, out.data.ptr, _CUDA_R_32F,
                      out.strides[0] // 4, _CUBLAS_COMPUTE_32F, _CUBLAS_GEMM_DEFAULT)

    # --- what the GPU tier needs beyond the kernels (engine/tier/) ---

    def copy_in(self, dev, host: np.ndarray) -> None:
        """host -> a device array of the same shape and dtype, ordered on the current stream."""
        dev.set(host, stream=self.cp.cuda.get_current_stream())

    def copy_out_async(self, host: np.ndarray, dev) -> None:
        """device -> pinned host bytes, queued on the current stream (capturable: a CUDA graph
        replays it); wait for it with an event recorded after it."""
        self.cp.cuda.runtime.memcpyAsync(host.ctypes.data, dev.data.ptr, dev.nbytes, 2, self.cp.cuda.get_current_stream().ptr)

    def copy_in_async(self, dev, host: np.ndarray, stream=None) -> None:
        """pinned host bytes -> device, queued on `stream` (default: the current stream; capturable:
        a replay reads the host bytes as they are when it runs)."""
        stream = stream or self.cp.cuda.get_current_stream()
        self.cp.cuda.runtime.memcpyAsync(dev.data.ptr, host.ctypes.data, dev.nbytes, 1, stream.ptr)

    def register_host(self, ptr: int, nbytes: int) -> None:
        """Page-lock host pages [ptr, ptr + nbytes) (page-aligned) for DMA, read-only: a read-only
        file mapping (the GGUF's) is refused without the flag. Raises what the driver refuses."""
        rt = self.cp.cuda.runtime
        rt.hostRegister(ptr, nbytes, getattr(rt, "cudaHostRegisterReadOnly", 8))
        self.registered.append((ptr, ptr + nbytes))

    def unregister_host(self, ptr: int) -> None:
        self.cp.cuda.runtime.hostUnregister(ptr)
        self.registered[:] = [r for r in self.registered if r[0] != ptr]

    # --- a second stream for copies that overlap the current stream's kernels (the prompt's streamed
    # experts, engine/tier/staging.py), ordered against it by markers (events without timing)

    def copy_stream(self):
        return self.cp.cuda.Stream(non_blocking=True)

    def marker(self):
        return self.cp.cuda.Event(block=False, disable_timing=True)

    def mark_on(self, marker, stream=None) -> None:
        """`marker` is reached once everything queued so far on `stream` (default: current) ran."""
        marker.record(stream or self.cp.cuda.get_current_stream())

    def stream_wait(self, stream, marker) -> None:
        """Work queued later on `stream` (default: current) starts after `marker` is reached."""
        (stream or self.cp.cuda.get_current_stream()).wait_event(marker)

    def host_wait(self, marker) -> None:
        marker.synchronize()

    def on(self, stream):
        """`with rt.on(stream):` this thread's launches and copies queue on `stream` (CuPy's current
        stream is per thread: a worker thread's work goes there, the main thread's does not move)."""
        return stream

    def copy_out(self, host: np.ndarray, dev) -> None:
        """device -> host, and wait for it (so for everything queued before it on the stream)."""
        stream = self.cp.cuda.get_current_stream()
        dev.get(out=host, stream=stream)
        stream.synchronize()

    def view(self, arena, offset: int, shape, dtype):
        """A typed device array over arena bytes [offset, offset + nbytes) (no allocation)."""
        return arena[offset : offset + int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize].view(dtype).reshape(shape)

    def pinned(self, nbytes: int) -> np.ndarray:
        """Page-locked host bytes (the D2H copies of the token path land here without staging)."""
        mem = self.cp.cuda.alloc_pinned_memory(max(nbytes, 1))
        return np.frombuffer(mem, np.uint8, nbytes)

    def mem_info(self) -> tuple[int, int]:
        """(free, total) bytes of the device, as cudaMemGetInfo reports them."""
        return self.cp.cuda.runtime.memGetInfo()

    def synchronize(self) -> None:
        self.cp.cuda.get_current_stream().synchronize()

    def events(self, n: int) -> list:
        """CUDA events (made once: the token path times the hits with them, allocating nothing)."""
        return [self.cp.cuda.Event() for _ in range(n)]

    def elapsed(self, start, stop) -> float:
        """Seconds between two recorded events (waits for `stop`)."""
        stop.synchronize()
        return self.cp.cuda.get_elapsed_time(start, stop) / 1000.0

    def release(self) -> None:
        """Hand the pools' cached free blocks back to the driver, so cudaMemGetInfo counts what is held."""
        self.cp.get_default_memory_pool().free_all_blocks()
        self.cp.get_default_pinned_memory_pool().free_all_blocks()

    # --- CUDA graphs (DeviceBackend.token_step): the emulation has none, so it runs every step eagerly

    def graph_pool(self):
        """A memory pool of a captured graph's own: its temporaries are allocated from it while the
        step is captured and stay the graph's (the default pool could hand them to someone else)."""
        return self.cp.cuda.MemoryPool()

    def allocating_from(self, pool):
        return self.cp.cuda.using_allocator(pool.malloc)

    def capturable(self) -> bool:
        """Whether the current stream can be captured: not the legacy default stream. (2026-12-02,
        H200: a plain decode on a tier started with --spec found the legacy stream current at its
        second token, whose capture then raised; the cause is not found yet.)"""
        return self.cp.cuda.get_current_stream().ptr != 0

    def begin_capture(self) -> None:
        """From now the current stream's work is captured (recorded, not run) until end_capture."""
        mode = getattr(self.cp.cuda.runtime, "streamCaptureModeRelaxed", None)
        stream = self.cp.cuda.get_current_stream()
        stream.begin_capture(mode) if mode is not None else stream.begin_capture()

    def end_capture(self):
        """-> the graph of what was queued since begin_capture."""
        return self.cp.cuda.get_current_stream().end_capture()

    def replay(self, graph) -> None:
        graph.launch(self.cp.cuda.get_current_stream())

    def use_stream(self):
        """A stream of its own for the GPU tier, made current (the hits queue on it while the CPU
        computes the misses). A blocking stream: synchronous copies elsewhere still order with it."""
        stream = self.cp.cuda.Stream(non_blocking=False)
        stream.use()
        self.stream = stream
        return stream

    def enter_thread(self) -> None:
        """This thread's work goes to the tier's stream (`use_stream`) too. CuPy's current stream is
        per thread: strata serve's worker thread was on the legacy default stream, which waits for
        every blocking stream and where no step can be captured (`capturable`)."""
        stream = getattr(self, "stream", None)
        if stream is not None:
            stream.use()

    def retake_stream(self) -> bool:
        """The tier's stream made current again where something left another one current -> whether
        it had to. A device step calls it first: on 2026-12-05 (an H100) the card's greedy --spec tests
        found the legacy stream current at their run's first token, after the plain decode of their
        reference run, so none of its verifies could be captured (they ran eagerly), as on 2026-12-02 a
        plain decode's second token had. What left it there is not found: the same flow alone in a
        script, every engine method watched, never did. The tier's stream is a blocking one, so work
        queued on the legacy stream before stays ordered."""
        stream = getattr(self, "stream", None)
        if stream is None or self.cp.cuda.get_current_stream().ptr == stream.ptr:
            return False
        stream.use()
        return True


_runtime: Any = None
_modules: dict[str, "_Module"] = {}
_plans: dict[tuple, tuple] = {}  # launch plans by kind and shape (_planned)


def runtime():
    """The runtime in use; the CuPy one is created on first use (GpuUnavailable says why not)."""
    global _runtime
    if _runtime is None:
        _runtime = CupyRuntime()
    return _runtime


def use_runtime(rt) -> Any:
    """Swap the runtime (tests: the host emulation); returns the previous one. Compiled modules
    belong to a runtime, so they are dropped."""
    global _runtime
    before, _runtime = _runtime, rt
    _modules.clear()
    _plans.clear()
    return before


# ---------------------------------------------------------------------------------------------
# compiled modules, one per block type (a process compiles only the types it meets)


def _check_tables() -> None:
    """What gpu_kernels.cu assumes of the tables, held to them (they stay the one source)."""
    i = np.arange(128)
    parity = np.array([bin(v).count("1") & 1 for v in i])
    if not np.array_equal(T.KSIGNS_IQ2XS, (i | (parity << 7)).astype(np.uint8)):
        raise RuntimeError("iq_tables.KSIGNS_IQ2XS is not i | parity(i) << 7: gpu_kernels.cu's ksigns() must read the table")
    for name in ("IQ2XXS_GRID", "IQ2XS_GRID", "IQ2S_GRID", "IQ3XXS_GRID", "IQ3S_GRID"):
        b = getattr(T, name).view(np.uint8)
        if b.min() < 1 or b.max() > 127:  # apply_signs negates a byte as (g ^ 0xff) + 1, carry-free only then
            raise RuntimeError(f"iq_tables.{name} has a byte outside 1..127 ({b.min()}..{b.max()}): gpu_kernels.cu's apply_signs() needs 1..127")


_TABLES = {  # __device__ symbol: table (exact bit patterns)
    "g_iq2xxs": T.IQ2XXS_GRID, "g_iq2xs": T.IQ2XS_GRID, "g_iq2s": T.IQ2S_GRID,
    "g_iq3xxs": T.IQ3XXS_GRID, "g_iq3s": T.IQ3S_GRID, "g_iq1s": T.IQ1S_GRID,
    "c_kv": T.KVALUES_IQ4NL.view(np.uint32),
}  # fmt: skip


@dataclass
class _Module:
    mod: Any
    apb: int = 0  # block types: act-blocks per block
    tab: int = 0  # shared-memory bytes of the grid copy (IQ grid types)
    mm_buf: int = 0  # bytes of one mm staging buffer
    mv_rows: tuple[int, ...] = ()  # most rows per mv warp step, for KPL = 1 .. 8
    mv_buf: tuple[int, ...] = ()  # bytes of one mv staging buffer, for KPL = 1 .. 8
    mq_smem: int = 0  # shared bytes of an mmq block (its decoded chunk and scales), the grid copy aside
    mq_warps: int = 4  # most warps of an mmq block (STRATA_MQ_WARPS): its item is 16 rows x 8 warps tokens
    mqw_warps: int = 1  # warps of an mmqw block (STRATA_MQW_WARPS), each with its own decoded image (mq_smem)
    mqk_smem: int = 0  # shared bytes of an mmqk block (its image, or its fold scratch over it), the grid copy aside
    mt_smem: int = 0  # shared bytes of an mmt block (its staged rows and tokens), the grid copy aside


def _names(t: GGMLType) -> list[str]:
    if t.quantized:
        wide = [f"mv<{t.id}, {k}, 1>" for k in KPLS] if is_wide(t) else []
        grouped = [f"mvx<{t.id}, {k}>" for k in KPLS] + [f"mvm<{t.id}, {k}>" for k in KPLS]
        few = [f"mvf<{t.id}, {r}>" for r in MVF_ROWS_ALL] + [f"mvfm<{t.id}, {r}>" for r in MVF_ROWS_ALL]
        batched = few + [f"deq_h<{t.id}>", f"mm<{t.id}>", f"mmx<{t.id}>", f"mmq<{t.id}>", f"mmqx<{t.id}>", f"mmqw<{t.id}>", f"mmqk<{t.id}>", f"mmt<{t.id}>"]
        return [f"mv<{t.id}, {k}>" for k in KPLS] + wide + grouped + batched + [f"traits<{t.id}>"]
    kind = _FLOAT_KIND[t.name]
    return [f"fmv<{kind}>", f"fmvm<{kind}>", f"fmm<{kind}>"] + [f"fmt<{kind}, {r}, {c}>" for r in FMT_SIDES for c in FMT_SIDES]


# The module of a block type's few-row products on the one-row kernel (mv<T, KPL, WIDE, NT> and
# mvm<T, KPL, NT>, MVT_TOKENS), key "<type>" + ROWS: apart from the type's own module, so that only
# a run that verifies drafts compiles its 30 kernels, 39 for a wide type (the tier's startup with
# --spec; a first launch elsewhere).
ROWS = "+rows"


def _rows_names(t: GGMLType) -> list[str]:
    rows = [(k, n) for n in range(2, MVT_MOST + 1) for k in KPLS if k * n <= MVT_ACT]
    wide = [(k, n) for n in range(2, MVT_MOST + 1) for k in KPLS if 2 * k * n <= MVT_ACT] if is_wide(t) else []
    return ([f"mv<{t.id}, {k}, 0, {n}>" for k, n in rows] + [f"mvm<{t.id}, {k}, {n}>" for k, n in rows]
            + [f"mv<{t.id}, {k}, 1, {n}>" for k, n in wide])


def module_names(key: str) -> list[str]:
    """The kernels (name expressions) of the module of a type name, of a block type's name + ROWS,
    or of "actq", in SOURCE."""
    if key == "actq":
        return ["actq", "actq16", "combine16", "to_h"]
    if key.endswith(ROWS):
        t = ggml_type(key[: -len(ROWS)], where="gpu kernels")
        if not t.quantized:
            raise ValueError(f"gpu kernels: {key}: only a block type has the one-row kernel's few-row module")
        return _rows_names(t)
    return _names(ggml_type(key, where="gpu kernels"))


def compile_module(key: str) -> None:
    """Compile (or load) the kernels of a type name (+ ROWS), or "actq", ahead of their first launch."""
    _module(key)


def _module(key: str) -> _Module:
    """The compiled module of a type name (+ ROWS: its traits are the type's own module's), or of
    "actq"; compiled and checked on first use."""
    if key in _modules:
        return _modules[key]
    rt = runtime()
    m = _Module(rt.compile(module_names(key)))
    if key != "actq":
        t = ggml_type(key.removesuffix(ROWS), where="gpu kernels")
        if t.quantized:
            _check_tables()
            for sym, table in _TABLES.items():
                rt.set_global(m.mod, sym, table)
            if not key.endswith(ROWS):
                m.apb, m.tab, m.mm_buf, m.mv_rows, m.mv_buf, m.mq_smem, m.mq_warps, m.mqw_warps, m.mqk_smem, m.mt_smem = _traits(rt, m.mod, t)
    _modules[key] = m
    return m


def _traits(rt, mod, t: GGMLType) -> tuple:
    """The kernel's own layout constants, held to the GGML type table (a drift is refused here,
    not discovered as wrong outputs), and its shared-memory sizes."""
    out = rt.empty(27, np.int32)
    rt.launch(mod, f"traits<{t.id}>", 1, 32, (out,))
    v = [int(x) for x in rt.to_host(out)]
    want = (t.block_size // QA, t.rest_bytes, t.n_scales, t.name in _HAS_MIN)
    if tuple(v[:3]) + (bool(v[3]),) != want:
        raise RuntimeError(
            f"gpu_kernels.cu: {t.name} has (act-blocks, rest bytes, scales, min term) per block = "
            f"{tuple(v[:3]) + (bool(v[3]),)}, the GGML type table and reference.py say {want}"
        )
    return v[0], v[4], v[5], tuple(v[6:22:2]), tuple(v[7:22:2]), v[22], v[23], v[24], v[25], v[26]


# ---------------------------------------------------------------------------------------------
# device-resident weights and activations


@dataclass(frozen=True)
class GpuWeight:
    """A weight of n_out rows of n_in elements in engine form on the device.

    Block types: `scales` f32 [n_blocks * n_scales] (None for IQ1_M, which has no fp16 field) and
    `rest` u8 [n_blocks * rest_bytes], exactly engine_form.widen's planes, flattened.
    F32/F16/BF16: `values` as stored, f32 or uint16 [n_out * n_in] (BF16 as its 16 bits)."""

    type_id: int
    n_in: int
    n_out: int
    rest: Any = None
    scales: Any = None
    values: Any = None
    name: str | None = None

    def __post_init__(self) -> None:
        t = ggml_type(self.type_id, where=f"GpuWeight {self.name or ''}".strip())
        blocks = t.nbytes((self.n_in, self.n_out)) // t.type_size  # refuses a partial block
        if t.quantized:
            want = {"rest": (self.rest, np.uint8, blocks * t.rest_bytes), "scales": (self.scales, np.float32, blocks * t.n_scales)}
            if t.n_scales == 0:
                want.pop("scales")
        else:
            want = {"values": (self.values, np.float32 if t.name == "F32" else np.uint16, self.n_in * self.n_out)}
        rt = runtime()
        for field, (arr, dtype, size) in want.items():
            if not rt.is_array(arr) or arr.dtype != dtype or arr.ndim != 1 or arr.size != size or not arr.flags.c_contiguous:
                raise ValueError(
                    f"GpuWeight {self.label}: {field} must be a contiguous device {np.dtype(dtype).name}[{size}], got {_describe(arr)}"
                )
            if rt.ptr(arr) % 16:  # the kernels read the planes in 16-byte vectors
                raise ValueError(f"GpuWeight {self.label}: {field} starts at device address {rt.ptr(arr):#x}, not 16-byte aligned")

    @property
    def type(self) -> GGMLType:
        return ggml_type(self.type_id)

    @property
    def label(self) -> str:
        return f"{self.name or '<unnamed>'} ({self.type.name} [{self.n_in} x {self.n_out}])"

    @property
    def nbytes(self) -> int:
        """Device bytes of the planes (what a budget must count: the widened scales included)."""
        return sum(a.nbytes for a in (self.rest, self.scales, self.values) if a is not None)

    def to_raw(self) -> np.ndarray:
        """Back to the pack bytes (engine_form.narrow, exact): the round trip's second half."""
        t, rt = self.type, runtime()
        if not t.quantized:
            return rt.to_host(self.values).view(np.uint8)
        blocks = t.nbytes((self.n_in, self.n_out)) // t.type_size
        scales = rt.to_host(self.scales) if self.scales is not None else np.zeros(0, np.float32)
        return narrow(scales.reshape(blocks, t.n_scales), rt.to_host(self.rest).reshape(blocks, t.rest_bytes), t.id, self.name)


def upload(raw: np.ndarray, type_id: int, n_in: int, n_out: int, name: str | None = None) -> GpuWeight:
    """Pack-form GGML bytes (n_out rows of n_in elements) -> engine form on the device, copied once."""
    t = ggml_type(type_id, where=f"upload {name or ''}".strip())
    label = f"{name or '<unnamed>'} ({t.name} [{n_in} x {n_out}])"
    if not isinstance(raw, np.ndarray) or raw.dtype != np.uint8:
        raise TypeError(f"upload {label}: weight bytes must be a uint8 numpy array, got {_describe(raw)}")
    need = t.nbytes((n_in, n_out))
    if raw.size != need:
        raise ValueError(f"upload {label}: {t.name} [{n_in} x {n_out}] is {need} bytes, got {raw.size}")
    rt = runtime()
    raw = np.ascontiguousarray(raw).reshape(-1)
    if not t.quantized:
        values = raw.view(np.float32 if t.name == "F32" else np.uint16)
        return GpuWeight(type_id, n_in, n_out, values=rt.to_device(values), name=name)
    scales, rest = widen(raw, type_id, name)
    dev_scales = rt.to_device(scales.reshape(-1)) if t.n_scales else None
    return GpuWeight(type_id, n_in, n_out, rest=rt.to_device(rest.reshape(-1)), scales=dev_scales, name=name)


def place(raw: np.ndarray, type_id: int, n_in: int, n_out: int, arena, offset: int, name: str | None = None,
          staging: np.ndarray | None = None, stream=None) -> GpuWeight:
    """`upload`, into arena bytes at `offset` (placed_bytes of them) instead of new allocations:
    the GPU tier allocates what engine/budget.py plans, in one piece per item, and carves weights
    out of it. `staging`: pinned host bytes (at least placed_bytes) to copy through, else the
    widened planes are copied from pageable memory. `stream` (with staging): the copies are queued
    on it and not waited for; the caller keeps the staging bytes until they are done."""
    t, rt = ggml_type(type_id, where=f"place {name or ''}".strip()), runtime()
    if raw.dtype != np.uint8 or raw.size != t.nbytes((n_in, n_out)):
        raise ValueError(f"place {name}: {t.name} [{n_in} x {n_out}] is {t.nbytes((n_in, n_out))} bytes, got {raw.dtype}[{raw.size}]")
    a, b = planes(type_id, n_in, n_out)
    if t.quantized and staging is not None:
        # widened straight into the staging, each plane its own part of it (the copies are in flight
        # together): the rest at 0, the scales at align(a), where the loop below puts them
        rest, scales = staging[:a], staging[align(a) : align(a) + b].view(np.float32)
        widen(raw.reshape(-1), type_id, name, scales=scales, rest=rest)
        host = [(rest, np.uint8, a), (scales, np.float32, b)]
    elif t.quantized:
        scales, rest = widen(raw.reshape(-1), type_id, name)
        host = [(rest.reshape(-1), np.uint8, a), (scales.reshape(-1), np.float32, b)]
    else:
        host = [(np.ascontiguousarray(raw).reshape(-1).view(np.float32 if t.name == "F32" else np.uint16), None, a)]
    dev, at = [], 0
    for values, dtype, nbytes in host:
        dtype = dtype or values.dtype
        if nbytes == 0:
            dev.append(None)
            continue
        view = rt.view(arena, offset + at, (nbytes // np.dtype(dtype).itemsize,), dtype)
        if staging is not None and not t.quantized:
            stage = staging[at : at + nbytes].view(dtype)
            stage[...] = values
            values = stage
        if staging is not None and stream is not None:
            rt.copy_in_async(view, values, stream)
        else:
            rt.copy_in(view, values)
        dev.append(view)
        at += align(nbytes)
    if staging is not None and stream is None:
        rt.synchronize()  # the staging buffer is reused by the next call
    if t.quantized:
        return GpuWeight(type_id, n_in, n_out, rest=dev[0], scales=dev[1], name=name)
    return GpuWeight(type_id, n_in, n_out, values=dev[0], name=name)


@dataclass(frozen=True)
class GpuActQ:
    """ActQ on the device (actq.ActQ's planes), plus `bad`: u64 [1], the lowest index of a
    non-finite input of the last quantization (all ones: none)."""

    q: Any  # int8  [T, n] or [n]
    d: Any  # f32   [T, n/32] or [n/32]
    s16: Any  # int32 [T, n/16] or [n/16]
    bad: Any

    @property
    def n(self) -> int:
        return self.q.shape[-1]

    def to_host(self) -> ActQ:
        rt = runtime()
        return ActQ(rt.to_host(self.q), rt.to_host(self.d), rt.to_host(self.s16))


@dataclass(frozen=True)
class GpuActQ16:
    """actq.ActQ16 on the device: `planes` a GpuActQ of 2T rows (row 2t: row t's hi plane, 2t + 1
    its lo plane); one: a single vector."""

    planes: GpuActQ
    one: bool

    @property
    def n(self) -> int:
        return self.planes.q.shape[-1]

    @property
    def rows(self) -> int:
        return self.planes.q.shape[0] // 2

    def to_host(self) -> ActQ16:
        return ActQ16(self.planes.to_host(), self.one)


def empty_act16(shape: tuple[int, ...]) -> GpuActQ16:
    """Buffers for quantize_act16_gpu(out=...): [n] or [T, n] features."""
    shape = tuple(int(s) for s in shape)
    if len(shape) not in (1, 2) or shape[-1] % QA:
        raise ValueError(f"empty_act16: shape must be [n] or [T, n] with n a multiple of {QA}, got {list(shape)}")
    rows = shape[0] if len(shape) == 2 else 1
    return GpuActQ16(empty_act((2 * rows, shape[-1])), len(shape) == 1)


def quantize_act16_gpu(x, out: GpuActQ16 | None = None, check: bool = True) -> GpuActQ16:
    """The wide form of device f32 activations [n] or [T, n], bit for bit actq.quantize_act16."""
    rt = runtime()
    where = "quantize_act16_gpu"
    if not rt.is_array(x) or x.dtype != np.float32 or x.ndim not in (1, 2) or x.shape[-1] % QA or not x.flags.c_contiguous:
        raise TypeError(f"{where}: activations must be a contiguous device f32 [n] or [T, n] with n a multiple of {QA}, got {_describe(x)}")
    if out is None:
        out = empty_act16(x.shape)
    elif not isinstance(out, GpuActQ16) or out.n != x.shape[-1] or out.rows != (x.shape[0] if x.ndim == 2 else 1):
        raise ValueError(f"{where}: out must be a GpuActQ16 of {list(x.shape)} activations, got {_describe(out)}")
    p = out.planes
    nblocks = x.size // QA
    if nblocks:
        if check:  # (unchecked, `bad` is not reset: the device step never reads it, one launch less)
            p.bad.fill(NO_BAD)
        rt.launch(_module("actq").mod, "actq16", _grid(rt, nblocks, 8), 256,
                  (x, p.q, p.d, p.s16, np.int64(nblocks), np.int64(x.shape[-1] // QA), p.bad))
    if check:
        bad = int(rt.to_host(p.bad)[0]) if nblocks else int(NO_BAD)
        if bad != int(NO_BAD):
            index = np.unravel_index(bad, x.shape)
            value = rt.to_host(x.reshape(-1)[bad : bad + 1])[0]
            raise NonFiniteActivation(f"{where}: non-finite activation {value} at index {tuple(int(i) for i in index)}")
    return out


def combine16(y2, out) -> None:
    """out [T, n_out] = f32(256) y2[2t] + y2[2t + 1] (y2 [2T, n_out], device f32; not in place)."""
    rt = runtime()
    n = out.size
    rt.launch(_module("actq").mod, "combine16", _grid(rt, n, 256), 256, (y2, out, np.int64(y2.shape[-1]), np.int64(n)))


def _check_wide(w: "GpuWeight", act: GpuActQ16, where: str) -> None:
    if not is_wide(w.type):
        raise TypeError(f"{where}: {w.type.name} weights read 8-bit activations (GpuActQ), got the wide form (GpuActQ16)")
    if act.n != w.n_in:
        raise TypeError(f"{where}: activations must have {w.n_in} features, got {_describe(act)}")


def empty_act(shape: tuple[int, ...]) -> GpuActQ:
    """Buffers for quantize_act_gpu(out=...): [n] or [T, n] features (allocated once, reused)."""
    shape = tuple(int(s) for s in shape)
    if len(shape) not in (1, 2) or shape[-1] % QA:
        raise ValueError(f"empty_act: shape must be [n] or [T, n] with n a multiple of {QA}, got {list(shape)}")
    rt, lead = runtime(), shape[:-1]
    n = shape[-1]
    return GpuActQ(rt.empty(shape, np.int8), rt.empty(lead + (n // QA,), np.float32), rt.empty(lead + (n // 16,), np.int32), rt.empty(1, np.uint64))


def quantize_act_gpu(x, out: GpuActQ | None = None, check: bool = True) -> GpuActQ:
    """ActQ of device f32 activations [n] or [T, n], bit for bit actq.quantize_act.

    check=True reads back whether an input was non-finite and raises ValueError naming it (one
    device synchronisation); with check=False there is no check and `out.bad` is not reset (the
    device step's products quantize hundreds of times a token and never read it: a launch less each)."""
    rt = runtime()
    where = "quantize_act_gpu"
    if not rt.is_array(x) or x.dtype != np.float32 or x.ndim not in (1, 2) or x.shape[-1] % QA or not x.flags.c_contiguous:
        raise TypeError(f"{where}: activations must be a contiguous device f32 [n] or [T, n] with n a multiple of {QA}, got {_describe(x)}")
    if out is None:
        out = empty_act(x.shape)
    elif out.q.shape != x.shape:
        raise ValueError(f"{where}: out holds {list(out.q.shape)} activations, x is {list(x.shape)}")
    nblocks = x.size // QA
    if nblocks:
        if check:
            out.bad.fill(NO_BAD)
        rt.launch(_module("actq").mod, "actq", _grid(rt, nblocks, 8), 256, (x, out.q, out.d, out.s16, np.int64(nblocks), out.bad))
    if check:
        bad = int(rt.to_host(out.bad)[0]) if nblocks else int(NO_BAD)
        if bad != int(NO_BAD):
            index = np.unravel_index(bad, x.shape)
            value = rt.to_host(x.reshape(-1)[bad : bad + 1])[0]
            raise NonFiniteActivation(f"{where}: non-finite activation {value} at index {tuple(int(i) for i in index)}")
    return out


# ---------------------------------------------------------------------------------------------
# the products


def _few_weight_rows(name: str, n_out: int, n_sm: int) -> bool:
    """Whether mvf would give each warp one weight row of n_out (its rule, unforced): where a few
    activation rows take the one-row kernel (MVT_TOKENS)."""
    return _mvf_rows(name, n_out, n_sm, forced=False) == 1


def _mvf_rows(name: str, n_out: int, n_sm: int, forced: bool = True) -> int:
    """The weight rows an mvf warp takes at once for n_out rows of type `name` (MVF_ROWS_ALL says
    why; `forced`: STRATA_MVF_ROWS's, where set)."""
    if MVF_ROWS and forced:
        return MVF_ROWS
    for r in range(MVF_ROWS_MOST.get(name, MVF_ROWS_ALL[-1]), 1, -1):
        if -(-n_out // r) >= MVF_TASKS_PER_SM * n_sm:
            return r
    return 1


def _grid(rt, n_items: int, per_block: int, per_sm: int = 32) -> int:
    # Warps take rows grid-stride; a few blocks per multiprocessor is enough to fill it (a block
    # that first copies an IQ grid to shared memory should be reused: fewer per multiprocessor).
    return max(1, min(-(-n_items // per_block), per_sm * rt.n_sm))


def _warps(per_warp_smem: int, n_rows: int, n_sm: int, most: int = 8, fixed_smem: int = 0) -> int:
    """Warps per block: as many as shared memory allows, fewer when the rows are too few to give
    every multiprocessor two blocks (expert-shaped matrices)."""
    w = most
    while w > 1 and (fixed_smem + w * per_warp_smem > SMEM_LIMIT or -(-n_rows // w) < 2 * n_sm):
        w //= 2
    return w


def _out(rt, out, shape: tuple[int, ...], where: str):
    if out is None:
        return rt.empty(shape, np.float32)
    if not rt.is_array(out) or out.dtype != np.float32 or tuple(out.shape) != shape or not out.flags.c_contiguous:
        raise ValueError(f"{where}: out must be a contiguous device f32 {list(shape)}, got {_describe(out)}")
    return out


def _planned(make):
    """(module, kernel, grid, block, shared bytes, trailing args) of one launch is a function of the
    type and shape alone, so it is worked out once per shape (the token path launches the same
    shapes every token)."""

    def plan(type_id: int, n_in: int, n_out: int, n_tok: int) -> tuple:
        key = (make, type_id, n_in, n_out, n_tok)
        p = _plans.get(key)
        if p is None:
            p = _plans[key] = make(type_id, n_in, n_out, n_tok)
        return p

    return plan


@_planned
def _quant_plan(type_id: int, n_in: int, n_out: int, n_tok: int) -> tuple:
    """matvec's and matmul's launch (the tensor cores for MMA_TYPES: mmt for MMT_TYPES where the product
    has MMT_MIN_TILES block tiles a multiprocessor and rows of MMT_MIN_BLOCKS act-blocks, else mmq)."""
    name = ggml_type(type_id).name
    return _quant_launch(type_id, n_in, n_out, n_tok, name in MMA_TYPES, tiled=name in MMT_TYPES)


def grouped_kernel(type_id: int, down: bool = False, pairs: float = 0.0) -> str:
    """The kernel grouped_products takes for a block type: "mmqk" (MMQK_TYPES), "mmqw" (MMQW_TYPES)
    or "mmqx" (MMAX_TYPES), the first that names it; else, for SHAPE_TYPES, by shape: "mmqw" for a
    down product (down: its input the experts' intermediate), "mmqk" for gate/up at fewer than
    GROUPED_MMQX_PAIRS pairs an expert (pairs: the chunk's mean), else "mmqx"; else "mmx"."""
    name = ggml_type(type_id).name
    for kind, types in (("mmqk", MMQK_TYPES), ("mmqw", MMQW_TYPES), ("mmqx", MMAX_TYPES)):
        if name in types:
            return kind
    if name in SHAPE_TYPES:
        if down:
            return "mmqw"
        return "mmqk" if pairs < GROUPED_MMQX_PAIRS else "mmqx"
    return "mmx"


def _grouped_plan(type_id: int, n_in: int, n_out: int, n_tok: int, down: bool = False, pairs: float = 0.0) -> tuple:
    """grouped_products' launch: (module, kernel, blocks a tile, block, shared bytes, trailing args)."""
    return _grouped_launch(type_id, n_in, n_out, n_tok, grouped_kernel(type_id, down, pairs))


def _grouped_launch(type_id: int, n_in: int, n_out: int, n_tok: int, kind: str) -> tuple:
    key = (_grouped_launch, type_id, n_in, n_out, n_tok, kind)
    p = _plans.get(key)
    if p is None:
        p = _plans[key] = _grouped_make(type_id, n_in, n_out, n_tok, kind)
    return p


def _grouped_make(type_id: int, n_in: int, n_out: int, n_tok: int, kind: str) -> tuple:
    mod, _, grid, block, smem, extra = _quant_launch(type_id, n_in, n_out, n_tok, kind != "mmx")
    groups = -(-n_out // 16)
    if kind == "mmqx":  # a tile of up to 8 x warps pairs (most tiles) is one item per 16 rows: a block each
        return mod, f"mmqx<{type_id}>", min(grid, groups), 32 * max(1, min(MMQX_WARPS, block // 32)), smem, extra
    if kind == "mmqw":  # a warp a 16-row group, each with its own decoded image after the grid copy
        m = _module(ggml_type(type_id).name)
        tab, nw = smem - m.mq_smem, m.mqw_warps
        if tab + nw * m.mq_smem > SMEM_LIMIT:
            raise ValueError(f"mmqw<{type_id}>: STRATA_MQW_WARPS={nw} takes {tab + nw * m.mq_smem} bytes of shared memory a block, "
                             f"more than the {SMEM_LIMIT} a launch may take; 1 fits")
        return mod, f"mmqw<{type_id}>", -(-groups // nw), 32 * nw, tab + nw * m.mq_smem, extra
    if kind == "mmqk":  # a block a 16-row group, its four warps a quarter of each chunk
        m = _module(ggml_type(type_id).name)
        return mod, f"mmqk<{type_id}>", groups, 128, smem - m.mq_smem + m.mqk_smem, extra
    return mod, f"mmx<{type_id}>", grid, block, smem, extra


def _kpl(nb: int) -> int:
    """The act-blocks a lane of the one-row kernel holds for rows of nb act-blocks (0: longer than
    it holds)."""
    return next((k for k in KPLS if 32 * k >= nb), 0)


def _grid_copy(m: "_Module", rt, n_out: int) -> int:
    # An IQ grid goes to shared memory only when every block has enough rows to repay the copy.
    return m.tab if m.tab and n_out >= SHARED_TABLE_ROWS * 8 * rt.n_sm else 0


def _mv_launch(type_id: int, n_in: int, n_out: int, n_tok: int = 1, wide: bool = False, share: int = 0) -> tuple | None:
    """The one-row kernel's launch (mv) for n_tok activation rows (a row's two planes, wide), or None
    where it does not take them: rows longer than 32 x KPLS[-1] act-blocks; more than one row
    (mv<T, KPL, WIDE, NT>) on more weight rows than mvf gives a warp one (MVT_TOKENS says why:
    n_out's, or `share`'s, the rows of the matrices one launch shares the card among), more than
    MVT_TOKENS rows, or planes x KPL past MVT_ACT."""
    t = ggml_type(type_id)
    rt, m = runtime(), _module(t.name)
    nb = n_in // QA
    kpl = _kpl(nb)
    if not kpl or n_tok < 1 or n_tok > 1 and (n_tok > MVT_TOKENS or kpl * n_tok * (1 + wide) > MVT_ACT
                                 or not _few_weight_rows(t.name, share or n_out, rt.n_sm)):
        return None
    tab = _grid_copy(m, rt, n_out)
    per_warp = 2 * m.mv_buf[kpl - 1]  # two staging buffers: this step's rows and the next's
    rows = m.mv_rows[kpl - 1]
    nw = _warps(per_warp, -(-n_out // rows), rt.n_sm, fixed_smem=tab)
    while rows > 1 and -(-n_out // (nw * rows)) < 2 * rt.n_sm:  # few rows: spread them out
        rows -= 1
    grid = _grid(rt, n_out, nw * rows, 8 if tab else 32)
    params = (type_id, kpl) + ((int(wide),) if wide or n_tok > 1 else ()) + ((n_tok,) if n_tok > 1 else ())
    mod = _module(t.name + ROWS).mod if n_tok > 1 else m.mod
    return mod, f"mv<{', '.join(str(v) for v in params)}>", grid, 32 * nw, tab + nw * per_warp, (np.int32(rows), np.int32(tab > 0))


def _mvf_launch(type_id: int, n_out: int, n_tok: int) -> tuple:
    """The few-row kernel's launch (mvf<T, R>): a warp R weight rows (_mvf_rows), grid-stride."""
    t = ggml_type(type_id)
    rt, m = runtime(), _module(t.name)
    tab = _grid_copy(m, rt, n_out)
    r = _mvf_rows(t.name, n_out, rt.n_sm)
    nw = _warps(0, -(-n_out // r), rt.n_sm, fixed_smem=tab)
    return m.mod, f"mvf<{type_id}, {r}>", _grid(rt, -(-n_out // r), nw, 8 if tab else 32), 32 * nw, tab, (np.int32(n_tok), np.int32(tab > 0))


def _quant_launch(type_id: int, n_in: int, n_out: int, n_tok: int, mma: bool, tiled: bool = False) -> tuple:
    t = ggml_type(type_id)
    rt, m = runtime(), _module(t.name)
    nb = n_in // QA
    tab = _grid_copy(m, rt, n_out)
    per_sm = 8 if tab else 32
    mv = _mv_launch(type_id, n_in, n_out, n_tok)
    if mv is not None:
        return mv
    if 0 < n_tok <= MVF_TOKENS and (n_tok > 1 or nb > 32 * KPLS[-1]):  # few rows, or one mv cannot hold: a warp a row
        return _mvf_launch(type_id, n_out, n_tok)
    tiles = -(-n_out // MT_ROWS) * -(-n_tok // MT_TOKS)
    if mma and tiled and tiles >= MMT_MIN_TILES * rt.n_sm and nb >= MMT_MIN_BLOCKS:  # the int8 tensor cores in block tiles of MT_ROWS x MT_TOKS
        tab = tab if tab + m.mt_smem <= SMEM_LIMIT else 0  # (the grid copy left out if both would not fit)
        return m.mod, f"mmt<{type_id}>", _grid(rt, tiles, 1, 16), 32 * MT_WR * MT_WC, tab + m.mt_smem, (np.int32(n_tok), np.int32(tab > 0))
    if mma:  # the int8 tensor cores: a block's item is 16 rows x 8 nw tokens
        nw = max(1, min(m.mq_warps, -(-n_tok // 8)))
        items = -(-n_out // 16) * -(-n_tok // (8 * nw))
        return m.mod, f"mmq<{type_id}>", _grid(rt, items, 1, 8), 32 * nw, tab + m.mq_smem, (np.int32(n_tok), np.int32(tab > 0))
    per_warp = 2 * m.mm_buf + 4 * 32 * n_tok
    nw = _warps(per_warp, n_out, rt.n_sm, most=4, fixed_smem=tab)
    grid = _grid(rt, n_out, nw, per_sm)
    return m.mod, f"mm<{type_id}>", grid, 32 * nw, tab + nw * per_warp, (np.int32(n_tok), np.int32(tab > 0))


def _wide_mv_plan(type_id: int, n_in: int, n_out: int, n_tok: int = 1) -> tuple | None:
    """The launch of the wide form for n_tok rows: matvec's, with the kernel that reads both planes
    (mv<T, KPL, 1>, or mv<T, KPL, 1, NT> for NT rows, MVT_TOKENS); None where matvec takes the
    batched kernel (rows longer than mv holds) or the rows' planes are more than mv holds."""
    key = (_wide_mv_plan, type_id, n_in, n_out, n_tok)
    if key not in _plans:
        _plans[key] = _mv_launch(type_id, n_in, n_out, n_tok, wide=True)
    return _plans[key]


def _quant16(w: GpuWeight, act: GpuActQ16, out, planes_out=None) -> None:
    """out [T, n_out] = the product of the wide form: through mv<T, KPL, 1> (one row; no buffer) or
    mv<T, KPL, 1, T> (a few: _wide_mv_plan), else both planes as 2T tokens of the batched kernel into
    planes_out (device f32 [2T, n_out]; made if None), then combine16."""
    p = act.planes
    plan = _wide_mv_plan(w.type_id, w.n_in, w.n_out, act.rows)
    if plan is not None:
        mod, name, grid, block, smem, extra = plan
        scales = w.scales if w.scales is not None else w.rest
        args = (w.rest, scales, p.q, p.d, p.s16, out, np.int32(w.n_out), np.int32(w.n_in // QA))
        runtime().launch(mod, name, grid, block, args + extra, smem)
        return
    y2 = matmul(w, p, planes_out)
    combine16(y2, out)


def _quant(w: GpuWeight, q, d, s16, out) -> None:
    """One launch for up to MAX_TOKENS tokens (mmq: MMQ_LAUNCH_TOKENS): q [T, n_in], d [T, nb], s16 [T, 2 nb], out [T, n_out]."""
    mod, name, grid, block, smem, extra = _quant_plan(w.type_id, w.n_in, w.n_out, q.shape[0])
    scales = w.scales if w.scales is not None else w.rest  # IQ1_M: never read
    args = (w.rest, scales, q, d, s16, out, np.int32(w.n_out), np.int32(w.n_in // QA))
    runtime().launch(mod, name, grid, block, args + extra, smem)


FMM_R, FMM_T = 8, 8  # gpu_kernels.cu's fmm tile: weight rows x tokens a warp sums in registers
FMT_SIDES = (8, 4, 2, 1)  # the rows R and tokens C of fmt's warp tile (each pair is compiled)
# The batched float product: "tiles" (fmt, all T tokens in one launch, the tile sized to the shape)
# or "8x8" (fmm, the kernel before it: 64 tokens a launch), kept to measure one against the other.
FMM_KERNELS = ("tiles", "8x8")
FMM = os.environ.get("STRATA_FMM", "tiles")
if FMM not in FMM_KERNELS:
    raise ValueError(f"STRATA_FMM={FMM!r}: expected one of {', '.join(FMM_KERNELS)}")


def use_fmm(kind: str) -> str:
    """Pick the batched float kernel ("tiles" or "8x8", see FMM); returns the previous choice.
    The same bits either way (tested); a benchmark's switch."""
    global FMM
    if kind not in FMM_KERNELS:
        raise ValueError(f"use_fmm: {kind!r} is not one of {', '.join(FMM_KERNELS)}")
    before, FMM = FMM, kind
    _plans.clear()
    return before


def fmt_tile(n_out: int, n_tok: int, n_sm: int) -> tuple[int, int]:
    """(R, C) of fmt's warp tile: the largest of FMT_SIDES that covers the shape (each load serves
    R x C products), halved, the longer side first, until the warp tiles give each of the n_sm
    multiprocessors 4 warps (one a scheduler) or the tile is one output."""
    r = next(s for s in reversed(FMT_SIDES) if s >= min(n_out, FMT_SIDES[0]))
    c = next(s for s in reversed(FMT_SIDES) if s >= min(n_tok, FMT_SIDES[0]))
    while -(-n_out // r) * -(-n_tok // c) < 4 * n_sm and r * c > 1:
        if r >= c:
            r //= 2
        else:
            c //= 2
    return r, c


@_planned
def _float_plan(type_id: int, n_in: int, n_out: int, n_tok: int) -> tuple:
    t = ggml_type(type_id)
    rt, m = runtime(), _module(t.name)
    kind = _FLOAT_KIND[t.name]
    if n_tok == 1:
        nw = _warps(0, n_out, rt.n_sm)
        return m.mod, f"fmv<{kind}>", _grid(rt, n_out, nw), 32 * nw, 0, ()
    if FMM == "8x8":
        tiles = -(-n_out // FMM_R) * -(-n_tok // FMM_T)  # (fmm's tile of rows x tokens a warp)
        return m.mod, f"fmm<{kind}>", _grid(rt, tiles, 8), 256, 0, (np.int32(n_tok),)
    r, c = fmt_tile(n_out, n_tok, rt.n_sm)
    row_tiles, tok_tiles = -(-n_out // r), -(-n_tok // c)
    br = 2 if row_tiles > 1 else 1  # a block's 8 warps: br row tiles x 8 / br token tiles
    groups = -(-row_tiles // br) * -(-tok_tiles // (8 // br))
    return m.mod, f"fmt<{kind}, {r}, {c}>", _grid(rt, groups, 1), 256, 0, (np.int32(n_tok), np.int32(br))


def _float(w: GpuWeight, x, out) -> None:
    """x f32 [T, n_in], out [T, n_out]: one launch (fmm: T <= MAX_TOKENS)."""
    mod, name, grid, block, smem, extra = _float_plan(w.type_id, w.n_in, w.n_out, x.shape[0])
    runtime().launch(mod, name, grid, block, (w.values, x, out, np.int32(w.n_out), np.int32(w.n_in)) + extra, smem)


def matvec_into(w: GpuWeight, act, out) -> None:
    """`matvec` without its checks, for the GPU tier's token path: `act` (a GpuActQ of n_in, or
    device f32 [n_in]) and `out` (device f32 [n_out]) are views the tier carved and checked at
    startup. The same launch as matvec's, so the same bits; a few microseconds of Python less per
    product (the token path makes hundreds)."""
    if isinstance(act, GpuActQ16):
        _quant16(w, act, out)
        return
    if isinstance(act, GpuActQ):
        mod, name, grid, block, smem, extra = _quant_plan(w.type_id, w.n_in, w.n_out, 1)
        scales = w.scales if w.scales is not None else w.rest
        args = (w.rest, scales, act.q, act.d, act.s16, out, np.int32(w.n_out), np.int32(w.n_in // QA))
    else:
        mod, name, grid, block, smem, extra = _float_plan(w.type_id, w.n_in, w.n_out, 1)
        args = (w.values, act, out, np.int32(w.n_out), np.int32(w.n_in))
    runtime().launch(mod, name, grid, block, args + extra, smem)


MANY = 4  # most matrices of one mvm / fmvm / mvfm launch (gpu_kernels.cu)


def _groupable(ws: list, act) -> bool:
    # 2 to MANY weights of one type and one n_in, and the activation form that type reads (not the wide one)
    return (1 < len(ws) <= MANY and not isinstance(act, GpuActQ16) and len({w.type_id for w in ws}) == 1
            and ws[0].type.quantized == isinstance(act, GpuActQ) and len({w.n_in for w in ws}) == 1)


def matvec_many(ws: list, act, outs: list) -> bool:
    """`matvec_into` of several weights of ONE type on the same one-token input, in one launch
    (mvm, or fmvm for the float types): ws (GpuWeights, at most MANY), act (a GpuActQ of their
    n_in, or device f32 [n_in]), outs (device f32 [n_out] each). Each matrix keeps its own mv
    launch's rows a warp step, so every row has matvec's bits. False (nothing launched) where
    matvec would not take mv (the wide form, rows longer than mv holds): the caller launches each."""
    if not _groupable(ws, act):
        return False
    if not ws[0].type.quantized:
        _fmvm(ws, act, outs, 1)
        return True
    plans = [_quant_plan(w.type_id, w.n_in, w.n_out, 1) for w in ws]
    if not all(p[1].startswith("mv<") for p in plans):
        return False
    _mvm(ws, act, outs, plans, 1)
    return True


def _mvm(ws: list, act: "GpuActQ", outs: list, plans: list, n_tok: int) -> None:
    """mvm of ws (one block type, one n_in) on act's n_tok rows, plans each weight's mv launch for
    them (_mv_launch): each matrix keeps its own launch's rows a warp step, so every row has that
    launch's bits."""
    rt, t, w0 = runtime(), ws[0].type, ws[0]
    mod, kpl = plans[0][0], _kpl(w0.n_in // QA)
    # one block shape for all: the widest plan's warps; the grid copy in shared memory only where
    # every plan takes it (else each reads it from global memory: the same table, the same bits)
    m, block = _module(t.name), max(p[3] for p in plans)
    tab = min(int(p[5][1]) for p in plans)
    smem = (m.tab if tab else 0) + block // 32 * 2 * m.mv_buf[kpl - 1]  # (a warp's two staging buffers)
    per_sm = 8 if tab else 32
    table = ()
    for w, out, p in zip(ws, outs, plans):
        rows = int(p[5][0])
        scales = w.scales if w.scales is not None else w.rest
        table += (w.rest, scales, out, np.int32(w.n_out), np.int32(_grid(rt, w.n_out, block // 32 * rows, per_sm)), np.int32(rows))
    grid = sum(int(g) for g in table[4::6])
    table += (w0.rest, w0.scales if w0.scales is not None else w0.rest, outs[0], np.int32(0), np.int32(0), np.int32(1)) * (MANY - len(ws))
    args = (act.q, act.d, act.s16, np.int32(w0.n_in // QA), np.int32(tab))
    rt.launch(mod, f"mvm<{t.id}, {kpl}" + (f", {n_tok}>" if n_tok > 1 else ">"), grid, block, args + table, smem)


def slot_products_fit(type_id: int, n_in: int, n_out: int) -> bool:
    """Whether `slot_products` takes this shape (the one-token kernel holds rows of n_in)."""
    return ggml_type(type_id).quantized and _quant_plan(type_id, n_in, n_out, 1)[1].startswith("mv<")


def slot_products(type_id: int, n_in: int, n_out: int, arena, slot_bytes: int, at: int, mat_bytes: int, slot, k: int,
                  R: int, act: GpuActQ, x_div: int, out) -> bool:
    """R one-row products on expert weights in the slot storage, in one launch (mvx, gpu_kernels.cu):
    product j multiplies matrix j // k (at + j // k * mat_bytes within the slot) of the expert in slot
    slot[j % k] (device int32 [k]; -1: skipped, a miss) by act's row (j % k) // x_div (x_div 0: row
    0) into out[j] (device f32 [R, n_out]). Each product has matvec's bits on that weight. False (nothing launched) where
    matvec would take the batched kernel (rows longer than mv holds): the caller keeps its own path.

    Each product gets the grid it would get alone (expert-shaped: one-warp blocks, a row a warp), so
    a launch of R products is R such grids in waves. Two other grids were timed on seed-4l
    qwen35moe's captured verify of 1 + 2 rows (2026-12-06, graph ms) and were no faster: the
    products sharing N warps a multiprocessor, each warp several staged steps (an H200, against 1.054
    and 1.058: N = 4, 8, 16, 32 gave 1.238, 1.113, 1.064, 1.044; an H100, against 1.069 and 1.071:
    N = 64 gave 1.058), and smaller staging buffers, so that more warps fit a multiprocessor (the
    H100: STRATA_MV_STEP=1024 1.129 and 1.132, 2048 1.099)."""
    mod, name, grid, block, smem, extra = _quant_plan(type_id, n_in, n_out, 1)
    if not name.startswith("mv<"):
        return False
    rest, _ = planes(type_id, n_in, n_out)
    args = (arena, np.int64(slot_bytes), np.int64(mat_bytes), np.int64(at), np.int64(at + align(rest)), slot, np.int32(k),
            np.int32(grid), act.q, act.d, act.s16, np.int32(x_div), out, np.int32(n_out), np.int32(n_in // QA))
    runtime().launch(mod, "mvx" + name[2:], grid * R, block, args + extra, smem)
    return True


def tile_rows(weights: list, firsts, counts, bases) -> np.ndarray:
    """The tile table of `grouped_products` (host i64 [n_tiles, 5]): group g multiplies weights[g] (a
    block-type GpuWeight) on pairs firsts[g] .. firsts[g] + counts[g] - 1, its output rows from
    bases[g] (0: row = pair); a group of more than MAX_TOKENS pairs is several tiles."""
    rt, rows = runtime(), []
    for w, a, n, base in zip(weights, firsts, counts, bases):
        rest = rt.ptr(w.rest)
        sc = rt.ptr(w.scales) if w.scales is not None else rest  # IQ1_M: never read
        for t in range(int(a), int(a) + int(n), MAX_TOKENS):
            rows.append((rest, sc, t, min(MAX_TOKENS, int(a) + int(n) - t), int(base)))
    return np.array(rows, np.int64).reshape(-1, 5)


def grouped_products(type_id: int, n_in: int, n_out: int, tiles, n_tiles: int, act: GpuActQ, xrow, orow, out,
                     down: bool = False, pairs: float = 0.0) -> None:
    """Many experts' products of a prompt chunk in one launch (mmx, mmqx, mmqw or mmqk: grouped_kernel): tile i of
    `tiles` (device i64 [n_tiles, 5], rows of `tile_rows`) multiplies its weight by act's rows
    xrow[p] (device int32; None: row p) for its pairs p into out's rows orow[p] (device int32; None:
    its base + p). Each row has matmul's bits on that weight alone (the batched kernel's arithmetic,
    the CPU's). Block types only (the ActQ; not the wide form). down (the experts' down product) and
    pairs (the chunk's mean pairs an expert) choose the kernel (grouped_kernel), never the bits."""
    if n_tiles == 0:
        return
    mod, name, grid, block, smem, (_, tab) = _grouped_plan(type_id, n_in, n_out, MAX_TOKENS, down, pairs)
    null = np.uint64(0)  # a null pointer argument
    args = (tiles, np.int32(grid), act.q, act.d, act.s16, null if xrow is None else xrow, null if orow is None else orow, out, np.int32(n_out), np.int32(n_in // QA),
            np.int32(MAX_TOKENS), tab)
    runtime().launch(mod, name, grid * n_tiles, block, args, smem)


def _fmvm(ws: list, act, outs: list, n_tok: int) -> None:
    """fmvm of ws (one float type, at most MANY) on n_tok rows of act: the widest of their fmv
    launches' warps a block, each matrix's blocks a token as its fmv launch takes them (fmv's bits)."""
    rt, w0 = runtime(), ws[0]
    mod, name, _, _, _, _ = _float_plan(w0.type_id, w0.n_in, w0.n_out, 1)
    nw = max(_warps(0, w.n_out, rt.n_sm) for w in ws)
    table = ()
    for w, out in zip(ws, outs):
        table += (w.values, out, np.int32(w.n_out), np.int32(_grid(rt, w.n_out, nw)))
    grid = n_tok * sum(int(g) for g in table[3::4])
    table += (ws[0].values, outs[0], np.int32(0), np.int32(0)) * (MANY - len(ws))
    rt.launch(mod, "fmvm" + name[3:], grid, 32 * nw, (act, np.int32(ws[0].n_in), np.int32(n_tok)) + table)


def matmul_many(ws: list, act, outs: list) -> bool:
    """`matmul` of several weights of ONE type on the same input of 2 to MVF_TOKENS rows (a
    verify's), in one launch, as matvec_many is for one token: mvm of NT rows (mv<T, KPL, 0, NT>'s)
    where the matrices' rows together are few (MVT_TOKENS), else mvfm (mvf's), each matrix its own
    launch's rows, so its bits; or,
    for the float types, fmvm over the rows (fmv's bits, which fmt's and fmm's are). ws
    (GpuWeights, at most MANY), act (a GpuActQ [T, n_in], or device f32 [T, n_in]), outs (device
    f32 [T, n_out] each). False (nothing launched) where matmul would take neither (the wide form,
    more rows): the caller launches each."""
    if not _groupable(ws, act):
        return False
    rt, t = runtime(), ws[0].type
    n_tok = act.q.shape[0] if t.quantized else act.shape[0]
    if not 1 < n_tok <= max(MVF_TOKENS, MVT_TOKENS):
        return False
    if not t.quantized:
        _fmvm(ws, act, outs, n_tok)
        return True
    # the one-row kernel's NT rows where the matrices' rows together are few (MVT_TOKENS), else mvf
    share = sum(w.n_out for w in ws)
    plans = [_mv_launch(w.type_id, w.n_in, w.n_out, n_tok, share=share) for w in ws]
    if all(plans):
        _mvm(ws, act, outs, plans, n_tok)
        return True
    if n_tok > MVF_TOKENS:
        return False
    plans = [_mvf_launch(w.type_id, w.n_out, n_tok) for w in ws]
    # one block shape for all: the widest plan's warps; the grid copy in shared memory only where
    # every plan takes it (else each reads it from global memory: the same table, the same bits)
    m, block = _module(t.name), max(p[3] for p in plans)
    tab = min(int(p[5][1]) for p in plans)
    per_sm = 8 if tab else 32
    # the rows a warp takes: one R for the launch, by all its matrices' rows (they share the card)
    r = _mvf_rows(t.name, sum(w.n_out for w in ws), rt.n_sm)
    table = ()
    for w, out in zip(ws, outs):
        scales = w.scales if w.scales is not None else w.rest
        table += (w.rest, scales, out, np.int32(w.n_out), np.int32(_grid(rt, -(-w.n_out // r), block // 32, per_sm)))
    grid = sum(int(g) for g in table[4::5])
    w0 = ws[0]
    table += (w0.rest, w0.scales if w0.scales is not None else w0.rest, outs[0], np.int32(0), np.int32(0)) * (MANY - len(ws))
    args = (act.q, act.d, act.s16, np.int32(w0.n_in // QA), np.int32(n_tok), np.int32(tab))
    rt.launch(plans[0][0], f"mvfm<{t.id}, {r}>", grid, block, args + table, m.tab if tab else 0)
    return True


def matmul(w: GpuWeight, act, out=None, planes_out=None):
    """Y[t] = W X[t] for T tokens -> device f32 [T, n_out].

    act: GpuActQ [T, n_in] for block types (quantize_act_gpu), or GpuActQ16 (quantize_act16_gpu)
    for the actq.WIDE types, whose planes' products go to planes_out (device f32 [2T, n_out], made
    if None); device f32 [T, n_in] for F32/F16/BF16."""
    rt, t = runtime(), w.type
    where = f"matmul {w.label}"
    if isinstance(act, GpuActQ16):
        _check_wide(w, act, where)
        if act.one:
            raise TypeError(f"{where}: activations must be rows [T, {w.n_in}], got a single vector (use matvec)")
        out = _out(rt, out, (act.rows, w.n_out), where)
        if planes_out is not None:
            planes_out = _out(rt, planes_out, (2 * act.rows, w.n_out), f"{where} (planes_out)")
        _quant16(w, act, out, planes_out)
        return out
    if t.quantized:
        if not isinstance(act, GpuActQ) or act.q.ndim != 2 or act.n != w.n_in:
            raise TypeError(f"{where}: activations must be a GpuActQ of shape [T, {w.n_in}], got {_describe(act)}")
        if rt.ptr(act.q) % 16 or not all(a.flags.c_contiguous for a in (act.q, act.d, act.s16)):
            raise ValueError(f"{where}: the GpuActQ planes must be contiguous, q 16-byte aligned (as empty_act makes them)")
    elif isinstance(act, GpuActQ) or not rt.is_array(act) or act.dtype != np.float32 or act.ndim != 2 or act.shape[1] != w.n_in or not act.flags.c_contiguous:
        raise TypeError(f"{where}: {t.name} weights take contiguous device f32 activations [T, {w.n_in}], got {_describe(act)}")
    n_tok = act.q.shape[0] if t.quantized else act.shape[0]
    out = _out(rt, out, (n_tok, w.n_out), where)
    if not t.quantized and FMM == "tiles" and n_tok:  # fmt holds no per-token state: one launch
        _float(w, act, out)
        return out
    step = MAX_TOKENS
    if t.quantized and t.name in MMA_TYPES and n_tok > MAX_TOKENS:  # mmq: up to MMQ_LAUNCH_TOKENS a launch
        step = max(MAX_TOKENS, MMQ_LAUNCH_TOKENS)
    for a in range(0, n_tok, step):
        b = min(n_tok, a + step)
        if t.quantized:
            _quant(w, act.q[a:b], act.d[a:b], act.s16[a:b], out[a:b])
        else:
            _float(w, act[a:b], out[a:b])
    return out


# --- the dense prompt products through cuBLAS (gemm_products)
# A quantized weight's rows dequantized to f16 pairs (hi, lo: 22 bits), a slab of them at a time
# into one reused buffer, multiplied by the chunk's activations (the ActQ's values, as the token
# path multiplies them, also split in two f16) in two cuBLAS GEMMs with f32 accumulation: the
# int8 activations' product within float32 rounding, in another order than mm's, so not its bits.
# The device step's prompt takes it for the dense products, where the logits are the CPU's within
# float32 rounding either way (tests/gpu/test_device_step.py); never an expert, whose rows must be
# the CPU's bit for bit at every --expert-cache size (grouped_products).
# STRATA_GEMM: "off", or the fewest rows a product takes it from (default GEMM_MIN_TOKENS).
GEMM_MIN_TOKENS = 64
GEMM_SLAB_BYTES = 128 << 20  # the f16 pairs of a slab of weight rows: the budget's prompt.gemm (one launch set a
# product up to 128 MiB of pairs, 12288 x 2560 among them: at 256 tokens a 10240 x 2560 product in 4 slabs
# of 32 MiB was ~0.4 ms of launches, the host's time, not the card's, 2026-12-03)
GEMM_SCALE = 256.0  # to_h stores x / 256 (f16's range, gpu_kernels.cu), the GEMMs' alpha undoes it


def _gemm_setting(spec: str | None) -> int:
    if spec is None or spec == "":
        return GEMM_MIN_TOKENS
    if spec == "off":
        return 0
    if spec.isdigit() and int(spec) > 0:
        return int(spec)
    raise ValueError(f"STRATA_GEMM={spec!r}: expected off or the fewest prompt rows a dense product takes cuBLAS from (a positive integer)")


GEMM_FROM = _gemm_setting(os.environ.get("STRATA_GEMM"))  # 0: off


def gemm_takes(w: GpuWeight, n_tok: int) -> bool:
    """Whether the dense prompt product of w on n_tok rows goes through cuBLAS (gemm_products)."""
    if not (GEMM_FROM > 0 and n_tok >= GEMM_FROM and w.type.quantized):
        return False
    rt = runtime()
    # never inside a captured graph (a token step's, a verify's): CuPy refuses cuBLAS calls while a
    # stream captures (2026-12-03, H200: the card's test with the route from 1 row hit it)
    return hasattr(rt, "gemm_f16") and not rt.capturing()


def gemm_products(w: GpuWeight, act, out, xh, wh) -> None:
    """out f32 [T, n_out] = W x[t] for the T rows of act (a GpuActQ [T, n_in], or a GpuActQ16 for
    the wide weights: the values the token path multiplies), through cuBLAS: act's values / 256 as
    f16 pairs into xh (device u16 of 2 T n_in or more), W's rows in slabs as f16 pairs into wh (device
    u16 of 128 n_in or more: as many rows, a multiple of 64, as it holds); per slab hi hi with
    alpha 256, then [hi lo + lo hi] with alpha 256 / 2048 added."""
    rt, t = runtime(), w.type
    wide = isinstance(act, GpuActQ16)
    a = act.planes if wide else act
    n = a.q.shape[-1]
    T = a.q.shape[0] // 2 if wide else a.q.shape[0]
    if n != w.n_in or out.shape != (T, w.n_out):
        raise ValueError(f"gemm_products {w.label}: activations [{T}, {n}] and out {list(out.shape)} for a [{w.n_out}, {w.n_in}] weight")
    if xh.size < 2 * T * n:
        raise ValueError(f"gemm_products {w.label}: an activation buffer of {xh.size} f16 is short of {2 * T * n}")
    slab = min(w.n_out, wh.size // (2 * n) // 64 * 64)  # (a slab's first output column 256-byte aligned for cuBLAS)
    if slab == 0:
        raise ValueError(f"gemm_products {w.label}: a buffer of {wh.size} f16 holds fewer than 64 rows of {n} pairs")
    nb = n // QA
    rt.launch(_module("actq").mod, "to_h", _grid(rt, T * n, 256 * 8), 256, (a.q, a.d, xh, np.int64(T), np.int32(nb), np.int32(wide)))
    x2 = xh[: 2 * T * n].view(np.float16).reshape(T, 2 * n)  # [hi | lo]
    m = _module(t.name)
    scales = w.scales if w.scales is not None else w.rest
    for r0 in range(0, w.n_out, slab):
        rows = min(slab, w.n_out - r0)
        rt.launch(m.mod, f"deq_h<{t.id}>", _grid(rt, rows * nb, 256 * 4), 256,
                  (w.rest, scales, wh, np.int64(r0), np.int32(rows), np.int32(nb)))
        gemm_pairs(x2, wh[: 2 * rows * n].view(np.float16).reshape(rows, 2 * n), out[:, r0 : r0 + rows])


def gemm_pairs(x2, w2, out) -> None:
    """out = the product of f16 pairs: x2 [T, 2K] rows [hi | lo] (to_h's, values / 256), w2 [R, 2K] rows
    [lo | hi] (deq_h's): hi hi with alpha 256, then hi lo + lo hi (one GEMM over the whole rows) with
    alpha 256 / 2^11 added."""
    rt, n = runtime(), x2.shape[1] // 2
    rt.gemm_f16(x2[:, :n], w2[:, n:], out, GEMM_SCALE, 0.0)
    rt.gemm_f16(x2, w2, out, GEMM_SCALE / 2048, 1.0)


def matvec(w: GpuWeight, act, out=None):
    """y = W x -> device f32 [n_out]; act: GpuActQ [n_in] (block types) or device f32 [n_in]."""
    rt = runtime()
    if isinstance(act, GpuActQ16):
        where = f"matvec {w.label}"
        _check_wide(w, act, where)
        if not act.one:
            raise TypeError(f"{where}: activations must be a single vector, got {_describe(act)} (use matmul)")
        out = _out(rt, out, (w.n_out,), where)
        _quant16(w, act, out)
        return out
    if isinstance(act, GpuActQ):
        if act.q.ndim != 1:
            raise TypeError(f"matvec {w.label}: activations must be a single vector, got {_describe(act)} (use matmul)")
        act2 = GpuActQ(act.q.reshape(1, -1), act.d.reshape(1, -1), act.s16.reshape(1, -1), act.bad)
    else:
        if not rt.is_array(act) or act.ndim != 1:
            raise TypeError(f"matvec {w.label}: activations must be a single device vector, got {_describe(act)} (use matmul)")
        act2 = act.reshape(1, -1)
    out2 = None if out is None else _out(rt, out, (w.n_out,), f"matvec {w.label}").reshape(1, -1)
    return matmul(w, act2, out2)[0]


def _describe(a) -> str:
    if isinstance(a, GpuActQ16):
        return f"GpuActQ16 of {a.rows} rows of {a.n}"
    if isinstance(a, GpuActQ):
        return f"GpuActQ {list(a.q.shape)}"
    if isinstance(a, ActQ):
        return f"host ActQ {list(a.q.shape)} (quantize on the device: quantize_act_gpu)"
    if a is None:
        return "None"
    return f"{type(a).__module__}.{type(a).__name__} {getattr(a, 'dtype', '')}{list(getattr(a, 'shape', []))}"

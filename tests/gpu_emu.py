"""A host runtime for strata.engine.kernels.gpu: gpu_kernels.cu compiled by the host C++ compiler
against tests/gpu_emu.h and run thread by thread, so the kernels are checked bit for bit on a
machine without a GPU. Device arrays are numpy arrays; a launch runs every thread of every block.

    rt = EmuRuntime.create()          # None when there is no C++ compiler or the host is not x86-64
    before = gpu.use_runtime(rt)

Builds are cached by content hash under $STRATA_EMU_CACHE (default: the system temp folder).
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import numpy as np

from strata.engine.kernels import gpu

HEADER = Path(__file__).with_name("gpu_emu.h")
# -ffp-contract=off: no FMA; x86-64 float arithmetic is SSE, rounded per operation like the GPU's
FLAGS = ["-std=c++17", "-O1", "-ffp-contract=off", "-fno-fast-math", "-fPIC", "-shared", "-w"]


def _compiler() -> str | None:
    return shutil.which(os.environ.get("CXX", "g++")) or shutil.which("c++")


def unavailable_reason() -> str | None:
    if platform.machine() not in ("x86_64", "AMD64"):
        return f"the emulation's float arithmetic is checked on x86-64 only (this is {platform.machine()})"
    if _compiler() is None:
        return "no C++ compiler (g++ or $CXX) to build the GPU emulation"
    return None


class _Lib:
    def __init__(self, path: Path):
        self.lib = ctypes.CDLL(str(path))
        self.lib.emu_launch.restype = ctypes.c_int
        self.lib.emu_launch.argtypes = [ctypes.c_char_p, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int]


class EmuRuntime:
    """gpu.CupyRuntime's interface on the host (see that class)."""

    xp = np  # the array module of this runtime's arrays: numpy (CuPy on a card)

    def __init__(self, n_sm: int = 1):
        self.n_sm = n_sm
        self._cublas = False  # gemm_f16 called once (the handle made)
        self.allocations = self.pinned_allocations = self.allocated = 0
        self.registered: list[tuple[int, int]] = []  # register_host's [start, end) host ranges
        self.cache = Path(os.environ.get("STRATA_EMU_CACHE", Path(tempfile.gettempdir()) / "strata_gpu_emu"))

    @classmethod
    def create(cls) -> "EmuRuntime | None":
        return None if unavailable_reason() else cls()

    # arrays: 64-byte aligned numpy buffers, as a device allocation would be
    def empty(self, shape, dtype):
        shape = (shape,) if np.isscalar(shape) else tuple(shape)
        dt = np.dtype(dtype)
        n = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
        self.allocations += 1
        self.allocated += n
        buf = np.empty(n + 64, np.uint8)
        off = -buf.ctypes.data % 64
        return buf[off : off + n].view(dt).reshape(shape)

    def to_device(self, a):
        a = np.ascontiguousarray(a)
        out = self.empty(a.shape, a.dtype)
        out[...] = a
        return out

    def to_host(self, a) -> np.ndarray:
        return np.array(a, copy=True)

    def is_array(self, a) -> bool:
        return isinstance(a, np.ndarray)

    def ptr(self, a) -> int:
        return a.ctypes.data

    def compile(self, names: list[str], source: Path = gpu.SOURCE) -> _Lib:
        table = ",\n".join(f'    emu_entry("{n}", &{n.replace(" ", "")})' for n in names)
        unit = (
            f'#include "{HEADER}"\n#include "{source}"\n'
            f"static const EmuEntry k_table[] = {{\n{table}\n}};\n"
            "const EmuEntry* emu_table(int* n) { *n = sizeof(k_table) / sizeof(k_table[0]); return k_table; }\n"
        )
        # a benchmark's knobs (gpu.OPTIONS' -D settings: STRATA_MT_WC=4 ...) build the same variant here
        flags = FLAGS + [o for o in gpu.OPTIONS if o.startswith("-D")]
        key = hashlib.sha256((unit + HEADER.read_text() + Path(source).read_text() + " ".join(flags)).encode()).hexdigest()[:20]
        so = self.cache / f"emu_{key}.so"
        if not so.exists():
            self.cache.mkdir(parents=True, exist_ok=True)
            src = self.cache / f"emu_{key}.cpp"
            src.write_text(unit)
            tmp = so.with_suffix(f".{os.getpid()}.tmp")
            r = subprocess.run([_compiler(), *flags, "-o", str(tmp), str(src)], capture_output=True, text=True)
            if r.returncode:
                raise RuntimeError(f"building the GPU emulation failed ({' '.join(names)}):\n{r.stderr[-4000:]}")
            os.replace(tmp, so)
        return _Lib(so)

    # one launch at a time: the emulation's fibers and their stacks are the library's globals, and the
    # layer stream (engine/tier/staging.py) launches from a worker thread beside the main one
    _lock = threading.Lock()

    def launch(self, mod: _Lib, name: str, grid: int, block: int, args: tuple, smem: int = 0) -> None:
        with self._lock:
            self._launch(mod, name, grid, block, args, smem)

    def _launch(self, mod: _Lib, name: str, grid: int, block: int, args: tuple, smem: int = 0) -> None:
        held = [_arg(a) for a in args]
        params = (ctypes.c_void_p * len(held))(*[ctypes.cast(ctypes.pointer(h), ctypes.c_void_p) for h in held])
        err = ctypes.create_string_buffer(512)
        rc = mod.lib.emu_launch(name.encode(), grid, block, smem, params, err, len(err))
        if rc:
            raise RuntimeError(f"emulated launch of {name} (grid {grid}, block {block}, {smem} B shared): {err.value.decode()}")

    # what the GPU tier needs (gpu.CupyRuntime's second part): device memory is host memory here,
    # so copies are assignments; allocations are counted (the S12 test) and free memory is a card
    # of `total` bytes less what was allocated
    total = 80 << 30

    def copy_in(self, dev, host: np.ndarray) -> None:
        if dev.shape != host.shape or dev.dtype != host.dtype:
            raise ValueError(f"emulated copy_in: {host.dtype}{list(host.shape)} into {dev.dtype}{list(dev.shape)}")
        dev[...] = host

    def copy_out(self, host: np.ndarray, dev) -> None:
        if dev.shape != host.shape or dev.dtype != host.dtype:
            raise ValueError(f"emulated copy_out: {dev.dtype}{list(dev.shape)} into {host.dtype}{list(host.shape)}")
        host[...] = dev

    # (the emulation runs every launch at once: an asynchronous copy is a copy, and a second stream
    # or a marker orders nothing that is not already done)
    copy_out_async = copy_out

    def copy_in_async(self, dev, host: np.ndarray, stream=None) -> None:
        a, b = host.ctypes.data, host.ctypes.data + host.nbytes
        for r0, r1 in self.registered:  # one DMA from registered pages stays inside one registration
            if a < r1 and r0 < b and not (r0 <= a and b <= r1):
                raise RuntimeError(f"emulated copy_in_async: host bytes [{a:#x}, {b:#x}) cross the registration "
                                   f"[{r0:#x}, {r1:#x})")
        self.copy_in(dev, host)

    def register_host(self, ptr: int, nbytes: int) -> None:
        """cudaHostRegister's rules, kept: whole pages, and no page registered twice."""
        if ptr % 4096 or nbytes % 4096 or nbytes <= 0:
            raise RuntimeError(f"emulated register_host: [{ptr:#x}, +{nbytes}) is not whole pages")
        if any(ptr < r1 and r0 < ptr + nbytes for r0, r1 in self.registered):
            raise RuntimeError("emulated register_host: cudaErrorHostMemoryAlreadyRegistered")
        self.registered.append((ptr, ptr + nbytes))

    def unregister_host(self, ptr: int) -> None:
        got = [r for r in self.registered if r[0] == ptr]
        if not got:
            raise RuntimeError("emulated unregister_host: cudaErrorHostMemoryNotRegistered")
        self.registered.remove(got[0])

    def copy_stream(self):
        return "copy stream"

    def marker(self):
        return "marker"

    def mark_on(self, marker, stream=None) -> None:
        pass

    def stream_wait(self, stream, marker) -> None:
        pass

    def host_wait(self, marker) -> None:
        pass

    def on(self, stream):
        return contextlib.nullcontext()

    def view(self, arena, offset: int, shape, dtype):
        n = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        return arena[offset : offset + n].view(dtype).reshape(shape)

    def pinned(self, nbytes: int) -> np.ndarray:
        self.pinned_allocations += 1
        return np.zeros(nbytes, np.uint8)

    def mem_info(self) -> tuple[int, int]:
        return self.total - self.allocated, self.total

    def synchronize(self) -> None:
        pass

    def use_stream(self):
        return None

    def enter_thread(self) -> None:
        pass

    def retake_stream(self) -> bool:  # (one stream: nothing to retake)
        return False

    def release(self) -> None:
        pass

    def capturing(self) -> bool:  # (the emulation captures no graphs)
        return False

    def cublas_held(self) -> bool:
        return self._cublas

    def gemm_f16(self, x, w, out, alpha: float, beta: float) -> None:
        """cuBLAS's f16 GEMM with f32 accumulation: here in float64, rounded once (its order of
        summation is cuBLAS's own; the callers hold it to a tolerance, not to bits). The first call
        counts the memory cuBLAS takes on a card for its handle, workspace and kernels as allocated
        (the budget's prompt.cublas: a figure measured on the H200, which the card's tests hold to
        the 1% of the marks; here every other byte is still counted exactly)."""
        if not self._cublas:
            from strata.engine.budget import CUBLAS_BYTES

            self._cublas = True
            self.allocated += CUBLAS_BYTES
        y = np.float64(np.float32(alpha)) * (x.astype(np.float64) @ w.astype(np.float64).T)
        if beta != 0:  # (beta 0: out is not read, as cuBLAS specifies: NaN there is overwritten)
            y = y + np.float64(np.float32(beta)) * out
        out[...] = y.astype(np.float32)

    def set_global(self, mod: _Lib, name: str, host: np.ndarray) -> None:
        host = np.ascontiguousarray(host)
        addr = ctypes.addressof(ctypes.c_char.in_dll(mod.lib, name))
        ctypes.memmove(addr, host.ctypes.data, host.nbytes)


def _arg(a):
    if isinstance(a, np.ndarray):
        return ctypes.c_void_p(a.ctypes.data)
    for np_t, c_t in ((np.int32, ctypes.c_int32), (np.int64, ctypes.c_int64), (np.uint64, ctypes.c_uint64),
                      (np.float32, ctypes.c_float)):
        if isinstance(a, np_t):
            return c_t(a.item())
    raise TypeError(f"emulated launch: unsupported argument {a!r} ({type(a).__name__}); pass numpy scalars of the kernel's type")

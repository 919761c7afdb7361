"""Compile the CUDA sources with NVRTC on a machine without a GPU (tests/test_cuda_compiles.py).

The host emulation (tests/gpu_emu.py) runs the kernels' C++ through the host compiler, which takes
things NVRTC refuses (and the reverse); a kernel that NVRTC cannot compile breaks every launch of
its module on the card, where a session may have no card to find it. NVRTC itself needs no GPU: its
library comes as a wheel (nvidia-cuda-nvrtc, the test extras), called here through ctypes as CuPy's
RawModule calls it on the card: the same options (kernels/gpu.py OPTIONS) and the same name
expressions (each template instantiated as its launches name it).
"""

from __future__ import annotations

import ctypes
import glob
import os
from pathlib import Path


def library() -> Path | None:
    """libnvrtc of the installed nvidia-cuda-nvrtc wheel (or STRATA_NVRTC), or None."""
    if os.environ.get("STRATA_NVRTC"):
        return Path(os.environ["STRATA_NVRTC"])
    try:
        import nvidia  # the namespace package the nvidia-* wheels install into
    except ImportError:
        return None
    for root in getattr(nvidia, "__path__", []):
        found = sorted(glob.glob(os.path.join(root, "*", "lib", "libnvrtc.so*")))
        found = [f for f in found if "builtins" not in f]
        if found:
            return Path(found[-1])
    return None


class NvrtcError(RuntimeError):
    pass


def compile_source(lib: Path, source: str, name: str, options: tuple[str, ...], names: list[str]) -> str:
    """NVRTC-compile `source` (file name `name`, for the messages) with `options`, instantiating every
    name expression in `names` -> the PTX; NvrtcError with NVRTC's log where it refuses."""
    nv = ctypes.CDLL(str(lib))
    prog = ctypes.c_void_p()

    def check(rc, what):
        if rc != 0:
            nv.nvrtcGetErrorString.restype = ctypes.c_char_p
            raise NvrtcError(f"{name}: {what}: {nv.nvrtcGetErrorString(rc).decode()}")

    check(nv.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), name.encode(), 0, None, None), "nvrtcCreateProgram")
    try:
        for n in names:
            check(nv.nvrtcAddNameExpression(prog, n.encode()), f"name expression {n}")
        opts = [o.encode() for o in options]
        arr = (ctypes.c_char_p * len(opts))(*opts)
        rc = nv.nvrtcCompileProgram(prog, len(opts), arr)
        size = ctypes.c_size_t()
        nv.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        nv.nvrtcGetProgramLog(prog, log)
        if rc != 0:
            raise NvrtcError(f"{name}: NVRTC refused it:\n{log.value.decode(errors='replace')}")
        for n in names:  # every launch's name resolves to a compiled kernel
            lowered = ctypes.c_char_p()
            check(nv.nvrtcGetLoweredName(prog, n.encode(), ctypes.byref(lowered)), f"lowered name of {n}")
        nv.nvrtcGetPTXSize(prog, ctypes.byref(size))
        ptx = ctypes.create_string_buffer(size.value)
        check(nv.nvrtcGetPTX(prog, ptx), "nvrtcGetPTX")
        return ptx.value.decode(errors="replace")
    finally:
        nv.nvrtcDestroyProgram(ctypes.byref(prog))

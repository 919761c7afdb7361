"""The Numba flags of every kernel, in one place (STUMPY's habit), and their disk cache.

fastmath stays False: it would let LLVM contract a*b+c into an FMA and reassociate sums, and the
specified arithmetic (docs/kernels.md) would no longer be what runs -- the GPU could not match it.
error_model="numpy" drops Python's ZeroDivisionError checks from the inner loops (every divisor in
the kernels is checked or a nonzero constant). boundscheck stays off: the wrappers validate sizes.

The disk cache (`cached`): compiling the kernels took 20-30 s at every start of the demo model.
Numba's `cache=True` does not fit them: it checks only the cached function's source file, but the
kernels also compile simd.py's intrinsics and the iq_tables arrays into their code, and simd.py
picks instructions by STRATA_SIMD_FEATURES, so it would hand an edited simd.py, or a narrowed
feature set, yesterday's machine code (the fallback-path test would then test nothing); its key
pickles closure cells, which for our kernels (closures over dispatchers) differ in every process;
and it refuses to import at all where no cache directory is writable. `cached` keeps numba's
choice of directory (NUMBA_CACHE_DIR, else __pycache__ beside the source, else the user's cache
directory when the install is read-only) and its file format, and changes what an entry is tied to:
- stamp: the content of the files the kernels compile in (_SOURCES) and of the function's own
  file: any edit there invalidates the entry;
- file name: the kernel's tag and the SIMD features it was compiled for (feature sets coexist),
  and simd.POOL_TAG (the work queues' code with and without STRATA_MAIN_ORCHESTRATES);
- key: the argument types and numba's target description (CPU name and features).
It relies on numba internals (FunctionCache, its _index_key, a dispatcher's _cache; numba 0.68):
tests/engine/test_kernels_cpu.py checks that a second process loads instead of compiling.
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import sys
import warnings
from pathlib import Path

from numba import njit
from numba.core.caching import FunctionCache, IndexDataCacheFile

from .simd import FEATURES, POOL_TAG

JIT = dict(nogil=True, fastmath=False, boundscheck=False, error_model="numpy")


# The files whose code or constants the compiled kernels contain (not gpu.py or reference.py:
# the GPU side changes often and must not cost the CPU kernels a recompilation).
_SOURCES = ("cpu.py", "simd.py", "actq.py", "jit.py", "iq_tables.py")


def _stamp(paths) -> str:
    h = hashlib.sha256()
    for p in paths:
        h.update(p.name.encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()


_KERNEL_STAMP = _stamp(Path(__file__).parent / name for name in _SOURCES)


# Called with a kernel's tag when it is not in the disk cache and is about to compile (seconds
# each): the command line says so while a first start compiles (docs/engine.md, "first start").
_listeners: list = []


@contextlib.contextmanager
def on_compile(fn):
    """fn(tag, cache directory) for every kernel compiled (not loaded from the disk cache) inside the block."""
    _listeners.append(fn)
    try:
        yield
    finally:
        _listeners.remove(fn)


class _KernelCache(FunctionCache):
    def __init__(self, py_func, name: str, also=()):
        super().__init__(py_func)  # raises RuntimeError when no directory is writable
        self.tag = name
        base = f"strata-{name}.py{sys.version_info[0]}{sys.version_info[1]}"
        # the function's own file too: a user outside this package (engine/ops.py) is covered
        stamp = _KERNEL_STAMP + _stamp([Path(inspect.getfile(py_func)), *map(Path, also)])
        self._cache_file = IndexDataCacheFile(self._cache_path, base, stamp)

    def load_overload(self, sig, target_context):
        found = super().load_overload(sig, target_context)
        if found is None:
            for fn in list(_listeners):
                fn(self.tag, self._cache_path)
        return found

    def _index_key(self, sig, codegen):
        # numba's key adds a pickle of the closure's cells: our kernels close over dispatchers,
        # whose pickle holds a per-process id, so that key would never match in a new process.
        return (sig, codegen.magic_tuple())


def cached(dispatcher, tag: str, also=()):
    """Give a Numba dispatcher the disk cache described above; `tag` names the kernel uniquely
    (type, variant); `also`: further source files its code compiles in (their edits invalidate it
    too). Without a writable cache directory it compiles at every start, as numba's `cache=True`
    would refuse to import there at all."""
    try:
        dispatcher._cache = _KernelCache(dispatcher.py_func, f"{tag}-{FEATURES}{POOL_TAG}", also)
    except RuntimeError as e:  # numba found no writable directory
        warnings.warn(f"{e}: the kernels compile at every start (set NUMBA_CACHE_DIR to a writable directory)", RuntimeWarning, stacklevel=2)
    return dispatcher


def cached_njit(tag: str, **flags):
    """@njit(**JIT, **flags) with `cached(..., tag)`: the decorator of module-level kernels."""
    return lambda fn: cached(njit(**JIT, **flags)(fn), tag)


# A prompt chunk's rows of a row-wise kernel (the ActQ, the grouped norm's scale, the MoE's combine,
# the hyper-connections' mix and inject, the conv taps) go across the CPU threads from this many
# rows; a token's row and a verify's few keep the serial loop, where a parallel launch would cost
# more than the work. On the 2-core VM these kernels were ~5% of a 512-token chunk at 2 threads,
# serial; with the products' kernels on 8 threads they would be several times that share.
PARALLEL_ROWS = 16


class RowKernel:
    """A kernel whose outer loop is `prange` over rows, compiled twice: serial (prange is range
    there) and parallel; a call takes the parallel one from PARALLEL_ROWS rows (the leading
    dimension of argument `rows`). Each row's arithmetic is the same in both, so the same bits."""

    def __init__(self, fn, tag: str, rows: int):
        self.serial = cached(njit(**JIT)(fn), tag)
        self.parallel = cached(njit(parallel=True, **JIT)(fn), f"{tag}-rows")
        self.rows = rows

    def __call__(self, *args):
        return (self.parallel if args[self.rows].shape[0] >= PARALLEL_ROWS else self.serial)(*args)


def cached_row_kernel(tag: str, rows: int = 0):
    """The decorator of a RowKernel: `rows` is the argument whose leading dimension counts the rows."""
    return lambda fn: RowKernel(fn, tag, rows)

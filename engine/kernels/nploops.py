"""numpy's own inner loops, called from Numba kernels: a fused pass keeps the bits of the numpy call
it takes in.

Why: the host's elementwise steps were matched to numpy's SIMD exp, step for step (hyper.py,
ple.py, ops.sigmoid). A Numba loop's exp is libm's or LLVM's, other functions with other bits, so
each such exp stayed a numpy call between two kernels: a Python call and, right after a product
has streamed megabytes through the caches, 10-40 us of cache misses each at one thread on the
2-core VM (docs/performance.md, session 28). numpy keeps each ufunc's inner loops in a C table
(`PyUFuncObject.functions`, the public struct of numpy's ufuncobject.h), the float32 one being the
loop numpy chose for this CPU at import. A kernel given that loop's address calls it on a
contiguous run of values, as numpy's own call would.

The address is a run-time argument of the kernels, never a constant in their code: the disk cache
(jit.py) keeps machine code across processes, and the table moves with every process.

EXP is np.exp's float32 loop, or 0 where the table cannot be read as expected (another numpy's
layout) or the loop, called through ctypes on a probe of special and random values, does not give
np.exp's bits: callers then keep the numpy call (and `np.exp` stays what tests compare against).
"""

from __future__ import annotations

import ctypes

import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

F32 = np.float32


class _UFunc(ctypes.Structure):
    # the leading fields of PyUFuncObject (numpy/ufuncobject.h, the same in numpy 1.26 and 2.x)
    _fields_ = [("ob_refcnt", ctypes.c_ssize_t), ("ob_type", ctypes.c_void_p), ("nin", ctypes.c_int),
                ("nout", ctypes.c_int), ("nargs", ctypes.c_int), ("identity", ctypes.c_int),
                ("functions", ctypes.POINTER(ctypes.c_void_p)), ("data", ctypes.POINTER(ctypes.c_void_p)),
                ("ntypes", ctypes.c_int), ("reserved1", ctypes.c_int), ("name", ctypes.c_char_p),
                ("types", ctypes.c_void_p)]


# numpy's inner-loop signature: void loop(char **args, npy_intp const *dimensions, npy_intp const *steps, void *data)
_LOOP = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p)


def _probe() -> np.ndarray:
    special = [0.0, -0.0, 1.0, -1.0, 88.0, 88.8, 89.0, -87.0, -103.0, -104.0, 1e-40, -1e-40, 1e-7, 3.4e38,
               -3.4e38, np.inf, -np.inf, np.nan]
    rng = np.random.default_rng(20261204)
    return np.concatenate([np.array(special, F32), (rng.standard_normal(4093) * 20).astype(F32),
                           rng.uniform(-110, 90, 4093).astype(F32)])


def unary_loop_address(uf: np.ufunc, sig: str, check) -> int:
    """The address of `uf`'s inner loop for `sig` ("f->f"), or 0 where the table is not as expected,
    its loop needs data, or check(call) is False (call(x, out) runs the loop through ctypes)."""
    try:
        s = _UFunc.from_address(id(uf))
        if s.name is None or s.name.decode() != uf.__name__ or s.ntypes != len(uf.types) or (s.nin, s.nout) != (1, 1):
            return 0
        i = uf.types.index(sig)
        fn, data = s.functions[i], s.data[i]
    except (ValueError, UnicodeDecodeError):
        return 0
    if not fn or data:
        return 0
    loop = _LOOP(fn)

    def call(x, out):
        args = (ctypes.c_void_p * 2)(x.ctypes.data, out.ctypes.data)
        n = (ctypes.c_ssize_t * 1)(x.size)
        steps = (ctypes.c_ssize_t * 2)(x.itemsize, out.itemsize)
        loop(args, n, steps, None)

    with np.errstate(all="ignore"):
        return int(fn) if check(call) else 0


def _exp_matches(call) -> bool:
    x = _probe()
    out = np.empty_like(x)
    call(x, out)
    return np.array_equal(out.view(np.uint32), np.exp(x).view(np.uint32))


EXP = unary_loop_address(np.exp, "f->f", _exp_matches)


@intrinsic
def unary_loop(typingctx, fn, x, out):
    """Call the numpy float32 inner loop at address fn (an integer, e.g. EXP) on every value of x into
    out: contiguous float32 arrays of x's size (out may be x: numpy's loops run in place)."""
    if not (isinstance(fn, types.Integer) and all(isinstance(a, types.Array) and a.dtype == types.float32
                                                   and a.layout == "C" for a in (x, out))):
        return None

    def codegen(context, builder, sig, args):
        fnv, xv, ov = args
        xa = context.make_array(sig.args[1])(context, builder, xv)
        oa = context.make_array(sig.args[2])(context, builder, ov)
        i8p, i64 = ir.IntType(8).as_pointer(), ir.IntType(64)
        argv = cgutils.alloca_once(builder, i8p, size=2)
        builder.store(builder.bitcast(xa.data, i8p), argv)
        builder.store(builder.bitcast(oa.data, i8p), builder.gep(argv, [ir.Constant(i64, 1)]))
        dims = cgutils.alloca_once_value(builder, builder.sext(xa.nitems, i64) if xa.nitems.type.width < 64 else xa.nitems)
        steps = cgutils.alloca_once(builder, i64, size=2)
        builder.store(ir.Constant(i64, 4), steps)
        builder.store(ir.Constant(i64, 4), builder.gep(steps, [ir.Constant(i64, 1)]))
        fnty = ir.FunctionType(ir.VoidType(), [i8p.as_pointer(), i64.as_pointer(), i64.as_pointer(), i8p])
        address = context.cast(builder, fnv, sig.args[0], types.int64)
        builder.call(builder.inttoptr(address, fnty.as_pointer()), [argv, dims, steps, ir.Constant(i8p, None)])
        return context.get_dummy_value()

    return types.void(fn, x, out), codegen

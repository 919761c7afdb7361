"""Small SIMD primitives for the CPU kernels, as Numba intrinsics that emit LLVM vector IR.

Why intrinsics: Numba gives LLVM no way to vectorize a 32-element loop well. With a literal trip
count LLVM unrolls the loop before the vectorizer runs and the unrolled int8 dot stays scalar;
with a runtime trip count it picks a 64-wide body that a 32-element block never enters. Either
way the int8 dot ran 3-6x below the hardware (measured on Zen 5: 5 GB/s of Q8_0 where one
<32 x i8> load, sext, multiply, reduce gives 35 GB/s).

All of it is exact integer arithmetic: order does not matter and nothing here is part of the
floating-point specification (docs/kernels.md). Every primitive touches exactly the bytes it
names, never past them: the wrappers in cpu.py validate buffer sizes, these do not check.

Notation: (a, i) is array a (any integer dtype, read as bytes) from element i; (dst, di) is an
int8 array written from element di. Shifts of byte vectors are done on 16-bit lanes (x86 has no
byte shift); every caller's mask clears the bits that crossed from the neighbouring byte.
"""

from __future__ import annotations

import hashlib
import os

import llvmlite.binding as llvm
import numpy as np
from llvmlite import ir
from numba import get_thread_id, njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

I8, I16, I32, I64 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64)
V16, V32 = ir.VectorType(I8, 16), ir.VectorType(I8, 32)

# Host x86 features (empty elsewhere): Numba compiles for the host CPU, so these are safe to use.
# STRATA_SIMD_FEATURES="avx2,ssse3" (or "" for none) narrows them, so the fallback paths can be
# tested on a machine that would never take them (tests/engine/test_kernels_cpu.py does).
_X86 = {k: v for k, v in llvm.get_host_cpu_features().items() if v} if llvm.get_default_triple().startswith("x86_64") else {}
if "STRATA_SIMD_FEATURES" in os.environ:
    _allowed = {f.strip() for f in os.environ["STRATA_SIMD_FEATURES"].split(",") if f.strip()}
    _X86 = {k: v for k, v in _X86.items() if k in _allowed}
# Names the compiled code's feature set in the kernel cache (jit.py): narrowed features compile
# different code for the same CPU, so they must not share cache entries with the full set.
FEATURES = hashlib.sha256(",".join(sorted(_X86)).encode()).hexdigest()[:12]


def _ptr(context, builder, arrty, arr, idx, idxty, elt):
    """Pointer to arr[idx] typed as a pointer to `elt` (a scalar or vector LLVM type)."""
    a = context.make_array(arrty)(context, builder, arr)
    i = context.cast(builder, idx, idxty, types.intp)
    return builder.bitcast(builder.gep(a.data, [i]), elt.as_pointer())


def _load(context, builder, sig, args, k, elt):
    """Unaligned load of `elt` from (array args[k], index args[k + 1])."""
    return builder.load(_ptr(context, builder, sig.args[k], args[k], args[k + 1], sig.args[k + 1], elt), align=1)


def _store(context, builder, sig, args, k, vec):
    """Unaligned store of `vec` to (array args[k], index args[k + 1])."""
    builder.store(vec, _ptr(context, builder, sig.args[k], args[k], args[k + 1], sig.args[k + 1], vec.type), align=1)


def _mask(n, idx):
    return ir.Constant(ir.VectorType(I32, n), list(idx))


def _splat(builder, scalar, vecty):
    v = builder.insert_element(ir.Constant(vecty, ir.Undefined), scalar, ir.Constant(I32, 0))
    return builder.shuffle_vector(v, ir.Constant(vecty, ir.Undefined), _mask(vecty.count, [0] * vecty.count))


def _scalar(context, builder, sig, args, k, ty):
    """Argument k (any integer type) truncated to the LLVM integer type `ty`."""
    return builder.trunc(context.cast(builder, args[k], sig.args[k], types.int64), ty)


def _byte_splat(context, builder, sig, args, k):
    return _splat(builder, _scalar(context, builder, sig, args, k, I8), V32)


def _shift_bytes(builder, v, count, right):
    """<32 x i8> shifted by a runtime count through 16-bit lanes (bits cross between bytes)."""
    w = builder.bitcast(v, ir.VectorType(I16, 16))
    c = _splat(builder, builder.zext(count, I16), ir.VectorType(I16, 16))
    return builder.bitcast(builder.lshr(w, c) if right else builder.shl(w, c), V32)


def _fn(builder, name, ret, params):
    try:
        return builder.module.get_global(name)
    except KeyError:
        return ir.Function(builder.module, ir.FunctionType(ret, params), name)


# ---------------------------------------------------------------------------------------------
# unpacking: a block's quantized fields -> 32 int8 values at (dst, di)


@intrinsic
def copy32(typingctx, src, si, dst, di):
    """dst[di + j] = src[si + j], j < 32 (Q8_0)"""

    def codegen(context, builder, sig, args):
        _store(context, builder, sig, args, 2, _load(context, builder, sig, args, 0, V32))
        return context.get_dummy_value()

    return types.void(src, si, dst, di), codegen


@intrinsic
def nibbles(typingctx, src, si, dst, di, off):
    """16 bytes -> 32 values: dst[di + j] = (src[si + j] & 15) - off, dst[di + 16 + j] = (src[si + j] >> 4) - off"""

    def codegen(context, builder, sig, args):
        v = _load(context, builder, sig, args, 0, V16)
        lo = builder.and_(v, _splat(builder, ir.Constant(I8, 15), V16))
        hi = builder.lshr(v, _splat(builder, ir.Constant(I8, 4), V16))
        both = builder.shuffle_vector(lo, hi, _mask(32, range(32)))
        _store(context, builder, sig, args, 2, builder.sub(both, _byte_splat(context, builder, sig, args, 4)))
        return context.get_dummy_value()

    return types.void(src, si, dst, di, off), codegen


@intrinsic
def bits(typingctx, src, si, dst, di, shift, mask, off):
    """dst[di + j] = ((src[si + j] >> shift) & mask) - off, j < 32; needs mask < 2**(8 - shift)"""

    def codegen(context, builder, sig, args):
        v = _load(context, builder, sig, args, 0, V32)
        q = builder.and_(_shift_bytes(builder, v, _scalar(context, builder, sig, args, 4, I8), True), _byte_splat(context, builder, sig, args, 5))
        _store(context, builder, sig, args, 2, builder.sub(q, _byte_splat(context, builder, sig, args, 6)))
        return context.get_dummy_value()

    return types.void(src, si, dst, di, shift, mask, off), codegen


@intrinsic
def or_bits(typingctx, src, si, dst, di, shift, mask, lshift, off):
    """dst[di + j] = (dst[di + j] | (((src[si + j] >> shift) & mask) << lshift)) - off, j < 32;
    needs mask < 2**(8 - shift) and mask << lshift < 256"""

    def codegen(context, builder, sig, args):
        v = _load(context, builder, sig, args, 0, V32)
        d = _load(context, builder, sig, args, 2, V32)
        q = builder.and_(_shift_bytes(builder, v, _scalar(context, builder, sig, args, 4, I8), True), _byte_splat(context, builder, sig, args, 5))
        hi = _shift_bytes(builder, q, _scalar(context, builder, sig, args, 6, I8), False)
        _store(context, builder, sig, args, 2, builder.sub(builder.or_(d, hi), _byte_splat(context, builder, sig, args, 7)))
        return context.get_dummy_value()

    return types.void(src, si, dst, di, shift, mask, lshift, off), codegen


@intrinsic
def or_word_bits(typingctx, word, dst, di, lshift, off):
    """dst[di + j] = (dst[di + j] | (((word >> j) & 1) << lshift)) - off, j < 32 (Q5_0/Q5_1's qh)"""

    def codegen(context, builder, sig, args):
        w32 = ir.VectorType(I32, 32)
        w = _splat(builder, _scalar(context, builder, sig, args, 0, I32), w32)
        bit = builder.trunc(builder.and_(builder.lshr(w, ir.Constant(w32, list(range(32)))), _splat(builder, ir.Constant(I32, 1), w32)), V32)
        d = _load(context, builder, sig, args, 1, V32)
        hi = builder.shl(bit, _byte_splat(context, builder, sig, args, 3))
        _store(context, builder, sig, args, 1, builder.sub(builder.or_(d, hi), _byte_splat(context, builder, sig, args, 4)))
        return context.get_dummy_value()

    return types.void(word, dst, di, lshift, off), codegen


@intrinsic
def crumbs64(typingctx, src, si, dst, di, off):
    """16 bytes -> 64 two-bit fields packed in order (Q2_0): dst[di + i] = ((src[si + i/4] >> 2(i%4)) & 3) - off.

    Four uniform shifts, then one byte interleave (x86 has no per-byte variable shift)."""

    def codegen(context, builder, sig, args):
        v = _load(context, builder, sig, args, 0, V16)
        three = _splat(builder, ir.Constant(I8, 3), V16)
        parts = [builder.and_(builder.lshr(v, _splat(builder, ir.Constant(I8, 2 * k), V16)), three) for k in range(4)]
        pair01 = builder.shuffle_vector(parts[0], parts[1], _mask(32, range(32)))
        pair23 = builder.shuffle_vector(parts[2], parts[3], _mask(32, range(32)))
        # element 4j + k comes from parts[k][j]: parts 0, 1 are lanes 0..31 of pair01, 2, 3 of pair23
        out = builder.shuffle_vector(pair01, pair23, _mask(64, [16 * (i % 4) + i // 4 for i in range(64)]))
        o = _splat(builder, _scalar(context, builder, sig, args, 4, I8), ir.VectorType(I8, 64))
        _store(context, builder, sig, args, 2, builder.sub(out, o))
        return context.get_dummy_value()

    return types.void(src, si, dst, di, off), codegen


@intrinsic
def lookup16(typingctx, dst, di, table):
    """dst[di + j] = table[dst[di + j]], j < 32, for values 0..15 and a 16-entry int8 table (IQ4)."""

    def codegen(context, builder, sig, args):
        idx = _load(context, builder, sig, args, 0, V32)
        tptr = _ptr(context, builder, sig.args[2], args[2], ir.Constant(I64, 0), types.int64, V16)
        if _X86.get("ssse3"):
            tab = builder.load(tptr, align=1)
            fn = _fn(builder, "llvm.x86.ssse3.pshuf.b.128", V16, [V16, V16])
            halves = [builder.call(fn, [tab, builder.shuffle_vector(idx, idx, _mask(16, range(16 * h, 16 * h + 16)))]) for h in range(2)]
            out = builder.shuffle_vector(halves[0], halves[1], _mask(32, range(32)))
        else:  # portable: 32 scalar table loads
            base = builder.bitcast(tptr, I8.as_pointer())
            out = ir.Constant(V32, ir.Undefined)
            for j in range(32):
                k = builder.zext(builder.extract_element(idx, ir.Constant(I32, j)), I64)
                out = builder.insert_element(out, builder.load(builder.gep(base, [k])), ir.Constant(I32, j))
        _store(context, builder, sig, args, 0, out)
        return context.get_dummy_value()

    return types.void(dst, di, table), codegen


def _words(context, builder, sig, args, first):
    """Four int64 arguments -> one <32 x i8> (word k = bytes 8k..8k+7, little-endian)."""
    v = ir.Constant(ir.VectorType(I64, 4), ir.Undefined)
    for k in range(4):
        v = builder.insert_element(v, _scalar(context, builder, sig, args, first + k, I64), ir.Constant(I32, k))
    return builder.bitcast(v, V32)


@intrinsic
def signed_bytes(typingctx, g0, g1, g2, g3, m0, m1, m2, m3, dst, di):
    """dst[di + 8k + j] = byte j of g_k, negated where byte j of m_k is 0xff (m_k bytes: 0 or 0xff).

    The IQ2/IQ3 grids: g_k = 8 grid values, m_k their sign mask; (g ^ m) - m = -g where m = -1."""

    def codegen(context, builder, sig, args):
        g = _words(context, builder, sig, args, 0)
        m = _words(context, builder, sig, args, 4)
        _store(context, builder, sig, args, 8, builder.sub(builder.xor(g, m), m))
        return context.get_dummy_value()

    return types.void(g0, g1, g2, g3, m0, m1, m2, m3, dst, di), codegen


@intrinsic
def iq1_bytes(typingctx, g0, g1, g2, g3, e0, e1, e2, e3, dst, di):
    """dst[di + 8k + j] = 8 * (byte j of g_k) + (byte j of e_k), as int8: the IQ1 grids (-1/0/1)
    and their delta of +-1/8, both scaled by 8 (e_k = +-1 in every byte)."""

    def codegen(context, builder, sig, args):
        g = _words(context, builder, sig, args, 0)
        e = _words(context, builder, sig, args, 4)
        _store(context, builder, sig, args, 8, builder.add(builder.shl(g, _splat(builder, ir.Constant(I8, 3), V32)), e))
        return context.get_dummy_value()

    return types.void(g0, g1, g2, g3, e0, e1, e2, e3, dst, di), codegen


# ---------------------------------------------------------------------------------------------
# the integer dot: half-block sums of int8 weights x int8 activations


def _pair_sums(builder, a16, b16):
    """<32 x i16> a, b -> <16 x i32>: lane i = a[2i] b[2i] + a[2i+1] b[2i+1] (vpmaddwd).

    LLVM does not find vpmaddwd in the portable form (it emits vpmullw and unpacking, 2x slower),
    so x86 hosts call the instruction by name; the portable form is the fallback."""
    if _X86.get("avx512bw"):
        return builder.call(_fn(builder, "llvm.x86.avx512.pmaddw.d.512", ir.VectorType(I32, 16), [a16.type] * 2), [a16, b16])
    if _X86.get("avx2"):
        w16 = ir.VectorType(I16, 16)
        fn = _fn(builder, "llvm.x86.avx2.pmadd.wd", ir.VectorType(I32, 8), [w16, w16])
        h = [builder.call(fn, [builder.shuffle_vector(x, x, _mask(16, range(16 * k, 16 * k + 16))) for x in (a16, b16)]) for k in range(2)]
        return builder.shuffle_vector(h[0], h[1], _mask(16, range(16)))
    w = ir.VectorType(I32, 16)

    def prod(first):
        sel = _mask(16, range(first, 32, 2))
        return builder.mul(*(builder.sext(builder.shuffle_vector(x, x, sel), w) for x in (a16, b16)))

    return builder.add(prod(0), prod(1))


def _fold_pair(builder, x, y, groups, lanes):
    """Two <16 x i32>, each `groups` groups of `lanes` partial sums -> one vector of 2*groups
    groups (x's, then y's) of lanes/2 partial sums: lane k + lane k + lanes/2 of each group."""
    first, second = [], []
    for src in (0, 1):
        for g in range(groups):
            for k in range(lanes // 2):
                first.append(16 * src + g * lanes + k)
                second.append(16 * src + g * lanes + k + lanes // 2)
    return builder.add(builder.shuffle_vector(x, y, _mask(16, first)), builder.shuffle_vector(x, y, _mask(16, second)))


def _reduce_groups(builder, vecs, groups, lanes):
    """Vectors of `groups` groups x `lanes` partial sums -> one vector whose lane g is the total
    of group g (groups in order: vector 0's, then vector 1's, ...)."""
    while len(vecs) > 1:
        vecs = [_fold_pair(builder, vecs[i], vecs[i + 1], groups, lanes) for i in range(0, len(vecs), 2)]
        groups, lanes = 2 * groups, lanes // 2
    v = vecs[0]
    while lanes > 1:  # fewer vectors than levels: fold the vector with itself (upper half repeats)
        v, groups, lanes = _fold_pair(builder, v, v, groups, lanes), 2 * groups, lanes // 2
    return v


def _half_sums_vnni(builder, wa, xa, sums, k):
    """AVX512-VNNI: vpdpbusd multiplies unsigned by signed bytes, so the weights go in offset by
    128 and 128 * (sum of the activations) comes back off; that sum is ActQ's s16, exact."""
    v64, i16v = ir.VectorType(I8, 64), ir.VectorType(I32, 16)
    fn = _fn(builder, "llvm.x86.avx512.vpdpbusd.512", i16v, [i16v] * 3)
    vecs = []
    for j in range(k // 2):  # 64 bytes = 2 act-blocks; lane i sums elements 4i .. 4i+3
        sel = _mask(64, range(64 * j, 64 * j + 64))
        w = builder.xor(builder.shuffle_vector(wa, wa, sel), _splat(builder, ir.Constant(I8, 0x80), v64))
        x = builder.shuffle_vector(xa, xa, sel)
        vecs.append(builder.call(fn, [ir.Constant(i16v, None), builder.bitcast(w, i16v), builder.bitcast(x, i16v)]))
    r = _reduce_groups(builder, vecs, 4, 4)
    return builder.sub(r, builder.shl(sums, _splat(builder, ir.Constant(I32, 7), i16v)))


# The one-token kernels' integer dot (rowdot.py): 64 weight bytes u, unsigned (value + offset),
# times 64 signed activation bytes, summed by 4-byte groups (vpdpbusd's lanes), so the callers'
# transpose-and-add reductions are the same on both instruction sets.
VNNI = bool(_X86.get("avx512vnni") and _X86.get("avx512bw"))
AVX2 = bool(_X86.get("avx2"))


def quad_offset(offset):
    """The offset left in dot_quads' sums for weights unpacked with `offset`."""
    return offset if VNNI or offset != 128 else 0


def dot_quads(builder, u, x, offset, x_full=False):
    """<64 x i8> u (unsigned bytes value + offset), x (signed) -> <16 x i32>, lane i = sum over
    k < 4 of (value + quad_offset(offset)) x at byte 4i + k (exact); the caller takes
    quad_offset(offset) x (sum of x) back off. x in -127..127, or -128..127 with x_full (the wide
    form's lo plane).

    AVX512-VNNI: vpdpbusd(u, x), off = offset. AVX2: vpmaddubsw (unsigned x signed bytes, pair sums
    SATURATED to int16) then vpmaddwd by ones. Exact when u <= 127 (2 x 127 x 128 < 2^15): every
    offset but 128 (u <= 63). For offset 128 (Q8_0, IQ4_NL, IQ4_XS: u up to 255, where a pair of
    255 x 127 would saturate) the signed value w = u ^ 128 goes in as |w| (<= 128) and x takes w's
    sign (vpsignb), off = 0: exact for |x| <= 127; x_full's -128 has no negation in int8 (vpsignb
    gives -128 back), so the wide form's planes widen to 16 bits and go through vpmaddwd instead."""
    v32, i8v, w16 = ir.VectorType(I8, 32), ir.VectorType(I32, 8), ir.VectorType(I16, 16)
    if VNNI:
        i16v = ir.VectorType(I32, 16)
        fn = _fn(builder, "llvm.x86.avx512.vpdpbusd.512", i16v, [i16v] * 3)
        return builder.call(fn, [ir.Constant(i16v, None), builder.bitcast(u, i16v), builder.bitcast(x, i16v)])
    ubsw = _fn(builder, "llvm.x86.avx2.pmadd.ub.sw", w16, [v32, v32])
    wd = _fn(builder, "llvm.x86.avx2.pmadd.wd", i8v, [w16, w16])
    sign = _fn(builder, "llvm.x86.avx2.psign.b", v32, [v32, v32])
    ones = ir.Constant(w16, [ir.Constant(I16, 1)] * 16)
    if offset == 128:
        u = builder.xor(u, _splat(builder, ir.Constant(I8, 0x80), u.type))  # the signed values
    quads = []
    for h in range(2):
        sel = _mask(32, range(32 * h, 32 * h + 32))
        a, b = builder.shuffle_vector(u, u, sel), builder.shuffle_vector(x, x, sel)
        if offset == 128 and x_full:
            pairs = _pair_sums(builder, builder.sext(a, ir.VectorType(I16, 32)), builder.sext(b, ir.VectorType(I16, 32)))
            quads.append(builder.add(builder.shuffle_vector(pairs, pairs, _mask(8, range(0, 16, 2))),
                                     builder.shuffle_vector(pairs, pairs, _mask(8, range(1, 16, 2)))))  # fmt: skip
            continue
        if offset == 128:  # |w| (-128's is 128 as unsigned) and x with w's sign (0 where w is 0)
            b = builder.call(sign, [b, a])
            a = builder.select(builder.icmp_signed("<", a, ir.Constant(v32, None)), builder.neg(a), a)
        quads.append(builder.call(wd, [builder.call(ubsw, [a, b]), ones]))
    return builder.shuffle_vector(quads[0], quads[1], _mask(16, range(16)))


def _half_sums(k):
    def impl(typingctx, a, ai, b, bi, s, si, lo, hi, oi):
        def codegen(context, builder, sig, args):
            va = _load(context, builder, sig, args, 0, ir.VectorType(I8, 32 * k))
            vb = _load(context, builder, sig, args, 2, ir.VectorType(I8, 32 * k))
            if _X86.get("avx512vnni") and _X86.get("avx512bw"):
                sums = _load(context, builder, sig, args, 4, ir.VectorType(I32, 2 * k))
                if k < 8:  # lanes past 2k are duplicates after the self-fold; pad the sums to match
                    sums = builder.shuffle_vector(sums, sums, _mask(16, [i % (2 * k) for i in range(16)]))
                r = _half_sums_vnni(builder, va, vb, sums, k)
            else:
                va, vb = (builder.sext(v, ir.VectorType(I16, 32 * k)) for v in (va, vb))
                vecs = []
                for m in range(k):
                    sel = _mask(32, range(32 * m, 32 * m + 32))
                    vecs.append(_pair_sums(builder, builder.shuffle_vector(va, va, sel), builder.shuffle_vector(vb, vb, sel)))
                r = _reduce_groups(builder, vecs, 2, 8)
            for arg, h in ((6, 0), (7, 1)):  # lane 2m + h = half h of act-block m
                part = builder.shuffle_vector(r, r, _mask(k, range(h, 2 * k, 2)))
                builder.store(part, _ptr(context, builder, sig.args[arg], args[arg], args[8], sig.args[8], part.type), align=1)
            return context.get_dummy_value()

        return types.void(a, ai, b, bi, s, si, lo, hi, oi), codegen

    return impl


_HALF_SUMS_DOC = """{k} act-blocks ({n} int8 of a and of b): for m < {k}, lo[oi + m] = sum of a*b over
elements 32m .. 32m+15 and hi[oi + m] over 32m+16 .. 32m+31 (exact, int32). s[si .. si + {h}]
must hold the {h} half sums of b (ActQ.s16); only the VNNI path reads them.

Each block gives its partial sums in one vector (vpdpbusd, or vpmaddwd); transpose-and-add levels
then reduce the vectors to one holding all the half sums: no per-block horizontal reduction."""
half_sums8 = intrinsic(_half_sums(8))
half_sums8.__doc__ = _HALF_SUMS_DOC.format(k=8, n=256, h=16)
half_sums4 = intrinsic(_half_sums(4))
half_sums4.__doc__ = _HALF_SUMS_DOC.format(k=4, n=128, h=8)


@intrinsic
def half_sums1(typingctx, a, ai, b, bi, lo, hi, oi):
    """One act-block: lo[oi] = sum of a*b over elements 0..15, hi[oi] over 16..31 (exact, int32)."""

    def codegen(context, builder, sig, args):
        va = builder.sext(_load(context, builder, sig, args, 0, V32), ir.VectorType(I16, 32))
        vb = builder.sext(_load(context, builder, sig, args, 2, V32), ir.VectorType(I16, 32))
        r = _pair_sums(builder, va, vb)
        for arg, h in ((4, 0), (5, 1)):
            part = builder.shuffle_vector(r, r, _mask(8, range(8 * h, 8 * h + 8)))
            total = builder.call(_fn(builder, "llvm.vector.reduce.add.v8i32", I32, [part.type]), [part])
            builder.store(total, _ptr(context, builder, sig.args[arg], args[arg], args[6], sig.args[6], I32), align=4)
        return context.get_dummy_value()

    return types.void(a, ai, b, bi, lo, hi, oi), codegen


@intrinsic
def f16_to_f32(typingctx, src, si, lut):
    """The IEEE half at bytes src[si], src[si + 1] as f32 (exact). Hosts with F16C convert in
    hardware (vcvtph2ps), keeping the 256 KiB table out of the cache; others read lut[bits]."""

    def codegen(context, builder, sig, args):
        bits = _load(context, builder, sig, args, 0, I16)
        if _X86.get("f16c"):
            return builder.fpext(builder.bitcast(bits, ir.HalfType()), ir.FloatType())
        tptr = _ptr(context, builder, sig.args[2], args[2], builder.zext(bits, I64), types.int64, ir.FloatType())
        return builder.load(tptr)

    return types.float32(src, si, lut), codegen


@intrinsic
def fetch_add(typingctx, a, i, v):
    """Atomically a[i] += v (an int64 array shared by the threads); returns the value before: a
    work queue's next item, so that a thread the OS deschedules holds up no one but itself."""

    def codegen(context, builder, sig, args):
        ptr = _ptr(context, builder, sig.args[0], args[0], args[1], sig.args[1], I64)
        return builder.atomic_rmw("add", ptr, context.cast(builder, args[2], sig.args[2], types.int64), "seq_cst")

    return types.int64(a, i, v), codegen


# The work queues of the token kernels. A region's threads take chunks until none is left (a thread
# the OS deschedules holds up no one but itself). With STRATA_MAIN_ORCHESTRATES=1 the caller (the
# pool's thread 0) takes none while the pool has other threads: it only launches and waits, so its
# caches keep the host work between launches. When it streams its share, that share evicts its L1
# and L2 (benchmarks/master_cache.py: a host step after a 64 MB stream took 163 us against 34 when
# only the other thread had streamed, 16.5 warm), and the next launch's Python pays for it again.
# seed-4l qwen4exp with one streaming thread either way (2 threads orchestrated against 1 thread,
# this 2-core VM, 2026-12-05): 90.5-92.9 -> 87.4-88.7 ms a token, the time between launches
# 5.2-5.5 -> 3.2-3.6 ms. It costs a streaming thread, so it can pay only where cores are left
# over, and on the H200's 16-core host it did not (2026-12-05, docs/performance.md session 30): at
# 8 threads 0.95-1.01x of the default for qwen4exp and 0.85-0.98x for qwen35moe, at 9 threads (8
# streaming + the main one against 9 streaming) 1.01x. So it is off by default. The code differs,
# so the disk cache keeps it apart (jit.cached's file name).
ORCHESTRATE = os.environ.get("STRATA_MAIN_ORCHESTRATES", "0") == "1"
POOL_TAG = "-orch" if ORCHESTRATE else ""
if ORCHESTRATE:
    # get_thread_id is a symbol of numba's threading layer, which numba binds only while it types a
    # call: a kernel loaded from the disk cache called it unbound (a segfault in every process after
    # the first) until the layer was started here
    from numba.np.ufunc.parallel import _launch_threads

    _launch_threads()


@njit(inline="always")
def _drain(queue, n, chunk, args) -> None:
    """chunk(c, args) for every item c < n still in the queue (int64 [1], shared by the threads)."""
    c = fetch_add(queue, 0, 1)
    while c < n:
        chunk(c, args)
        c = fetch_add(queue, 0, 1)


@njit(inline="always")
def run_queue(n_workers, n, chunk, args) -> None:
    """chunk(c, args) for c = 0 .. n - 1, from a shared queue over n_workers iterations of the pool
    (inlined into a parallel kernel the loop below is its region; into a serial one a plain loop).
    Orchestrated, thread 0 takes none inside the region and drains the queue after it: nothing is
    left unless the pool ran fewer threads than asked (in a serial kernel, where thread 0 is the
    only one, it takes all)."""
    queue = np.zeros(1, np.int64)
    # (get_num_threads reads a ctypes pointer, which numba's disk cache refuses: with one thread the
    # region is thread 0's alone, it takes nothing there and the drain after it does the work)
    main_none = ORCHESTRATE and n_workers > 1
    for _ in prange(n_workers):
        if not (main_none and get_thread_id() == 0):
            _drain(queue, n, chunk, args)
    if main_none:
        _drain(queue, n, chunk, args)


# ---------------------------------------------------------------------------------------------
# scalar loads and the f32 lane steps (element-wise IEEE adds: vectorizing them reorders nothing)


def _load_int(bits):
    def impl(typingctx, src, si):
        def codegen(context, builder, sig, args):
            return builder.zext(_load(context, builder, sig, args, 0, ir.IntType(bits)), I64)

        return types.int64(src, si), codegen

    return impl


load_u8 = intrinsic(_load_int(8))
load_u8.__doc__ = "src[si] as int64 (no negative-index wrap-around test, unlike src[si] in Numba)."
load_u16 = intrinsic(_load_int(16))
load_u16.__doc__ = "The little-endian uint16 at src[si], src[si + 1] (one unaligned load) as int64."
load_u32 = intrinsic(_load_int(32))
load_u32.__doc__ = "The little-endian uint32 at src[si .. si + 3] (one unaligned load) as int64."
load_u64 = intrinsic(_load_int(64))
load_u64.__doc__ = "The 8 bytes at src[si .. si + 7] as a little-endian int64 bit pattern (one unaligned load)."


@intrinsic
def f32_from_bits(typingctx, bits):
    """The f32 whose IEEE bit pattern is the int32 `bits` (a register move, no conversion)."""

    def codegen(context, builder, sig, args):
        return builder.bitcast(_scalar(context, builder, sig, args, 0, I32), ir.FloatType())

    return types.float32(bits), codegen


@intrinsic
def fold32(typingctx, acc):
    """The fold of docs/kernels.md on 32 f32 lanes: lane[l] += lane[l + w] for w = 16, 8, 4, 2, 1;
    returns lane 0. Element-wise fadds on shrinking vectors: the same additions, in the same order."""

    def codegen(context, builder, sig, args):
        v = builder.load(_ptr(context, builder, sig.args[0], args[0], ir.Constant(I64, 0), types.int64, ir.VectorType(ir.FloatType(), 32)), align=4)
        w = 16
        while w:
            v = builder.fadd(builder.shuffle_vector(v, v, _mask(w, range(w))), builder.shuffle_vector(v, v, _mask(w, range(w, 2 * w))))
            w //= 2
        return builder.extract_element(v, ir.Constant(I32, 0))

    return types.float32(acc), codegen


def _row_epilogue(has_min, scales):
    def impl(typingctx, sc, fl, c0, stride, lo, hi, l0, xd, xs0, xs1, t0, nb):
        """One row x one token, from the integer half sums to the f32 result (docs/kernels.md):

            term[b] = (wf[b] * xd[b]) * f32(ws0[b] * lo[b] + ws1[b] * hi[b])
                      [+ (wm[b] * xd[b]) * f32(mn0[b] * xs0[b] + mn1[b] * xs1[b])]   (has_min)
            lane l = ((+0 + term[l]) + term[l + 32]) + ...,  then the fold of the 32 lanes.

        Flat arrays and offsets (views would cost atomic reference counts in the row loop):
        ws0, ws1, mn0, mn1 of act-block b at sc[c0 + i * stride + b] (i = 0..3, int32), wf, wm at
        fl[c0 + i * stride + b] (i = 0, 1, f32); lo, hi at l0 + b (int32); the token's xd (f32),
        xs0, xs1 (int32, its half sums of q) at t0 + b. All readable up to b < P = nb rounded up
        to 32. Every f32 operation is a separate IEEE op, element-wise over 16 act-blocks at a
        time; lanes past nb add -0.0, which leaves any sum unchanged.

        `scales` says what the type's integer scales are, so that no multiply by a known value
        is spent (the integer sums are exact either way: the same bits): "unit" (all 1: the
        32-element types), "same" (ws0 = ws1 and mn0 = mn1: one multiply of the whole sum),
        "own" (two per sum)."""

        def codegen(context, builder, sig, args):
            f16v, i16v = ir.VectorType(ir.FloatType(), 16), ir.VectorType(I32, 16)
            c0, stride, l0, t0, nb = (context.cast(builder, args[k], sig.args[k], types.intp) for k in (2, 3, 6, 10, 11))
            base = {}
            for k, name in ((0, "sc"), (1, "fl"), (4, "lo"), (5, "hi"), (7, "xd"), (8, "xs0"), (9, "xs1")):
                base[name] = context.make_array(sig.args[k])(context, builder, args[k]).data
            p = builder.udiv(builder.add(nb, ir.Constant(I64, 31)), ir.Constant(I64, 32))

            def load(name, idx, vt):
                return builder.load(builder.bitcast(builder.gep(base[name], [idx]), vt.as_pointer()), align=4)

            def field(name, i, b, vt):  # row i, act-blocks b .. b + 15 of sc or fl
                return load(name, builder.add(builder.add(c0, builder.mul(stride, ir.Constant(I64, i))), b), vt)

            def scaled(i, b, a0, a1):  # ws0 * a0 + ws1 * a1 (i = 0), or mn0, mn1 (i = 2)
                if scales == "unit":
                    return builder.add(a0, a1)
                if scales == "same":
                    return builder.mul(field("sc", i, b, i16v), builder.add(a0, a1))
                return builder.add(builder.mul(field("sc", i, b, i16v), a0), builder.mul(field("sc", i + 1, b, i16v), a1))

            neg0 = ir.Constant(f16v, [-0.0] * 16)
            acc = [cgutils.alloca_once_value(builder, ir.Constant(f16v, [0.0] * 16)) for _ in range(2)]
            iota = ir.Constant(ir.VectorType(I64, 16), list(range(16)))

            def half(b, h):  # acc[h] += the terms of act-blocks b .. b + 15, -0.0 past nb
                lb, tb = builder.add(l0, b), builder.add(t0, b)
                isum = scaled(0, b, load("lo", lb, i16v), load("hi", lb, i16v))
                ad = load("xd", tb, f16v)
                term = builder.fmul(builder.fmul(field("fl", 0, b, f16v), ad), builder.sitofp(isum, f16v))
                if has_min:
                    imin = scaled(2, b, load("xs0", tb, i16v), load("xs1", tb, i16v))
                    term = builder.fadd(term, builder.fmul(builder.fmul(field("fl", 1, b, f16v), ad), builder.sitofp(imin, f16v)))
                live = builder.icmp_unsigned("<", builder.add(_splat(builder, b, ir.VectorType(I64, 16)), iota), _splat(builder, nb, ir.VectorType(I64, 16)))
                term = builder.select(live, term, neg0)
                builder.store(builder.fadd(builder.load(acc[h]), term), acc[h])

            with cgutils.for_range(builder, p) as loop:
                b = builder.mul(loop.index, ir.Constant(I64, 32))
                half(b, 0)
                # a half wholly past nb would add -0.0 to every lane, which changes nothing: skipped
                # (half the work of a 10-block row, e.g. the 320-element hyper-connection inputs)
                b = builder.add(b, ir.Constant(I64, 16))
                with builder.if_then(builder.icmp_unsigned("<", b, nb)):
                    half(b, 1)
            v = builder.shuffle_vector(builder.load(acc[0]), builder.load(acc[1]), _mask(32, range(32)))
            w = 16
            while w:  # the fold: lane[l] += lane[l + w]
                v = builder.fadd(builder.shuffle_vector(v, v, _mask(w, range(w))), builder.shuffle_vector(v, v, _mask(w, range(w, 2 * w))))
                w //= 2
            return builder.extract_element(v, ir.Constant(I32, 0))

        return types.float32(sc, fl, c0, stride, lo, hi, l0, xd, xs0, xs1, t0, nb), codegen

    return impl


# (has a min term, scales) -> the epilogue
row_epilogue = {(m, k): intrinsic(_row_epilogue(m, k)) for m in (False, True) for k in ("unit", "same", "own")}


def _widen16(context, builder, sig, args, kind):
    """16 weights from (array args[2], index args[3]) as <16 x float>, exactly: f32 as they are,
    bf16 bits shifted into place, fp16 through F16C, else the exact table args[6], one at a time."""
    fv = ir.VectorType(ir.FloatType(), 16)
    if kind == "f32":
        return _load(context, builder, sig, args, 2, fv)
    if kind == "bf16":
        bits = builder.zext(_load(context, builder, sig, args, 2, ir.VectorType(I16, 16)), ir.VectorType(I32, 16))
        return builder.bitcast(builder.shl(bits, _splat(builder, ir.Constant(I32, 16), ir.VectorType(I32, 16))), fv)
    if _X86.get("f16c"):
        return builder.fpext(builder.bitcast(_load(context, builder, sig, args, 2, ir.VectorType(I16, 16)), ir.VectorType(ir.HalfType(), 16)), fv)
    bits = _load(context, builder, sig, args, 2, ir.VectorType(I16, 16))
    table = _ptr(context, builder, sig.args[6], args[6], ir.Constant(I64, 0), types.int64, ir.FloatType())
    wv = ir.Constant(fv, ir.Undefined)
    for j in range(16):
        k = builder.zext(builder.extract_element(bits, ir.Constant(I32, j)), I64)
        wv = builder.insert_element(wv, builder.load(builder.gep(table, [k])), ir.Constant(I32, j))
    return wv


def _dense16(kind):
    def impl(typingctx, acc, ai, w, wi, x, xi, lut):
        """acc[ai + l] = acc[ai + l] + w[wi + l] * x[xi + l], l < 16: products rounded, then added
        (no FMA); w is f32, or fp16 / bf16 bits (uint16) widened exactly to f32 first."""

        def codegen(context, builder, sig, args):
            fv = ir.VectorType(ir.FloatType(), 16)
            prod = builder.fmul(_widen16(context, builder, sig, args, kind), _load(context, builder, sig, args, 4, fv))
            _store(context, builder, sig, args, 0, builder.fadd(_load(context, builder, sig, args, 0, fv), prod))
            return context.get_dummy_value()

        return types.void(acc, ai, w, wi, x, xi, lut), codegen

    return impl


def _widen(kind):
    def impl(typingctx, dst, di, w, wi, x, xi, lut):
        """dst[di + l] = w[wi + l] as f32, exactly, l < 16 (the weights of dense16_*; x unused,
        there so that both take the same arguments)."""

        def codegen(context, builder, sig, args):
            _store(context, builder, sig, args, 0, _widen16(context, builder, sig, args, kind))
            return context.get_dummy_value()

        return types.void(dst, di, w, wi, x, xi, lut), codegen

    return impl


dense16_f32 = intrinsic(_dense16("f32"))
dense16_f16 = intrinsic(_dense16("f16"))
dense16_bf16 = intrinsic(_dense16("bf16"))
widen16 = {kind: intrinsic(_widen(kind)) for kind in ("f32", "f16", "bf16")}

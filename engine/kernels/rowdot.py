"""The token path's matvec for the 32-element unit-scale types (Q8_0, Q4_0, Q5_0, IQ4_NL): each
row's dot straight from the raw blocks, in one pass.

Why: the LM head (248320 x 2560 Q8_0, 675 MB) is most of a decode step, and the general row
kernel (cpu._quant_rows) copies every row into int8 scratch, stores its scales, reloads both for
the integer sums and again for the epilogue: 37.7 ms per token at 1 thread, 58% of the read
bandwidth (docs/performance.md). For these types a block's 32 values unpack in a few vector
operations into a register, so here the integer sums take them straight from the raw bytes, the
fp16 scales convert straight into a vector, and the f32 terms are added to the lanes in the same
pass: no scratch, no stores. The same holds for the Gated DeltaNet projections (Q5_0 qkv, Q4_0
gate, IQ4_NL out), the hyper-connections (Q8_0) and the IQ4_NL expert down projections.

The arithmetic is docs/kernels.md's, term for term as simd.row_epilogue does it for the "unit"
scales: per act-block b the exact integer sum s[b] of w * q_x, then

    term[b] = (f32(d_w[b]) * xd[b]) * f32(s[b]);   lane l = ((+0 + term[l]) + term[l + 32]) + ...

and the same fold of the 32 lanes, so the result is the general kernel's to the bit (tests/
test_kernels_cpu.py holds the two equal). Activations in the fine form (a scale per 16
elements, ActQ.d twice as long) take term[b] = f32(d_w[b]) * (xd0[b] f32(lo[b]) + xd1[b] f32(hi[b]))
over the two half sums instead, as simd.row_epilogue's "fine" scales do. The integer sum is
exact in any order: VNNI's vpdpbusd over two act-blocks at a time, the weights unpacked as
unsigned bytes value + offset (TYPES) and offset x the activations' sum taken back off, then one
transpose-and-add reduction per 16 act-blocks (simd._reduce_groups).

Only for hosts with AVX512-VNNI, AVX512BW and F16C (AVAILABLE); elsewhere cpu.py keeps the
general kernel.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from . import iq_tables as T
from . import simd
from .jit import JIT, cached

F32 = np.float32
QA = 32  # elements per act-block

AVAILABLE = bool(simd._X86.get("avx512vnni") and simd._X86.get("avx512bw") and simd._X86.get("f16c"))

I8, I16, I32, I64 = simd.I8, simd.I16, simd.I32, simd.I64

# IQ4_NL's 16 values + 128, as the unsigned bytes vpdpbusd multiplies (int8 bit patterns)
_KV_U = [((int(v) + 128) & 0xFF) - 256 * (((int(v) + 128) & 0xFF) > 127) for v in T.KVALUES_IQ4NL]

# name: (block bytes, offset): each block is an fp16 scale at byte 0 and 32 values; the unpacker
# gives them as unsigned bytes u = value + offset, so the exact integer sum is
# vpdpbusd(u, x) - offset * (sum of x)
TYPES = {"Q8_0": (34, 128), "Q4_0": (18, 8), "Q5_0": (22, 16), "IQ4_NL": (18, 128)}


def _unpack(builder, name, load, at):
    """The 32 values of the block at byte `at` as <32 x i8> holding value + offset (TYPES).
    load(byte index, LLVM type) reads raw; layouts as cpu.py's decoders (reference.py draws them)."""
    v16, v32 = ir.VectorType(I8, 16), ir.VectorType(I8, 32)
    if name == "Q8_0":
        return builder.xor(load(builder.add(at, ir.Constant(I64, 2)), v32), simd._splat(builder, ir.Constant(I8, 0x80), v32))
    qs = load(builder.add(at, ir.Constant(I64, 6 if name == "Q5_0" else 2)), v16)
    lo = builder.and_(qs, simd._splat(builder, ir.Constant(I8, 15), v16))
    hi = builder.lshr(qs, simd._splat(builder, ir.Constant(I8, 4), v16))
    u = builder.shuffle_vector(lo, hi, simd._mask(32, range(32)))  # element j < 16: low nibble of byte j
    if name == "Q5_0":  # bit j of the u32 at byte 2 is element j's fifth bit
        # byte k of the word to lanes 8k .. 8k + 7, each lane testing its own bit: one byte shuffle
        # and a compare (a per-lane i32 shift of the word, as cpu.py's decoder does it, made the
        # kernel no faster than the general one)
        qh = builder.bitcast(simd._splat(builder, load(builder.add(at, ir.Constant(I64, 2)), I32), ir.VectorType(I32, 8)), v32)
        qh = builder.shuffle_vector(qh, qh, simd._mask(32, [j // 8 for j in range(32)]))
        probe = ir.Constant(v32, [ir.Constant(I8, (1 << (j % 8)) - 256 * (j % 8 == 7)) for j in range(32)])
        set_ = builder.icmp_unsigned("!=", builder.and_(qh, probe), ir.Constant(v32, None))
        u = builder.or_(u, builder.select(set_, simd._splat(builder, ir.Constant(I8, 16), v32), ir.Constant(v32, None)))
    elif name == "IQ4_NL":  # in-lane byte shuffle, the 16-entry table in both 128-bit lanes
        fn = simd._fn(builder, "llvm.x86.avx2.pshuf.b", v32, [v32, v32])
        u = builder.call(fn, [ir.Constant(v32, [ir.Constant(I8, k) for k in _KV_U * 2]), u])
    return u


def _row(name: str, fine: bool):
    def impl(typingctx, raw, p, nb, xq, xd, xd1, xs):
        """The dot of the `name` row at byte p of raw (nb blocks) with one token's ActQ: xq (int8,
        nb * 32 values) and its scales and sums, readable up to nb rounded up to 16 blocks: xd (f32
        per block) and xs (int32 block sums of xq; xd1 unused), or for the fine form (d per 16)
        xd, xd1 (the first and second halves' scales per block) and xs (int32 half sums, 2 per
        block, as ActQ.s16). Returns the f32 result, bit for bit simd.row_epilogue's for the row."""
        return types.float32(raw, p, nb, xq, xd, xd1, xs), lambda context, builder, sig, args: _codegen(context, builder, sig, args, name, fine)

    return impl


def _codegen(context, builder, sig, args, name, fine, wide=False):
    size, offset = TYPES[name]
    f16v, i16v = ir.VectorType(ir.FloatType(), 16), ir.VectorType(I32, 16)
    v32, v64 = ir.VectorType(I8, 32), ir.VectorType(I8, 64)
    p, nb = (context.cast(builder, args[k], sig.args[k], types.intp) for k in (1, 2))
    base = {}
    # wide: args 5 and 6 are the hi and the lo plane's block sums (xs, xs_lo); xq holds both planes
    for k, arr in ((0, "raw"), (3, "xq"), (4, "xd"), (5, "xs" if wide else "xd1"), (6, "xs_lo" if wide else "xs")):
        base[arr] = context.make_array(sig.args[k])(context, builder, args[k]).data
    planes = 2 if wide else 1
    n_in = builder.mul(nb, ir.Constant(I64, QA))  # the lo plane's first byte in xq

    def ptr(arr, idx, ty):
        return builder.bitcast(builder.gep(base[arr], [idx]), ty.as_pointer())

    vnni = simd._fn(builder, "llvm.x86.avx512.vpdpbusd.512", i16v, [i16v] * 3)
    off = simd._splat(builder, ir.Constant(I32, offset), i16v)
    last = builder.sub(nb, ir.Constant(I64, 1))
    neg0 = ir.Constant(f16v, [-0.0] * 16)
    iota = ir.Constant(ir.VectorType(I64, 16), list(range(16)))
    acc = [[cgutils.alloca_once_value(builder, ir.Constant(f16v, [0.0] * 16)) for _ in range(2)] for _ in range(planes)]

    def group(b, h, tail, n=16):
        """acc[h] += the terms of act-blocks b .. b + 15; `tail`: some are past nb, whose loads
        read block nb - 1 instead and whose terms become -0.0 (adding it changes no lane). n = 8:
        at most 8 are left, only those 8 are read and summed (a 20-block expert row's last 4
        cost a whole 16-block group: the kernel ran at 0.9x the general one)."""
        blocks = []
        for k in range(n):
            i = builder.add(b, ir.Constant(I64, k))
            if tail:
                i = builder.select(builder.icmp_unsigned("<", i, nb), i, last)
            blocks.append(i)
        all_vecs, halves = [[] for _ in range(planes)], []
        for j in range(n // 2):
            w = []
            for i in blocks[2 * j : 2 * j + 2]:
                at = builder.add(p, builder.mul(i, ir.Constant(I64, size)))
                w.append(_unpack(builder, name, lambda idx, ty: builder.load(ptr("raw", idx, ty), align=1), at))
                halves.append(builder.load(ptr("raw", at, I16), align=1))
            w = builder.shuffle_vector(w[0], w[1], simd._mask(64, range(64)))
            for pl in range(planes):  # the weights unpacked once, multiplied by each plane
                o = n_in if pl else ir.Constant(I64, 0)
                if tail:
                    x = [builder.load(ptr("xq", builder.add(o, builder.mul(i, ir.Constant(I64, QA))), v32), align=1)
                         for i in blocks[2 * j : 2 * j + 2]]  # fmt: skip
                    x = builder.shuffle_vector(x[0], x[1], simd._mask(64, range(64)))
                else:  # the pair's activations are contiguous: one 64-byte load
                    x = builder.load(ptr("xq", builder.add(o, builder.mul(blocks[2 * j], ir.Constant(I64, QA))), v64), align=1)
                all_vecs[pl].append(builder.call(vnni, [ir.Constant(i16v, None), builder.bitcast(w, i16v), builder.bitcast(x, i16v)]))
        vecs = all_vecs[0]
        if not tail and n == 16:  # the group's bytes as words (all inside the row), the 16 scales picked out
            words = builder.load(ptr("raw", builder.add(p, builder.mul(b, ir.Constant(I64, size))), ir.VectorType(I16, 8 * size)), align=1)
            dw = builder.shuffle_vector(words, words, simd._mask(16, [k * size // 2 for k in range(16)]))
        else:
            dw = ir.Constant(ir.VectorType(I16, 16), None)
            for k, hb in enumerate(halves):
                dw = builder.insert_element(dw, hb, ir.Constant(I32, k))
        wf = builder.fpext(builder.bitcast(dw, ir.VectorType(ir.HalfType(), 16)), f16v)
        if fine:  # the half sums (lane 2m + h: half h of block b + m), less offset x the activations'
            two_b = builder.add(b, b)
            r = [builder.sub(simd._reduce_groups(builder, vecs[4 * m : 4 * m + 4], 4, 4),
                             builder.mul(builder.load(ptr("xs", builder.add(two_b, ir.Constant(I64, 16 * m)), i16v), align=4), off))
                 for m in range(n // 8)]  # fmt: skip
            if n == 8:  # blocks b + 8 .. b + 15 are past nb: their lanes are dropped below
                r.append(ir.Constant(i16v, None))
            lo = builder.shuffle_vector(r[0], r[1], simd._mask(16, range(0, 32, 2)))
            hi = builder.shuffle_vector(r[0], r[1], simd._mask(16, range(1, 32, 2)))
            ad0, ad1 = builder.load(ptr("xd", b, f16v), align=4), builder.load(ptr("xd1", b, f16v), align=4)
            both = builder.fadd(builder.fmul(ad0, builder.sitofp(lo, f16v)), builder.fmul(ad1, builder.sitofp(hi, f16v)))
            term = builder.fmul(wf, both)
        if tail:
            live = builder.icmp_unsigned("<", builder.add(simd._splat(builder, b, ir.VectorType(I64, 16)), iota),
                                         simd._splat(builder, nb, ir.VectorType(I64, 16)))  # fmt: skip
        if fine:
            if tail:
                term = builder.select(live, term, neg0)
            builder.store(builder.fadd(builder.load(acc[0][h]), term), acc[0][h])
            return
        ad = builder.load(ptr("xd", b, f16v), align=4)
        wad = builder.fmul(wf, ad)
        for pl in range(planes):
            r = simd._reduce_groups(builder, all_vecs[pl], 2, 8)  # lane g = block b + g (n = 8: g < 8), the weights offset
            isum = builder.sub(r, builder.mul(builder.load(ptr("xs_lo" if pl else "xs", b, i16v), align=4), off))
            term = builder.fmul(wad, builder.sitofp(isum, f16v))
            if tail:
                term = builder.select(live, term, neg0)
            builder.store(builder.fadd(builder.load(acc[pl][h]), term), acc[pl][h])

    def half(b, h):
        full = builder.icmp_unsigned("<=", builder.add(b, ir.Constant(I64, 16)), nb)
        with builder.if_else(full) as (then, otherwise):
            with then:
                group(b, h, False)
            with otherwise:
                few = builder.icmp_unsigned("<", builder.add(b, ir.Constant(I64, 8)), nb)  # more than 8 left
                with builder.if_else(few) as (more, eight):
                    with more:
                        group(b, h, True)
                    with eight:
                        group(b, h, True, 8)

    n32 = builder.udiv(builder.add(nb, ir.Constant(I64, 31)), ir.Constant(I64, 32))
    with cgutils.for_range(builder, n32) as loop:
        b = builder.mul(loop.index, ir.Constant(I64, 32))
        half(b, 0)
        b = builder.add(b, ir.Constant(I64, 16))
        with builder.if_then(builder.icmp_unsigned("<", b, nb)):  # a half wholly past nb adds -0.0: skipped
            half(b, 1)
    folded = []
    for pl in range(planes):
        v = builder.shuffle_vector(builder.load(acc[pl][0]), builder.load(acc[pl][1]), simd._mask(32, range(32)))
        w = 16
        while w:  # the fold: lane[l] += lane[l + w]
            v = builder.fadd(builder.shuffle_vector(v, v, simd._mask(w, range(w))), builder.shuffle_vector(v, v, simd._mask(w, range(w, 2 * w))))
            w //= 2
        folded.append(builder.extract_element(v, ir.Constant(I32, 0)))
    if wide:  # actq.combine16: 256 y_hi (exact) + y_lo
        return builder.fadd(builder.fmul(ir.Constant(ir.FloatType(), 256.0), folded[0]), folded[1])
    return folded[0]


ROW = {(name, fine): intrinsic(_row(name, fine)) for name in TYPES for fine in (False, True)}


def _row16(name: str):
    def impl(typingctx, raw, p, nb, xq, xd, xs, xs_lo):
        """The dot of the `name` row at byte p of raw (nb blocks) with one token's wide ActQ
        (actq.ActQ16): xq (int8, its hi plane's nb * 32 values then its lo plane's), xd (f32 per
        block, the planes' common d) and xs, xs_lo (int32 block sums of each plane), readable up to
        nb rounded up to 16 blocks. Each block's weights are unpacked once for both planes; the
        result is f32(256) * (the row . hi) + (the row . lo), each as ROW computes it."""
        return types.float32(raw, p, nb, xq, xd, xs, xs_lo), lambda context, builder, sig, args: _codegen(context, builder, sig, args, name, False, True)

    return impl


ROW16 = {name: intrinsic(_row16(name)) for name in TYPES}


def _kernel(name: str, parallel: bool, fine: bool):
    row = ROW[name, fine]

    def kernel(raw, row_bytes, xq, xd, s16, out, n_chunks):
        # raw u8 [n_out * row_bytes]; xq i8 [n_in]; xd f32 [nb] (the fine form: [2 nb]); s16 i32
        # [2 nb]; out f32 [n_out]
        nb = xq.size // QA
        P = (nb + 15) // 16 * 16
        xd0 = np.zeros(P, F32)
        xd1 = np.zeros(P, F32)  # the fine form's second halves
        xs = np.zeros(2 * P if fine else P, np.int32)  # half sums (fine) or block sums, zero past nb
        for b in range(nb):
            if fine:
                xd0[b], xd1[b] = xd[2 * b], xd[2 * b + 1]
                xs[2 * b], xs[2 * b + 1] = s16[2 * b], s16[2 * b + 1]
            else:
                xd0[b] = xd[b]
                xs[b] = s16[2 * b] + s16[2 * b + 1]
        n_out = out.size
        for c in prange(n_chunks):
            for o in range(c * n_out // n_chunks, (c + 1) * n_out // n_chunks):
                out[o] = row(raw, o * row_bytes, nb, xq, xd0, xd1, xs)

    return cached(njit(parallel=parallel, **JIT)(kernel), f"{name}-rowdot{'-fine' if fine else ''}-{'par' if parallel else 'serial'}")


def _kernel16(name: str, parallel: bool):
    row = ROW16[name]

    def kernel(raw, row_bytes, xq, xd, s16, out, n_chunks):
        # the wide form's planes (actq.ActQ16, one token): xq i8 [2 n_in] (hi, then lo), xd f32
        # [2 nb] (equal halves), s16 i32 [4 nb]; out f32 [n_out]. Each row's blocks unpacked once
        # for both planes (ROW16): a row's dot with the hi plane then the lo plane through ROW cost
        # 1.9x the 8-bit kernel's CPU time for the nibble types.
        nb = xq.size // (2 * QA)
        P = (nb + 15) // 16 * 16
        xd0 = np.zeros(P, F32)
        xs_hi = np.zeros(P, np.int32)
        xs_lo = np.zeros(P, np.int32)
        for b in range(nb):
            xd0[b] = xd[b]
            xs_hi[b] = s16[2 * b] + s16[2 * b + 1]
            xs_lo[b] = s16[2 * nb + 2 * b] + s16[2 * nb + 2 * b + 1]
        n_out = out.size
        for c in prange(n_chunks):
            for o in range(c * n_out // n_chunks, (c + 1) * n_out // n_chunks):
                out[o] = row(raw, o * row_bytes, nb, xq, xd0, xs_hi, xs_lo)

    return cached(njit(parallel=parallel, **JIT)(kernel), f"{name}-rowdot-wide-{'par' if parallel else 'serial'}")


_KERNELS: dict[tuple[str, bool, object], object] = {}


# A few tokens (speculative decoding's verify forward: 2-4 rows): each weight row read once from
# memory and dotted with every token's activations while it is in the cache, by the one-token
# row function, so every token's result has the one-token kernel's bits. The panel kernels took
# 3x a token step's time for 3 rows of the seed-4l model's dense products (2026-12-01).
ROWS_MAX = 4


def _rows_kernel(name: str, parallel: bool, fine: bool):
    row = ROW[name, fine]

    def kernel(raw, row_bytes, xq, xd, s16, out, n_chunks):
        # xq i8 [T, n_in]; xd f32 [T, nb] (fine: [T, 2 nb]); s16 i32 [T, 2 nb]; out f32 [T, n_out]
        T = xq.shape[0]
        nb = xq.shape[1] // QA
        P = (nb + 15) // 16 * 16
        xd0 = np.zeros((T, P), F32)
        xd1 = np.zeros((T, P), F32)
        xs = np.zeros((T, 2 * P if fine else P), np.int32)
        for t in range(T):
            for b in range(nb):
                if fine:
                    xd0[t, b], xd1[t, b] = xd[t, 2 * b], xd[t, 2 * b + 1]
                    xs[t, 2 * b], xs[t, 2 * b + 1] = s16[t, 2 * b], s16[t, 2 * b + 1]
                else:
                    xd0[t, b] = xd[t, b]
                    xs[t, b] = s16[t, 2 * b] + s16[t, 2 * b + 1]
        n_out = out.shape[1]
        for c in prange(n_chunks):
            for o in range(c * n_out // n_chunks, (c + 1) * n_out // n_chunks):
                for t in range(T):
                    out[t, o] = row(raw, o * row_bytes, nb, xq[t], xd0[t], xd1[t], xs[t])

    return cached(njit(parallel=parallel, **JIT)(kernel), f"{name}-rowdot-rows{'-fine' if fine else ''}-{'par' if parallel else 'serial'}")


_ROWS_KERNELS: dict[tuple[str, bool, bool], object] = {}


def matmul(name: str, raw: np.ndarray, row_bytes: int, xq: np.ndarray, xd: np.ndarray, s16: np.ndarray, out: np.ndarray,
           parallel: bool, n_chunks: int) -> None:  # fmt: skip
    """`matvec` for T <= ROWS_MAX tokens at once, each row of the matrix read once: xq int8 [T, n_in],
    xd f32 [T, n_in / 32] (fine form: [T, n_in / 16]), s16 int32 [T, n_in / 16], out f32 [T, n_out];
    token t's row of out is bit for bit `matvec`'s for that token alone."""
    key = (name, parallel, xd.shape[1] == 2 * (xq.shape[1] // QA))
    if key not in _ROWS_KERNELS:
        _ROWS_KERNELS[key] = _rows_kernel(*key)
    _ROWS_KERNELS[key](raw, row_bytes, xq, xd, s16, out, n_chunks)


def matvec(name: str, raw: np.ndarray, row_bytes: int, xq: np.ndarray, xd: np.ndarray, s16: np.ndarray, out: np.ndarray,
           parallel: bool, n_chunks: int, wide: bool = False) -> None:  # fmt: skip
    """out[o] = row o of the `name` (TYPES) matrix raw (flat u8, row_bytes per row) . the token's
    ActQ planes (xq int8 [n_in], xd f32 [n_in / 32], or [n_in / 16] for the fine form, s16 int32
    [n_in / 16], contiguous); rows split into n_chunks on the pool if `parallel`. The caller
    (cpu.matvec) has validated the shapes. wide: the planes of an actq.ActQ16 (xq [2 n_in], xd
    [2 n_in / 32], s16 [2 n_in / 16]: hi, then lo), out = f32(256) (W . hi) + W . lo."""
    if wide:
        key = (name, parallel, "wide")
        if key not in _KERNELS:
            _KERNELS[key] = _kernel16(name, parallel)
        _KERNELS[key](raw, row_bytes, xq, xd, s16, out, n_chunks)
        return
    key = (name, parallel, xd.size == 2 * (xq.size // QA))
    if key not in _KERNELS:
        _KERNELS[key] = _kernel(*key)
    _KERNELS[key](raw, row_bytes, xq, xd, s16, out, n_chunks)

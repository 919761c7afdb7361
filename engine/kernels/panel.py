"""The many-token CPU product: W X for block types, 16 rows at a time with the rows in the vector
lanes (AVX512-VNNI hosts; cpu.py's row kernels everywhere else and for few tokens).

Why a second kernel: cpu.py's row kernels run every (row, token) pair as a dot of one row against
one token, so each `vpdpbusd` needs two fresh vector loads and a shuffle tree to leave the
act-blocks' sums apart; with many tokens that loop ran at ~115 GMAC/s per core where the
instruction itself does ~510 on the development machine's Zen 5 (8 vpdpbusd per ns, measured).
Here 16 rows are decoded as usual, then transposed so that one 64-byte vector holds 4 bytes of
each of the 16 rows: `vpdpbusd(acc, W[g], broadcast of the token's 4 bytes)` then leaves row r's
partial sum in lane r, and an act-block's 8 groups give its 16 rows' sums in 2 vectors (its two
halves) with no reduction at all. The 8 vectors of an act-block stay in registers for all the
tokens; the activations come in as broadcasts straight from memory.

The f32 arithmetic is docs/kernels.md's to the bit, element-wise over 16 rows instead of 16
act-blocks: per act-block the same term, added into the row's lane b % 32 in block order, then
the same fold. So a row's result equals cpu.py's matvec bit for bit (tests/engine/test_panel.py), and
everything that compares the batched and token paths keeps its meaning.

The unit-scale types (RAW: Q8_0, Q4_0, Q5_0, IQ4_NL, and Q2_0's 64-element blocks) skip the decode: each pair of
act-blocks of the 16 rows unpacks in registers as rowdot.py's kernel does (values + the type's
offset), is transposed there and stored into wp once, the scales straight into flp. That made
them worth a panel from 2 tokens (a serving step of 2-16 streams; cpu.PANEL_FROM_RAW).

Layout of a panel (per thread, `_scratch`), P = act-blocks per row rounded up to 16:
  rows     the 16 rows decoded by cpu.py's decoders: int8 values at [r * 32P + 32b ..], integer
           scales sc[i, r * P + b] (ws0, ws1, mn0, mn1), f32 factors fl[i, r * P + b] (wf, wm)
  wp       the values transposed: act-block b, group g (elements 32b + 4g .. + 3) of row r at
           byte 512b + 64g + 4r, offset by 128 (vpdpbusd multiplies unsigned by signed bytes)
  scp, flp the scales transposed: plane i, act-block b, row r at [i, 16b + r]
  lanes    [tokens, 32 lanes, 16 rows] f32
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from . import rowdot, simd
from .actq import QA
from .jit import JIT, cached

_inline = dict(inline="always", **JIT)
from .simd import I32, I64, _fn, _mask, _splat

F32 = np.float32
ROWS = 16  # rows per panel: one zmm of int32 lanes
LANES = 32  # docs/kernels.md's lanes
# Tokens per pass over a panel: their lanes (2 KB each) stay in the 48 KB L1 beside the block's
# weights and the tokens' activations.
TOKEN_TILE = 16

# The panel kernel needs vpdpbusd on 512-bit vectors; elsewhere cpu.py's row kernels run.
AVAILABLE = bool(simd._X86.get("avx512vnni") and simd._X86.get("avx512bw") and simd._X86.get("avx512f"))

_V16I = ir.VectorType(I32, 16)
_V16F = ir.VectorType(ir.FloatType(), 16)


def _vec(context, builder, sig, args, k, idx, vt):
    """Pointer to the vector `vt` at element idx (an LLVM i64) of array args[k]."""
    a = context.make_array(sig.args[k])(context, builder, args[k])
    return builder.bitcast(builder.gep(a.data, [idx]), vt.as_pointer())


def _arg(context, builder, sig, args, k):
    return context.cast(builder, args[k], sig.args[k], types.intp)


def _transpose(builder, rows):
    """16 <16 x i32> rows -> the 16 columns (column c: element c of every row, row r in lane r)."""
    rows = list(rows)
    d = 8
    while d:  # swap the off-diagonal d x d blocks of every 2d x 2d block
        lo = [c if not c & d else 16 + c - d for c in range(16)]
        hi = [c + d if not c & d else 16 + c for c in range(16)]
        for i in range(16):
            if not i & d:
                a, b = rows[i], rows[i + d]
                rows[i], rows[i + d] = builder.shuffle_vector(a, b, _mask(16, lo)), builder.shuffle_vector(a, b, _mask(16, hi))
        d //= 2
    return rows


@intrinsic
def transpose16(typingctx, src, si, stride, dst, di, flip):
    """dst[di + 16c + r] = src[si + r * stride + c] ^ flip for r, c < 16, on 4-byte elements: src
    and dst are any arrays, si, stride and di in elements of their own dtype (bytes of an int8
    array), flip an int32 mask. Four butterfly stages of two-source shuffles (vpermt2d)."""

    def codegen(context, builder, sig, args):
        si_, st, di_ = (_arg(context, builder, sig, args, k) for k in (1, 2, 4))
        rows = []
        for r in range(16):
            idx = builder.add(si_, builder.mul(st, ir.Constant(I64, r)))
            rows.append(builder.load(_vec(context, builder, sig, args, 0, idx, _V16I), align=1))
        rows = _transpose(builder, rows)
        mask = _splat(builder, builder.trunc(context.cast(builder, args[5], sig.args[5], types.int64), I32), _V16I)
        base = _vec(context, builder, sig, args, 3, di_, _V16I)
        for c in range(16):
            builder.store(builder.xor(rows[c], mask), builder.gep(base, [ir.Constant(I64, c)]), align=1)
        return context.get_dummy_value()

    return types.void(src, si, stride, dst, di, flip), codegen


def _block(has_min, scales, shift=7):
    """The block step below; the weights come offset by 1 << shift (128 for the decoded panels,
    rowdot.TYPES' offset for the raw ones), taken back off as (1 << shift) * the half sums."""

    def impl(typingctx, wp, wi, scp, flp, si, plane, xq, xi, n_in, s16, s16i, xd, xdi, nb, lanes, li, n_tok):
        """Act-block b of a panel against n_tok tokens (docs/kernels.md's term, 16 rows at once):

            S_h    = sum over half h of the block of w * x   (vpdpbusd on w + 128, minus 128 * s16)
            isum   = S0 + S1 | ws * (S0 + S1) | ws0 * S0 + ws1 * S1      (scales unit | same | own)
            term   = (wf * ad) * f32(isum) [+ (wm * ad) * f32(mn0 * s16_0 + mn1 * s16_1)]
            lane   = lane + term

        wp at byte wi: the block's 8 groups of 64 bytes. scp, flp: plane i of act-block b at
        si + i * plane (16 rows). Token k: its 32 values at xq[xi + k n_in], half sums at
        s16[s16i + 2 k nb], scale at xd[xdi + k nb], the 16 rows of its lane b % 32 at
        lanes[li + 512 k]."""

        def codegen(context, builder, sig, args):
            wi_, si_, plane_, xi_, n_in_, s16i_, xdi_, nb_, li_, n_tok_ = (
                _arg(context, builder, sig, args, k) for k in (1, 4, 5, 7, 8, 10, 12, 13, 15, 16))
            wbase = _vec(context, builder, sig, args, 0, wi_, _V16I)
            w = [builder.load(builder.gep(wbase, [ir.Constant(I64, g)]), align=1) for g in range(8)]

            def plane_vec(k, i, vt):  # plane i of scp (k = 2) or flp (k = 3)
                idx = builder.add(si_, builder.mul(plane_, ir.Constant(I64, i)))
                return builder.load(_vec(context, builder, sig, args, k, idx, vt), align=4)

            wf = plane_vec(3, 0, _V16F)
            wm = plane_vec(3, 1, _V16F) if has_min else None
            ws = [plane_vec(2, i, _V16I) for i in ((0, 1) if scales == "own" else (0,) if scales == "same" else ())]
            mn = [plane_vec(2, i, _V16I) for i in ((2, 3) if scales == "own" else (2,) if scales == "same" else ())] if has_min else []
            dp = _fn(builder, "llvm.x86.avx512.vpdpbusd.512", _V16I, [_V16I] * 3)

            with cgutils.for_range(builder, n_tok_) as loop:
                k = loop.index
                xk = builder.add(xi_, builder.mul(k, n_in_))
                sk = builder.add(s16i_, builder.mul(k, builder.add(nb_, nb_)))
                s = [builder.load(_vec(context, builder, sig, args, 9, builder.add(sk, ir.Constant(I64, h)), I32), align=4) for h in (0, 1)]
                acc = [_splat(builder, builder.neg(builder.shl(s[h], ir.Constant(I32, shift))), _V16I) for h in (0, 1)]
                for g in range(8):
                    xv = builder.load(_vec(context, builder, sig, args, 6, builder.add(xk, ir.Constant(I64, 4 * g)), I32), align=1)
                    acc[g // 4] = builder.call(dp, [acc[g // 4], w[g], _splat(builder, xv, _V16I)])
                if scales == "unit":
                    isum = builder.add(acc[0], acc[1])
                elif scales == "same":
                    isum = builder.mul(ws[0], builder.add(acc[0], acc[1]))
                else:
                    isum = builder.add(builder.mul(ws[0], acc[0]), builder.mul(ws[1], acc[1]))
                xdk = builder.add(xdi_, builder.mul(k, nb_))
                ad = _splat(builder, builder.load(_vec(context, builder, sig, args, 11, xdk, ir.FloatType()), align=4), _V16F)
                term = builder.fmul(builder.fmul(wf, ad), builder.sitofp(isum, _V16F))
                if has_min:
                    if scales == "unit":
                        imin = _splat(builder, builder.add(s[0], s[1]), _V16I)
                    elif scales == "same":
                        imin = builder.mul(mn[0], _splat(builder, builder.add(s[0], s[1]), _V16I))
                    else:
                        imin = builder.add(builder.mul(mn[0], _splat(builder, s[0], _V16I)), builder.mul(mn[1], _splat(builder, s[1], _V16I)))
                    term = builder.fadd(term, builder.fmul(builder.fmul(wm, ad), builder.sitofp(imin, _V16F)))
                lp = _vec(context, builder, sig, args, 14, builder.add(li_, builder.mul(k, ir.Constant(I64, LANES * ROWS))), _V16F)
                builder.store(builder.fadd(builder.load(lp, align=4), term), lp, align=4)
            return context.get_dummy_value()

        return types.void(wp, wi, scp, flp, si, plane, xq, xi, n_in, s16, s16i, xd, xdi, nb, lanes, li, n_tok), codegen

    return impl


_BLOCK = {(m, k): intrinsic(_block(m, k)) for m in (False, True) for k in ("unit", "same", "own")}


@intrinsic
def fold16(typingctx, lanes, li, out, oi):
    """The fold of docs/kernels.md for 16 rows at once: the 32 lane vectors at lanes[li + 16 l],
    lane[l] += lane[l + w] for w = 16, 8, 4, 2, 1 (element-wise: row r's own additions, in its
    order) -> out[oi .. oi + 16]."""

    def codegen(context, builder, sig, args):
        li_, oi_ = _arg(context, builder, sig, args, 1), _arg(context, builder, sig, args, 3)
        base = _vec(context, builder, sig, args, 0, li_, _V16F)
        v = [builder.load(builder.gep(base, [ir.Constant(I64, l)]), align=4) for l in range(LANES)]
        w = LANES // 2
        while w:
            v = [builder.fadd(v[l], v[l + w]) for l in range(w)]
            w //= 2
        builder.store(v[0], _vec(context, builder, sig, args, 2, oi_, _V16F), align=4)
        return context.get_dummy_value()

    return types.void(lanes, li, out, oi), codegen


# ---------------------------------------------------------------------------------------------
# the raw panels: the 32-element unit-scale types straight from their blocks

# Types whose panels are built from the raw blocks (rowdot.py's unpackers), not decoded into
# scratch first. Why: for few tokens the decode dominated. A Q8_0 panel of the LM head cost
# ~160 ns per row to decode (a scalar f16 lookup per block, copies, then a transpose reading the
# copies back) against ~17 ns per row and token for the dots: 8 tokens took 4.3x one token's
# matvec at 1 thread where the bytes read are the same. Unpacked in registers, transposed there
# and stored once, a row's share of the panel costs ~70 ns (in cache, measured alone).
RAW = tuple(rowdot.TYPES) if AVAILABLE and rowdot.AVAILABLE else ()  # the panels need VNNI; rowdot runs on AVX2 too


def _raw_pair(name):
    size, _ = rowdot.TYPES[name]

    def impl(typingctx, raw, at, rb, n, b0, nb, wp, wi, flp):
        """Act-blocks b0 and b0 + 1 of the 16 rows of a panel of the `name` matrix -> the panel:
        row r at byte at + r rb of raw (rows r >= n repeat row n - 1, a block b0 + 1 >= nb
        repeats block nb - 1: their sums are never stored). The values, offset as rowdot._unpack
        gives them, transposed to wp at byte wi (the layout of the module docstring: group g of
        row r at wi + 64 g + 4 r, b0's 8 groups then b0 + 1's); the fp16 scales, as f32, to
        flp[16 b + r]."""

        def codegen(context, builder, sig, args):
            at_, rb_, n_, b0_, nb_, wi_ = (_arg(context, builder, sig, args, k) for k in (1, 2, 3, 4, 5, 7))
            data = context.make_array(sig.args[0])(context, builder, args[0]).data

            def load(idx, ty):
                return builder.load(builder.bitcast(builder.gep(data, [idx]), ty.as_pointer()), align=1)

            one = ir.Constant(I64, 1)
            b1 = builder.add(b0_, one)
            b1 = builder.select(builder.icmp_signed("<", b1, nb_), b1, builder.sub(nb_, one))
            rows, scales = [], ([], [])
            for r in range(ROWS):
                rr = builder.select(builder.icmp_signed("<", ir.Constant(I64, r), n_), ir.Constant(I64, r), builder.sub(n_, one))
                p = builder.add(at_, builder.mul(rr, rb_))
                if name in rowdot.PAIRED:  # b0 even, nb even: the pair is one block, one scale
                    q = builder.add(p, builder.mul(b0_, ir.Constant(I64, size // 2)))
                    rows.append(builder.bitcast(rowdot._unpack_q2(builder, load, q), _V16I))
                    for h in (0, 1):
                        scales[h].append(load(q, simd.I16))
                    continue
                us = []
                for h, b in enumerate((b0_, b1)):
                    q = builder.add(p, builder.mul(b, ir.Constant(I64, size)))
                    us.append(rowdot._unpack(builder, name, load, q))
                    scales[h].append(load(q, simd.I16))
                rows.append(builder.bitcast(builder.shuffle_vector(us[0], us[1], _mask(64, range(64))), _V16I))
            base = _vec(context, builder, sig, args, 6, wi_, _V16I)
            for c, col in enumerate(_transpose(builder, rows)):
                builder.store(col, builder.gep(base, [ir.Constant(I64, c)]), align=1)
            # (a vpgatherdd of the 16 scales instead of these loads and inserts was slower)
            for h, b in enumerate((b0_, b1)):  # b1 = b0 (nb odd, the last pair): the same values again
                dw = ir.Constant(ir.VectorType(simd.I16, ROWS), None)
                for r, hb in enumerate(scales[h]):
                    dw = builder.insert_element(dw, hb, ir.Constant(I32, r))
                wf = builder.fpext(builder.bitcast(dw, ir.VectorType(ir.HalfType(), ROWS)), _V16F)
                builder.store(wf, _vec(context, builder, sig, args, 8, builder.mul(b, ir.Constant(I64, ROWS)), _V16F), align=4)
            return context.get_dummy_value()

        return types.void(raw, at, rb, n, b0, nb, wp, wi, flp), codegen

    return impl


@intrinsic
def prefetch(typingctx, raw, at):
    """Ask for the cache line of byte `at` of raw into L2 (prefetcht1; never faults, even past the end)."""

    def codegen(context, builder, sig, args):
        data = context.make_array(sig.args[0])(context, builder, args[0]).data
        ptr = builder.bitcast(builder.gep(data, [_arg(context, builder, sig, args, 1)]), ir.IntType(8).as_pointer())
        fn = _fn(builder, "llvm.prefetch.p0", ir.VoidType(), [ir.IntType(8).as_pointer(), I32, I32, I32])
        builder.call(fn, [ptr, ir.Constant(I32, 0), ir.Constant(I32, 2), ir.Constant(I32, 1)])
        return context.get_dummy_value()

    return types.void(raw, at), codegen


def _raw_panel_rows(name):
    """_panel_rows for a RAW type: the same arguments (the decoder's scratch wq, sc, fl and lut
    unused) and the same dots, the panel made by _raw_pair. flp must be plane 0 of the scratch's
    (the f32 factors wf; these types have no other). With one token tile (up to 16 tokens: a
    serving step) each pair's two blocks are dotted right after the pair is made, from 1 KB of wp
    in L1 (a block's terms still go to its lane in block order: the same bits); the 2 tokens of
    the LM head from memory took 38 ms of CPU instead of 48-52 with the whole panel made first."""
    pair = intrinsic(_raw_pair(name))
    per = 2 if name in rowdot.PAIRED else 1  # act-blocks per block
    block = intrinsic(_block(False, "unit", rowdot.TYPES[name][1].bit_length() - 1))

    @njit(**_inline)
    def panels(raw, base, type_size, row_bytes, o0, o1, t0, t1, xq, xd, s16, lut, wq, sc, fl, wp, scp, flp, lanes, tmp, out):
        nb = row_bytes // type_size * per
        n_in = nb * QA
        P = sc.shape[1] // ROWS
        # the next panel's bytes, a share after each pair: a pair reads 16 rows at once, 16
        # streams the hardware prefetcher did not follow (2 tokens of the LM head from memory
        # took as long as 2 matvecs, where the same panels in cache took 1.4 matvecs)
        share = (ROWS * row_bytes + 32 * nb - 1) // (32 * nb) * 64  # bytes per pair, whole lines
        for p0 in range(o0, o1, ROWS):
            n = min(ROWS, o1 - p0)
            ahead = base + (p0 + 2 * ROWS) * row_bytes
            if t1 - t0 <= TOKEN_TILE:  # one tile (a serving step): each pair's dots at once, from L1
                m = t1 - t0
                lanes[: m * LANES * ROWS] = 0.0
                for b in range(0, nb, 2):
                    pair(raw, base + p0 * row_bytes, row_bytes, n, b, nb, wp, 0, flp)
                    for c in range(ahead + b // 2 * share, ahead + (b // 2 + 1) * share, 64):
                        prefetch(raw, c)
                    for k in range(b, min(b + 2, nb)):
                        block(wp, 8 * 64 * (k - b), scp, flp, ROWS * k, ROWS * P, xq, t0 * n_in + QA * k, n_in,
                              s16, 2 * t0 * nb + 2 * k, xd, t0 * nb + k, nb, lanes, ROWS * (k % LANES), m)  # fmt: skip
                _fold_tile(lanes, m, n, t0, p0, tmp, out)
                continue
            for b in range(0, nb, 2):
                pair(raw, base + p0 * row_bytes, row_bytes, n, b, nb, wp, 512 * b, flp)
                for c in range(ahead + b // 2 * share, ahead + (b // 2 + 1) * share, 64):
                    prefetch(raw, c)
            for a in range(t0, t1, TOKEN_TILE):
                m = min(TOKEN_TILE, t1 - a)
                lanes[: m * LANES * ROWS] = 0.0
                for b in range(nb):
                    block(wp, 8 * 64 * b, scp, flp, ROWS * b, ROWS * P, xq, a * n_in + QA * b, n_in,
                          s16, 2 * a * nb + 2 * b, xd, a * nb + b, nb, lanes, ROWS * (b % LANES), m)  # fmt: skip
                _fold_tile(lanes, m, n, a, p0, tmp, out)

    return panels


# ---------------------------------------------------------------------------------------------
# drivers


@njit(**_inline)
def _fold_tile(lanes, m, n, a, p0, tmp, out):
    """The lanes of m tokens (from token a) of a panel of n rows (from row p0) -> out[a + k, p0 + r]:
    a whole panel folds straight into out, a partial one through tmp."""
    n_out = out.shape[1]
    for k in range(m):
        if n == ROWS:
            fold16(lanes, k * LANES * ROWS, out, (a + k) * n_out + p0)
        else:
            fold16(lanes, k * LANES * ROWS, tmp, 0)
            for r in range(n):
                out[a + k, p0 + r] = tmp[r]


_FLIP = -0x7F7F7F80  # 0x80808080 as int32: every byte + 128 (mod 256)


def _planes(has_min, scales):
    """Bit masks of the scale planes a type's block step reads: sc rows (ws0, ws1, mn0, mn1), fl
    rows (wf, wm). Masks, not tuples: numba folds a constant test, an empty tuple will not type."""
    sc = {"unit": 0b0000, "same": 0b0101, "own": 0b1111}[scales]
    return sc & (0b1111 if has_min else 0b0011), 0b11 if has_min else 0b01


def _panel_rows(dec, per, has_min, scales):
    """Rows o0 .. o1 of the matrix at byte `base` of raw against tokens t0 .. t1 -> out[t, o],
    16 rows at a time: decode (cpu.py's decoders), transpose, then every token tile's blocks and
    folds. A row's arithmetic depends on nothing but the row and the token: any split gives the
    same bits."""
    block = _BLOCK[has_min, scales]
    sc_planes, fl_planes = _planes(has_min, scales)

    @njit(**_inline)
    def panels(raw, base, type_size, row_bytes, o0, o1, t0, t1, xq, xd, s16, lut, wq, sc, fl, wp, scp, flp, lanes, tmp, out):
        nb = row_bytes // type_size * per
        n_in = nb * QA
        P = sc.shape[1] // ROWS
        for p0 in range(o0, o1, ROWS):
            n = min(ROWS, o1 - p0)
            for r in range(n):
                for w in range(nb // per):
                    dec(raw, base + (p0 + r) * row_bytes + w * type_size, wq, r * P + per * w, sc, fl, lut)
            # 16 rows x 64 bytes (2 act-blocks) at a time, up to the row's last block: not the
            # padding to P (for the 640-element down projections, 16 tiles where 10 hold values)
            for c in range(0, (nb + 1) // 2 * 16, 16):
                transpose16(wq, 4 * c, P * QA, wp, 64 * c, _FLIP)
            for c in range(0, P, 16):
                for i in range(4):
                    if sc_planes >> i & 1:
                        transpose16(sc, i * ROWS * P + c, P, scp, i * ROWS * P + ROWS * c, 0)
                for i in range(2):
                    if fl_planes >> i & 1:
                        transpose16(fl, i * ROWS * P + c, P, flp, i * ROWS * P + ROWS * c, 0)
            for a in range(t0, t1, TOKEN_TILE):
                m = min(TOKEN_TILE, t1 - a)
                lanes[: m * LANES * ROWS] = 0.0
                for b in range(nb):
                    block(wp, 8 * 64 * b, scp, flp, ROWS * b, ROWS * P, xq, a * n_in + QA * b, n_in,
                          s16, 2 * a * nb + 2 * b, xd, a * nb + b, nb, lanes, ROWS * (b % LANES), m)  # fmt: skip
                _fold_tile(lanes, m, n, a, p0, tmp, out)

    return panels


@njit(**_inline)
def _scratch(P, preset, tokens):
    """One thread's panel scratch (module docstring): rows wq, sc (preset for the types whose
    decoders leave it), fl; the transposed wp, scp, flp; the lanes of `tokens` tokens; tmp for a
    panel of fewer than 16 rows."""
    wq = np.empty(ROWS * P * QA, np.int8)
    sc = np.empty((4, ROWS * P), np.int32)
    for i in range(4):
        sc[i, :] = preset[i]
    fl = np.zeros((2, ROWS * P), F32)
    wp = np.empty(ROWS * P * QA, np.int8)
    scp = np.zeros((4, ROWS * P), np.int32)
    flp = np.zeros((2, ROWS * P), F32)
    return wq, sc, fl, wp, scp, flp, np.zeros(min(tokens, TOKEN_TILE) * LANES * ROWS, F32), np.zeros(ROWS, F32)


def _panels(name, dec, per, has_min, scales):
    """The panel row loop of a block type and the files its code comes from (jit.cached's `also`)."""
    if name in RAW:
        return _raw_panel_rows(name), (rowdot.__file__,)
    return _panel_rows(dec, per, has_min, scales), ()


def matmul_kernel(name, dec, per, has_min, preset, scales, parallel):
    """cpu.matmul's panel driver for one block type (cpu.py's decoder and its constants): the
    panels split into n_chunks ranges."""
    panels, also = _panels(name, dec, per, has_min, scales)

    def kernel(raw, type_size, row_bytes, xq, xd, xs, lut, out, n_chunks):
        n_tok, n_out = out.shape
        P = (xd.shape[1] + 15) // 16 * 16
        n_pan = (n_out + ROWS - 1) // ROWS
        for c in prange(n_chunks):
            wq, sc, fl, wp, scp, flp, lanes, tmp = _scratch(P, preset, n_tok)
            o0, o1 = ROWS * (c * n_pan // n_chunks), min(n_out, ROWS * ((c + 1) * n_pan // n_chunks))
            panels(raw, 0, type_size, row_bytes, o0, o1, 0, n_tok, xq, xd, xs, lut, wq, sc, fl, wp, scp, flp, lanes, tmp, out)

    return cached(njit(parallel=parallel, **JIT)(kernel), f"{name}-panel-{'par' if parallel else 'serial'}", also)


def grouped_kernel(name, dec, per, has_min, preset, scales, parallel):
    """cpu.matmul_grouped's panel driver: (matrix, row tile) items from a shared queue, as cpu.py's."""
    panels, also = _panels(name, dec, per, has_min, scales)

    def kernel(raw, offsets, type_size, row_bytes, starts, items, bounds, xq, xd, xs, lut, out, n_workers):
        P = (xd.shape[1] + 15) // 16 * 16
        most = 0
        for g in range(offsets.size):
            most = max(most, starts[g + 1] - starts[g])
        queue = np.zeros(1, np.int64)
        for _ in prange(n_workers):
            wq, sc, fl, wp, scp, flp, lanes, tmp = _scratch(P, preset, most)
            c = simd.fetch_add(queue, 0, 1)
            while c < bounds.size - 1:
                for i in range(bounds[c], bounds[c + 1]):
                    g, o0, o1 = items[i, 0], items[i, 1], items[i, 2]
                    panels(raw, offsets[g], type_size, row_bytes, o0, o1, starts[g], starts[g + 1],
                           xq, xd, xs, lut, wq, sc, fl, wp, scp, flp, lanes, tmp, out)  # fmt: skip
                c = simd.fetch_add(queue, 0, 1)

    return cached(njit(parallel=parallel, **JIT)(kernel), f"{name}-panel-grouped-{'par' if parallel else 'serial'}", also)


# ---------------------------------------------------------------------------------------------
# F32/F16/BF16 weights: the same panels, per element instead of per act-block


@intrinsic
def float_lanes(typingctx, wp, x, t0, cnt, n_in, lanes, li, j0):
    """Lanes j0 .. j0 + 3 of tokens t0 .. t0 + cnt (cnt <= 4) against a float panel, whole:

        lane l of token k = ((+0 + w[l] x[k, l]) + w[l + 32] x[k, l + 32]) + ...   (i < n_in)

    each product rounded, then added (docs/kernels.md's float lanes), 16 rows at once. wp: the
    panel, element i of row r at [16 i + r] (f32); x f32 [T, n_in]; token k's lane l goes to
    lanes[li + 512 k + 16 l]. 4 x 4 accumulators stay in registers for the whole row, each
    weight vector serving 4 tokens; a token past cnt repeats token t0 and is not stored."""

    def codegen(context, builder, sig, args):
        t0_, cnt_, n_in_, li_, j0_ = (_arg(context, builder, sig, args, k) for k in (2, 3, 4, 6, 7))
        zero = ir.Constant(_V16F, [0.0] * 16)
        acc = [[cgutils.alloca_once_value(builder, zero) for _ in range(4)] for _ in range(4)]
        rows = [builder.select(builder.icmp_signed("<", ir.Constant(I64, k), cnt_), builder.add(t0_, ir.Constant(I64, k)), t0_)
                for k in range(4)]  # fmt: skip
        xrow = [builder.mul(r, n_in_) for r in rows]

        def step(i, j):  # element i (i64) of lane j0 + j for the 4 tokens
            w = builder.load(_vec(context, builder, sig, args, 0, builder.mul(i, ir.Constant(I64, 16)), _V16F), align=4)
            for k in range(4):
                xv = builder.load(_vec(context, builder, sig, args, 1, builder.add(xrow[k], i), ir.FloatType()), align=4)
                prod = builder.fmul(w, _splat(builder, xv, _V16F))
                builder.store(builder.fadd(builder.load(acc[k][j]), prod), acc[k][j])

        full = builder.sdiv(n_in_, ir.Constant(I64, LANES))
        with cgutils.for_range(builder, full) as loop:
            base = builder.add(builder.mul(loop.index, ir.Constant(I64, LANES)), j0_)
            for j in range(4):
                step(builder.add(base, ir.Constant(I64, j)), j)
        tail = builder.add(builder.mul(full, ir.Constant(I64, LANES)), j0_)
        for j in range(4):  # the last, partial round: lanes whose element exists
            i = builder.add(tail, ir.Constant(I64, j))
            with builder.if_then(builder.icmp_signed("<", i, n_in_)):
                step(i, j)
        for k in range(4):
            with builder.if_then(builder.icmp_signed("<", ir.Constant(I64, k), cnt_)):
                for j in range(4):
                    idx = builder.add(li_, builder.add(ir.Constant(I64, LANES * ROWS * k), builder.mul(builder.add(j0_, ir.Constant(I64, j)), ir.Constant(I64, ROWS))))
                    builder.store(builder.load(acc[k][j]), _vec(context, builder, sig, args, 5, idx, _V16F), align=4)
        return context.get_dummy_value()

    return types.void(wp, x, t0, cnt, n_in, lanes, li, j0), codegen


def float_matmul_kernel(name, widen, load, parallel):
    """cpu.matmul's panel driver for F32/F16/BF16 weights (simd.widen16's exact widening of 16
    elements, cpu.py's `load` of one): 16 rows widened to f32 and transposed, then every 4 tokens
    x 4 lanes in registers."""

    @njit(**_inline)
    def panels(w, x, lut, o0, o1, wf, wp, lanes, tmp, out):
        n_tok, n_in = x.shape
        NP = wf.size // ROWS
        for p0 in range(o0, o1, ROWS):
            n = min(ROWS, o1 - p0)
            for r in range(n):
                i = 0
                while i + 16 <= n_in:
                    widen(wf, r * NP + i, w, (p0 + r) * n_in + i, wf, 0, lut)
                    i += 16
                for j in range(i, n_in):
                    wf[r * NP + j] = load(w, (p0 + r) * n_in + j, lut)
            for c in range(0, NP, 16):
                transpose16(wf, c, NP, wp, ROWS * c, 0)
            for a in range(0, n_tok, TOKEN_TILE):
                m = min(TOKEN_TILE, n_tok - a)
                for k in range(0, m, 4):
                    for j0 in range(0, LANES, 4):
                        float_lanes(wp, x, a + k, min(4, m - k), n_in, lanes, k * LANES * ROWS, j0)
                _fold_tile(lanes, m, n, a, p0, tmp, out)

    def kernel(w, x, lut, out, n_chunks):
        n_tok, n_in = x.shape
        n_out = out.shape[1]
        NP = (n_in + 15) // 16 * 16
        n_pan = (n_out + ROWS - 1) // ROWS
        for c in prange(n_chunks):
            wf = np.zeros(ROWS * NP, F32)
            wp = np.empty(ROWS * NP, F32)
            lanes = np.empty(min(n_tok, TOKEN_TILE) * LANES * ROWS, F32)
            tmp = np.empty(ROWS, F32)
            o0, o1 = ROWS * (c * n_pan // n_chunks), min(n_out, ROWS * ((c + 1) * n_pan // n_chunks))
            panels(w, x, lut, o0, o1, wf, wp, lanes, tmp, out)

    return cached(njit(parallel=parallel, **JIT)(kernel), f"{name}-panel-{'par' if parallel else 'serial'}")

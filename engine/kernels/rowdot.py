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
transpose-and-add reduction per 16 act-blocks (simd._reduce_groups; on AVX2 two vphaddd levels per
8, _block_totals). Each kernel asks for its row bytes ROW_PREFETCH ahead: one thread streaming a
head from memory otherwise waited on it (docs/kernels.md, session 17).

For hosts with F16C and AVX512-VNNI + AVX512BW, or AVX2 (AVAILABLE); elsewhere cpu.py keeps the
general kernel. AVX2 takes the same IR with vpmaddubsw + vpmaddwd for vpdpbusd (simd.dot_quads
says how it stays exact); LLVM splits the 512-bit vectors in two. The IQ2/IQ3 grid kernels have
an AVX512-VBMI form and an AVX2 one (IQ_AVAILABLE; _iq_superblock_avx2 says how it stays exact).
"""

from __future__ import annotations

import os
from functools import partial

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

# AVX2 hosts (Zen 2/3, most Intel desktops) take the same kernels with vpmaddubsw for vpdpbusd
# (simd.dot_quads); STRATA_ROWDOT_AVX2=0 keeps them on cpu.py's general kernel, for comparison.
AVX2 = not simd.VNNI and simd.AVX2 and os.environ.get("STRATA_ROWDOT_AVX2", "1") != "0"
AVAILABLE = bool((simd.VNNI or AVX2) and simd._X86.get("f16c"))
# The K kernels' (Q4_K, Q6_K, IQ4_XS) block sums on AVX2 by vphaddd levels, as the other token
# kernels' (_block_totals); STRATA_ROWDOT_K_HADD=0 keeps simd._reduce_groups' transpose-and-add
# there, for comparison. The disk cache keys a kernel by its source, not by this switch, so the
# kernels that read K rows carry it in their tags (_tag): else one setting's machine code would
# load under the other.
K_HADD = AVX2 and os.environ.get("STRATA_ROWDOT_K_HADD", "1") != "0"
# Q2_0's fields on AVX2 by one byte shuffle per act-block (_unpack_q2_avx2); STRATA_ROWDOT_Q2_SHUFFLE=0
# keeps the four shifts and the 64-byte interleave, for comparison (a cache tag too: _tag).
Q2_SHUFFLE = AVX2 and os.environ.get("STRATA_ROWDOT_Q2_SHUFFLE", "1") != "0"
# Bytes ahead of the row bytes being read that the token kernels ask the cache for (0: none).
# The rows are one sequential stream, yet Zen 3's own prefetcher left one thread waiting on
# memory: the Q6_K head (521 MB) read at 12.4 GB/s against 14.4 for its rows in cache; 3 KB
# ahead it read at 16.1 (2 threads: 20.5 -> 25.5 GB/s of 27). STRATA_ROWDOT_PREFETCH=N sets it
# (a cache tag too: _tag).
_ROW_PREFETCH = 3072
ROW_PREFETCH = int(os.environ.get("STRATA_ROWDOT_PREFETCH", str(_ROW_PREFETCH)))
# Which cache those lines are asked into: "l2" (prefetcht1), "l1" (prefetcht0) or "nta". Into L1,
# as until 2026-12-04, the seed-4l qwen4exp token took 6.5-8% longer on the 2-core Intel VM at 1 and
# 2 threads (the Q8_0 head 12.3 -> 15.4 GB/s at one thread). The likely cause, not measured: a line
# asked for 3 KB ahead holds an L1 miss buffer the whole way, and L1 has far fewer than L2. "nta"
# took 1.7x as long.
# STRATA_ROWDOT_PREFETCH_CACHE=l1 gives the old code, for comparison (a cache tag too: _tag).
_LOCALITY = {"l1": 3, "l2": 2, "nta": 0}
ROW_PREFETCH_CACHE = os.environ.get("STRATA_ROWDOT_PREFETCH_CACHE", "l2")
if ROW_PREFETCH_CACHE not in _LOCALITY:
    raise ValueError(f"STRATA_ROWDOT_PREFETCH_CACHE={ROW_PREFETCH_CACHE!r}: expected one of {', '.join(_LOCALITY)}")

I8, I16, I32, I64 = simd.I8, simd.I16, simd.I32, simd.I64

# IQ4_NL's 16 values + 128, as the unsigned bytes vpdpbusd multiplies (int8 bit patterns)
_KV_U = [((int(v) + 128) & 0xFF) - 256 * (((int(v) + 128) & 0xFF) > 127) for v in T.KVALUES_IQ4NL]

# name: (block bytes, offset): each block is an fp16 scale at byte 0 and 32 values; the unpacker
# gives them as unsigned bytes u = value + offset, so the exact integer sum is
# vpdpbusd(u, x) - offset * (sum of x)
TYPES = {"Q8_0": (34, 128), "Q4_0": (18, 8), "Q5_0": (22, 16), "IQ4_NL": (18, 128), "Q2_0": (18, 1)}
# Q2_0's block is 64 elements (an fp16 scale and 16 bytes of 2-bit fields): two act-blocks with
# one scale, which its unpacker gives at once (_unpack_q2), so its act-blocks go in even pairs.
# The routed experts' down projections of seed-4l's layers 1 and 3 are Q2_0 (640-long rows, 10
# blocks); decoded row by row into scratch they read at ~4 GB/s per thread (docs/performance.md).
PAIRED = frozenset({"Q2_0"})
_VBMI = bool(simd._X86.get("avx512vbmi"))


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
        u = _pshufb(builder, ir.Constant(v32, [ir.Constant(I8, k) for k in _KV_U * 2]), u)
    return u


def _pshufb(builder, table, idx):
    """<32 or 64 x i8>: byte j = table[idx[j]] within j's 128-bit lane (idx < 16; the table in every
    lane). 64 bytes: one AVX512BW vpshufb, else two AVX2 ones."""
    n = idx.type.count
    if n == 64 and simd._X86.get("avx512bw"):
        v64 = ir.VectorType(I8, 64)
        return builder.call(simd._fn(builder, "llvm.x86.avx512.pshuf.b.512", v64, [v64, v64]), [table, idx])
    v32 = ir.VectorType(I8, 32)
    fn = simd._fn(builder, "llvm.x86.avx2.pshuf.b", v32, [v32, v32])
    parts = [builder.call(fn, [builder.shuffle_vector(v, v, simd._mask(32, range(k, k + 32))) for v in (table, idx)]) for k in range(0, n, 32)]
    return parts[0] if n == 32 else builder.shuffle_vector(parts[0], parts[1], simd._mask(64, range(64)))


def _unpack_q2(builder, load, at):
    """The 64 values of the Q2_0 block at byte `at` as <64 x i8> holding value + 1 (its 2-bit
    fields as stored: element 4j + k is bits 2k.. of byte j of the 16 at byte 2; w = (q - 1) d).
    With AVX512-VBMI: bytes 2m, 2m + 1 spread to the start of qword m, then one vpmultishiftqb takes
    field r of the qword from bit 2r (3 instructions for 64 values); AVX2: _unpack_q2_avx2;
    elsewhere four shifts and a byte interleave, as simd.crumbs64 decodes them."""
    v16, v64 = ir.VectorType(I8, 16), ir.VectorType(I8, 64)
    qs = load(builder.add(at, ir.Constant(I64, 2)), v16)
    three = simd._splat(builder, ir.Constant(I8, 3), v64)
    if _VBMI:
        spread = builder.shuffle_vector(qs, qs, simd._mask(64, [2 * (i // 8) + min(i % 8, 1) for i in range(64)]))
        return builder.and_(_fields(builder, spread, [2 * r for r in range(8)]), three)
    v32 = ir.VectorType(I8, 32)
    if Q2_SHUFFLE:
        return _unpack_q2_avx2(builder, qs)
    parts = [builder.and_(builder.lshr(qs, simd._splat(builder, ir.Constant(I8, 2 * k), v16)), simd._splat(builder, ir.Constant(I8, 3), v16))
             for k in range(4)]  # fmt: skip
    pair01 = builder.shuffle_vector(parts[0], parts[1], simd._mask(32, range(32)))
    pair23 = builder.shuffle_vector(parts[2], parts[3], simd._mask(32, range(32)))
    assert pair01.type == v32
    return builder.shuffle_vector(pair01, pair23, simd._mask(64, [16 * (i % 4) + i // 4 for i in range(64)]))


def _unpack_q2_avx2(builder, qs):
    """AVX2: _unpack_q2's <64 x i8> from its 16 bytes qs. Act-block h's element 4j + k (j < 8) is
    bits 2k of byte 8h + j: one byte shuffle puts byte j (k even) or byte j >> 2 (k odd) at
    element 4j + k, then the words of k = 2, 3 shift by 4 more and every byte keeps its low 2 bits
    (each shift's bits from the next byte land above them). The four-shifts-and-interleave form
    cost Q2_0 1.5x Q4_0's time per act-block on rows of 2560 (its 64-byte interleave, split by LLVM)."""
    v16, v32, w16 = ir.VectorType(I8, 16), ir.VectorType(I8, 32), ir.VectorType(I16, 16)
    q2 = builder.bitcast(builder.lshr(builder.bitcast(qs, ir.VectorType(I16, 8)), simd._splat(builder, ir.Constant(I16, 2), ir.VectorType(I16, 8))), v16)
    out = []
    for h in range(2):
        src = builder.shuffle_vector(qs, q2, simd._mask(16, [*range(8 * h, 8 * h + 8), *range(16 + 8 * h, 24 + 8 * h)]))
        v = builder.bitcast(builder.shuffle_vector(src, src, simd._mask(32, [(e >> 2) + 8 * (e & 1) for e in range(32)])), w16)
        odd = ir.Constant(ir.VectorType(ir.IntType(1), 16), [w % 2 for w in range(16)])
        v = builder.select(odd, builder.lshr(v, simd._splat(builder, ir.Constant(I16, 4), w16)), v)
        out.append(builder.and_(builder.bitcast(v, v32), simd._splat(builder, ir.Constant(I8, 3), v32)))
    return builder.shuffle_vector(out[0], out[1], simd._mask(64, range(64)))


def _prefetch(builder, ptr, at, n_bytes):
    """Ask for the cache lines of the n_bytes at byte `at` of raw, ROW_PREFETCH bytes ahead, into
    ROW_PREFETCH_CACHE."""
    if ROW_PREFETCH:
        pf = simd._fn(builder, "llvm.prefetch.p0", ir.VoidType(), [I8.as_pointer(), I32, I32, I32])
        for ahead in range(ROW_PREFETCH, ROW_PREFETCH + n_bytes, 64):
            builder.call(pf, [ptr("raw", builder.add(at, ir.Constant(I64, ahead)), I8), ir.Constant(I32, 0), ir.Constant(I32, _LOCALITY[ROW_PREFETCH_CACHE]),
                              ir.Constant(I32, 1)])


def _row(name: str, fine: bool, full: bool = False):
    def impl(typingctx, raw, p, nb, xq, xd, xd1, xs):
        """The dot of the `name` row at byte p of raw (nb blocks) with one token's ActQ: xq (int8,
        nb * 32 values) and its scales and sums, readable up to nb rounded up to 16 blocks: xd (f32
        per block) and xs (int32 block sums of xq; xd1 unused), or for the fine form (d per 16)
        xd, xd1 (the first and second halves' scales per block) and xs (int32 half sums, 2 per
        block, as ActQ.s16). Returns the f32 result, bit for bit simd.row_epilogue's for the row.
        full: xq may hold -128 (the wide form's lo plane; ROW_FULL says why that matters)."""
        return types.float32(raw, p, nb, xq, xd, xd1, xs), lambda context, builder, sig, args: _codegen(context, builder, sig, args, name, fine, full=full)

    return impl


def _codegen(context, builder, sig, args, name, fine, wide=False, full=False, few=0):
    size, offset = TYPES[name]
    f16v, i16v = ir.VectorType(ir.FloatType(), 16), ir.VectorType(I32, 16)
    v32, v64 = ir.VectorType(I8, 32), ir.VectorType(I8, 64)
    p, nb = (context.cast(builder, args[k], sig.args[k], types.intp) for k in (1, 2))
    base = {}
    # wide: args 5 and 6 are the hi and the lo plane's block sums (xs, xs_lo); xq holds both planes.
    # few: args 3-5 are xq [few, n_in], xd [few, P], xs [few, P] (P: nb rounded up to 16)
    names = ((0, "raw"), (3, "xq"), (4, "xd"), (5, "xs")) if few else \
        ((0, "raw"), (3, "xq"), (4, "xd"), (5, "xs" if wide else "xd1"), (6, "xs_lo" if wide else "xs"))
    for k, arr in names:
        base[arr] = context.make_array(sig.args[k])(context, builder, args[k]).data
    n_in = builder.mul(nb, ir.Constant(I64, QA))  # the lo plane's (a few-token row's: token 1's) first byte in xq
    zero = ir.Constant(I64, 0)
    # the activation streams the weights are multiplied by, each unpacked block once for all:
    # (first byte in xq, first scale in xd, block sums' array and first index, may hold -128)
    if few:
        P = builder.mul(builder.udiv(builder.add(nb, ir.Constant(I64, 15)), ir.Constant(I64, 16)), ir.Constant(I64, 16))
        acts = [(builder.mul(n_in, ir.Constant(I64, t)), builder.mul(P, ir.Constant(I64, t)), "xs",
                 builder.mul(P, ir.Constant(I64, t)), full) for t in range(few)]  # fmt: skip
    elif wide:
        acts = [(zero, zero, "xs", zero, full), (n_in, zero, "xs_lo", zero, True)]
    else:
        acts = [(zero, zero, "xs", zero, full)]
    planes = len(acts)

    def ptr(arr, idx, ty):
        return builder.bitcast(builder.gep(base[arr], [idx]), ty.as_pointer())

    off = simd._splat(builder, ir.Constant(I32, simd.quad_offset(offset)), i16v)
    last = builder.sub(nb, ir.Constant(I64, 1))
    paired = name in PAIRED
    last2 = builder.sub(nb, ir.Constant(I64, 2))
    neg0 = ir.Constant(f16v, [-0.0] * 16)
    iota = ir.Constant(ir.VectorType(I64, 16), list(range(16)))
    acc = [[cgutils.alloca_once_value(builder, ir.Constant(f16v, [0.0] * 16)) for _ in range(2)] for _ in range(planes)]

    def group(b, h, tail, n=16):
        """acc[h] += the terms of act-blocks b .. b + 15; `tail`: some are past nb, whose loads
        read block nb - 1 instead and whose terms become -0.0 (adding it changes no lane). n = 8:
        at most 8 are left, only those 8 are read and summed (a 20-block expert row's last 4
        cost a whole 16-block group: the kernel ran at 0.9x the general one); n = 4 (not the fine
        form): at most 4 are left, as the expert downs' rows of 640 end."""
        blocks = []
        for k in range(n):
            i = builder.add(b, ir.Constant(I64, k))
            if tail:  # a paired type's pair past nb reads the last pair (nb is even)
                i = builder.select(builder.icmp_unsigned("<", i, nb), i, last2 if paired and k % 2 == 0 else last)
            blocks.append(i)
        _prefetch(builder, ptr, builder.add(p, builder.mul(b, ir.Constant(I64, size // 2 if paired else size))), n * size // (2 if paired else 1))
        all_vecs, halves = [[] for _ in range(planes)], []
        for j in range(n // 2):
            w = []
            if paired:  # act-blocks 2j, 2j + 1 of the group: one block, one scale (b is even)
                at = builder.add(p, builder.mul(blocks[2 * j], ir.Constant(I64, size // 2)))
                w = _unpack_q2(builder, lambda idx, ty: builder.load(ptr("raw", idx, ty), align=1), at)
                halves += [builder.load(ptr("raw", at, I16), align=1)] * 2
            else:
                for i in blocks[2 * j : 2 * j + 2]:
                    at = builder.add(p, builder.mul(i, ir.Constant(I64, size)))
                    w.append(_unpack(builder, name, lambda idx, ty: builder.load(ptr("raw", idx, ty), align=1), at))
                    halves.append(builder.load(ptr("raw", at, I16), align=1))
                w = builder.shuffle_vector(w[0], w[1], simd._mask(64, range(64)))
            for pl in range(planes):  # the weights unpacked once, multiplied by each plane
                o = acts[pl][0]
                if tail and not paired:
                    x = [builder.load(ptr("xq", builder.add(o, builder.mul(i, ir.Constant(I64, QA))), v32), align=1)
                         for i in blocks[2 * j : 2 * j + 2]]  # fmt: skip
                    x = builder.shuffle_vector(x[0], x[1], simd._mask(64, range(64)))
                else:  # the pair's activations are contiguous: one 64-byte load
                    x = builder.load(ptr("xq", builder.add(o, builder.mul(blocks[2 * j], ir.Constant(I64, QA))), v64), align=1)
                all_vecs[pl].append(simd.dot_quads(builder, w, x, offset, x_full=acts[pl][4]))
        vecs = all_vecs[0]
        if not tail and n == 16:  # the group's bytes as words (all inside the row), the 16 scales picked out
            if paired:  # 8 blocks, each scale twice
                words = builder.load(ptr("raw", builder.add(p, builder.mul(b, ir.Constant(I64, size // 2))), ir.VectorType(I16, 4 * size)), align=1)
                dw = builder.shuffle_vector(words, words, simd._mask(16, [(k // 2) * size // 2 for k in range(16)]))
            else:
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
        wad = None
        for pl, (_, xd_at, xs_arr, xs_at, _) in enumerate(acts):
            if wad is None or few:  # (the wide form's planes share their scales)
                wad = builder.fmul(wf, builder.load(ptr("xd", builder.add(xd_at, b), f16v), align=4))
            # lane g = block b + g (n = 8: g < 8), the weights offset. AVX2: vphaddd levels, where
            # LLVM's split of the 512-bit shuffles took ~4 instructions per block (the LM head)
            r = _block_totals(builder, all_vecs[pl]) if AVX2 else simd._reduce_groups(builder, all_vecs[pl], 2, 8)
            isum = builder.sub(r, builder.mul(builder.load(ptr(xs_arr, builder.add(xs_at, b), i16v), align=4), off))
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
                        if fine:
                            group(b, h, True, 8)
                        else:
                            four = builder.icmp_unsigned("<", builder.add(b, ir.Constant(I64, 4)), nb)  # more than 4 left
                            with builder.if_else(four) as (more4, last4):
                                with more4:
                                    group(b, h, True, 8)
                                with last4:
                                    group(b, h, True, 4)

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
    if few:
        return context.make_tuple(builder, sig.return_type, folded)
    if wide:  # actq.combine16: 256 y_hi (exact) + y_lo
        return builder.fadd(builder.fmul(ir.Constant(ir.FloatType(), 256.0), folded[0]), folded[1])
    return folded[0]


ROW = {(name, fine): intrinsic(_row(name, fine)) for name in TYPES for fine in (False, True)}


def _row_few(name: str, T: int):
    def impl(typingctx, raw, p, nb, xq, xd, xs):
        """The dots of the `name` row at byte p of raw (nb blocks) with T tokens' ActQ, each block
        unpacked once for all of them: xq (int8 [T, nb * 32], C order), xd (f32 [T, P], a scale per
        block) and xs (int32 [T, P], block sums), P = nb rounded up to 16, zero past nb -> a T-tuple
        of f32, each bit for bit ROW's for its token (the same ops per token, in the same order)."""
        return types.UniTuple(types.float32, T)(raw, p, nb, xq, xd, xs), \
            lambda context, builder, sig, args: _codegen(context, builder, sig, args, name, False, few=T)

    return impl

# The types whose one-token products need the full path for an input that can hold -128. On AVX2
# (no vpdpbusd) simd.dot_quads multiplies the offset-128 types (Q8_0, IQ4_NL: weights up to 255 as
# unsigned bytes, where vpmaddubsw's pair sums would saturate) as |w| times x with w's sign moved
# onto x by vpsignb, and vpsignb cannot negate -128: -(-128) stays -128 in int8, so such a product
# comes back with the wrong sign. ActQ's 8-bit q never holds -128 (it is clipped to -127..127),
# but the wide form's lo plane does (actq.ActQ16: -128..127). ROW16 takes its lo plane by the full
# path already (x_full: both widened to 16 bits, vpmaddwd); the wide form of 2 rows goes through
# matmul as 4 plane rows (cpu._multiply16), whose lo rows took the sign trick: a verify forward's
# q/k projections of qwen4exp's QSA layers then differed from the token step's, and speculative
# decoding's KV with them (tests/engine/test_speculative.py). IQ4_XS (a K kernel) has the same
# sign trick but reads only the 8-bit form (it is not in actq.WIDE). VNNI's vpdpbusd takes any
# signed byte: there nothing needs the full path.
ROW_FULL = frozenset(name for name, (_, offset) in TYPES.items() if offset == 128 and not simd.VNNI)
ROW_X = {name: intrinsic(_row(name, False, full=True)) for name in ROW_FULL}


def needs_full(name: str, can_hold_m128: bool) -> bool:
    """Whether a product of `name` weights by activations that may hold -128 must take the full
    (16-bit) path here: ROW_FULL says why."""
    return bool(can_hold_m128) and name in ROW_FULL


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


def _row_chunk(row):
    """A one-token kernel's queue item c (simd.run_queue): rows c n_out / n_chunks .. of `row`, a
    row function of (raw, byte, nb, xq, and three planes: ROW's xd, xd1, xs or ROW16's xd, xs_hi, xs_lo)."""

    @njit(inline="always", **JIT)
    def chunk(c, a):
        raw, row_bytes, nb, xq, p1, p2, p3, out, n_chunks = a
        n_out = out.size
        for o in range(c * n_out // n_chunks, (c + 1) * n_out // n_chunks):
            out[o] = row(raw, o * row_bytes, nb, xq, p1, p2, p3)

    return chunk


def _kernel(name: str, parallel: bool, fine: bool):
    chunk = _row_chunk(ROW[name, fine])

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
        simd.run_queue(n_chunks, n_chunks, chunk, (raw, row_bytes, nb, xq, xd0, xd1, xs, out, n_chunks))

    return cached(njit(parallel=parallel, **JIT)(kernel), f"{name}-rowdot{'-fine' if fine else ''}-{'par' if parallel else 'serial'}{_tag(name)}")


def _kernel16(name: str, parallel: bool):
    chunk = _row_chunk(ROW16[name])

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
        simd.run_queue(n_chunks, n_chunks, chunk, (raw, row_bytes, nb, xq, xd0, xs_hi, xs_lo, out, n_chunks))

    return cached(njit(parallel=parallel, **JIT)(kernel), f"{name}-rowdot-wide-{'par' if parallel else 'serial'}{_tag(name)}")


_KERNELS: dict[tuple[str, bool, object], object] = {}


# A few tokens (speculative decoding's verify forward: 2-4 rows): each weight row read once from
# memory and dotted with every token's activations while it is in the cache, by the one-token
# row function, so every token's result has the one-token kernel's bits. The panel kernels took
# 3x a token step's time for 3 rows of the seed-4l model's dense products (2026-12-01).
ROWS_MAX = 4


def _rows_kernel(name: str, parallel: bool, fine: bool, lo_full: bool = False):
    row = ROW[name, fine]
    row_lo = ROW_X[name] if lo_full else row  # lo_full: the odd rows (the wide form's lo planes) by the full path

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
                    if lo_full and t % 2 == 1:
                        out[t, o] = row_lo(raw, o * row_bytes, nb, xq[t], xd0[t], xd1[t], xs[t])
                    else:
                        out[t, o] = row(raw, o * row_bytes, nb, xq[t], xd0[t], xd1[t], xs[t])

    tag = ("-fine" if fine else "") + ("-lofull" if lo_full else "")
    return cached(njit(parallel=parallel, **JIT)(kernel), f"{name}-rowdot-rows{tag}-{'par' if parallel else 'serial'}{_tag(name)}")


_ROWS_KERNELS: dict[tuple[str, bool, bool, bool], object] = {}

@njit(inline="always", **JIT)
def _padded_rows(xd, s16, nb):
    """Rows of ActQ planes with a scale per 32 elements (xd f32 [N, nb], s16 i32 [N, 2 nb]) as the
    32-element row functions read them: the scales and block sums, zero past nb up to 16 blocks."""
    P = (nb + 15) // 16 * 16
    xd0 = np.zeros((xd.shape[0], P), F32)
    xs = np.zeros((xd.shape[0], P), np.int32)
    for r in range(xd.shape[0]):
        for b in range(nb):
            xd0[r, b] = xd[r, b]
            xs[r, b] = s16[r, 2 * b] + s16[r, 2 * b + 1]
    return xd0, xs


# A verify's 2-4 rows (or a serving step's streams) through ROW_FEW: each block of a weight row
# unpacked once and multiplied by every token's activations, where _rows_kernel ran the one-token
# row function token by token (the unpack, the scale loads and the prefetch again per token).
# STRATA_ROWDOT_FEW=0 keeps _rows_kernel and the raw panels (cpu._multiply), for comparison.
FEW = os.environ.get("STRATA_ROWDOT_FEW", "1") != "0"
ROW_FEW = {(name, T): intrinsic(_row_few(name, T)) for name in TYPES for T in range(2, ROWS_MAX + 1)}


def _few_kernel(name: str, parallel: bool, T: int):
    row = ROW_FEW[name, T]

    def kernel(raw, row_bytes, xq, xd, s16, out, n_chunks):
        # xq i8 [T, n_in] (C order); xd f32 [T, nb]; s16 i32 [T, 2 nb]; out f32 [T, n_out]
        nb = xq.shape[1] // QA
        xd0, xs = _padded_rows(xd, s16, nb)
        n_out = out.shape[1]
        for c in prange(n_chunks):
            for o in range(c * n_out // n_chunks, (c + 1) * n_out // n_chunks):
                r = row(raw, o * row_bytes, nb, xq, xd0, xs)
                for t in range(T):
                    out[t, o] = r[t]

    return cached(njit(parallel=parallel, **JIT)(kernel), f"{name}-rowdot-few{T}-{'par' if parallel else 'serial'}{_tag(name)}")


_FEW_KERNELS: dict[tuple[str, bool, int], object] = {}


def few_rows(name: str, rows: int, fine: bool, wide: bool) -> bool:
    """Whether `matmul` takes `rows` activation rows (a wide form's planes: two a token) of `name`
    through ROW_FEW (one unpack per block for all of them)."""
    return FEW and not fine and 2 <= rows <= ROWS_MAX and not needs_full(name, wide)


def matmul(name: str, raw: np.ndarray, row_bytes: int, xq: np.ndarray, xd: np.ndarray, s16: np.ndarray, out: np.ndarray,
           parallel: bool, n_chunks: int, wide: bool = False) -> None:  # fmt: skip
    """`matvec` for T <= ROWS_MAX tokens at once, each row of the matrix read once: xq int8 [T, n_in],
    xd f32 [T, n_in / 32] (fine form: [T, n_in / 16]), s16 int32 [T, n_in / 16], out f32 [T, n_out];
    token t's row of out is bit for bit `matvec`'s for that token alone. wide: the rows are an
    actq.ActQ16's planes (row 2t the hi plane of token t, 2t + 1 its lo plane, which holds -128):
    the lo rows of the ROW_FULL types take the full path (needs_full), the others as above."""
    fine = xd.shape[1] == 2 * (xq.shape[1] // QA)
    T = xq.shape[0]
    if few_rows(name, T, fine, wide) and xq.flags.c_contiguous:
        key = (name, parallel, T)
        if key not in _FEW_KERNELS:
            _FEW_KERNELS[key] = _few_kernel(*key)
        _FEW_KERNELS[key](raw, row_bytes, xq, xd, s16, out, n_chunks)
        return
    key = (name, parallel, fine, needs_full(name, wide) and not fine)
    if key not in _ROWS_KERNELS:
        _ROWS_KERNELS[key] = _rows_kernel(*key)
    _ROWS_KERNELS[key](raw, row_bytes, xq, xd, s16, out, n_chunks)


def matvec(name: str, raw: np.ndarray, row_bytes: int, xq: np.ndarray, xd: np.ndarray, s16: np.ndarray, out: np.ndarray,
           parallel: bool, n_chunks: int, wide: bool = False) -> None:  # fmt: skip
    """out[o] = row o of the `name` (NAMES) matrix raw (flat u8, row_bytes per row) . the token's
    ActQ planes (xq int8 [n_in], xd f32 [n_in / 32], or [n_in / 16] for the fine form, s16 int32
    [n_in / 16], contiguous); rows split into n_chunks on the pool if `parallel`. The caller
    (cpu.matvec) has validated the shapes. wide: the planes of an actq.ActQ16 (xq [2 n_in], xd
    [2 n_in / 32], s16 [2 n_in / 16]: hi, then lo), out = f32(256) (W . hi) + W . lo."""
    fine = xd.size == 2 * (xq.size // QA)
    if fine and not wide and name in KTYPES:
        raise ValueError(f"rowdot.matvec: {name} takes activations with a scale per 32 elements, got {xd.size} scales for {xq.size}")
    one_kernel(name, parallel, "wide" if wide else fine)(raw, row_bytes, xq, xd, s16, out, n_chunks)


def one_kernel(name: str, parallel: bool, form):
    """`matvec`'s kernel: form "wide" (the planes of an ActQ16), True (the fine form: a scale per 16
    elements) or False (a scale per 32). cpu.TokenProducts keeps it to launch without the lookup."""
    key = (name, parallel, form)
    kernel = _KERNELS.get(key)
    if kernel is None:
        if form == "wide":
            kernel = _kernel16(name, parallel)
        elif name in KTYPES:  # (their kernel reads a scale per 32 elements: `matvec` refuses the fine form)
            kernel = _kkernel(name, parallel)
        else:
            kernel = _kernel(name, parallel, form)
        _KERNELS[key] = kernel
    return kernel


# ---------------------------------------------------------------------------------------------
# The K-quants (Q4_K, Q6_K): 256-element super-blocks of 8 act-blocks with integer sub-block
# scales. qwen35moe as released keeps its LM head (Q6_K, 521 MB at vocab 248320), its GDN and
# attention projections and its shared experts in these types; through the general row kernel
# they read at 27-50% of bandwidth (docs/kernels.md). Same arithmetic, per act-block b of a
# super-block (reference.block_terms; docs/kernels.md's table):
#
#   Q4_K  term[b] = (f32(d) * xd[b]) * f32(sc_k * S[b]) + (f32(-dmin) * xd[b]) * f32(m_k * (s16[2b] + s16[2b+1]))
#   Q6_K  term[b] = (f32(d) * xd[b]) * f32(sc[2k] * S0[b] + sc[2k+1] * S1[b])
#
# S = the exact integer sum of weight x activation over the act-block (S0, S1: its halves). The
# lanes and the fold are the 32-element types' (lane b % 32 from +0 in block order): a super-block
# at act-block 8i fills lanes 8 (i % 4) .. + 7, so four <8 x f32> accumulators hold the 32 lanes.
# A K row is whole super-blocks, so there is no tail inside one. Activations are read in place
# (xq, xd, s16 as ActQ holds them): nothing is allocated per call. On AVX2 the sums S (S0, S1)
# come out of two vphaddd levels (_block_totals, _block_sums: K_HADD): LLVM split the 512-bit
# transpose-and-add of simd._reduce_groups into several shuffles per block (one thread, 512 rows
# of 2560 in cache: Q4_K 15.0 -> 12.9 ns per super-block, Q6_K 16.8 -> 14.8, IQ4_XS 19.8 -> 17.4).

KTYPES = {"Q4_K": 144, "Q6_K": 210, "IQ4_XS": 136}  # name: super-block bytes
QK = 256
_K_SUPER = frozenset(KTYPES)  # the types _k_superblock computes (KTYPES gains the IQ types below)


def _tag(*names) -> str:
    """The cache-tag suffix of a kernel that reads rows of `names`: the settings of the switches
    that change its code (K_HADD, Q2_SHUFFLE, ROW_PREFETCH, ROW_PREFETCH_CACHE, IQ_CODES) where they
    are not the default."""
    off = AVX2 and not K_HADD and _K_SUPER.intersection(names)
    reads = (_K_SUPER | set(TYPES)).intersection(names)  # (the kernels that prefetch)
    pf = "" if ROW_PREFETCH == _ROW_PREFETCH or not reads else f"-pf{ROW_PREFETCH}"
    pf += "" if ROW_PREFETCH_CACHE == "l2" or not reads else f"-{ROW_PREFETCH_CACHE}"
    flip = sorted(n for n in IQTYPES if n in names and (n in IQ_CODES) != (n in _IQ_CODES_DEFAULT)) if IQ_VBMI else []
    codes = "".join(f"-{n.lower()}{'codes' if n in IQ_CODES else 'loads'}" for n in flip)
    return ("-kreduce" if off else "") + ("-q2interleave" if AVX2 and not Q2_SHUFFLE and "Q2_0" in names else "") + pf + codes




def _k_scales(builder, S):
    """Q4_K's 6-bit scales and mins of a super-block from its 12 scale bytes (S: <16 x i8>, bytes 0..11
    used) -> (sc, m) as <8 x i32>. Byte diagram: reference.py beside _k4_scale_min.
        k < 4:  sc = S[k] & 63                      m = S[k + 4] & 63
        k >= 4: sc = S[k + 4] & 15 | (S[k - 4] >> 6) << 4    m = S[k + 4] >> 4 | (S[k] >> 6) << 4"""
    v8 = ir.VectorType(I8, 8)

    def c(vals):
        return ir.Constant(v8, [ir.Constant(I8, x) for x in vals])

    def pick(idx):
        return builder.shuffle_vector(S, S, simd._mask(8, idx))

    lo = builder.and_(pick([0, 1, 2, 3, 8, 9, 10, 11]), c([63] * 4 + [15] * 4))
    hi = builder.and_(builder.lshr(pick([0, 0, 0, 0, 0, 1, 2, 3]), c([2] * 8)), c([0] * 4 + [0x30] * 4))
    mlo = builder.and_(builder.lshr(pick([4, 5, 6, 7, 8, 9, 10, 11]), c([0] * 4 + [4] * 4)), c([63] * 8))
    mhi = builder.and_(builder.lshr(pick([0, 0, 0, 0, 4, 5, 6, 7]), c([2] * 8)), c([0] * 4 + [0x30] * 4))
    i8v = ir.VectorType(I32, 8)
    return builder.zext(builder.or_(lo, hi), i8v), builder.zext(builder.or_(mlo, mhi), i8v)


def _k_superblock(builder, name, ptr, p, sb):
    """The <8 x f32> terms of super-block sb of the row at byte p (act-blocks 8 sb .. 8 sb + 7)."""
    v16, v32, v64 = ir.VectorType(I8, 16), ir.VectorType(I8, 32), ir.VectorType(I8, 64)
    i16v, i8v, f8v = ir.VectorType(I32, 16), ir.VectorType(I32, 8), ir.VectorType(ir.FloatType(), 8)
    at = builder.add(p, builder.mul(sb, ir.Constant(I64, KTYPES[name])))
    b = builder.mul(sb, ir.Constant(I64, 8))

    def raw(off, ty):
        return builder.load(ptr("raw", builder.add(at, ir.Constant(I64, off)), ty), align=1)

    _prefetch(builder, ptr, at, KTYPES[name])

    def c8(x, ty=v32):
        return simd._splat(builder, ir.Constant(I8, x), ty)

    def dot(w, k, offset):  # the 64 unsigned weight bytes (value + offset) of act-blocks b + k, b + k + 1
        x = builder.load(ptr("xq", builder.mul(builder.add(b, ir.Constant(I64, k)), ir.Constant(I64, QA)), v64), align=1)
        return simd.dot_quads(builder, w, x, offset)

    def cat(lo, hi):
        return builder.shuffle_vector(lo, hi, simd._mask(64, range(64)))

    def half_of(v):  # lanes 0..7 of a <16 x i32>
        return builder.shuffle_vector(v, v, simd._mask(8, range(8)))

    def totals(vecs):  # dot's 4 act-block pairs -> <8 x i32>, lane k = act-block k's sum
        if K_HADD:  # two vphaddd levels, as the 32-element kernels' (_block_totals)
            return half_of(_block_totals(builder, vecs))
        return half_of(simd._reduce_groups(builder, vecs, 2, 8))

    ad = builder.load(ptr("xd", b, f8v), align=4)
    d = builder.fpext(builder.bitcast(raw(208 if name == "Q6_K" else 0, I16), ir.HalfType()), ir.FloatType())
    wf = builder.fmul(simd._splat(builder, d, f8v), ad)
    hs = builder.load(ptr("xs", builder.add(b, b), i16v), align=4)  # s16 of the 16 halves
    if name == "Q4_K":
        # act-block 2j + h: nibble h of qs[32 j ..] (qs at byte 16); values 0..15, no offset
        vecs = []
        for j in range(4):
            qs = raw(16 + 32 * j, v32)
            vecs.append(dot(cat(builder.and_(qs, c8(15)), builder.lshr(qs, c8(4))), 2 * j, 0))
        s = totals(vecs)
        sc, m = _k_scales(builder, raw(4, v16))
        bs = builder.add(builder.shuffle_vector(hs, hs, simd._mask(8, range(0, 16, 2))),
                         builder.shuffle_vector(hs, hs, simd._mask(8, range(1, 16, 2))))  # fmt: skip
        dmin = builder.fpext(builder.bitcast(raw(2, I16), ir.HalfType()), ir.FloatType())
        wm = builder.fmul(simd._splat(builder, builder.fneg(dmin), f8v), ad)
        return builder.fadd(builder.fmul(wf, builder.sitofp(builder.mul(s, sc), f8v)),
                            builder.fmul(wm, builder.sitofp(builder.mul(bs, m), f8v)))  # fmt: skip
    if name == "IQ4_XS":
        # act-block k: the nibbles of qs[16 k ..] (qs at byte 8; low nibbles first, as IQ4_NL),
        # each through the kvalues table + 128 (an in-lane byte shuffle): u = value + 128, so the
        # exact sum is vpdpbusd(u, x) - 128 x (the block's sum of x); ls - 32 per act-block
        kv = ir.Constant(v64, [ir.Constant(I8, k) for k in _KV_U * 4])
        vecs = []
        for j in range(4):  # act-blocks 2j, 2j + 1: 32 bytes
            qs = raw(8 + 32 * j, v32)
            lo, hi = builder.and_(qs, c8(15)), builder.lshr(qs, c8(4))
            u = builder.shuffle_vector(lo, hi, simd._mask(64, [*range(16), *range(32, 48), *range(16, 32), *range(48, 64)]))
            vecs.append(dot(_pshufb(builder, kv, u), 2 * j, 128))
        s = totals(vecs)
        bs = builder.add(builder.shuffle_vector(hs, hs, simd._mask(8, range(0, 16, 2))),
                         builder.shuffle_vector(hs, hs, simd._mask(8, range(1, 16, 2))))  # fmt: skip
        s = builder.sub(s, builder.mul(bs, simd._splat(builder, ir.Constant(I32, simd.quad_offset(128)), i8v)))

        def c32(vals):
            return ir.Constant(i8v, [ir.Constant(I32, x) for x in vals])

        sl = builder.zext(builder.shuffle_vector(raw(4, ir.VectorType(I8, 4)), raw(4, ir.VectorType(I8, 4)), simd._mask(8, [k // 2 for k in range(8)])), i8v)
        sl = builder.and_(builder.lshr(sl, c32([4 * (k % 2) for k in range(8)])), c32([15] * 8))
        sh = simd._splat(builder, builder.zext(raw(2, I16), I32), i8v)
        sh = builder.shl(builder.and_(builder.lshr(sh, c32([2 * k for k in range(8)])), c32([3] * 8)), c32([4] * 8))
        sc = builder.sub(builder.or_(sl, sh), c32([32] * 8))
        return builder.fmul(wf, builder.sitofp(builder.mul(s, sc), f8v))
    # Q6_K: act-block 4n + j, element l: low nibble (j / 2) of ql[64 n + 32 (j % 2) + l], bits 2j
    # of qh[32 n + l] above them: u = q + 32 in 0..63 (ql at byte 0, qh at 128, scales at 192)
    vecs = []
    for n in range(2):
        A, B, H = raw(64 * n, v32), raw(64 * n + 32, v32), raw(128 + 32 * n, v32)
        high = [builder.and_(builder.shl(H, c8(4)), c8(0x30)), builder.and_(builder.shl(H, c8(2)), c8(0x30)),
                builder.and_(H, c8(0x30)), builder.and_(builder.lshr(H, c8(2)), c8(0x30))]  # fmt: skip
        u = [builder.or_(builder.and_(A, c8(15)), high[0]), builder.or_(builder.and_(B, c8(15)), high[1]),
             builder.or_(builder.lshr(A, c8(4)), high[2]), builder.or_(builder.lshr(B, c8(4)), high[3])]  # fmt: skip
        vecs += [dot(cat(u[0], u[1]), 4 * n, 32), dot(cat(u[2], u[3]), 4 * n + 2, 32)]
    if K_HADD:
        # the half sums by two vphaddd levels (_block_sums), the offset x s16 and the int8 scales
        # moved into their lanes (4h + k: half h of act-block k, then k + 4) before, not after
        halves = [_pick(builder, v, range(8 * q, 8 * q + 8)) for v in vecs for q in range(2)]
        lanes = [[2 * k + q for q in range(2) for k in range(4 * u, 4 * u + 4)] for u in range(2)]
        off = [builder.mul(_pick(builder, hs, ln), _c32(builder, simd.quad_offset(32))) for ln in lanes]
        sc = raw(192, v16)
        ws = [builder.sext(_pick(builder, sc, ln), i8v) for ln in lanes]
        return builder.fmul(wf, builder.sitofp(_block_sums(builder, halves, ws, off), f8v))
    h = builder.sub(simd._reduce_groups(builder, vecs, 4, 4), builder.mul(hs, simd._splat(builder, ir.Constant(I32, simd.quad_offset(32)), i16v)))
    h = builder.mul(h, builder.sext(raw(192, v16), i16v))  # each half times its int8 scale
    s = builder.add(builder.shuffle_vector(h, h, simd._mask(8, range(0, 16, 2))), builder.shuffle_vector(h, h, simd._mask(8, range(1, 16, 2))))
    return builder.fmul(wf, builder.sitofp(s, f8v))


# ---------------------------------------------------------------------------------------------
# The IQ2/IQ3 grid types of the routed experts (IQ2_XXS, IQ2_XS, IQ3_XXS: seed-4l's gate and up
# projections). The general kernel decodes each row through the grids into int8 scratch for the
# token's one dot: ~2-3 GB/s per thread where the Q8_0 head reads at ~22 (docs/performance.md).
# Here a super-block's grid entries are fetched straight into vectors and the signs go onto the
# activations instead of the weights (grid values are all positive, so the grid bytes are the
# unsigned operand of vpdpbusd as they are, with no offset to take back off):
#
#   x'[e] = -x[e] where the weight's sign bit e is set, else x[e]     (|x| <= 127: exact)
#   S0, S1 = vpdpbusd(grid bytes, x') summed over each half act-block (exact integers)
#   term[b] = (f32(d) * 2^-3 (IQ3_XXS: 2^-2) * xd[b]) * f32(ws0 S0 + ws1 S1)
#
# the general kernel's term to the bit (simd.row_epilogue "same" / "own": wf = d * 0.125 exactly,
# then wf * xd, then times the exact integer sum), in the K types' lanes and fold. Sign bytes:
# 7 stored bits and an 8th that makes their parity even, looked up in ggml's ksigns table.
#
# The sign fields come out by vpmultishiftqb and vpermi2b: AVX512-VBMI (Ice Lake and Zen 4 on,
# not Cascade Lake). AVX2 hosts take _iq_superblock_avx2 (below); Cascade Lake keeps cpu.py's row
# kernel.
IQ_VBMI = AVAILABLE and simd.VNNI and bool(simd._X86.get("avx512vbmi") and simd._X86.get("avx512vl"))

PERMUTE_IQ3 = True  # IQ3_XXS's grid entries by register permutes (_lookup_perm), not scalar loads
PREFETCH = (512, 576)  # bytes ahead of a super-block whose cache lines are asked for (5-8 super-blocks)
IQTYPES = {"IQ2_XXS": 66, "IQ2_XS": 74, "IQ3_XXS": 98}  # name: super-block bytes
_GRIDS = {"IQ2_XXS": (T.IQ2XXS_GRID, 64), "IQ2_XS": (T.IQ2XS_GRID, 64), "IQ3_XXS": (T.IQ3XXS_GRID, 32)}
# The grid types whose entries come as codes through byte permutes (_grid_codes), not by loads or
# _lookup_perm: one thread, a 640 x 2560 matrix in L2, Zen 4, super-blocks a second against the
# loads: IQ3_XXS 79 M against 45 (1.75x, _lookup_perm's permutes and selects gone), IQ2_XXS 77
# against 70 (1.08x), IQ2_XS 63 against 65 (0.95x: its 512 entries take twice the permutes, so it
# keeps the loads). STRATA_ROWDOT_IQ_CODES: the types, comma-separated ("0": none), to time one
# form against the other (benchmarks/switch_ab.py).
_IQ_CODES_DEFAULT = frozenset({"IQ2_XXS", "IQ3_XXS"})
_IQ_CODES = os.environ.get("STRATA_ROWDOT_IQ_CODES", ",".join(sorted(_IQ_CODES_DEFAULT)))
IQ_CODES = frozenset() if _IQ_CODES.strip() in ("", "0") else frozenset(n.strip() for n in _IQ_CODES.split(","))
if not IQ_CODES <= set(IQTYPES):
    raise ValueError(f"STRATA_ROWDOT_IQ_CODES={_IQ_CODES!r}: expected grid types of {sorted(IQTYPES)}, comma-separated, or 0")


def _grid_table(builder, name):
    """The type's grid as a constant array in the kernel's own module (one L1-resident table)."""
    table, bits = _GRIDS[name]
    gname = f"strata_grid_{name.lower()}"
    try:
        return builder.module.get_global(gname)
    except KeyError:
        ty = ir.ArrayType(ir.IntType(bits), table.size)
        g = ir.GlobalVariable(builder.module, ty, gname)
        g.initializer = ir.Constant(ty, [int(v) for v in table])
        g.global_constant = True
        g.linkage = "internal"
        return g


def _lookup(builder, table, idxs, word=I64):
    """<64 x i8>: the 8-byte words table[i] for the 8 (i64) indices idxs, or for pairs (i, j) of
    a 4-byte table, table[i] | table[j] << 32. Scalar loads from the L1 table (a vpgatherqq of 8
    ran at 0.7x them on Zen 4), the words put together by LLVM's shuffles. Any number of indices
    (<8 n x i8>); word=I32: one 4-byte entry per index (<4 n x i8>)."""
    v = ir.Constant(ir.VectorType(word, len(idxs)), ir.Undefined)
    for n, k in enumerate(idxs):
        if isinstance(k, tuple):
            lo, hi = (builder.zext(builder.load(builder.gep(table, [ir.Constant(I64, 0), i]), align=4), I64) for i in k)
            entry = builder.or_(lo, builder.shl(hi, ir.Constant(I64, 32)))
        else:
            entry = builder.load(builder.gep(table, [ir.Constant(I64, 0), k]), align=word.width // 8)
        v = builder.insert_element(v, entry, ir.Constant(I32, n))
    return builder.bitcast(v, ir.VectorType(I8, word.width // 8 * len(idxs)))


def _lookup_perm(builder, name, idx16):
    """<64 x i8>: the 4-byte entries table[i] of the 16 grid indices in idx16 (<16 x i8>, IQ3_XXS's
    256-entry table), by register permutes instead of scalar loads: the table is 16 vectors of 16
    entries, vpermi2d picks from each pair of them by the index's low 5 bits, then a select tree
    on bits 5, 6, 7 (8 permutes and 7 selects per 16 entries, where the scalar form took 16 loads
    of indices, 16 of entries and their inserts)."""
    table, _ = _GRIDS[name]
    i16v = ir.VectorType(I32, 16)
    fn = simd._fn(builder, "llvm.x86.avx512.vpermi2var.d.512", i16v, [i16v] * 3)
    idx = builder.zext(idx16, i16v)
    parts = [builder.call(fn, [ir.Constant(i16v, [ir.Constant(I32, int(v) - (1 << 32) * (int(v) >> 31)) for v in table[32 * k : 32 * k + 16]]), idx,
                               ir.Constant(i16v, [ir.Constant(I32, int(v) - (1 << 32) * (int(v) >> 31)) for v in table[32 * k + 16 : 32 * k + 32]])])
             for k in range(8)]  # fmt: skip
    for bit in (5, 6, 7):
        on = builder.icmp_unsigned("!=", builder.and_(idx, simd._splat(builder, ir.Constant(I32, 1 << bit), i16v)), ir.Constant(i16v, None))
        parts = [builder.select(on, parts[2 * k + 1], parts[2 * k]) for k in range(len(parts) // 2)]
    return builder.bitcast(parts[0], ir.VectorType(I8, 64))


def _code_planes(name: str) -> tuple[list[int], list[int], list[int], int]:
    """The grid of `name` as codes: every entry's bytes take few values (IQ2's 8 bytes 3, IQ3_XXS's
    4 bytes 8), so an entry is its bytes' level numbers, `width` bits each (IQ2 2 x 8 = 16 bits,
    IQ3_XXS 3 x 4 = 12), byte j at bit width * j. -> (the codes' low bytes, their high bytes, the
    levels (the byte values, ascending), width)."""
    table, bits = _GRIDS[name]
    n = bits // 8
    entries = np.asarray(table).astype(np.uint64 if n == 8 else np.uint32).view(np.uint8).reshape(-1, n)
    levels = sorted(set(entries.ravel().tolist()))
    width = (len(levels) - 1).bit_length()
    codes = [sum(levels.index(int(v)) << (width * j) for j, v in enumerate(e)) for e in entries]
    return [c & 255 for c in codes], [c >> 8 for c in codes], levels, width


def _const64(vals) -> ir.Constant:
    """<64 x i8> of the byte values `vals` (0..255)."""
    return ir.Constant(ir.VectorType(I8, 64), [ir.Constant(I8, int(v) - 256 * (int(v) > 127)) for v in vals])


def _grid_codes(builder, name, src):
    """The four <64 x i8> grid vectors of a super-block (vector m: the entries of act-blocks 2m,
    2m + 1, in element order) from `src`, the super-block's 64 bytes after d (the index bytes of
    IQ2_XXS's words and of IQ3_XXS, IQ2_XS's u16s), by byte permutes where the scalar form
    (_lookup) took a load of each index, a load of each entry and their inserts, and _lookup_perm
    (IQ3_XXS) 32 permutes, 28 selects and 32 copies of a table. The loop's instructions a
    super-block (LLVM's code, counted): IQ2_XXS 156 -> 90, IQ2_XS 189 -> 111, IQ3_XXS 177 -> 88;
    what a second gains is less (IQ_CODES: 512-bit permutes are what Zen 4 runs fewest of):

    1. every lane's index is looked up in the low and in the high bytes of the codes
       (_code_planes), 128 entries per vpermi2b, a select on index bit 7 (IQ2_XS: and 8);
    2. one vpermi2b per vector puts each entry's code bytes at the start of its own qword (IQ3_XXS:
       of its dword; two entries a qword);
    3. vpmultishiftqb takes byte j's level number from bit width * j of the code (the bits above
       it are the next fields' or other bytes': the table below ignores them);
    4. one vpermi2b of a 64-entry table maps each byte's low bits to its level's value.

    The bytes are the grid's, so the sums and the bits are the scalar form's."""
    v64 = ir.VectorType(I8, 64)
    perm = simd._fn(builder, "llvm.x86.avx512.vpermi2var.qi.512", v64, [v64] * 3)
    lo, hi, levels, width = _code_planes(name)
    zero = ir.Constant(v64, None)
    bit7 = builder.icmp_signed("<", src, zero)
    if name == "IQ2_XS":  # lane 2i: u16 i's low byte; its bit 8 (the index's ninth) is the next lane's bit 0
        up = builder.bitcast(builder.lshr(builder.bitcast(src, ir.VectorType(I16, 32)), simd._splat(builder, ir.Constant(I16, 8), ir.VectorType(I16, 32))), v64)
        bit8 = builder.icmp_unsigned("!=", builder.and_(up, _const64([1] * 64)), zero)

    def lookup(plane):
        parts = [builder.call(perm, [_const64(plane[k : k + 64]), src, _const64(plane[k + 64 : k + 128])]) for k in range(0, len(plane), 128)]
        parts = [builder.select(bit7, parts[k + 1], parts[k]) for k in range(0, len(parts), 2)]
        return parts[0] if len(parts) == 1 else builder.select(bit8, parts[1], parts[0])

    lov, hiv = lookup(lo), lookup(hi)
    if name == "IQ2_XXS":  # entry i: byte i % 4 of word i // 4 (8 bytes a word: 4 indices, then signs and scale)
        lane, per, offsets = (lambda i: 8 * (i // 4) + i % 4), 8, [2 * j for j in range(8)]
    elif name == "IQ2_XS":
        lane, per, offsets = (lambda i: 2 * i), 8, [2 * j for j in range(8)]
    else:  # IQ3_XXS: entry i at lane i; two entries a qword (dwords)
        lane, per, offsets = (lambda i: i), 16, [0, 3, 6, 9, 32, 35, 38, 41]
    value = _const64([levels[t % (1 << width)] if t % (1 << width) < len(levels) else 0 for t in range(64)])
    out = []
    for m in range(4):
        at = [0] * 64
        for k in range(per):  # entry per * m + k: its code's bytes at the start of its qword (dword)
            b = 8 * k if per == 8 else 4 * k
            at[b], at[b + 1] = lane(per * m + k), 64 + lane(per * m + k)
        codes = builder.call(perm, [lov, _const64(at), hiv])
        out.append(builder.call(perm, [value, _fields(builder, codes, offsets), value]))
    return out


# ksigns: a 7-bit sign index -> the 8 sign bits (the 8th makes the parity even), as the two
# 64-byte halves vpermi2b looks the 128 entries up in
_KSIGNS = [_const64(T.KSIGNS_IQ2XS[h * 64 : h * 64 + 64]) for h in range(2)]


def _ksigns(builder, idx):
    """<64 x i8> of 7-bit sign indices (bit 7 ignored) -> their sign bytes: one vpermi2b."""
    v64 = ir.VectorType(I8, 64)
    fn = simd._fn(builder, "llvm.x86.avx512.vpermi2var.qi.512", v64, [v64] * 3)
    return builder.call(fn, [_KSIGNS[0], idx, _KSIGNS[1]])


def _fields(builder, data, offsets):
    """vpmultishiftqb: byte j of qword i of the result = the 8 bits of qword i of `data` (<N x i8>)
    from bit offsets[j % 8] (rotating): 7-bit fields out of packed words in one instruction."""
    n = data.type.count
    vt = ir.VectorType(I8, n)
    fn = simd._fn(builder, f"llvm.x86.avx512.pmultishift.qb.{8 * n}", vt, [vt, vt])
    ctrl = ir.Constant(vt, [ir.Constant(I8, offsets[j % 8]) for j in range(n)])
    return builder.call(fn, [ctrl, data])


def _iq_reader(builder, name, ptr, p, sb, zero):
    """What both forms of the grid kernels read super-block sb of the `name` row at byte p with
    (its cache lines ahead asked for): raw(off, ty, vec) loads `ty` at byte off of the super-block
    (vec: through `zero`), index(off, wide) is the grid index byte (wide: u16) at off as i64, b
    the super-block's first act-block."""
    at = builder.add(p, builder.mul(sb, ir.Constant(I64, IQTYPES[name])))
    # the grid indices are read by scalar loads; a vector load of the same bytes (for the signs)
    # from the same address let LLVM take each index out of the vector instead (vpextrb: 2 uops
    # on Zen 4, 32 per super-block): the vector loads' address hides behind `zero`
    at_v = builder.add(at, zero)
    b = builder.mul(sb, ir.Constant(I64, 8))
    # the grid loads wait on the index bytes: where those come late from memory, every super-block
    # waits (from memory the kernel ran at 0.7x its speed on cached rows); ask for them ahead
    pf = simd._fn(builder, "llvm.prefetch.p0", ir.VoidType(), [I8.as_pointer(), I32, I32, I32])
    for ahead in PREFETCH:
        builder.call(pf, [ptr("raw", builder.add(at, ir.Constant(I64, ahead)), I8), ir.Constant(I32, 0), ir.Constant(I32, 3), ir.Constant(I32, 1)])

    def raw(off, ty, vec=False):
        return builder.load(ptr("raw", builder.add(at_v if vec else at, ir.Constant(I64, off)), ty), align=1)

    def index(off, wide=False):
        return builder.zext(raw(off, I16 if wide else I8), I64)

    return raw, index, b


def _iq_d(builder, name, raw):
    """The super-block's f32(d) * 2^-3 (IQ3_XXS: 2^-2): the terms' weight factor, exact."""
    d = builder.fpext(builder.bitcast(raw(0, I16), ir.HalfType()), ir.FloatType())
    return builder.fmul(d, ir.Constant(ir.FloatType(), 0.25 if name == "IQ3_XXS" else 0.125))


def _iq_superblock(builder, name, ptr, p, sb, zero, xptrs=None):
    """The <8 x f32> terms of super-block sb of the `name` (IQTYPES) row at byte p (act-blocks
    8 sb .. 8 sb + 7). Layouts: reference.py beside _iq2_xxs, _iq2_xs, _iq3_xxs. `zero`: an i64
    0 that LLVM cannot see is 0, added to the addresses of the vector loads (see below).
    xptrs: several tokens (a list of `ptr`s, each reading one token's xq and xd): the grid words,
    signs and scales are fetched once and each token's terms (the one-token ops, in the same
    order: the same bits) come back as a list."""
    v32, v64, i16v, i8v, f8v = ir.VectorType(I8, 32), ir.VectorType(I8, 64), ir.VectorType(I32, 16), ir.VectorType(I32, 8), ir.VectorType(ir.FloatType(), 8)
    vnni = simd._fn(builder, "llvm.x86.avx512.vpdpbusd.512", i16v, [i16v] * 3)
    raw, index, b = _iq_reader(builder, name, ptr, p, sb, zero)
    table = _grid_table(builder, name)

    def c32(x, n=8):
        return simd._splat(builder, ir.Constant(I32, x), ir.VectorType(I32, n))

    def pick(v, idx):
        return builder.shuffle_vector(v, v, simd._mask(len(idx), idx))

    def widen(v):  # <32 x i8> -> <64 x i8>, the upper half unused
        return builder.shuffle_vector(v, v, simd._mask(64, list(range(32)) * 2))

    if name == "IQ2_XS":  # 32 x u16 at 2: 9-bit grid index | 7-bit sign index << 9; scales at 66
        q = raw(2, ir.VectorType(I16, 32), vec=True)
        idx = builder.trunc(builder.lshr(q, simd._splat(builder, ir.Constant(I16, 9), q.type)), v32)
        signs = pick(_ksigns(builder, widen(idx)), range(32))

        def gidx(i):  # grid index i (lane 4k + j): the low 9 bits of u16 i
            return builder.and_(index(2 + 2 * i, True), ir.Constant(I64, 511))

        s = builder.zext(raw(66, ir.VectorType(I8, 8)), i8v)
        ws = builder.shuffle_vector(builder.and_(s, c32(15)), builder.lshr(s, c32(4)), simd._mask(16, [i // 2 + 8 * (i % 2) for i in range(16)]))
        ws = builder.add(builder.shl(ws, c32(1, 16)), c32(1, 16))  # lane 2k + h: 2 (nibble h of scales[k]) + 1
    elif name == "IQ2_XXS":  # 8 x (4 grid index bytes, u32 of 4 sign indices and ls << 28) at 2
        w = raw(2, v64, vec=True)
        aux = pick(builder.bitcast(w, i16v), range(1, 16, 2))
        # qword k: the indices in bits 0..31, sign index j at bit 32 + 7 j
        signs = pick(_ksigns(builder, _fields(builder, w, [32, 39, 46, 53] * 2)), [8 * (i // 4) + i % 4 for i in range(32)])

        def gidx(i):  # grid index i (lane 4k + j): byte j of act-block k's first word
            return index(2 + 8 * (i // 4) + i % 4)

        ws = builder.add(builder.shl(builder.lshr(aux, c32(28)), c32(1)), c32(1))
    else:  # IQ3_XXS: 64 grid index bytes at 2 (8 per act-block), 8 x u32 of sign indices and ls at 66
        auxb = raw(66, v32, vec=True)
        aux = builder.bitcast(auxb, i8v)
        # qword i: act-blocks 2i, 2i + 1: sign index j at bit 7 j of each u32
        signs = pick(_ksigns(builder, widen(_fields(builder, auxb, [0, 7, 14, 21, 32, 39, 46, 53]))), range(32))

        def gidx(i):  # grid index i: byte i
            return index(2 + i)

        ws = builder.add(builder.shl(builder.lshr(aux, c32(28)), c32(1)), c32(1))
    _, bits = _GRIDS[name]
    sword = builder.bitcast(signs, ir.VectorType(I64, 4))  # word m: the 64 sign bits of act-blocks 2m, 2m + 1
    if name in IQ_CODES:  # all four vectors at once
        grid = _grid_codes(builder, name, raw(2, v64, vec=True))
    elif bits == 64:
        grid = [_lookup(builder, table, [gidx(i) for i in range(8 * m, 8 * m + 8)]) for m in range(4)]
    elif PERMUTE_IQ3:  # IQ3_XXS: the 16 index bytes of act-blocks 2m, 2m + 1 in one load
        grid = [_lookup_perm(builder, name, raw(2 + 16 * m, ir.VectorType(I8, 16), vec=True)) for m in range(4)]
    else:  # IQ3_XXS: two 4-byte entries to a word, so the vector is built as IQ2's
        grid = [_lookup(builder, table, [(gidx(i), gidx(i + 1)) for i in range(16 * m, 16 * m + 16, 2)]) for m in range(4)]
    negs = [builder.bitcast(builder.extract_element(sword, ir.Constant(I32, m)), ir.VectorType(ir.IntType(1), 64)) for m in range(4)]
    d = _iq_d(builder, name, raw)
    terms = []
    for xptr in xptrs or [ptr]:
        vecs = []
        for m in range(4):
            x = builder.load(xptr("xq", builder.mul(builder.add(b, ir.Constant(I64, 2 * m)), ir.Constant(I64, QA)), v64), align=1)
            x = builder.select(negs[m], builder.sub(ir.Constant(v64, None), x), x)
            vecs.append(builder.call(vnni, [ir.Constant(i16v, None), builder.bitcast(grid[m], i16v), builder.bitcast(x, i16v)]))
        h = simd._reduce_groups(builder, vecs, 4, 4)  # lane 2k + h: half h of act-block k, exact
        if name == "IQ2_XS":
            h = builder.mul(h, ws)
            isum = builder.add(pick(h, range(0, 16, 2)), pick(h, range(1, 16, 2)))
        else:
            isum = builder.mul(builder.add(pick(h, range(0, 16, 2)), pick(h, range(1, 16, 2))), ws)
        ad = builder.load(xptr("xd", b, f8v), align=4)
        terms.append(builder.fmul(builder.fmul(simd._splat(builder, d, f8v), ad), builder.sitofp(isum, f8v)))
    return terms if xptrs else terms[0]


# ---------------------------------------------------------------------------------------------
# The grid kernels on AVX2 hosts (Zen 2/3, most Intel desktops: no AVX-512, so no vpdpbusd, no
# vpmultishiftqb/vpermi2b for the signs). The same super-block loop, lanes, fold and f32 terms as
# above; only the exact integer sums are formed differently, per act-block k of the super-block
# (32 elements: a 32-byte vector):
#
#   g[e]   = the grid byte of element e (unsigned, <= 43; IQ3_XXS <= 62), fetched as above
#   g'[e]  = -g[e] where the weight's sign bit e is set, else g[e]       (|g'| <= 62: exact)
#   P[i]   = vpmaddubsw(|x|, sign(x) g')[i] = |x[2i]| sign(x[2i]) g'[2i] + (the same at 2i + 1)
#          = x[2i] g'[2i] + x[2i + 1] g'[2i + 1]                          (|P| <= 2 * 128 * 62 < 2^15)
#   Q      = vpmaddwd(P, 1): lanes 0..3 sum to S0, lanes 4..7 to S1      (exact int32)
#   isum   = ws0 S0 + ws1 S1, after two vphaddd levels (_block_sums)     (exact: |isum| < 2^24)
#
# The signs go onto the grid bytes, not onto the activations, and the activations' signs travel
# by vpsignb onto g' (never -128: it negates exactly) while vpmaddubsw's unsigned operand takes
# |x| (vpabsb's -128 is the byte 0x80, which the instruction reads as unsigned 128): so the sums
# are exact for every int8 activation, -128 included, and no pair can saturate. Moving the signs
# onto x as the VNNI form does (x' = -x) would be wrong for x = -128 (it stays -128); ActQ's 8-bit
# q never holds -128 and these types never read the wide form (actq.WIDE), but the kernel does not
# lean on that. The sign bytes (7 stored bits, the 8th making the parity even: ggml's ksigns
# table) come from the packed fields by shifts and masks in vector registers and a 16-entry
# parity table (one vpshufb), where llama.cpp's AVX2 code looks each one up in a table of 128
# 8-byte masks (32 more scalar loads and inserts per super-block, beside the 32-64 of the grid).
IQ_AVX2 = AVX2 and AVAILABLE and os.environ.get("STRATA_ROWDOT_IQ_AVX2", "1") != "0"
IQ_AVAILABLE = IQ_VBMI or IQ_AVX2  # the types of IQTYPES have a one-token kernel here

# 0x80 where the 4-bit index has an odd number of set bits (in both 128-bit lanes, for vpshufb)
_PARITY = [ir.Constant(I8, -128 if bin(i).count("1") % 2 else 0) for i in range(16)] * 2


def _sign_bytes(builder, s7):
    """<32 x i8> of 7-bit sign fields -> ggml's ksigns bytes: bit 7 set where the 7 bits' parity
    is odd. i ^ (i >> 4) keeps the parity of i in its low 4 bits (b0^b4, b1^b5, b2^b6, b3)."""
    v32 = ir.VectorType(I8, 32)
    fold = builder.and_(builder.xor(s7, builder.lshr(s7, simd._splat(builder, ir.Constant(I8, 4), v32))), simd._splat(builder, ir.Constant(I8, 15), v32))
    return builder.or_(s7, _pshufb(builder, ir.Constant(v32, _PARITY), fold))


def _fields7(builder, aux):
    """<8 x i32> words holding four 7-bit sign fields at bits 0, 7, 14, 21 (IQ2_XXS, IQ3_XXS) ->
    <32 x i8>, byte 4k + j = field j of word k: each field moved up to its own byte in the word."""
    out = builder.and_(aux, _c32(builder, 0x7F))
    for j in (1, 2, 3):
        out = builder.or_(out, builder.and_(builder.shl(aux, _c32(builder, j)), _c32(builder, 0x7F << (8 * j))))
    return builder.bitcast(out, ir.VectorType(I8, 32))


def _c32(builder, x, n=8):
    """<n x i32> of x."""
    return simd._splat(builder, ir.Constant(I32, x), ir.VectorType(I32, n))


def _pick(builder, v, idx):
    """Lanes idx of v, one shuffle."""
    return builder.shuffle_vector(v, v, simd._mask(len(idx), idx))


def _hadd(builder, a, b):
    """<8 x i32> a, b -> vphaddd's lanes: per 128-bit half, a's adjacent pairs then b's."""
    return builder.add(builder.shuffle_vector(a, b, simd._mask(8, [0, 2, 8, 10, 4, 6, 12, 14])),
                       builder.shuffle_vector(a, b, simd._mask(8, [1, 3, 9, 11, 5, 7, 13, 15])))  # fmt: skip


def _block_sums(builder, vecs, ws=None, off=None):
    """Eight <8 x i32>, act-blocks 0..7 with lanes 0..3 summing to the block's first half S0 and
    lanes 4..7 to its second S1, and ws = two <8 x i32> of integer scales (lane h * 4 + k: half h
    of act-block k, then of k + 4) -> <8 x i32>, lane k = ws0 S0 + ws1 S1 of act-block k (exact;
    without ws, S0 + S1). Two levels of vphaddd leave the half sums in the scales' lanes. off: two
    <8 x i32> in the same lanes taken off the half sums before the scales (Q6_K's offset x s16)."""
    h = [_hadd(builder, vecs[k], vecs[k + 1]) for k in range(0, 8, 2)]
    a, b = _hadd(builder, h[0], h[1]), _hadd(builder, h[2], h[3])  # lane 4h + k: half h of act-block k (k + 4)
    if off:
        a, b = builder.sub(a, off[0]), builder.sub(b, off[1])
    if ws:
        a, b = builder.mul(a, ws[0]), builder.mul(b, ws[1])
    return builder.add(builder.shuffle_vector(a, b, simd._mask(8, [0, 1, 2, 3, 8, 9, 10, 11])),
                       builder.shuffle_vector(a, b, simd._mask(8, [4, 5, 6, 7, 12, 13, 14, 15])))  # fmt: skip


def _block_totals(builder, vecs):
    """simd.dot_quads' AVX2 sums of 8, 4 or 2 act-block pairs (<16 x i32>: lanes 0..7 sum to the
    first block, 8..15 to the second) -> <16 x i32>, lane g = act-block g's total (4 pairs: lanes
    8..15 repeat 0..7; 2 pairs: lanes 4..7 are 0, then the same repeat)."""
    halves = [_pick(builder, v, range(8 * h, 8 * h + 8)) for v in vecs for h in range(2)]
    halves += [ir.Constant(halves[0].type, None)] * (-len(halves) % 8)  # 2 pairs (n = 4): lanes 4..7 are 0
    out = [_block_sums(builder, halves[k : k + 8]) for k in range(0, len(halves), 8)]
    return builder.shuffle_vector(out[0], out[-1], simd._mask(16, range(16)))


def _iq_superblock_avx2(builder, name, ptr, p, sb, zero, xptrs=None):
    """_iq_superblock's terms (the same arguments, the same bits) with AVX2 instructions: the
    section comment above says how the integer sums stay exact."""
    v32, i8v, w16, f8v = ir.VectorType(I8, 32), ir.VectorType(I32, 8), ir.VectorType(I16, 16), ir.VectorType(ir.FloatType(), 8)
    ubsw = simd._fn(builder, "llvm.x86.avx2.pmadd.ub.sw", w16, [v32, v32])
    wd = simd._fn(builder, "llvm.x86.avx2.pmadd.wd", i8v, [w16, w16])
    sign = simd._fn(builder, "llvm.x86.avx2.psign.b", v32, [v32, v32])
    ones = ir.Constant(w16, [ir.Constant(I16, 1)] * 16)
    raw, index, b = _iq_reader(builder, name, ptr, p, sb, zero)
    table = _grid_table(builder, name)
    c32, pick = partial(_c32, builder), partial(_pick, builder)
    if name == "IQ2_XS":  # 32 x u16 at 2: 9-bit grid index | 7-bit sign index << 9; scales at 66
        q = raw(2, ir.VectorType(I16, 32), vec=True)
        s7 = builder.trunc(builder.lshr(q, simd._splat(builder, ir.Constant(I16, 9), q.type)), v32)
        grids = [[builder.and_(index(2 + 2 * i, True), ir.Constant(I64, 511)) for i in range(4 * k, 4 * k + 4)] for k in range(8)]
        s = builder.zext(raw(66, ir.VectorType(I8, 8)), i8v)
        ws = builder.shuffle_vector(builder.and_(s, c32(15)), builder.lshr(s, c32(4)), simd._mask(16, [i // 2 + 8 * (i % 2) for i in range(16)]))
        ws = builder.add(builder.shl(ws, c32(1, 16)), c32(1, 16))  # lane 2k + h: 2 (nibble h of scales[k]) + 1
        ws = [pick(ws, [2 * (k + 4 * u) + h for h in range(2) for k in range(4)]) for u in range(2)]
    else:  # IQ2_XXS: 8 x (4 grid index bytes, u32 of 4 sign indices and ls << 28) at 2;
        # IQ3_XXS: 64 grid index bytes at 2 (8 per act-block), 8 x u32 of the same kind at 66
        if name == "IQ2_XXS":
            aux = builder.shuffle_vector(*[raw(2, ir.VectorType(I32, 16), vec=True)] * 2, simd._mask(8, range(1, 16, 2)))
            grids = [[index(2 + 8 * k + j) for j in range(4)] for k in range(8)]
        else:
            aux = raw(66, i8v, vec=True)
            grids = [[index(2 + 8 * k + j) for j in range(8)] for k in range(8)]
        s7 = _fields7(builder, aux)
        ws = builder.add(builder.shl(builder.lshr(aux, c32(28)), c32(1)), c32(1))  # 2 ls + 1, both halves
        ws = [pick(ws, [k + 4 * u for _ in range(2) for k in range(4)]) for u in range(2)]
    signs = _sign_bytes(builder, s7)  # byte 4k + j: the signs of elements 8j .. 8j + 7 of act-block k
    bit = ir.Constant(v32, [ir.Constant(I8, (1 << (e % 8)) - 256 * (e % 8 == 7)) for e in range(32)])
    lanes = [pick(signs, [*range(16 * u, 16 * u + 16)] * 2) for u in range(2)]  # act-blocks 4u .. 4u + 3 in both lanes
    gs = []
    for k in range(8):
        g = _lookup(builder, table, grids[k], I64 if name != "IQ3_XXS" else I32)
        ctrl = ir.Constant(v32, [ir.Constant(I8, 4 * (k % 4) + e // 8) for e in range(32)])
        rep = _pshufb(builder, lanes[k // 4], ctrl)  # byte e: the sign byte of element e
        neg = builder.sext(builder.icmp_unsigned("!=", builder.and_(rep, bit), ir.Constant(v32, None)), v32)  # 0xFF where negative
        gs.append(builder.sub(builder.xor(g, neg), neg))
    d = _iq_d(builder, name, raw)
    terms = []
    for xptr in xptrs or [ptr]:
        vecs = []
        for k in range(8):
            x = builder.load(xptr("xq", builder.mul(builder.add(b, ir.Constant(I64, k)), ir.Constant(I64, QA)), v32), align=1)
            ax = builder.select(builder.icmp_signed("<", x, ir.Constant(v32, None)), builder.sub(ir.Constant(v32, None), x), x)  # vpabsb
            vecs.append(builder.call(wd, [builder.call(ubsw, [ax, builder.call(sign, [gs[k], x])]), ones]))
        isum = _block_sums(builder, vecs, ws)
        ad = builder.load(xptr("xd", b, f8v), align=4)
        terms.append(builder.fmul(builder.fmul(simd._splat(builder, d, f8v), ad), builder.sitofp(isum, f8v)))
    return terms if xptrs else terms[0]


# the super-block terms of this host: the VNNI + VBMI form, else the AVX2 one (the same bits)
_IQ_SUPERBLOCK = _iq_superblock if IQ_VBMI else _iq_superblock_avx2


def _krow(name: str):
    def impl(typingctx, raw, p, nb, xq, xd, xs):
        """The dot of the `name` (KTYPES) row at byte p of raw (nb act-blocks, a multiple of 8)
        with one token's ActQ (xq, xd, xs = s16, as ActQ holds them) -> f32, bit for bit
        reference.dot_reference's for the row."""
        return types.float32(raw, p, nb, xq, xd, xs), lambda context, builder, sig, args: _kcodegen(context, builder, sig, args, name)

    return impl


def _kcodegen(context, builder, sig, args, name):
    f8v = ir.VectorType(ir.FloatType(), 8)
    p, nb = (context.cast(builder, args[k], sig.args[k], types.intp) for k in (1, 2))
    base = {arr: context.make_array(sig.args[k])(context, builder, args[k]).data for k, arr in ((0, "raw"), (3, "xq"), (4, "xd"), (5, "xs"))}

    def ptr(arr, idx, ty):
        return builder.bitcast(builder.gep(base[arr], [idx]), ty.as_pointer())

    acc = [cgutils.alloca_once_value(builder, ir.Constant(f8v, [0.0] * 8)) for _ in range(4)]
    nsb = builder.udiv(nb, ir.Constant(I64, 8))
    zero = builder.lshr(nb, ir.Constant(I64, 62))  # 0 for any real row; LLVM cannot know it
    with cgutils.for_range(builder, builder.udiv(builder.add(nsb, ir.Constant(I64, 3)), ir.Constant(I64, 4))) as loop:
        for u in range(4):  # super-block 4i + u: lanes 8u .. 8u + 7; one past the row adds nothing
            sb = builder.add(builder.mul(loop.index, ir.Constant(I64, 4)), ir.Constant(I64, u))
            with builder.if_then(builder.icmp_unsigned("<", sb, nsb), likely=True):
                if name in IQTYPES:
                    terms = _IQ_SUPERBLOCK(builder, name, ptr, p, sb, zero)
                else:
                    terms = _k_superblock(builder, name, ptr, p, sb)
                builder.store(builder.fadd(builder.load(acc[u]), terms), acc[u])
    lo = builder.shuffle_vector(builder.load(acc[0]), builder.load(acc[1]), simd._mask(16, range(16)))
    hi = builder.shuffle_vector(builder.load(acc[2]), builder.load(acc[3]), simd._mask(16, range(16)))
    v = builder.shuffle_vector(lo, hi, simd._mask(32, range(32)))
    w = 16
    while w:  # the fold: lane[l] += lane[l + w]
        v = builder.fadd(builder.shuffle_vector(v, v, simd._mask(w, range(w))), builder.shuffle_vector(v, v, simd._mask(w, range(w, 2 * w))))
        w //= 2
    return builder.extract_element(v, ir.Constant(I32, 0))


if IQ_AVAILABLE:
    KTYPES.update(IQTYPES)  # the same super-block loop, lanes and fold; each its own terms
KROW = {name: intrinsic(_krow(name)) for name in KTYPES}


# A few tokens of one IQ row: a serving step gives a few experts 2-4 tokens. Read in place once
# per token, the row's grid words were fetched again for every token (the scalar loads and
# inserts that bound these kernels, docs/kernels.md); decoded into scratch, its bytes went
# through cpu.py's decoder. Here each super-block's grid words, signs and scales are fetched once
# and dotted with every token's activations: per token the one-token kernel's ops, lanes and
# fold, so every token's result is its bits.
FEW_MAX = 4


def _krow_few(name: str, T: int):
    def impl(typingctx, raw, p, nb, xq, xd, xs, r0):
        """The dots of the `name` (IQTYPES) row at byte p of raw (nb act-blocks) with T tokens,
        rows r0 .. r0 + T - 1 of the C-contiguous xq i8 [N, 32 nb] and xd f32 [N, nb] (xs, as
        s16 [N, 2 nb], unused: these types have no offset) -> a T-tuple of f32, each bit for bit
        KROW's for its token."""
        return types.UniTuple(types.float32, T)(raw, p, nb, xq, xd, xs, r0), lambda context, builder, sig, args: _kcodegen_few(context, builder, sig, args, name, T)

    return impl


def _kcodegen_few(context, builder, sig, args, name, T):
    f8v = ir.VectorType(ir.FloatType(), 8)
    p, nb, r0 = (context.cast(builder, args[k], sig.args[k], types.intp) for k in (1, 2, 6))
    base = {arr: context.make_array(sig.args[k])(context, builder, args[k]).data for k, arr in ((0, "raw"), (3, "xq"), (4, "xd"))}

    def ptr(arr, idx, ty):
        return builder.bitcast(builder.gep(base[arr], [idx]), ty.as_pointer())

    def token(t):  # token t's xq, xd: row r0 + t of the [N, ...] planes
        r = builder.add(r0, ir.Constant(I64, t))
        first = {"xq": builder.mul(r, builder.mul(nb, ir.Constant(I64, QA))), "xd": builder.mul(r, nb)}
        return lambda arr, idx, ty: ptr(arr, builder.add(first[arr], idx), ty)

    xptrs = [token(t) for t in range(T)]
    acc = [[cgutils.alloca_once_value(builder, ir.Constant(f8v, [0.0] * 8)) for _ in range(4)] for _ in range(T)]
    nsb = builder.udiv(nb, ir.Constant(I64, 8))
    zero = builder.lshr(nb, ir.Constant(I64, 62))  # as _kcodegen's
    with cgutils.for_range(builder, builder.udiv(builder.add(nsb, ir.Constant(I64, 3)), ir.Constant(I64, 4))) as loop:
        for u in range(4):
            sb = builder.add(builder.mul(loop.index, ir.Constant(I64, 4)), ir.Constant(I64, u))
            with builder.if_then(builder.icmp_unsigned("<", sb, nsb), likely=True):
                for t, terms in enumerate(_IQ_SUPERBLOCK(builder, name, ptr, p, sb, zero, xptrs)):
                    builder.store(builder.fadd(builder.load(acc[t][u]), terms), acc[t][u])
    out = []
    for t in range(T):
        lo = builder.shuffle_vector(builder.load(acc[t][0]), builder.load(acc[t][1]), simd._mask(16, range(16)))
        hi = builder.shuffle_vector(builder.load(acc[t][2]), builder.load(acc[t][3]), simd._mask(16, range(16)))
        v = builder.shuffle_vector(lo, hi, simd._mask(32, range(32)))
        w = 16
        while w:  # the fold: lane[l] += lane[l + w]
            v = builder.fadd(builder.shuffle_vector(v, v, simd._mask(w, range(w))), builder.shuffle_vector(v, v, simd._mask(w, range(w, 2 * w))))
            w //= 2
        out.append(builder.extract_element(v, ir.Constant(I32, 0)))
    return context.make_tuple(builder, sig.return_type, out)


KROW_FEW = {(name, T): intrinsic(_krow_few(name, T)) for name in (IQTYPES if IQ_AVAILABLE else ()) for T in range(2, FEW_MAX + 1)}


def few_max(name: str) -> int:
    """The most tokens per matrix that matmul_grouped_one takes for type `name`: FEW_MAX for the
    IQ types (their few-token rows), 1 for the others."""
    return FEW_MAX if (name, 2) in KROW_FEW else 1


def _kkernel(name: str, parallel: bool):
    row = KROW[name]

    # _row_chunk's loop for a row function of two planes: the planes passed as one tuple and
    # star-unpacked into the row call failed numba's parfor array analysis in the parallel kernels
    # ("Dimension mismatch", 2026-12-05), so each arity keeps its own chunk
    @njit(inline="always", **JIT)
    def chunk(c, a):
        raw, row_bytes, nb, xq, xd, s16, out, n_chunks = a
        n_out = out.size
        for o in range(c * n_out // n_chunks, (c + 1) * n_out // n_chunks):
            out[o] = row(raw, o * row_bytes, nb, xq, xd, s16)

    def kernel(raw, row_bytes, xq, xd, s16, out, n_chunks):
        # raw u8 [n_out * row_bytes]; xq i8 [n_in]; xd f32 [n_in / 32]; s16 i32 [n_in / 16]; out f32 [n_out]
        simd.run_queue(n_chunks, n_chunks, chunk, (raw, row_bytes, xq.size // QA, xq, xd, s16, out, n_chunks))

    return cached(njit(parallel=parallel, **JIT)(kernel), f"{name}-rowdot-{'par' if parallel else 'serial'}{_tag(name)}")


NAMES = frozenset(TYPES) | frozenset(KTYPES)  # the types with a one-token kernel here


# ---------------------------------------------------------------------------------------------
# Several products of one token in one parallel region: a decode step multiplies the same input
# by 2-3 matrices in a row (a GDN layer's qkv and gate, a shared expert's gate and up), and each
# product was a parallel region of its own. A region's start and end barrier cost little at 1-2
# threads but grow with the thread count (8 threads on the device host: the small products of the
# token path, not the LM head, kept decode at 0.75x llama.cpp). Here the rows of all the matrices
# are one range split over the pool, each row by its own type's kernel, to the same bits.

_MANY_SRC = """
def chunk(c, a):
    {names} = a
{chunk_init}
    for o in range(c * total // n_chunks, (c + 1) * total // n_chunks):
{body}


def kernel({params}xq, xd, s16, wq, wd, ws, fx, n_chunks):
    # the 8-bit form: xq i8 [n_in], xd f32 [nb], s16 i32 [2 nb]; the wide form (actq.ActQ16, one
    # token): wq i8 [2 n_in] (hi, then lo), wd f32 [2 nb], ws i32 [4 nb]; the f32 values fx
    # [n_in] (F32/F16/BF16 matrices, raw{{i}} their values, lut{{i}} their table to f32). A form
    # no matrix reads is passed empty and never touched.
{prologue}
    {sizes}
    total = {total}
    # the chunks from a shared queue (simd.run_queue): a thread that got cheap rows takes more.
    # prange's static split gave each thread the same count of rows, whatever they cost: a layer's
    # router (BF16 rows of 5 KB) beside its shared expert's Q8_0 rows of 2.7 KB left the threads
    # with the router's rows late and the rest waiting (that region scaled 1.36x from 1 to 2
    # threads and 3x from 1 to 8, seed-4l, 2026-12-04)
    run_queue(n_chunks, n_chunks, chunk, ({names}))
"""

# the 32-element kernels' padded scales and block sums, as _kernel's (8-bit) and _kernel16's (wide)
_MANY_PROLOGUE = """
    nb = xq.size // QA
    P = (nb + 15) // 16 * 16
    xd0 = np.zeros(P, F32)
    xd1 = np.zeros(P, F32)
    xs = np.zeros(P, np.int32)
    for b in range(nb):
        xd0[b] = xd[b]
        xs[b] = s16[2 * b] + s16[2 * b + 1]"""
_MANY_PROLOGUE_WIDE = """
    nbw = wq.size // (2 * QA)
    Pw = (nbw + 15) // 16 * 16
    wd0 = np.zeros(Pw, F32)
    ws_hi = np.zeros(Pw, np.int32)
    ws_lo = np.zeros(Pw, np.int32)
    for b in range(nbw):
        wd0[b] = wd[b]
        ws_hi[b] = ws[2 * b] + ws[2 * b + 1]
        ws_lo[b] = ws[2 * nbw + 2 * b] + ws[2 * nbw + 2 * b + 1]"""


def _load_f32(w, i, lut):
    return w[i]


def _load_16(w, i, lut):
    return lut[w[i]]


def _float_row(kind: str):
    """One row of an F32/F16/BF16 matrix . f32 values x: cpu._float_kernel's loop for one token
    (lane l takes elements l, l + 32, ... in order, product rounded then added; the same fold)."""
    step16 = getattr(simd, f"dense16_{kind}")
    load = njit(inline="always", **JIT)(_load_f32 if kind == "f32" else _load_16)

    @njit(inline="always", **JIT)
    def row(w, o, x, lut, acc):
        n_in = x.size
        base = o * n_in
        acc[:] = F32(0)
        i = 0
        while i + 16 <= n_in:
            step16(acc, i & 31, w, base + i, x, i, lut)
            i += 16
        for j in range(i, n_in):
            acc[j & 31] = acc[j & 31] + load(w, base + j, lut) * x[j]
        return simd.fold32(acc)

    return row


FLOATS = ("F32", "F16", "BF16")
FROW = {name: _float_row(name.lower()) for name in FLOATS}


def _many_kernel(names: tuple[str, ...], wides: tuple[bool, ...], parallel: bool):
    params = "".join(f"raw{i}, {'lut' if n in FLOATS else 'rb'}{i}, out{i}, " for i, n in enumerate(names))
    sizes = "; ".join(f"n{i} = out{i}.size" for i in range(len(names)))
    narrow = any(not w and n not in FLOATS for n, w in zip(names, wides))
    prologue = (_MANY_PROLOGUE if narrow else "") + (_MANY_PROLOGUE_WIDE if any(wides) else "")
    body, start = [], "0"
    for i, (name, wide) in enumerate(zip(names, wides)):
        at = f"(o - ({start})) * rb{i}"
        if wide:
            call = f"W{i}(raw{i}, {at}, nbw, wq, wd0, ws_hi, ws_lo)"
        elif name in FLOATS:
            call = f"F{i}(raw{i}, o - ({start}), fx, lut{i}, acc)"
        elif name in KTYPES:
            call = f"K{i}(raw{i}, {at}, nb, xq, xd, s16)"
        else:
            call = f"R{i}(raw{i}, {at}, nb, xq, xd0, xd1, xs)"
        test = "if" if i == 0 else "elif"
        end = f"{start} + n{i}" if i else "n0"
        body.append(f"        {test} o < {end}:\n            out{i}[o - ({start})] = {call}" if i < len(names) - 1 else
                    f"        else:\n            out{i}[o - ({start})] = {call}")  # fmt: skip
        start = end
    chunk_init = "    acc = np.empty(32, F32)  # a float row's lanes" if any(n in FLOATS for n in names) else ""
    # what a chunk reads: the arguments, the prologues' padded planes, the sizes
    names_ = [f"raw{i}, {'lut' if n in FLOATS else 'rb'}{i}, out{i}" for i, n in enumerate(names)]
    names_ += ["xq, xd, s16, fx, total, n_chunks"] + [f"n{i}" for i in range(len(names))]
    names_ += ["nb, xd0, xd1, xs"] if narrow else []
    names_ += ["wq, nbw, wd0, ws_hi, ws_lo"] if any(wides) else []
    src = _MANY_SRC.format(params=params, prologue=prologue, sizes=sizes, total=start, body="\n".join(body), chunk_init=chunk_init,
                           names=", ".join(names_))  # fmt: skip
    # __name__: numba's disk cache rebuilds a kernel's environment by importing its module by name
    # (None, the default of exec's globals, failed in every process after the first)
    env = {"__name__": __name__, "np": np, "F32": F32, "QA": QA, "run_queue": simd.run_queue}
    for i, (name, wide) in enumerate(zip(names, wides)):
        if wide:
            env[f"W{i}"] = ROW16[name]
        elif name in FLOATS:
            env[f"F{i}"] = FROW[name]
        elif name in KTYPES:
            env[f"K{i}"] = KROW[name]
        else:
            env[f"R{i}"] = ROW[name, False]
    exec(compile(src, __file__, "exec"), env)  # noqa: S102 -- the source is the template above
    env["chunk"] = njit(inline="always", **JIT)(env["chunk"])
    tag = "-".join(n + ("w" if w else "") for n, w in zip(names, wides))
    return cached(njit(parallel=parallel, **JIT)(env["kernel"]), f"rowdot-many-{tag}-{'par' if parallel else 'serial'}{_tag(*names)}")


_MANY: dict[tuple[tuple[str, ...], tuple[bool, ...], bool], object] = {}
_NONE8 = (np.zeros(0, np.int8), np.zeros(0, F32), np.zeros(0, np.int32))  # a form no matrix of the call reads


def many_kernel(names: tuple[str, ...], wides: tuple[bool, ...], parallel: bool):
    """The kernel of several products of one token, every row of every matrix in one range split
    into n_chunks on the pool if `parallel`, each out bit for bit `matvec` of its matrix (the
    caller, cpu.TokenProducts, has validated everything). Its arguments: per matrix i, raw_i,
    rb_i, out_i, then xq, xd, s16 (the 8-bit ActQ planes, a scale per 32 elements), wq, wd, ws (the
    wide form's planes, as `matvec`'s `wide`), fx (f32 values [n_in]), n_chunks; a form no matrix
    reads is given as _NONE8. names[i] a NAMES type, or with wides[i] a TYPES type reading the wide
    form (a GDN layer's qkv beside its 8-bit gate), or a FLOATS type reading fx: raw_i its values
    (f32, or f16/bf16 bits as uint16) and rb_i the table its bits go through (a GDN layer's BF16
    alpha and beta, QSA's indexer q/k)."""
    key = (names, wides, parallel)
    kernel = _MANY.get(key)
    if kernel is None:
        kernel = _MANY[key] = _many_kernel(*key)
    return kernel


# ---------------------------------------------------------------------------------------------
# The routed experts of a decode step: G matrices (a layer's selected experts), one token each.
# cpu.matmul_grouped's kernel decodes every row into scratch for the token's one dot (its rows
# were written for a prompt chunk's few tokens per expert); for these types the row is read in
# place as above. The work items, their chunks and the shared queue are the grouped kernel's.


def _grouped_one_kernel(name: str, parallel: bool, few: bool = False):
    if few:
        row, row2, row3, row4 = KROW[name], KROW_FEW[name, 2], KROW_FEW[name, 3], KROW_FEW[name, 4]

        @njit(inline="always", **JIT)
        def chunk(c, a):
            raw, offsets, row_bytes, starts, items, bounds, xq, xd, s16, out, nb = a
            for i in range(bounds[c], bounds[c + 1]):
                g, o0, o1 = items[i, 0], items[i, 1], items[i, 2]
                r, n, at = starts[g], starts[g + 1] - starts[g], offsets[g]
                if n == 1:  # the views made once per item: in the row loop they cost reference counts
                    xr, dr, sr = xq[r], xd[r], s16[r]
                    for o in range(o0, o1):
                        out[r, o] = row(raw, at + o * row_bytes, nb, xr, dr, sr)
                elif n == 2:
                    for o in range(o0, o1):
                        out[r, o], out[r + 1, o] = row2(raw, at + o * row_bytes, nb, xq, xd, s16, r)
                elif n == 3:
                    for o in range(o0, o1):
                        out[r, o], out[r + 1, o], out[r + 2, o] = row3(raw, at + o * row_bytes, nb, xq, xd, s16, r)
                else:
                    for o in range(o0, o1):
                        out[r, o], out[r + 1, o], out[r + 2, o], out[r + 3, o] = row4(raw, at + o * row_bytes, nb, xq, xd, s16, r)

        def kernel(raw, offsets, row_bytes, starts, items, bounds, xq, xd, s16, out, n_workers):
            # as below, groups of 1 .. FEW_MAX tokens: each row read once for all of them
            simd.run_queue(n_workers, bounds.size - 1, chunk, (raw, offsets, row_bytes, starts, items, bounds, xq, xd, s16, out, xd.shape[1]))

        return cached(njit(parallel=parallel, **JIT)(kernel), f"{name}-rowdot-grouped-few-{'par' if parallel else 'serial'}{_tag(name)}")
    if name in KTYPES:
        row = KROW[name]

        @njit(inline="always", **JIT)
        def chunk(c, a):
            raw, offsets, row_bytes, starts, items, bounds, xq, xd, s16, out, nb = a
            for i in range(bounds[c], bounds[c + 1]):
                g, o0, o1 = items[i, 0], items[i, 1], items[i, 2]
                for r in range(starts[g], starts[g + 1]):  # a second token reads the tile from cache
                    xr, dr, sr = xq[r], xd[r], s16[r]
                    for o in range(o0, o1):
                        out[r, o] = row(raw, offsets[g] + o * row_bytes, nb, xr, dr, sr)

        def kernel(raw, offsets, row_bytes, starts, items, bounds, xq, xd, s16, out, n_workers):
            # matrix g at byte offsets[g] against its one token, row starts[g] of xq i8 [N, n_in],
            # xd f32 [N, nb], s16 i32 [N, 2 nb]; out f32 [N, n_out]. items i64 [n, 3]: (g, o0, o1)
            simd.run_queue(n_workers, bounds.size - 1, chunk, (raw, offsets, row_bytes, starts, items, bounds, xq, xd, s16, out, xd.shape[1]))
    else:
        row = ROW[name, False]

        @njit(inline="always", **JIT)
        def chunk(c, a):
            raw, offsets, row_bytes, starts, items, bounds, xq, xd0, xd1, xs, out, nb = a
            for i in range(bounds[c], bounds[c + 1]):
                g, o0, o1 = items[i, 0], items[i, 1], items[i, 2]
                for r in range(starts[g], starts[g + 1]):
                    xr, dr, sr = xq[r], xd0[r], xs[r]
                    for o in range(o0, o1):
                        out[r, o] = row(raw, offsets[g] + o * row_bytes, nb, xr, dr, xd1, sr)

        def kernel(raw, offsets, row_bytes, starts, items, bounds, xq, xd, s16, out, n_workers):
            nb = xd.shape[1]
            xd0, xs = _padded_rows(xd, s16, nb)  # the padded scales and block sums, as _kernel's
            xd1 = np.zeros(xd0.shape[1], F32)
            simd.run_queue(n_workers, bounds.size - 1, chunk, (raw, offsets, row_bytes, starts, items, bounds, xq, xd0, xd1, xs, out, nb))

    return cached(njit(parallel=parallel, **JIT)(kernel), f"{name}-rowdot-grouped-{'par' if parallel else 'serial'}{_tag(name)}")


_GROUPED: dict[tuple, object] = {}


def matmul_grouped_one(name: str, raw: np.ndarray, offsets, row_bytes: int, starts, items, bounds, xq: np.ndarray,
                       xd: np.ndarray, s16: np.ndarray, out: np.ndarray, parallel: bool, n_workers: int) -> None:  # fmt: skip
    """cpu.matmul_grouped's items of a `name` (NAMES) type, activations with a scale per 32
    elements ([N, ...] planes): the same items, chunks and queue, each row read in place (each
    token's row is the one-token kernel's bits). cpu.py gives it the groups of at most
    few_max(name) tokens: one token (a decode step's routed experts, most of a serving step's), and
    for the IQ types 2-4 (each row's grid words fetched once for all the group's tokens); for more,
    decoding a row once costs less. The caller has validated everything."""
    key = (name, parallel)
    # more rows than matrices: some matrix has several tokens (the few-token kernel); otherwise (a
    # decode step) the one-token kernel, whose code the few-token branches would share. Either
    # kernel gives every group's bits whatever its size: this picks only the faster.
    if few_max(name) > 1 and xq.shape[0] > offsets.size:
        key = (name, parallel, True)
    if key not in _GROUPED:
        _GROUPED[key] = _grouped_one_kernel(*key)
    _GROUPED[key](raw, offsets, row_bytes, starts, items, bounds, xq, xd, s16, out, n_workers)

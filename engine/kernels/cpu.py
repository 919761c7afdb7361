"""Numba CPU kernels: W x straight from raw GGML block bytes (experts are read in place from the
mapped GGUF, never copied or widened).

The arithmetic is the one docs/kernels.md specifies to the bit, so a CUDA kernel can reproduce it:
per 32-element act-block an exact integer sum, ONE f32 expression with the float factors, lanes
l = block % 32 accumulated in block order, then a fixed fold over the 32 lanes. reference.py's
`dot_reference` is the same arithmetic in numpy; tests/engine/test_kernels_cpu.py holds the two equal.

Shapes: n_in = row length (GGUF ne0), n_out = rows, T = tokens; raw = n_out rows of n_in elements;
nb = n_in / 32 act-blocks per row.

How it is fast (each step measured; simd.py says why it is written with LLVM intrinsics):
- each row is decoded whole into int8 values + integer scales (one vector op per act-block for
  the simple types), then every token runs the integer half sums over the row 8 act-blocks at a
  time (VNNI or vpmaddwd, no per-block horizontal reduction), then one vectorized epilogue does
  the f32 terms, the lanes and the fold;
- rows go to threads in chunks, so scratch is allocated per chunk, not per row; a small call
  (SERIAL_BELOW) runs the same loop on the calling thread, without waking the pool;
- many tokens are walked in tiles whose activations stay in L2 (_TILE_BYTES), and the epilogue
  spends no multiply on scales known to be 1 or equal, nor any work on a 16-block half past the
  row's end;
- fp16 scales convert in hardware (F16C) where the host has it, else through a 65536-entry table;
  both are exact;
- the routed experts of a prompt chunk (a few tokens each) go through `matmul_grouped`: one call
  per matrix role for all the experts, each on its own rows, split into (expert, row tile) work
  items that the threads take from a shared queue (per expert `matmul` woke the pool three times
  per expert, and a static split left a thread idle whenever the other was descheduled).

Each type has two kernels (parallel, serial), and two grouped ones for block types, built on
first use and kept in a disk cache (jit.cached): a second process loads them in milliseconds
instead of compiling for seconds.
"""

from __future__ import annotations

import numba
import numpy as np
from numba import njit, prange

from strata.index_format.ggml_types import ggml_type

from . import iq_tables as T
from . import panel, rowdot, simd, threads
from .actq import QA, ActQ, ActQ16, combine16, is_wide
from .engine_form import F16_TO_F32
from .jit import JIT, cached

F32 = np.float32
BF16_TO_F32 = (np.arange(1 << 16, dtype=np.uint32) << 16).view(F32)
BF16_TO_F32.setflags(write=False)

# Grids as int64 words (8 int8 values, or 4 for the IQ3 grids widened to int64) so the decoders
# stay in int64 arithmetic: numba turns uint64-with-int64 arithmetic into float64.
_G2XXS = T.IQ2XXS_GRID.view(np.int64)
_G2XS = T.IQ2XS_GRID.view(np.int64)
_G2S = T.IQ2S_GRID.view(np.int64)
_G3XXS = T.IQ3XXS_GRID.astype(np.int64)
_G3S = T.IQ3S_GRID.astype(np.int64)
_G1S = T.IQ1S_GRID.view(np.int64)
# byte b -> 8 bytes, byte j = 0xff where bit j of b is set: the sign masks of simd.signed_bytes
_SMASK = (np.unpackbits(np.arange(256, dtype=np.uint8)[:, None], axis=1, bitorder="little") * np.uint8(255)).view(np.int64).reshape(256)
_KMASK = _SMASK[T.KSIGNS_IQ2XS]  # ksigns index (7 bits) -> mask (ggml's ksigns64)
_KV = T.KVALUES_IQ4NL.copy()
_PLUS1 = np.int64(0x0101010101010101)  # +1 in every byte
_MINUS1 = np.int64(-1)  # -1 (0xff) in every byte

_inline = dict(inline="always", **JIT)

# ---------------------------------------------------------------------------------------------
# Block decoders: the weight block at byte p of raw, whose first act-block is b of the row ->
# the row scratch: wq[32b ..] (int8 values) and, per act-block b + k, the integer form
# (reference.IntForm): sc[:, b + k] = ws0, ws1, mn0, mn1 (int32), fl[:, b + k] = wf, wm (f32).
# A type whose sc is constant leaves it as the driver preset it (_DECODERS). Loops over the 8
# act-blocks of a 256-block have literal bounds on purpose: LLVM unrolls them, so every shift
# below becomes a constant. Layout diagrams: reference.py, beside the numpy unpacking.


@njit(**_inline)
def _h(raw, p, lut):
    return simd.f16_to_f32(raw, p, lut)


@njit(**_inline)
def _dec_q8_0(raw, p, wq, b, sc, fl, lut):
    simd.copy32(raw, p + 2, wq, QA * b)
    fl[0, b] = _h(raw, p, lut)


@njit(**_inline)
def _dec_q4_0(raw, p, wq, b, sc, fl, lut):
    simd.nibbles(raw, p + 2, wq, QA * b, 8)
    fl[0, b] = _h(raw, p, lut)


@njit(**_inline)
def _dec_q4_1(raw, p, wq, b, sc, fl, lut):
    simd.nibbles(raw, p + 4, wq, QA * b, 0)
    fl[0, b], fl[1, b] = _h(raw, p, lut), _h(raw, p + 2, lut)


@njit(**_inline)
def _dec_q5_0(raw, p, wq, b, sc, fl, lut):
    simd.nibbles(raw, p + 6, wq, QA * b, 0)
    simd.or_word_bits(simd.load_u32(raw, p + 2), wq, QA * b, 4, 16)
    fl[0, b] = _h(raw, p, lut)


@njit(**_inline)
def _dec_q5_1(raw, p, wq, b, sc, fl, lut):
    simd.nibbles(raw, p + 8, wq, QA * b, 0)
    simd.or_word_bits(simd.load_u32(raw, p + 4), wq, QA * b, 4, 0)
    fl[0, b], fl[1, b] = _h(raw, p, lut), _h(raw, p + 2, lut)


@njit(**_inline)
def _dec_q2_0(raw, p, wq, b, sc, fl, lut):
    simd.crumbs64(raw, p + 2, wq, QA * b, 1)
    fl[0, b] = fl[0, b + 1] = _h(raw, p, lut)


@njit(**_inline)
def _dec_q2_k(raw, p, wq, b, sc, fl, lut):
    d, dmin = _h(raw, p + 80, lut), -_h(raw, p + 82, lut)
    for k in range(8):
        simd.bits(raw, p + 16 + 32 * (k >> 2), wq, QA * (b + k), 2 * (k & 3), 3, 0)
        s0, s1 = simd.load_u8(raw, p + 2 * k), simd.load_u8(raw, p + 2 * k + 1)
        sc[0, b + k], sc[1, b + k], sc[2, b + k], sc[3, b + k] = s0 & 15, s1 & 15, s0 >> 4, s1 >> 4
        fl[0, b + k], fl[1, b + k] = d, dmin


@njit(**_inline)
def _q3k_scale(raw, p, s):
    lo = (simd.load_u8(raw, p + 96 + (s & 7)) >> (4 * (s >> 3))) & 15
    hi = (simd.load_u8(raw, p + 104 + (s & 3)) >> (2 * (s >> 2))) & 3
    return np.int64(lo | (hi << 4)) - 32


@njit(**_inline)
def _dec_q3_k(raw, p, wq, b, sc, fl, lut):
    d = _h(raw, p + 108, lut)
    for k in range(8):
        # q = low 2 bits - (hmask bit k of byte j ? 0 : 4) = (low | hbit << 2) - 4
        simd.bits(raw, p + 32 + 32 * (k >> 2), wq, QA * (b + k), 2 * (k & 3), 3, 0)
        simd.or_bits(raw, p, wq, QA * (b + k), k, 1, 2, 4)
        sc[0, b + k], sc[1, b + k] = _q3k_scale(raw, p, 2 * k), _q3k_scale(raw, p, 2 * k + 1)
        fl[0, b + k] = d


@njit(**_inline)
def _k4_scale_min(raw, p, s):
    if s < 4:
        return simd.load_u8(raw, p + 4 + s) & 63, simd.load_u8(raw, p + 8 + s) & 63
    sc = (simd.load_u8(raw, p + 8 + s) & 15) | ((simd.load_u8(raw, p + s) >> 6) << 4)
    mn = (simd.load_u8(raw, p + 8 + s) >> 4) | ((simd.load_u8(raw, p + 4 + s) >> 6) << 4)
    return sc, mn


@njit(**_inline)
def _dec_q45_k(raw, p, wq, b, sc, fl, lut, qs, qh):
    d, dmin = _h(raw, p, lut), -_h(raw, p + 2, lut)
    for k in range(8):
        simd.bits(raw, p + qs + 32 * (k >> 1), wq, QA * (b + k), 4 * (k & 1), 15, 0)
        if qh:
            simd.or_bits(raw, p + qh, wq, QA * (b + k), k, 1, 4, 0)
        s, m = _k4_scale_min(raw, p, k)
        sc[0, b + k], sc[1, b + k], sc[2, b + k], sc[3, b + k] = s, s, m, m
        fl[0, b + k], fl[1, b + k] = d, dmin


@njit(**_inline)
def _dec_q4_k(raw, p, wq, b, sc, fl, lut):
    _dec_q45_k(raw, p, wq, b, sc, fl, lut, 16, 0)


@njit(**_inline)
def _dec_q5_k(raw, p, wq, b, sc, fl, lut):
    _dec_q45_k(raw, p, wq, b, sc, fl, lut, 48, 16)


@njit(**_inline)
def _dec_q6_k(raw, p, wq, b, sc, fl, lut):
    d = _h(raw, p + 208, lut)
    for k in range(8):
        n, j = k >> 2, k & 3
        simd.bits(raw, p + 64 * n + 32 * (j & 1), wq, QA * (b + k), 4 * (j >> 1), 15, 0)
        simd.or_bits(raw, p + 128 + 32 * n, wq, QA * (b + k), 2 * j, 3, 4, 32)
        sc[0, b + k] = np.int8(simd.load_u8(raw, p + 192 + 2 * k))
        sc[1, b + k] = np.int8(simd.load_u8(raw, p + 193 + 2 * k))
        fl[0, b + k] = d


@njit(**_inline)
def _b(w, i):
    """Byte i of the int64 word w."""
    return (w >> (8 * i)) & 255


@njit(**_inline)
def _dec_iq2_xxs(raw, p, wq, b, sc, fl, lut):
    d = _h(raw, p, lut) * F32(0.125)
    for k in range(8):
        w = simd.load_u64(raw, p + 2 + 8 * k)  # 4 grid indices, then the signs/scale word
        aux = (w >> 32) & 0xFFFFFFFF
        simd.signed_bytes(
            _G2XXS[_b(w, 0)], _G2XXS[_b(w, 1)], _G2XXS[_b(w, 2)], _G2XXS[_b(w, 3)],
            _KMASK[aux & 127], _KMASK[(aux >> 7) & 127], _KMASK[(aux >> 14) & 127], _KMASK[(aux >> 21) & 127],
            wq, QA * (b + k),
        )  # fmt: skip
        sc[0, b + k] = sc[1, b + k] = 2 * (aux >> 28) + 1
        fl[0, b + k] = d


@njit(**_inline)
def _dec_iq2_xs(raw, p, wq, b, sc, fl, lut):
    d = _h(raw, p, lut) * F32(0.125)
    for k in range(8):
        w = simd.load_u64(raw, p + 2 + 8 * k)  # 4 x (9-bit grid index | 7-bit ksigns index << 9)
        w0, w1, w2, w3 = w & 0xFFFF, (w >> 16) & 0xFFFF, (w >> 32) & 0xFFFF, (w >> 48) & 0xFFFF
        simd.signed_bytes(
            _G2XS[w0 & 511], _G2XS[w1 & 511], _G2XS[w2 & 511], _G2XS[w3 & 511],
            _KMASK[w0 >> 9], _KMASK[w1 >> 9], _KMASK[w2 >> 9], _KMASK[w3 >> 9], wq, QA * (b + k),
        )  # fmt: skip
        s = simd.load_u8(raw, p + 66 + k)
        sc[0, b + k], sc[1, b + k] = 2 * (s & 15) + 1, 2 * (s >> 4) + 1
        fl[0, b + k] = d


@njit(**_inline)
def _dec_iq2_s(raw, p, wq, b, sc, fl, lut):
    d = _h(raw, p, lut) * F32(0.125)
    for k in range(8):
        q = simd.load_u32(raw, p + 2 + 4 * k)
        sg = simd.load_u32(raw, p + 34 + 4 * k)
        qh = simd.load_u8(raw, p + 66 + k)
        simd.signed_bytes(
            _G2S[_b(q, 0) | ((qh & 3) << 8)], _G2S[_b(q, 1) | ((qh & 12) << 6)],
            _G2S[_b(q, 2) | ((qh & 48) << 4)], _G2S[_b(q, 3) | ((qh & 192) << 2)],
            _SMASK[_b(sg, 0)], _SMASK[_b(sg, 1)], _SMASK[_b(sg, 2)], _SMASK[_b(sg, 3)], wq, QA * (b + k),
        )  # fmt: skip
        s = simd.load_u8(raw, p + 74 + k)
        sc[0, b + k], sc[1, b + k] = 2 * (s & 15) + 1, 2 * (s >> 4) + 1
        fl[0, b + k] = d


@njit(**_inline)
def _pair(grid, w, i):
    """Grid entries at bytes i and i + 1 of w, as one 8-byte word."""
    return grid[_b(w, i)] | (grid[_b(w, i + 1)] << 32)


@njit(**_inline)
def _dec_iq3_xxs(raw, p, wq, b, sc, fl, lut):
    d = _h(raw, p, lut) * F32(0.25)
    for k in range(8):
        q = simd.load_u64(raw, p + 2 + 8 * k)
        aux = simd.load_u32(raw, p + 66 + 4 * k)
        simd.signed_bytes(
            _pair(_G3XXS, q, 0), _pair(_G3XXS, q, 2), _pair(_G3XXS, q, 4), _pair(_G3XXS, q, 6),
            _KMASK[aux & 127], _KMASK[(aux >> 7) & 127], _KMASK[(aux >> 14) & 127], _KMASK[(aux >> 21) & 127],
            wq, QA * (b + k),
        )  # fmt: skip
        sc[0, b + k] = sc[1, b + k] = 2 * (aux >> 28) + 1
        fl[0, b + k] = d


@njit(**_inline)
def _g3s(q, qh, m):
    # grid value m of the act-block: index byte m of q | bit m of qh << 8
    return _G3S[_b(q, m) | (((qh >> m) & 1) << 8)]


@njit(**_inline)
def _dec_iq3_s(raw, p, wq, b, sc, fl, lut):
    d = _h(raw, p, lut)
    for k in range(8):
        q = simd.load_u64(raw, p + 2 + 8 * k)
        qh = simd.load_u8(raw, p + 66 + k)
        sg = simd.load_u32(raw, p + 74 + 4 * k)
        simd.signed_bytes(
            _g3s(q, qh, 0) | (_g3s(q, qh, 1) << 32), _g3s(q, qh, 2) | (_g3s(q, qh, 3) << 32),
            _g3s(q, qh, 4) | (_g3s(q, qh, 5) << 32), _g3s(q, qh, 6) | (_g3s(q, qh, 7) << 32),
            _SMASK[_b(sg, 0)], _SMASK[_b(sg, 1)], _SMASK[_b(sg, 2)], _SMASK[_b(sg, 3)], wq, QA * (b + k),
        )  # fmt: skip
        sc[0, b + k] = sc[1, b + k] = 2 * ((simd.load_u8(raw, p + 106 + (k >> 1)) >> (4 * (k & 1))) & 15) + 1
        fl[0, b + k] = d


@njit(**_inline)
def _dec_iq1_s(raw, p, wq, b, sc, fl, lut):
    d = _h(raw, p, lut) * F32(0.125)
    for k in range(8):
        h = simd.load_u16(raw, p + 34 + 2 * k)
        q = simd.load_u32(raw, p + 2 + 4 * k)
        e = _MINUS1 if h & 0x8000 else _PLUS1
        simd.iq1_bytes(
            _G1S[_b(q, 0) | ((h & 7) << 8)], _G1S[_b(q, 1) | ((h & 56) << 5)],
            _G1S[_b(q, 2) | ((h & 448) << 2)], _G1S[_b(q, 3) | ((h & 3584) >> 1)], e, e, e, e, wq, QA * (b + k),
        )  # fmt: skip
        sc[0, b + k] = sc[1, b + k] = 2 * ((h >> 12) & 7) + 1
        fl[0, b + k] = d


@njit(**_inline)
def _iq1m_group(q, qh, l):
    nib = (qh >> (4 * l)) & 15
    return _G1S[_b(q, l) | ((nib & 7) << 8)], (_MINUS1 if nib & 8 else _PLUS1)


@njit(**_inline)
def _dec_iq1_m(raw, p, wq, b, sc, fl, lut):
    w = simd.load_u64(raw, p + 48)  # four scale words; their top nibbles are the fp16 d
    dbits = ((w >> 12) & 0x000F) | ((w >> 24) & 0x00F0) | ((w >> 36) & 0x0F00) | ((w >> 48) & 0xF000)
    d = lut[dbits] * F32(0.125)
    for k in range(8):
        q = simd.load_u32(raw, p + 4 * k)
        qh = simd.load_u16(raw, p + 32 + 2 * k)
        g0, e0 = _iq1m_group(q, qh, 0)
        g1, e1 = _iq1m_group(q, qh, 1)
        g2, e2 = _iq1m_group(q, qh, 2)
        g3, e3 = _iq1m_group(q, qh, 3)
        simd.iq1_bytes(g0, g1, g2, g3, e0, e1, e2, e3, wq, QA * (b + k))
        sh = 16 * (k >> 1) + 6 * (k & 1)
        sc[0, b + k], sc[1, b + k] = 2 * ((w >> sh) & 7) + 1, 2 * ((w >> (sh + 3)) & 7) + 1
        fl[0, b + k] = d


@njit(**_inline)
def _dec_iq4_nl(raw, p, wq, b, sc, fl, lut):
    simd.nibbles(raw, p + 2, wq, QA * b, 0)
    simd.lookup16(wq, QA * b, _KV)
    fl[0, b] = _h(raw, p, lut)


@njit(**_inline)
def _dec_iq4_xs(raw, p, wq, b, sc, fl, lut):
    d = _h(raw, p, lut)
    sh = simd.load_u16(raw, p + 2)
    for k in range(8):
        simd.nibbles(raw, p + 8 + 16 * k, wq, QA * (b + k), 0)
        simd.lookup16(wq, QA * (b + k), _KV)
        ls = ((simd.load_u8(raw, p + 4 + (k >> 1)) >> (4 * (k & 1))) & 15) | (((sh >> (2 * k)) & 3) << 4)
        sc[0, b + k] = sc[1, b + k] = ls - 32
        fl[0, b + k] = d


# Masking an index with this lets LLVM prove it non-negative, which drops numba's negative-index
# wrap-around code (3 instructions) from every sc[i, b] / fl[i, b] store of the decoders: with
# the second half's runtime offset unmasked, IQ2_XXS decoded 8% slower.
_NONNEG = (1 << 40) - 1

_UNIT, _UNIT_MIN, _OWN = (1, 1, 0, 0), (1, 1, 1, 1), (0, 0, 0, 0)

# name: (decoder, act-blocks per weight block, has a min term, sc preset (ws0, ws1, mn0, mn1))
_DECODERS = {
    "Q8_0": (_dec_q8_0, 1, False, _UNIT), "Q4_0": (_dec_q4_0, 1, False, _UNIT),
    "Q4_1": (_dec_q4_1, 1, True, _UNIT_MIN), "Q5_0": (_dec_q5_0, 1, False, _UNIT),
    "Q5_1": (_dec_q5_1, 1, True, _UNIT_MIN), "Q2_0": (_dec_q2_0, 2, False, _UNIT),
    "Q2_K": (_dec_q2_k, 8, True, _OWN), "Q3_K": (_dec_q3_k, 8, False, _OWN),
    "Q4_K": (_dec_q4_k, 8, True, _OWN), "Q5_K": (_dec_q5_k, 8, True, _OWN),
    "Q6_K": (_dec_q6_k, 8, False, _OWN), "IQ2_XXS": (_dec_iq2_xxs, 8, False, _OWN),
    "IQ2_XS": (_dec_iq2_xs, 8, False, _OWN), "IQ2_S": (_dec_iq2_s, 8, False, _OWN),
    "IQ3_XXS": (_dec_iq3_xxs, 8, False, _OWN), "IQ3_S": (_dec_iq3_s, 8, False, _OWN),
    "IQ1_S": (_dec_iq1_s, 8, False, _OWN), "IQ1_M": (_dec_iq1_m, 8, False, _OWN),
    "IQ4_NL": (_dec_iq4_nl, 1, False, _UNIT), "IQ4_XS": (_dec_iq4_xs, 8, False, _OWN),
}  # fmt: skip


# ---------------------------------------------------------------------------------------------
# drivers


# Types whose decoder writes ws0 = ws1 (and mn0 = mn1) for every act-block: their epilogue spends
# one integer multiply per sum, not two; the 32-element types (sc preset to 1) spend none.
_SAME_SCALES = {"Q4_K", "Q5_K", "IQ2_XXS", "IQ3_XXS", "IQ3_S", "IQ1_S", "IQ4_XS"}


def _scales(name: str, preset) -> str:
    """The kind of integer scales simd.row_epilogue is compiled for."""
    if preset != _OWN:
        return "unit"
    return "same" if name in _SAME_SCALES else "own"


def _quant_rows(dec, per, has_min, scales):
    """The row loop of one block type, inlined into its drivers: rows o0 .. o1 of the matrix at
    byte `base` of raw, against tokens t0 .. t1 of the activations -> out[t0 .. t1, o0 .. o1].

    Each row is decoded whole into the integer form (int8 values, integer scales, f32 factors per
    act-block); then each token walks it: exact integer half sums, one f32 term per act-block,
    lanes, fold. A row's arithmetic depends on neither the row range nor the token range, so
    every driver (serial, parallel, grouped) gives the same bits.

    Loads that meet a store made just before them stall (a 32-byte vector stored in two halves
    and reloaded whole made IQ4_NL 4x slower), so the dots never read a row decoded just before:
    rows alternate between two halves of the scratch, and row o + 1 is decoded after row o's
    dots. For short rows (fewer than 32 act-blocks: the 640-element down projection) it goes
    before row o's epilogue, whose loads of the scales and half sums would otherwise meet the
    stores just made (the down projection took 15-25% less time, docs/kernels.md); for long rows
    after it (decoding it before the epilogue cost them 10-20% in cache)."""

    epilogue = simd.row_epilogue[has_min, scales]

    @njit(**_inline)
    def rows(raw, base, type_size, row_bytes, o0, o1, t0, t1, xq, xs, xdp, xs0, xs1, lut, wq, sc, fl, lo, hi, out):
        # nb = act-blocks per row, P = nb rounded up to 32. Scratch (the driver's, per thread,
        # _scratch): wq, sc, fl hold two rows' integer form, row o in act-blocks c0 .. c0 + nb,
        # c0 = P * ((o - o0) & 1); lo, hi the half sums of token t at (t - t0) * P. xdp, xs0,
        # xs1 (_padded): the activations' scales and half sums, token t at t * P. Offsets, not
        # views: a view made in the row loop costs atomic reference counts. The dot loop stays
        # written out here: moved into an inlined helper it ran 1.1-5x slower (measured).
        P = sc.shape[1] // 2
        nb = row_bytes // type_size * per
        n_in = nb * QA
        short = nb < 32
        if o0 < o1:
            for w in range(nb // per):
                dec(raw, base + o0 * row_bytes + w * type_size, wq, per * w, sc, fl, lut)
        for o in range(o0, o1):
            c0 = P * ((o - o0) & 1)
            for t in range(t0, t1):
                x0, s0, l0 = t * n_in, 2 * t * nb, (t - t0) * P
                b = 0
                while b + 8 <= nb:
                    simd.half_sums8(wq, QA * (c0 + b), xq, x0 + QA * b, xs, s0 + 2 * b, lo, hi, l0 + b)
                    b += 8
                if b + 4 <= nb:
                    simd.half_sums4(wq, QA * (c0 + b), xq, x0 + QA * b, xs, s0 + 2 * b, lo, hi, l0 + b)
                    b += 4
                while b < nb:
                    simd.half_sums1(wq, QA * (c0 + b), xq, x0 + QA * b, lo, hi, l0 + b)
                    b += 1
            cn = (P - c0) & _NONNEG  # the other half
            if o + 1 < o1 and short:
                for w in range(nb // per):
                    dec(raw, base + (o + 1) * row_bytes + w * type_size, wq, cn + per * w, sc, fl, lut)
            for t in range(t0, t1):
                out[t, o] = epilogue(sc, fl, c0, 2 * P, lo, hi, (t - t0) * P, xdp, xs0, xs1, t * P, nb)
            if o + 1 < o1 and not short:
                for w in range(nb // per):
                    dec(raw, base + (o + 1) * row_bytes + w * type_size, wq, cn + per * w, sc, fl, lut)

    return rows


@njit(**_inline)
def _scratch(P, preset, n_tok):
    """One thread's scratch for _quant_rows: two rows' integer form (wq int8 values; sc = ws0, ws1,
    mn0, mn1 per act-block, preset for types that leave them constant; fl = wf, wm) and the
    integer half sums lo, hi of n_tok tokens."""
    wq = np.empty(2 * P * QA, np.int8)
    sc = np.empty((4, 2 * P), np.int32)
    for i in range(4):
        sc[i, :] = preset[i]
    fl = np.zeros((2, 2 * P), F32)
    return wq, sc, fl, np.zeros(n_tok * P, np.int32), np.zeros(n_tok * P, np.int32)


@njit(**_inline)
def _padded(xd, xs, P):
    """The activations' scales xd [T, nb] and half sums xs [T, 2 nb] as flat [T * P] planes (xdp,
    xs0, xs1), zero past nb: row_epilogue reads whole 16-block vectors."""
    n_tok, nb = xd.shape
    xdp = np.zeros(n_tok * P, F32)
    xs0 = np.zeros(n_tok * P, np.int32)
    xs1 = np.zeros(n_tok * P, np.int32)
    for t in range(n_tok):
        for b in range(nb):
            xdp[t * P + b], xs0[t * P + b], xs1[t * P + b] = xd[t, b], xs[t, 2 * b], xs[t, 2 * b + 1]
    return xdp, xs0, xs1


# Activations per token tile of the row loop: every row walks all the tokens, so with many
# tokens of long rows (256 x 6144 = 1.5 MB) the activations streamed from L3 for every row; a
# tile that stays in the 1 MB L2 is walked by all the chunk's rows first (each row's decode is
# then repeated per tile: cheap next to a tile's dots).
_TILE_BYTES = 1 << 18


def _quant_kernel(name, dec, per, has_min, preset, parallel):
    """The driver for one block type, parallel (prange over row chunks) or serial (the same loop
    on the calling thread: for small matrices the thread hand-off costs more than it saves)."""
    rows = _quant_rows(dec, per, has_min, _scales(name, preset))

    def kernel(raw, type_size, row_bytes, xq, xd, xs, lut, out, n_chunks):
        # raw u8 [n_out * row_bytes]; xq i8 [T * n_in] (flat); xd f32 [T, nb]; xs i32 [T, 2 nb]
        # out f32 [T, n_out]
        n_tok, n_out = out.shape
        P = (xd.shape[1] + 31) // 32 * 32
        for c in prange(n_chunks):
            # per chunk, not shared: the padding is cheap next to a chunk's rows
            xdp, xs0, xs1 = _padded(xd, xs, P)
            tile = max(1, _TILE_BYTES // (QA * xd.shape[1]))
            wq, sc, fl, lo, hi = _scratch(P, preset, min(tile, n_tok))
            o0, o1 = c * n_out // n_chunks, (c + 1) * n_out // n_chunks
            for a in range(0, n_tok, tile):
                rows(raw, 0, type_size, row_bytes, o0, o1, a, min(a + tile, n_tok), xq, xs, xdp, xs0, xs1, lut, wq, sc, fl, lo, hi, out)

    return cached(njit(parallel=parallel, **JIT)(kernel), f"{name}-{'par' if parallel else 'serial'}")


def _grouped_kernel(name, dec, per, has_min, preset, parallel):
    """The grouped driver of one block type: G matrices of the same shape, each against its own
    run of activation rows, as work items (matrix, row tile) in chunks of about equal cost
    (_balance) that the threads take from a shared queue, so 2 threads stay busy even when each
    matrix has ~5 tokens and when one thread is descheduled."""
    rows = _quant_rows(dec, per, has_min, _scales(name, preset))

    def kernel(raw, offsets, type_size, row_bytes, starts, items, bounds, xq, xd, xs, lut, out, n_workers):
        # raw u8: matrix g at byte offsets[g]; its tokens are rows starts[g] .. starts[g + 1] of
        # xq i8 [N * n_in] (flat), xd f32 [N, nb], xs i32 [N, 2 nb] and out f32 [N, n_out].
        # items i64 [n, 3]: (g, o0, o1); chunk c takes items bounds[c] .. bounds[c + 1].
        P = (xd.shape[1] + 31) // 32 * 32
        xdp, xs0, xs1 = _padded(xd, xs, P)
        tile = max(1, _TILE_BYTES // (QA * xd.shape[1]))
        most = 0
        for g in range(offsets.size):
            most = min(tile, max(most, starts[g + 1] - starts[g]))
        queue = np.zeros(1, np.int64)  # the next chunk: each worker takes chunks until none is left
        for _ in prange(n_workers):
            wq, sc, fl, lo, hi = _scratch(P, preset, most)
            c = simd.fetch_add(queue, 0, 1)
            while c < bounds.size - 1:
                for i in range(bounds[c], bounds[c + 1]):
                    g, o0, o1 = items[i, 0], items[i, 1], items[i, 2]
                    for a in range(starts[g], starts[g + 1], tile):
                        rows(raw, offsets[g], type_size, row_bytes, o0, o1, a, min(a + tile, starts[g + 1]),
                             xq, xs, xdp, xs0, xs1, lut, wq, sc, fl, lo, hi, out)  # fmt: skip
                c = simd.fetch_add(queue, 0, 1)

    return cached(njit(parallel=parallel, **JIT)(kernel), f"{name}-grouped-{'par' if parallel else 'serial'}")
@njit(**_inline)
def _load_f32(w, i, lut):
    return w[i]


@njit(**_inline)
def _load_16(w, i, lut):
    return lut[w[i]]


def _float_kernel(name, step16, load, parallel):
    """F32/F16/BF16 weights against f32 activations: lane l takes elements i = l (mod 32) in
    order, product rounded then added (docs/kernels.md); 16 lanes per vector step."""

    def kernel(w, x, lut, out, n_chunks):
        # w [n_out * n_in] (f32, or fp16/bf16 bits as uint16); x f32 [T, n_in]; out f32 [T, n_out]
        n_tok, n_in = x.shape
        n_out = out.shape[1]
        for c in prange(n_chunks):
            acc = np.empty(32, F32)
            for o in range(c * n_out // n_chunks, (c + 1) * n_out // n_chunks):
                base = o * n_in
                for t in range(n_tok):
                    acc[:] = F32(0)
                    i = 0
                    while i + 16 <= n_in:
                        step16(acc, i & 31, w, base + i, x[t], i, lut)
                        i += 16
                    for j in range(i, n_in):
                        acc[j & 31] = acc[j & 31] + load(w, base + j, lut) * x[t, j]
                    out[t, o] = simd.fold32(acc)

    return cached(njit(parallel=parallel, **JIT)(kernel), f"{name}-{'par' if parallel else 'serial'}")


def _quant_pair_kernel(name, dec, per, has_min, preset, parallel):
    """Two matrices of one block type and row length against one token, their rows one range split
    into chunks: one parallel region where a matvec of each made two (a shared expert's gate and
    up in a type without a one-token kernel: IQ4_XS). A row's arithmetic is _quant_rows' whatever
    the range it is in, so each out has its own matvec's bits."""
    rows = _quant_rows(dec, per, has_min, _scales(name, preset))

    def kernel(raw0, raw1, type_size, row_bytes, xq, xd, xs, lut, out0, out1, n_chunks):
        # as _quant_kernel's for one token; out0 f32 [1, n0], out1 f32 [1, n1]: rows 0 .. n0 of
        # the range are raw0's, the rest raw1's
        n0 = out0.shape[1]
        total = n0 + out1.shape[1]
        P = (xd.shape[1] + 31) // 32 * 32
        for c in prange(n_chunks):
            xdp, xs0, xs1 = _padded(xd, xs, P)
            wq, sc, fl, lo, hi = _scratch(P, preset, 1)
            a, b = c * total // n_chunks, (c + 1) * total // n_chunks
            if a < n0:
                rows(raw0, 0, type_size, row_bytes, a, min(b, n0), 0, 1, xq, xs, xdp, xs0, xs1, lut, wq, sc, fl, lo, hi, out0)
            if b > n0:
                rows(raw1, 0, type_size, row_bytes, max(a, n0) - n0, b - n0, 0, 1, xq, xs, xdp, xs0, xs1, lut, wq, sc, fl, lo,
                     hi, out1)  # fmt: skip

    return cached(njit(parallel=parallel, **JIT)(kernel), f"{name}-pair-{'par' if parallel else 'serial'}")


def _float_pair_kernel(name, step16, load, parallel):
    """_quant_pair_kernel for F32/F16/BF16 weights (QSA's indexer query and key projections): each
    row _float_kernel's lanes and fold."""

    @njit(**_inline)
    def row(w, o, x, lut, acc):
        n_in = x.shape[1]
        base = o * n_in
        acc[:] = F32(0)
        i = 0
        while i + 16 <= n_in:
            step16(acc, i & 31, w, base + i, x[0], i, lut)
            i += 16
        for j in range(i, n_in):
            acc[j & 31] = acc[j & 31] + load(w, base + j, lut) * x[0, j]
        return simd.fold32(acc)

    def kernel(w0, w1, x, lut, out0, out1, n_chunks):
        # w0 [n0 * n_in], w1 [n1 * n_in]; x f32 [1, n_in]; out0 f32 [1, n0], out1 f32 [1, n1]
        # (one array picked by the row in a prange body was not written to: two branches)
        n0 = out0.shape[1]
        total = n0 + out1.shape[1]
        for c in prange(n_chunks):
            acc = np.empty(32, F32)
            for r in range(c * total // n_chunks, (c + 1) * total // n_chunks):
                if r < n0:
                    out0[0, r] = row(w0, r, x, lut, acc)
                else:
                    out1[0, r - n0] = row(w1, r - n0, x, lut, acc)

    return cached(njit(parallel=parallel, **JIT)(kernel), f"{name}-pair-{'par' if parallel else 'serial'}")


_FLOAT = {"F32": (simd.dense16_f32, _load_f32), "F16": (simd.dense16_f16, _load_16), "BF16": (simd.dense16_bf16, _load_16)}


_KERNELS: dict[tuple[str, bool], object] = {}
_GROUPED: dict[tuple[str, bool], object] = {}


def _build(name: str, parallel: bool):
    if name in _DECODERS:
        return _quant_kernel(name, *_DECODERS[name], parallel)
    return _float_kernel(name, *_FLOAT[name], parallel)


def _kernel(name: str, parallel: bool):
    """Built on first use and compiled on first call, or loaded from the disk cache (jit.py)."""
    key = (name, parallel)
    if key not in _KERNELS:
        _KERNELS[key] = _build(name, parallel)
    return _KERNELS[key]


def _grouped(name: str, parallel: bool):
    """matmul_grouped's kernel of a block type, as _kernel."""
    key = (name, parallel)
    if key not in _GROUPED:
        _GROUPED[key] = _grouped_kernel(name, *_DECODERS[name], parallel)
    return _GROUPED[key]


_PANEL: dict[tuple[str, bool, bool], object] = {}


_PAIRS: dict[tuple[str, bool], object] = {}


def _pair_kernel(name: str, parallel: bool):
    """_quant_pair_kernel / _float_pair_kernel of a type, as _kernel."""
    key = (name, parallel)
    if key not in _PAIRS:
        _PAIRS[key] = (_quant_pair_kernel(name, *_DECODERS[name], parallel) if name in _DECODERS
                       else _float_pair_kernel(name, *_FLOAT[name], parallel))  # fmt: skip
    return _PAIRS[key]


def _panel(name: str, grouped: bool, parallel: bool):
    """The many-token kernel of a block type (panel.py, with this module's decoder), as _kernel."""
    key = (name, grouped, parallel)
    if key not in _PANEL:
        if name in _FLOAT:
            _PANEL[key] = panel.float_matmul_kernel(name, simd.widen16[name.lower()], _FLOAT[name][1], parallel)
        else:
            dec, per, has_min, preset = _DECODERS[name]
            make = panel.grouped_kernel if grouped else panel.matmul_kernel
            _PANEL[key] = make(name, dec, per, has_min, preset, _scales(name, preset), parallel)
    return _PANEL[key]


# Tokens per matrix from which products go to panel.py's kernels (AVX512-VNNI hosts): they
# decode (or widen) and transpose 16 rows for all the tokens at once, which costs more than it
# saves for few tokens (measured, 2560 x 2048 block types: 0.66-0.84x the row kernel at 1 token,
# 0.9-1.0x at 2, 0.94-1.16x at 3, 1.1-1.25x at 4, 1.3-1.9x at 8, 2.5-3.4x at 256; BF16/F16
# 2560 x 512 at 1 thread: 0.5-0.8x at 3-4 tokens, 1.1-1.2x at 8, 2.3-3.1x at 256). The token
# path (matvec) never takes them. Float matrices of fewer than 16 rows keep the row kernel too
# (a panel of 4 rows did a whole panel's work: 0.6x).
PANEL_FROM = 3
PANEL_FROM_FLOAT = 8
# Up to this many tokens, the rowdot.py types take rowdot.matmul (speculative decoding's verify
# forward of 1 + N rows): 2.45x a token step's dense time for 3 rows on seed-4l, where the panel
# kernels took 3.06x. tests/kernel_paths.py sets it to 1 to pin the row or panel kernels.
ROWDOT_ROWS_MAX = rowdot.ROWS_MAX
# The types whose panels are built straight from the raw blocks (panel.RAW) have no decode to pay
# back: from 2 tokens (the LM head from memory, 1 thread, CPU time: 2 tokens 38-40 ms on the raw
# panel against 44-62 on the row kernel, one token's matvec 28-34).
PANEL_FROM_RAW = 2
# ... except where each block unpacked once for every token (rowdot.ROW_FEW) beats the panel: rows
# of at least FEW_MIN_IN elements and at most FEW_MAX_ROWS activation rows (a wide form's token is
# two). One thread, seed-4l, the panel's time against ROW_FEW's (2026-12-05): the Q8_0 head 2 / 3 /
# 4 tokens 0.86-0.91 / 0.96-0.98 / 1.02-1.14, Q4_0 2560 x 6144 0.82 / 0.91 / 1.01, IQ4_NL 6144 x
# 2560 0.76 / 0.89 / 0.95, Q8_0 10240 x 320 0.86 / 0.89 / 1.20; the short rows lose (Q8_0 320 x
# 10240 1.40 / 1.63 / 1.96, IQ4_NL 640 x 2560 0.97 / 1.14 / 1.28): the per-row fold and tail are
# paid per token there, where a panel spreads them over 16 rows. A whole verify forward (seed-4l
# qwen4exp, 2 threads, benchmarks/spec.py, alternated processes): 2 rows 76.8, 77.4 -> 73.5, 73.2 ms
# (1.05x); 3 rows 91.1, 91.8 -> 92.2, 93.2 (nothing), so 3 rows keep the panel.
FEW_MIN_IN = 2048
FEW_MAX_ROWS = 2
# matmul_grouped has no one-token kernel of its own: its row kernel decodes each row into scratch.
# So there the raw panels take even one token per matrix (the routed experts of a serving step or
# of one token): IQ4_NL down projections, 2560 x 640, one token per expert, 1 thread, CPU time:
# 64 experts 7.6-9.6 -> 6.1-6.9 ms, 10 experts 1.25-1.37 -> 0.93-0.97 ms.
GROUPED_FROM_RAW = 1


def _use_panel(t, tokens_per_matrix: float, n_out: int, grouped: bool = False) -> bool:
    if not panel.AVAILABLE:
        return False
    if t.name in panel.RAW:
        return tokens_per_matrix >= (GROUPED_FROM_RAW if grouped else PANEL_FROM_RAW)
    if t.quantized:
        return tokens_per_matrix >= PANEL_FROM
    return tokens_per_matrix >= PANEL_FROM_FLOAT and n_out >= panel.ROWS


# ---------------------------------------------------------------------------------------------
# public API

_fixed: int | None = None  # set_threads' cap; None: the governor's count (threads.py)
_governor: threads.Governor | None = None


def set_threads(n: int | None) -> None:
    """Cap the kernels' CPU threads (the engine's --pool-workers), or None: follow the cores other
    processes leave free (threads.Governor, the default). Applies to every calling thread: numba's
    own setting is per thread, so each launch re-applies it where it runs."""
    global _fixed
    if n is None:
        _fixed = None
        return
    hi = numba.config.NUMBA_NUM_THREADS
    if not 1 <= int(n) <= hi:
        raise ValueError(f"set_threads: {n} threads asked for, this process has 1..{hi} (NUMBA_NUM_THREADS)")
    _fixed = int(n)
    numba.set_num_threads(_fixed)


def governor() -> threads.Governor:
    global _governor
    if _governor is None:
        _governor = threads.Governor(numba.config.NUMBA_NUM_THREADS)
    return _governor


def get_threads() -> int:
    """The threads a kernel launched now uses: the cap, or the governor's count."""
    return _fixed if _fixed is not None else governor().threads()


def threads_cap() -> int | None:
    """set_threads' argument in force (None: the governor decides)."""
    return _fixed


def use_threads() -> int:
    """get_threads(), applied to numba's per-thread setting for the parallel kernel launched next."""
    n = get_threads()
    if _numba_threads() != n:
        numba.set_num_threads(n)
    return n


def _numba_threads() -> int:
    """numba.get_num_threads(): once numba's pool is up, its C getter alone. The public function
    takes two locks to check the pool's start at every call, ~2 us of each of the ~50 launches of a
    token (a numba internal, as jit.py's cache: checked by tests/engine/test_threads.py)."""
    global _numba_threads
    from numba.np.ufunc import parallel

    parallel._launch_threads()
    getter = getattr(parallel, "_get_num_threads", None)
    if getter is None or getter() != numba.get_num_threads():  # another numba: the public function
        _numba_threads = numba.get_num_threads
        return numba.get_num_threads()
    _numba_threads = getter
    return getter()


# Below this much work (weight elements x tokens: multiply-adds) a call runs on the calling
# thread alone. Waking the pool costs 3-4 us on an idle machine and 3-8 ms when its cores are
# busy with other processes (a tiny model: 34 ms/token at 2 threads, 2.6 ms at 1). Idle, 2
# threads beat 1 from ~2^18 multiply-adds for Q4_0 and ~2^17 for IQ2_XXS (benchmarks/kernels.py
# --serial-sweep, docs/kernels.md); the larger crossover is kept, busy machines favour serial.
SERIAL_BELOW = 1 << 18


def _launch(n_out: int, work: int) -> tuple[bool, int]:
    """(parallel, chunks) for a call of `work` multiply-adds over n_out rows.

    Which kernel variant runs depends only on the work, not on the thread count: the parallel
    variant runs on one thread too (a region of one thread costs ~2.5 us), so a change of thread
    count while a model runs (the governor's) never compiles the other variant in the middle of
    a decode (a compile costs seconds)."""
    if not _parallel(n_out, work):
        return False, 1
    n = use_threads()
    return True, 1 if n == 1 else min(n_out, 4 * n)


def _parallel(n_out: int, work: int) -> bool:
    """Whether `_launch` sends a call of this size to the pool (its kernel's parallel variant)."""
    return not (work < SERIAL_BELOW or n_out == 1)


def _check_raw(raw: np.ndarray, t, n_in: int, n_out: int, where: str) -> np.ndarray:
    if not isinstance(raw, np.ndarray) or raw.dtype != np.uint8:
        raise TypeError(f"{where}: weight bytes must be a uint8 numpy array, got {getattr(raw, 'dtype', type(raw))}")
    need = t.nbytes((n_in, n_out))
    if raw.size != need:
        raise ValueError(f"{where}: {t.name} [{n_in} x {n_out}] is {need} bytes, got {raw.size}")
    if not raw.flags.c_contiguous:
        raise ValueError(f"{where}: weight bytes must be contiguous (they are read in place)")
    return raw.reshape(-1)


def _planes(act, n_in: int, one: bool, where: str):
    """q, d, s16 of an ActQ ([n_in] if `one`, else [T, n_in]) as 2-D planes [T, ...]. Shapes
    and dtypes only: that s16 are the sums of q is ActQ's invariant (quantize_act)."""
    if one and isinstance(act, ActQ) and act.q.ndim != 1:
        raise TypeError(f"{where}: activations must be a single vector, got ActQ {list(act.q.shape)} (use matmul)")
    ok = isinstance(act, ActQ) and act.q.ndim == (1 if one else 2) and act.q.shape[-1] == n_in
    if ok:
        q, d, s16 = act.q, act.d, act.s16
        lead = q.shape[:-1]
        ok = (q.dtype == np.int8 and d.dtype == F32 and s16.dtype == np.int32 and d.shape == lead + (n_in // QA,)
              and s16.shape == lead + (n_in // 16,) and q.flags.c_contiguous and d.flags.c_contiguous and s16.flags.c_contiguous)  # fmt: skip
    if not ok:
        shape = f"[{n_in}]" if one else f"[T, {n_in}]"
        raise TypeError(f"{where}: activations must be an ActQ {shape} (int8 q, f32 d, int32 s16, contiguous), got {_describe(act)}")
    if one:
        return q.reshape(1, -1), d.reshape(1, -1), s16.reshape(1, -1)
    return q, d, s16


def _floats(act, n_in: int, one: bool, t, where: str) -> np.ndarray:
    """f32 activations ([n_in] if `one`, else [T, n_in]) of F32/F16/BF16 weights, as [T, n_in]."""
    if one and not isinstance(act, ActQ) and getattr(act, "ndim", 1) != 1:
        raise TypeError(f"{where}: activations must be a single vector, got shape {list(act.shape)} (use matmul)")
    if isinstance(act, ActQ) or getattr(act, "dtype", None) != F32 or act.ndim != (1 if one else 2) or act.shape[-1] != n_in:
        shape = f"[{n_in}]" if one else f"[T, {n_in}]"
        raise TypeError(f"{where}: {t.name} weights take f32 activations {shape}, got {_describe(act)}")
    return np.ascontiguousarray(act).reshape(-1, n_in)


def _multiply(name: str, raw, type_id: int, n_in: int, n_out: int, act, out, one: bool, planes16: bool = False) -> np.ndarray:
    # planes16: act is an ActQ16's planes (_multiply16), whose lo rows hold -128 (rowdot.ROW_FULL)
    t = ggml_type(type_id, where=name)
    where = f"{name}({t.name})"
    if isinstance(act, ActQ16):
        return _multiply16(where, raw, t, n_in, n_out, act, out, one)
    raw = _check_raw(raw, t, n_in, n_out, where)
    if t.quantized:
        q, d, s16 = _planes(act, n_in, one, where)
    else:
        x = _floats(act, n_in, one, t, where)
    n_tok = q.shape[0] if t.quantized else x.shape[0]
    shape = (n_out,) if one else (n_tok, n_out)
    if out is None:
        out = np.empty(shape, F32)
    elif not (isinstance(out, np.ndarray) and out.shape == shape and out.dtype == F32 and out.flags.c_contiguous):
        raise ValueError(f"{where}: out must be contiguous f32 {list(shape)}, got {getattr(out, 'dtype', type(out))}{list(getattr(out, 'shape', []))}")
    out2 = out.reshape(n_tok, n_out)  # a view: out is contiguous
    # a verify's few rows: rowdot.matmul, unless a raw panel takes them (panel.RAW: the LM head of
    # seed-4l, Q8_0, 1 thread, CPU time: 2 / 3 / 4 tokens 36.8 / 60.0 / 70.6 ms through rowdot.matmul,
    # 36.2 / 46.1 / 46.2 through the raw panel, the same bits; 2026-12-01)
    few = not one and t.quantized and n_tok <= FEW_MAX_ROWS and n_in >= FEW_MIN_IN \
        and rowdot.few_rows(t.name, n_tok, d.shape[1] == 2 * (n_in // QA), planes16)  # (n_tok: the wide form's plane rows)
    if not one and 2 <= n_tok <= ROWDOT_ROWS_MAX and t.name in rowdot.TYPES and rowdot.AVAILABLE \
            and (few or not (t.name in panel.RAW and _use_panel(t, n_tok, n_out))):
        parallel, chunks = _launch(n_out, n_in * n_out * n_tok)
        rowdot.matmul(t.name, raw, t.row_bytes(n_in), q, d, s16, out2, parallel, chunks, wide=planes16)
        return out
    if not one and _use_panel(t, n_tok, n_out):  # both kernels take the same arguments
        parallel, chunks = _launch(-(-n_out // panel.ROWS), n_in * n_out * n_tok)  # chunks of panels
        kernel = _panel(t.name, False, parallel)
    else:
        parallel, chunks = _launch(n_out, n_in * n_out * n_tok)
        kernel = _kernel(t.name, parallel)
    if n_tok == 1 and t.name in rowdot.NAMES and rowdot.AVAILABLE:  # the token path: rowdot.py says why
        rowdot.matvec(t.name, raw, t.row_bytes(n_in), q.reshape(-1), d.reshape(-1), s16.reshape(-1), out2.reshape(-1), parallel, chunks)
    elif t.quantized:
        kernel(raw, t.type_size, t.row_bytes(n_in), q.reshape(-1), d, s16, F16_TO_F32, out2, chunks)
    else:
        w = raw.view(F32) if t.name == "F32" else raw.view(np.uint16)
        kernel(w, x, BF16_TO_F32 if t.name == "BF16" else F16_TO_F32, out2, chunks)
    return out


def _check16(act: ActQ16, t, n_in: int, one: bool, where: str) -> None:
    if not is_wide(t):
        raise TypeError(f"{where}: {t.name} weights read 8-bit activations (ActQ), got the wide form (ActQ16)")
    if act.one != one:
        raise TypeError(f"{where}: activations must be {'a single vector' if one else 'rows [T, n]'}, got ActQ16 of {act.rows} rows")
    _planes(act.planes, n_in, False, where)


def _multiply16(where: str, raw, t, n_in: int, n_out: int, act: ActQ16, out, one: bool) -> np.ndarray:
    """A product of the wide form: its planes' products as 2T tokens of one call (each row of the
    weight decoded once for all), combined (actq.combine16); the token path's rowdot types take
    both planes in one pass over the weight bytes."""
    _check16(act, t, n_in, one, where)
    T = act.rows
    shape = (n_out,) if one else (T, n_out)
    if out is None:
        out = np.empty(shape, F32)
    elif not (isinstance(out, np.ndarray) and out.shape == shape and out.dtype == F32 and out.flags.c_contiguous):
        raise ValueError(f"{where}: out must be contiguous f32 {list(shape)}, got {getattr(out, 'dtype', type(out))}{list(getattr(out, 'shape', []))}")
    p = act.planes
    if T == 1 and t.name in rowdot.TYPES and rowdot.AVAILABLE:
        raw = _check_raw(raw, t, n_in, n_out, where)
        parallel, chunks = _launch(n_out, 2 * n_in * n_out)
        rowdot.matvec(t.name, raw, t.row_bytes(n_in), p.q.reshape(-1), p.d.reshape(-1), p.s16.reshape(-1), out.reshape(-1), parallel, chunks, wide=True)
        return out
    both = _multiply("matmul", raw, t.id, n_in, n_out, p, None, one=False, planes16=True)
    combine16(both, out.reshape(T, n_out))
    return out


def matmul(raw: np.ndarray, type_id: int, n_in: int, n_out: int, act, out: np.ndarray | None = None) -> np.ndarray:
    """Y[t] = W X[t] for T tokens -> f32 [T, n_out] (into `out` if given).

    raw: the weight's GGML bytes (n_out rows of n_in elements), e.g. a slice of the mapped GGUF.
    act: ActQ [T, n_in] for block types (quantize_act), or ActQ16 (quantize_act16) for the actq.WIDE
    types; f32 [T, n_in] for F32/F16/BF16 weights. Small products (work under SERIAL_BELOW) run on
    the calling thread, the rest on the pool."""
    return _multiply("matmul", raw, type_id, n_in, n_out, act, out, one=False)


def matvec(raw: np.ndarray, type_id: int, n_in: int, n_out: int, act, out: np.ndarray | None = None) -> np.ndarray:
    """y = W x -> f32 [n_out]; act: ActQ [n_in] (block types), ActQ16 [n_in] (actq.WIDE types) or
    f32 [n_in] (F32/F16/BF16)."""
    return _multiply("matvec", raw, type_id, n_in, n_out, act, out, one=True)


def matvec_many(products, act) -> list[np.ndarray]:
    """y_i = W_i x for several matrices and one token's activations -> the outs. products: a list
    of (raw, type_id, n_in, n_out, out) with out f32 [n_out]; act as `matvec` takes it, or a list of
    one form per product (the 8-bit ActQ and the wide ActQ16 of one input: a GDN layer's qkv reads
    the wide form, its gate the 8-bit one, its BF16 alpha and beta the f32 values). Where every
    W_i has a one-token kernel (rowdot.NAMES; for the wide form rowdot.TYPES; F32/F16/BF16: the
    float row) the rows of all of them are one parallel region (a decode
    step's products on one input: rowdot.many_kernel); otherwise one matvec each. Either
    way each out is bit for bit `matvec` of its matrix."""
    acts = list(act) if isinstance(act, (list, tuple)) else [act] * len(products)
    if len(acts) != len(products):
        raise ValueError(f"matvec_many: {len(acts)} activation forms for {len(products)} products")
    names, raws, outs, work = [], [], [], 0
    for (raw, type_id, n_in, n_out, out), a in zip(products, acts):
        t = ggml_type(type_id, where="matvec_many")
        where = f"matvec_many({t.name})"
        raws.append(_check_raw(raw, t, n_in, n_out, where))
        if isinstance(a, ActQ16):
            _check16(a, t, n_in, True, where)
        if not (isinstance(out, np.ndarray) and out.shape == (n_out,) and out.dtype == F32 and out.flags.c_contiguous):
            raise ValueError(f"{where}: out must be contiguous f32 [{n_out}], got {_describe(out)}")
        names.append(t.name)
        outs.append(out)
        work += n_in * n_out
    wides = [isinstance(a, ActQ16) for a in acts]
    floats = [n in rowdot.FLOATS for n in names]
    narrow = [a for a, w, f in zip(acts, wides, floats) if not w and not f]
    wide = [a for a, w in zip(acts, wides) if w]
    values = [a for a, f in zip(acts, floats) if f]
    # one region where the forms are one input's (one ActQ, one ActQ16, one f32 vector) and
    # TokenProducts takes the matrices (each type with a one-token kernel for its form)
    plan = None
    if len(names) > 1 and all(isinstance(a, ActQ) and a is narrow[0] and a.d.size == a.q.size // QA for a in narrow) \
            and all(a is wide[0] and a.one for a in wide) \
            and all(isinstance(a, np.ndarray) and a is values[0] and a.dtype == F32 and a.ndim == 1 for a in values):
        kinds = ["w" if w else "f" if f else "q" for w, f in zip(wides, floats)]
        plan = TokenProducts.make([p[:4] for p in products], kinds)
    if plan is None:
        if len(names) == 2 and names[0] == names[1] and products[0][2] == products[1][2] and acts[0] is acts[1] \
                and not isinstance(acts[0], ActQ16) and not (rowdot.AVAILABLE and names[0] in rowdot.NAMES):
            return _matvec_pair(names[0], raws, products[0][2], outs, acts[0], work)
        return [matvec(raw, type_id, n_in, n_out, a, out) for (raw, type_id, n_in, n_out, out), a in zip(products, acts)]
    n_in = products[0][2]
    if narrow:
        _planes(narrow[0], n_in, True, "matvec_many")  # (its checks of the 8-bit form's planes)
    if values:
        _floats(values[0], n_in, True, ggml_type(names[floats.index(True)]), "matvec_many")
    plan(narrow[0] if narrow else None, wide[0] if wide else None, values[0] if values else None, outs)
    return outs


def _matvec_pair(name: str, raws, n_in: int, outs, act, work: int) -> list[np.ndarray]:
    """matvec_many of two matrices of one type without a one-token kernel: their rows in one region
    (_pair_kernel), each out bit for bit its matvec (the same row kernel, the same activations)."""
    t = ggml_type(name, where="matvec_many")
    parallel, chunks = _launch(outs[0].size + outs[1].size, work)
    o0, o1 = outs[0].reshape(1, -1), outs[1].reshape(1, -1)
    if t.quantized:
        q, d, s16 = _planes(act, n_in, True, "matvec_many")
        _pair_kernel(name, parallel)(raws[0], raws[1], t.type_size, t.row_bytes(n_in), q.reshape(-1), d.reshape(1, -1),
                              s16.reshape(1, -1), F16_TO_F32, o0, o1, chunks)  # fmt: skip
    else:
        x = _floats(act, n_in, True, t, "matvec_many")
        view = (lambda r: r.view(F32)) if name == "F32" else (lambda r: r.view(np.uint16))
        _pair_kernel(name, parallel)(view(raws[0]), view(raws[1]), x, BF16_TO_F32 if name == "BF16" else F16_TO_F32, o0, o1, chunks)
    return outs


class TokenProducts:
    """One token's products of fixed matrices (one call site of the token path), checked once and
    launched at every token.

    A token step makes the same product calls at every token, and matvec / matvec_many check every
    argument at each (each type's lookup, the bytes' size, the outs, the activations' planes): ~20-30
    us of Python a call, ~1 ms a token of seed-4l at one thread on the 2-core VM and twice that on
    the H200's host, where at 8 threads the whole token is ~30 ms (2026-12-04). Only the
    activations and outs change from token to token. A plan checks the matrices once, with the
    calls matvec_many makes, and at each call only the sizes of the activations and the outs it is
    given; then it launches the kernel matvec_many (several products) or matvec (one) would, with
    the same arguments and chunks: the same bits (tests/engine/test_token_regions.py)."""

    __slots__ = ("kernel", "static", "one", "n_in", "n_outs", "rows", "work", "t8", "t16", "floats")

    @classmethod
    def make(cls, products, kinds) -> TokenProducts | None:
        """products: [(raw, type_id, n_in, n_out)]; kinds[i] the form matrix i reads: "q" (an ActQ),
        "w" (an ActQ16: actq.reads_wide) or "f" (f32 values). None where matvec_many would not
        take them in one region (a type without a one-token kernel, inputs of two sizes, no rowdot on
        this CPU) or, for one product, where matvec would not take rowdot's one-token kernel (a
        float type): the caller multiplies them as before."""
        if not rowdot.AVAILABLE or not products or len({p[2] for p in products}) != 1:
            return None
        names, raws, row_bytes, work = [], [], [], 0
        types = {}
        for (raw, type_id, n_in, n_out), kind in zip(products, kinds):
            t = ggml_type(type_id, where="TokenProducts")
            ok = kind == "f" if t.name in rowdot.FLOATS else t.name in (rowdot.TYPES if kind == "w" else rowdot.NAMES) and kind != "f"
            if not ok or (kind == "f" and len(products) == 1):
                return None
            raw = _check_raw(raw, t, n_in, n_out, f"TokenProducts({t.name})")
            if kind == "f":  # a float matrix: its values and, in row_bytes' place, its table (matvec_many)
                raws.append(raw.view(F32) if t.name == "F32" else raw.view(np.uint16))
                row_bytes.append(BF16_TO_F32 if t.name == "BF16" else F16_TO_F32)
            else:
                raws.append(raw)
                row_bytes.append(t.row_bytes(n_in))
            types.setdefault(kind, t)
            names.append(t.name)
            work += n_in * n_out * (2 if kind == "w" else 1)  # the wide form: two planes, twice the dots
        plan = cls()
        plan.n_in, plan.n_outs, plan.work = products[0][2], tuple(p[3] for p in products), work
        plan.rows = sum(plan.n_outs)
        plan.t8, plan.t16, plan.floats = types.get("q"), types.get("w"), "f" in types
        parallel = _parallel(plan.rows, work)  # (the variant depends on the work alone: _launch)
        plan.one = len(products) == 1
        if plan.one:
            plan.kernel = rowdot.one_kernel(names[0], parallel, "wide" if kinds[0] == "w" else False)
        else:
            plan.kernel = rowdot.many_kernel(tuple(names), tuple(k == "w" for k in kinds), parallel)
        plan.static = tuple(zip(raws, row_bytes))
        return plan

    def __call__(self, x8: ActQ | None, x16: ActQ16 | None, fx: np.ndarray | None, outs) -> None:
        """The products of one token into outs (f32, contiguous, n_out values each: [n_out] or
        [1, n_out]): x8 its ActQ ([n_in] or [1, n_in]) where a matrix reads it (t8 not None), x16
        its ActQ16 of one row (t16), fx its f32 values (floats)."""
        n, nb = self.n_in, self.n_in // QA
        q = d = s = None
        if self.t8 is not None:
            q, d, s = x8.q, x8.d, x8.s16
            if q.size != n or d.size != nb or s.size != 2 * nb:
                raise TypeError(f"TokenProducts: activations must be one ActQ [{n}] (a scale per 32), got {_describe(x8)}")
            q, d, s = q.reshape(-1), d.reshape(-1), s.reshape(-1)  # (views: quantize_act's planes are contiguous)
        w = None
        if self.t16 is not None:
            p = x16.planes
            if p.q.size != 2 * n:
                raise TypeError(f"TokenProducts: the wide activations must be one ActQ16 [{n}], got {_describe(x16)}")
            w = (p.q.reshape(-1), p.d.reshape(-1), p.s16.reshape(-1))
        flat = []
        for o, n_out in zip(outs, self.n_outs):
            if not (o.size == n_out and o.dtype == F32 and o.flags.c_contiguous):  # (reshape would copy otherwise)
                raise ValueError(f"TokenProducts: out must be contiguous f32 of {n_out} values, got {_describe(o)}")
            flat.append(o.reshape(-1))
        chunks = _launch(self.rows, self.work)[1]
        if self.one:
            q, d, s = w if w is not None else (q, d, s)
            self.kernel(*self.static[0], q, d, s, flat[0], chunks)
            return
        f = None
        if self.floats:
            if fx.size != n:
                raise TypeError(f"TokenProducts: f32 activations must be [{n}], got {_describe(fx)}")
            f = fx.reshape(-1)
        none = rowdot._NONE8
        args = [a for (raw, rb), o in zip(self.static, flat) for a in (raw, rb, o)]
        self.kernel(*args, *((q, d, s) if q is not None else none), *(w if w is not None else none),
                    none[1] if f is None else f, chunks)  # fmt: skip


def _describe(act) -> str:
    if isinstance(act, ActQ16):
        return f"ActQ16 of {act.rows} rows of {act.n}"
    if isinstance(act, ActQ):
        return f"ActQ {list(act.q.shape)}"
    return f"{type(act).__name__} {getattr(act, 'dtype', '')}{list(getattr(act, 'shape', []))}"


# Rows per work item of the grouped kernel, and a row's decode counted as this many tokens' dots
# when the items are balanced over the threads (measured on the AMD EPYC development machine: an
# IQ2_XS row of 2560 decodes in the time of ~4 tokens' dots, an IQ4_NL row of 640 in ~1).
GROUP_TILE = 32
_DECODE_COST = 4
# Chunks per thread of a grouped call, taken from a shared queue: a static split, with one of the
# 2 cores busy with another process, made a 2-thread call slower than a serial one (120-139 ms
# against 100); with 32 queued chunks the running thread takes the waiting one's work (66-75 ms).
GROUP_CHUNKS = 16


def matmul_grouped(raw: np.ndarray, type_id: int, n_in: int, n_out: int, offsets, act, starts, out: np.ndarray | None = None) -> np.ndarray:
    """Y[starts[g]:starts[g + 1]] = W_g X[starts[g]:starts[g + 1]] for G matrices of one type and
    shape -> f32 [N, n_out], each row bit-identical to `matmul` of its own matrix and rows alone.

    raw: uint8 bytes holding the G matrices (e.g. one layer's whole expert tensor in the mapped
    GGUF); W_g is n_out rows of n_in elements from byte offsets[g]. act: ActQ [N, n_in] (block
    types) or f32 [N, n_in] (F32/F16/BF16: group by group through `matmul`). starts: int [G + 1]
    from 0 to N, non-decreasing (a group may be empty). One call for all the groups wakes the pool
    once and splits the work into (matrix, row tile) items of about equal cost per thread, so
    groups of a few tokens each (the routed experts of a prompt chunk) keep every thread busy."""
    t = ggml_type(type_id, where="matmul_grouped")
    where = f"matmul_grouped({t.name})"
    if not isinstance(raw, np.ndarray) or raw.dtype != np.uint8 or raw.ndim != 1 or not raw.flags.c_contiguous:
        raise TypeError(f"{where}: weight bytes must be a contiguous 1-D uint8 numpy array, got {_describe(raw)}")
    offsets, starts = _groups(offsets, starts, t.nbytes((n_in, n_out)), raw.size, where)
    if isinstance(act, ActQ16):
        return _grouped16(raw, t, n_in, n_out, offsets, act, starts, out, where)
    if t.quantized:
        q, d, s16 = _planes(act, n_in, False, where)
        n_tok = q.shape[0]
    else:
        x = _floats(act, n_in, False, t, where)
        n_tok = x.shape[0]
    if n_tok != starts[-1]:
        raise ValueError(f"{where}: starts end at {starts[-1]}, the activations have {n_tok} rows")
    if out is None:
        out = np.empty((n_tok, n_out), F32)
    elif not (isinstance(out, np.ndarray) and out.shape == (n_tok, n_out) and out.dtype == F32 and out.flags.c_contiguous):
        raise ValueError(f"{where}: out must be contiguous f32 {[n_tok, n_out]}, got {_describe(out)}")
    if not t.quantized:
        size = t.nbytes((n_in, n_out))
        for g, off in enumerate(offsets):
            a, b = starts[g], starts[g + 1]
            if a < b:
                matmul(raw[off : off + size], type_id, n_in, n_out, x[a:b], out[a:b])
        return out
    parallel, workers, calls = _grouped_plan(t, n_in, n_out, starts, d.shape[1] == n_in // QA)
    xq = q.reshape(-1)
    for kind, items, bounds in calls:
        if kind == "one":  # the one-token matrices: rowdot reads their rows in place
            rowdot.matmul_grouped_one(t.name, raw, offsets, t.row_bytes(n_in), starts, items, bounds, q, d, s16, out, parallel, workers)
        else:  # both kernels take the same arguments
            kernel = _panel(t.name, True, parallel) if kind == "panel" else _grouped(t.name, parallel)
            kernel(raw, offsets, t.type_size, t.row_bytes(n_in), starts, items, bounds, xq, d, s16, F16_TO_F32, out, workers)
    return out


# A decode step's grouped calls repeat one layout token after token (its k experts of one token
# each: starts 0..k, or 0..2k for gate and up in one call), so the work items of a layout, and
# per launch (parallel or not, threads) their chunks and the kernel choice, are kept rather than
# remade: ~30 numpy calls a call, 8 calls a token of seed-4l, were a share of the token's serial
# Python (docs/performance.md). Only layouts of a few rows are kept (a prompt chunk's items run
# to a MB and never repeat); PLANS_MAX bounds the dict. The key holds every setting the choice
# reads, so a test or benchmark that changes one gets a new plan.
PLAN_ROWS = 128
PLANS_MAX = 512
_PLANS: dict[tuple, tuple[np.ndarray, dict]] = {}


def _grouped_plan(t, n_in: int, n_out: int, starts: np.ndarray, coarse: bool) -> tuple[bool, int, list]:
    """(parallel, workers, calls) of a quantized matmul_grouped: calls = [(kind, items, bounds)],
    kind "one" (rowdot.matmul_grouped_one), "panel" (_panel) or "rows" (_grouped). A function of
    its arguments, the launch and the settings in the key only, so a kept plan is the one a fresh
    call would make."""
    n_tok = int(starts[-1])
    key = (t.name, n_in, n_out, coarse, starts.tobytes(), GROUPED_FROM_RAW, PANEL_FROM, PANEL_FROM_FLOAT, panel.AVAILABLE,
           rowdot.AVAILABLE, t.name in rowdot.NAMES, GROUP_TILE, GROUP_CHUNKS)  # fmt: skip
    entry = _PLANS.get(key)
    if entry is None:
        entry = (_tiles(starts, n_out), {})
        if n_tok <= PLAN_ROWS:
            if len(_PLANS) >= PLANS_MAX:
                _PLANS.clear()
            _PLANS[key] = entry
    items, by_launch = entry
    if len(items) == 0:
        return False, 1, []
    # every call: it applies the thread count where this call runs, and it is the region counted
    parallel, _ = _launch(len(items), n_in * n_out * n_tok)
    workers = _numba_threads() if parallel else 1  # _launch set it
    calls = by_launch.get((parallel, workers))
    if calls is None:
        calls = by_launch[parallel, workers] = _make_calls(t, n_out, starts, items, coarse, parallel, workers, n_tok)
    return parallel, workers, calls


def _make_calls(t, n_out: int, starts: np.ndarray, items: np.ndarray, coarse: bool, parallel: bool, workers: int,
                n_tok: int) -> list:  # fmt: skip
    sizes = np.diff(starts)
    live = np.count_nonzero(sizes)
    if _use_panel(t, n_tok / live, n_out, grouped=True):  # the raw-panel types take the panel from one token per expert
        return [("panel", items, _balance(items, starts, min(len(items), GROUP_CHUNKS * workers)))]
    calls = []
    if t.name in rowdot.NAMES and rowdot.AVAILABLE and coarse:
        # the one-token matrices (all of a decode step's; most of a serving step's, where 8
        # streams x 10 of 512 experts give a few experts 2 tokens) read their rows in place
        # (rowdot.py says why); the others decode each row once for their tokens (IQ2_XS, 48
        # experts of 2 tokens, 1 thread: 9.9 ms read in place twice, 10.7 decoded; IQ3_XXS
        # 19.5 against 14.0), in a second region. The IQ types read 2-4 tokens' rows in place
        # too, each row's grid words fetched once for all of them (rowdot.few_max)
        one = sizes[items[:, 0]] <= rowdot.few_max(t.name)
        if one.any():
            first = items[one]
            calls.append(("one", first, _balance(first, starts, min(len(first), GROUP_CHUNKS * workers))))
            items = items[~one]
            if len(items) == 0:
                return calls
    calls.append(("rows", items, _balance(items, starts, min(len(items), GROUP_CHUNKS * workers))))
    return calls


def _grouped16(raw, t, n_in: int, n_out: int, offsets, act: ActQ16, starts, out, where: str) -> np.ndarray:
    """matmul_grouped of the wide form: a group's rows a..b are planes rows 2a..2b (hi and lo of
    each row), one group of twice the tokens, so each expert row is decoded once for both planes;
    then combined."""
    _check16(act, t, n_in, False, where)
    N = act.rows
    if N != starts[-1]:
        raise ValueError(f"{where}: starts end at {starts[-1]}, the activations have {N} rows")
    if out is None:
        out = np.empty((N, n_out), F32)
    elif not (isinstance(out, np.ndarray) and out.shape == (N, n_out) and out.dtype == F32 and out.flags.c_contiguous):
        raise ValueError(f"{where}: out must be contiguous f32 {[N, n_out]}, got {_describe(out)}")
    both = matmul_grouped(raw, t.id, n_in, n_out, offsets, act.planes, 2 * starts)
    return combine16(both, out)


def _groups(offsets, starts, size: int, n_bytes: int, where: str) -> tuple[np.ndarray, np.ndarray]:
    """offsets, starts of matmul_grouped as int64 arrays, checked: every matrix inside raw, starts
    running from 0 without going back."""
    offsets = np.asarray(offsets)
    starts = np.asarray(starts)
    if offsets.ndim != 1 or offsets.dtype.kind not in "iu":
        raise TypeError(f"{where}: offsets must be a 1-D integer array, got {_describe(offsets)}")
    if starts.ndim != 1 or starts.dtype.kind not in "iu" or starts.size != offsets.size + 1:
        raise TypeError(f"{where}: starts must be a 1-D integer array of {offsets.size + 1} (groups + 1), got {_describe(starts)}")
    # no copy of int64 arrays, and the bounds by min and max: the token path makes 8 calls a token
    offsets = np.ascontiguousarray(offsets, dtype=np.int64)
    starts = np.ascontiguousarray(starts, dtype=np.int64)
    if offsets.size and (offsets.min() < 0 or offsets.max() > n_bytes - size):
        g = int(np.flatnonzero((offsets < 0) | (offsets > n_bytes - size))[0])
        raise ValueError(f"{where}: matrix {g} at byte {offsets[g]} ({size} bytes) is outside the {n_bytes} weight bytes")
    if starts[0] != 0 or (starts[1:] < starts[:-1]).any():
        raise ValueError(f"{where}: starts must run from 0 and never decrease, got {starts[:8].tolist()}...")
    return offsets, starts


def _tiles(starts: np.ndarray, n_out: int) -> np.ndarray:
    """The grouped kernel's work items, int64 [n, 3]: (group, first row, end row) of every
    GROUP_TILE rows of every group that has tokens."""
    live = np.flatnonzero(np.diff(starts))
    first = np.arange(0, n_out, GROUP_TILE, dtype=np.int64)
    items = np.empty((live.size * first.size, 3), np.int64)
    items[:, 0] = np.repeat(live, first.size)
    items[:, 1] = np.tile(first, live.size)
    items[:, 2] = np.minimum(items[:, 1] + GROUP_TILE, n_out)
    return items


def _balance(items: np.ndarray, starts: np.ndarray, chunks: int) -> np.ndarray:
    """int64 [chunks + 1]: chunk c takes items bounds[c] .. bounds[c + 1], of about equal cost
    (rows x (tokens + a decode)). The order of the items does not change: results do not depend on it."""
    tokens = starts[items[:, 0] + 1] - starts[items[:, 0]]
    cost = np.cumsum((items[:, 2] - items[:, 1]) * (tokens + _DECODE_COST))
    bounds = np.searchsorted(cost, cost[-1] * np.arange(1, chunks) / chunks, side="right")
    return np.concatenate(([0], bounds, [len(items)])).astype(np.int64)

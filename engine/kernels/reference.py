"""Slow, plain numpy references for the GGML block types: the first link of the chain of checks.

    gguf.quants (PyPI gguf 0.19.0)  ==bit-exact==  dequantize()      (tests/engine/test_kernels_reference.py)
    dequantize()                    ~=f32 level~=  IntForm           (same test, per element)
    dot_reference() (numpy)         ==bit-exact==  cpu.matvec/matmul (tests/engine/test_kernels_cpu.py)

`dequantize` repeats gguf-py's f32 operations in gguf-py's order (that is what makes it bit-exact:
`(d * sc) * q - dmin * m` and `d * (sc * q) - ...` differ in the last bit). Q2_0 (type 42) is not
in gguf 0.19.0; it follows ggml's dequantize_row_q2_0: `(q - 1) * d`, q the 2-bit field.

`IntForm` is the same block in the integer form the kernels compute with (docs/kernels.md):
every 32-element slice of a row ("act-block", the activation quantizer's block) is

    w[16h + j] = wf * ws[h] * q[16h + j]  (+ wm * mn[h])        h = 0, 1 (halves), j < 16

with q, ws, mn integers and wf, wm f32 (d times an exact power of two, or dmin, or m). All weight
block sizes are multiples of 32, so every type decomposes this way; `dot_reference` then does the
specified arithmetic with numpy, lane for lane.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from strata.index_format.ggml_types import QK_K, ggml_type

from . import iq_tables as T
from .actq import ActQ16, is_wide

F32 = np.float32

# Per-element grid values as small integer arrays: [n_entries, 8] (or 4 for the IQ3 grids).
IQ2XXS = T.IQ2XXS_GRID.view(np.uint8).reshape(-1, 8)
IQ2XS = T.IQ2XS_GRID.view(np.uint8).reshape(-1, 8)
IQ2S = T.IQ2S_GRID.view(np.uint8).reshape(-1, 8)
IQ3XXS = T.IQ3XXS_GRID.view(np.uint8).reshape(-1, 4)
IQ3S = T.IQ3S_GRID.view(np.uint8).reshape(-1, 4)
IQ1S = T.IQ1S_GRID.view(np.int8).reshape(-1, 8)
KSIGNS = T.KSIGNS_IQ2XS
KVALUES = T.KVALUES_IQ4NL


@dataclass(frozen=True)
class IntForm:
    """A weight tensor as integer act-blocks (module docstring). n32 = elements / 32."""

    q: np.ndarray  # int8  [n32, 32]  integer weight values
    ws: np.ndarray  # int32 [n32, 2]   integer scale of elements 0..15 and 16..31
    wf: np.ndarray  # f32   [n32]      float factor
    mn: np.ndarray | None = None  # int32 [n32, 2]  integer mins (types with a min term only)
    wm: np.ndarray | None = None  # f32   [n32]     float min factor: -dmin, or +m (Q4_1, Q5_1)

    def values(self) -> np.ndarray:
        """The weights this form denotes, in float64 (exact: no rounding of its own)."""
        v = self.wf[:, None, None].astype(np.float64) * self.ws[:, :, None] * self.q.reshape(-1, 2, 16)
        if self.mn is not None:
            v = v + (self.wm[:, None].astype(np.float64) * self.mn)[:, :, None]
        return v.reshape(-1)


# ---------------------------------------------------------------------------------------------
# small helpers: byte columns of a [n_blocks, type_size] uint8 array


def _cols(blocks: np.ndarray, *sizes: int) -> list[np.ndarray]:
    out, at = [], 0
    for n in sizes:
        out.append(np.ascontiguousarray(blocks[:, at : at + n]))
        at += n
    if at != blocks.shape[1]:
        raise AssertionError(f"layout covers {at} of {blocks.shape[1]} bytes")  # a bug here, not bad input
    return out


def _f16(col: np.ndarray) -> np.ndarray:
    return col.view(np.float16).astype(F32)  # [n, k]: k halves per block


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[n, 16*m] bytes -> [n, 32*m]: each 16-byte run gives 16 low nibbles then 16 high nibbles."""
    n = qs.shape[0]
    r = qs.reshape(n, -1, 1, 16) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
    return (r & 15).reshape(n, -1)


def _bits(col: np.ndarray, n_bits: int) -> np.ndarray:
    """[n, k] bytes -> [n, n_bits] bits, little-endian (bit i of the k-byte word)."""
    return np.unpackbits(col, axis=1, bitorder="little")[:, :n_bits]


def _sign_bits(sign_bytes: np.ndarray) -> np.ndarray:
    """[..., g] sign bytes -> [..., g, 8] of +1/-1 (bit j set: element j negative)."""
    b = (sign_bytes[..., None] >> np.arange(8, dtype=np.uint8)) & 1
    return np.where(b == 0, np.int8(1), np.int8(-1))


def _form(q, ws, wf, mn=None, wm=None) -> IntForm:
    n32 = q.size // 32

    def halves(v):  # a scalar, one value per act-block, or one per half -> int32 [n32, 2]
        v = np.asarray(v, np.int32)
        return np.ascontiguousarray(np.broadcast_to(v if v.ndim == 0 else v.reshape(n32, -1), (n32, 2)))

    if mn is not None:
        mn, wm = halves(mn), np.asarray(wm, F32).reshape(n32)
    return IntForm(q.astype(np.int8).reshape(n32, 32), halves(ws), np.asarray(wf, F32).reshape(n32), mn, wm)


def _per32(a: np.ndarray, n32_per_block: int) -> np.ndarray:
    """Repeat a per-block value [n, 1] for each of the block's act-blocks -> [n * n32_per_block]."""
    return np.repeat(a.reshape(-1), n32_per_block)


# ---------------------------------------------------------------------------------------------
# The block types. Each returns (values: f32 [n, block_size] bit-exact with gguf, IntForm).

# Q8_0  | d f16 | qs int8 x32 |           w = qs * d
# Q4_0  | d f16 | qs u8 x16   |           qs[j] = (w[j] & 15) | (w[j+16] << 4);  w = (nib - 8) * d
# Q4_1  | d f16 | m f16 | qs u8 x16 |     w = nib * d + m
# Q5_0  | d f16 | qh u32 | qs u8 x16 |    5th bit of element j = bit j of qh;  w = (q5 - 16) * d
# Q5_1  | d f16 | m f16 | qh u32 | qs | w = q5 * d + m
# Q2_0  | d f16 | qs u8 x16 |             element k: bits 2(k%4).. of qs[k/4] (packed in order); w = (q - 1) * d


def _q8_0(b):
    d, qs = _cols(b, 2, 32)
    d = _f16(d)
    q = qs.view(np.int8)
    return q.astype(F32) * d, _form(q, 1, d)


def _q4_0(b):
    d, qs = _cols(b, 2, 16)
    d = _f16(d)
    q = _nibbles(qs).astype(np.int8) - np.int8(8)
    return d * q.astype(F32), _form(q, 1, d)


def _q4_1(b):
    d, m, qs = _cols(b, 2, 2, 16)
    d, m = _f16(d), _f16(m)
    q = _nibbles(qs)
    return d * q.astype(F32) + m, _form(q, 1, d, 1, m)


def _q5_0(b):
    d, qh, qs = _cols(b, 2, 4, 16)
    d = _f16(d)
    q = (_nibbles(qs) | (_bits(qh, 32) << np.uint8(4))).astype(np.int8) - np.int8(16)
    return d * q.astype(F32), _form(q, 1, d)


def _q5_1(b):
    d, m, qh, qs = _cols(b, 2, 2, 4, 16)
    d, m = _f16(d), _f16(m)
    q = _nibbles(qs) | (_bits(qh, 32) << np.uint8(4))
    return d * q.astype(F32) + m, _form(q, 1, d, 1, m)


def _q2_0(b):
    d, qs = _cols(b, 2, 16)
    d = _f16(d)
    q = ((qs[:, :, None] >> np.array([0, 2, 4, 6], np.uint8)) & 3).reshape(-1, 64).astype(np.int8) - np.int8(1)
    return q.astype(F32) * d, _form(q, 1, _per32(d, 2))


# Q2_K  | scales u8 x16 | qs u8 x64 | d f16 | dmin f16 |   16 sub-blocks of 16
#   element 128n + 32j + l (n<2, j<4, l<32): q = (qs[32n + l] >> 2j) & 3, sub-block 8n + 2j + l/16
#   scales[s] = sc | m << 4 (4 bits each);  w = (d * sc) * q - dmin * m
# Q3_K  | hmask u8 x32 | qs u8 x64 | scales 12 B | d f16 |  16 sub-blocks of 16, same walk as Q2_K
#   q = ((qs[32n + l] >> 2j) & 3) - (bit (4n + j) of hmask[l] ? 0 : 4)
#   6-bit scale s: low 4 bits from nibble (s / 8) of scales[s % 8], high 2 bits from bits 2(s / 4) of
#   scales[8 + s % 4]; sc = that - 32;  w = (d * sc) * q


def _k_walk16(qs: np.ndarray) -> np.ndarray:
    """Q2_K/Q3_K: [n, 64] bytes -> [n, 256] 2-bit fields in element order."""
    n = qs.shape[0]
    r = qs.reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)
    return (r & 3).reshape(n, QK_K)


def _q2_k(b):
    scales, qs, d, dmin = _cols(b, 16, 64, 2, 2)
    d, dmin = _f16(d), _f16(dmin)
    sc, mn = scales & 15, scales >> 4  # [n, 16]
    q = _k_walk16(qs)
    dl = (d * sc.astype(F32))[:, :, None]
    ml = (dmin * mn.astype(F32))[:, :, None]
    vals = dl * q.reshape(-1, 16, 16).astype(F32) - ml
    return vals.reshape(-1, QK_K), _form(q, sc, _per32(d, 8), mn, _per32(-dmin, 8))


def _q3_k(b):
    hmask, qs, scales, d = _cols(b, 32, 64, 12, 2)
    d = _f16(d)
    s = np.arange(16)
    lo = (scales[:, s % 8] >> (4 * (s // 8)).astype(np.uint8)) & 15
    hi = (scales[:, 8 + s % 4] >> (2 * (s // 4)).astype(np.uint8)) & 3
    sc = (lo | (hi << 4)).astype(np.int8) - np.int8(32)
    hbit = (hmask[:, None, :] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1  # [n, bit=4n+j, l]
    q = _k_walk16(qs).astype(np.int8) - (4 * (1 - hbit.reshape(-1, QK_K))).astype(np.int8)
    vals = (d * sc.astype(F32))[:, :, None] * q.reshape(-1, 16, 16).astype(F32)
    return vals.reshape(-1, QK_K), _form(q, sc, _per32(d, 8))


# Q4_K  | d f16 | dmin f16 | scales 12 B | qs u8 x128 |     8 sub-blocks of 32
#   element 64i + 32h + l: q = nibble h of qs[32i + l];  sub-block s = 2i + h
#   6-bit sc/m of s (bytes 0..11 = S0..S11):  s < 4: sc = S[s] & 63, m = S[s+4] & 63
#                                             s >= 4: sc = S[s+4] & 15 | (S[s-4] >> 6) << 4,
#                                                     m  = S[s+4] >> 4 | (S[s]   >> 6) << 4
#   w = (d * sc) * q - dmin * m
# Q5_K  | d | dmin | scales 12 B | qh u8 x32 | qs u8 x128 |  q += bit s of qh[l] << 4


def _k4_scale_min(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    S = scales
    sc = np.concatenate([S[:, 0:4] & 63, (S[:, 8:12] & 15) | ((S[:, 0:4] >> 6) << 4)], axis=1)
    mn = np.concatenate([S[:, 4:8] & 63, (S[:, 8:12] >> 4) | ((S[:, 4:8] >> 6) << 4)], axis=1)
    return sc, mn  # [n, 8] each


def _q45_k(b, five):
    d, dmin, scales, qh, qs = _cols(b, 2, 2, 12, 32, 128) if five else _cols(b, 2, 2, 12, 0, 128)
    d, dmin = _f16(d), _f16(dmin)
    sc, mn = _k4_scale_min(scales)
    n = b.shape[0]
    q = ((qs.reshape(n, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)) & 15).reshape(n, 8, 32)
    if five:
        q = q | ((qh[:, None, :] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1) << np.uint8(4)
    dl = (d * sc.astype(F32))[:, :, None]
    ml = (dmin * mn.astype(F32))[:, :, None]
    vals = dl * q.astype(F32) - ml
    return vals.reshape(-1, QK_K), _form(q, np.repeat(sc, 2, axis=1), _per32(d, 8), np.repeat(mn, 2, axis=1), _per32(-dmin, 8))


# Q6_K  | ql u8 x128 | qh u8 x64 | scales int8 x16 | d f16 |   16 sub-blocks of 16
#   element 128n + 32j + l: low 4 bits = nibble (j / 2) of ql[64n + 32(j % 2) + l],
#   high 2 bits = bits 2j of qh[32n + l];  q = that - 32;  sub-block 8n + 2j + l/16;  w = (d * sc) * q


def _q6_k(b):
    ql, qh, scales, d = _cols(b, 128, 64, 16, 2)
    d = _f16(d)
    n = b.shape[0]
    lo = ((ql.reshape(n, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)) & 15).reshape(n, 2, 4, 32)
    hi = ((qh.reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)) & 3).reshape(n, 2, 4, 32)
    q = (lo | (hi << np.uint8(4))).astype(np.int8).reshape(n, QK_K) - np.int8(32)
    sc = scales.view(np.int8)
    vals = (d * sc.astype(F32))[:, :, None] * q.reshape(n, 16, 16).astype(F32)
    return vals.reshape(-1, QK_K), _form(q, sc, _per32(d, 8))


# IQ2_XXS | d f16 | 8 x (u32 grid, u32 signs) |   per act-block k: grid = 4 byte indices into
#   iq2xxs_grid (8 values each from {8, 25, 43}); signs word: 4 x 7-bit ksigns indices, top 4 bits ls
#   w = (d * (0.5 + ls) * 0.25 * grid) * sign = d/8 * (2 ls + 1) * grid * sign
# IQ2_XS  | d f16 | u16 x32 | scales u8 x8 |   u16 = 9-bit iq2xs_grid index | 7-bit ksigns index << 9
#   scale nibble h of scales[k] serves half h of act-block k
# IQ2_S   | d f16 | qs u8 x32 | signs u8 x32 | qh u8 x8 | scales u8 x8 |
#   group g (8 elements): index qs[g] | ((qh[g/4] >> 2(g%4)) & 3) << 8 into iq2s_grid; sign byte signs[g]


def _iq2_db(d, ls):
    return d * (F32(0.5) + ls.astype(F32)) * F32(0.25)


def _iq2_xxs(b):
    d, qs = _cols(b, 2, 64)
    d = _f16(d)
    w = qs.view(np.uint32).reshape(-1, 8, 2)
    grid = IQ2XXS[w[:, :, 0].copy().view(np.uint8).reshape(-1, 8, 4)]  # [n, 8, 4, 8]
    sidx = (w[:, :, 1:2] >> np.array([0, 7, 14, 21], np.uint32)) & 127
    sign = _sign_bits(KSIGNS[sidx])  # [n, 8, 4, 8]
    ls = w[:, :, 1] >> 28
    vals = (_iq2_db(d, ls)[:, :, None, None] * grid.astype(F32)) * sign.astype(F32)
    q = grid.astype(np.int8) * sign
    return vals.reshape(-1, QK_K), _form(q, 2 * ls.astype(np.int32) + 1, _per32(d * F32(0.125), 8))


def _iq2_xs(b):
    d, qs, scales = _cols(b, 2, 64, 8)
    d = _f16(d)
    w = qs.view(np.uint16)  # [n, 32]
    grid = IQ2XS[w & 511]  # [n, 32, 8]
    sign = _sign_bits(KSIGNS[w >> 9])
    ls = np.stack([scales & 15, scales >> 4], axis=2).reshape(-1, 16)  # per half (16 elements)
    vals = (_iq2_db(d, ls)[:, :, None, None] * grid.reshape(-1, 16, 2, 8).astype(F32)) * sign.reshape(-1, 16, 2, 8).astype(F32)
    q = grid.astype(np.int8) * sign
    return vals.reshape(-1, QK_K), _form(q, 2 * ls.astype(np.int32) + 1, _per32(d * F32(0.125), 8))


def _iq2_s(b):
    d, qs, signs, qh, scales = _cols(b, 2, 32, 32, 8, 8)
    d = _f16(d)
    hi = ((qh[:, :, None] >> np.array([0, 2, 4, 6], np.uint8)) & 3).reshape(-1, 32)
    grid = IQ2S[qs.astype(np.int32) | (hi.astype(np.int32) << 8)]  # [n, 32, 8]
    sign = _sign_bits(signs)
    ls = np.stack([scales & 15, scales >> 4], axis=2).reshape(-1, 16)
    vals = (_iq2_db(d, ls)[:, :, None, None] * grid.reshape(-1, 16, 2, 8).astype(F32)) * sign.reshape(-1, 16, 2, 8).astype(F32)
    q = grid.astype(np.int8) * sign
    return vals.reshape(-1, QK_K), _form(q, 2 * ls.astype(np.int32) + 1, _per32(d * F32(0.125), 8))


# IQ3_XXS | d f16 | qs u8 x64 | u32 x8 |  act-block k: 8 bytes qs[8k..] index iq3xxs_grid (4 values
#   each from {4, 12, ..., 62}); u32 k: 4 x 7-bit ksigns indices, top 4 bits ls
#   w = (d * (0.5 + ls) * 0.5 * grid) * sign = d/4 * (2 ls + 1) * grid * sign
# IQ3_S   | d f16 | qs u8 x64 | qh u8 x8 | signs u8 x32 | scales u8 x4 |
#   value m (4 elements): index qs[m] | (bit m%8 of qh[m/8]) << 8 into iq3s_grid ({1, 3, ..., 15});
#   sign bits: signs[g] for group g of 8; scale nibble k%2 of scales[k/2];  w = (d * (1 + 2 s) * grid) * sign


def _iq3_xxs(b):
    d, qs, sw = _cols(b, 2, 64, 32)
    d = _f16(d)
    w = sw.view(np.uint32)  # [n, 8]
    grid = IQ3XXS[qs].reshape(-1, 8, 4, 8)
    sign = _sign_bits(KSIGNS[(w[:, :, None] >> np.array([0, 7, 14, 21], np.uint32)) & 127])
    ls = w >> 28
    db = d * (F32(0.5) + ls.astype(F32)) * F32(0.5)
    vals = (db[:, :, None, None] * grid.astype(F32)) * sign.astype(F32)
    q = grid.astype(np.int8) * sign
    return vals.reshape(-1, QK_K), _form(q, 2 * ls.astype(np.int32) + 1, _per32(d * F32(0.25), 8))


def _iq3_s(b):
    d, qs, qh, signs, scales = _cols(b, 2, 64, 8, 32, 4)
    d = _f16(d)
    idx = qs.astype(np.int32) | (_bits(qh, 64).astype(np.int32) << 8)
    grid = IQ3S[idx].reshape(-1, 8, 4, 8)
    sign = _sign_bits(signs).reshape(-1, 8, 4, 8)
    s = np.stack([scales & 15, scales >> 4], axis=2).reshape(-1, 8)
    db = d * (1 + 2 * s).astype(F32)
    vals = (db[:, :, None, None] * grid.astype(F32)) * sign.astype(F32)
    q = grid.astype(np.int8) * sign
    return vals.reshape(-1, QK_K), _form(q, 2 * s.astype(np.int32) + 1, _per32(d, 8))


# IQ1_S | d f16 | qs u8 x32 | qh u16 x8 |  act-block k, group l: index qs[4k + l] | ((qh[k] >> 3l) & 7) << 8
#   into iq1s_grid (values -1, 0, 1); s = (qh[k] >> 12) & 7; delta = bit 15 ? -1/8 : +1/8
#   w = d * (2s + 1) * (grid + delta) = d/8 * (2s + 1) * (8 grid +- 1)
# IQ1_M | qs u8 x32 | qh u8 x16 | scales u16 x4 |   no plain fp16 field: d = the top nibbles of the
#   four scale words; 3-bit scale t of half h of act-block k: bits 6(k%2) + 3h of word k/2;
#   group g: index qs[g] | ((qh[g/2] >> 4(g%2)) & 7) << 8, delta sign bit 3 + 4(g%2) of qh[g/2]


def _iq1_s(b):
    d, qs, qh = _cols(b, 2, 32, 16)
    d = _f16(d)
    h = qh.view(np.uint16)  # [n, 8]
    idx = qs.reshape(-1, 8, 4).astype(np.int32) | (((h[:, :, None] >> np.array([0, 3, 6, 9], np.uint16)) & 7).astype(np.int32) << 8)
    grid = IQ1S[idx]  # [n, 8, 4, 8]
    s = (h >> 12) & 7
    neg = (h & 0x8000) != 0
    dl = d * (2 * s + 1).astype(F32)
    delta = np.where(neg, F32(-0.125), F32(0.125))
    vals = dl[:, :, None, None] * (grid.astype(F32) + delta[:, :, None, None])
    q = 8 * grid.astype(np.int16) + np.where(neg, -1, 1).astype(np.int16)[:, :, None, None]
    return vals.reshape(-1, QK_K), _form(q, 2 * s.astype(np.int32) + 1, _per32(d * F32(0.125), 8))


def _iq1_m(b):
    qs, qh, scales = _cols(b, 32, 16, 8)
    sw = scales.view(np.uint16)  # [n, 4]
    dbits = (sw[:, 0] >> 12) | ((sw[:, 1] >> 8) & 0x00F0) | ((sw[:, 2] >> 4) & 0x0F00) | (sw[:, 3] & 0xF000)
    d = dbits.astype(np.uint16).view(np.float16).astype(F32)[:, None]
    t = ((sw[:, :, None] >> np.array([0, 3, 6, 9], np.uint16)) & 7).reshape(-1, 16)  # [n, half of act-block]
    nib = (qh[:, :, None] >> np.array([0, 4], np.uint8)).reshape(-1, 32)  # per group
    idx = qs.astype(np.int32) | ((nib & 7).astype(np.int32) << 8)
    neg = (nib & 8) != 0
    grid = IQ1S[idx].reshape(-1, 16, 2, 8)
    dl = d * (2 * t + 1).astype(F32)
    delta = np.where(neg, F32(-0.125), F32(0.125)).reshape(-1, 16, 2, 1)
    vals = dl[:, :, None, None] * (grid.astype(F32) + delta)
    q = 8 * grid.astype(np.int16) + np.where(neg, -1, 1).astype(np.int16).reshape(-1, 16, 2, 1)
    return vals.reshape(-1, QK_K), _form(q, 2 * t.astype(np.int32) + 1, _per32(d * F32(0.125), 8))


# IQ4_NL | d f16 | qs u8 x16 |   Q4_0's nibble order, value kvalues_iq4nl[nibble];  w = d * kv
# IQ4_XS | d f16 | scales_h u16 | scales_l u8 x4 | qs u8 x128 |   act-block k: 6-bit ls =
#   nibble k%2 of scales_l[k/2] | ((scales_h >> 2k) & 3) << 4;  nibbles of qs[16k..16k+15];  w = (d * (ls - 32)) * kv


def _iq4_nl(b):
    d, qs = _cols(b, 2, 16)
    d = _f16(d)
    kv = KVALUES[_nibbles(qs)]
    return d * kv.astype(F32), _form(kv, 1, d)


def _iq4_xs(b):
    d, sh, sl, qs = _cols(b, 2, 2, 4, 128)
    d = _f16(d)
    h = sh.view(np.uint16)
    lo = np.stack([sl & 15, sl >> 4], axis=2).reshape(-1, 8)
    hi = (h >> (2 * np.arange(8, dtype=np.uint16))) & 3
    ls = (lo.astype(np.int16) | (hi.astype(np.int16) << 4)) - 32
    kv = KVALUES[_nibbles(qs)].reshape(-1, 8, 32)
    vals = (d * ls.astype(F32))[:, :, None] * kv.astype(F32)
    return vals.reshape(-1, QK_K), _form(kv, ls, _per32(d, 8))


_QUANT = {
    "Q8_0": _q8_0, "Q4_0": _q4_0, "Q4_1": _q4_1,
    "Q5_0": _q5_0, "Q5_1": _q5_1, "Q2_0": _q2_0,
    "Q2_K": _q2_k, "Q3_K": _q3_k, "Q4_K": lambda b: _q45_k(b, False), "Q5_K": lambda b: _q45_k(b, True),
    "Q6_K": _q6_k, "IQ2_XXS": _iq2_xxs, "IQ2_XS": _iq2_xs, "IQ2_S": _iq2_s, "IQ3_XXS": _iq3_xxs,
    "IQ3_S": _iq3_s, "IQ1_S": _iq1_s, "IQ1_M": _iq1_m, "IQ4_NL": _iq4_nl, "IQ4_XS": _iq4_xs,
}  # fmt: skip


def _blocks(raw: np.ndarray, type_id: int, n_elements: int, where: str) -> np.ndarray:
    t = ggml_type(type_id, where=where)
    if not isinstance(raw, np.ndarray) or raw.dtype != np.uint8:
        raise TypeError(f"{where}: raw weight bytes must be a uint8 numpy array, got {getattr(raw, 'dtype', type(raw))}")
    need = t.nbytes((n_elements,))  # also refuses a partial block
    if raw.size != need:
        raise ValueError(f"{where}: {t.name} x {n_elements} elements is {need} bytes, got {raw.size}")
    return raw.reshape(-1, t.type_size)


def dequantize(raw: np.ndarray, type_id: int, n_elements: int) -> np.ndarray:
    """Raw GGML bytes -> f32 [n_elements], bit-identical to gguf.quants.dequantize (and ggml for Q2_0)."""
    t = ggml_type(type_id, where="dequantize")
    blocks = _blocks(raw, type_id, n_elements, f"dequantize({t.name})")
    if t.name == "F32":
        return raw.view(F32).copy()
    if t.name == "F16":
        return raw.view(np.float16).astype(F32)
    if t.name == "BF16":
        return (raw.view(np.uint16).astype(np.uint32) << 16).view(F32)
    return _QUANT[t.name](blocks)[0].reshape(-1)


def decompose(raw: np.ndarray, type_id: int, n_elements: int) -> IntForm:
    """Raw GGML bytes of a quantized type -> IntForm over its n_elements / 32 act-blocks."""
    t = ggml_type(type_id, where="decompose")
    if not t.quantized:
        raise ValueError(f"decompose: {t.name} is not a block type (float weights have no integer form)")
    return _QUANT[t.name](_blocks(raw, type_id, n_elements, f"decompose({t.name})"))[1]


# ---------------------------------------------------------------------------------------------
# The dot product, exactly as specified in docs/kernels.md (lanes and fold), in numpy.


def fold_lanes(acc: np.ndarray) -> np.ndarray:
    """[..., 32] f32 lanes -> [...]: lane[l] += lane[l + w] for w = 16, 8, 4, 2, 1; result lane 0."""
    acc = acc.copy()
    w = 16
    while w:
        acc[..., :w] = acc[..., :w] + acc[..., w : 2 * w]
        w //= 2
    return acc[..., 0]


def accumulate_lanes(terms: np.ndarray) -> np.ndarray:
    """[..., n] f32 terms -> [..., 32] lanes: lane l = ((+0 + t[l]) + t[l + 32]) + ... in that order."""
    acc = np.zeros(terms.shape[:-1] + (32,), F32)
    for k in range(0, terms.shape[-1], 32):
        chunk = terms[..., k : k + 32]
        acc[..., : chunk.shape[-1]] = acc[..., : chunk.shape[-1]] + chunk
    return acc


def block_terms(form: IntForm, n_out: int, q: np.ndarray, d: np.ndarray, s16: np.ndarray) -> np.ndarray:
    """Per act-block f32 terms c [B, n_out, n32] of every row against B quantized activations."""
    n32 = form.q.shape[0] // n_out
    wq = form.q.reshape(n_out, n32, 2, 16).astype(np.int64)
    xq = q.reshape(-1, 1, n32, 2, 16).astype(np.int64)
    halves = (wq * xq).sum(-1)  # [B, n_out, n32, 2]
    isum = (form.ws.reshape(n_out, n32, 2) * halves).sum(-1)
    ad = d.reshape(-1, 1, n32)
    c = (form.wf.reshape(n_out, n32) * ad) * isum.astype(F32)
    if form.mn is not None:
        imin = (form.mn.reshape(n_out, n32, 2) * s16.reshape(-1, 1, n32, 2).astype(np.int64)).sum(-1)
        c = c + (form.wm.reshape(n_out, n32) * ad) * imin.astype(F32)
    return c


def dot_reference(raw: np.ndarray, type_id: int, n_in: int, n_out: int, act) -> np.ndarray:
    """W x for raw GGML weights (n_out rows of n_in) -> f32 [n_out] (or [B, n_out] for a batch).

    `act` is an ActQ for block types (or an ActQ16 for the actq.WIDE types: f32(256) times the
    product of its hi plane plus that of its lo plane), f32 activations [n_in] or [B, n_in] for
    F32/F16/BF16."""
    t = ggml_type(type_id, where="dot_reference")
    if isinstance(act, ActQ16):
        if not is_wide(t):
            raise TypeError(f"dot_reference: {t.name} weights read 8-bit activations, got the wide form (ActQ16)")
        hi, lo = dot_reference(raw, type_id, n_in, n_out, act.hi()), dot_reference(raw, type_id, n_in, n_out, act.lo())
        return F32(256) * hi + lo
    if not t.quantized:
        w = dequantize(raw, type_id, n_in * n_out).reshape(n_out, n_in)
        x = np.asarray(act, F32)
        prods = w[None] * x.reshape(-1, 1, n_in)  # [B, n_out, n_in], each product rounded to f32
        out = fold_lanes(accumulate_lanes(prods))  # lane l: elements i = l (mod 32), in order
        return out if x.ndim == 2 else out[0]
    form = decompose(raw, type_id, n_in * n_out)
    c = block_terms(form, n_out, act.q, act.d, act.s16)
    out = fold_lanes(accumulate_lanes(c))
    return out if act.q.ndim == 2 else out[0]

"""Random but valid GGML blocks of a chosen RMS, and plain quantizers for structured values.

A synthetic model needs gigabytes of weights that every decoder accepts and whose dequantized
values have a known scale; quantizing gigabytes of floats would make generation CPU-bound. So for
a block type we draw the whole block as random bytes (in every format Strata knows, any bit
pattern of a quant, grid-index, sign or sub-scale field decodes to a finite value) and then write
the fp16 scale(s): d = rms / unit_rms(type) * jitter, per block.

- jitter: every block gets its own scale (lognormal, sigma SCALE_JITTER). Equal scales would let
  a kernel that applies one block's scale to another block pass every test.
- types with a min (Q4_1, Q5_1, Q2_K, Q4_K, Q5_K): the min is tied to the scale so the values are
  centred; a random min gives every sub-block a large negative offset, unlike any real weight.
- Q4_0, Q5_0, Q2_0, IQ4_NL and IQ4_XS decode asymmetric ranges ({-8..7}, {-16..15}, {-1,0,1,2},
  the IQ4 value table); their d gets a random sign per block (ggml's quantizers produce both
  signs), so the tensor mean is zero.
- IQ1_M has no plain fp16 field: its scale lives in the top nibbles of its four uint16 sub-scale
  words, and is written there.

`_UNIT_MS[type]` is the mean of v^2 over the decoded values v of uniformly random blocks with
d = 1 (and the min rule above). Legacy, K and IQ4 types are closed forms of the bit fields; the
grid types (IQ1/IQ2/IQ3) depend on the grid tables and were measured once with gguf-py's
dequantizer over 4 x 2^16 random blocks, to about 0.1% (tests/tools/test_synth.py re-measures every type end to end).

Structured values (the token embedding, which must carry a shared direction) need a real
quantizer: `quantize_rows` covers F32, F16, BF16, Q8_0, Q4_0 and Q5_0, with ggml's reference
rounding (bit-identical to gguf-py's quantizers, which are bit-identical to ggml-quants.c).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from strata.index_format.ggml_types import GGMLType

SCALE_JITTER = 0.25

_KVALUES_MS = float(np.mean(np.array(
    [-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.float64) ** 2))
_U4_MS = 77.5  # E[s^2], s uniform in 0..15
_U6_MS = 1333.5  # E[s^2], s uniform in 0..63
_S6_MS = 341.5  # E[(s - 32)^2], s uniform in 0..63
_I8_MS = 5461.5  # E[q^2], q uniform int8


@dataclass(frozen=True)
class _Layout:
    unit_ms: float
    d_at: int | None  # byte offset of the fp16 scale (None: IQ1_M)
    min_at: int | None = None  # byte offset of the fp16 min (Q4_1/Q5_1 m, K-quant dmin)
    min_ratio: float = 0.0  # min = min_ratio * d
    signed_d: bool = False
    fix: Callable[[np.ndarray, np.random.Generator], None] | None = None  # sub-scale rule, in place


def _q2k_scales(b: np.ndarray, rng: np.random.Generator) -> None:
    # scales[16]: low nibble = scale, high nibble = min; min == scale and dmin = 1.5 d centre q in 0..3
    s = b[:, 0:16] & 0x0F
    b[:, 0:16] = s | (s << 4)


def _k4_scales(b: np.ndarray, rng: np.random.Generator) -> None:
    # Q4_K / Q5_K scales[12] at byte 4 pack eight 6-bit scales and eight 6-bit mins
    # (get_scale_min_k4). Packing scale == min for every sub-block, with dmin = (q_max / 2) * d,
    # centres the values. For j < 4: scale = q[j] & 63, min = q[j+4] & 63; for j >= 4 the low
    # nibbles sit in q[j+4] (scale low, min high) and the two high bits in q[j-4] >> 6 / q[j] >> 6.
    s = (b[:, 4:12] & 0x3F).astype(np.uint8)  # 8 random 6-bit values per block
    lo, hi = s[:, :4], s[:, 4:]
    top = (hi >> 4) << 6
    b[:, 4:8] = lo | top
    b[:, 8:12] = lo | top
    b[:, 12:16] = (hi & 0x0F) * 17


# fmt: off
_LAYOUTS: dict[str, _Layout] = {
    "Q4_0":    _Layout(21.5, 0, signed_d=True),                 # E[(q-8)^2], q in 0..15
    "Q4_1":    _Layout(21.25, 0, 2, -7.5),                      # y = d q + m, m = -7.5 d
    "Q5_0":    _Layout(85.5, 0, signed_d=True),                 # E[(q-16)^2], q in 0..31
    "Q5_1":    _Layout(85.25, 0, 2, -15.5),
    "Q8_0":    _Layout(_I8_MS, 0),
    "Q2_0":    _Layout(1.5, 0, signed_d=True),                  # y = (q-1) d, q in 0..3
    "Q2_K":    _Layout(_U4_MS * 1.25, 80, 82, 1.5, fix=_q2k_scales),   # d s (q - 1.5)
    "Q3_K":    _Layout(_S6_MS * 5.5, 108),                      # d (s-32) q, q in -4..3
    "Q4_K":    _Layout(_U6_MS * 21.25, 0, 2, 7.5, fix=_k4_scales),     # d s (q - 7.5)
    "Q5_K":    _Layout(_U6_MS * 85.25, 0, 2, 15.5, fix=_k4_scales),    # d s (q - 15.5)
    "Q6_K":    _Layout(_I8_MS * _S6_MS, 208),                   # d s (q - 32), s int8
    "IQ4_NL":  _Layout(_KVALUES_MS, 0, signed_d=True),          # kvalues are asymmetric too
    "IQ4_XS":  _Layout(_S6_MS * _KVALUES_MS, 0, signed_d=True), # d (ls - 32) kvalue
    # measured (see the module docstring)
    "IQ2_XXS": _Layout(2850.0, 0),
    "IQ2_XS":  _Layout(3126.0, 0),
    "IQ2_S":   _Layout(3181.0, 0),
    "IQ3_XXS": _Layout(20280.0, 0),
    "IQ3_S":   _Layout(19670.0, 0),
    "IQ1_S":   _Layout(51.80, 0),
    "IQ1_M":   _Layout(51.80, None),
}
# fmt: on


def unit_rms(t: GGMLType) -> float:
    """RMS of the decoded values of random blocks of `t` with scale 1."""
    return float(np.sqrt(_layout(t).unit_ms))


def _layout(t: GGMLType) -> _Layout:
    lay = _LAYOUTS.get(t.name)
    if lay is None:
        raise ValueError(f"synth_blocks: no random-block rule for GGML type {t.name} (id {t.id})")
    return lay


def random_bytes(rng: np.random.Generator, n: int) -> np.ndarray:
    """n uniformly random bytes, writable. random_raw is ~4x faster than integers(dtype=uint8)."""
    raw = rng.bit_generator.random_raw(-(-n // 8)).view(np.uint8)
    return raw[:n]


def random_blocks(t: GGMLType, n_blocks: int, rms: float, rng: np.random.Generator) -> np.ndarray:
    """`n_blocks` random valid blocks of quantized type `t`, shape (n_blocks, type_size) uint8,
    whose decoded values have root-mean-square `rms`."""
    lay = _layout(t)
    b = random_bytes(rng, n_blocks * t.type_size).reshape(n_blocks, t.type_size)
    if lay.fix is not None:
        lay.fix(b, rng)
    # E[d^2] over the lognormal jitter is d0^2 exp(2 sigma^2): divide it out so the RMS is `rms`.
    d0 = rms / np.sqrt(lay.unit_ms) * np.exp(-SCALE_JITTER**2)
    d = d0 * np.exp(SCALE_JITTER * rng.standard_normal(n_blocks))
    if lay.signed_d:
        d *= np.where(random_bytes(rng, n_blocks) & 1, -1.0, 1.0)
    if lay.d_at is None:
        _set_iq1m_scale(b, d)
        return b
    _put_f16(b, lay.d_at, d)
    if lay.min_at is not None:
        _put_f16(b, lay.min_at, lay.min_ratio * d)
    return b


def _put_f16(b: np.ndarray, at: int, values: np.ndarray) -> None:
    b[:, at : at + 2] = values.astype("<f2").view(np.uint8).reshape(-1, 2)


def _set_iq1m_scale(b: np.ndarray, d: np.ndarray) -> None:
    # block_iq1_m: qs[32] qh[16] scales[8]; the fp16 d is split into 4 nibbles, nibble i in the
    # top 4 bits of the i-th uint16 of scales (dequantize_row_iq1_m); the low 12 bits stay random.
    bits = d.astype("<f2").view("<u2").astype(np.uint16)
    sc = b[:, 48:56].copy().view("<u2")  # (n, 4)
    for i in range(4):
        sc[:, i] = (sc[:, i] & 0x0FFF) | (((bits >> (4 * i)) & 0xF) << 12)
    b[:, 48:56] = sc.view(np.uint8)


# ----------------------------------------------------------------------------- float types


def encode_floats(t: GGMLType, x: np.ndarray) -> np.ndarray:
    """Values as the bytes of an unquantized type (F32, F16, BF16), little endian."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    if t.name == "F32":
        return x.astype("<f4").view(np.uint8).ravel()
    if t.name == "F16":
        return x.astype("<f2").view(np.uint8).ravel()
    if t.name == "BF16":
        u = x.view(np.uint32).astype(np.uint64)
        # round to nearest even, as torch and ggml do (finite inputs only)
        r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype("<u2")
        return r.view(np.uint8).ravel()
    raise ValueError(f"encode_floats: {t.name} is not an unquantized type")


def decode_floats(t: GGMLType, raw: np.ndarray) -> np.ndarray:
    """Inverse of encode_floats (for checks): bytes of F32/F16/BF16 to float32."""
    raw = np.ascontiguousarray(raw, dtype=np.uint8)
    if t.name == "F32":
        return raw.view("<f4").astype(np.float32)
    if t.name == "F16":
        return raw.view("<f2").astype(np.float32)
    if t.name == "BF16":
        return (raw.view("<u2").astype(np.uint32) << 16).view(np.float32)
    raise ValueError(f"decode_floats: {t.name} is not an unquantized type")


# ----------------------------------------------------------------------------- quantizers

STRUCTURED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q5_0")


def quantize_rows(t: GGMLType, x: np.ndarray) -> np.ndarray:
    """Encode float rows (last axis = row, a whole number of blocks) as type `t`, as uint8."""
    if not t.quantized:
        return encode_floats(t, x)
    enc = {"Q8_0": _q8_0, "Q4_0": _q4_0, "Q5_0": _q5_0}.get(t.name)
    if enc is None:
        raise ValueError(f"quantize_rows: {t.name} has no quantizer here (structured values need one of "
                         f"{', '.join(STRUCTURED_TYPES)})")
    xb = np.ascontiguousarray(x, dtype=np.float32).reshape(-1, 32)
    return enc(xb).ravel()


def _q8_0(x: np.ndarray) -> np.ndarray:
    # block_q8_0: d (fp16) | qs[32] int8;  d = amax / 127, q = roundf(x / d) (half away from zero)
    d = np.abs(x).max(axis=1) / np.float32(127)
    v = x * _inv(d)[:, None]
    q = (np.sign(v) * np.floor(np.abs(v) + np.float32(0.5))).astype(np.int8)
    return _pack(d, q.view(np.uint8))


def _signed_max(x: np.ndarray) -> np.ndarray:
    """Per block, the value of largest magnitude with its sign (ggml's q4_0/q5_0 reference)."""
    return x[np.arange(len(x)), np.abs(x).argmax(axis=1)]


def _q4_0(x: np.ndarray) -> np.ndarray:
    # block_q4_0: d (fp16) | qs[16]: element j in the low nibble of qs[j], j+16 in the high nibble
    d = _signed_max(x) / np.float32(-8)
    q = np.minimum(15, np.floor(x * _inv(d)[:, None] + np.float32(8.5))).astype(np.uint8)
    return _pack(d, q[:, :16] | (q[:, 16:] << 4))


def _q5_0(x: np.ndarray) -> np.ndarray:
    # block_q5_0: d (fp16) | qh (u32: bit j = bit 4 of element j) | qs[16] (low nibbles as q4_0)
    d = _signed_max(x) / np.float32(-16)
    q = np.minimum(31, np.floor(x * _inv(d)[:, None] + np.float32(16.5))).astype(np.uint8)
    qh = np.packbits(q >> 4, axis=1, bitorder="little")  # (n, 4): bit j of the u32, little endian
    lo = q & 0x0F
    return _pack(d, qh, lo[:, :16] | (lo[:, 16:] << 4))


def _pack(d: np.ndarray, *fields: np.ndarray) -> np.ndarray:
    return np.concatenate([d.astype("<f2").view(np.uint8).reshape(-1, 2), *fields], axis=1)


def _inv(d: np.ndarray) -> np.ndarray:
    # ggml scales by 1/d of the UNROUNDED float32 d and stores d rounded to fp16
    return np.divide(np.float32(1), d, out=np.zeros_like(d), where=d != 0)

"""ActQ: the ONE activation quantizer of every quantized matmul, CPU and GPU alike (S10).

GPU hits and CPU misses must see the same integer activations: a 4.761e-04 relative disagreement
(fp16 activation scales on one side, f32 on the other) was enough to change the generated tokens.
So the quantizer is specified to the bit here and in docs/kernels.md, and a GPU port is checked
against `quantize_act_reference`.

Per 32-element block x[0..31] (f32), in f32 IEEE arithmetic, no fast-math, no flush-to-zero:

    amax = max_j |x[j]|
    d    = amax / 127                        (correctly rounded division)
    q[j] = 0                                 if d == 0
         = clip(rint(x[j] / d), -127, 127)   otherwise; rint = round half to EVEN (IEEE default),
                                             x / d a correctly rounded division
    s16[h] = sum of q[16h .. 16h + 15]       (int32; the "mins" of Q4_1/Q5_1/Q2_K/Q4_K/Q5_K need it)

Why these choices: division rather than a reciprocal (`x * (1/d)`), because 1/d overflows to inf for
a subnormal d and 0 * inf is NaN; half-to-even because it is the hardware default on both sides
(`cvtps2dq`, CUDA `__float2int_rn` / `rintf`), so neither side emulates the other. The clip never
fires for finite input (|x| <= amax gives |x / d| <= 127 * (1 + 2^-23)); it is there so the
specification is total.

Non-finite activations are refused (ValueError): an inf or NaN would quantize to plausible
integers and the layer would go on with garbage.

The wide form (ActQ16), read by the query/key projections (WIDE_ROLES) of the weight types
llama.cpp reads with Q8_0 activations (WIDE; reads_wide): the same rule with 16-bit integers,
per 32-element block

    d    = amax / 32639                      q = clip(rint(x / d), -32639, 32639)
    hi   = (q + 128) >> 8  (in -127..127)    lo = q - 256 hi  (in -128..127)

held as two int8 ActQ rows per activation row (hi, then lo) with the same d (each its own s16
sums), so every kernel
multiplies each plane exactly as it multiplies 8-bit activations, and

    W x = f32(256) * (W . hi-plane) + (W . lo-plane)        (256 * y exact: one rounding)

Why: with 8 bits per 32 for these types our error against transformers was llama.cpp's within
the prompts' noise (0.97-1.06x on llama.cpp's own files: both engines quantize these activations
alike); 16 bits put it at 0.004-0.28x (docs/conformance.md). 32639 = 127 * 257 is the largest
bound whose q splits into two signed bytes. The planes are combined after the f32 terms, not as
one integer sum, so that the kernels stay the 8-bit ones, bit for bit: the extra rounding
(2^-24 relative) is far below the 16-bit step (2^-15).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numba import njit, prange

from . import simd
from .jit import JIT, cached_njit, cached_row_kernel

F32 = np.float32
QA = 32  # elements per activation block; every weight block size is a multiple of it
Q16 = 32639  # the wide form's integer bound: q = 256 hi + lo with hi, lo signed bytes
# Block types that read the wide form: those whose llama.cpp dot reads activations as Q8_0 (8 bits
# per 32, the same as ours, where the two engines' errors were equal within noise). The K and IQ
# types llama.cpp reads as Q8_K (per 256) stay 8-bit: our 32-element blocks are finer already.
WIDE = frozenset({"Q8_0", "Q4_0", "Q5_0", "Q2_0", "IQ4_NL"})


# ... and of those, only the projections that make the mixers' queries and keys: the Gated
# DeltaNet's in_proj_qkv (q and k are L2-normalised per head and drive the delta rule, which
# amplifies input noise unevenly: the emulation put the whole error gap in this matrix) and
# attention's q/k/v. Every product of the five types in the wide form cost decode 20-24% more CPU
# per token on seed-4l (the token kernels do the integer sums and f32 terms twice); these alone
# cost ~2.8% (docs/conformance.md).
WIDE_ROLES = frozenset({"attn_qkv", "attn_q", "attn_k", "attn_v"})


def is_wide(t) -> bool:
    """Whether GGML type `t` (a GGMLType or its name) can multiply the wide form (the kernels take
    it for these types only)."""
    return getattr(t, "name", t) in WIDE


def reads_wide(t, name: str) -> bool:
    """Whether the weight `name` ("blk.N.ROLE.weight") of type `t` multiplies the wide form."""
    parts = name.split(".")
    return is_wide(t) and len(parts) == 4 and parts[0] == "blk" and parts[2] in WIDE_ROLES


class NonFiniteActivation(ValueError):
    """A NaN/inf met where an activation is quantized: the commands catch it and scan the weights
    (engine/weight_scan.py) to name the tensor, layer and expert it came from."""


@dataclass(frozen=True)
class ActQ:
    """Quantized activations. T = tokens (absent for a single vector), n = features."""

    q: np.ndarray  # int8  [T, n] or [n]
    d: np.ndarray  # f32   [T, n/32] or [n/32]   scale of each 32-block
    s16: np.ndarray  # int32 [T, n/16] or [n/16] sum of q over each 16-element half block:
    # an invariant the kernels rely on (min terms; the VNNI integer dot subtracts 128 * s16)

    @property
    def n(self) -> int:
        return self.q.shape[-1]

    @staticmethod
    def empty(shape: tuple[int, ...]) -> ActQ:
        """Buffers for activations of `shape` ([n] or [T, n]), e.g. quantize_act's `out`."""
        shape = tuple(int(s) for s in shape)
        if len(shape) not in (1, 2) or shape[-1] % QA:
            raise ValueError(f"ActQ.empty: shape must be [n] or [T, n] with n a multiple of {QA}, got {list(shape)}")
        lead = shape[:-1]
        return ActQ(np.empty(shape, np.int8), np.empty(lead + (shape[-1] // QA,), F32), np.empty(lead + (shape[-1] // 16,), np.int32))

    def take(self, rows) -> ActQ:
        """Rows `rows` (an index array) of an ActQ of T rows."""
        return ActQ(self.q[rows], self.d[rows], self.s16[rows])

    def values(self) -> np.ndarray:
        """The activations this ActQ denotes, in float64 (exact)."""
        return (self.q.reshape(self.d.shape + (QA,)) * self.d[..., None].astype(np.float64)).reshape(self.q.shape)


@dataclass(frozen=True)
class ActQ16:
    """Wide (16-bit) activations as int8 planes in one ActQ: `planes` has 2T rows (2 for a single
    vector), row 2t the hi plane of row t, row 2t + 1 its lo plane with the same d, so rows a..b
    of the activations are planes rows 2a..2b, one contiguous block (a group of tokens, a chunk)."""

    planes: ActQ  # q int8 [2T, n]; d f32 [2T, n/32] (rows 2t, 2t + 1 equal); s16 int32 [2T, n/16]
    one: bool  # a single vector: the shapes of values() are [n]

    @property
    def n(self) -> int:
        return self.planes.q.shape[-1]

    @property
    def rows(self) -> int:
        """T: the activation rows (1 for a single vector)."""
        return self.planes.q.shape[0] // 2

    @staticmethod
    def empty(shape: tuple[int, ...]) -> ActQ16:
        shape = tuple(int(s) for s in shape)
        if len(shape) not in (1, 2) or shape[-1] % QA:
            raise ValueError(f"ActQ16.empty: shape must be [n] or [T, n] with n a multiple of {QA}, got {list(shape)}")
        rows = shape[0] if len(shape) == 2 else 1
        return ActQ16(ActQ.empty((2 * rows, shape[-1])), len(shape) == 1)

    def take(self, rows) -> ActQ16:
        """Rows `rows` (an index array) of an ActQ16 of T rows, both planes."""
        rows = np.asarray(rows, np.int64)
        return ActQ16(self.planes.take(np.stack([2 * rows, 2 * rows + 1], axis=1).reshape(-1)), False)

    def row(self, t: int) -> ActQ16:
        """Row t as a single vector (the matvec kernels' form): a view."""
        p = self.planes
        return ActQ16(ActQ(p.q[2 * t : 2 * t + 2], p.d[2 * t : 2 * t + 2], p.s16[2 * t : 2 * t + 2]), True)

    def hi(self) -> ActQ:
        return _plane(self.planes, 0, self.one)

    def lo(self) -> ActQ:
        return _plane(self.planes, 1, self.one)

    def values(self) -> np.ndarray:
        """The activations this ActQ16 denotes, in float64 (exact)."""
        p = self.planes
        q = p.q[0::2].astype(np.int64) * 256 + p.q[1::2]
        v = (q.reshape(self.rows, -1, QA) * p.d[0::2, :, None].astype(np.float64)).reshape(self.rows, -1)
        return v[0] if self.one else v


def _plane(a: ActQ, h: int, one: bool) -> ActQ:
    q, d, s = (np.ascontiguousarray(v[h::2]) for v in (a.q, a.d, a.s16))
    return ActQ(q[0], d[0], s[0]) if one else ActQ(q, d, s)


def _check_shape(x: np.ndarray, where: str) -> np.ndarray:
    x = np.asarray(x)
    if x.dtype != F32:
        raise TypeError(f"{where}: activations must be float32, got {x.dtype}")
    if x.ndim not in (1, 2) or x.shape[-1] % QA:
        raise ValueError(f"{where}: activations must be [n] or [T, n] with n a multiple of {QA}, got shape {x.shape}")
    return x


def _check(x: np.ndarray, where: str) -> np.ndarray:
    x = _check_shape(x, where)
    if not np.isfinite(x).all():
        bad = np.argwhere(~np.isfinite(x))[0]
        raise NonFiniteActivation(f"{where}: non-finite activation {x[tuple(bad)]} at index {tuple(int(i) for i in bad)}")
    return np.ascontiguousarray(x)


def quantize_act_reference(x: np.ndarray, where: str = "quantize_act_reference") -> ActQ:
    """The numpy statement of the specification (module docstring)."""
    x = _check(x, where)
    blocks = x.reshape(x.shape[:-1] + (-1, QA))
    amax = np.abs(blocks).max(axis=-1)
    d = amax / F32(127)
    with np.errstate(divide="ignore", invalid="ignore"):
        r = np.rint(blocks / d[..., None])
    q = np.where(d[..., None] == 0, F32(0), np.clip(r, -127, 127)).astype(np.int8).reshape(x.shape)
    s16 = q.reshape(x.shape[:-1] + (-1, 16)).sum(axis=-1, dtype=np.int32)
    return ActQ(q, d.astype(F32), s16)


def quantize_act16_reference(x: np.ndarray, where: str = "quantize_act16_reference") -> ActQ16:
    """The numpy statement of the wide form (module docstring)."""
    x = _check(x, where)
    x2 = x.reshape(-1, x.shape[-1])
    blocks = x2.reshape(x2.shape[0], -1, QA)
    d = np.abs(blocks).max(axis=-1) / F32(Q16)
    with np.errstate(divide="ignore", invalid="ignore"):
        r = np.rint(blocks / d[..., None])
    q = np.where(d[..., None] == 0, F32(0), np.clip(r, -Q16, Q16)).astype(np.int32).reshape(x2.shape)
    hi = (q + 128) >> 8
    planes = np.stack([hi, q - 256 * hi], axis=1).reshape(-1, x2.shape[1]).astype(np.int8)  # rows hi, lo, hi, lo, ...
    s16 = planes.reshape(planes.shape[0], -1, 16).sum(axis=-1, dtype=np.int32)
    return ActQ16(ActQ(planes, np.repeat(d, 2, axis=0).astype(F32), s16), x.ndim == 1)


_ABS = np.int32(0x7FFFFFFF)  # f32 bits without the sign
_INF = np.int32(0x7F800000)  # bits of +inf: |x|'s bits at or above it are inf or NaN


@njit(inline="always", **JIT)
def quantize_row(x, q, d, s16, t, qa):
    """Row t: x f32 [T, n] -> q int8 [T, n], d f32 [T, n/32], s16 int32 [T, n/16], the specification
    above; returns the index in the row of its first non-finite x, or -1. qa = QA, passed at run
    time (with the literal 32 LLVM unrolled the block loops before its vectorizer ran and they
    stayed scalar; with a run-time count all three vectorize: 4.7x faster, 256 x 2560 in 0.16 ms
    instead of 0.75). The building block of every CPU ActQ: a Numba kernel that makes activations
    row by row (hyper.py's norm) quantizes each row with it while the row is in cache."""
    xb = x.view(np.int32)
    half = qa // 2
    for b in range(x.shape[1] // qa):
        o = b * qa
        # amax on the bit patterns: for finite values |x| orders as its bits do, and an
        # integer max vectorizes where a float max does not (NaN rules)
        m = np.int32(0)
        for j in range(qa):
            m = max(m, xb[t, o + j] & _ABS)
        if m >= _INF:
            for j in range(qa):
                if xb[t, o + j] & _ABS >= _INF:
                    return o + j
        db = simd.f32_from_bits(m) / F32(127)
        d[t, b] = db
        # d = 0 only when amax / 127 is 0: then every |x| < 1 and x / 1 rounds to 0, the
        # specification's q = 0, without a branch in the loop
        div = db if db != F32(0) else F32(1)
        for j in range(qa):
            q[t, o + j] = np.int8(min(max(np.rint(x[t, o + j] / div), F32(-127)), F32(127)))
    # the sums in a pass of their own: read right after the block's vector stores, q stalled on
    # store forwarding (1.4x slower)
    for h in range(s16.shape[1]):
        s = np.int32(0)
        for j in range(half):
            s += np.int32(q[t, h * half + j])
        s16[t, h] = s
    return -1


@cached_row_kernel("quantize_rows")
def _quantize_rows(x, q, d, s16, qa):
    # x f32 [T, n] -> q, d, s16 (quantize_row, row by row, the rows across the threads). Returns
    # the flat index of the first non-finite x, or -1: checked here, in the same pass, so that no
    # temporary the size of x is made (np.isfinite's)
    T = x.shape[0]
    bads = np.empty(T, np.int64)
    for t in prange(T):
        bads[t] = quantize_row(x, q, d, s16, t, qa)
    for t in range(T):
        if bads[t] >= 0:
            return t * x.shape[1] + bads[t]
    return -1


@cached_njit("quantize_rows16")
def _quantize_rows16(x, q, d, s16, qa):
    # x f32 [T, n] -> the wide planes q int8 [2T, n], d f32 [2T, n/32], s16 int32 [2T, n/16]
    # (row 2t: row t's hi plane, 2t + 1 its lo plane); quantize_row's steps with the bound Q16. Returns the flat index of
    # the first non-finite x, or -1. qa = QA at run time (quantize_row says why).
    T, n = x.shape
    xb = x.view(np.int32)
    half = qa // 2
    for t in range(T):
        for b in range(n // qa):
            o = b * qa
            m = np.int32(0)
            for j in range(qa):
                m = max(m, xb[t, o + j] & _ABS)
            if m >= _INF:
                for j in range(qa):
                    if xb[t, o + j] & _ABS >= _INF:
                        return t * n + o + j
            db = simd.f32_from_bits(m) / F32(Q16)
            d[2 * t, b] = db
            d[2 * t + 1, b] = db
            div = db if db != F32(0) else F32(1)
            for j in range(qa):
                v = np.int32(min(max(np.rint(x[t, o + j] / div), F32(-Q16)), F32(Q16)))
                h = (v + np.int32(128)) >> np.int32(8)
                q[2 * t, o + j] = np.int8(h)
                q[2 * t + 1, o + j] = np.int8(v - np.int32(256) * h)
    for r in range(2 * T):
        for h in range(s16.shape[1]):
            s = np.int32(0)
            for j in range(half):
                s += np.int32(q[r, h * half + j])
            s16[r, h] = s
    return -1


def quantize_act16(x: np.ndarray, where: str = "quantize_act16", out: ActQ16 | None = None) -> ActQ16:
    """The wide form of f32 activations [n] or [T, n] (Numba; bit-identical to
    quantize_act16_reference). out: an ActQ16 of the same shape (ActQ16.empty) to fill."""
    x = _check_shape(x, where)
    if out is None:
        out = ActQ16.empty(x.shape)
    elif not isinstance(out, ActQ16) or out.one != (x.ndim == 1):
        raise TypeError(f"{where}: out must be an ActQ16 (ActQ16.empty({list(x.shape)})), got {type(out).__name__}")
    x2 = np.ascontiguousarray(x).reshape(-1, x.shape[-1])
    _check_out(out.planes, (2 * x2.shape[0], x2.shape[1]), where)
    bad = _quantize_rows16(x2, out.planes.q, out.planes.d, out.planes.s16, QA)
    if bad >= 0:
        at = np.unravel_index(bad, x.shape)
        raise NonFiniteActivation(f"{where}: non-finite activation {x[at]} at index {tuple(int(i) for i in at)}")
    return out


def combine16(planes_out: np.ndarray, out: np.ndarray) -> np.ndarray:
    """out [T, n_out] = f32(256) * planes_out[2t] + planes_out[2t + 1]: a product of the wide form
    from the products of its planes (planes_out [2T, n_out] f32). 256 y is exact, so the one
    rounding is the add's, on every backend (an FMA gives the same bits)."""
    np.multiply(planes_out[0::2], F32(256), out=out)
    return np.add(out, planes_out[1::2], out=out)


def _check_out(out, shape: tuple[int, ...], where: str) -> ActQ:
    if not isinstance(out, ActQ):
        raise TypeError(f"{where}: out must be an ActQ (ActQ.empty({list(shape)})), got {type(out).__name__}")
    want = ((out.q, np.int8, shape), (out.d, F32, shape[:-1] + (shape[-1] // QA,)), (out.s16, np.int32, shape[:-1] + (shape[-1] // 16,)))
    for name, (a, dt, shp) in zip(("q", "d", "s16"), want):
        if not (isinstance(a, np.ndarray) and a.dtype == dt and a.shape == shp and a.flags.c_contiguous and a.flags.writeable):
            raise ValueError(f"{where}: out.{name} must be a writable contiguous {np.dtype(dt).name} array of shape {list(shp)} "
                             f"for activations of shape {list(shape)}, got {getattr(a, 'dtype', type(a))}{list(getattr(a, 'shape', []))}")
    return out


def quantize_act(x: np.ndarray, where: str = "quantize_act", out: ActQ | None = None) -> ActQ:
    """Quantize f32 activations [n] or [T, n] (Numba; bit-identical to quantize_act_reference).

    out: an ActQ of the same shape (ActQ.empty) to fill in place and return; with it, and x
    contiguous, the call allocates no array (the token path, S12)."""
    if out is None and type(x) is np.ndarray and x.ndim == 2 and x.shape[0] == 1 and x.dtype == F32 \
            and x.flags.c_contiguous and x.shape[1] % QA == 0:
        # one token's row, as every product of a decode step quantizes it: the same kernel (the serial
        # one, as below for one row) without the general path's checks and reshapes (5.9 -> 2.8 us a
        # call on the 2-core VM, ~30-60 calls a token)
        n = x.shape[1]
        res = ActQ(np.empty((1, n), np.int8), np.empty((1, n // QA), F32), np.empty((1, n // 16), np.int32))
        bad = _quantize_rows.serial(x, res.q, res.d, res.s16, QA)
    else:
        x = _check_shape(x, where)
        res = ActQ.empty(x.shape) if out is None else _check_out(out, x.shape, where)
        x2 = np.ascontiguousarray(x).reshape(-1, x.shape[-1])
        T, n = x2.shape
        bad = _quantize_rows(x2, res.q.reshape(T, n), res.d.reshape(T, -1), res.s16.reshape(T, -1), QA)
    if bad >= 0:
        at = np.unravel_index(bad, x.shape)
        raise NonFiniteActivation(f"{where}: non-finite activation {x[at]} at index {tuple(int(i) for i in at)}")
    return res

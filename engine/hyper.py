"""qwen4exp hyper-connections: hc residual streams in place of layer norms.

transformers' `Qwen4ExpTextGatedResidual` (ground truth), with the weights as llama.cpp's converter
stores them (docs/gguf-layout.md): the grouped norm gain is folded as (1 + w), so it multiplies
directly. One instance serves one of `blk.N.hc_attn`, `blk.N.hc_ffn` or the final `output_hc`:

    S  = hc streams, f32[hc*E] (stream c = S[c*E:(c+1)*E]); the token's embedding repeated hc times
    Sn = grouped_rmsnorm(S, *_norm)                    each E-group normalised on its own
    m  = sigmoid(up(silu(down(Sn) / hc)))              f32[hc*E], low rank R in the middle
    x  = mean_c (m * Sn)[c]                            f32[E]: the block's input
    w  = 2 * sigmoid(inject(Sn) / hc)                  f32[hc] (absent for output_hc)
    S' = S + w[c] * block(x) on every stream c         S, not Sn, carries the residual

The final mixer (`output_hc`, no inject) gives the LM head its input; qwen4exp has no output_norm.

One forward for any T: `mix` and `inject` take the streams of T tokens, f32 [T, hc*E] (T = 1 is the
decode step). The norms are `ops.rmsnorm` with f32 sums and the sigmoids `ops.sigmoid`'s exp form,
the rounding these components were matched to (ops.rmsnorm says why).

Shapes: E = n_embd, hc = streams, R = hc_lowrank, T = tokens. Matrices are engine `Weight`s (GGUF
shape (n_in, n_out)); `as_linear` makes one from a numpy [n_out, n_in] array (torch orientation),
which the tests use.
"""

from __future__ import annotations

from typing import Mapping

import numpy as np
from numba import prange

from strata.index_format.geometry import ModelGeometry

from .kernels.actq import QA, ActQ, NonFiniteActivation, quantize_row
from .kernels.jit import cached_njit, cached_row_kernel
from .ops import rmsnorm
from .ops import sigmoid as ops_sigmoid
from .pack_reader import PackError
from .weights import Input, Weight

F32 = np.float32
# a component's tensors: the pack's weight table (Weight), or numpy arrays in torch orientation (the tests)
Tensor = Weight | np.ndarray


def as_linear(obj: Tensor, name: str, n_in: int, n_out: int) -> Weight:
    """The Weight `name` of GGUF shape (n_in, n_out); a numpy [n_out, n_in] array (torch orientation)
    becomes an F32 Weight of its values."""
    if isinstance(obj, np.ndarray):
        if obj.shape != (n_out, n_in):
            raise PackError(f"{name}: array shape {obj.shape}, expected [n_out, n_in] = {(n_out, n_in)}")
        raw = np.ascontiguousarray(obj, dtype=F32).reshape(-1).view(np.uint8)
        return Weight(name, (n_in, n_out), 0, raw)  # type 0: F32
    if not isinstance(obj, Weight):
        raise PackError(f"{name}: {type(obj).__name__} is not a weight")
    if tuple(obj.shape) != (n_in, n_out):
        raise PackError(f"{name}: shape {tuple(obj.shape)}, expected GGUF (n_in, n_out) = {(n_in, n_out)}")
    return obj


def as_f32(obj: Tensor, name: str, shape: tuple[int, ...]) -> np.ndarray:
    """A small tensor as a contiguous f32 array of `shape` (numpy order, i.e. GGUF shape reversed)."""
    arr = obj if isinstance(obj, np.ndarray) else obj.f32()
    if arr.shape != shape:
        raise PackError(f"{name}: shape {arr.shape}, expected {shape} (numpy order, GGUF reversed)")
    return np.ascontiguousarray(arr, dtype=F32)


def take(tensors: Mapping[str, Tensor], name: str) -> Tensor:
    if name not in tensors:
        raise PackError(f"tensor {name} is missing")
    return tensors[name]


def grouped_rmsnorm(x: np.ndarray, gain: np.ndarray, group: int, eps: float) -> np.ndarray:
    """RMSNorm of every `group`-long slice of the last axis (gain the stored 1 + w), with the f32
    sums these components were matched to: ops.rmsnorm, named for its use here."""
    return rmsnorm(x, gain, eps, group=group, f32_sums=True)


def grouped_rmsnorm_q(x: np.ndarray, gain: np.ndarray, group: int, eps: float) -> tuple[np.ndarray, ActQ]:
    """grouped_rmsnorm of rows x f32 [T, n] and its ActQ, each row quantized as it is written (the
    same bits as quantize_act of the result: actq.quantize_row is its code); the means of squares
    stay numpy's (pairwise sums, which a Numba loop did not vectorize)."""
    T, n = x.shape
    out = np.square(x)
    # np.mean's own sum (add.reduce, pairwise), the rest of the mean and of the norm's factor in
    # the kernel (np.mean, the add and the root were 8-10 numpy calls a mix of a token)
    sums = np.add.reduce(out.reshape(T, -1, group), axis=-1, dtype=F32)  # [T, n / group]
    act = ActQ.empty(x.shape)
    bad = _scale_quantize(x, sums, F32(eps), gain, out, act.q, act.d, act.s16, QA)
    if bad >= 0:
        at = np.unravel_index(bad, x.shape)
        raise NonFiniteActivation(f"grouped_rmsnorm_q: non-finite activation {out[at]} at index {tuple(int(i) for i in at)}")
    return out, act


@cached_row_kernel("grouped-rmsnorm-q")
def _scale_quantize(x, sums, eps, gain, out, q, d, s16, qa):
    # r = 1 / sqrt(mean + eps) from the f32 sums of squares, as grouped_rmsnorm makes it: np.mean
    # divides its f32 sum by an intp count, i.e. in float64, rounded to f32; then the f32 add,
    # root and division. Then out = (x r) gain, grouped_rmsnorm's last two steps, and the row's
    # ActQ while it is in cache: one pass where numpy's two and quantize_act's read made three
    # over a [T, 10240] chunk. The rows across the threads (jit.RowKernel)
    T, n = x.shape
    group = n // sums.shape[1]
    bads = np.empty(T, np.int64)
    for t in prange(T):
        for g in range(sums.shape[1]):
            mean = F32(np.float64(sums[t, g]) / np.float64(group))
            rg = F32(1) / np.sqrt(mean + eps)
            o = g * group
            for i in range(group):  # from 0: a loop from g * group did not vectorize (10x slower)
                out[t, o + i] = (x[t, o + i] * rg) * gain[o + i]
        bads[t] = quantize_row(out, q, d, s16, t, qa)
    for t in range(T):
        if bads[t] >= 0:
            return t * n + bads[t]
    return -1


def sigmoid(x: np.ndarray) -> np.ndarray:
    """1 / (1 + exp(-x)): ops.sigmoid's exp form, the one these components were matched to."""
    return ops_sigmoid(x, exp_form=True)


def silu(x: np.ndarray) -> np.ndarray:
    return x * sigmoid(x)


def streams_from_embedding(x: np.ndarray, hc: int) -> np.ndarray:
    """The hc streams a token starts with: its embedding, repeated (transformers `.repeat(1, 1, hc)`)."""
    return np.tile(np.asarray(x, dtype=F32), hc)


class HyperConnection:
    """One hyper-connection: `mix` before a block, `inject` after it (no inject for output_hc)."""

    def __init__(self, name: str, norm: Tensor, down: Tensor, up: Tensor, inject: Tensor | None,
                 *, hc: int, n_embd: int, lowrank: int, eps: float):
        HE = hc * n_embd
        self.name, self.hc, self.n_embd, self.eps = name, hc, n_embd, eps
        self.norm = as_f32(norm, f"{name}_norm.weight", (HE,))
        self.down = as_linear(down, f"{name}_down.weight", HE, lowrank)
        self.up = as_linear(up, f"{name}_up.weight", lowrank, HE)
        self.inject_w = None if inject is None else as_linear(inject, f"{name}_inject.weight", HE, hc)

    @classmethod
    def from_tensors(cls, tensors: Mapping[str, Tensor], prefix: str, geometry: ModelGeometry, *, inject: bool = True):
        """`prefix` is `blk.N.hc_attn`, `blk.N.hc_ffn` or `output_hc`; tensors maps GGUF names."""
        g = geometry
        if not g.hc or not g.hc_lowrank:
            raise PackError(f"{prefix}: the geometry has no hyper-connections (hc {g.hc}, low rank {g.hc_lowrank})")
        return cls(prefix, take(tensors, f"{prefix}_norm.weight"), take(tensors, f"{prefix}_down.weight"),
                   take(tensors, f"{prefix}_up.weight"),
                   take(tensors, f"{prefix}_inject.weight") if inject else None,
                   hc=g.hc, n_embd=g.n_embd, lowrank=g.hc_lowrank, eps=g.rms_eps)

    def _check(self, s: np.ndarray) -> None:
        want = self.hc * self.n_embd
        if s.ndim != 2 or s.shape[-1] != want:
            raise ValueError(f"{self.name}: streams of shape {s.shape}, expected [T, {want}]")

    def mix(self, be, streams: np.ndarray) -> tuple[Input, np.ndarray | None]:
        """streams f32 [T, hc*E] -> (the block input, an Input of [T, E]; injection weights f32 [T, hc]
        or None)."""
        self._check(streams)
        T = streams.shape[0]
        # a block-type `down` reads sn as ActQ: made with sn, in the same pass
        if self.down.type.quantized:
            sn, act = be.rmsnorm_q(streams, self.norm, self.n_embd, self.eps)
            sn_in = Input(sn, act)
        else:
            sn = be.rmsnorm(streams, self.norm, self.eps, group=self.n_embd, f32_sums=True)
            sn_in = Input(sn)
        sc = be.scratch  # the token step's buffers, reused (the same values as new arrays)
        R = self.down.n_out
        if self.inject_w is None:
            d, inj = be.linear(self.down, sn_in, sc("hc.d", (T, R))), None
        else:  # down and inject both read sn: one parallel region for a token (backend.linears, the same bits)
            d, inj = be.linears((self.down, self.inject_w), sn_in, (sc("hc.d", (T, R)), sc("hc.inj", (T, self.hc))))
        a, w = be.lowrank_gates_input(d, inj, self.hc, self.up)
        u = be.linear(self.up, a, sc("hc.u", (T, self.hc * self.n_embd)))
        x = be.mix_tail(u, sn, sc("hc.x", (T, self.n_embd)))
        return Input(x), w

    def inject(self, be, streams: np.ndarray, block_out: np.ndarray, w: np.ndarray) -> None:
        """In place: stream c of token t += w[t, c] * block_out[t]."""
        self._check(streams)
        T = streams.shape[0]
        for name, a, shape in (("block output", block_out, (T, self.n_embd)), ("injection weights", w, (T, self.hc))):
            if a.shape != shape or a.dtype != F32:
                raise ValueError(f"{self.name}: {name} {a.dtype}{list(a.shape)}, expected float32{list(shape)}")
        be.inject(streams, block_out, w)


def lowrank_gates_reference(d: np.ndarray, inj: np.ndarray | None, hc: int) -> tuple[np.ndarray, np.ndarray | None]:
    """(silu(d / hc), 2 sigmoid(inj / hc)) of down's and inject's outputs: `mix`'s steps between
    its products for T rows (sigmoid: the exp form), new arrays."""
    d = d / F32(hc)
    w = None if inj is None else 2 * sigmoid(inj / F32(hc))
    return d * sigmoid(d), w


def lowrank_gates(d: np.ndarray, inj: np.ndarray | None, hc: F32, a: np.ndarray, w: np.ndarray | None,
                  ex: np.ndarray, exw: np.ndarray | None) -> None:
    """lowrank_gates_reference into a and w (inj and w None: output_hc), with ex and exw buffers of
    d's and inj's shapes; d and inj are overwritten. The exp is numpy's, one call per array as the
    reference makes it (its SIMD exp is not libm's, which a Numba loop would call)."""
    _scale_neg(d, hc, ex)
    np.exp(ex, out=ex)
    if inj is not None:
        _scale_neg(inj, hc, exw)
        np.exp(exw, out=exw)
        _inject_weights(exw, w)
    _silu_from_exp(d, ex, a)


@cached_njit("hc-scale-neg")
def _scale_neg(x, hc, neg):
    # x /= hc (f32), neg = -x: the reference's division and sigmoid's negation (exact)
    x = x.reshape(-1)
    neg = neg.reshape(-1)
    for i in range(x.size):
        x[i] = x[i] / hc
        neg[i] = -x[i]


@cached_njit("hc-silu-from-exp")
def _silu_from_exp(d, ex, a):
    # sigmoid's last steps from ex = exp(-d): 1 / (ex + 1) in f32, then d times it (the reference's
    # d * sigmoid(d))
    d, ex, a = d.reshape(-1), ex.reshape(-1), a.reshape(-1)
    for i in range(d.size):
        a[i] = d[i] * (F32(1) / (ex[i] + F32(1)))


@cached_njit("hc-inject-weights")
def _inject_weights(ex, w):
    # 2 sigmoid from ex = exp(-x): 2 (1 / (ex + 1)), each step f32
    ex, w = ex.reshape(-1), w.reshape(-1)
    for i in range(ex.size):
        w[i] = F32(2) * (F32(1) / (ex[i] + F32(1)))


def mix_tail_reference(u: np.ndarray, sn: np.ndarray, hc: int) -> np.ndarray:
    """mean_c (sigmoid(u) sn)[c] -> f32 [T, E]: `mix`'s last step for T rows (u, sn f32 [T, hc*E])."""
    return (sigmoid(u) * sn).reshape(u.shape[0], hc, -1).mean(axis=1, dtype=F32)


def mix_tail(u: np.ndarray, sn: np.ndarray, out: np.ndarray) -> np.ndarray:
    """mix_tail_reference into out (f32 [T, E]) -> out; u, this call's own product, is overwritten."""
    _mix_tail(np.exp(np.negative(u, out=u), out=u), sn, out)  # numpy's exp: the one transcendental step
    return out


@cached_row_kernel("hc-mix-tail")
def _mix_tail(ex, sn, out):
    # mix_tail_reference from ex = exp(-u) (numpy's exp, the one transcendental step) in one pass,
    # where numpy made four [T, hc E] passes. The same f32 steps: 1 / (ex + 1), times sn, summed
    # over the streams in order from 0 (numpy's reduction over a middle axis), divided by hc in
    # float64 (np.mean divides by an intp count) and rounded to f32.
    T, E = out.shape
    hc = ex.shape[1] // E
    for t in prange(T):
        out[t] = F32(0)
        for c in range(hc):
            for e in range(E):
                out[t, e] += (F32(1) / (ex[t, c * E + e] + F32(1))) * sn[t, c * E + e]
        for e in range(E):
            out[t, e] = F32(np.float64(out[t, e]) / np.float64(hc))


def inject_reference(streams: np.ndarray, block_out: np.ndarray, w: np.ndarray) -> None:
    """streams f32 [T, hc*E] += w [T, hc] (x) block_out [T, E], per stream: what _inject computes."""
    T, hc = w.shape
    streams.reshape(T, hc, -1)[...] += w[:, :, None] * block_out[:, None, :]


def inject(streams: np.ndarray, y: np.ndarray, w: np.ndarray) -> None:
    """inject_reference, in place."""
    _inject(streams, y, w)


@cached_row_kernel("hc-inject")
def _inject(streams, y, w):
    # inject_reference without its [T, hc, E] product temporary (10 MB a 256-token chunk at
    # production widths): the same f32 product, then the same f32 add (no FMA: fastmath off)
    T, hc = w.shape
    E = y.shape[1]
    for t in prange(T):
        for c in range(hc):
            wc = w[t, c]
            for e in range(E):
                streams[t, c * E + e] += wc * y[t, e]

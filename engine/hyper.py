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

Shapes: E = n_embd, hc = streams, R = hc_lowrank, T = tokens. Matrices are anything with
`.matvec(x[n_in]) -> [n_out]`, `.matmul(X[T, n_in]) -> [T, n_out]` and `.shape` in GGUF order
(n_in, n_out); `F32Linear` wraps a numpy [n_out, n_in] array (torch orientation) that way.
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from .kernels.actq import QA, ActQ, NonFiniteActivation, quantize_row
from .kernels.jit import cached_njit
from .weights import Input, Weight

F32 = np.float32


class ComponentError(ValueError):
    """A qwen4exp component got a tensor or state it cannot use (names the tensor, found, expected)."""


class F32Linear:
    """A small f32 matrix with the engine's weight interface. `w` is [n_out, n_in] (torch orientation)."""

    def __init__(self, w: np.ndarray, name: str = "f32 matrix"):
        if w.ndim != 2:
            raise ComponentError(f"{name}: expected a 2-D matrix, found shape {w.shape}")
        self.name = name
        self.w = np.ascontiguousarray(w, dtype=F32)
        self.shape = (self.w.shape[1], self.w.shape[0])  # GGUF order: (n_in, n_out)

    def matvec(self, x: np.ndarray) -> np.ndarray:
        return self.w @ x

    def matmul(self, x: np.ndarray) -> np.ndarray:
        return x @ self.w.T

    def f32(self) -> np.ndarray:
        return self.w


def as_linear(obj: Any, name: str, n_in: int, n_out: int) -> Any:
    """A numpy [n_out, n_in] array becomes an F32Linear; a weight object must have GGUF shape (n_in, n_out)."""
    if isinstance(obj, np.ndarray):
        if obj.shape != (n_out, n_in):
            raise ComponentError(f"{name}: array shape {obj.shape}, expected [n_out, n_in] = {(n_out, n_in)}")
        return F32Linear(obj, name)
    if not (hasattr(obj, "matvec") and hasattr(obj, "matmul")):
        raise ComponentError(f"{name}: {type(obj).__name__} has no matvec/matmul")
    if tuple(obj.shape) != (n_in, n_out):
        raise ComponentError(f"{name}: shape {tuple(obj.shape)}, expected GGUF (n_in, n_out) = {(n_in, n_out)}")
    return obj


def as_f32(obj: Any, name: str, shape: tuple[int, ...]) -> np.ndarray:
    """A small tensor as a contiguous f32 array of `shape` (numpy order, i.e. GGUF shape reversed)."""
    arr = obj if isinstance(obj, np.ndarray) else obj.f32()
    if arr.shape != shape:
        raise ComponentError(f"{name}: shape {arr.shape}, expected {shape} (numpy order, GGUF reversed)")
    return np.ascontiguousarray(arr, dtype=F32)


def take(tensors: Mapping[str, Any], name: str) -> Any:
    if name not in tensors:
        raise ComponentError(f"tensor {name} is missing")
    return tensors[name]


def grouped_rmsnorm(x: np.ndarray, gain: np.ndarray, group: int, eps: float) -> np.ndarray:
    """RMSNorm of every `group`-long slice of the last axis; `gain` is the stored (1 + w)."""
    g = x.reshape(*x.shape[:-1], -1, group)
    out = np.square(g)  # the squares, then (g r) gain: one buffer for every step
    r = 1.0 / np.sqrt(np.mean(out, axis=-1, keepdims=True, dtype=F32) + F32(eps))
    np.multiply(g, r, out=out)
    out = out.reshape(x.shape)
    out *= gain
    return out


def grouped_rmsnorm_q(x: np.ndarray, gain: np.ndarray, group: int, eps: float) -> tuple[np.ndarray, ActQ]:
    """grouped_rmsnorm of rows x f32 [T, n] and its ActQ, each row quantized as it is written (the
    same bits as quantize_act of the result: actq.quantize_row is its code); the means of squares
    stay numpy's (pairwise sums, which a Numba loop did not vectorize)."""
    T, n = x.shape
    out = np.square(x)
    r = 1.0 / np.sqrt(np.mean(out.reshape(T, -1, group), axis=-1, dtype=F32) + F32(eps))  # [T, n / group]
    act = ActQ.empty(x.shape)
    bad = _scale_quantize(x, r, gain, out, act.q, act.d, act.s16, QA)
    if bad >= 0:
        at = np.unravel_index(bad, x.shape)
        raise NonFiniteActivation(f"grouped_rmsnorm_q: non-finite activation {out[at]} at index {tuple(int(i) for i in at)}")
    return out, act


@cached_njit("grouped-rmsnorm-q")
def _scale_quantize(x, r, gain, out, q, d, s16, qa):
    # out = (x r) gain, grouped_rmsnorm's last two steps, then the row's ActQ while it is in cache:
    # one pass where numpy's two and quantize_act's read made three over a [T, 10240] chunk
    T, n = x.shape
    group = n // r.shape[1]
    for t in range(T):
        for g in range(r.shape[1]):
            rg = r[t, g]
            o = g * group
            for i in range(group):  # from 0: a loop from g * group did not vectorize (10x slower)
                out[t, o + i] = (x[t, o + i] * rg) * gain[o + i]
        bad = quantize_row(out, q, d, s16, t, qa)
        if bad >= 0:
            return t * n + bad
    return -1


def sigmoid(x: np.ndarray) -> np.ndarray:
    """1 / (1 + exp(-x)), its steps in one buffer."""
    out = np.negative(x)
    np.exp(out, out=out)
    out += 1.0
    return np.divide(1.0, out, out=out)


def silu(x: np.ndarray) -> np.ndarray:
    return x * sigmoid(x)


def streams_from_embedding(x: np.ndarray, hc: int) -> np.ndarray:
    """The hc streams a token starts with: its embedding, repeated (transformers `.repeat(1, 1, hc)`)."""
    return np.tile(np.asarray(x, dtype=F32), hc)


class HyperConnection:
    """One hyper-connection: `mix` before a block, `inject` after it (no inject for output_hc)."""

    def __init__(self, name: str, norm: np.ndarray, down: Any, up: Any, inject: Any | None,
                 *, hc: int, n_embd: int, lowrank: int, eps: float):
        HE = hc * n_embd
        self.name, self.hc, self.n_embd, self.eps = name, hc, n_embd, eps
        self.norm = as_f32(norm, f"{name}_norm.weight", (HE,))
        self.down = as_linear(down, f"{name}_down.weight", HE, lowrank)
        self.up = as_linear(up, f"{name}_up.weight", lowrank, HE)
        self.inject_w = None if inject is None else as_linear(inject, f"{name}_inject.weight", HE, hc)

    @classmethod
    def from_tensors(cls, tensors: Mapping[str, Any], prefix: str, geometry: Any, *, inject: bool = True):
        """`prefix` is `blk.N.hc_attn`, `blk.N.hc_ffn` or `output_hc`; tensors maps GGUF names."""
        g = geometry
        if not g.hc or not g.hc_lowrank:
            raise ComponentError(f"{prefix}: the geometry has no hyper-connections (hc {g.hc}, low rank {g.hc_lowrank})")
        return cls(prefix, take(tensors, f"{prefix}_norm.weight"), take(tensors, f"{prefix}_down.weight"),
                   take(tensors, f"{prefix}_up.weight"),
                   take(tensors, f"{prefix}_inject.weight") if inject else None,
                   hc=g.hc, n_embd=g.n_embd, lowrank=g.hc_lowrank, eps=g.rms_eps)

    def _check(self, s: np.ndarray, rows: bool) -> None:
        want = self.hc * self.n_embd
        if s.shape[-1] != want or s.ndim != (2 if rows else 1):
            raise ComponentError(f"{self.name}: streams of shape {s.shape}, expected {'[T, ' if rows else '['}{want}]")

    def mix(self, streams: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
        """streams f32[hc*E] -> (block input f32[E], injection weights f32[hc] or None)."""
        self._check(streams, rows=False)
        sn = grouped_rmsnorm(streams, self.norm, self.n_embd, self.eps)
        m = sigmoid(self.up.matvec(silu(self.down.matvec(sn) / F32(self.hc))))
        x = (m * sn).reshape(self.hc, self.n_embd).mean(axis=0, dtype=F32)
        if self.inject_w is None:
            return x, None
        return x, 2 * sigmoid(self.inject_w.matvec(sn) / F32(self.hc))

    def inject(self, streams: np.ndarray, block_out: np.ndarray, w: np.ndarray) -> None:
        """In place: stream c += w[c] * block_out."""
        streams.reshape(self.hc, self.n_embd)[...] += w[:, None] * block_out[None, :]

    def mix_many(self, streams: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
        """streams f32[T, hc*E] -> (f32[T, E], f32[T, hc] or None); the batched `mix`."""
        self._check(streams, rows=True)
        T = streams.shape[0]
        # a block-type `down` reads sn as ActQ: made with sn, in the same pass
        if isinstance(self.down, Weight) and self.down.type.quantized:
            sn, act = grouped_rmsnorm_q(streams, self.norm, self.n_embd, self.eps)
            u = self.up.matmul(silu(self.down.matmul(Input(sn, act)) / F32(self.hc)))
        else:
            sn = grouped_rmsnorm(streams, self.norm, self.n_embd, self.eps)
            u = self.up.matmul(silu(self.down.matmul(sn) / F32(self.hc)))
        ex = np.exp(np.negative(u, out=u), out=u)  # u is this call's own product
        x = np.empty((T, self.n_embd), F32)
        _mix_tail(ex, sn, x)
        if self.inject_w is None:
            return x, None
        return x, 2 * sigmoid(self.inject_w.matmul(sn) / F32(self.hc))

    def inject_many(self, streams: np.ndarray, block_out: np.ndarray, w: np.ndarray) -> None:
        """In place: stream c of token t += w[t, c] * block_out[t]; the batched `inject`."""
        self._check(streams, rows=True)
        T = streams.shape[0]
        for name, a, shape in (("block output", block_out, (T, self.n_embd)), ("injection weights", w, (T, self.hc))):
            if a.shape != shape or a.dtype != F32:
                raise ComponentError(f"{self.name}: {name} {a.dtype}{list(a.shape)}, expected float32{list(shape)}")
        _inject(streams, block_out, w)


def mix_tail_reference(u: np.ndarray, sn: np.ndarray, hc: int) -> np.ndarray:
    """mean_c (sigmoid(u) sn)[c] -> f32 [T, E]: `mix`'s last step for T rows (u, sn f32 [T, hc*E])."""
    return (sigmoid(u) * sn).reshape(u.shape[0], hc, -1).mean(axis=1, dtype=F32)


@cached_njit("hc-mix-tail")
def _mix_tail(ex, sn, out):
    # mix_tail_reference from ex = exp(-u) (numpy's exp, the one transcendental step) in one pass,
    # where numpy made four [T, hc E] passes. The same f32 steps: 1 / (ex + 1), times sn, summed
    # over the streams in order from 0 (numpy's reduction over a middle axis), divided by hc in
    # float64 (np.mean divides by an intp count) and rounded to f32.
    T, E = out.shape
    hc = ex.shape[1] // E
    for t in range(T):
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


@cached_njit("hc-inject")
def _inject(streams, y, w):
    # inject_reference without its [T, hc, E] product temporary (10 MB a 256-token chunk at
    # production widths): the same f32 product, then the same f32 add (no FMA: fastmath off)
    T, hc = w.shape
    E = y.shape[1]
    for t in range(T):
        for c in range(hc):
            wc = w[t, c]
            for e in range(E):
                streams[t, c * E + e] += wc * y[t, e]

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
    r = 1.0 / np.sqrt(np.mean(g * g, axis=-1, keepdims=True, dtype=F32) + F32(eps))
    return (g * r).reshape(x.shape) * gain


def sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


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
        sn = grouped_rmsnorm(streams, self.norm, self.n_embd, self.eps)
        m = sigmoid(self.up.matmul(silu(self.down.matmul(sn) / F32(self.hc))))
        x = (m * sn).reshape(T, self.hc, self.n_embd).mean(axis=1, dtype=F32)
        if self.inject_w is None:
            return x, None
        return x, 2 * sigmoid(self.inject_w.matmul(sn) / F32(self.hc))

    def inject_many(self, streams: np.ndarray, block_out: np.ndarray, w: np.ndarray) -> None:
        T = streams.shape[0]
        streams.reshape(T, self.hc, self.n_embd)[...] += w[:, :, None] * block_out[:, None, :]

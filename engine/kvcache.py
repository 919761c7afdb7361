"""The KV cache of one full-attention layer: K and V for max_context tokens, in one of three kinds.

    f32   exact: what the float64 reference tests run with
    f16   K and V rounded to half precision (the default; llama.cpp's default too)
    int8  per 32 elements of one head of one token: an f32 scale d and 32 int8 values q, x ~ q d

The layout and the bytes per token (`kv_bytes_per_token`) live here, beside the arrays they
describe; strata-budget's plan (engine/budget.py) sizes the session from them, so it predicts
exactly what this allocates. A block never straddles two heads, so a head dequantizes alone. The
int8 rounding is ActQ's rule (engine/kernels/actq.py): d = amax / 127, q = rint(x / d) half to
even, q = 0 when d = 0, so the error of an element is at most d / 2.

Storage is head-major, [Hkv, C, D] (C = max_context): a head's first n positions are contiguous,
which is what attention reads; a token's write touches Hkv short rows. Reads return f32 copies
(or, for f32, views): attention always computes in f32.
"""

from __future__ import annotations

import numpy as np

from .kernels.actq import QA, quantize_act

KV_TYPES = ("f16", "int8", "f32")  # --kv; f32: the exact cache the CPU engine's reference tests run with
KV_BLOCK = QA  # int8: one f32 scale per 32 elements of one head of one token, ActQ's block
F32 = np.float32
_STORE = {"f32": np.float32, "f16": np.float16, "int8": np.int8}


class ContextFull(RuntimeError):
    """A token past the session's max_context: the caches are sized once, never grown (--ctx-size)."""


def check_kv(kind: str, head_dim: int) -> None:
    """--kv `kind` for heads of `head_dim`: a known kind, and for int8 whole blocks per head."""
    if kind not in KV_TYPES:
        raise ValueError(f"--kv {kind!r}: expected one of {', '.join(KV_TYPES)}")
    if kind == "int8" and head_dim % KV_BLOCK:
        raise ValueError(f"--kv int8: head_dim {head_dim} is not a multiple of the {KV_BLOCK}-element KV block; "
                         "use --kv f16")


def kv_bytes_per_token(g, kind: str) -> int:
    """K and V of one token in one full-attention layer of geometry `g` (n_head_kv, head_dim): 2 or 4
    bytes an element (f16, f32), or int8 with an f32 scale per 32 elements of each head."""
    check_kv(kind, g.head_dim)
    if kind == "int8":
        return 2 * g.n_head_kv * (g.head_dim + g.head_dim // KV_BLOCK * 4)
    return 2 * g.n_head_kv * g.head_dim * np.dtype(_STORE[kind]).itemsize


def quantize_int8(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x f32 [..., D] (D a multiple of 32) -> (q int8 [..., D], d f32 [..., D/32]) by ActQ's own
    quantizer (engine/kernels/actq.py), not a copy of its rule: one rounding for activations and
    cached keys, and 4x faster than the numpy copy this was (a 1024-token chunk of seed-4l's K:
    0.7 ms instead of 2.9). A non-finite K or V is refused as a non-finite activation is."""
    a = quantize_act(np.asarray(x, F32).reshape(-1, x.shape[-1]), "KV cache (int8)")
    return a.q.reshape(x.shape), a.d.reshape(*x.shape[:-1], -1)


def dequantize_int8(q: np.ndarray, d: np.ndarray) -> np.ndarray:
    """The inverse of quantize_int8: f32 [..., D] = q * d per 32-element block."""
    x = q.reshape(*q.shape[:-1], -1, KV_BLOCK).astype(F32) * d[..., None]
    return x.reshape(q.shape)


class KVCache:
    """K and V of one layer: `write(pos, k, v)` stores T tokens, `read(index)` returns f32 [Hkv, n, D]."""

    def __init__(self, kind: str, max_context: int, n_head_kv: int, head_dim: int):
        check_kv(kind, head_dim)
        self.kind, self.max_context, self.n_head_kv, self.head_dim = kind, max_context, n_head_kv, head_dim
        shape = (n_head_kv, max_context, head_dim)
        self.k = np.zeros(shape, _STORE[kind])
        self.v = np.zeros(shape, _STORE[kind])
        if kind == "int8":
            self.k_scale = np.zeros((n_head_kv, max_context, head_dim // KV_BLOCK), F32)
            self.v_scale = np.zeros_like(self.k_scale)

    @property
    def nbytes(self) -> int:
        arrays = [self.k, self.v] + ([self.k_scale, self.v_scale] if self.kind == "int8" else [])
        return sum(a.nbytes for a in arrays)

    def write(self, pos: int, k: np.ndarray, v: np.ndarray) -> None:
        """k, v f32 [T, Hkv, D] at positions pos .. pos + T - 1."""
        T = k.shape[0]
        if pos + T > self.max_context:
            raise ValueError(f"KV cache: positions {pos}..{pos + T - 1} past its {self.max_context} tokens (--ctx-size)")
        for x, store, scale in ((k, self.k, "k_scale"), (v, self.v, "v_scale")):
            x = x.transpose(1, 0, 2)  # [Hkv, T, D]
            if self.kind == "int8":
                store[:, pos : pos + T], getattr(self, scale)[:, pos : pos + T] = quantize_int8(x)
            else:
                store[:, pos : pos + T] = x

    def read(self, index) -> tuple[np.ndarray, np.ndarray]:
        """K, V f32 [Hkv, n, D] at `index` (a slice of positions, or an array of them)."""
        if self.kind == "int8":
            return (dequantize_int8(self.k[:, index], self.k_scale[:, index]),
                    dequantize_int8(self.v[:, index], self.v_scale[:, index]))
        return self.k[:, index].astype(F32, copy=False), self.v[:, index].astype(F32, copy=False)

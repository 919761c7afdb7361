"""qwen4exp QSA: gated full attention over the tokens a block indexer selects (one query, or a chunk of them).

transformers' `Qwen4ExpTextQSAIndexer` + `Qwen4ExpTextAttention` (ground truth), with the weights as
llama.cpp's converter stores them (docs/gguf-layout.md, docs/qwen4exp.md). For the token at position p:

    indexer   iq = rope_p(rmsnorm_h(indexer.q_proj x))          [Ih, Id], per-head norm (gain stored 1+w)
              ik = indexer.k_proj x                             [Id]: ONE key head, cached raw per token
    blocks    block b = tokens [b*r, (b+1)*r), complete once p >= (b+1)*r - 1;
              kb = rope_{b*r}(rmsnorm(mean of its r raw keys))  [Id], computed once when it completes
    score     s_b = sum_h relu(iq_h . kb) / sqrt(Id)            over the n = (p+1)//r complete blocks
    select    the top min(budget/r, n) blocks by s (ties exactly as torch.topk on CPU), their r tokens
              each, plus the incomplete tail [n*r, p]: transformers' rule, NOT llama.cpp's
              "top_k + r - 1 key cells" (they differ once the prompt is longer than the budget)
    attention q|gate = attn_q x, per head h rows [h*2D, h*2D+D) = q, the next D = gate
              q, k = rope_p(rmsnorm_h(.)), v = attn_v x; GQA head h reads kv head h // (H/Hkv)
              o = softmax(q.K_sel / sqrt(D)) V_sel * sigmoid(gate); out = attn_output o

Rotary: ops.Rope with f32 angles, cos/sin computed in f32 as transformers does (for text positions
t = h = w its M-RoPE is plain RoPE); the selection is discrete, so the rounding is transformers'.
Positions are cache indices (text only).

One forward for any T (T = 1 is the decode step): the chunk's keys are appended first, then each
query selects from the blocks complete at its position (`select`) and attends its selection.

Shapes: E = n_embd, H/Hkv/D = attention heads/kv heads/head dim, Ih/Id = indexer query heads/head dim,
r = compress ratio, C = max context, T = tokens.
"""

from __future__ import annotations

import math
from typing import Mapping

import numpy as np
from numba import njit

from strata.index_format.geometry import ModelGeometry

from .hyper import Tensor, as_f32, as_linear, take
from .kernels.actq import NonFiniteActivation
from .kernels.jit import JIT, cached_njit
from .batch import seqs_of
from .kvcache import ContextFull, KVCache, kv_bytes_per_token
from .ops import Rope, causal_mask
from .pack_reader import PackError
from .weights import Input

F32 = np.float32


# ---------------------------------------------------------------------------------------------
# torch.topk's choice among ties
#
# torch's CPU topk (aten TopKImpl.h) fills (value, index) pairs and runs libstdc++'s
# std::partial_sort when k * 64 <= n, else std::nth_element, with comp(x, y) = x > y; the first k
# pairs are the selection. Which of several EQUAL scores it keeps depends on those algorithms' exact
# swaps, and equal scores are common here: relu makes every block whose heads all point away score
# exactly 0. So the algorithms are reproduced step for step (libstdc++ bits/stl_algo.h,
# bits/stl_heap.h); tests check the chosen set against torch.topk on tie-heavy inputs.


@njit(inline="always", **JIT)
def _swap(v, ix, a, b):
    v[a], v[b] = v[b], v[a]
    ix[a], ix[b] = ix[b], ix[a]


@njit(**JIT)
def _adjust_heap(v, ix, first, hole, n, val, vi):
    top = hole
    child = hole
    while child < (n - 1) // 2:
        child = 2 * (child + 1)
        if v[first + child] > v[first + child - 1]:
            child -= 1
        v[first + hole] = v[first + child]
        ix[first + hole] = ix[first + child]
        hole = child
    if (n & 1) == 0 and child == (n - 2) // 2:
        child = 2 * (child + 1)
        v[first + hole] = v[first + child - 1]
        ix[first + hole] = ix[first + child - 1]
        hole = child - 1
    parent = (hole - 1) // 2  # __push_heap
    while hole > top and v[first + parent] > val:
        v[first + hole] = v[first + parent]
        ix[first + hole] = ix[first + parent]
        hole = parent
        parent = (hole - 1) // 2
    v[first + hole] = val
    ix[first + hole] = vi


@njit(**JIT)
def _heap_select(v, ix, first, middle, last):
    n = middle - first
    if n >= 2:  # __make_heap
        parent = (n - 2) // 2
        while True:
            _adjust_heap(v, ix, first, parent, n, v[first + parent], ix[first + parent])
            if parent == 0:
                break
            parent -= 1
    for i in range(middle, last):
        if v[i] > v[first]:  # __pop_heap(first, middle, i)
            val, vi = v[i], ix[i]
            v[i], ix[i] = v[first], ix[first]
            _adjust_heap(v, ix, first, 0, n, val, vi)


@njit(**JIT)
def _insertion_sort(v, ix, first, last):
    for i in range(first + 1, last):
        val, vi = v[i], ix[i]
        if val > v[first]:
            for j in range(i, first, -1):
                v[j], ix[j] = v[j - 1], ix[j - 1]
            v[first], ix[first] = val, vi
        else:
            j = i
            while val > v[j - 1]:
                v[j], ix[j] = v[j - 1], ix[j - 1]
                j -= 1
            v[j], ix[j] = val, vi


@njit(**JIT)
def _median_to_first(v, ix, r, a, b, c):
    if v[a] > v[b]:
        if v[b] > v[c]:
            _swap(v, ix, r, b)
        elif v[a] > v[c]:
            _swap(v, ix, r, c)
        else:
            _swap(v, ix, r, a)
    elif v[a] > v[c]:
        _swap(v, ix, r, a)
    elif v[b] > v[c]:
        _swap(v, ix, r, c)
    else:
        _swap(v, ix, r, b)


@njit(**JIT)
def _introselect(v, ix, first, nth, last, depth):
    while last - first > 3:
        if depth == 0:
            _heap_select(v, ix, first, nth + 1, last)
            _swap(v, ix, first, nth)
            return
        depth -= 1
        _median_to_first(v, ix, first, first + 1, first + (last - first) // 2, last - 1)
        lo, hi = first + 1, last  # __unguarded_partition around v[first]
        while True:
            while v[lo] > v[first]:
                lo += 1
            hi -= 1
            while v[first] > v[hi]:
                hi -= 1
            if not lo < hi:
                break
            _swap(v, ix, lo, hi)
            lo += 1
        if lo <= nth:
            first = lo
        else:
            last = lo
    _insertion_sort(v, ix, first, last)


# The disk cache (kernels/jit.py): compiling this and its helpers took ~3.9 s at every start.
# The helpers need no cache of their own: their code is linked into this entry point's.
@cached_njit("qsa-topk")
def _topk_inplace(v, ix, n, k):
    for i in range(n):
        ix[i] = i
    if k * 64 <= n:
        _heap_select(v, ix, 0, k, n)
    else:
        depth = 0
        m = n
        while m > 1:  # 2 * floor(log2(n)), libstdc++'s __lg
            m >>= 1
            depth += 1
        _introselect(v, ix, 0, k - 1, n, 2 * depth)


def torch_topk_set(scores: np.ndarray, k: int, vbuf: np.ndarray, ibuf: np.ndarray) -> np.ndarray:
    """The indices torch.topk(scores, k) returns on CPU, as a set (ascending). Uses vbuf/ibuf as scratch."""
    n = scores.shape[0]
    if not 0 < k <= n:
        raise ValueError(f"topk: k {k} outside 1..{n}")
    if np.isnan(scores).any():
        raise NonFiniteActivation("QSA block scores contain NaN (the indexer input is not finite)")
    vbuf[:n] = scores
    _topk_inplace(vbuf, ibuf, n, k)
    return np.sort(ibuf[:k])


# ---------------------------------------------------------------------------------------------
# the per-layer cache


def qsa_cache_bytes(g: ModelGeometry, max_ctx: int, kv: str = "f32") -> int:
    """Bytes of one QSA layer's QSACache: the KV cache (engine/kvcache.py, `kv` kind), ONE raw indexer
    key head per token (f32), pooled blocks and their scores (f32), the top-k index scratch (int64)."""
    nb = max_ctx // g.idx_compress_ratio
    return max_ctx * kv_bytes_per_token(g, kv) + indexer_key_bytes(g, max_ctx) + pooled_block_bytes(g, max_ctx) + 8 * nb


def indexer_key_bytes(g: ModelGeometry, max_ctx: int) -> int:
    """QSACache.idx_keys: ONE shared key head per token, f32 [C, Id]. indexer.k_proj is [E, Id]:
    idx_n_heads counts QUERY heads and has no place in this term (round 194 sized it by them: 4x too
    big, and unnoticed because it tightened the budget)."""
    return max_ctx * g.idx_key_store_dim * 4


def pooled_block_bytes(g: ModelGeometry, max_ctx: int) -> int:
    """QSACache.idx_blocks and the block scores: f32 [C // r, Id] and f32 [C // r]."""
    nb = max_ctx // g.idx_compress_ratio
    return nb * g.idx_head_dim * 4 + nb * 4


class QSACache:
    """One QSA layer's state, allocated once for max_ctx tokens (S12); `n` tokens are cached.

    The indexer stores ONE key head per token (indexer.k_proj is [E, Id]); sizing it by the 4 query
    heads made a store 4x too big that survived every total-based check (seed, round 194). K and V
    are a KVCache of the session's kind (f32, f16 or int8); the indexer keys stay f32, because block
    selection is discrete and a rounded key could flip it.
    """

    def __init__(self, max_ctx: int, *, n_head_kv: int, head_dim: int, idx_head_dim: int, compress_ratio: int,
                 kv: str = "f32"):
        if max_ctx <= 0 or compress_ratio <= 0:
            raise ValueError(f"QSACache: max_ctx {max_ctx} and compress ratio {compress_ratio} must be > 0")
        nb = max_ctx // compress_ratio
        self.max_ctx, self.ratio = max_ctx, compress_ratio
        self.kv = KVCache(kv, max_ctx, n_head_kv, head_dim)  # normed, roped
        self.idx_keys = np.zeros((max_ctx, idx_head_dim), F32)  # raw (unnormed, unroped), one head
        self.idx_blocks = np.zeros((nb, idx_head_dim), F32)  # block b valid iff (b+1)*r <= n
        self._vbuf = np.zeros(nb, F32)  # the block scores, as top-k permutes them
        self._ibuf = np.zeros(nb, np.int64)
        self.n = 0

    @classmethod
    def for_geometry(cls, g: ModelGeometry, max_ctx: int, kv: str = "f32") -> "QSACache":
        return cls(max_ctx, n_head_kv=g.n_head_kv, head_dim=g.head_dim, idx_head_dim=g.idx_head_dim,
                   compress_ratio=g.idx_compress_ratio, kv=kv)

    @property
    def nbytes(self) -> int:
        return sum(self.memory().values())

    def memory(self) -> dict[str, int]:
        """Bytes by strata-budget's session items (engine/budget.py); `scratch`: the top-k indices."""
        return {"session.kv": self.kv.nbytes, "session.indexer_keys": self.idx_keys.nbytes,
                "session.indexer_blocks": self.idx_blocks.nbytes + self._vbuf.nbytes, "scratch": self._ibuf.nbytes}

    def truncate(self, n: int) -> None:
        """Forget tokens n.. (a rejected draft); pooled blocks below n stay valid, the rest are rebuilt on append."""
        if not 0 <= n <= self.n:
            raise ValueError(f"QSACache.truncate: {n} outside 0..{self.n}")
        self.n = n


# ---------------------------------------------------------------------------------------------
# the layer


class QSALayer:
    """A qwen4exp full-attention layer with its QSA indexer: `forward` over T tokens (T = 1: the decode step)."""

    def __init__(self, layer: int, t: Mapping[str, Tensor], g: ModelGeometry):
        b = f"blk.{layer}"
        if not g.has_qsa or g.idx_compress_ratio <= 0 or g.idx_top_k <= 0:
            raise PackError(
                f"layer {layer}: QSA needs indexer heads, a token budget and a compress ratio (geometry has "
                f"idx_n_heads {g.idx_n_heads}, idx_top_k {g.idx_top_k}, idx_compress_ratio {g.idx_compress_ratio}); "
                "refusing to run dense attention in place of QSA")
        missing = [n for n in ("q_proj", "k_proj", "q_norm", "k_norm") if f"{b}.indexer.{n}.weight" not in t]
        if missing:
            raise PackError(f"layer {layer}: indexer tensors {[f'{b}.indexer.{n}.weight' for n in missing]} are "
                                 "missing; this layer is QSA, refusing to run it as dense attention")
        E, H, Hkv, D = g.n_embd, g.n_head, g.n_head_kv, g.head_dim
        Ih, Id = g.idx_n_heads, g.idx_head_dim
        self.layer, self.E, self.H, self.Hkv, self.D, self.Ih, self.Id = layer, E, H, Hkv, D, Ih, Id
        self.ratio, self.block_topk, self.eps = g.idx_compress_ratio, g.idx_top_k // g.idx_compress_ratio, g.rms_eps
        self.attn_q = as_linear(take(t, f"{b}.attn_q.weight"), f"{b}.attn_q.weight", E, 2 * H * D)
        self.attn_k = as_linear(take(t, f"{b}.attn_k.weight"), f"{b}.attn_k.weight", E, Hkv * D)
        self.attn_v = as_linear(take(t, f"{b}.attn_v.weight"), f"{b}.attn_v.weight", E, Hkv * D)
        self.attn_out = as_linear(take(t, f"{b}.attn_output.weight"), f"{b}.attn_output.weight", H * D, E)
        self.q_norm = as_f32(take(t, f"{b}.attn_q_norm.weight"), f"{b}.attn_q_norm.weight", (D,))
        self.k_norm = as_f32(take(t, f"{b}.attn_k_norm.weight"), f"{b}.attn_k_norm.weight", (D,))
        self.idx_q = as_linear(t[f"{b}.indexer.q_proj.weight"], f"{b}.indexer.q_proj.weight", E, Ih * Id)
        self.idx_k = as_linear(t[f"{b}.indexer.k_proj.weight"], f"{b}.indexer.k_proj.weight", E, Id)
        self.idx_q_norm = as_f32(t[f"{b}.indexer.q_norm.weight"], f"{b}.indexer.q_norm.weight", (Id,))
        self.idx_k_norm = as_f32(t[f"{b}.indexer.k_norm.weight"], f"{b}.indexer.k_norm.weight", (Id,))
        self.rope = Rope(g.n_rot, g.rope_freq_base, f32_angles=True)
        self.selected = np.zeros(0, np.int64)  # the token ids the last step attended (diagnostics, tests)
        self.block_scores = np.zeros(0, F32)  # the last step's score of each complete block (diagnostics, tests)

    def forward(self, be, x, caches) -> np.ndarray:
        """x, an Input of T rows (or f32 [T, E]) -> f32 [T, E]. `caches`: one QSACache (every row is
        its sequence's, at positions cache.n..), or a list of Seq (engine/batch.py): whose rows they
        are, each with its QSACache; every sequence's tokens are appended to its cache.

        A sequence's keys are appended first (a query still attends only keys at or before it: its
        selection is made from the blocks complete at its position, by `select`); attention runs
        once over the union of the sequence's selections, masked per query. One query attends its
        selection in `select`'s order, unmasked."""
        x = x if isinstance(x, Input) else Input(np.ascontiguousarray(x, dtype=F32))
        T = x.x.shape[0]
        seqs = seqs_of(caches, T, caches.n if isinstance(caches, QSACache) else 0)
        for r in seqs:
            if r.state.n + r.n > r.state.max_ctx:
                raise ContextFull(f"layer {self.layer}: context full ({r.state.max_ctx} tokens); raise --ctx-size")
        # the five products of x in one parallel region for a token (backend.linears), into the step's
        # buffers: a token's products without outs went the unplanned way, every argument checked at
        # every call (~0.2 ms a QSA layer of the `tiny` token on the 2-core VM, 2026-12-04)
        H, Hkv, D, sc = self.H, self.Hkv, self.D, be.scratch
        qg, k, v, iq, ik = be.linears((self.attn_q, self.attn_k, self.attn_v, self.idx_q, self.idx_k), x,
                                      (sc("qsa.qg", (T, 2 * H * D)), sc("qsa.k", (T, Hkv * D)), sc("qsa.v", (T, Hkv * D)),
                                       sc("qsa.iq", (T, self.Ih * self.Id)), sc("qsa.ik", (T, self.Id))))  # fmt: skip
        # r.pos, not the cache's n: a verify forward's rows are Seqs of ONE cache, appended in turn
        pos = np.concatenate([r.pos + np.arange(r.n) for r in seqs])
        qg = qg.reshape(T, H, 2 * D)
        q = be.rmsnorm(qg[:, :, :D], self.q_norm, self.eps, group=D, f32_sums=True)
        k = be.rmsnorm(k.reshape(T, Hkv, D), self.k_norm, self.eps, group=D, f32_sums=True)
        iq = be.rmsnorm(iq.reshape(T, self.Ih, self.Id), self.idx_q_norm, self.eps, group=self.Id, f32_sums=True)
        for a in (q, k, iq):
            be.rope_(self.rope, a, pos)
        v = v.reshape(T, Hkv, D)
        if len(seqs) == 1:  # one sequence: its attention's own output
            o = self._attend(be, seqs[0].state, q, k, v, iq, ik)
        else:  # (the backend's array: on the device step a host one took the rows' device outputs only
            # by an implicit copy down, which CuPy refuses; the emulation's arrays are numpy, so it passed there)
            o = sc("qsa.o", (T, H, D))
            for r in seqs:
                o[r.a : r.b] = self._attend(be, r.state, q[r.a : r.b], k[r.a : r.b], v[r.a : r.b], iq[r.a : r.b],
                                            ik[r.a : r.b])
        o = o.reshape(T, H * D)
        o *= be.sigmoid(qg[:, :, D:].reshape(T, H * D), exp_form=True)
        return be.linear(self.attn_out, Input(o), sc("qsa.y", (T, self.attn_out.n_out)))

    def _attend(self, be, cache: QSACache, q, k, v, iq, ik) -> np.ndarray:
        """One sequence's T queries (normed, roped) and keys: the keys appended, the selections made,
        the queries attending them -> f32 [T, H, D]."""
        T, p0 = q.shape[0], cache.n
        step = getattr(be, "qsa_token", None)
        if T == 1 and step is not None:
            # the device step: keys, pooling, scores, selection and attention at the device's
            # position, so a captured step replays at every position (DeviceBackend.qsa_token; its
            # selection is not brought down: `selected` is the host path's)
            return step(self, cache, q, k, v, iq, ik)
        self._append(be, cache, k, v, ik)
        if T == 1:
            keys, visible = self.select(be, iq[0], cache), None
            self.selected = keys
        elif (p0 + T) // self.ratio <= self.block_topk:
            # every query's complete blocks fit the budget: `select` would give each its whole
            # prefix (all blocks and the tail), so the mask is the causal one, without scoring
            visible, keys = causal_mask(p0, T, p0 + T), None
            self.selected = np.arange(p0 + T)
        elif (visible := be.qsa_select_rows(self, cache, iq, p0)) is not None:
            # the device step: every query's selection made there at once, as its token step
            # would make it, into a mask over every cached key (`selected` is the host path's)
            keys = None
        else:
            sels = [self.select(be, iq[i], cache, p0 + i + 1) for i in range(T)]
            seen = np.zeros((T, p0 + T), bool)  # query i attends token j
            seen[np.repeat(np.arange(T), [len(sel) for sel in sels]), np.concatenate(sels)] = True
            keys = np.flatnonzero(seen.any(axis=0))  # the union, ascending
            visible = seen[:, keys]
            self.selected = sels[-1]
        K, V = cache.kv.read(slice(0, p0 + T) if keys is None else keys)
        return be.attention(q, K, V, self.D**-0.5, visible)

    def _append(self, be, cache: QSACache, k, v, ik) -> None:
        """k, v [T, Hkv, D], ik [T, Id] at positions cache.n..; pools every block they complete, once."""
        p, T, r = cache.n, k.shape[0], self.ratio
        cache.kv.write(p, k, v)
        cache.idx_keys[p : p + T] = ik
        cache.n = p + T
        for b in range(p // r, (p + T) // r):  # blocks completed by these tokens never change again
            keys = cache.idx_keys[b * r : (b + 1) * r]
            kb = be.rmsnorm(keys.mean(axis=0, dtype=F32), self.idx_k_norm, self.eps, group=self.Id, f32_sums=True)
            be.rope_(self.rope, kb.reshape(1, 1, -1), np.array([b * r]))
            cache.idx_blocks[b] = kb

    def select(self, be, iq: np.ndarray, cache: QSACache, n: int | None = None) -> np.ndarray:
        """Token ids (ascending) a query attends when n tokens are cached (default: all of them): the top
        complete blocks by indexer score + the incomplete tail."""
        r = self.ratio
        n = cache.n if n is None else n
        nb = n // r
        tail = np.arange(nb * r, n, dtype=np.int64)
        if nb == 0:
            return tail
        s = np.maximum(iq @ cache.idx_blocks[:nb].T, F32(0)).sum(axis=0, dtype=F32) / F32(math.sqrt(self.Id))
        self.block_scores = s
        blocks = be.topk_set(s, min(self.block_topk, nb), cache._vbuf, cache._ibuf)
        toks = (blocks[:, None] * r + np.arange(r, dtype=np.int64)[None, :]).reshape(-1)
        return np.concatenate([toks, tail])

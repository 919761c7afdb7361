"""The MoE block over T tokens: softmax router, top-k with renormalised weights (norm_topk_prob, true
for both architectures and not stored in the GGUF), routed experts read in place from the mapped
GGUF, and the sigmoid-gated shared expert (transformers' Qwen3_5MoeSparseMoeBlock).

One forward for any T (T = 1 is the decode step). The routed experts run expert by expert: each
routed expert's weights are read once for all the tokens routed to it, in one grouped kernel call
per matrix. THE MOE OWNS THE HIT/MISS SPLIT: `routed` asks the backend's expert server (the GPU
tier's, engine/tier/hits.py) which experts it serves; the server multiplies on the device and makes
each hit's hidden activation with `hidden_`, the function the CPU path uses, so a hit and a miss
give the same bits (tests/gpu/test_gpu_tier.py); without a server every expert is computed here.

Legend: E = n_embd, X = experts, k = experts per token, F = expert n_ff, Fs = shared expert n_ff,
T = tokens, N = (token, rank) pairs = T k.
"""

from __future__ import annotations

import numpy as np
from numba import prange

from .batch import keep, seqs_of
from .kernels import cpu
from .kernels.actq import ActQ, NonFiniteActivation
from .kernels.jit import cached_njit, cached_row_kernel
from .ops import silu_mul_
from .pack_reader import Pack
from .weights import Input

F32 = np.float32
# Up to this many (token, rank) rows the routed experts' gate and up go in one grouped call (the
# decode step's 10, a few streams' steps); a prompt chunk keeps two calls (no copy of its rows).
FUSE_ROWS = 64


def hidden_(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """up *= silu(gate), in place -> up: an expert's hidden activation, rows [n, F] (the down
    projection's input). Every routed expert's h on the host is made here, a CPU miss's and a GPU
    hit's (from its downloaded gate and up) alike, and the device step's kernel makes it with the
    same operations (ops.silu_mul_ says how): so the same bits wherever the expert sits."""
    return silu_mul_(up, gate)


def route_topk(logits: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Router logits f32 [T, X] -> (expert ids int64 [T, k], weights f64 [T, k]) ranked by probability,
    the weights renormalised to sum to 1. The softmax is in float64, so the ranking and the weights
    come from the probabilities transformers has. Equal probabilities rank the lower expert id first,
    in the top-k and at its edge: the device's routing kernels (engine/tier/device_kernels.cu
    dev_route, dev_route_rows) follow the same rule. (argpartition alone left the order of ties to
    its partitioning, so a tie at the edge or within the k could pick or rank another expert than
    the device did.)"""
    p = np.exp(logits - logits.max(axis=1, keepdims=True), dtype=np.float64)
    p /= p.sum(axis=1, keepdims=True)
    if p.shape[0] == 1:  # the decode step: the selection in one pass (its numpy steps took ~50 us a layer)
        top = np.empty((1, k), np.int64)
        if _top_one(p[0], top[0]):
            weights = p[:, top[0]]
            weights /= weights.sum(axis=1, keepdims=True)
            return top, weights
    return _ranked(p, k)


def route_topk_reference(logits: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """route_topk with every row through the numpy selection (the one-row kernel's reference)."""
    p = np.exp(logits - logits.max(axis=1, keepdims=True), dtype=np.float64)
    p /= p.sum(axis=1, keepdims=True)
    return _ranked(p, k)


@cached_njit("moe-top-one")
def _top_one(p, top):
    # route_topk's experts of one row, ranked: the first k of the order (probability descending,
    # then id ascending), picked one at a time (k passes over X, no sort); the same set and ranks
    # as `_ranked`'s partition, edge ties and stable sort. False on a NaN (the caller's numpy path
    # then raises the error naming it).
    X, k = p.size, top.size
    for i in range(X):
        if np.isnan(p[i]):
            return False
    last_p, last_i = np.inf, -1
    for j in range(k):
        best = -1
        for i in range(X):
            # after (last_p, last_i) in the order, and before the best so far
            after = p[i] < last_p or (p[i] == last_p and i > last_i)
            if after and (best < 0 or p[i] > p[best]):
                best = i
        top[j] = best
        last_p, last_i = p[best], best
    return True


def _ranked(p: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """route_topk's selection and ranking from the probabilities p f64 [T, X]."""
    top = np.argpartition(-p, k - 1, axis=1)[:, :k]  # position k - 1 holds each row's k-th largest
    if p.shape[0] == 1:  # the decode step: scalar work (each numpy call on a row costs microseconds)
        edge = np.count_nonzero(p >= p[0, top[0, k - 1]]) != k
    else:
        edge = (np.count_nonzero(p >= np.take_along_axis(p, top[:, k - 1 : k], axis=1), axis=1) != k).any()
    if edge:
        top = _edge_ties(p, k)  # rare: a probability equal to the k-th outside the k (or a NaN)
    top.sort(axis=1)  # equal probabilities inside the k: the lower id first (the argsort is stable)
    order = np.argsort(-np.take_along_axis(p, top, axis=1), axis=1, kind="stable")
    top = np.take_along_axis(top, order, axis=1)
    weights = np.take_along_axis(p, top, axis=1)
    weights /= weights.sum(axis=1, keepdims=True)
    return top, weights


def _edge_ties(p: np.ndarray, k: int) -> np.ndarray:
    """route_topk's k experts of each row where a probability equal to the k-th lies beyond it: all
    those above the k-th, then the equal ones lowest id first -> ids [T, k] (ascending)."""
    T = p.shape[0]
    kth = -np.partition(-p, k - 1, axis=1)[:, k - 1 : k]
    above, tied = p > kth, p == kth
    need = k - above.sum(axis=1, keepdims=True)
    chosen = above | (tied & (np.cumsum(tied, axis=1) <= need))
    if chosen.sum() != T * k:  # a NaN compares false to everything
        t = int(np.flatnonzero(chosen.sum(axis=1) != k)[0])
        # a NonFiniteActivation, as the quantizers raise: the commands then name the weight it came
        # from (a NaN in an F32 router's input reaches here before any quantizer sees it)
        raise NonFiniteActivation(f"router logits of token {t}: non-finite activation, no top-{k} of {p.shape[1]} experts")
    return np.nonzero(chosen)[1].reshape(T, k)


class Groups:
    """The (token, rank) pairs of a batch's routing, expert by expert: group g is expert experts[g] on
    the token rows rows[starts[g]:starts[g + 1]]; slot [T, k] is where pair (t, j) sits in that order.
    `one_row` False: one token's groups through the general steps (the one-row form's reference)."""

    __slots__ = ("experts", "rows", "starts", "slot")

    def __init__(self, top: np.ndarray, *, one_row: bool = True):
        T, k = top.shape
        if T == 1 and one_row:  # one token: k distinct experts, one row each (the numpy steps below took ~19 us)
            order = np.argsort(top[0], kind="stable")
            self.experts, self.rows, self.starts = top[0, order], np.zeros(k, np.int64), np.arange(k + 1)
            self.slot = np.empty((1, k), np.int64)
            self.slot[0, order] = self.starts[:k]
            return
        flat = top.reshape(-1)
        order = np.argsort(flat, kind="stable")  # the (token, rank) pairs, expert by expert
        self.experts, first = np.unique(flat[order], return_index=True)
        self.starts = np.append(first, flat.size)
        self.rows = order // k
        slot = np.empty(flat.size, np.int64)
        slot[order] = np.arange(flat.size)
        self.slot = slot.reshape(T, k)


class MoE:
    """One layer's experts. `forward(be, x, counts)` -> f32 [T, E]."""

    def __init__(self, pack: Pack, layer: int):
        g = pack.geometry
        b = f"blk.{layer}"
        self.pack, self.layer = pack, layer
        self.E, self.F, self.k = g.n_embd, g.n_ff_exp, g.n_expert_used
        self.router = pack.weight(f"{b}.ffn_gate_inp.weight")  # (E, X), F32 always
        self.gu, self.d = pack.expert_types(layer)
        self._one = None  # _token_products' buffers
        self._rank_slot = np.arange(g.n_expert_used, dtype=np.int64).reshape(1, -1)  # (its rows in rank order)
        self.shared = None
        if g.n_ff_shexp:
            self.shared = (
                pack.weight(f"{b}.ffn_gate_inp_shexp.weight"),  # (E, 1): the sigmoid gate
                pack.weight(f"{b}.ffn_gate_shexp.weight"),
                pack.weight(f"{b}.ffn_up_shexp.weight"),
                pack.weight(f"{b}.ffn_down_shexp.weight"),
            )

    def route(self, be, x: Input, logits: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(expert ids int64 [T, k], weights f64 [T, k]): each token's experts ranked by router
        probability, weights summing to 1 (`route_topk`). logits: the router's product of x when
        the caller made it (`forward`, beside the shared expert's)."""
        if logits is None:
            logits = be.linear(self.router, x, self._router_out(be, x))
        self.logits = logits
        return be.route(logits, self.k)

    def _router_out(self, be, x: Input) -> np.ndarray:
        # the layer's own buffer (not one shared by every layer): `logits` stays the last batch's
        # router logits [T, X] for diagnostics and tests
        return be.scratch(f"moe.router.{self.layer}", (x.x.shape[0], self.router.n_out))

    def forward(self, be, x: Input, counts=None) -> np.ndarray:
        """y = sum_e w_e down_e(silu(gate_e x) * up_e x) + sigmoid(s . x) shared(x) for T tokens ->
        f32 [T, E]. counts: an int array [X] (counts[e] += 1 per routed e), or a list of Seq whose
        states are such arrays (each sequence counts its own rows). Each (token, rank) output is
        kept apart and the sum is made rank by rank (`combine_reference`), so a token's result does
        not depend on its batch."""
        T = x.x.shape[0]
        # an expert server may take a whole token (or a prompt chunk) where its arrays live: routing,
        # experts, combine (the device step's, engine/tier/device.py); None: routed here
        out, logits, shared, y_s = None, None, None, None
        if be.experts is not None:
            # one-token sequences (a verify's rows): the server's token path row by row, where it
            # has one (the device step: no round trip of the routing through the host, the token's bits)
            rows = T > 1 and getattr(be.experts, "rows", None) is not None and isinstance(counts, list) \
                and all(r.n == 1 for r in counts)
            if T == 1 or rows:
                if self.shared and getattr(be.experts, "adds_shared", False):
                    # the router and the shared expert first (their products of x grouped by type),
                    # so that the server's combine adds the shared output in its own launch
                    logits, shared = self._router_and_shared(be, x)
                    y_s = self._shared_out(be, shared)
                out = (be.experts.rows if rows else be.experts.token)(self, x, counts, logits, y_s)
                if out is not None and y_s is not None:
                    return out
            else:
                out = be.experts.tokens(self, x, counts)
        if out is None:
            if self.shared and T == 1 and logits is None:
                # the router and the shared expert's up, gate and gate logit all read x: one
                # parallel region for a token where the router took one of its own (backend.linears,
                # each product the bits of its own linear)
                logits, shared = self._router_and_shared(be, x)
            top, weights = self.route(be, x, logits)
            if counts is not None:
                for r in seqs_of(counts, T):
                    if T == 1:  # (a token's k experts are distinct: bincount's counts, without its array)
                        r.state[top[0]] += 1
                    else:
                        r.state[...] += np.bincount(top[r.a : r.b].reshape(-1), minlength=r.state.size)
                    keep(r)
            part = self._token_products(x, top[0]) if T == 1 and be.experts is None else None
            if part is not None:  # the groups in rank order: row j is rank j's output
                slot = self._rank_slot
            else:
                grp = Groups(top)
                part, slot = self.routed(be, x, grp.experts, grp.rows, grp.starts), grp.slot
            out = be.scratch("moe.out", (T, self.E))
            be.combine(part, slot, weights, out)
        if self.shared:
            if shared is None:
                s_gate, gate, up, _ = self.shared
                sc, Fs = be.scratch, gate.n_out
                shared = be.linears((up, gate, s_gate), x, (sc("moe.sh_up", (T, Fs)), sc("moe.sh_gate", (T, Fs)), sc("moe.sh_g", (T, 1))))
            be.shared_add_(out, *(y_s or self._shared_out(be, shared)))  # out += y sigmoid(s . x)
        return out

    def _router_and_shared(self, be, x: Input) -> tuple:
        """The router logits of x's rows (one token, a verify's few) and the shared expert's (up,
        gate, gate logit): all of x."""
        s_gate, gate, up, _ = self.shared
        sc, Fs, T = be.scratch, gate.n_out, x.x.shape[0]
        logits, *shared = be.linears((self.router, up, gate, s_gate), x,
                                     (self._router_out(be, x), sc("moe.sh_up", (T, Fs)), sc("moe.sh_gate", (T, Fs)),
                                      sc("moe.sh_g", (T, 1))))  # fmt: skip
        return logits, shared

    def _shared_out(self, be, shared) -> tuple:
        """(y, s): the shared expert's output before its gate, down(up silu(gate)), and its gate logit."""
        u, g, s = shared
        down = self.shared[3]
        h = be.gate_input(u, g, True, down)  # up silu(gate) (the device makes down's ActQ in the same launch)
        return be.linear(down, h, be.scratch("moe.sh_y", (u.shape[0], self.E))), s

    def _token_products(self, x: Input, top: np.ndarray) -> np.ndarray | None:
        """`products` of one token's k experts in rank order (top: int64 [k]) -> f32 [k, E], row j
        expert top[j]'s output; None where `products` would not fuse gate and up (an input that is
        not an ActQ). The same kernels on the same rows as `products` of the token's Groups (which
        orders the experts by id: each expert's rows are its own work items, so the order moves no
        bit), with the copies of the token's ActQ, the offsets and the groups' bounds in buffers
        kept by the layer, where `products` made them at every token (~25 numpy calls and a
        gather: ~20 us a layer on the 2-core VM, `tiny` 4.17 -> 4.00 ms a token, 2026-12-04)."""
        act = x.form(self.gu)
        if not isinstance(act, ActQ) or act.q.shape[0] != 1:
            return None
        k, E, F = top.size, self.E, self.F
        b = self._one
        if b is None or b[0].shape[0] != 2 * k:  # (made at the first token)
            b = self._one = (np.empty((2 * k, E), act.q.dtype), np.empty((2 * k,) + act.d.shape[1:], act.d.dtype),
                             np.empty((2 * k,) + act.s16.shape[1:], act.s16.dtype), np.empty(2 * k, np.int64),
                             np.empty(k, np.int64), np.arange(2 * k + 1), np.arange(k + 1),
                             self.gu.nbytes((E, F)), self.d.nbytes((F, E)))  # fmt: skip
        q2, d2, s2, offs2, offs, starts2, starts, gu_size, d_size = b
        q2[...], d2[...], s2[...] = act.q, act.d, act.s16  # gate's k rows, then up's: the token's ActQ each
        span, g_at, u_at = self.pack.expert_gate_up(self.layer)
        np.multiply(top, gu_size, out=offs)
        np.add(offs, g_at, out=offs2[:k])
        np.add(offs, u_at, out=offs2[k:])
        gu = cpu.matmul_grouped(span, self.gu.id, E, F, offs2, ActQ(q2, d2, s2), starts2)
        h = hidden_(gu[:k], gu[k:])
        np.multiply(top, d_size, out=offs)
        return cpu.matmul_grouped(self.pack.expert_tensors(self.layer)[2], self.d.id, F, E, offs, Input(h).form(self.d), starts)

    def routed(self, be, x: Input, experts: np.ndarray, rows: np.ndarray, starts: np.ndarray) -> np.ndarray:
        """Expert experts[g] on the tokens rows[starts[g]:starts[g + 1]] of x, for every g -> f32
        [len(rows), E] in that order: the backend's expert server computes the experts it holds (and
        the rest through `products`, beside them), or, without one, all of them here."""
        if be.experts is None:
            return self.products(x, experts, rows, starts)
        return be.experts.routed(self, x, experts, rows, starts)

    def products(self, x: Input, experts: np.ndarray, rows: np.ndarray, starts: np.ndarray) -> np.ndarray:
        """`routed` on the CPU -> f32 [len(rows), E], row i the output of token rows[i] through its
        group's expert, bit-identical to that expert on that token alone. All the experts in one
        grouped kernel call per matrix (gate, up, down), reading the layer's expert tensors in place.
        Any subset of the batch's experts may be passed (a GPU tier computes its hits elsewhere)."""
        gate_all, up_all, down_all = self.pack.expert_tensors(self.layer)
        E, F = self.E, self.F
        act = x.form(self.gu)
        act = ActQ(act.q[rows], act.d[rows], act.s16[rows]) if isinstance(act, ActQ) else act[rows]
        gu_at = experts.astype(np.int64) * self.gu.nbytes((E, F))
        N = len(rows)
        if N <= FUSE_ROWS and isinstance(act, ActQ):
            # gate and up of every expert as one grouped call: one parallel region where there were
            # two (at 8 threads a decode step's many small regions, not their bytes, held it at 0.75x
            # llama.cpp: each region's wake-up and barrier costs more with every thread)
            span, g_at, u_at = self.pack.expert_gate_up(self.layer)
            both = ActQ(np.concatenate([act.q, act.q]), np.concatenate([act.d, act.d]), np.concatenate([act.s16, act.s16]))
            gu = cpu.matmul_grouped(span, self.gu.id, E, F, np.concatenate([g_at + gu_at, u_at + gu_at]), both,
                                    np.concatenate([starts, starts[1:] + N]))  # fmt: skip
            gate, up = gu[:N], gu[N:]
        else:
            gate = cpu.matmul_grouped(gate_all, self.gu.id, E, F, gu_at, act, starts)
            up = cpu.matmul_grouped(up_all, self.gu.id, E, F, gu_at, act, starts)
        h = hidden_(gate, up)
        d_at = experts.astype(np.int64) * self.d.nbytes((F, E))
        return cpu.matmul_grouped(down_all, self.d.id, F, E, d_at, Input(h).form(self.d), starts)


# --- the weighted sum of a chunk's routed outputs ------------------------------------------------------


def combine_reference(part: np.ndarray, slot: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """out[t] = sum over ranks j, in rank order from 0, of f32(weights[t, j]) * part[slot[t, j]]:
    `step`'s sum (out += w_j parts[j]) for T tokens -> f32 [T, E]. part f32 [N, E]; slot int [T, k]."""
    routed = part[slot]  # [T, k, E]
    out = np.zeros((slot.shape[0], part.shape[1]), F32)
    for j in range(slot.shape[1]):
        out += weights[:, j : j + 1].astype(F32) * routed[:, j]
    return out


def combine(part: np.ndarray, slot: np.ndarray, weights: np.ndarray, out: np.ndarray) -> np.ndarray:
    """combine_reference into out (f32 [T, E]) -> out."""
    _combine(part, slot, weights, out)
    return out


@cached_row_kernel("moe-combine", rows=1)
def _combine(part, slot, weights, out):
    # combine_reference into out, reading each part row in place: the numpy form gathered the
    # [T, k, E] outputs (26 MB for a 256-token chunk at production widths) and made a product
    # temporary per rank. Each element is the same f32 product and the same f32 sums in the same
    # order (no FMA: JIT has fastmath off), so the same bits.
    T, k = slot.shape
    for t in prange(T):
        out[t] = F32(0)
        for j in range(k):
            w = F32(weights[t, j])
            row = part[slot[t, j]]
            for e in range(out.shape[1]):
                out[t, e] += w * row[e]

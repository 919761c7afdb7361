"""The MoE block of one token (or of a chunk of T tokens, expert by expert): softmax router, top-k with renormalised weights (norm_topk_prob, true
for both architectures and not stored in the GGUF), routed experts read in place from the mapped
GGUF, and the sigmoid-gated shared expert (transformers' Qwen3_5MoeSparseMoeBlock).

Legend: E = n_embd, X = experts, k = experts per token, F = expert n_ff, Fs = shared expert n_ff,
T = tokens of a chunk.
"""

from __future__ import annotations

import numpy as np

from .kernels import cpu
from .kernels.actq import ActQ
from .kernels.jit import cached_njit
from .ops import gate_, sigmoid, silu_
from .pack import Pack
from .weights import Input

F32 = np.float32


class MoE:
    """One layer's experts. `step(x, counts)` -> f32 [E] (a view of this block's scratch)."""

    def __init__(self, pack: Pack, layer: int):
        g = pack.geometry
        b = f"blk.{layer}"
        self.pack, self.layer = pack, layer
        self.E, self.F, self.k = g.n_embd, g.n_ff_exp, g.n_expert_used
        self.router = pack.weight(f"{b}.ffn_gate_inp.weight")  # (E, X), F32 always
        self.gu, self.d = pack.expert_types(layer)
        self.shared = None
        if g.n_ff_shexp:
            self.shared = (
                pack.weight(f"{b}.ffn_gate_inp_shexp.weight"),  # (E, 1): the sigmoid gate
                pack.weight(f"{b}.ffn_gate_shexp.weight"),
                pack.weight(f"{b}.ffn_up_shexp.weight"),
                pack.weight(f"{b}.ffn_down_shexp.weight"),
            )
        # scratch, made once (S12)
        self.logits = np.empty(g.n_expert, F32)
        self.gate = np.empty(self.F, F32)
        self.up = np.empty(self.F, F32)
        self.h = Input(np.empty(self.F, F32))
        self.part = np.empty(self.E, F32)
        self.parts = np.empty((self.k, self.E), F32)  # the routed experts' outputs, in the router's order
        self.out = np.empty(self.E, F32)
        # the GPU tier's hit path (engine/gpu_tier.py) when it is ready, else None: every expert a CPU miss
        self.hits = None
        self.top = np.empty(self.k, np.int64)
        self.weights = np.empty(self.k, np.float64)
        if self.shared:
            Fs = g.n_ff_shexp
            self.sh_gate = np.empty(Fs, F32)
            self.sh_up = np.empty(Fs, F32)
            self.sh_h = Input(np.empty(Fs, F32))
            self.sh_g = np.empty(1, F32)

    def route(self, x: Input) -> tuple[np.ndarray, np.ndarray]:
        """(expert ids [k], weights [k]) ranked by router probability, weights summing to 1."""
        logits = self.router.matvec(x, out=self.logits)
        # softmax in float64: the ranking and weights come from the same probabilities transformers has
        p = np.exp(logits - logits.max(), dtype=np.float64)
        p /= p.sum()
        top = np.argpartition(-p, self.k - 1)[: self.k]
        order = np.argsort(-p[top], kind="stable")
        self.top[:] = top[order]
        self.weights[:] = p[self.top]
        self.weights /= self.weights.sum()
        return self.top, self.weights

    def step(self, x: Input, counts: np.ndarray | None = None) -> np.ndarray:
        """y = sum_e w_e down_e(silu(gate_e x) * up_e x) + sigmoid(s . x) shared(x); counts[e] += 1 per routed e."""
        top, weights = self.route(x)
        if counts is not None:
            counts[top] += 1
        parts = self.parts
        if self.hits is not None:
            self.hits.run(self, x, top, parts)  # GPU hits beside CPU misses, each part the same bits (B2)
        else:
            for j, e in enumerate(top):
                self._expert(x, int(e), parts[j])
        out = self.out
        out[:] = 0
        for j, w in enumerate(weights):
            out += F32(w) * parts[j]
        if self.shared:
            s_gate, gate, up, down = self.shared
            s_gate.matvec(x, out=self.sh_g)
            gate.matvec(x, out=self.sh_gate)
            up.matvec(x, out=self.sh_up)
            self.sh_h.set(silu_(self.sh_gate) * self.sh_up)
            down.matvec(self.sh_h, out=self.part)
            out += sigmoid(self.sh_g)[0] * self.part
        return out

    def _expert(self, x: Input, e: int, out: np.ndarray) -> np.ndarray:
        """Expert e on one token, on the CPU (a miss) -> `out` f32 [E]."""
        gate_raw, up_raw, down_raw = self.pack.expert(self.layer, e)
        E, F = self.E, self.F
        act = x.form(self.gu)
        cpu.matvec(gate_raw, self.gu.id, E, F, act, out=self.gate)
        cpu.matvec(up_raw, self.gu.id, E, F, act, out=self.up)
        return cpu.matvec(down_raw, self.d.id, F, E, self.hidden(self.gate, self.up).form(self.d), out=out)

    def hidden(self, gate: np.ndarray, up: np.ndarray) -> Input:
        """silu(gate) * up as the down projection's input (gate is overwritten). A GPU hit makes its
        h here too, on the host, from its downloaded gate and up: one function, so the same bits."""
        silu_(gate)
        gate *= up
        return self.h.set(gate)


    # --- T tokens at once (the prompt path) -------------------------------------------------------

    def route_many(self, x: Input) -> tuple[np.ndarray, np.ndarray]:
        """(expert ids [T, k], weights [T, k]): `route` row by row (the same argpartition and stable
        argsort on the same float64 probabilities, so the same experts in the same order)."""
        logits = self.router.matmul(x)
        p = np.exp(logits - logits.max(axis=1, keepdims=True), dtype=np.float64)
        p /= p.sum(axis=1, keepdims=True)
        top = np.argpartition(-p, self.k - 1, axis=1)[:, : self.k]
        order = np.argsort(-np.take_along_axis(p, top, axis=1), axis=1, kind="stable")
        top = np.take_along_axis(top, order, axis=1)
        weights = np.take_along_axis(p, top, axis=1)
        weights /= weights.sum(axis=1, keepdims=True)
        return top, weights

    def forward_many(self, x: Input, counts: np.ndarray | None = None) -> np.ndarray:
        """`step` for T tokens -> f32 [T, E]. Expert by expert: each routed expert's weights are read
        once for all the tokens routed to it. Each (token, rank) output is kept apart and the sum is
        made rank by rank, as `step` makes it, so a token's result does not depend on its chunk."""
        top, weights = self.route_many(x)
        T = top.shape[0]
        if counts is not None:
            counts += np.bincount(top.reshape(-1), minlength=counts.size)
        flat = top.reshape(-1)
        order = np.argsort(flat, kind="stable")  # the (token, rank) pairs, expert by expert
        experts, first = np.unique(flat[order], return_index=True)
        starts = np.append(first, flat.size)
        rows = order // self.k
        if self.hits is not None:
            part = self.hits.run_many(self, x, experts, rows, starts)  # GPU hits beside CPU misses (B2)
        else:
            part = self._routed_many(x, experts, rows, starts)
        slot = np.empty(flat.size, np.int64)
        slot[order] = np.arange(flat.size)  # (token, rank) -> its row of part
        out = np.empty((T, self.E), F32)
        _combine(part, slot.reshape(T, self.k), weights, out)
        if self.shared:
            s_gate, gate, up, down = self.shared
            h = gate_(up.matmul(x), gate.matmul(x), silu=True)  # up silu(gate)
            out += sigmoid(s_gate.matmul(x)) * down.matmul(Input(h))
        return out

    def _routed_many(self, x: Input, experts: np.ndarray, rows: np.ndarray, starts: np.ndarray) -> np.ndarray:
        """Expert experts[g] on the tokens rows[starts[g]:starts[g + 1]] of x, for every g ->
        f32 [len(rows), E], row i the output of token rows[i] through its group's expert; each row
        bit-identical to `_expert` on that token alone. All the experts in one grouped kernel call
        per matrix (gate, up, down), reading the layer's expert tensors in place. Any subset of the
        chunk's experts may be passed (a GPU tier sends its hits elsewhere and the misses here)."""
        gate_all, up_all, down_all = self.pack.expert_tensors(self.layer)
        E, F = self.E, self.F
        act = x.form(self.gu)
        act = ActQ(act.q[rows], act.d[rows], act.s16[rows]) if isinstance(act, ActQ) else act[rows]
        gu_at = experts.astype(np.int64) * self.gu.nbytes((E, F))
        gate = cpu.matmul_grouped(gate_all, self.gu.id, E, F, gu_at, act, starts)
        h = gate_(cpu.matmul_grouped(up_all, self.gu.id, E, F, gu_at, act, starts), gate, silu=True)  # up silu(gate)
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


@cached_njit("moe-combine")
def _combine(part, slot, weights, out):
    # combine_reference into out, reading each part row in place: the numpy form gathered the
    # [T, k, E] outputs (26 MB for a 256-token chunk at production widths) and made a product
    # temporary per rank. Each element is the same f32 product and the same f32 sums in the same
    # order (no FMA: JIT has fastmath off), so the same bits.
    T, k = slot.shape
    for t in range(T):
        out[t] = F32(0)
        for j in range(k):
            w = F32(weights[t, j])
            row = part[slot[t, j]]
            for e in range(out.shape[1]):
                out[t, e] += w * row[e]

"""The MTP draft head (qwen35moe): the token after next, from the trunk's hidden state and the next token.

Semantics: llama.cpp 0.3.36's `graph_mtp` (src/models/qwen35moe.cpp), tensors as its converter
writes them (conversion/qwen.py _QwenMtpMixin: the checkpoint's mtp.* become layer blk.{n_layer}):

    e = RMSNorm(embed(token), enorm)          embed: nextn.embed_tokens, else the trunk's token_embd
    h = RMSNorm(h_trunk, hnorm)               h_trunk: the trunk's FINAL hidden state, after output_norm
    x = eh_proj [e | h]                       embedding first: eh_proj is [2 n_embd -> n_embd]
    x += attention(RMSNorm(x, attn_norm))     a full-attention layer (engine/model.py GatedAttention)
    x += moe(RMSNorm(x, post_attention_norm)) routed experts + gated shared expert (engine/moe.py MoE)
    y = RMSNorm(x, shared_head_norm)          else the trunk's output_norm
    logits = head y                           nextn.shared_head_head, else the trunk's output

The pair (h of position p, token at p + 1) predicts the token at p + 2. llama.cpp runs it at MTP
position p + 1 (common/speculative.cpp, draft-mtp: "pair (h_p, x_{p+1}) at MTP pos p+1"), so no pair
is at position 0. Here it runs at p: the head's own KV cache (its session state) is indexed by
position from 0, and a pair at p + 1 would leave slot 0 empty yet attended. Attention sees
positions only through RoPE, whose scores depend on the difference of the query's and the key's
positions, so shifting every pair by one is the same arithmetic (tests/engine/test_mtp.py compares with
the reference run at llama.cpp's positions). `hidden` after a step is y, the input h of the next
draft in a chain (llama.cpp feeds the head's h_nextn back).

Drafting, verification and rollback are engine/speculative.py's: this computes the draft logits,
with the engine's blocks and the pack's weight table.
"""

from __future__ import annotations

import numpy as np

from .backend import CpuBackend
from .batch import Seq
from .kernels.reference import dequantize
from .kvcache import KVCache
from .model import GatedAttention
from .moe import MoE
from .ops import Rope
from .pack_reader import Pack, PackError
from .weights import Input

F32 = np.float32


class MTPHead:
    """The pack's MTP block. `new_state(max_context, kv)` -> its KV cache; `step(state, h, token, pos)`
    -> draft logits f32 [n_vocab] (a view of this head's scratch, overwritten by the next step).
    `backend`: what its blocks compute with (engine/backend.py), the model's when it drafts for one."""

    def __init__(self, pack: Pack, backend=None):
        self.backend = backend if backend is not None else CpuBackend()
        g = pack.geometry
        if not g.n_mtp_layer:
            raise PackError(f"{pack.dir}: the model has no MTP block (its GGUF had nextn_predict_layers 0; a "
                            "separate MTP-only GGUF is packed with strata-pack convert --mtp PATH)")
        l, b = g.n_layer, f"blk.{g.n_layer}"
        self.E, self.eps = g.n_embd, g.rms_eps
        self.eh_proj = pack.weight(f"{b}.nextn.eh_proj.weight")
        self.enorm = pack.weight(f"{b}.nextn.enorm.weight").f32()
        self.hnorm = pack.weight(f"{b}.nextn.hnorm.weight").f32()
        self.attn_norm = pack.weight(f"{b}.attn_norm.weight").f32()
        self.ffn_norm = pack.weight(f"{b}.post_attention_norm.weight").f32()
        self.attn = GatedAttention(pack, l, Rope(g.n_rot, g.rope_freq_base))
        self.moe = MoE(pack, l)
        # the optional tensors: the block's own where it has them, else the trunk's (graph_mtp)
        self.embd = pack.weight(f"{b}.nextn.embed_tokens.weight" if g.mtp_embed_tokens else "token_embd.weight")
        self.head = pack.weight(f"{b}.nextn.shared_head_head.weight" if g.mtp_shared_head_head else "output.weight")
        self.head_norm = pack.weight(f"{b}.nextn.shared_head_norm.weight" if g.mtp_shared_head_norm
                                     else "output_norm.weight").f32()
        self.n_vocab = g.n_vocab
        # scratch, made once (S12), where the backend computes (the GPU tier's draft head: on the device)
        self.y = Input(self.backend.zeros((1, self.E), F32))  # the last pair's y: `hidden`
        self.hidden = self.y.x[0]
        self.logits = np.empty(g.n_vocab, F32)  # host: the drafter decides here (the top probability, the pick)
        # where the head's product goes: the host row itself, or on the device a row brought down after
        self._device = getattr(self.backend, "rt", None) is not None
        self._out = self.backend.zeros((1, g.n_vocab), F32) if self._device else self.logits.reshape(1, -1)
        self.routing = np.zeros(g.n_expert, np.int64)  # routed expert counts of the head's MoE
        self.piece = 0  # rows one forward of the block takes at most (0: all; the GPU tier's: its prompt chunk)
        # KV caches made at the GPU tier's startup (one a --batch request), each handed to a `new_state`
        # that fits and taken back by `give_back` when its drafter is done; `kept` of them at most
        self.spares: list = []
        self.kept = 0

    @classmethod
    def of(cls, model) -> "MTPHead":
        """The head a drafter for `model` uses: the GPU tier's on the device (Model.draft_head, placed
        at its startup: engine/tier/draft.py), else one of its own on the CPU."""
        return model.draft_head if model.draft_head is not None else cls(model.pack)

    def new_state(self, max_context: int, kv: str = "f32") -> KVCache:
        for i, s in enumerate(self.spares):
            if s.max_context == max_context and s.kind == kv:
                return self.spares.pop(i)
        return self.attn.new_state(self.backend, max_context, kv)

    def give_back(self, state: KVCache) -> None:
        """A finished drafter's KV cache, for the next `new_state` (strata serve's next request): the
        ones the tier placed stay placed rather than freed and made again. Its old entries need no
        clearing: a drafter writes each position's pair before any draft reads it."""
        if len(self.spares) < self.kept and all(state is not s for s in self.spares):
            self.spares.append(state)

    def step(self, state: KVCache, h: np.ndarray, token: int, pos: int) -> np.ndarray:
        """Draft logits for the token at position pos + 2, from h (the trunk's output-normed hidden
        state at position pos, or the previous draft's `hidden`) and `token` (the token at pos + 1).
        Writes the head's KV at slot pos: pairs go in position order, as the trunk's tokens do."""
        if not 0 <= token < self.n_vocab:
            raise ValueError(f"token id {token} outside the vocabulary 0..{self.n_vocab - 1}")
        h = np.asarray(h, F32).reshape(1, self.E) if isinstance(h, (np.ndarray, list, tuple)) else h.reshape(1, self.E)
        return self.forward(state, h, np.array([token]), pos)

    def _embed(self, tokens) -> np.ndarray:
        """The tokens' embedding rows, f32 [T, E]: a host-side read of the pack, as the trunk's."""
        tok = [int(t) for t in tokens]
        raw = self.embd.rows(tok[0], tok[0] + 1) if len(tok) == 1 else \
            np.concatenate([self.embd.rows(t, t + 1) for t in tok])
        return dequantize(raw, self.embd.type_id, len(tok) * self.E).reshape(len(tok), self.E)

    def forward(self, state: KVCache, h, tokens: np.ndarray, pos: int, logits: bool = True):
        """T pairs (h f32 [T, E], tokens int [T]) at head positions pos..pos + T - 1 in one batch
        (speculative decoding catches the head up on the verified positions and drafts from the last
        in one pass over its weights): their KV written, `hidden` = the last pair's y, and with
        `logits` the last pair's draft logits (else None). T = 1 is `step`. h: host rows, or the
        backend's own (the previous draft's `hidden` on the device)."""
        T = len(tokens)
        bad = [int(t) for t in tokens if not 0 <= t < self.n_vocab]
        if bad:
            raise ValueError(f"token id {bad[0]} outside the vocabulary 0..{self.n_vocab - 1}")
        if self.piece and T > self.piece:  # in pieces, in order: the same rows attend the same keys
            for a in range(0, T, self.piece):
                b = min(T, a + self.piece)
                out = self.forward(state, h[a:b], tokens[a:b], pos + a, logits and b == T)
            return out
        be = self.backend
        if T == 1 and hasattr(be, "verify_step"):  # the device's draft step: one replayed graph
            return self._device_step(state, h, tokens, pos, logits)
        self._block([Seq(state, 0, T, pos)], self._on(self._embed(tokens)), self._on(h), T, self.y,
                    self._out if logits else None)
        return self._finish(logits)

    def forward_rows(self, states: list, h: np.ndarray, tokens, poses) -> tuple[np.ndarray, np.ndarray]:
        """One pair each of B chains (strata serve's requests drafting together), pair i at head position
        poses[i] of states[i], in one pass over the block's and the head's weights -> (the draft logits
        f32 [B, n_vocab], y f32 [B, E]: each chain's next h), arrays of their own. Each row's numbers
        are the ones `forward` gives its pair alone: a product keeps a row's bits whatever its batch,
        the attention reads each row's own cache and the MoE sums each row apart (as the trunk's
        forward_batch). The head on the host only (on the device step each draft is a replayed graph)."""
        if self._device:
            raise ValueError("MTPHead.forward_rows: the head on the device drafts chain by chain (its captured steps)")
        B = len(states)
        bad = [int(t) for t in tokens if not 0 <= t < self.n_vocab]
        if bad:
            raise ValueError(f"token id {bad[0]} outside the vocabulary 0..{self.n_vocab - 1}")
        y, out = Input(np.empty((B, self.E), F32)), np.empty((B, self.n_vocab), F32)
        seqs = [Seq(st, i, i + 1, int(p)) for i, (st, p) in enumerate(zip(states, poses, strict=True))]
        self._block(seqs, self._embed(tokens), np.ascontiguousarray(h, F32).reshape(B, self.E), B, y, out)
        if self.backend.experts is not None:
            self.backend.experts.settle()
        return out, y.x

    def _block(self, seqs: list, e, h, T: int, y: Input, out) -> None:
        """The block on T pairs of the sequences `seqs` (Seq: rows, head KV cache, position) whose
        embedding rows e and head inputs h are the backend's: the last rows' y into `y` (as many as it
        has rows), and with `out` their draft logits there."""
        be, E, eps, sc = self.backend, self.E, self.eps, self.backend.scratch
        en, hn = sc("mtp.e", (T, E)), sc("mtp.h", (T, E))
        be.rmsnorm(e, self.enorm, eps, en)
        be.rmsnorm(h, self.hnorm, eps, hn)
        cat = sc("mtp.cat", (T, 2 * E))
        cat[:, :E] = en  # embedding first (ggml_concat(e_norm, h_norm))
        cat[:, E:] = hn
        x = be.linear(self.eh_proj, Input(cat), sc("mtp.x", (T, E)))
        xin = sc("mtp.xin", (T, E))
        be.rmsnorm(x, self.attn_norm, eps, xin)
        x += self.attn.forward(be, seqs, Input(xin))
        be.rmsnorm(x, self.ffn_norm, eps, xin)
        x += self.moe.forward(be, Input(xin), self.routing)
        be.rmsnorm(x[T - y.x.shape[0] :], self.head_norm, eps, y.x)
        if out is not None:
            be.linear(self.head, y.changed(), out)

    def _finish(self, logits: bool, settle: bool = True):
        """After the block: the draft logits on the host (or None), the head's routing counts settled
        (`settle` False: the caller settles them after its own wait)."""
        be, out = self.backend, None
        if logits:
            if self._device:
                self.logits[...] = be.host(self._out)[0]
            out = self.logits
        if settle and be.experts is not None:  # what the expert server owes the head's counts
            be.experts.settle()
        return out

    @property
    def picks(self) -> bool:
        """Whether `pick` makes a greedy draft where the logits are (the head on the device step)."""
        return self._device and hasattr(self.backend, "queue_top_prob")

    def pick(self, state: KVCache, h, token: int, pos: int, banned: np.ndarray) -> tuple[int, float]:
        """`step` with the draft picked on the device -> (the greedy token, never one of the banned
        ids; the draft logits' top probability at temperature 1, as MTPDrafter computes it from the
        logits in float64). 12 + 8 bytes come down, not the vocabulary's logits: on seed-4l's
        248320-word vocabulary those were a 1 MB copy and a float64 softmax on the host at every
        draft, beside a ~1 ms token step. Only where `picks`."""
        if not 0 <= token < self.n_vocab:
            raise ValueError(f"token id {token} outside the vocabulary 0..{self.n_vocab - 1}")
        be = self.backend
        be.pick_rows_ready(1, banned)  # (their buffers made before a capture)
        be.top_prob_ready()
        self._device_step(state, h, np.array([token]), pos, True, banned, settle=False)
        ex = be.experts
        for queue in ("queue_settle", "queue_rows_settle"):  # the routing ids' copy queued before the wait,
            if hasattr(ex, queue):  # read after it by settle, which made a copy and wait of its own a draft
                getattr(ex, queue)()
        be.rt.synchronize()
        if ex is not None:
            ex.settle()
        return int(be.picked_rows(1, banned)[0]), be.top_prob()

    def _device_step(self, state: KVCache, h, tokens, pos: int, logits: bool, pick: np.ndarray | None = None,
                     settle: bool = True):
        """One pair on the device step's backend as a verify of one row (DeviceBackend.verify_step):
        its inputs staged into fixed buffers and its position read from the position buffer, so the
        step is captured once and replayed (where the backend's verify_graphs allow), not launched
        from Python block by block: some 30 launches, and on an H100 the trunk's eager token step
        spent ~50 us a launch (4.1 ms for 78, 2026-12-05), against 1.1 ms for its captured step.
        `pick` (banned ids): the draft's pick and top probability queued after the logits (`pick`),
        which stay on the device; a kind of step of its own."""
        be, E = self.backend, self.E
        e = be.stage_in("mtp.embd", self._embed(tokens))
        hb = be.verify_buf("mtp.h_in", (1, E))
        if isinstance(h, np.ndarray):
            be.stage_in("mtp.h_in", np.asarray(h, F32).reshape(1, E))
        else:  # the chain's previous y, already on the device: copied in, queued
            hb[...] = h.reshape(1, E)

        def run():
            self._block([Seq(state, 0, 1, pos)], e, hb, 1, self.y, self._out if logits else None)
            if pick is not None:
                be.queue_pick_rows(self._out, pick)
                be.queue_top_prob(self._out[0])

        key = ("mtp", logits) if pick is None else ("mtp", logits, "pick", id(pick))
        be.verify_step(state, pos, 1, run, key, hold=(e, hb) if pick is None else (e, hb, pick))
        return self._finish(logits and pick is None, settle)

    def _on(self, a):
        """A host array as the backend's (uploaded to the device; the CPU's as it is)."""
        if isinstance(a, np.ndarray):
            a = np.ascontiguousarray(a, F32)
            return self.backend.upload(a) if self._device else a
        return a

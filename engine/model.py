"""The model: one token through every layer, with all per-sequence state in a Session.

    token -> embedding -> [layer 0 .. L-1] -> head input -> LM head -> logits

A layer is  token mixer (Gated DeltaNet, or gated full attention every `interval`-th layer)  then
MoE, joined by the architecture's residual scheme:
  qwen35moe  pre-norm residual:  h += mixer(norm(h));  h += moe(norm(h));  head reads norm(h)
  qwen4exp   hyper-connections:  hc streams mixed into the block input and injected back
             (engine/hyper.py), plus QSA indexed attention (engine/qsa.py) and PLE (engine/ple.py).
The residual is an object with enter/leave per sub-block, so the mixers and the MoE are shared by
both architectures and only the residual (and qwen4exp's extra components) differ.

S12: a Session makes its state and scratch once (the KV cache is sized for max_context up front);
a step writes into them and returns a view of the session's logits buffer.

Two ways through the same weights and state: `step` (one token: the decode path, and the prompt
with --prefill off) and `forward` (T tokens at once: the prompt path, B1). In `forward` every
matrix multiplies all T tokens at once (ActQ made per token row, exactly as for one token), the MoE
runs expert by expert over the tokens routed to it, Gated DeltaNet uses the chunked delta rule, and
attention takes the T queries together. The two agree to float32 rounding (tests/test_prefill.py).
"""

from __future__ import annotations

import numpy as np

from strata.index_format.geometry import ModelGeometry

from .ops import ATTN_TILE_BYTES
from .hyper import HyperConnection
from .kernels.reference import dequantize
from .kvcache import KVCache
from .moe import MoE
from .ops import (Rope, attend, attend_many, causal_mask, chunk_delta_rule, conv_many, delta_rule_step, gate_sigmoid,
                  gate_silu, gated_rmsnorm_, l2norm_, rmsnorm, sigmoid, softplus)
from .pack import Pack
from .ple import PLELayer, PLEState, TableRows
from .qsa import QSACache, QSALayer
from .weights import Input

F32 = np.float32
# Model.warm_up's prompt chunks: copies of one token (routed nearly alike: many tokens per
# matrix) and distinct tokens (about one per routed expert)
WARM_SAME, WARM_DISTINCT = 16, 8


class ContextFull(RuntimeError):
    """A step past the session's max_context (the KV cache is sized once, never grown)."""


# --- token mixers ------------------------------------------------------------------------------------


class GatedDeltaNet:
    """A linear-attention layer: in_proj -> causal conv + SiLU -> gated delta rule -> gated RMSNorm -> out.

    State per session: conv f32 [K-1, C] (the last K-1 inputs), S f32 [nv, dv, dk]. `gate_act` is the
    output-gate activation, not stored in the GGUF: SiLU for qwen35moe, sigmoid for qwen4exp."""

    def __init__(self, pack: Pack, layer: int, gate_act):
        g, b = pack.geometry, f"blk.{layer}"
        self.nk, self.nv, self.dk, self.dv = g.ssm_n_k_heads, g.ssm_n_v_heads, g.ssm_d_state, g.ssm_head_v_dim
        self.K, self.C, self.eps, self.gate_act = g.ssm_d_conv, g.ssm_conv_channels, g.rms_eps, gate_act
        self.qkv = pack.weight(f"{b}.attn_qkv.weight")
        self.z = pack.weight(f"{b}.attn_gate.weight")
        self.beta = pack.weight(f"{b}.ssm_beta.weight")
        self.alpha = pack.weight(f"{b}.ssm_alpha.weight")
        self.out = pack.weight(f"{b}.ssm_out.weight")
        self.conv_w = np.ascontiguousarray(pack.weight(f"{b}.ssm_conv1d.weight").f32().T)  # torch [C, K] -> [K, C]
        self.a = pack.weight(f"{b}.ssm_a").f32()  # -exp(A_log)
        self.dt_bias = pack.weight(f"{b}.ssm_dt.bias").f32()
        self.norm = pack.weight(f"{b}.ssm_norm.weight").f32()
        # scratch shared by every session (one token at a time)
        self.mixed = np.empty((1, self.C), F32)
        self.zv = np.empty((self.nv, self.dv), F32)
        self.bv = np.empty(self.nv, F32)
        self.av = np.empty(self.nv, F32)
        self.o = Input(np.empty(self.nv * self.dv, F32))
        self.y = np.empty(g.n_embd, F32)

    def new_state(self, max_context: int, kv: str) -> dict[str, np.ndarray]:
        return {"conv": np.zeros((self.K - 1, self.C), F32), "S": np.zeros((self.nv, self.dv, self.dk), F32)}

    def _qkv(self, c: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Conv output [T, C] -> q, k [T, nk, dk] (l2-normalised, q scaled by dk^-1/2), v [T, nv, dv]."""
        nk, dk, T = self.nk, self.dk, c.shape[0]
        q = l2norm_(c[:, : nk * dk].reshape(T, nk, dk))
        q *= F32(dk**-0.5)
        k = l2norm_(c[:, nk * dk : 2 * nk * dk].reshape(T, nk, dk))
        return q, k, c[:, 2 * nk * dk :].reshape(T, self.nv, self.dv)

    def step(self, state: dict[str, np.ndarray], x: Input, pos: int) -> np.ndarray:
        self.qkv.matvec(x, out=self.mixed[0])
        self.z.matvec(x, out=self.zv.reshape(-1))
        self.beta.matvec(x, out=self.bv)
        self.alpha.matvec(x, out=self.av)
        q, k, v = self._qkv(conv_many(state["conv"], self.conv_w, self.mixed))
        beta = sigmoid(self.bv)
        decay = self.a * softplus(self.av + self.dt_bias)
        o = self.o.x.reshape(self.nv, self.dv)
        delta_rule_step(state["S"], q[0], k[0], v[0], decay, beta, o)
        gated_rmsnorm_(o, self.norm, self.zv, self.eps, self.gate_act)
        return self.out.matvec(self.o.changed(), out=self.y)

    def forward_many(self, state: dict[str, np.ndarray], x: Input, pos: int) -> np.ndarray:
        """T tokens: the same projections as matrix products, the chunked delta rule -> f32 [T, E]."""
        T = x.x.shape[0]
        q, k, v = self._qkv(conv_many(state["conv"], self.conv_w, self.qkv.matmul(x)))
        z = self.z.matmul(x).reshape(T, self.nv, self.dv)
        beta = sigmoid(self.beta.matmul(x))
        decay = self.a * softplus(self.alpha.matmul(x) + self.dt_bias)
        o = chunk_delta_rule(state["S"], q, k, v, decay, beta)
        gated_rmsnorm_(o, self.norm, z, self.eps, self.gate_act)
        return self.out.matmul(Input(o.reshape(T, -1)))


class GatedAttention:
    """Full attention with q/k RMSNorm, partial NeoX RoPE, a KV cache, and a sigmoid output gate.

    attn_q holds, per head h, rows [h*2D, h*2D + D) = query and [h*2D + D, (h+1)*2D) = gate.
    State per session: a KVCache (engine/kvcache.py: f32, f16 or int8) for max_context tokens."""

    def __init__(self, pack: Pack, layer: int, rope: Rope):
        g, b = pack.geometry, f"blk.{layer}"
        self.H, self.Hkv, self.D, self.eps, self.rope = g.n_head, g.n_head_kv, g.head_dim, g.rms_eps, rope
        self.wq = pack.weight(f"{b}.attn_q.weight")
        self.wk = pack.weight(f"{b}.attn_k.weight")
        self.wv = pack.weight(f"{b}.attn_v.weight")
        self.wo = pack.weight(f"{b}.attn_output.weight")
        self.q_norm = pack.weight(f"{b}.attn_q_norm.weight").f32()  # (1 + w), folded
        self.k_norm = pack.weight(f"{b}.attn_k_norm.weight").f32()
        self.qg = np.empty((self.H, 2 * self.D), F32)
        self.q = np.empty((self.H, self.D), F32)
        self.k = np.empty((1, self.Hkv, self.D), F32)
        self.v = np.empty((1, self.Hkv, self.D), F32)
        self.att = Input(np.empty(self.H * self.D, F32))
        self.y = np.empty(g.n_embd, F32)

    def new_state(self, max_context: int, kv: str) -> KVCache:
        return KVCache(kv, max_context, self.Hkv, self.D)

    def step(self, cache: KVCache, x: Input, pos: int) -> np.ndarray:
        self.wq.matvec(x, out=self.qg.reshape(-1))
        self.wk.matvec(x, out=self.k.reshape(-1))
        self.wv.matvec(x, out=self.v.reshape(-1))
        rmsnorm(self.qg[:, : self.D], self.q_norm, self.eps, out=self.q)
        rmsnorm(self.k, self.k_norm, self.eps, out=self.k)
        self.rope.at(pos)
        self.rope.apply_(self.q)
        self.rope.apply_(self.k[0])
        cache.write(pos, self.k, self.v)
        K, V = cache.read(slice(0, pos + 1))
        out = self.att.x.reshape(self.H, self.D)
        attend(self.q, K, V, self.D**-0.5, out=out)
        out *= sigmoid(self.qg[:, self.D :])
        return self.wo.matvec(self.att.changed(), out=self.y)

    def forward_many(self, cache: KVCache, x: Input, pos: int) -> np.ndarray:
        """T tokens at positions pos..: projections as matrix products, the T queries attend together."""
        H, Hkv, D, T = self.H, self.Hkv, self.D, x.x.shape[0]
        positions = pos + np.arange(T)
        qg = self.wq.matmul(x).reshape(T, H, 2 * D)
        q = rmsnorm(qg[:, :, :D], self.q_norm, self.eps, out=np.empty((T, H, D), F32))
        k = self.wk.matmul(x).reshape(T, Hkv, D)
        rmsnorm(k, self.k_norm, self.eps, out=k)
        self.rope.apply_many_(q, positions)
        self.rope.apply_many_(k, positions)
        cache.write(pos, k, self.wv.matmul(x).reshape(T, Hkv, D))
        K, V = cache.read(slice(0, pos + T))
        o = attend_many(q, K, V, D**-0.5, causal_mask(pos, T, pos + T), ATTN_TILE_BYTES)
        o *= sigmoid(qg[:, :, D:])
        return self.wo.matmul(Input(o.reshape(T, H * D)))


class QSAAttention:
    """A qwen4exp full-attention layer: engine/qsa.py's QSALayer (indexer, block selection, gated
    attention) behind the mixer interface. State per session: its QSACache, sized for max_context."""

    def __init__(self, pack: Pack, layer: int):
        self.geometry = pack.geometry
        self.qsa = QSALayer(layer, pack.weights, pack.geometry)

    def new_state(self, max_context: int, kv: str) -> QSACache:
        return QSACache.for_geometry(self.geometry, max_context, kv)

    def step(self, state: QSACache, x: Input, pos: int) -> np.ndarray:
        # the Input goes to the Weights as is: the five projections of x share one ActQ
        return self.qsa.step(x, state)

    def forward_many(self, state: QSACache, x: Input, pos: int) -> np.ndarray:
        return self.qsa.forward_many(x, state)


# --- residual schemes --------------------------------------------------------------------------------


class PreNormResidual:
    """qwen35moe: h += mixer(attn_norm(h)); h += moe(post_attention_norm(h)); the head reads output_norm(h)."""

    def __init__(self, pack: Pack):
        g = pack.geometry
        self.eps = g.rms_eps
        self.attn_norm = [pack.weight(f"blk.{l}.attn_norm.weight").f32() for l in range(g.n_layer)]
        self.ffn_norm = [pack.weight(f"blk.{l}.post_attention_norm.weight").f32() for l in range(g.n_layer)]
        self.out_norm = pack.weight("output_norm.weight").f32()
        self.xin = Input(np.empty(g.n_embd, F32))
        self.head_in = np.empty(g.n_embd, F32)

    def new_stream(self) -> np.ndarray:
        return np.zeros(self.out_norm.shape, F32)

    def embed(self, h: np.ndarray, e: np.ndarray) -> None:
        h[:] = e

    def embed_many(self, e: np.ndarray) -> np.ndarray:
        return e.copy()

    def enter(self, h: np.ndarray, layer: int, ffn: bool) -> Input:
        gain = (self.ffn_norm if ffn else self.attn_norm)[layer]
        rmsnorm(h, gain, self.eps, out=self.xin.x)
        return self.xin.changed()

    def leave(self, h: np.ndarray, layer: int, ffn: bool, y: np.ndarray) -> None:
        h += y

    def final(self, h: np.ndarray) -> np.ndarray:
        return rmsnorm(h, self.out_norm, self.eps, out=self.head_in)

    # T tokens at once (the prompt path): rows [T, E]; `ctx` carries nothing here
    def enter_many(self, H: np.ndarray, layer: int, ffn: bool) -> tuple[Input, None]:
        gain = (self.ffn_norm if ffn else self.attn_norm)[layer]
        return Input(rmsnorm(H, gain, self.eps, out=np.empty_like(H))), None

    def leave_many(self, H: np.ndarray, layer: int, ffn: bool, Y: np.ndarray, ctx: None) -> None:
        H += Y

    def final_many(self, H: np.ndarray) -> np.ndarray:
        return rmsnorm(H, self.out_norm, self.eps, out=np.empty_like(H))


class HyperResidual:
    """qwen4exp: hc residual streams (engine/hyper.py). Before each block its hyper-connection mixes
    the streams into the block input; after it, injects the output back into every stream with the
    weights the mix computed. The head reads the final mixer's output (there is no output_norm)."""

    def __init__(self, pack: Pack):
        g, w = pack.geometry, pack.weights
        self.hc, self.E = g.hc, g.n_embd
        self.attn = [HyperConnection.from_tensors(w, f"blk.{l}.hc_attn", g) for l in range(g.n_layer)]
        self.ffn = [HyperConnection.from_tensors(w, f"blk.{l}.hc_ffn", g) for l in range(g.n_layer)]
        self.out = HyperConnection.from_tensors(w, "output_hc", g, inject=False)
        self.xin = Input(np.empty(g.n_embd, F32))
        self.inject_w: np.ndarray | None = None  # between enter and leave of one block

    def new_stream(self) -> np.ndarray:
        return np.zeros(self.hc * self.E, F32)

    def embed(self, h: np.ndarray, e: np.ndarray) -> None:
        h.reshape(self.hc, self.E)[:] = e  # transformers: embedding.repeat(1, 1, hc)

    def embed_many(self, e: np.ndarray) -> np.ndarray:
        return np.tile(e, self.hc)  # [T, hc*E]: every stream starts as the token's embedding

    def enter(self, h: np.ndarray, layer: int, ffn: bool) -> Input:
        x, self.inject_w = (self.ffn if ffn else self.attn)[layer].mix(h)
        return self.xin.set(x)

    def leave(self, h: np.ndarray, layer: int, ffn: bool, y: np.ndarray) -> None:
        (self.ffn if ffn else self.attn)[layer].inject(h, y, self.inject_w)

    def final(self, h: np.ndarray) -> np.ndarray:
        return self.out.mix(h)[0]

    # T tokens at once (the prompt path): streams [T, hc*E]; `ctx` is the mix's injection weights [T, hc]
    def enter_many(self, H: np.ndarray, layer: int, ffn: bool) -> tuple[Input, np.ndarray]:
        x, w = (self.ffn if ffn else self.attn)[layer].mix_many(H)
        return Input(x), w

    def leave_many(self, H: np.ndarray, layer: int, ffn: bool, Y: np.ndarray, w: np.ndarray) -> None:
        (self.ffn if ffn else self.attn)[layer].inject_many(H, Y, w)

    def final_many(self, H: np.ndarray) -> np.ndarray:
        return self.out.mix_many(H)[0]


# --- the model ---------------------------------------------------------------------------------------


class Session:
    """Everything one sequence owns: position, per-layer state, the residual stream, the logits
    buffer, and per-layer expert routing counts ([n_layer, n_expert], for --stats).

    `kv` is the KV cache kind (engine/kvcache.py): f32 (exact), f16 or int8. The Gated DeltaNet,
    conv, QSA indexer and PLE states are f32 whatever it is."""

    def __init__(self, model: Model, max_context: int, kv: str = "f32"):
        if max_context < 1:
            raise ValueError(f"max_context {max_context}: expected at least 1")
        g = model.geometry
        self.max_context, self.kv = max_context, kv
        self.pos = 0
        self.states = [m.new_state(max_context, kv) for m in model.mixers]
        self.ple_states = {l: PLEState.for_geometry(g) for l in model.ple}
        self.stream = model.residual.new_stream()
        self.embedding = np.empty(g.n_embd, F32)
        self.logits = np.empty(g.n_vocab, F32)
        self.routing = np.zeros((g.n_layer, g.n_expert), np.int64)

    def memory(self) -> dict[str, int]:
        """Bytes of the session's state, measured from its arrays, under the keys of strata-budget's
        session items (engine/budget.py), which predict them; `scratch` (QSA top-k indices, PLE token
        windows) is in no plan item."""
        m = dict.fromkeys(("session.kv", "session.gdn_state", "session.conv_state"), 0)
        m["scratch"] = sum(p.window.nbytes for p in self.ple_states.values())
        for st in self.states:
            if isinstance(st, QSACache):
                for key, n in st.memory().items():
                    m[key] = m.get(key, 0) + n
            elif isinstance(st, KVCache):
                m["session.kv"] += st.nbytes
            else:
                m["session.gdn_state"] += st["S"].nbytes
                m["session.conv_state"] += st["conv"].nbytes
        if self.ple_states:
            m["session.ple_state"] = sum(p.ring.nbytes for p in self.ple_states.values())
        m["session.stream"] = self.stream.nbytes
        return m


class Model:
    """Weights and per-layer blocks of one pack; `step(session, token)` -> logits f32 [n_vocab],
    `forward(session, tokens)` -> the logits of the last positions of a batch of tokens."""

    def __init__(self, pack: Pack):
        g: ModelGeometry = pack.geometry
        self.pack, self.geometry = pack, g
        qwen4exp = g.arch == "qwen4exp"
        # the GDN output-gate activation is not in the GGUF: sigmoid for qwen4exp as released, SiLU for qwen35moe
        gate_act = gate_sigmoid if qwen4exp else gate_silu
        rope = Rope(g.n_rot, g.rope_freq_base)
        self.mixers = [
            (QSAAttention(pack, l) if qwen4exp else GatedAttention(pack, l, rope)) if g.is_full_attention(l)
            else GatedDeltaNet(pack, l, gate_act)
            for l in range(g.n_layer)
        ]
        self.moes = [MoE(pack, l) for l in range(g.n_layer)]
        self.residual = HyperResidual(pack) if qwen4exp else PreNormResidual(pack)
        self.ple = _ple_layers(pack)  # {layer: PLELayer}, qwen4exp only
        self.embd = pack.weight("token_embd.weight")
        self.head = pack.weight("output.weight")

    def new_session(self, max_context: int, kv: str = "f32") -> Session:
        return Session(self, max_context, kv)

    def warm_up(self, prompt_path: bool = True, token: bool = True) -> None:
        """Throwaway work in scratch sessions, so the kernels compile (Numba, on first call) or load
        from the disk cache while loading, not inside the first tokens' time: `warm_up_token`, then
        with `prompt_path` `warm_up_prompt`, else the steps up to QSA's first block selection.
        Without the prompt chunks the prompt path compiled inside the first prompt on a fresh
        install: seed-4l's first 1024 tokens took 36 s, then 3 s (2026-11-30). `token` False: the
        token step was warmed up already (engine/warm.py)."""
        if token:
            self.warm_up_token()
        if prompt_path:
            self.warm_up_prompt()
        elif self.geometry.idx_compress_ratio:
            # QSA selects blocks only once one is complete: step up to it (without the prompt
            # path, whose chunk would get there in one call)
            s = self.new_session(self.geometry.idx_compress_ratio + 1)
            for _ in range(self.geometry.idx_compress_ratio + 1):
                self.step(s, 0)

    def warm_up_token(self) -> None:
        """One token step: every kernel of the token path but QSA's block selection."""
        self.step(self.new_session(1), 0)

    def warm_up_prompt(self, select: bool = True) -> None:
        """Two prompt chunks: copies of one token, which route nearly alike (many tokens per expert:
        the panel kernels, grouped), at least a QSA block long, then WARM_DISTINCT different
        tokens, about one per expert (the row kernels); with `select`, one token step after them,
        which selects among the complete blocks (QSA's top-k). The warm-up took 33-65 throwaway
        token steps to reach a complete block before (~11 s of a 17-43 s warm start of the demo)."""
        same = max(WARM_SAME, self.geometry.idx_compress_ratio)
        s = self.new_session(same + WARM_DISTINCT + 1)
        self.forward(s, np.zeros(same, np.int64), n_logits=0)
        self.forward(s, np.arange(1, WARM_DISTINCT + 1) % self.geometry.n_vocab, n_logits=1)
        if select:
            self.step(s, 0)

    def _check(self, s: Session, tokens) -> None:
        if s.pos + len(tokens) > s.max_context:
            raise ContextFull(f"position {s.pos + len(tokens) - 1}: the session's context is {s.max_context} tokens "
                              "(--ctx-size)")
        bad = [t for t in tokens if not 0 <= t < self.geometry.n_vocab]
        if bad:
            raise ValueError(f"token id {bad[0]} outside the vocabulary 0..{self.geometry.n_vocab - 1}")

    def step(self, s: Session, token: int) -> np.ndarray:
        """Feed `token` at position s.pos; returns the logits for the next position (s.logits)."""
        self._check(s, (token,))
        g, r, h = self.geometry, self.residual, s.stream
        s.embedding[:] = dequantize(self.embd.rows(token, token + 1), self.embd.type_id, g.n_embd)
        r.embed(h, s.embedding)
        for l in range(g.n_layer):
            if l in self.ple:
                self.ple[l].step(h, token, s.ple_states[l])  # adds to the streams before the layer's mix
            y = self.mixers[l].step(s.states[l], r.enter(h, l, ffn=False), s.pos)
            r.leave(h, l, False, y)
            y = self.moes[l].step(r.enter(h, l, ffn=True), s.routing[l])
            r.leave(h, l, True, y)
        self.head.matvec(r.final(h), out=s.logits)
        s.pos += 1
        return s.logits

    def forward(self, s: Session, tokens, n_logits: int = 1) -> np.ndarray:
        """Feed T tokens at positions s.pos.. in one batch; returns the logits of the last `n_logits`
        positions, f32 [n_logits, n_vocab] (0 <= n_logits <= T: the LM head runs only for those).

        The prompt path; `step` is the decode path (S12: it allocates nothing), this one makes its
        chunk's buffers as it goes."""
        tokens = np.asarray(tokens, np.int64).reshape(-1)
        T = tokens.size
        if not 0 <= n_logits <= T:
            raise ValueError(f"forward: n_logits {n_logits} outside 0..{T} (the tokens fed)")
        self._check(s, tokens.tolist())
        g, r = self.geometry, self.residual
        # the T rows' bytes in one decode (a row decodes alone: the same values as one at a time)
        raw = np.concatenate([self.embd.rows(t, t + 1) for t in tokens.tolist()])
        emb = dequantize(raw, self.embd.type_id, T * g.n_embd).reshape(T, g.n_embd)
        H = r.embed_many(emb)
        for l in range(g.n_layer):
            if l in self.ple:
                self.ple[l].forward_many(H, tokens, s.ple_states[l])
            x, ctx = r.enter_many(H, l, ffn=False)
            r.leave_many(H, l, False, self.mixers[l].forward_many(s.states[l], x, s.pos), ctx)
            x, ctx = r.enter_many(H, l, ffn=True)
            r.leave_many(H, l, True, self.moes[l].forward_many(x, s.routing[l]), ctx)
        s.pos += T
        if n_logits == 0:
            return np.empty((0, g.n_vocab), F32)
        return self.head.matmul(np.ascontiguousarray(r.final_many(H[T - n_logits :])))


def _ple_layers(pack: Pack) -> dict[int, PLELayer]:
    g, t = pack.geometry, pack.ple
    if not g.ple_layers:
        return {}
    if t.type.quantized:
        rows = _BlockRows(pack)
    else:
        rows = TableRows(pack.ple_table(), t.type_id, t.row_dim, t.rows, where=f"{t.name} in {t.file}")
    return {l: PLELayer(l, pack.weights, g, rows) for l in g.ple_layers}


class _BlockRows:
    """PLE table rows of a block type (a quantized table), each dequantized from its bytes in the
    mapped shard when a token reads it (exact: the reference decoder); a token reads a few rows."""

    def __init__(self, pack: Pack):
        self.t = pack.ple
        self.table = pack.ple_table().reshape(self.t.rows, self.t.row_bytes)  # a view: only the rows read are touched

    def __call__(self, row_ids: np.ndarray) -> np.ndarray:
        if row_ids.size and not (0 <= row_ids.min() and row_ids.max() < self.t.rows):
            raise IndexError(f"PLE rows {row_ids.min()}..{row_ids.max()}: the table has {self.t.rows}")
        # the rows' bytes in one gather (a Python call per row took 3 ms for a 256-token chunk)
        raw = self.table[row_ids].reshape(-1)
        return dequantize(raw, self.t.type_id, row_ids.size * self.t.row_dim).reshape(row_ids.size, self.t.row_dim)

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
"""

from __future__ import annotations

import numpy as np

from strata.index_format.geometry import ModelGeometry

from .hyper import HyperConnection
from .kernels.reference import dequantize
from .moe import MoE
from .ops import Rope, attend, conv_step, delta_rule_step, gate_sigmoid, gate_silu, gated_rmsnorm_, l2norm_, rmsnorm, sigmoid, softplus
from .pack import Pack
from .ple import PLELayer, PLEState, TableRows
from .qsa import QSACache, QSALayer
from .weights import Input

F32 = np.float32


class ContextFull(RuntimeError):
    """A step past the session's max_context (the KV cache is sized once, never grown)."""


# --- token mixers ------------------------------------------------------------------------------------


class GatedDeltaNet:
    """A linear-attention layer: in_proj -> causal conv + SiLU -> gated delta rule -> gated RMSNorm -> out.

    State per session: conv f32 [K, C] (last K-1 inputs), S f32 [nv, dv, dk]. `gate_act` is the
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
        self.mixed = np.empty(self.C, F32)
        self.conv_out = np.empty(self.C, F32)
        self.zv = np.empty((self.nv, self.dv), F32)
        self.bv = np.empty(self.nv, F32)
        self.av = np.empty(self.nv, F32)
        self.o = Input(np.empty(self.nv * self.dv, F32))
        self.y = np.empty(g.n_embd, F32)

    def new_state(self, max_context: int) -> dict[str, np.ndarray]:
        return {"conv": np.zeros((self.K, self.C), F32), "S": np.zeros((self.nv, self.dv, self.dk), F32)}

    def step(self, state: dict[str, np.ndarray], x: Input, pos: int) -> np.ndarray:
        nk, dk = self.nk, self.dk
        self.qkv.matvec(x, out=self.mixed)
        self.z.matvec(x, out=self.zv.reshape(-1))
        self.beta.matvec(x, out=self.bv)
        self.alpha.matvec(x, out=self.av)
        c = conv_step(state["conv"], self.conv_w, self.mixed, out=self.conv_out)
        q = l2norm_(c[: nk * dk].reshape(nk, dk))
        q *= F32(dk**-0.5)
        k = l2norm_(c[nk * dk : 2 * nk * dk].reshape(nk, dk))
        v = c[2 * nk * dk :].reshape(self.nv, self.dv)
        beta = sigmoid(self.bv)
        decay = self.a * softplus(self.av + self.dt_bias)
        o = self.o.x.reshape(self.nv, self.dv)
        delta_rule_step(state["S"], q, k, v, decay, beta, o)
        gated_rmsnorm_(o, self.norm, self.zv, self.eps, self.gate_act)
        return self.out.matvec(self.o.changed(), out=self.y)


class GatedAttention:
    """Full attention with q/k RMSNorm, partial NeoX RoPE, a KV cache, and a sigmoid output gate.

    attn_q holds, per head h, rows [h*2D, h*2D + D) = query and [h*2D + D, (h+1)*2D) = gate.
    State per session: K, V f32 [Hkv, max_context, D] (f32 for now; --kv int8 comes later)."""

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
        self.k = np.empty((self.Hkv, self.D), F32)
        self.v = np.empty((self.Hkv, self.D), F32)
        self.att = Input(np.empty(self.H * self.D, F32))
        self.y = np.empty(g.n_embd, F32)

    def new_state(self, max_context: int) -> dict[str, np.ndarray]:
        shape = (self.Hkv, max_context, self.D)
        return {"K": np.zeros(shape, F32), "V": np.zeros(shape, F32)}

    def step(self, state: dict[str, np.ndarray], x: Input, pos: int) -> np.ndarray:
        K, V = state["K"], state["V"]
        self.wq.matvec(x, out=self.qg.reshape(-1))
        self.wk.matvec(x, out=self.k.reshape(-1))
        self.wv.matvec(x, out=self.v.reshape(-1))
        rmsnorm(self.qg[:, : self.D], self.q_norm, self.eps, out=self.q)
        rmsnorm(self.k, self.k_norm, self.eps, out=K[:, pos])
        self.rope.at(pos)
        self.rope.apply_(self.q)
        self.rope.apply_(K[:, pos])
        V[:, pos] = self.v
        out = self.att.x.reshape(self.H, self.D)
        attend(self.q, K, V, pos + 1, self.D**-0.5, out=out)
        out *= sigmoid(self.qg[:, self.D :])
        return self.wo.matvec(self.att.changed(), out=self.y)


class QSAAttention:
    """A qwen4exp full-attention layer: engine/qsa.py's QSALayer (indexer, block selection, gated
    attention) behind the mixer interface. State per session: its QSACache, sized for max_context."""

    def __init__(self, pack: Pack, layer: int):
        self.geometry = pack.geometry
        self.qsa = QSALayer(layer, pack.weights, pack.geometry)

    def new_state(self, max_context: int) -> QSACache:
        return QSACache.for_geometry(self.geometry, max_context)

    def step(self, state: QSACache, x: Input, pos: int) -> np.ndarray:
        # the Input goes to the Weights as is: the five projections of x share one ActQ
        return self.qsa.step(x, state)


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

    def enter(self, h: np.ndarray, layer: int, ffn: bool) -> Input:
        gain = (self.ffn_norm if ffn else self.attn_norm)[layer]
        rmsnorm(h, gain, self.eps, out=self.xin.x)
        return self.xin.changed()

    def leave(self, h: np.ndarray, layer: int, ffn: bool, y: np.ndarray) -> None:
        h += y

    def final(self, h: np.ndarray) -> np.ndarray:
        return rmsnorm(h, self.out_norm, self.eps, out=self.head_in)


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

    def enter(self, h: np.ndarray, layer: int, ffn: bool) -> Input:
        x, self.inject_w = (self.ffn if ffn else self.attn)[layer].mix(h)
        return self.xin.set(x)

    def leave(self, h: np.ndarray, layer: int, ffn: bool, y: np.ndarray) -> None:
        (self.ffn if ffn else self.attn)[layer].inject(h, y, self.inject_w)

    def final(self, h: np.ndarray) -> np.ndarray:
        return self.out.mix(h)[0]


# --- the model ---------------------------------------------------------------------------------------


class Session:
    """Everything one sequence owns: position, per-layer state, the residual stream, the logits
    buffer, and per-layer expert routing counts ([n_layer, n_expert], for --stats)."""

    def __init__(self, model: Model, max_context: int):
        if max_context < 1:
            raise ValueError(f"max_context {max_context}: expected at least 1")
        g = model.geometry
        self.max_context = max_context
        self.pos = 0
        self.states = [m.new_state(max_context) for m in model.mixers]
        self.ple_states = {l: PLEState.for_geometry(g) for l in model.ple}
        self.stream = model.residual.new_stream()
        self.embedding = np.empty(g.n_embd, F32)
        self.logits = np.empty(g.n_vocab, F32)
        self.routing = np.zeros((g.n_layer, g.n_expert), np.int64)


class Model:
    """Weights and per-layer blocks of one pack; `step(session, token)` -> logits f32 [n_vocab]."""

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

    def new_session(self, max_context: int) -> Session:
        return Session(self, max_context)

    def warm_up(self) -> None:
        """A few throwaway steps in a scratch session, so the kernels compile (Numba, on first call)
        while loading, not inside the first tokens' time; QSA selects only once a block is complete."""
        n = self.geometry.idx_compress_ratio + 1
        s = self.new_session(n)
        for _ in range(n):
            self.step(s, 0)

    def step(self, s: Session, token: int) -> np.ndarray:
        """Feed `token` at position s.pos; returns the logits for the next position (s.logits)."""
        if s.pos >= s.max_context:
            raise ContextFull(f"position {s.pos}: the session's context is {s.max_context} tokens (--max-context)")
        g, r, h = self.geometry, self.residual, s.stream
        if not 0 <= token < g.n_vocab:
            raise ValueError(f"token id {token} outside the vocabulary 0..{g.n_vocab - 1}")
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
        self.pack, self.t = pack, pack.ple

    def __call__(self, row_ids: np.ndarray) -> np.ndarray:
        out = np.empty((row_ids.size, self.t.row_dim), F32)
        for i, r in enumerate(row_ids.tolist()):
            out[i] = dequantize(self.pack.ple_row(r), self.t.type_id, self.t.row_dim)
        return out

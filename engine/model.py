"""The model: T tokens through every layer, with all per-sequence state in a Session.

    tokens -> embedding -> [layer 0 .. L-1] -> head input -> LM head -> logits

A layer is  token mixer (Gated DeltaNet, or gated full attention every `interval`-th layer)  then
MoE, joined by the architecture's residual scheme:
  qwen35moe  pre-norm residual:  h += mixer(norm(h));  h += moe(norm(h));  head reads norm(h)
  qwen4exp   hyper-connections:  hc streams mixed into the block input and injected back
             (engine/hyper.py), plus QSA indexed attention (engine/qsa.py) and PLE (engine/ple.py).
The residual is an object with enter/leave per sub-block, so the mixers and the MoE are shared by
both architectures and only the residual (and qwen4exp's extra components) differ.

ONE FORWARD. Every block has one `forward` over a batch of T token rows [T, n]; T = 1 is the decode
step, T > 1 a prompt chunk. What differs with T (a matvec or the panel kernels, the delta rule's
recurrence or its chunked form, one query or a tile of them) is chosen below the blocks, by the
backend (engine/backend.py) and the MoE, never by a second method; the recurrent states are updated
by the same code for any T. The choices differ only by float32 rounding (tests/engine/test_prefill.py).

S12: a Session makes its state once (the KV cache is sized for max_context up front); the decode
step writes into it and into the backend's scratch, and returns a view of the session's logits.
"""

from __future__ import annotations

import numpy as np

from strata.index_format.geometry import ModelGeometry

from .backend import CpuBackend
from .batch import Seq, copy_state, keep
from .hyper import HyperConnection
from .kernels import delta
from .kernels.reference import dequantize
from .kvcache import ContextFull, KVCache  # noqa: F401 (ContextFull: the model's error too)
from .moe import MoE
from .ops import Rope
from .pack_reader import Pack
from .ple import PLELayer, TableRows
from .qsa import QSACache, QSALayer
from .weights import Input

F32 = np.float32
EMBD_ROWS_BYTES = 16 << 20  # the device step's decoded embedding rows kept (Model._embd_row)
# Model.warm_up's prompt chunks: copies of one token (routed nearly alike: many tokens per
# matrix) and distinct tokens (about one per routed expert)
WARM_SAME, WARM_DISTINCT = 16, 8


# --- token mixers ------------------------------------------------------------------------------------


def gdn_state_bytes(g: ModelGeometry) -> int:
    """One linear-attention layer's recurrent state S, f32 [nv, dv, dk] (GatedDeltaNet.new_state)."""
    return g.ssm_n_v_heads * g.ssm_head_v_dim * g.ssm_d_state * 4


def conv_state_bytes(g: ModelGeometry) -> int:
    """One linear-attention layer's conv state: the last K - 1 inputs, f32 [K - 1, Ch] (GatedDeltaNet.new_state)."""
    return (g.ssm_d_conv - 1) * g.ssm_conv_channels * 4


def stream_elems(g: ModelGeometry) -> int:
    """The residual stream's width: hc streams of n_embd (qwen4exp), or one (Session.stream)."""
    return g.hc * g.n_embd if g.hc else g.n_embd


class GatedDeltaNet:
    """A linear-attention layer: in_proj -> causal conv + SiLU -> gated delta rule -> gated RMSNorm -> out.

    State per session: conv f32 [K-1, C] (the last K-1 inputs), S f32 [nv, dv, dk]. `silu_gate`: the
    output gate's activation, not stored in the GGUF: SiLU for qwen35moe, sigmoid for qwen4exp."""

    def __init__(self, pack: Pack, layer: int, silu_gate: bool):
        g, b = pack.geometry, f"blk.{layer}"
        self.nk, self.nv, self.dk, self.dv = g.ssm_n_k_heads, g.ssm_n_v_heads, g.ssm_d_state, g.ssm_head_v_dim
        self.K, self.C, self.E, self.eps, self.silu_gate = g.ssm_d_conv, g.ssm_conv_channels, g.n_embd, g.rms_eps, silu_gate
        self.qkv = pack.weight(f"{b}.attn_qkv.weight")
        self.z = pack.weight(f"{b}.attn_gate.weight")
        self.beta = pack.weight(f"{b}.ssm_beta.weight")
        self.alpha = pack.weight(f"{b}.ssm_alpha.weight")
        self.out = pack.weight(f"{b}.ssm_out.weight")
        self.conv_w = np.ascontiguousarray(pack.weight(f"{b}.ssm_conv1d.weight").f32().T)  # torch [C, K] -> [K, C]
        self.a = pack.weight(f"{b}.ssm_a").f32()  # -exp(A_log)
        self.dt_bias = pack.weight(f"{b}.ssm_dt.bias").f32()
        self.norm = pack.weight(f"{b}.ssm_norm.weight").f32()

    def new_state(self, be, max_context: int, kv: str) -> dict[str, np.ndarray]:
        return {"conv": be.zeros((self.K - 1, self.C)), "S": be.zeros((self.nv, self.dv, self.dk))}

    def forward(self, be, seqs: list[Seq], x: Input) -> np.ndarray:
        """T rows (`seqs`: whose they are, each with its conv and delta-rule state, advanced by its
        rows) -> f32 [T, E]."""
        T = x.x.shape[0]
        nk, dk, nv, dv, sc = self.nk, self.dk, self.nv, self.dv, be.scratch
        # the four products of x in one parallel region for a token (backend.linears)
        mixed, z, beta, alpha = be.linears((self.qkv, self.z, self.beta, self.alpha), x,
                                           (sc("gdn.qkv", (T, self.C)), sc("gdn.z", (T, nv * dv)), sc("gdn.beta", (T, nv)),
                                            sc("gdn.alpha", (T, nv))))  # fmt: skip
        if T == 1 and len(seqs) == 1 and be.owns(*self.TOKEN_HOOKS):
            return self._token(be, seqs[0], mixed, z, beta, alpha)
        z = z.reshape(T, nv, dv)
        if len(seqs) == 1:  # the gates and the one sequence's conv: one launch on the device
            (beta, decay), c1 = be.gates_conv(beta, alpha, self.a, self.dt_bias, seqs[0].state["conv"], self.conv_w, mixed)
        else:
            beta, decay = be.gdn_gates(beta, alpha, self.a, self.dt_bias)
        # one sequence's chunk takes the delta rule's own output (a copy of [T, nv, dv] per layer
        # otherwise); the decode step, the scratch; several sequences, their rows of one array
        o = sc("gdn.o", (T, nv, dv)) if T == 1 or len(seqs) > 1 else None
        device_rows = getattr(be, "gdn_rows", None)  # (the device step's: its own launches for them)
        i, fused = 0, len(seqs) > 1 and (device_rows is not None or be.owns(*self.ROWS_HOOKS))
        while i < len(seqs):
            r = seqs[i]
            rows = 1  # a verify's rows: one-token sequences over one state, consecutive
            while fused and i + rows < len(seqs) and seqs[i + rows].state is r.state and r.n == seqs[i + rows].n == 1:
                rows += 1
            if rows > 1 and device_rows is None:
                self._rows(be, seqs[i : i + rows], mixed, decay, beta, o)
                i += rows
                continue
            if rows > 1 and device_rows(self, seqs[i : i + rows], mixed, decay, beta, o):  # (False: row by row)
                i += rows
                continue
            c = c1 if len(seqs) == 1 else be.conv(r.state["conv"], self.conv_w, mixed[r.a : r.b])
            n = r.n
            q, k = be.qk_l2norm_(c, n, nk, dk, dk**-0.5)
            v = c[:, 2 * nk * dk :].reshape(n, nv, dv)
            y = be.delta_rule(r.state["S"], q, k, v, decay[r.a : r.b], beta[r.a : r.b], None if o is None else o[r.a : r.b])
            o = y if o is None else o
            keep(r)
            i += 1
        return be.linear(self.out, be.gated_norm_input(o, self.norm, z, self.eps, self.silu_gate), sc("gdn.y", (T, self.E)))

    def _rows(self, be, rows: list[Seq], mixed, decay, beta, o) -> None:
        """`forward`'s delta rule for one-token sequences of one state (a verify's rows, each kept in
        its snapshot): each row's conv and norms as its own sequence's, then every row's token step
        in one call that also fills the snapshots (be.delta_rule_rows). The step and the copies one
        row after another cost 1.6-1.8x as long (one layer of seed-4l, 3 rows, 2 threads)."""
        nk, dk, nv, dv, sc = self.nk, self.dk, self.nv, self.dv, be.scratch
        n, a, b = len(rows), rows[0].a, rows[-1].b
        q, k, v = sc("gdn.rows_q", (n, nk, dk)), sc("gdn.rows_k", (n, nk, dk)), sc("gdn.rows_v", (n, nv, dv))
        for t, r in enumerate(rows):
            c = be.conv(r.state["conv"], self.conv_w, mixed[r.a : r.b])
            q[t : t + 1], k[t : t + 1] = be.qk_l2norm_(c, 1, nk, dk, dk**-0.5)
            v[t] = c[0, 2 * nk * dk :].reshape(nv, dv)
            if r.saved is not None:
                copy_state(r.state["conv"], r.saved["conv"])
        be.delta_rule_rows(rows[0].state["S"], q, k, v, decay[a:b], beta[a:b], o[a:b],
                           [None if r.saved is None else r.saved["S"] for r in rows])

    # the hooks `_rows` makes: a backend that overrides one (the device step) takes the rows one by one
    ROWS_HOOKS = ("conv", "qk_l2norm_", "delta_rule", "delta_rule_rows")

    # the hooks `_token` makes in its own passes (a backend that overrides one, the device step,
    # gets them one by one: CpuBackend.owns)
    TOKEN_HOOKS = ("gates_conv", "gdn_gates", "sigmoid", "softplus", "conv", "qk_l2norm_", "l2norm_",
                   "gated_norm_input", "gated_rmsnorm_", "gate_", "rmsnorm")

    def _token(self, be, r: Seq, mixed: np.ndarray, z: np.ndarray, beta: np.ndarray, alpha: np.ndarray) -> np.ndarray:
        """`forward` of one token of one sequence on the CPU from its four products: the same values
        through kernels/delta.py's host passes, numpy's tanh, logaddexp and float64 sums between them,
        in the step's buffers (the hooks' ~40 numpy calls and their temporaries cost ~0.17 ms a layer at 1 thread)."""
        nk, dk, nv, dv, C, sc = self.nk, self.dk, self.nv, self.dv, self.C, be.scratch
        c, th, zt = sc("gdn.c", (1, C)), sc("gdn.th", (1, C)), sc("gdn.zt", (1, nv, dv))
        bt, ad, b, decay = sc("gdn.bt", (1, nv)), sc("gdn.ad", (1, nv)), sc("gdn.b", (1, nv)), sc("gdn.decay", (1, nv))
        delta.token_prep(r.state["conv"], self.conv_w, mixed[0], c[0], th[0], beta[0], bt[0], alpha[0], self.dt_bias,
                         ad[0], z[0], zt.reshape(-1))  # fmt: skip
        np.tanh(th, out=th)  # (the reference's shapes: gate_'s of c [1, C], sigmoid's of beta [1, nv], gate_'s of z [1, nv, dv])
        np.tanh(bt, out=bt)
        np.tanh(zt, out=zt)
        np.logaddexp(0, ad, out=ad)  # softplus
        delta.token_gates(c[0], th[0], bt[0], self.a, ad[0], b[0], decay[0])
        q, k = c[:, : nk * dk].reshape(1, nk, dk), c[:, nk * dk : 2 * nk * dk].reshape(1, nk, dk)
        ssq = np.einsum("...i,...i->...", q, q, dtype=np.float64)  # ops.l2norm_'s sums
        ssk = np.einsum("...i,...i->...", k, k, dtype=np.float64)
        delta.token_qk(c[0], ssq[0], ssk[0], nk, dk, F32(dk**-0.5))
        o = sc("gdn.o", (1, nv, dv))
        be.delta_rule(r.state["S"], q, k, c[:, 2 * nk * dk :].reshape(1, nv, dv), decay, b, o)
        keep(r)
        g = o.reshape(1, nv, 1, dv)
        ms = np.einsum("...i,...i->...", g, g, dtype=np.float64)  # ops.rmsnorm's sums, [1, nv, 1]
        delta.token_out(o[0], ms.reshape(-1), self.norm, float(self.eps), z.reshape(nv, dv), zt[0], self.silu_gate)
        return be.linear(self.out, Input(o.reshape(1, -1)), sc("gdn.y", (1, self.E)))


class GatedAttention:
    """Full attention with q/k RMSNorm, partial NeoX RoPE, a KV cache, and a sigmoid output gate.

    attn_q holds, per head h, rows [h*2D, h*2D + D) = query and [h*2D + D, (h+1)*2D) = gate.
    State per session: a KVCache (engine/kvcache.py: f32, f16 or int8) for max_context tokens."""

    def __init__(self, pack: Pack, layer: int, rope: Rope):
        g, b = pack.geometry, f"blk.{layer}"
        self.H, self.Hkv, self.D, self.E, self.eps, self.rope = g.n_head, g.n_head_kv, g.head_dim, g.n_embd, g.rms_eps, rope
        self.wq = pack.weight(f"{b}.attn_q.weight")
        self.wk = pack.weight(f"{b}.attn_k.weight")
        self.wv = pack.weight(f"{b}.attn_v.weight")
        self.wo = pack.weight(f"{b}.attn_output.weight")
        self.q_norm = pack.weight(f"{b}.attn_q_norm.weight").f32()  # (1 + w), folded
        self.k_norm = pack.weight(f"{b}.attn_k_norm.weight").f32()

    def new_state(self, be, max_context: int, kv: str) -> KVCache:
        return be.kv_cache(kv, max_context, self.Hkv, self.D)

    def forward(self, be, seqs: list[Seq], x: Input) -> np.ndarray:
        """T rows (`seqs`: whose they are, each with its KV cache) -> f32 [T, E]: a sequence's keys are
        cached, then its queries attend together (a query sees the keys up to its own position)."""
        H, Hkv, D, T, sc = self.H, self.Hkv, self.D, x.x.shape[0], be.scratch
        positions = np.concatenate([r.pos + np.arange(r.n) for r in seqs]) if len(seqs) > 1 else seqs[0].pos + np.arange(T)
        qg, k, v = be.linears((self.wq, self.wk, self.wv), x, (sc("attn.qg", (T, 2 * H * D)), sc("attn.k", (T, Hkv * D)),
                                                              sc("attn.v", (T, Hkv * D))))  # fmt: skip
        qg, k, v = qg.reshape(T, H, 2 * D), k.reshape(T, Hkv, D), v.reshape(T, Hkv, D)
        q = be.rmsnorm(qg[:, :, :D], self.q_norm, self.eps, sc("attn.q", (T, H, D)))
        be.rmsnorm(k, self.k_norm, self.eps, k)
        be.rope_(self.rope, q, positions)
        be.rope_(self.rope, k, positions)
        o = None if len(seqs) == 1 else be.empty((T, H, D))  # one sequence: attention's own output
        rows = getattr(be, "attend_rows", None)  # (the device step's: a verify's rows in its own launches)
        done = rows is not None and len(seqs) > 1 and all(r.n == 1 and r.state is seqs[0].state and r.pos == seqs[0].pos + i
                                                          for i, r in enumerate(seqs)) \
            and rows(seqs[0].state, seqs[0].pos, q, k, v, D**-0.5, o)
        for r in [] if done else seqs:
            cache, n = r.state, r.n
            if n == 1 and len(seqs) == 1:  # the decode step: the backend's one-token form
                o = be.attend_one(cache, r.pos, q, k, v, D**-0.5)
                break
            if n == 1 and be.rows_attend_one:
                # a verify row (or a batch's decoding request) on a backend whose one-token form sums
                # in another order than its `attention` (the device step): the token step's bits
                o[r.a : r.b] = be.attend_one(cache, r.pos, q[r.a : r.b], k[r.a : r.b], v[r.a : r.b], D**-0.5)
                continue
            cache.write(r.pos, k[r.a : r.b], v[r.a : r.b])
            K, V = cache.read(slice(0, r.pos + n))
            visible = None if n == 1 else be.causal_mask(r.pos, n, r.pos + n)  # one token sees its whole cache
            y = be.attention(q[r.a : r.b], K, V, D**-0.5, visible)
            if o is None:
                o = y
            else:
                o[r.a : r.b] = y
        # o *= sigmoid(gate), as wo's Input (the device makes its ActQ in the same launch)
        return be.linear(self.wo, be.gate_input(o, qg[:, :, D:], False, self.wo), sc("attn.y", (T, self.E)))


class QSAAttention:
    """A qwen4exp full-attention layer: engine/qsa.py's QSALayer (indexer, block selection, gated
    attention) behind the mixer interface. State per session: its QSACache, sized for max_context."""

    def __init__(self, pack: Pack, layer: int):
        self.geometry = pack.geometry
        self.qsa = QSALayer(layer, pack.weights, pack.geometry)

    def new_state(self, be, max_context: int, kv: str) -> QSACache:
        return be.qsa_cache(self.geometry, max_context, kv)

    def forward(self, be, seqs: list[Seq], x: Input) -> np.ndarray:
        # the Input goes to the Weights as is: the five projections of x share one ActQ
        return self.qsa.forward(be, x, seqs)


# --- residual schemes --------------------------------------------------------------------------------


class PreNormResidual:
    """qwen35moe: h += mixer(attn_norm(h)); h += moe(post_attention_norm(h)); the head reads output_norm(h).
    The stream is H f32 [T, E]; `ctx` carries nothing."""

    def __init__(self, pack: Pack):
        g = pack.geometry
        self.E, self.eps = g.n_embd, g.rms_eps
        self.attn_norm = [pack.weight(f"blk.{l}.attn_norm.weight").f32() for l in range(g.n_layer)]
        self.ffn_norm = [pack.weight(f"blk.{l}.post_attention_norm.weight").f32() for l in range(g.n_layer)]
        self.out_norm = pack.weight("output_norm.weight").f32()

    def embed(self, e: np.ndarray, out: np.ndarray | None) -> np.ndarray:
        """The stream of T tokens from their embeddings [T, E] (into `out` when given)."""
        if out is None:
            return e
        out[...] = e
        return out

    def _gain(self, layer: int, ffn: bool) -> np.ndarray:
        return (self.ffn_norm if ffn else self.attn_norm)[layer]

    def enter(self, be, H: np.ndarray, layer: int, ffn: bool) -> tuple[Input, None]:
        return be.norm_input(H, self._gain(layer, ffn), self.eps, be.scratch("residual.x", H.shape)), None

    def leave(self, be, H: np.ndarray, layer: int, ffn: bool, Y: np.ndarray, ctx: None) -> None:
        H += Y

    def move(self, be, H: np.ndarray, layer: int, ffn: bool, Y: np.ndarray, ctx: None,
             to: tuple[int, bool]) -> tuple[Input, None]:
        """leave (layer, ffn) with Y, then enter `to` (layer, ffn): the add and the next norm, one
        launch on the device (a decode token's adds were launches of their own)."""
        return be.add_norm_input(H, Y, self._gain(*to), self.eps, be.scratch("residual.x", H.shape)), None

    def final(self, be, H: np.ndarray) -> np.ndarray:
        return be.rmsnorm(H, self.out_norm, self.eps, be.scratch("residual.head_in", H.shape))

    def final_input(self, be, H: np.ndarray) -> Input:
        """`final` as the LM head's Input: the device step makes its ActQ in the norm's launch."""
        return be.norm_input(H, self.out_norm, self.eps, be.scratch("residual.head_in", H.shape))


class HyperResidual:
    """qwen4exp: hc residual streams (engine/hyper.py), H f32 [T, hc*E]. Before each block its
    hyper-connection mixes the streams into the block input; after it, injects the output back into
    every stream with the weights the mix computed (`ctx`, f32 [T, hc]). The head reads the final
    mixer's output (there is no output_norm)."""

    def __init__(self, pack: Pack):
        g, w = pack.geometry, pack.weights
        self.hc, self.E = g.hc, g.n_embd
        self.attn = [HyperConnection.from_tensors(w, f"blk.{l}.hc_attn", g) for l in range(g.n_layer)]
        self.ffn = [HyperConnection.from_tensors(w, f"blk.{l}.hc_ffn", g) for l in range(g.n_layer)]
        self.out = HyperConnection.from_tensors(w, "output_hc", g, inject=False)

    def embed(self, e: np.ndarray, out: np.ndarray | None) -> np.ndarray:
        """The streams of T tokens from their embeddings [T, E] (into `out` when given): every stream
        starts as the token's embedding (transformers: embedding.repeat(1, 1, hc))."""
        if out is None:  # (np.tile: a device array's own module makes the streams where e lives)
            return np.tile(e, (1, self.hc))
        out.reshape(-1, self.hc, self.E)[...] = e[:, None, :]
        return out

    def enter(self, be, H: np.ndarray, layer: int, ffn: bool) -> tuple[Input, np.ndarray]:
        x, w = (self.ffn if ffn else self.attn)[layer].mix(be, H)
        return x, w

    def leave(self, be, H: np.ndarray, layer: int, ffn: bool, Y: np.ndarray, w: np.ndarray) -> None:
        (self.ffn if ffn else self.attn)[layer].inject(be, H, Y, w)

    def move(self, be, H: np.ndarray, layer: int, ffn: bool, Y: np.ndarray, w: np.ndarray, to: tuple[int, bool]):
        """leave (layer, ffn), then enter `to` (layer, ffn)."""
        self.leave(be, H, layer, ffn, Y, w)
        return self.enter(be, H, *to)

    def final(self, be, H: np.ndarray) -> np.ndarray:
        return self.out.mix(be, H)[0].x

    def final_input(self, be, H: np.ndarray) -> Input:
        """`final` as the LM head's Input (the mix's, with the ActQ its norm made)."""
        return self.out.mix(be, H)[0]


# --- the model ---------------------------------------------------------------------------------------


class Session:
    """Everything one sequence owns: position, per-layer state, the decode step's residual stream,
    the logits buffer, and per-layer expert routing counts ([n_layer, n_expert], for --stats).

    `kv` is the KV cache kind (engine/kvcache.py): f32 (exact), f16 or int8. The Gated DeltaNet,
    conv, QSA indexer and PLE states are f32 whatever it is."""

    def __init__(self, model: Model, max_context: int, kv: str = "f32", backend=None):
        """`backend`: where the states are allocated (default: the model's; the GPU tier makes the
        device step's first session with its backend before binding it)."""
        if max_context < 1:
            raise ValueError(f"max_context {max_context}: expected at least 1")
        g = model.geometry
        self.max_context, self.kv = max_context, kv
        self.pos = 0
        be = model.backend if backend is None else backend
        self.states = [m.new_state(be, max_context, kv) for m in model.mixers]
        self.ple_states = {l: be.ple_state(g) for l in model.ple}
        self.stream = be.zeros((1, stream_elems(g)))  # the decode step's residual stream, where the backend computes
        self.logits = np.empty(g.n_vocab, F32)
        self.routing = np.zeros((g.n_layer, g.n_expert), np.int64)
        self.spent = None  # why the session can take no more tokens (Model.decode_ahead), or None

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
    """Weights and per-layer blocks of one pack; `forward(session, tokens)` -> the logits of the last
    positions of T tokens, `step(session, token)` -> logits f32 [n_vocab] (T = 1, into the session's
    buffer). `backend` (engine/backend.py) is what the blocks compute with: the CPU's, or the GPU
    tier's once it starts (engine/tier/)."""

    def __init__(self, pack: Pack):
        g: ModelGeometry = pack.geometry
        self.pack, self.geometry = pack, g
        self.backend = CpuBackend()
        # the MTP draft head the GPU tier placed on the device (engine/tier/draft.py), which --spec's
        # drafters then use; None: a drafter makes its own on the CPU
        self.draft_head = None
        qwen4exp = g.arch == "qwen4exp"
        # the GDN output-gate activation is not in the GGUF: sigmoid for qwen4exp as released, SiLU for qwen35moe
        silu_gate = not qwen4exp
        rope = Rope(g.n_rot, g.rope_freq_base)
        self.mixers = [
            (QSAAttention(pack, l) if qwen4exp else GatedAttention(pack, l, rope)) if g.is_full_attention(l)
            else GatedDeltaNet(pack, l, silu_gate)
            for l in range(g.n_layer)
        ]
        self.moes = [MoE(pack, l) for l in range(g.n_layer)]
        self.residual = HyperResidual(pack) if qwen4exp else PreNormResidual(pack)
        self.ple = _ple_layers(pack)  # {layer: PLELayer}, qwen4exp only
        self.embd = pack.weight("token_embd.weight")
        self._embd_rows: dict[int, np.ndarray] = {}  # `_embd_row`'s decoded rows, oldest first
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

    def _embd_row(self, token: int) -> np.ndarray:
        """The device step's embedding row of `token`, f32 [1, n_embd] (read-only: the step copies
        it up). Decoded rows are kept, up to EMBD_ROWS_BYTES: the reference decoder takes 30-70 us a
        row (Q4_0 .. Q4_K, 3072 wide), on the host's critical path between two device steps, and
        generated text repeats its tokens. A kept row is the decode's own bits."""
        row = self._embd_rows.get(token)
        if row is None:
            g = self.geometry
            row = dequantize(self.embd.rows(token, token + 1), self.embd.type_id, g.n_embd).reshape(1, g.n_embd)
            row.flags.writeable = False
            if len(self._embd_rows) >= max(1, EMBD_ROWS_BYTES // (4 * g.n_embd)):
                del self._embd_rows[next(iter(self._embd_rows))]  # the oldest kept row
            self._embd_rows[token] = row
        return row

    def _check(self, s: Session, tokens) -> None:
        if s.spent:
            raise ValueError(f"this session cannot take more tokens: {s.spent}; start a new session")
        if s.pos + len(tokens) > s.max_context:
            raise ContextFull(f"position {s.pos + len(tokens) - 1}: the session's context is {s.max_context} tokens "
                              "(--ctx-size)")
        bad = [t for t in tokens if not 0 <= t < self.geometry.n_vocab]
        if bad:
            raise ValueError(f"token id {bad[0]} outside the vocabulary 0..{self.geometry.n_vocab - 1}")

    def step(self, s: Session, token: int, hidden: np.ndarray | None = None) -> np.ndarray:
        """Feed `token` at position s.pos; returns the logits for the next position (s.logits).
        The decode step: `forward` of one token, which allocates nothing after warm-up (S12).
        `hidden`: f32 [1, E] receives the head's input row (see `forward`)."""
        self._forward([s], [(int(token),)], [1], [s.logits.reshape(1, -1)], hidden)
        return s.logits

    @property
    def picks(self) -> bool:
        """Whether `step_pick` and `step_sample` make the pick where the logits are (the device step),
        so that only the token comes back to the host."""
        return getattr(self.backend, "token_step", None) is not None

    def step_pick(self, s: Session, token: int, banned: np.ndarray) -> int:
        """Feed `token` at position s.pos and return the greedy next token: the lowest id of the
        largest logit, the `banned` ids (int32) never (the sampler's rule at temperature 0 without
        penalties). On the device step the pick is made there and s.logits is not written; elsewhere
        it is `step` and the argmax of its logits."""
        if not self.picks:
            work = self.step(s, token).copy()
            work[banned] = -np.inf
            return int(work.argmax())
        return self._forward([s], [(int(token),)], [1], [s.logits.reshape(1, -1)], pick=banned)

    def step_sample(self, s: Session, token: int, sampler, history) -> int:
        """Feed `token` at position s.pos and return `sampler`'s next token (Sampler.sample of the
        logits with `history`). On the device step the pick is made there (DeviceBackend._sample,
        the sampler's own uniform draw passed up) and only the token comes back; elsewhere it is
        `step` and the sampler on the host."""
        if not self.picks:
            return sampler.sample(self.step(s, token), history)
        return self._forward([s], [(int(token),)], [1], [s.logits.reshape(1, -1)], pick=sampler.device_draw(history, s.logits))

    def forward(self, s: Session, tokens, n_logits: int = 1, *, hidden: np.ndarray | None = None,
                saved: list | None = None, pick: np.ndarray | None = None) -> np.ndarray:
        """Feed T tokens at positions s.pos.. in one batch; returns the logits of the last `n_logits`
        positions, f32 [n_logits, n_vocab] (0 <= n_logits <= T: the LM head runs only for those).

        hidden: f32 [n_h, E], when given, receives the LM head's input of the last n_h positions:
        the final post-norm hidden state (output_norm(h), qwen35moe; the final hyper-connection mix,
        qwen4exp), what an MTP head drafts from. saved: speculative decoding's verify forward
        (engine/speculative.py): the rows run as one-token sequences of this session in turn, each
        with the token step's own arithmetic (so a verified row has the bits decoding gives it), and
        the state after row i is copied into saved[i] (a Snapshot; None: not kept). pick: the banned
        ids (int32, Sampler.pick): returns instead the greedy token of each of the n_logits rows,
        int64 [n_logits], picked where the logits are (the device step: only the ids come back)."""
        ids = np.asarray(tokens, np.int64).reshape(-1).tolist()
        if not ids or not 0 <= n_logits <= len(ids):
            raise ValueError(f"forward: n_logits {n_logits} outside 0..{len(ids)} (the tokens fed), at least one token")
        if hidden is not None and hidden.shape[0] > len(ids):
            raise ValueError(f"forward: {hidden.shape[0]} hidden rows asked for, {len(ids)} tokens fed")
        if pick is not None and n_logits:
            if len(ids) == 1 and hidden is None and not saved:  # one token: the token step's own pick
                return np.array([self.step_pick(s, ids[0], pick)], np.int64)
            return self._forward([s], [ids], [n_logits], [np.empty((n_logits, 0), F32)], [hidden], [saved], rows_pick=pick)
        if hidden is None and saved is None:
            return self.forward_batch([s], [ids], [n_logits])[0]
        return self.forward_batch([s], [ids], [n_logits], hidden=[hidden], saved=[saved])[0]

    def forward_batch(self, sessions: list[Session], tokens: list, n_logits: list[int], *,
                      hidden: list | None = None, saved: list | None = None) -> list[np.ndarray]:
        """Feed several sequences at once (engine/batch.py): tokens[i] (at least one) at positions
        sessions[i].pos..; returns for each the logits of its last n_logits[i] positions, f32
        [n_logits[i], n_vocab]. A sequence's numbers are the ones it gets alone. `hidden[i]` and
        `saved[i]` (None: not asked) are `forward`'s, per sequence: strata serve --batch-mtp verifies
        every request's drafts in this one forward, each with its own snapshots."""
        if not (len(sessions) == len(tokens) == len(n_logits)) or not sessions:
            raise ValueError(f"forward_batch: {len(sessions)} sessions, {len(tokens)} token lists and {len(n_logits)} "
                             "logit counts, expected as many of each and at least one")
        for name, per in (("hidden", hidden), ("saved", saved)):
            if per is not None and len(per) != len(sessions):
                raise ValueError(f"forward_batch: {len(per)} {name} entries for {len(sessions)} sessions")
        if len({id(s) for s in sessions}) != len(sessions):
            raise ValueError("forward_batch: a session appears twice (its rows must be consecutive)")
        ids = [np.asarray(t, np.int64).reshape(-1).tolist() for t in tokens]
        for i, (t, n) in enumerate(zip(ids, n_logits)):
            if not t or not 0 <= n <= len(t):
                raise ValueError(f"forward: n_logits {n} outside 0..{len(t)} (the tokens fed), at least one token")
            if hidden is not None and hidden[i] is not None and hidden[i].shape[0] > len(t):
                raise ValueError(f"forward: {hidden[i].shape[0]} hidden rows asked for, {len(t)} tokens fed")
        outs = [np.empty((n, self.geometry.n_vocab), F32) for n in n_logits]
        self._forward(sessions, ids, n_logits, outs, hidden, saved)
        return outs

    def _forward(self, sessions: list[Session], tokens: list, n_logits: list[int], outs: list[np.ndarray],
                 hidden: list | np.ndarray | None = None, saved: list | None = None, pick: np.ndarray | None = None,
                 rows_pick: np.ndarray | None = None):
        """`hidden`, `saved`: per session (forward_batch's), or for `step`'s one session its array.
        `pick`: step_pick's banned ids or step_sample's DeviceDraw (the token step picks the next
        token: returned); `rows_pick`: forward's banned ids (one session: the greedy token of
        each logits row, returned)."""
        if isinstance(hidden, np.ndarray):
            hidden = [hidden]
        try:
            return self._forward_rows(sessions, tokens, n_logits, outs, hidden, saved, pick, rows_pick)
        finally:
            if self.backend.experts is not None:  # what the expert server owes the sessions (routing counts)
                self.backend.experts.settle()

    def _forward_rows(self, sessions: list[Session], tokens: list, n_logits: list[int], outs: list[np.ndarray],
                      hidden: list | None, saved: list | None, pick: np.ndarray | None = None,
                      rows_pick: np.ndarray | None = None) -> int | np.ndarray | None:
        for s, t in zip(sessions, tokens):
            self._check(s, t)
        g, r, be = self.geometry, self.residual, self.backend
        flat = tokens[0] if len(tokens) == 1 else [t for ts in tokens for t in ts]
        T = len(flat)
        ends = np.cumsum([len(t) for t in tokens]).tolist()
        spans = list(zip([0] + ends[:-1], ends))
        # (session, rows a..b, position of row a, snapshot): one per sequence, or for a session with
        # snapshots asked (`saved`) one per row, each a sequence of its own over the same state
        parts = []
        for i, (s, (a, b)) in enumerate(zip(sessions, spans)):
            sv = None if saved is None else saved[i]
            parts += [(s, a, b, s.pos, None)] if sv is None else \
                [(s, j, j + 1, s.pos + j - a, sv[j - a] if j - a < len(sv) else None) for j in range(a, b)]
        ids = np.asarray(flat, np.int64)
        step = getattr(be, "token_step", None)
        if step is not None and T == 1 and all(h is None for h in hidden or []) and all(v is None for v in saved or []):
            # one token of one session on a backend that can replay it (the device step: a CUDA
            # graph of the embedding into the stream, the layers and the head, captured once per
            # session); the embedding row goes up to a fixed address, so the graph reads it there
            row = be.stage_row(self._embd_row(flat[0]))
            staged = self._stage_ple(sessions[0], flat[0]) if self.ple else None
            got = step(sessions[0], sessions[0].pos, self._layers_and_head(row, ids, parts, staged),
                       None if pick is not None or not n_logits[0] else outs[0], g.n_vocab, pick)
            sessions[0].pos += 1
            return got
        if getattr(be, "verify_step", None) is not None and len(sessions) == 1 and T > 1 and saved is not None \
                and saved[0] is not None:
            return self._verify_rows(sessions[0], flat, ids, parts, n_logits[0], outs[0],
                                     None if hidden is None else hidden[0], rows_pick)
        e = be.embed_rows(ids, g.n_embd)  # (the device step's prompt: gathered there from its table)
        if e is None:
            # the T rows' bytes in one decode (a row decodes alone: the same values as one at a time)
            raw = self.embd.rows(flat[0], flat[0] + 1) if T == 1 else \
                np.concatenate([self.embd.rows(t, t + 1) for t in flat])
            e = be.upload(dequantize(raw, self.embd.type_id, T * g.n_embd).reshape(T, g.n_embd))
        # the decode step's stream is the session's (strata-budget's session.stream); a batch's is its own
        H = r.embed(e, sessions[0].stream if T == 1 else None)
        self._layers(be, H, ids, parts)
        for s, t in zip(sessions, tokens):
            s.pos += len(t)
        if hidden is not None and any(h is not None for h in hidden):
            return self._head_with_hidden(spans, n_logits, outs, hidden, H, rows_pick)
        want = [(b - n, b) for n, (_, b) in zip(n_logits, spans) if n]
        if not want:
            return
        rows = H[want[0][0] : want[0][1]] if len(want) == 1 else np.concatenate([H[a:b] for a, b in want])
        if len(want) == 1:
            return self._head_rows(r.final(be, rows), next(o for o in outs if o.shape[0]), rows_pick)
        logits = be.host(be.linear(self.head, r.final(be, rows)))
        i = 0
        for o in outs:
            o[...] = logits[i : i + o.shape[0]]
            i += o.shape[0]

    def _verify_rows(self, s: Session, flat: list, ids: np.ndarray, parts: list, n_logits: int, out: np.ndarray,
                     hidden: np.ndarray | None, pick: np.ndarray | None):
        """A verify forward of one session on the device step (DeviceBackend.verify_step, which may
        capture it and replay it): the rows' embeddings staged up, the layers, the final rows into
        fixed device buffers (the hidden rows the drafter reads, the logits, the picks), read here
        after the step. The values are `_forward_rows`' eager ones."""
        g, be = self.geometry, self.backend
        T = len(flat)
        n_h = 0 if hidden is None else hidden.shape[0]
        # the rows gathered on the device from the staged ids where the table is there, in the forward
        got = be.verify_embed(ids, g.n_embd) if hasattr(be, "verify_embed") else None
        if got is None:
            got = be.stage_rows(np.concatenate([self._embd_row(t) for t in flat])), None
        rows, gather = got
        vl = be.verify_logits
        if n_logits:
            vl = vl[:n_logits] if vl is not None and vl.shape[0] >= n_logits else be.verify_buf("logits", (n_logits, g.n_vocab))
        hbuf = be.verify_buf("hidden", hidden.shape) if n_h else None
        if pick is not None and n_logits:
            be.pick_rows_ready(n_logits, pick)
        run = self._verify_run(rows, gather, ids, parts, n_logits, n_h, vl, hbuf, pick)
        snaps = tuple(p[4] for p in parts)
        hold = (snaps, pick, vl, hbuf, rows)
        # the buffers by their device addresses: `vl` is a new view of the planned rows at every call
        # (keyed by the view's id, no verify was ever the same kind twice, so none was captured)
        at = [None if a is None else be.rt.ptr(a) for a in (vl, hbuf, rows)]
        key = (T, n_logits, n_h, tuple(id(x) for x in snaps), None if pick is None else id(pick), *at)
        capturable = self._verify_captured()
        be.verify_step(s, s.pos, T, run, key, hold, capturable)
        s.pos += T
        if not (n_h or n_logits):
            return None
        # what comes down is queued before one wait: the rows' routing ids (read by the settle after
        # this forward), the hidden rows, then the picks or the logits
        if hasattr(be.experts, "queue_rows_settle"):
            be.experts.queue_rows_settle()
        down = be.queue_down("hidden", hbuf) if n_h else None
        picked = None
        if pick is not None and n_logits:
            be.rt.synchronize()
            picked = be.picked_rows(n_logits, pick)
        elif n_logits:
            out[...] = be.host(vl)  # (its wait is the forward's)
        else:
            be.rt.synchronize()
        if n_h:
            hidden[...] = down
        return picked

    def _verify_run(self, rows, gather, ids: np.ndarray, parts: list, n_logits: int, n_h: int, vl, hbuf,
                    pick: np.ndarray | None, tail=None):
        """A verify's work on the device step (`_verify_rows`, `verify_ahead`), as DeviceBackend.
        verify_step's `run`: the rows' embeddings (gathered from their ids where `gather`), the layers,
        the final rows' head input into `hbuf` (n_h rows), the last n_logits rows' logits into `vl`
        and with `pick` their picks; `tail` (a verify run ahead): its judge and rollback after them,
        the picks then not copied down (the judge's record brings them)."""
        r, be, T = self.residual, self.backend, ids.size
        need = max(n_h, n_logits)

        def run():
            if gather is not None:
                gather()
            H = r.embed(rows, None)
            self._layers(be, H, ids, parts)
            be.boundary("head")
            if not need:
                return
            fin = r.final(be, H[T - need :])
            if n_h:
                hbuf[...] = fin[need - n_h :]
            if n_logits:
                be.linear(self.head, Input(fin[need - n_logits :]), vl)
                if pick is not None:
                    be.queue_pick_rows(vl, pick, down=tail is None)
            if tail is not None:
                tail()

        return run

    def verifies_ahead(self, s: Session) -> bool:
        """Whether `verify_ahead` can take `s`: a verify the device step captures (no PLE, no QSA) on a
        backend that can run it ahead (DeviceBackend.can_verify_ahead)."""
        can = getattr(self.backend, "can_verify_ahead", None)
        return can is not None and self._verify_captured() and can(s)

    def _verify_captured(self) -> bool:
        """Whether the device step may capture a verify: no row needs the host mid-way (QSA's block
        selection and PLE's hashes do)."""
        return not self.ple and not any(isinstance(m, QSAAttention) for m in self.mixers)

    def verify_ahead(self, s: Session, tokens: np.ndarray, banned: np.ndarray, drafter, snaps: list, n: int):
        """Greedy speculative decoding on the device step with each verify queued before the last one's
        picks are read (engine/tier/verify_ahead.py says how): `tokens` [1 + N] are the first verify's
        (the last known token, not fed, at s.pos, then N drafts, drafter's own rule), `snaps` its N
        Snapshots. Yields, a verify at a time, (k, the k + 1 tokens it gave: the k drafts kept, then
        the pick after them); the verify after it is on the device by then. Stops queuing where the
        n-th token may be among those read (n: tokens wanted) or where a verify could reach past the
        context; then returns with nothing queued and s.pos where the last verify read leaves it, so
        the plain loop can go on. A caller that closes it earlier leaves one verify queued past its
        last token, which moved the states: the session is SPENT (as decode_ahead's)."""
        be, g = self.backend, self.geometry
        if not self.verifies_ahead(s):
            raise ValueError("verify_ahead: this session's verify cannot run ahead on this backend (verifies_ahead)")
        T, N = tokens.size, tokens.size - 1
        if N < 1 or len(snaps) != N:
            raise ValueError(f"verify_ahead: {T} ids and {len(snaps)} snapshots, expected 1 + N ids and N snapshots (N >= 1)")
        self._check(s, tokens)
        ids = np.asarray(tokens, np.int64)
        va = be.ahead_verify
        vl = be.verify_logits
        vl = vl[:T] if vl is not None and vl.shape[0] >= T else be.verify_buf("logits", (T, g.n_vocab))
        be.pick_rows_ready(T, banned)
        last = s.max_context - T  # the last first row a verify may have

        def queue(guess: int, first: bool) -> tuple:
            rows, gather = be.verify_embed(ids, g.n_embd, stage=first)
            tok = be.verify_ids(T)
            parts = [(s, j, j + 1, guess + j, snaps[j] if j < N else None) for j in range(T)]
            picks = be.picks_dev(banned)
            run = self._verify_run(rows, gather, ids, parts, T, 0, vl, None, banned,
                                   tail=lambda: va.judge(T, picks, tok, drafter, s, snaps, last))
            key = ("ahead", T, tuple(id(x) for x in snaps), id(banned), id(drafter), *[be.rt.ptr(a) for a in (vl, rows)])
            # (held with its graphs: the addresses it reads, the drafter's and the rollback's tables among them)
            hold = (tuple(snaps), banned, vl, rows, drafter, va.chain(drafter), va.restore(s, snaps))
            be.verify_step(s, guess, T, run, key, hold, True, stage_pos=first)
            return va.queue(T)

        start = s.pos  # the first queued verify's first position, known once the verify before it is read
        queued = [queue(start, True)]  # the verifies on the device not read yet, oldest first
        got = 0
        try:
            while queued:
                # the next verify starts at start + 1 .. start + N + 1: queued where a token may still
                # be wanted after the oldest one's (it gives one at least) and its rows fit
                if got + 1 < n and start + 2 * N + 1 <= s.max_context - 1:
                    queued.append(queue(start + 1, False))
                k, P, picked = va.wait(queued[0])
                queued.pop(0)
                if P != start:
                    raise RuntimeError(f"verify_ahead: a verify read at position {P}, expected {start}")
                start = s.pos = P + k + 1
                got += k + 1
                yield k, picked
        finally:
            if queued:  # closed early (or an error): a queued verify is past the last token read
                for pending in queued:
                    va.drop(pending)
                s.spent = "its verify ran ahead (Model.verify_ahead) past its last token"

    def _stage_ple(self, s: Session, token: int) -> dict:
        """The device token step's PLE rows, one fixed device buffer per PLE layer, made and staged
        from the step's input token before the step (PLELayer.step_rows: the host's hash and table),
        so the step (a replayed graph) reads them there -> {layer: device rows}."""
        be, staged = self.backend, {}
        for l, ple in self.ple.items():
            st = s.ple_states[l]
            if st.t != s.pos:
                raise ValueError(f"layer {l}: the PLE state has seen {st.t} tokens, the session {s.pos}")
            staged[l] = be.stage_ple(l, ple.step_rows(token, st))
        return staged

    def _ple_ahead(self, s: Session) -> dict | None:
        """A run-ahead step's PLE rows, those its last step gathered on the device from its pick
        (DeviceBackend.ple_picked), the host states' counts advanced as `step_rows` advances them;
        their windows wait for the token (`_ple_took`) -> {layer: device rows}, or None without PLE."""
        if not self.ple:
            return None
        for l, st in s.ple_states.items():
            if st.t != s.pos:
                raise ValueError(f"layer {l}: the PLE state has seen {st.t} tokens, the session {s.pos}")
            st.t += 1
        return self.backend.ple_picked()

    def _ple_took(self, s: Session, token: int) -> None:
        """The pick a queued run-ahead step fed, read now: into every PLE state's window, as `step_rows`
        puts its token (the device's window took it in dev_ple_rows)."""
        for st in s.ple_states.values():
            st.window[:-1] = st.window[1:]
            st.window[-1] = token

    def _layers_and_head(self, row, ids: np.ndarray, parts: list, staged: dict | None = None):
        """The device token step's work (DeviceBackend.token_step's `run`): the embedding row (at its
        fixed device address) into the session's stream, the layers, the head into `logits`;
        `staged`: the PLE rows of `_stage_ple`."""
        r, be = self.residual, self.backend

        def run(logits):
            H = r.embed(row, parts[0][0].stream)
            self._layers(be, H, ids, parts, staged)
            be.boundary("head")
            be.linear(self.head, r.final_input(be, H), logits)

        return run

    def runs_ahead(self, s: Session) -> bool:
        """Whether `decode_ahead` can run `s` one step ahead (DeviceBackend.can_run_ahead)."""
        ahead = getattr(self.backend, "can_run_ahead", None)
        return ahead is not None and ahead(s)

    def decode_ahead(self, s: Session, token: int, banned: np.ndarray, n: int):
        """Greedy decoding on the device step, one step ahead of the host: feeds `token` at s.pos,
        then each picked token, and yields the n picked tokens in order (`step_pick`'s, the same
        bits). Step t + 1 is queued (its embedding row gathered on the device from the device's
        pick of token t: DeviceBackend.embed_picked) BEFORE token t is read, so the device always
        has a step queued while the host takes token t (streams it, checks the stop rules): the
        host's part of a step was on the critical path between two graphs (2026-12-02, H200: ~0.4 ms
        a token beside a ~1.06 ms GPU floor).

        The n-th token is never fed (as the plain loop: nothing reads its logits). A caller that
        stops earlier (a stop token, a stop string: it closes the generator) leaves one step
        queued past its last token: that step is not rolled back (the Gated DeltaNet and conv
        states change in place; a snapshot per token would cost more than the run-ahead saves),
        so the session is SPENT: its --stats counts are the plain loop's (the step's hits, misses
        and routing not counted) but any later forward of it is refused. So only a session
        discarded afterwards runs ahead (strata generate's; serve's and chat's are parked and
        reused: they keep the plain loop).

        qwen4exp (its PLE table on the device): the first step's PLE rows are the host's (`_stage_ple`),
        its window goes up after them; each later step's are hashed and gathered on the device from
        the pick (DeviceBackend.ple_picked). The host's PLE states are kept as the plain loop's: each
        state's count advances as its step is queued, its window as the pick its step fed is read,
        so a run that ends at its length leaves them as step_pick's loop would (`_ple_took`)."""
        if not self.runs_ahead(s):
            raise ValueError("decode_ahead: this session cannot run ahead on this backend (runs_ahead)")
        if n < 1:
            return
        be, g = self.backend, self.geometry
        self._check(s, [int(token)] * min(n, s.max_context - s.pos + 1))
        ids = np.zeros(1, np.int64)  # (the PLE layers read their staged rows, never the ids)

        def queue(row, staged):
            parts = [(s, 0, 1, s.pos, None)]
            got = be.token_step(s, s.pos, self._layers_and_head(row, ids, parts, staged), None, g.n_vocab, banned, wait=False)
            s.pos += 1
            return got

        staged = None
        if self.ple:
            staged = self._stage_ple(s, int(token))
            be.stage_ple_window(next(iter(s.ple_states.values())).window)
        pending = queue(be.stage_row(self._embd_row(int(token))), staged)
        done = 0
        try:
            while True:
                ahead = queue(be.embed_picked((1, g.n_embd)), self._ple_ahead(s)) if done + 1 < n else None
                got = be.wait_picked(pending)
                if ahead is not None and self.ple:
                    self._ple_took(s, got)
                pending, done = ahead, done + 1
                yield got
                if pending is None:
                    return
        finally:
            if pending is not None:  # stopped early: the queued step is past the last token
                be.drop_picked(pending)
                s.pos -= 1
                s.spent = "it ran one step ahead (Model.decode_ahead) past its last token"

    def _head_rows(self, x, out: np.ndarray, pick: np.ndarray | None) -> np.ndarray | None:
        """The LM head of one session's rows x into `out`; with `pick` (the banned ids) the greedy
        token of each row instead, returned: picked on the device step (DeviceBackend.pick_rows,
        only the ids come down), else from the logits here (the sampler's greedy rule)."""
        be = self.backend
        if pick is None:
            be.linear(self.head, x, out)
            return None
        n, V = out.shape[0], self.geometry.n_vocab
        buf = getattr(be, "verify_logits", None)  # the tier's planned rows, when it placed them
        logits = be.linear(self.head, x, buf[:n] if buf is not None and buf.shape[0] >= n else None)
        if getattr(be, "pick_rows", None) is not None:
            return be.pick_rows(logits, pick)
        work = np.array(be.host(logits), F32).reshape(n, V)
        work[:, pick] = -np.inf
        return work.argmax(axis=-1).astype(np.int64)

    def _head_with_hidden(self, spans, n_logits, outs, hidden, H, pick: np.ndarray | None = None):
        """Each session's last n_h rows' head input into hidden[i] (None: none asked), its logits rows
        among them: the final mix of the rows either needs, once, then one LM head product."""
        r, be = self.residual, self.backend
        need = [max(0 if h is None else h.shape[0], n) for h, n in zip(hidden, n_logits)]
        sel = [(b - k, b) for k, (_, b) in zip(need, spans) if k]
        if not sel:  # empty hidden buffers and no logits asked
            return
        final = r.final(be, H[sel[0][0] : sel[0][1]] if len(sel) == 1 else np.concatenate([H[a:b] for a, b in sel]))
        at, want = 0, []  # at: session i's first row in `final`
        for h, n, k in zip(hidden, n_logits, need):
            if h is not None:  # (the host's array: the device step's rows come down)
                h[...] = be.host(final[at + k - h.shape[0] : at + k])
            if n:
                want.append((at + k - n, at + k))
            at += k
        if not want:
            return
        rows = final[want[0][0] : want[0][1]] if len(want) == 1 else np.concatenate([final[a:b] for a, b in want])
        if len(want) == 1:
            return self._head_rows(Input(rows), next(o for o in outs if o.shape[0]), pick)
        logits = be.host(be.linear(self.head, Input(rows)))
        i = 0
        for o in outs:
            o[...] = logits[i : i + o.shape[0]]
            i += o.shape[0]

    def _layers(self, be, H, ids: np.ndarray, parts: list, staged: dict | None = None) -> None:
        """Every layer over the stream H of the rows `parts` describes (_forward_rows); `staged`: a
        device token step's PLE rows (`_stage_ple`), which the PLE layers read instead of hashing."""
        r, L = self.residual, self.geometry.n_layer
        x = ctx = None  # the next block's Input, made with the last block's leave (r.move), or None
        for l in range(L):
            be.boundary(l)
            if l in self.ple:  # adds to the streams before the layer's mix
                self.ple[l].forward(be, H, ids, [Seq(s.ple_states[l], a, b, p, k and k.ple_states[l])
                                                 for s, a, b, p, k in parts], None if staged is None else staged[l])
            if x is None:
                x, ctx = r.enter(be, H, l, ffn=False)
            seqs = [Seq(s.states[l], a, b, p, k and k.states[l]) for s, a, b, p, k in parts]
            x, ctx = r.move(be, H, l, False, self.mixers[l].forward(be, seqs, x), ctx, (l, True))
            counts = [Seq(s.routing[l], a, b, p, k and k.routing[l]) for s, a, b, p, k in parts]
            Y = self.moes[l].forward(be, x, counts)
            if l + 1 < L and l + 1 not in self.ple:  # (PLE adds to the streams between the two)
                x, ctx = r.move(be, H, l, True, Y, ctx, (l + 1, False))
            else:
                r.leave(be, H, l, True, Y, ctx)
                x = ctx = None


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

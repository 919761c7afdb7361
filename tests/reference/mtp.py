"""A float64 numpy reference of qwen35moe's MTP draft block, written from llama.cpp 0.3.36's sources.

Semantics: `graph_mtp` in src/models/qwen35moe.cpp (the draft head's graph), with `build_moe_ffn`'s
softmax gating and renormalised top-k weights and `build_ffn`'s SiLU-gated experts; tensor names
and layouts as conversion/qwen.py `_QwenMtpMixin` writes them (mtp.fc -> nextn.eh_proj,
pre_fc_norm_embedding -> nextn.enorm, pre_fc_norm_hidden -> nextn.hnorm, norm ->
nextn.shared_head_norm, mtp.layers.0.* -> blk.{n_layer}.*; every `*norm.weight` stored with the +1
folded in). Nothing here comes from Strata: the GGUF is read with gguf-py (its reader and its
numpy dequantizers), the arithmetic is float64 throughout.

    e = rms(embed[token]) * enorm ; h = rms(h_trunk) * hnorm ; x = eh_proj @ [e ; h]   (embedding first)
    x += wo @ (attention(q, k, v) * sigmoid(gate))      q/k RMSNorm per head, partial NeoX RoPE,
                                                         causal over the block's own positions
    x += sum_k w_k down_k(silu(gate_k u) * up_k u) + sigmoid(s . u) down_s(silu(gate_s u) * up_s u)
    logits = head @ (rms(x) * shared_head_norm)

Weights are numpy float64 in math orientation: W[out, in] (a GGUF tensor of shape (ne0, ne1) is
W[ne1, ne0]; experts (ne0, ne1, X) are W[X, ne1, ne0]).
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np


def rms(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


def rope(x: np.ndarray, pos: int, n_rot: int, base: float) -> np.ndarray:
    """x [heads, D]: NeoX rotary on the first n_rot dims (pairs i, i + n_rot/2). graph_mtp uses
    ggml_rope_multi (interleaved M-RoPE); for text every section's position is the token's, so
    each frequency rotates by pos * base^(-2i/n_rot), the plain partial rotary."""
    half = n_rot // 2
    ang = pos * base ** (-np.arange(half, dtype=np.float64) * 2 / n_rot)
    c, s = np.cos(ang), np.sin(ang)
    out = x.copy()
    x1, x2 = x[:, :half], x[:, half:n_rot]
    out[:, :half] = x1 * c - x2 * s
    out[:, half:n_rot] = x2 * c + x1 * s
    return out


def load_mtp_weights(paths: Sequence[str | Path]) -> dict:
    """The MTP block's weights and hyperparameters from a model's GGUF file(s), with gguf-py.

    The block's optional tensors fall back as graph_mtp does: nextn.embed_tokens -> token_embd,
    nextn.shared_head_norm -> output_norm, nextn.shared_head_head -> output."""
    import gguf
    from gguf.quants import dequantize

    tensors, kv = {}, {}
    for p in paths:
        r = gguf.GGUFReader(str(p))
        for f in r.fields.values():
            if f.types and f.types[0] != gguf.GGUFValueType.ARRAY:
                kv[f.name] = f.contents()
        for t in r.tensors:
            shape = tuple(int(d) for d in t.shape)  # gguf-py: ne0 first
            vals = dequantize(t.data, t.tensor_type).astype(np.float64)
            tensors[t.name] = vals.reshape(shape[::-1])
    arch = kv["general.architecture"]
    n_mtp = int(kv[f"{arch}.nextn_predict_layers"])
    L = int(kv[f"{arch}.block_count"]) - n_mtp
    b = f"blk.{L}."

    def opt(name, fallback):
        return tensors[b + name] if b + name in tensors else tensors[fallback]

    hp = dict(eps=float(kv[f"{arch}.attention.layer_norm_rms_epsilon"]), n_head=int(kv[f"{arch}.attention.head_count"]),
              n_head_kv=int(kv[f"{arch}.attention.head_count_kv"]), head_dim=int(kv[f"{arch}.attention.key_length"]),
              n_rot=int(kv[f"{arch}.rope.dimension_count"]), rope_base=float(kv[f"{arch}.rope.freq_base"]),
              n_expert_used=int(kv[f"{arch}.expert_used_count"]))
    w = dict(
        embed=opt("nextn.embed_tokens.weight", "token_embd.weight"),
        enorm=tensors[b + "nextn.enorm.weight"], hnorm=tensors[b + "nextn.hnorm.weight"],
        eh_proj=tensors[b + "nextn.eh_proj.weight"],
        attn_norm=tensors[b + "attn_norm.weight"], post_norm=tensors[b + "post_attention_norm.weight"],
        wq=tensors[b + "attn_q.weight"], wk=tensors[b + "attn_k.weight"], wv=tensors[b + "attn_v.weight"],
        wo=tensors[b + "attn_output.weight"], q_norm=tensors[b + "attn_q_norm.weight"],
        k_norm=tensors[b + "attn_k_norm.weight"],
        router=tensors[b + "ffn_gate_inp.weight"], gate_exps=tensors[b + "ffn_gate_exps.weight"],
        up_exps=tensors[b + "ffn_up_exps.weight"], down_exps=tensors[b + "ffn_down_exps.weight"],
        head_norm=opt("nextn.shared_head_norm.weight", "output_norm.weight"),
        head=opt("nextn.shared_head_head.weight", "output.weight"),
    )
    if b + "ffn_up_shexp.weight" in tensors:
        w.update(shexp_gate=tensors[b + "ffn_gate_inp_shexp.weight"].reshape(-1),
                 gate_shexp=tensors[b + "ffn_gate_shexp.weight"], up_shexp=tensors[b + "ffn_up_shexp.weight"],
                 down_shexp=tensors[b + "ffn_down_shexp.weight"])
    return dict(weights=w, hparams=hp, n_layer=L)


def mtp_forward(w: dict, hp: dict, h_trunk: np.ndarray, tokens: Sequence[int], positions: Sequence[int]) -> dict:
    """The block over T pairs (h_trunk[t], tokens[t]) at positions[t] (increasing), each attending
    the block's own earlier pairs and itself (its KV cache) -> {"logits" [T, V], "hidden" [T, E],
    "router" [T, X] (the router logits: a test checks the top-k boundary is no near-tie)}."""
    eps, H, Hkv, D = hp["eps"], hp["n_head"], hp["n_head_kv"], hp["head_dim"]
    h_trunk = np.asarray(h_trunk, np.float64)
    T = len(tokens)
    e = rms(w["embed"][np.asarray(tokens)], w["enorm"], eps)
    hn = rms(h_trunk, w["hnorm"], eps)
    x = np.concatenate([e, hn], axis=1) @ w["eh_proj"].T  # [T, E]
    # attention: per head h, attn_q rows [h*2D, h*2D + D) are the query, the next D the gate
    u = rms(x, w["attn_norm"], eps)
    qg = (u @ w["wq"].T).reshape(T, H, 2 * D)
    q, gate = qg[:, :, :D], qg[:, :, D:]
    k = (u @ w["wk"].T).reshape(T, Hkv, D)
    v = (u @ w["wv"].T).reshape(T, Hkv, D)
    q = rms(q, w["q_norm"], eps)
    k = rms(k, w["k_norm"], eps)
    q = np.stack([rope(q[t], positions[t], hp["n_rot"], hp["rope_base"]) for t in range(T)])
    k = np.stack([rope(k[t], positions[t], hp["n_rot"], hp["rope_base"]) for t in range(T)])
    att = np.empty((T, H, D))
    group = H // Hkv
    for t in range(T):
        for hd in range(H):
            kv = hd // group
            s = k[: t + 1, kv] @ q[t, hd] / np.sqrt(D)
            p = np.exp(s - s.max())
            att[t, hd] = (p / p.sum()) @ v[: t + 1, kv]
    x = x + (att * sigmoid(gate)).reshape(T, H * D) @ w["wo"].T
    # MoE: softmax over all experts, the top k renormalised (build_moe_ffn, norm_w true), SiLU experts
    u = rms(x, w["post_norm"], eps)
    ffn = np.zeros_like(x)
    router = u @ w["router"].T  # [T, X]
    for t in range(T):
        logit = router[t]
        p = np.exp(logit - logit.max())
        p /= p.sum()
        top = np.argsort(-p, kind="stable")[: hp["n_expert_used"]]
        for ex in top:
            hid = silu(w["gate_exps"][ex] @ u[t]) * (w["up_exps"][ex] @ u[t])
            ffn[t] += p[ex] / p[top].sum() * (w["down_exps"][ex] @ hid)
        if "up_shexp" in w:
            hid = silu(w["gate_shexp"] @ u[t]) * (w["up_shexp"] @ u[t])
            ffn[t] += sigmoid(w["shexp_gate"] @ u[t]) * (w["down_shexp"] @ hid)
    x = x + ffn
    y = rms(x, w["head_norm"], eps)
    return {"logits": y @ w["head"].T, "hidden": y, "router": router}


def load_mtp_weights_from_checkpoint(checkpoint_dir: str | Path) -> dict:
    """The same block from the Hugging Face checkpoint llama.cpp's converter reads (a Qwen3.5-MoE
    release's `mtp.*`), without the converter: the names _QwenMtpMixin maps, each norm's gain as
    Qwen3.5's RMSNorm applies it (x * (1 + w): the converter folds the 1 in), q_proj's per-head
    [query | gate] rows as transformers' Qwen3_5MoeAttention chunks them. A GGUF reading that swaps
    eh_proj's halves, forgets a +1 or takes the wrong norm disagrees with this."""
    import json

    from safetensors.numpy import load_file

    d = Path(checkpoint_dir)
    cfg = json.loads((d / "config.json").read_text(encoding="utf-8"))
    t = {}
    for f in sorted(d.glob("*.safetensors")):
        t.update({k: v.astype(np.float64) for k, v in load_file(str(f)).items()})
    m = "mtp.layers.0."
    X = cfg["num_experts"]

    def norm(name):
        return 1.0 + t[name]

    w = dict(
        embed=t["model.embed_tokens.weight"],
        enorm=norm("mtp.pre_fc_norm_embedding.weight"), hnorm=norm("mtp.pre_fc_norm_hidden.weight"),
        eh_proj=t["mtp.fc.weight"],
        attn_norm=norm(m + "input_layernorm.weight"), post_norm=norm(m + "post_attention_layernorm.weight"),
        wq=t[m + "self_attn.q_proj.weight"], wk=t[m + "self_attn.k_proj.weight"], wv=t[m + "self_attn.v_proj.weight"],
        wo=t[m + "self_attn.o_proj.weight"], q_norm=norm(m + "self_attn.q_norm.weight"),
        k_norm=norm(m + "self_attn.k_norm.weight"),
        router=t[m + "mlp.gate.weight"],
        gate_exps=np.stack([t[f"{m}mlp.experts.{e}.gate_proj.weight"] for e in range(X)]),
        up_exps=np.stack([t[f"{m}mlp.experts.{e}.up_proj.weight"] for e in range(X)]),
        down_exps=np.stack([t[f"{m}mlp.experts.{e}.down_proj.weight"] for e in range(X)]),
        shexp_gate=t[m + "mlp.shared_expert_gate.weight"].reshape(-1),
        gate_shexp=t[m + "mlp.shared_expert.gate_proj.weight"], up_shexp=t[m + "mlp.shared_expert.up_proj.weight"],
        down_shexp=t[m + "mlp.shared_expert.down_proj.weight"],
        head_norm=norm("mtp.norm.weight"), head=t["lm_head.weight"],
    )
    rope = cfg["rope_parameters"]
    hp = dict(eps=float(cfg["rms_norm_eps"]), n_head=cfg["num_attention_heads"], n_head_kv=cfg["num_key_value_heads"],
              head_dim=cfg["head_dim"], n_rot=int(cfg["head_dim"] * rope["partial_rotary_factor"]),
              rope_base=float(rope["rope_theta"]), n_expert_used=cfg["num_experts_per_tok"])
    return dict(weights=w, hparams=hp, n_layer=cfg["num_hidden_layers"])

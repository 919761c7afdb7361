"""ModelGeometry: one contract of the numbers the kernels depend on (S2).

The weight table answers "where are the bytes"; this answers "is this the tensor I think it is",
which is where a pack and a kernel disagree - the failure the seed kept paying for. Every field
is a number some kernel depends on, so a change is a change to a kernel contract, not a knob.

Two rules from the seed:
- Layer kinds are DERIVED (`layer % interval == interval - 1` is full attention), never a second
  list kept in parallel; the GGUF's own per-layer array (attention.compress_ratios) is CHECKED
  against the derived kinds, not trusted.
- Check semantics, not totals. Round 194 sized the indexer key store from indexer.head_count = 4,
  which counts QUERY heads; the cached key is ONE shared head (indexer.k_proj is [n_embd, key_dim]),
  so the term was 4x too big and survived because it TIGHTENED the budget. `tensor_specs()` gives
  the exact shape of every tensor role, and loaders check each tensor against it at LOAD time.

Shapes are in GGUF order: shape[0] (ne0) is the contiguous row length, so a torch [out, in]
weight is [in, out] here.
"""

from __future__ import annotations

from dataclasses import MISSING, asdict, dataclass, fields, replace
from typing import Iterable, Mapping

from .hparams import HParam, read_hparams, write_hparams

ARCHS = ("qwen4exp", "qwen35moe")

# Budget categories (strata-budget groups dense weights by these).
ATTENTION = "attention"
LINEAR_ATTENTION = "linear_attention"
INDEXER = "indexer"
HYPER_CONNECTION = "hyper_connection"
SHARED_EXPERT = "shared_expert"
ROUTER = "router"
NORM = "norm"
HEAD = "head"
EMBEDDING = "embedding"  # stays in host memory
PLE = "ple"  # the PLE projection weights (dense, per PLE layer)
PLE_TABLE = "ple_table"  # the huge n-gram table: host memory, read through the page cache (S16)
EXPERT = "expert"  # routed experts: referenced in place in the GGUF, never copied into the pool
MTP = "mtp"  # the MTP draft block's dense tensors (speculative decoding): in the pool, not on the device yet


class GeometryError(ValueError):
    """A geometry that cannot be right, or a tensor whose shape disagrees with it."""


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]  # GGUF order
    category: str
    layer: int | None = None

    @property
    def in_pool(self) -> bool:
        """Dense tensors (the MTP block's too) are copied into pool.bin; experts (the MTP block's too)
        and the PLE table stay in the GGUF."""
        return self.category not in (EXPERT, PLE_TABLE)

    @property
    def multiplied(self) -> bool:
        """A dense matrix the kernels multiply (W x): what the GPU tier puts on the device. Vectors
        (norm gains, ssm_a, ssm_dt) and the depthwise conv kernels are read as f32 by the host's
        elementwise work, the embedding and PLE tables row by row on the host (S16)."""
        # The MTP block's matrices are not: the GPU tier places the trunk; the draft head is placed
        # by the drafting work (its own budget item, weights.drafter), not with the trunk.
        return (self.in_pool and len(self.shape) == 2 and self.category not in (EMBEDDING, MTP)
                and not self.name.endswith("conv1d.weight"))


@dataclass(frozen=True)
class ModelGeometry:
    arch: str
    n_vocab: int
    n_embd: int
    n_layer: int
    full_attention_interval: int
    rms_eps: float
    # full (gated) attention: attn_q holds [q | gate] per head
    n_head: int
    n_head_kv: int
    head_dim: int
    n_rot: int  # rotary dims per head (partial rotary)
    rope_freq_base: float
    rope_sections: tuple[int, ...]  # interleaved mrope sections (text uses only the first)
    # Gated DeltaNet (linear attention)
    ssm_d_conv: int
    ssm_d_state: int  # key head dim
    ssm_n_k_heads: int
    ssm_n_v_heads: int
    ssm_d_inner: int  # value dim = n_v_heads * value head dim
    # MoE
    n_expert: int
    n_expert_used: int
    n_ff_exp: int
    n_ff_shexp: int
    recurrent_layers: tuple[int, ...] = ()  # the GGUF's per-layer bool array (1 = GDN), checked not trusted
    # MTP draft blocks after the trunk (the GGUF's nextn_predict_layers; its block_count counts them
    # too): layers n_layer .. n_layer + n_mtp_layer - 1, each a full-attention MoE layer + nextn.*
    n_mtp_layer: int = 0
    # The MTP block's optional tensors, 1 where the file carries its own: without nextn.embed_tokens,
    # nextn.shared_head_head or nextn.shared_head_norm, llama.cpp's graph_mtp reads the trunk's
    # token_embd, output and output_norm (src/models/qwen35moe.cpp; the loader marks the three
    # TENSOR_NOT_REQUIRED). Fields, not a look at the file, so tensor_specs stays the exact list.
    mtp_embed_tokens: int = 0
    mtp_shared_head_head: int = 0
    mtp_shared_head_norm: int = 0
    # qwen4exp only (0 / empty for qwen35moe)
    hc: int = 0
    hc_lowrank: int = 0
    idx_n_heads: int = 0  # indexer QUERY heads; the key is ONE shared head
    idx_head_dim: int = 0
    idx_top_k: int = 0  # indexer budget in tokens
    idx_compress_ratio: int = 0  # tokens averaged into one index block
    compress_ratios: tuple[int, ...] = ()  # the GGUF's per-layer array, checked not trusted
    ple_layers: tuple[int, ...] = ()  # 0-based
    ple_ngram_size: int = 0
    ple_heads_per_ngram: int = 0
    ple_conv_kernel: int = 0
    ple_eos_token_id: int = 0
    ple_row_dim: int = 0
    ple_table_rows: int = 0
    ple_multipliers: tuple[int, ...] = ()  # uint64: exceed 2^53, never floats
    ple_head_offsets: tuple[int, ...] = ()
    ple_head_vocab_sizes: tuple[int, ...] = ()
    n_ctx_train: int = 0  # the GGUF's context_length (0: not recorded): a longer --max-context is warned about

    def __post_init__(self) -> None:
        _validate(self)

    # --- derived, never stored -------------------------------------------------------------

    def is_full_attention(self, layer: int) -> bool:
        i = self.full_attention_interval
        return layer % i == i - 1

    @property
    def full_attention_layers(self) -> tuple[int, ...]:
        return tuple(l for l in range(self.n_layer) if self.is_full_attention(l))

    @property
    def linear_attention_layers(self) -> tuple[int, ...]:
        return tuple(l for l in range(self.n_layer) if not self.is_full_attention(l))

    @property
    def has_qsa(self) -> bool:
        return self.idx_n_heads > 0

    @property
    def ssm_head_v_dim(self) -> int:
        return self.ssm_d_inner // self.ssm_n_v_heads

    @property
    def ssm_conv_channels(self) -> int:
        return 2 * self.ssm_d_state * self.ssm_n_k_heads + self.ssm_d_inner

    @property
    def ple_n_heads(self) -> int:
        return (self.ple_ngram_size - 1) * self.ple_heads_per_ngram

    @property
    def ple_embed_dim(self) -> int:
        return self.ple_row_dim * self.ple_n_heads

    @property
    def idx_key_store_dim(self) -> int:
        """Per cached token of a QSA layer's indexer: ONE shared key head (not idx_n_heads of them)."""
        return self.idx_head_dim

    # --- serialisation (geometry.txt holds exactly these fields) --------------------------

    def to_values(self) -> dict[str, object]:
        return asdict(self)

    @classmethod
    def from_values(cls, values: Mapping[str, object], *, source: str = "geometry") -> "ModelGeometry":
        names = {f.name: f for f in fields(cls)}
        unknown = sorted(set(values) - set(names))
        if unknown:
            raise GeometryError(f"{source}: unknown geometry field(s) {unknown}; this Strata knows {sorted(names)}")
        missing = [n for n, f in names.items() if n not in values and f.default is MISSING]
        if missing:
            raise GeometryError(f"{source}: missing geometry field(s) {missing}")
        kw = {}
        for n, v in values.items():
            want = names[n].type
            kw[n] = tuple(int(x) for x in v) if "tuple" in str(want) else v
        return cls(**kw)


def _require(cond: bool, what: str) -> None:
    if not cond:
        raise GeometryError(what)


def _validate(g: ModelGeometry) -> None:
    _require(g.arch in ARCHS, f"architecture {g.arch!r} is not supported (expected one of {ARCHS})")
    for f in fields(g):
        v = getattr(g, f.name)
        if isinstance(v, int) and not isinstance(v, bool):
            _require(v >= 0, f"geometry field {f.name} is {v}, expected >= 0")
    for name in ("n_vocab", "n_embd", "n_layer", "full_attention_interval", "n_head", "n_head_kv",
                 "head_dim", "ssm_d_conv", "ssm_d_state", "ssm_n_k_heads", "ssm_n_v_heads",
                 "ssm_d_inner", "n_expert", "n_expert_used", "n_ff_exp"):
        _require(getattr(g, name) > 0, f"geometry field {name} is {getattr(g, name)}, expected > 0")
    _require(g.n_head % g.n_head_kv == 0, f"n_head {g.n_head} is not a multiple of n_head_kv {g.n_head_kv}")
    _require(0 < g.n_rot <= g.head_dim and g.n_rot % 2 == 0, f"n_rot {g.n_rot} must be even and in 1..head_dim {g.head_dim}")
    _require(g.ssm_n_v_heads % g.ssm_n_k_heads == 0,
             f"ssm_n_v_heads {g.ssm_n_v_heads} is not a multiple of ssm_n_k_heads {g.ssm_n_k_heads}")
    _require(g.ssm_d_inner % g.ssm_n_v_heads == 0,
             f"ssm_d_inner {g.ssm_d_inner} is not a multiple of ssm_n_v_heads {g.ssm_n_v_heads}")
    _require(g.n_expert_used <= g.n_expert, f"n_expert_used {g.n_expert_used} > n_expert {g.n_expert}")
    _require(g.rms_eps > 0, f"rms_eps {g.rms_eps} must be > 0")
    if g.recurrent_layers:
        _require(len(g.recurrent_layers) == g.n_layer,
                 f"recurrent_layers has {len(g.recurrent_layers)} entries, expected n_layer = {g.n_layer}")
    _require(g.n_mtp_layer == 0 or g.arch == "qwen35moe",
             f"an MTP block in a {g.arch} model: no GGUF layout is defined for one (llama.cpp's {g.arch} converter "
             "exports none and its tensor list has no nextn tensors); Strata knows qwen35moe's MTP block only")
    _require(g.n_mtp_layer in (0, 1),
             f"{g.n_mtp_layer} MTP blocks: Strata knows one (llama.cpp's graph_mtp runs a single block)")
    for name in MTP_OPTIONAL:
        v = getattr(g, name)
        _require(v in (0, 1) and (v == 0 or g.n_mtp_layer == 1),
                 f"geometry field {name} is {v}, expected 0 or 1, and 0 without an MTP block")
    if g.arch == "qwen35moe":
        _require(g.hc == 0 and not g.has_qsa and not g.ple_layers,
                 "qwen35moe has no hyper-connections, QSA indexer or PLE fields")
        return
    _require(g.hc > 1 and g.hc_lowrank > 0, f"qwen4exp needs hc > 1 and hc_lowrank > 0 (got {g.hc}, {g.hc_lowrank})")
    if g.compress_ratios:
        _require(len(g.compress_ratios) == g.n_layer,
                 f"compress_ratios has {len(g.compress_ratios)} entries, expected n_layer = {g.n_layer}")
    if g.has_qsa:
        _require(g.idx_head_dim > 0 and g.idx_top_k > 0 and g.idx_compress_ratio > 0,
                 "QSA needs idx_head_dim, idx_top_k and idx_compress_ratio > 0")
        _require(g.idx_top_k % g.idx_compress_ratio == 0,
                 f"idx_top_k {g.idx_top_k} is not a multiple of idx_compress_ratio {g.idx_compress_ratio}")
        _require(g.n_rot <= g.idx_head_dim, f"n_rot {g.n_rot} does not fit the indexer head dim {g.idx_head_dim}")
    if g.ple_layers:
        _require(all(0 <= l < g.n_layer and not g.is_full_attention(l) for l in g.ple_layers),
                 f"PLE layers {list(g.ple_layers)} must be linear-attention layers in 0..{g.n_layer - 1}")
        n = g.ple_n_heads
        _require(n > 0 and g.ple_row_dim > 0, "PLE needs ngram_size > 1, heads_per_ngram > 0 and a row dim")
        _require(len(g.ple_multipliers) == g.ple_ngram_size * len(g.ple_layers) or len(g.ple_multipliers) == g.ple_ngram_size,
                 f"ple_multipliers has {len(g.ple_multipliers)} entries, expected ngram_size = {g.ple_ngram_size} per PLE layer")
        _require(len(g.ple_head_offsets) == len(g.ple_head_vocab_sizes) and len(g.ple_head_offsets) % n == 0,
                 f"PLE head offsets/vocab sizes: {len(g.ple_head_offsets)}/{len(g.ple_head_vocab_sizes)} entries, expected a multiple of {n}")
        _require(all(x < 2**64 for x in g.ple_multipliers), "PLE multipliers must fit in uint64")
        end = max(o + s for o, s in zip(g.ple_head_offsets, g.ple_head_vocab_sizes))
        _require(end <= g.ple_table_rows, f"PLE heads reach row {end}, the table has {g.ple_table_rows}")


def check_layer_arrays(g: ModelGeometry) -> list[str]:
    """Compare every per-layer array the GGUF carries with the DERIVED layer kinds.

    A recurrent_layers array that disagrees is an error (the file describes another model); the
    compress-ratio array has a known benign disagreement, returned as a warning (see below).
    """
    if g.recurrent_layers:
        derived = [0 if g.is_full_attention(l) else 1 for l in range(g.n_layer)]
        bad = [l for l in range(g.n_layer) if g.recurrent_layers[l] != derived[l]]
        if bad:
            raise GeometryError(
                f"attention.recurrent_layers disagrees with full_attention_interval {g.full_attention_interval} "
                f"at layers {bad}: the file says {[g.recurrent_layers[l] for l in bad]}, derived {[derived[l] for l in bad]}"
            )
    return check_compress_ratios(g)


def mtp_notes(g: ModelGeometry) -> list[str]:
    """What a reader of the pack should know about its MTP draft block (empty without one)."""
    if not g.n_mtp_layer:
        return []
    return [f"the model carries an MTP draft block (layer {g.n_layer}, nextn_predict_layers {g.n_mtp_layer}); "
            "it is packed (its experts in place in the GGUF) and drafts only with strata generate --spec N "
            "(speculative decoding); without --spec the trunk runs alone"]


def check_compress_ratios(g: ModelGeometry) -> list[str]:
    """Compare the GGUF's per-layer compress-ratio array with the DERIVED layer kinds.

    Returns the disagreements as sentences (empty when they agree). An all-zero array on a model
    whose full-attention layers carry indexer tensors is a known converter bug (transformers
    renames "full_attention" to "indexed_attention", so the converter's test never matches):
    callers report it; nobody silently runs dense attention.
    """
    if not g.compress_ratios:
        return []
    expect = [g.idx_compress_ratio if g.has_qsa and g.is_full_attention(l) else 0 for l in range(g.n_layer)]
    if list(g.compress_ratios) == expect:
        return []
    if g.has_qsa and not any(g.compress_ratios):
        return [
            f"attention.compress_ratios is all zeros, but layers {list(g.full_attention_layers)} are "
            f"full attention (every {g.full_attention_interval}th) and carry QSA indexer tensors; "
            f"using the derived kinds with compress ratio {g.idx_compress_ratio} (a known converter "
            "bug: transformers renames full_attention to indexed_attention)"
        ]
    bad = [l for l in range(g.n_layer) if g.compress_ratios[l] != expect[l]]
    return [f"attention.compress_ratios disagrees with the derived layer kinds at layers {bad}: "
            f"found {[g.compress_ratios[l] for l in bad]}, derived {[expect[l] for l in bad]}"]


def tensor_specs(g: ModelGeometry) -> list[TensorSpec]:
    """The exact name, shape (GGUF order) and category of every tensor the model has."""
    E, V = g.n_embd, g.n_vocab
    out = [TensorSpec("token_embd.weight", (E, V), EMBEDDING), TensorSpec("output.weight", (E, V), HEAD)]
    if g.arch == "qwen4exp":
        out += _hc_specs("output_hc", g, None, inject=False)
    else:
        out.append(TensorSpec("output_norm.weight", (E,), NORM))
    for l in range(g.n_layer):
        out += _layer_specs(g, l)
    if g.ple_layers:
        out.append(TensorSpec("per_layer_token_embd.weight", (g.ple_row_dim, g.ple_table_rows), PLE_TABLE))
    for l in range(g.n_layer, g.n_layer + g.n_mtp_layer):
        out += _mtp_specs(g, l)
    return out


def _mtp_specs(g: ModelGeometry, l: int) -> list[TensorSpec]:
    """qwen35moe's MTP block as llama.cpp's converter writes it (conversion/qwen.py _QwenMtpMixin maps
    mtp.fc / pre_fc_norm_embedding / pre_fc_norm_hidden / norm / layers.0.* to blk.{n_layer}.nextn.
    eh_proj / enorm / hnorm / shared_head_norm and the layer's own names), with the shapes its loader
    requires (src/models/qwen35moe.cpp load_block_mtp): a full-attention decoder layer with MoE and
    shared expert, plus nextn.eh_proj [2 n_embd -> n_embd] (input: the embedding's norm, then the
    hidden state's) and the norms. Dense tensors are category MTP (in the pool, a budget group of
    their own); the routed experts are EXPERT, left in place in the GGUF like the trunk's."""
    E, V, b = g.n_embd, g.n_vocab, f"blk.{l}"
    s = [TensorSpec(f"{b}.attn_norm.weight", (E,), NORM, l), TensorSpec(f"{b}.post_attention_norm.weight", (E,), NORM, l)]
    s += _full_attention_specs(g, l) + _moe_specs(g, l)
    s += [TensorSpec(f"{b}.nextn.eh_proj.weight", (2 * E, E), MTP, l),
          TensorSpec(f"{b}.nextn.enorm.weight", (E,), NORM, l),
          TensorSpec(f"{b}.nextn.hnorm.weight", (E,), NORM, l)]
    if g.mtp_embed_tokens:
        s.append(TensorSpec(f"{b}.nextn.embed_tokens.weight", (E, V), MTP, l))
    if g.mtp_shared_head_head:
        s.append(TensorSpec(f"{b}.nextn.shared_head_head.weight", (E, V), MTP, l))
    if g.mtp_shared_head_norm:
        s.append(TensorSpec(f"{b}.nextn.shared_head_norm.weight", (E,), NORM, l))
    return [t if t.category == EXPERT else replace(t, category=MTP) for t in s]


MTP_OPTIONAL = {  # geometry field -> the tensor it says the MTP block carries (blk.{n_layer}.nextn.*)
    "mtp_embed_tokens": "nextn.embed_tokens.weight",
    "mtp_shared_head_head": "nextn.shared_head_head.weight",
    "mtp_shared_head_norm": "nextn.shared_head_norm.weight",
}


def mtp_tensor_names(g: ModelGeometry) -> list[str]:
    """Every tensor of the MTP block (empty without one): what an MTP-only GGUF contributes."""
    return [s.name for s in tensor_specs(g) if s.layer is not None and s.layer >= g.n_layer]


def _hc_specs(prefix: str, g: ModelGeometry, layer: int | None, inject: bool) -> list[TensorSpec]:
    HE, R = g.hc * g.n_embd, g.hc_lowrank
    s = [
        TensorSpec(f"{prefix}_norm.weight", (HE,), NORM, layer),
        TensorSpec(f"{prefix}_down.weight", (HE, R), HYPER_CONNECTION, layer),
        TensorSpec(f"{prefix}_up.weight", (R, HE), HYPER_CONNECTION, layer),
    ]
    if inject:
        s.append(TensorSpec(f"{prefix}_inject.weight", (HE, g.hc), HYPER_CONNECTION, layer))
    return s


def _layer_specs(g: ModelGeometry, l: int) -> list[TensorSpec]:
    E, b = g.n_embd, f"blk.{l}"
    s: list[TensorSpec] = []
    if g.arch == "qwen4exp":
        s += _hc_specs(f"{b}.hc_attn", g, l, inject=True) + _hc_specs(f"{b}.hc_ffn", g, l, inject=True)
    else:
        s += [TensorSpec(f"{b}.attn_norm.weight", (E,), NORM, l),
              TensorSpec(f"{b}.post_attention_norm.weight", (E,), NORM, l)]
    s += _full_attention_specs(g, l) if g.is_full_attention(l) else _linear_attention_specs(g, l)
    if l in g.ple_layers:
        s += _ple_specs(g, l)
    s += _moe_specs(g, l)
    return s


def _full_attention_specs(g: ModelGeometry, l: int) -> list[TensorSpec]:
    E, D, b = g.n_embd, g.head_dim, f"blk.{l}"
    s = [
        TensorSpec(f"{b}.attn_q.weight", (E, 2 * g.n_head * D), ATTENTION, l),  # [q | gate] per head
        TensorSpec(f"{b}.attn_k.weight", (E, g.n_head_kv * D), ATTENTION, l),
        TensorSpec(f"{b}.attn_v.weight", (E, g.n_head_kv * D), ATTENTION, l),
        TensorSpec(f"{b}.attn_output.weight", (g.n_head * D, E), ATTENTION, l),
        TensorSpec(f"{b}.attn_q_norm.weight", (D,), NORM, l),
        TensorSpec(f"{b}.attn_k_norm.weight", (D,), NORM, l),
    ]
    if g.has_qsa:
        K = g.idx_head_dim
        s += [
            TensorSpec(f"{b}.indexer.q_proj.weight", (E, g.idx_n_heads * K), INDEXER, l),
            # ONE shared key head: [n_embd, key_dim], not idx_n_heads of them (round 194).
            TensorSpec(f"{b}.indexer.k_proj.weight", (E, K), INDEXER, l),
            TensorSpec(f"{b}.indexer.q_norm.weight", (K,), NORM, l),
            TensorSpec(f"{b}.indexer.k_norm.weight", (K,), NORM, l),
        ]
    return s


def _linear_attention_specs(g: ModelGeometry, l: int) -> list[TensorSpec]:
    E, b, nv = g.n_embd, f"blk.{l}", g.ssm_n_v_heads
    return [
        TensorSpec(f"{b}.attn_qkv.weight", (E, g.ssm_conv_channels), LINEAR_ATTENTION, l),
        TensorSpec(f"{b}.attn_gate.weight", (E, g.ssm_d_inner), LINEAR_ATTENTION, l),
        TensorSpec(f"{b}.ssm_beta.weight", (E, nv), LINEAR_ATTENTION, l),
        TensorSpec(f"{b}.ssm_alpha.weight", (E, nv), LINEAR_ATTENTION, l),
        TensorSpec(f"{b}.ssm_a", (nv,), LINEAR_ATTENTION, l),  # -exp(A_log), folded by the converter
        TensorSpec(f"{b}.ssm_dt.bias", (nv,), LINEAR_ATTENTION, l),
        TensorSpec(f"{b}.ssm_conv1d.weight", (g.ssm_d_conv, g.ssm_conv_channels), LINEAR_ATTENTION, l),
        TensorSpec(f"{b}.ssm_norm.weight", (g.ssm_head_v_dim,), NORM, l),  # gated norm: stored as is
        TensorSpec(f"{b}.ssm_out.weight", (g.ssm_d_inner, E), LINEAR_ATTENTION, l),
    ]


def _ple_specs(g: ModelGeometry, l: int) -> list[TensorSpec]:
    E, HE, P, b = g.n_embd, g.hc * g.n_embd, g.ple_embed_dim, f"blk.{l}"
    return [
        TensorSpec(f"{b}.ple_key.weight", (P, HE), PLE, l),
        TensorSpec(f"{b}.ple_value.weight", (P, E), PLE, l),
        TensorSpec(f"{b}.ple_norm_key.weight", (HE,), NORM, l),
        TensorSpec(f"{b}.ple_norm_query.weight", (HE,), NORM, l),
        TensorSpec(f"{b}.ple_norm_conv.weight", (HE,), NORM, l),
        TensorSpec(f"{b}.ple_conv1d.weight", (g.ple_conv_kernel, HE), PLE, l),
    ]


def _moe_specs(g: ModelGeometry, l: int) -> list[TensorSpec]:
    E, F, X, b = g.n_embd, g.n_ff_exp, g.n_expert, f"blk.{l}"
    s = [
        TensorSpec(f"{b}.ffn_gate_inp.weight", (E, X), ROUTER, l),
        TensorSpec(f"{b}.ffn_gate_exps.weight", (E, F, X), EXPERT, l),
        TensorSpec(f"{b}.ffn_up_exps.weight", (E, F, X), EXPERT, l),
        TensorSpec(f"{b}.ffn_down_exps.weight", (F, E, X), EXPERT, l),
    ]
    if g.n_ff_shexp:
        S = g.n_ff_shexp
        s += [
            # the converter keeps torch's [1, n_embd] as a 2-D [n_embd, 1]
            TensorSpec(f"{b}.ffn_gate_inp_shexp.weight", (E, 1), ROUTER, l),
            TensorSpec(f"{b}.ffn_gate_shexp.weight", (E, S), SHARED_EXPERT, l),
            TensorSpec(f"{b}.ffn_up_shexp.weight", (E, S), SHARED_EXPERT, l),
            TensorSpec(f"{b}.ffn_down_shexp.weight", (S, E), SHARED_EXPERT, l),
        ]
    return s


def ggml_shape(shape: Iterable[int]) -> tuple[int, ...]:
    """A shape as ggml compares shapes: trailing 1-dimensions are no dimension at all.

    ggml keeps ne[0..3] with unused dims 1, so [n, 1] and [n] are the same tensor; llama.cpp's
    quantizer writes the converter's [n_embd, 1] (ffn_gate_inp_shexp) as [n_embd], and a strict
    tuple compare refused every quantized release. Leading and inner 1s still count.
    """
    dims = [int(d) for d in shape]
    while len(dims) > 1 and dims[-1] == 1:
        dims.pop()
    return tuple(dims)


def same_shape(a: Iterable[int], b: Iterable[int]) -> bool:
    """True when ggml sees one shape in `a` and `b` (trailing 1-dims ignored)."""
    return ggml_shape(a) == ggml_shape(b)


def check_tensor_shapes(g: ModelGeometry, found: Mapping[str, tuple[int, ...]], *, source: str,
                        ignore: Iterable[str] = ()) -> None:
    """Every tensor the contract names must exist with its shape, compared as ggml compares shapes
    (`same_shape`: trailing 1-dims are not a difference); no unknown tensor either.

    A mismatch names the tensor, the shape found and the shape required, at LOAD time - not as a
    wrong number inside a GEMV at token 4000.
    """
    specs = {s.name: s for s in tensor_specs(g)}
    ignore = set(ignore)
    for name, spec in specs.items():
        if name in ignore:
            continue
        if name not in found:
            raise GeometryError(f"{source}: tensor {name} is missing (required shape {list(spec.shape)})")
        if not same_shape(found[name], spec.shape):
            raise GeometryError(
                f"{source}: tensor {name} has shape {list(found[name])}, the geometry requires {list(spec.shape)}"
            )
    extra = sorted(set(found) - set(specs) - ignore)
    if extra:
        raise GeometryError(f"{source}: tensor(s) the {g.arch} geometry does not know: {extra[:8]}"
                            + (f" and {len(extra) - 8} more" if len(extra) > 8 else ""))


# --- geometry.txt: the pack's copy of this contract (format: index_format/hparams.py) ------------

_TUPLE_FIELDS = {f.name for f in fields(ModelGeometry) if "tuple" in str(f.type)}


def _kind(name: str, annotation: str) -> str:
    if name in _TUPLE_FIELDS:
        # the PLE hash multipliers exceed 2^53: u64, never a float
        return "u64" if name == "ple_multipliers" else "i64"
    return {"int": "i64", "float": "f64", "str": "str"}[annotation]


_KINDS = {f.name: _kind(f.name, str(f.type)) for f in fields(ModelGeometry)}


def write_geometry(path, g: ModelGeometry) -> None:
    """geometry.txt holds exactly ModelGeometry's fields, each with its kind."""
    write_hparams(path, {n: HParam(_KINDS[n], tuple(v) if n in _TUPLE_FIELDS else (v,))
                         for n, v in g.to_values().items()})


def read_geometry(path) -> ModelGeometry:
    """geometry.txt -> ModelGeometry; each field must have its kind (an int is never an f64)."""
    params = read_hparams(path)
    for k, p in params.items():
        if k in _KINDS and p.kind != _KINDS[k]:
            raise GeometryError(f"{path}: field {k} is {p.kind}, expected {_KINDS[k]}")
    values = {k: (p.array() if k in _TUPLE_FIELDS else p.scalar()) for k, p in params.items()}
    return ModelGeometry.from_values(values, source=str(path))

"""Tiny random transformers checkpoints of both architectures, structurally complete.

`tiny_config(arch, **overrides)` gives the config fields; `build_checkpoint(arch, out_dir, seed)`
writes config.json, the safetensors (qwen4exp: the PLE n-gram shards in a second part, as a
release stores them) and a tokenizer that llama.cpp's converter accepts; `load_model` loads it
back as the float32 eager reference; `ablation_effects` measures how much each component matters.

The geometry is small but every structural feature of the production models is present:
  qwen4exp  -- n_embd 80, 8 layers, full_attention_interval 4 (layers 3 and 7 are QSA attention:
               4 heads of 32, 2 KV heads, partial rotary 32 * 0.25 = 8, indexer 4 query heads of
               12 over ONE key head), Gated DeltaNet with 2 key heads and 6 value heads of 16
               (n_v = 3 * n_k, so the v-head reordering matters), hyper-connections (hc 4, low
               rank 8), 16 experts top-4 (n_ff 32) + sigmoid-gated shared expert (n_ff 56),
               PLE on layer 1 (1-based id 2): 2 n-gram orders x 2 heads of 20, a 4096-row table
               saved as 4 checkpoint shards.
  qwen35moe -- the same linear/full attention and MoE, plain pre-norm residuals.
Sizes are pairwise distinct where possible (80, 32, 56, 12, 96, 160, 320, ...)
so a transposed or swapped dimension shows up as a shape error, not a silent pass.

Weights are drawn with scales chosen so each component moves the logits (see _init_rules);
all values are rounded to bf16-representable floats so an f32 and a bf16 conversion of the
same checkpoint describe the same model (1-D tensors and +1-folded norms stay F32 anyway).
Near-tie screening of router / QSA / greedy gaps is NOT done here (BRIEF section 5): the
numerical-agreement fixtures must pick seeds and check those gaps themselves.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

ARCHS = ("qwen4exp", "qwen35moe")

# Bump when the tokenizer or the weight initialisation changes: it is part of the GGUF cache key.
BUILDER_VERSION = 2

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
VOCAB_SIZE = 512

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# The real Qwen3.5 pre-tokenizer (transformers/models/qwen3_5/tokenization_qwen3_5.py). Using the
# same split rules makes the converter's "qwen35" pre-tokenizer name TRUE for this vocabulary; only
# the vocabulary (hence the converter's hash of a test string) differs.
QWEN35_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"""
    r"""| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

_CORPUS = """\
The quick brown fox jumps over the lazy dog. A mixture of experts routes every token to a few
experts; the router picks the top experts by probability and the shared expert always runs.
Linear attention keeps a recurrent state per head, while every fourth layer attends to all
previous tokens through a sparse indexer that scores blocks of keys and keeps the best ones.
def forward(self, hidden_states, position_ids=None):
    return self.layers(hidden_states) + 1
for i in range(10): print(i * 2, i ** 3, "value", [1, 2, 3])
User: What is the capital of France? Assistant: The capital of France is Paris.
User: Count to five. Assistant: one, two, three, four, five.
Numbers 0 1 2 3 4 5 6 7 8 9 10 100 1000 3.14159 2.71828 -42 +7 50%
Hyper-connections keep several residual streams and mix them with learned weights.
The n-gram hash embedding looks up bigrams and trigrams in a very large table.
"""


def _qwen4exp_defaults() -> dict[str, Any]:
    return dict(
        architectures=["Qwen4ExpForCausalLM"],
        model_type="qwen4_exp_text",
        vocab_size=VOCAB_SIZE,
        hidden_size=80,
        num_hidden_layers=8,
        full_attention_interval=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        hidden_act="silu",
        output_gate_type="sigmoid",
        max_position_embeddings=4096,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        rope_parameters=dict(
            rope_type="default",
            rope_theta=10_000_000.0,
            partial_rotary_factor=0.25,
            mrope_section=[2, 1, 1],
            mrope_interleaved=True,
        ),
        linear_conv_kernel_dim=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=6,
        num_experts=16,
        num_experts_per_tok=4,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=56,
        norm_topk_prob=True,
        hc_count=4,
        hc_lowrank=8,
        ple_layer_ids=[2],
        ple_conv_kernel_size=4,
        ngram_size=3,
        heads_per_ngram=2,
        ngram_vocab_size_base=1000,
        make_ngram_vocab_size_divisible_by=128,
        seed=1234,
        split_ngram_parts=4,
        indexer_n_heads=4,
        indexer_kv_heads=1,
        indexer_head_dim=12,
        indexer_budget=8,
        indexer_compress_ratio=4,
    )


def _qwen35moe_defaults() -> dict[str, Any]:
    return dict(
        architectures=["Qwen3_5MoeForCausalLM"],
        model_type="qwen3_5_moe_text",
        vocab_size=VOCAB_SIZE,
        hidden_size=80,
        num_hidden_layers=8,
        full_attention_interval=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        hidden_act="silu",
        max_position_embeddings=4096,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        rope_parameters=dict(
            rope_type="default",
            rope_theta=10_000_000.0,
            partial_rotary_factor=0.25,
            mrope_section=[2, 1, 1],
            mrope_interleaved=True,
        ),
        linear_conv_kernel_dim=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=6,
        num_experts=16,
        num_experts_per_tok=4,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=56,
    )


def tiny_config(arch: str, **overrides: Any) -> dict[str, Any]:
    """The config.json fields of a tiny `arch` model; `overrides` replace or add fields."""
    if arch == "qwen4exp":
        cfg = _qwen4exp_defaults()
    elif arch == "qwen35moe":
        cfg = _qwen35moe_defaults()
    else:
        raise ValueError(f"tiny_config: unknown arch {arch!r}; expected one of {ARCHS}")
    cfg.update(overrides)
    n_layer, interval = cfg["num_hidden_layers"], cfg["full_attention_interval"]
    # The released qwen4exp config.json says "full_attention" (transformers renames it to
    # "indexed_attention" on load); writing the same word reproduces the converter's view.
    cfg.setdefault("layer_types", [
        "full_attention" if i % interval == interval - 1 else "linear_attention" for i in range(n_layer)
    ])
    ids = token_ids()
    cfg.setdefault("eos_token_id", ids["<|im_end|>"])
    cfg.setdefault("pad_token_id", ids["<|endoftext|>"])
    cfg.setdefault("bos_token_id", None)
    return cfg


def token_ids() -> dict[str, int]:
    """Ids of the special tokens: they are added first, so they are 0, 1, 2."""
    return {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}


def _transformers_config(cfg: dict[str, Any]):
    if cfg["model_type"] == "qwen4_exp_text":
        from transformers import Qwen4ExpTextConfig as Config
    else:
        from transformers import Qwen3_5MoeTextConfig as Config
    fields = {k: v for k, v in cfg.items() if k not in ("architectures", "model_type")}
    return Config(**fields)


def _model_class(cfg: dict[str, Any]):
    if cfg["model_type"] == "qwen4_exp_text":
        from transformers import Qwen4ExpForCausalLM as Model
    else:
        from transformers import Qwen3_5MoeForCausalLM as Model
    return Model


def _init_rules(cfg: dict[str, Any]) -> list[tuple[str, str, float]]:
    """(name suffix, kind, scale) in match order; kinds are drawn in _init_weights.

    Scales are chosen so no component is negligible (measured with ablation_effects: each
    ablation moves the logits by roughly 5-90 %): embeddings O(1); projections ~ unit gain
    (std scale/sqrt(fan_in)); zero-centred norm gains w ~ N(0, 0.1^2) so the stored (1 + w) is
    not trivially 1; a router sharp enough that the top-k is not a coin toss; A in [0.05, 1] so
    the delta-rule state keeps memory over tens of tokens (the HF default A ~ U(0.01, 16)
    forgets almost at once); a non-zero PLE conv (HF initialises it to zero, which would hide
    it). qwen4exp's hyper-connection streams are not normalised between layers, so its experts
    get a larger gain and its PLE table a smaller one than a plain pre-norm model needs.
    """
    hc_model = cfg["model_type"] == "qwen4_exp_text"
    return [
        ("embed_tokens.weight", "normal", 1.0),
        ("lm_head.weight", "fan_in", 4.0 if hc_model else 2.5),
        (".A_log", "alog", 0.0),
        (".dt_bias", "normal", 0.5),
        ("linear_attn.norm.weight", "one_norm", 0.1),
        ("linear_attn.conv1d.weight", "normal", 0.5),
        ("ple.conv1d.weight", "normal", 0.5),
        ("ngram_embedding.weight", "normal", 0.3),
        # zero-centred gains (transformers computes x * (1 + w)); the GGUF stores 1 + w
        ("norm.weight", "normal", 0.1),
        ("layernorm.weight", "normal", 0.1),
        ("hc_norm.weight", "normal", 0.1),
        ("norm_key.weight", "normal", 0.1),
        ("norm_query.weight", "normal", 0.1),
        ("norm_conv.weight", "normal", 0.1),
        ("mlp.gate.weight", "fan_in", 3.0),
        ("experts.gate_up_proj", "fan_in", 1.0),
        ("experts.down_proj", "fan_in", 3.0 if hc_model else 1.0),
        ("input_mix_weight_up.weight", "fan_in", 2.0),
        ("block_inject_weight.weight", "fan_in", 2.0),
        (".weight", "fan_in", 1.0),
    ]


def _init_weights(model, cfg: dict[str, Any], seed: int) -> None:
    import torch

    gen = torch.Generator().manual_seed(seed)
    rules = _init_rules(cfg)
    with torch.no_grad():
        for name, param in model.named_parameters():
            kind, scale = next(((k, s) for suffix, k, s in rules if name.endswith(suffix)), (None, 0.0))
            if kind is None:
                raise ValueError(f"tiny model init: no rule for parameter {name} {tuple(param.shape)}")
            shape = tuple(param.shape)
            if kind == "normal":
                value = torch.randn(shape, generator=gen) * scale
            elif kind == "fan_in":  # torch layout [..., out, in]: the last axis is fan-in
                value = torch.randn(shape, generator=gen) * (scale / math.sqrt(shape[-1]))
            elif kind == "one_norm":
                value = 1.0 + torch.randn(shape, generator=gen) * scale
            elif kind == "alog":
                value = torch.log(0.05 + 0.95 * torch.rand(shape, generator=gen))
            else:
                raise ValueError(f"tiny model init: unknown kind {kind!r} for {name}")
            # bf16-representable values: f32 and bf16 conversions then carry the same numbers
            param.copy_(value.to(torch.bfloat16).to(torch.float32))


def build_tokenizer(out_dir: Path) -> None:
    """Train a tiny byte-level BPE with the Qwen3.5 pre-tokenizer and save it in HF format."""
    from tokenizers import Regex, Tokenizer, decoders, normalizers, pre_tokenizers
    from tokenizers.models import BPE
    from tokenizers.trainers import BpeTrainer
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN35_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([_CORPUS] * 4, trainer=trainer)
    if tok.get_vocab_size() > VOCAB_SIZE:
        raise ValueError(f"tiny tokenizer has {tok.get_vocab_size()} tokens, more than vocab_size {VOCAB_SIZE}")
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        additional_special_tokens=["<|im_start|>"],
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out_dir))


def build_checkpoint(arch: str, out_dir: str | Path, seed: int = 0, **overrides: Any) -> Path:
    """Create a tiny random `arch` model and save it (safetensors, config.json, tokenizer) in out_dir."""
    import torch

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    cfg = tiny_config(arch, **overrides)
    hf_cfg = _transformers_config(cfg)
    torch.manual_seed(seed)
    model = _model_class(cfg)(hf_cfg).to(torch.float32).eval()
    _init_weights(model, cfg, seed)
    model.save_pretrained(str(out_dir))
    if cfg.get("mtp_num_hidden_layers"):
        _add_mtp_block(out_dir, cfg, seed)
    _move_ple_to_last_part(out_dir)
    build_tokenizer(out_dir)
    _write_config(out_dir / "config.json", cfg)
    return out_dir


def _add_mtp_block(out_dir: Path, cfg: dict[str, Any], seed: int) -> None:
    """Add the MTP draft block a Qwen3.5-MoE release carries (`mtp_num_hidden_layers`: 1).

    transformers models no MTP head (it ignores `mtp.*` on load), so the block is written here as
    a release stores it: `mtp.fc` [n_embd, 2 n_embd], `mtp.pre_fc_norm_embedding/hidden`,
    `mtp.norm`, and `mtp.layers.0.*`, a full-attention decoder layer with MoE, its tensors named as
    the trunk's last full-attention layer's and drawn by the same rules from their own generator.
    """
    import torch
    from safetensors.torch import load_file, save_file

    if cfg["model_type"] != "qwen3_5_moe_text" or cfg["mtp_num_hidden_layers"] != 1:
        raise ValueError("tiny model: an MTP block is built for qwen35moe with mtp_num_hidden_layers 1 only")
    single = out_dir / "model.safetensors"
    tensors = load_file(str(single))
    n, interval, E = cfg["num_hidden_layers"], cfg["full_attention_interval"], cfg["hidden_size"]
    last_full = max(l for l in range(n) if l % interval == interval - 1)
    prefix = f"model.layers.{last_full}."
    gen = torch.Generator().manual_seed(seed + 7919)
    shapes = {f"mtp.layers.0.{k[len(prefix):]}": tuple(v.shape) for k, v in tensors.items() if k.startswith(prefix)}
    shapes.update({"mtp.fc.weight": (E, 2 * E), "mtp.pre_fc_norm_embedding.weight": (E,),
                   "mtp.pre_fc_norm_hidden.weight": (E,), "mtp.norm.weight": (E,)})
    rules = _init_rules(cfg)
    for name, shape in sorted(shapes.items()):
        kind, scale = next((k, sc) for suffix, k, sc in rules if name.endswith(suffix))
        if kind == "fan_in":
            value = torch.randn(shape, generator=gen) * (scale / math.sqrt(shape[-1]))
        else:  # "normal": the zero-centred norm gains
            value = torch.randn(shape, generator=gen) * scale
        tensors[name] = value.to(torch.bfloat16).to(torch.float32)
    save_file(tensors, str(single), metadata={"format": "pt"})


PLE_SHARD_MARK = ".ngram_embedding.shard_"


def _move_ple_to_last_part(out_dir: Path) -> None:
    """Store the n-gram table shards in a second safetensors part, as a release does.

    The converter emits tensors part by part, so the PLE table then comes last in its output
    and `--split-max-tensors` can put it alone in the second GGUF shard (convert.py).
    """
    from safetensors.torch import load_file, save_file

    single = out_dir / "model.safetensors"
    tensors = load_file(str(single))
    ple = {k: v for k, v in tensors.items() if PLE_SHARD_MARK in k}
    if not ple:
        return
    rest = {k: v for k, v in tensors.items() if PLE_SHARD_MARK not in k}
    parts = {"model-00001-of-00002.safetensors": rest, "model-00002-of-00002.safetensors": ple}
    weight_map = {}
    for fname, group in parts.items():
        save_file(group, str(out_dir / fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in group})
    total = sum(v.numel() * v.element_size() for v in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
    single.unlink()


def _write_config(path: Path, cfg: dict[str, Any]) -> None:
    """Overlay our fields on what save_pretrained wrote, so config.json says what the release says."""
    saved = json.loads(path.read_text(encoding="utf-8"))
    saved.update(cfg)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(saved, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    tmp.replace(path)


def load_model(checkpoint_dir: str | Path):
    """Load a built checkpoint as the float32 eager reference model."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        str(checkpoint_dir), dtype=torch.float32, attn_implementation="eager",
        experts_implementation="eager",
    ).eval()


def ablation_effects(model, input_ids) -> dict[str, float]:
    """Relative change ||logits' - logits|| / ||logits|| when one component is switched off.

    BRIEF section 5: a component whose removal barely moves the logits lets a broken
    implementation of it pass every comparison. Ablations (each on a copy of the model):
      expert          -- zero the down projection of the most-routed expert of a middle layer
      shared_expert   -- zero the shared expert's down projection in that layer
      linear_attn     -- zero out_proj of the first linear-attention layer
      full_attn       -- zero o_proj of the first full-attention layer
      qwen4exp only:
      qsa_selection   -- let every indexer keep all blocks (dense attention instead of QSA)
      hc_inject       -- zero every block_inject_weight (uniform injection into the streams)
      ple             -- zero the PLE value projection (PLE adds nothing)
    """
    import copy

    import torch

    mask = torch.ones_like(input_ids)
    cfg = model.config
    kinds = cfg.layer_types
    lin = kinds.index("linear_attention")
    full = next(i for i, k in enumerate(kinds) if k != "linear_attention")
    mid = cfg.num_hidden_layers // 2
    with torch.no_grad():
        out = model(input_ids, attention_mask=mask, output_router_logits=True)
    base = out.logits[0]
    routed = out.router_logits[mid].topk(cfg.num_experts_per_tok, dim=-1).indices.flatten()
    top_expert = int(torch.bincount(routed, minlength=cfg.num_experts).argmax())

    def effect(edit) -> float:
        m = copy.deepcopy(model)
        with torch.no_grad():
            edit(m)
            logits = m(input_ids, attention_mask=mask).logits[0]
        return float((logits - base).norm() / base.norm())

    layers = lambda m: m.model.layers  # noqa: E731
    res = {
        "expert": effect(lambda m: layers(m)[mid].mlp.experts.down_proj[top_expert].zero_()),
        "shared_expert": effect(lambda m: layers(m)[mid].mlp.shared_expert.down_proj.weight.zero_()),
        "linear_attn": effect(lambda m: layers(m)[lin].linear_attn.out_proj.weight.zero_()),
        "full_attn": effect(lambda m: layers(m)[full].self_attn.o_proj.weight.zero_()),
    }
    if cfg.model_type == "qwen4_exp_text":
        def dense(m):
            for layer in layers(m):
                if layer.layer_type != "linear_attention":
                    idx = layer.self_attn.indexer
                    idx.token_budget = idx.compress_ratio * input_ids.shape[1]
                    idx.block_topk = input_ids.shape[1]

        def no_inject(m):
            for layer in layers(m):
                layer.attn_hyper_connection.block_inject_weight.weight.zero_()
                layer.mlp_hyper_connection.block_inject_weight.weight.zero_()

        res["qsa_selection"] = effect(dense)
        res["hc_inject"] = effect(no_inject)
        ple_layer = cfg.ple_layer_ids[0] - 1
        res["ple"] = effect(lambda m: layers(m)[ple_layer].ple.value_proj.weight.zero_())
    return res

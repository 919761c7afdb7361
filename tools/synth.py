"""Synthetic model GGUFs, laid out exactly as llama.cpp's converter and quantizer would (strata-pack synth).

A synthetic model stands in for a real checkpoint wherever only the layout and the arithmetic
matter: tests (`tiny`), the README's embedded default (`demo`) and benchmarks at the production
geometry (`seed-4l`). The weights are random, but everything a reader can check is the real thing
(docs/gguf-layout.md, measured from llama.cpp's own converter):

- names and shapes: index_format/geometry.py's tensor_specs(), the one contract; metadata keys, value
  types and key order: the converter's set_gguf_parameters chain, then llama-quantize's tail
  (general.quantization_version and general.file_type re-set at the end, quantize.imatrix.* when an
  IQ1/IQ2/IQ3_XXS type needs an importance matrix, split.* last);
- tensor order: llama-quantize's (llama_model_loader's weight_name_comparer: non-block tensors by
  name, then blocks by number, names sorted within a block). The seed's native_experts.txt offsets
  show exactly this order in the release (ffn_down_exps, ffn_down_shexp, ffn_gate_exps, ...);
- split shards as gguf-split / the converter write them: `NAME-0000i-of-0000n.gguf`; shard 1 holds
  all metadata plus split.no / split.count / split.tensors.count, the others ONLY those three keys.
  qwen4exp ships as two shards, the second holding only per_layer_token_embd (the PLE table), as the
  release does (`--native ...-00001-of-00002.gguf --ple-gguf ...-00002-of-00002.gguf`);
- block types: chosen per tensor by the preset (an IQ3_XXS-style mix for qwen4exp), then the
  quantizer's own fallback when a row is not a whole number of blocks (llama-quant.cpp
  tensor_type_fallback: 256-block IQ types -> IQ4_NL, Q2_0/Q2_K/Q3_K -> Q4_0, Q4_K -> Q5_0,
  Q5_K -> Q5_1, Q6_K -> Q8_0, and F16 when even that does not fit). 1-D tensors, `*_norm.weight`
  and names not ending in `.weight` are F32, as the converter forces;
- `attention.compress_ratios` for qwen4exp holds the QSA block size at every full-attention layer
  (0 elsewhere), what a correct converter writes, so `strata-pack convert` needs no extra flag.
  llama.cpp's converter today writes all zeros (transformers renames full_attention to
  indexed_attention and its test never matches); `zero_compress_ratios=True` (`strata-pack synth
  --zero-compress-ratios`) reproduces that file, which then needs `--compress-ratio` to pack.

Weights: projections are random blocks with RMS 1/sqrt(row length) (tools/synth_blocks.py);
stored norms (1 + w folded, or ssm_norm as is) are near 1; ssm_a = -exp(A_log) in [-16, -1];
ssm_dt.bias is softplus^-1 of dt in [1e-3, 1e-1] (transformers' init). The router is SKEWED, as
in real models, so that a routing profile matters: every token embedding carries a shared
direction u, and every router row carries u with a Zipf-distributed strength over a random
permutation of the experts, so a few experts per layer are hot for most tokens. The output head's
rows of tokens that do not decode to printable ASCII are zero (printable_tokens), so the demo's
random text still prints.

Generation streams: each tensor is produced in chunks by its own RNG, seeded from (seed, tensor
name), so the same seed gives byte-identical files and no tensor is ever whole in memory.
"""

from __future__ import annotations

import functools
import hashlib
import math
import os
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Iterator, Mapping, Sequence

import gguf
import numpy as np

from strata.index_format.geometry import ARCHS, EXPERT, ModelGeometry, TensorSpec, tensor_specs
from strata.index_format.ggml_types import GGMLType, ggml_type
from strata.tools import synth_blocks as sb
from strata.tools.gguf_io import VT, GGUFWriter


class SynthError(ValueError):
    """A synthetic model that cannot be made as asked (unknown preset, bad output name, ...)."""


# ============================================================================ presets

# llama_ftype values written as general.file_type (llama.h)
FTYPE_MOSTLY_Q4_K_M = 15
FTYPE_MOSTLY_IQ3_XXS = 23


@dataclass(frozen=True)
class TypePlan:
    """Block types: `rules` map a tensor-name regex to a target type (first match wins); routed
    experts take `experts[layer % len(experts)]` = (gate/up type, down type)."""

    rules: tuple[tuple[str, str], ...]
    experts: tuple[tuple[str, str], ...]
    file_type: int

    def overriding(self, *rules: tuple[str, str]) -> "TypePlan":
        return replace(self, rules=tuple(rules) + self.rules)


# Production-like qwen4exp mix (release "IQ3_XXS"). Evidence from the seed (sections 6.2, 6.3):
# layer 0 experts IQ2_XS gate/up + IQ4_NL down (blob 1,868,800 B), layer 1 IQ2_XXS + Q2_0
# (1,305,600 B); between ffn_down_exps and ffn_gate_exps sit 921,600 B (ffn_down_shexp: IQ4_NL,
# the fallback of IQ4_XS on 640-long rows), between ffn_gate_exps and ffn_up_exps 3,496,960 B
# (ffn_gate_inp BF16 2,621,440 + ffn_gate_inp_shexp BF16 5,120 + ffn_gate_shexp IQ4_XS 870,400);
# the embedding's engine form is 0.444 GiB, i.e. Q5_0. The release's routers are 2 bytes per
# weight although this converter forces F32 on them: the release was not made by exactly this
# converter version. `tiny` uses the converter's F32 instead, so both forms are exercised.
QWEN4EXP_IQ3_XXS = TypePlan(
    rules=(
        (r"^token_embd\.weight$", "Q5_0"),
        (r"^output\.weight$", "Q8_0"),
        (r"^per_layer_token_embd\.weight$", "IQ3_XXS"),  # falls back to IQ4_NL on short rows
        (r"\.ffn_gate_inp(_shexp)?\.weight$", "BF16"),
        (r"\.ffn_(gate|up|down)_shexp\.weight$", "IQ4_XS"),
        (r"\.attn_qkv\.weight$", "Q5_0"),
        (r"\.attn_gate\.weight$", "Q4_0"),
        (r"\.ssm_out\.weight$", "IQ4_NL"),
        (r"\.ssm_(alpha|beta)\.weight$", "BF16"),
        (r"\.ssm_conv1d\.weight$", "F32"),
        (r"\.attn_q\.weight$", "IQ4_NL"),
        (r"\.attn_[kv]\.weight$", "Q8_0"),
        (r"\.attn_output\.weight$", "Q5_0"),
        (r"\.indexer\.[qk]_proj\.weight$", "BF16"),  # the quantizer never touches these
        (r"hc_(attn|ffn)_inject\.weight$", "BF16"),
        (r"hc(_attn|_ffn)?_(down|up)\.weight$", "Q8_0"),
        (r"\.ple_(key|value)\.weight$", "Q8_0"),
        (r"\.ple_conv1d\.weight$", "BF16"),
    ),
    experts=(("IQ2_XS", "IQ3_XXS"), ("IQ2_XXS", "Q2_0"), ("IQ3_XXS", "IQ4_NL"), ("IQ2_XS", "Q2_0")),
    file_type=FTYPE_MOSTLY_IQ3_XXS,
)

# qwen35moe as commonly released: K-quant dense weights (a Q4_K_M-like mix), IQ/Q2_0 experts.
QWEN35MOE_K_MIX = TypePlan(
    rules=(
        (r"^token_embd\.weight$", "Q4_0"),
        (r"^output\.weight$", "Q6_K"),
        (r"\.ffn_gate_inp(_shexp)?\.weight$", "F32"),
        (r"\.ffn_(gate|up)_shexp\.weight$", "Q4_K"),
        (r"\.ffn_down_shexp\.weight$", "Q6_K"),
        (r"\.(attn_qkv|attn_gate|attn_q|attn_k|attn_v)\.weight$", "Q4_K"),
        (r"\.(ssm_out|attn_output)\.weight$", "Q6_K"),
        (r"\.ssm_(alpha|beta)\.weight$", "BF16"),
        (r"\.ssm_conv1d\.weight$", "F32"),
        (r"\.nextn\.eh_proj\.weight$", "Q4_K"),  # the MTP block's fc: the quantizer's default type
    ),
    experts=(("Q4_K", "Q6_K"), ("IQ3_XXS", "Q2_0")),
    file_type=FTYPE_MOSTLY_Q4_K_M,
)


@dataclass(frozen=True)
class Preset:
    name: str
    description: str
    dims: Mapping[str, object]  # ModelGeometry fields shared by both architectures
    qwen4exp: Mapping[str, object]  # hc / QSA fields (qwen4exp only)
    ple: Mapping[str, int]  # layer, ngram_size, heads_per_ngram, conv_kernel, vocab_base (qwen4exp)
    types: Mapping[str, TypePlan]
    context_length: int
    compress_ratio: int  # QSA block size (in the file unless zero_compress_ratios reproduces the converter bug)
    qwen35moe_shards: int = 1  # gguf-split shard count for qwen35moe (qwen4exp: main + PLE shard)

    def geometry(self, arch: str) -> ModelGeometry:
        _check_arch(arch)
        values = dict(self.dims, arch=arch, n_ctx_train=self.context_length)
        if arch == "qwen4exp":
            values.update(self.qwen4exp, idx_compress_ratio=self.compress_ratio)
            values.update(_ple_fields(values, self.ple))
        return ModelGeometry(**values)


def _dims(*, n_vocab, n_embd, n_layer, n_head, head_dim, n_rot, rope_sections, d_state, n_k, n_v,
          n_expert, n_expert_used, n_ff, n_ff_sh) -> dict[str, object]:
    # GDN value head dim = key head dim (qwen4exp requires it; llama.cpp's loader assumes it)
    return dict(
        n_vocab=n_vocab, n_embd=n_embd, n_layer=n_layer, full_attention_interval=4, rms_eps=1e-6,
        n_head=n_head, n_head_kv=2, head_dim=head_dim, n_rot=n_rot, rope_freq_base=1e7,
        rope_sections=tuple(rope_sections), ssm_d_conv=4, ssm_d_state=d_state, ssm_n_k_heads=n_k,
        ssm_n_v_heads=n_v, ssm_d_inner=n_v * d_state, n_expert=n_expert, n_expert_used=n_expert_used,
        n_ff_exp=n_ff, n_ff_shexp=n_ff_sh,
    )


PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        Preset(
            name="tiny",
            description="seconds to make, for tests: 8 layers (QSA at 3 and 7), 16 experts, n_embd 256",
            # n_embd 256: the smallest width whose rows are whole 256-element IQ/K blocks; vocab 512 keeps
            # the PLE hash multipliers above 2^53 (they are bounded by 2^63 / n_vocab), as a trap should be.
            dims=_dims(n_vocab=512, n_embd=256, n_layer=8, n_head=4, head_dim=64, n_rot=16, rope_sections=(3, 3, 2, 0),
                       d_state=32, n_k=2, n_v=4, n_expert=16, n_expert_used=4, n_ff=64, n_ff_sh=128),
            qwen4exp=dict(hc=4, hc_lowrank=32, idx_n_heads=4, idx_head_dim=32, idx_top_k=64),
            ple=dict(layer=1, ngram_size=3, heads_per_ngram=2, conv_kernel=4, vocab_base=1000),
            types={
                # F32 routers as this converter writes them; ple_conv1d asked as Q8_0 falls back to F16
                # (a 4-element row), as llama-quantize does with default rules.
                "qwen4exp": QWEN4EXP_IQ3_XXS.overriding((r"\.ffn_gate_inp(_shexp)?\.weight$", "F32"),
                                                        (r"\.ple_conv1d\.weight$", "Q8_0")),
                "qwen35moe": QWEN35MOE_K_MIX,
            },
            context_length=4096,
            compress_ratio=16,
            qwen35moe_shards=2,
        ),
        Preset(
            name="demo",
            description="the README's embedded default: 8 layers, 64 experts, n_embd 1024, ~0.3 GB",
            dims=_dims(n_vocab=32768, n_embd=1024, n_layer=8, n_head=8, head_dim=128, n_rot=32, rope_sections=(6, 5, 5, 0),
                       d_state=64, n_k=4, n_v=8, n_expert=64, n_expert_used=6, n_ff=256, n_ff_sh=256),
            qwen4exp=dict(hc=4, hc_lowrank=64, idx_n_heads=4, idx_head_dim=64, idx_top_k=512),
            ple=dict(layer=1, ngram_size=3, heads_per_ngram=4, conv_kernel=4, vocab_base=4000),
            types={"qwen4exp": QWEN4EXP_IQ3_XXS, "qwen35moe": QWEN35MOE_K_MIX},
            context_length=32768,
            compress_ratio=32,
        ),
        Preset(
            name="seed-4l",
            description="the production geometry (BRIEF section 2) with 4 layers (3 linear + 1 QSA), "
                        "512 experts, vocab 248320, a reduced PLE table; for benchmarks "
                        "(4.9 GB qwen4exp, 6.5 GB qwen35moe)",
            dims=_dims(n_vocab=248320, n_embd=2560, n_layer=4, n_head=24, head_dim=256, n_rot=64,
                       rope_sections=(11, 11, 10, 0), d_state=128, n_k=16, n_v=48, n_expert=512, n_expert_used=10,
                       n_ff=640, n_ff_sh=640),
            # indexer budget 2048 tokens over 64-token blocks: plausible values (the released config
            # is not public); the ratio is not in the file, so it is a pack-time argument anyway.
            qwen4exp=dict(hc=4, hc_lowrank=320, idx_n_heads=4, idx_head_dim=128, idx_top_k=2048),
            # the real table has ~20M rows per head (ngram_vocab_size_base 2e7); 16384 keeps it at ~24 MB
            ple=dict(layer=1, ngram_size=3, heads_per_ngram=8, conv_kernel=4, vocab_base=16384),
            types={"qwen4exp": QWEN4EXP_IQ3_XXS, "qwen35moe": QWEN35MOE_K_MIX},
            context_length=262144,
            compress_ratio=64,
            qwen35moe_shards=2,
        ),
    )
}


def _check_arch(arch: str) -> None:
    if arch not in ARCHS:
        raise SynthError(f"architecture {arch!r} is not supported (expected one of {', '.join(ARCHS)})")


def get_preset(name: str) -> Preset:
    p = PRESETS.get(name)
    if p is None:
        raise SynthError(f"unknown preset {name!r} (known: {', '.join(PRESETS)})")
    return p


# ---------------------------------------------------------------------------- PLE constants

PLE_TABLE_ROW_MULTIPLE = 128  # transformers pads the n-gram vocabulary to make_ngram_vocab_size_divisible_by


def _ple_fields(values: Mapping[str, object], ple: Mapping[str, int]) -> dict[str, object]:
    """PLE geometry the way transformers builds it: one prime modulus per n-gram head, starting at
    `vocab_base`, offsets cumulative, the table padded to a multiple of 128 rows; the embed dim
    defaults to n_embd, split evenly over the heads."""
    n_vocab, n_embd = int(values["n_vocab"]), int(values["n_embd"])
    n_heads = (ple["ngram_size"] - 1) * ple["heads_per_ngram"]
    sizes = _primes_from(ple["vocab_base"], n_heads)
    offsets = tuple(int(x) for x in np.cumsum((0,) + sizes[:-1]))
    rows = -(-sum(sizes) // PLE_TABLE_ROW_MULTIPLE) * PLE_TABLE_ROW_MULTIPLE
    return dict(
        ple_layers=(ple["layer"],), ple_ngram_size=ple["ngram_size"],
        ple_heads_per_ngram=ple["heads_per_ngram"], ple_conv_kernel=ple["conv_kernel"],
        ple_eos_token_id=n_vocab - 1, ple_row_dim=n_embd // n_heads, ple_table_rows=rows,
        ple_multipliers=_hash_multipliers(n_vocab, ple["ngram_size"]),
        ple_head_offsets=offsets, ple_head_vocab_sizes=sizes,
    )


def _primes_from(start: int, count: int) -> tuple[int, ...]:
    out: list[int] = []
    n = start
    while len(out) < count:
        if n > 1 and all(n % d for d in range(2, math.isqrt(n) + 1)):
            out.append(n)
        n += 1
    return tuple(out)


def _hash_multipliers(n_vocab: int, ngram_size: int) -> tuple[int, ...]:
    # Odd multipliers below 2^63 / n_vocab, so token * multiplier cannot overflow int64 (the model's
    # own bound); drawn from the upper half, so a small vocabulary gets values above 2^53.
    bound = (2**63 - 1) // n_vocab
    rng = np.random.default_rng(_key("ple.layer_multipliers"))
    return tuple(int(x) | 1 for x in rng.integers(bound // 2, bound - 1, size=ngram_size, dtype=np.int64))


# ============================================================================ block types

# llama-quant.cpp tensor_type_fallback: the type tried when a row is not whole blocks of the target
_FALLBACK = {
    **dict.fromkeys(("IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ4_XS"), "IQ4_NL"),
    **dict.fromkeys(("Q2_0", "Q2_K", "Q3_K"), "Q4_0"),
    "Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0",
}


def resolve_type(target: str, shape: Sequence[int]) -> str:
    """The type llama-quantize writes for a `target` type and a tensor of `shape` (GGUF order):
    the target when its rows are whole blocks, else the fallback, else F16."""
    t = ggml_type(target, where="synth type plan")
    if shape[0] % t.block_size == 0:
        return t.name
    fb = _FALLBACK.get(t.name, t.name)
    return fb if shape[0] % ggml_type(fb).block_size == 0 else "F16"


def _converter_forces_f32(spec: TensorSpec) -> bool:
    # convert_hf_to_gguf prepare_tensors: 1-D tensors, norms and names not ending in .weight are F32
    return len(spec.shape) == 1 or spec.name.endswith("_norm.weight") or not spec.name.endswith(".weight")


def _target_type(plan: TypePlan, spec: TensorSpec, preset: str, arch: str) -> str:
    if _converter_forces_f32(spec):
        return "F32"
    if spec.category == EXPERT:
        gate_up, down = plan.experts[spec.layer % len(plan.experts)]
        return down if ".ffn_down_exps." in spec.name else gate_up
    for pattern, type_name in plan.rules:
        if re.search(pattern, spec.name):
            return type_name
    raise SynthError(f"preset {preset} ({arch}) has no block type for tensor {spec.name}")


# ============================================================================ the plan


@dataclass(frozen=True)
class SynthTensor:
    name: str
    shape: tuple[int, ...]  # GGUF order
    type_name: str  # as written (after the quantizer's fallback)
    target: str  # as the preset asked
    role: str  # how its values are made (see _ROLE_RULES)
    layer: int | None

    @property
    def ggml(self) -> GGMLType:
        return ggml_type(self.type_name)

    @property
    def nbytes(self) -> int:
        return self.ggml.nbytes(self.shape)


@dataclass(frozen=True)
class SynthPlan:
    arch: str
    preset: Preset
    geometry: ModelGeometry
    shards: tuple[tuple[SynthTensor, ...], ...]  # tensors per output file, in file order
    metadata: tuple[tuple[str, object, VT, VT | None], ...] = field(repr=False)  # main shard's keys

    @property
    def tensors(self) -> tuple[SynthTensor, ...]:
        return tuple(t for s in self.shards for t in s)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)


def plan_model(arch: str, preset: str, zero_compress_ratios: bool = False, mtp: bool = False) -> SynthPlan:
    """Everything about the files except the tensor data: geometry, tensors, types, order, shards, keys.
    `zero_compress_ratios`: write qwen4exp's attention.compress_ratios as all zeros, as llama.cpp's
    converter does (the QSA block size is then lost and convert needs --compress-ratio). `mtp`: carry
    an MTP draft block as llama.cpp's converter writes a Qwen3.5-MoE checkpoint's by default
    (conversion/qwen.py _QwenMtpMixin: block_count n_layer + 1, nextn_predict_layers 1, the block at
    blk.{n_layer} with nextn.eh_proj / enorm / hnorm / shared_head_norm, its recurrent_layers entry false)."""
    p = get_preset(preset)
    g = p.geometry(arch)
    if mtp:
        if arch != "qwen35moe":
            raise SynthError(f"--mtp: {arch} has no GGUF layout for an MTP block (llama.cpp's converter exports "
                             "none for it); qwen35moe only")
        # a Qwen3.5-MoE release's mtp.norm always exists (-> shared_head_norm); it borrows the trunk's
        # embedding and head (no mtp.embed_tokens / shared_head.head)
        g = replace(g, n_mtp_layer=1, mtp_shared_head_norm=1)
    types = p.types[arch]
    tensors = [_plan_tensor(spec, types, p.name, arch) for spec in tensor_specs(g)]
    shards = _shard(arch, p, sorted(tensors, key=_quantizer_order), g.n_layer)
    return SynthPlan(arch, p, g, shards, tuple(_metadata(arch, p, g, shards, zero_compress_ratios)))


def _plan_tensor(spec: TensorSpec, types: TypePlan, preset: str, arch: str) -> SynthTensor:
    shape = spec.shape
    target = _target_type(types, spec, preset, arch)
    role = _role(spec.name)
    written = resolve_type(target, shape)
    if role not in _RANDOM_BLOCK_ROLES and written not in sb.STRUCTURED_TYPES:
        # these values are computed, then quantized: only types with a quantizer here can hold them
        raise SynthError(f"preset {preset} ({arch}): {spec.name} carries computed values and needs one of "
                         f"{', '.join(sb.STRUCTURED_TYPES)}, not {written}")
    return SynthTensor(spec.name, shape, written, target, role, spec.layer)


def _quantizer_order(t: SynthTensor) -> tuple[int, str]:
    # llama_model_loader::weight_name_comparer: non-block tensors (layer -1) first, then by layer
    # number, then by name (so blk.10 follows blk.9, not blk.1)
    return (-1 if t.layer is None else t.layer, t.name)


PLE_TABLE = "per_layer_token_embd.weight"


def _shard(arch: str, p: Preset, ordered: list[SynthTensor], n_layer: int) -> tuple[tuple[SynthTensor, ...], ...]:
    if arch == "qwen4exp":
        main = tuple(t for t in ordered if t.name != PLE_TABLE)
        table = tuple(t for t in ordered if t.name == PLE_TABLE)
        return (main, table) if table else (main,)
    # gguf-split --split-max-tensors N: consecutive runs of at most N tensors, in file order. N is
    # the trunk's share, so an MTP block (last in file order) adds a shard of its own rather than
    # moving the trunk's split point into a layer's experts (the packer needs a layer's in one file).
    n_trunk = sum(t.layer is None or t.layer < n_layer for t in ordered)
    per = -(-n_trunk // p.qwen35moe_shards)
    return tuple(tuple(ordered[i : i + per]) for i in range(0, len(ordered), per))


# ============================================================================ tokenizer

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
TOKEN_NORMAL, TOKEN_CONTROL = 1, 3  # llama.cpp token types
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Bytes roughly by frequency in English text and code, so the first merges look like real ones
# ("Ġt", "he", ...); every other byte follows in byte order.
_FREQUENT = b" etaoinsrhldcumfpgwybvkxjqzETAOINSRHLDCUMFPGWYBVKXJQZ0123456789.,'\"-:;!?()\n_/=+*[]{}<>#%&@$\\|^`~\t"
_MERGE_FANOUT = 64  # bytes appended to each token of one length to make the next


@dataclass(frozen=True)
class Vocab:
    tokens: list[str]
    token_types: np.ndarray  # int32
    merges: list[str]

    def special(self, name: str) -> int:
        return len(self.tokens) - len(SPECIAL_TOKENS) + SPECIAL_TOKENS.index(name)

    @property
    def bos(self) -> int:
        return self.special("<|endoftext|>")

    @property
    def eos(self) -> int:
        return self.special("<|im_end|>")


def byte_to_unicode() -> list[tuple[int, str]]:
    """GPT-2's byte-level alphabet in its id order: printable bytes as themselves, the rest mapped
    to U+0100.. in byte order (space -> 'Ġ', newline -> 'Ċ')."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    shifted = [b for b in range(256) if b not in set(printable)]
    return [(b, chr(b)) for b in printable] + [(b, chr(0x100 + i)) for i, b in enumerate(shifted)]


def synthetic_vocab(n_vocab: int) -> Vocab:
    """A byte-level BPE vocabulary of exactly n_vocab tokens: the 256 byte tokens, one merge per
    further token (both parts are earlier tokens, the result is new), and the three special tokens
    as control tokens at the top. Two-byte tokens are the cheapest byte pairs (cost = sum of the
    bytes' frequency ranks); each longer length is a cheap token of the previous length plus one
    of the _MERGE_FANOUT most frequent bytes. No token but a byte ends in a space: the
    pre-tokenizer starts words with their space."""
    n_merges = n_vocab - 256 - len(SPECIAL_TOKENS)
    if n_merges < 0:
        raise SynthError(f"n_vocab {n_vocab} is below the 256 byte tokens + {len(SPECIAL_TOKENS)} special tokens")
    alphabet = byte_to_unicode()
    tokens = [c for _, c in alphabet]
    rank = _byte_ranks(alphabet)
    by_rank = np.argsort(rank, kind="stable")
    appendable = by_rank[[alphabet[i][0] != 0x20 for i in by_rank]]
    merges: list[str] = []
    left, cost, fan = by_rank, rank[by_rank], appendable
    while len(merges) < n_merges:
        need = n_merges - len(merges)
        if len(merges):  # longer tokens: only as many cheap prefixes as the remaining merges need
            fan = appendable[:_MERGE_FANOUT]
            left, cost = left[: -(-need // len(fan))], cost[: -(-need // len(fan))]
        a, b = np.repeat(left, len(fan)), np.tile(fan, len(left))
        c = np.repeat(cost, len(fan)) + rank[b]
        order = np.lexsort((b, a, c))[:need]
        left, cost = np.arange(len(tokens), len(tokens) + len(order)), c[order]
        for i, j in zip(a[order].tolist(), b[order].tolist()):
            merges.append(f"{tokens[i]} {tokens[j]}")
            tokens.append(tokens[i] + tokens[j])
    types = np.full(n_vocab, TOKEN_NORMAL, np.int32)
    types[-len(SPECIAL_TOKENS):] = TOKEN_CONTROL
    return Vocab(tokens + list(SPECIAL_TOKENS), types, merges)


def _byte_ranks(alphabet: list[tuple[int, str]]) -> np.ndarray:
    """Frequency rank of each byte token (by token id): _FREQUENT's order, then the rest by id."""
    where = {b: i for i, (b, _) in enumerate(alphabet)}
    rank = np.full(256, -1, np.int64)
    rank[[where[b] for b in _FREQUENT]] = np.arange(len(_FREQUENT))
    rest = rank < 0
    rank[rest] = len(_FREQUENT) + np.arange(int(rest.sum()))
    return rank


# ============================================================================ metadata

_IMATRIX_TYPES = {"IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS"}  # llama-quantize refuses these without one


def _metadata(arch: str, p: Preset, g: ModelGeometry, shards,
              zero_compress_ratios: bool = False) -> list[tuple[str, object, VT, VT | None]]:
    """Main-shard keys in the order the converter writes them, then llama-quantize's tail."""
    kv: list[tuple[str, object, VT, VT | None]] = []

    def add(key, value, vt, sub=None):
        kv.append((key, value, vt, sub))

    tensors = [t for s in shards for t in s]
    vocab = synthetic_vocab(g.n_vocab)
    add("general.architecture", arch, VT.STRING)
    add("general.type", "model", VT.STRING)
    add("general.name", f"Strata Synth {p.name} {arch}", VT.STRING)
    add("general.basename", f"strata-synth-{arch}", VT.STRING)
    add("general.size_label", _size_label(g, tensors), VT.STRING)
    kv += arch_metadata(g, context_length=p.context_length, zero_compress_ratios=zero_compress_ratios)
    add("tokenizer.ggml.model", "gpt2", VT.STRING)
    add("tokenizer.ggml.pre", "qwen35", VT.STRING)
    add("tokenizer.ggml.tokens", vocab.tokens, VT.ARRAY, VT.STRING)
    add("tokenizer.ggml.token_type", vocab.token_types.tolist(), VT.ARRAY, VT.INT32)
    add("tokenizer.ggml.merges", vocab.merges, VT.ARRAY, VT.STRING)
    # a real Qwen conversion: eos <|im_end|>, pad = bos = <|endoftext|>, BOS not added
    add("tokenizer.ggml.eos_token_id", vocab.eos, VT.UINT32)
    add("tokenizer.ggml.padding_token_id", vocab.bos, VT.UINT32)
    add("tokenizer.ggml.bos_token_id", vocab.bos, VT.UINT32)
    add("tokenizer.ggml.add_bos_token", False, VT.BOOL)
    add("tokenizer.chat_template", CHAT_TEMPLATE, VT.STRING)
    # llama-quantize: copies the keys, then re-sets these two (gguf_set_val appends after removing)
    add("general.quantization_version", 2, VT.UINT32)
    add("general.file_type", p.types[arch].file_type, VT.UINT32)
    if any(t.type_name in _IMATRIX_TYPES for t in tensors):
        n_quantized = sum(1 for t in tensors if t.ggml.quantized)
        add("quantize.imatrix.file", "uniform.imatrix", VT.STRING)
        add("quantize.imatrix.dataset", "uniform (strata synth)", VT.STRING)
        add("quantize.imatrix.entries_count", n_quantized, VT.UINT32)
        add("quantize.imatrix.chunks_count", 1, VT.UINT32)
    return kv


def arch_metadata(g: ModelGeometry, *, context_length: int | None = None,
                  zero_compress_ratios: bool = False) -> list[tuple[str, object, VT, VT | None]]:
    """The `{arch}.*` keys that describe geometry `g`, in the converter's order: what every synthetic
    GGUF (strata-pack synth, the engine tests' fixture) writes, so the pack's reader meets one layout.
    `context_length`: written when given (the converter always does; the fixture has none)."""
    kv: list[tuple[str, object, VT, VT | None]] = []

    def add(key, value, vt, sub=None):
        kv.append((key, value, vt, sub))

    a = lambda s: f"{g.arch}.{s}"  # noqa: E731
    add(a("block_count"), g.n_layer + g.n_mtp_layer, VT.UINT32)  # the converter counts the MTP block
    if context_length is not None:
        add(a("context_length"), context_length, VT.UINT32)
    add(a("embedding_length"), g.n_embd, VT.UINT32)
    add(a("attention.head_count"), g.n_head, VT.UINT32)
    add(a("attention.head_count_kv"), g.n_head_kv, VT.UINT32)
    add(a("rope.dimension_sections"), list(g.rope_sections), VT.ARRAY, VT.INT32)
    add(a("rope.freq_base"), g.rope_freq_base, VT.FLOAT32)
    add(a("attention.layer_norm_rms_epsilon"), g.rms_eps, VT.FLOAT32)
    add(a("expert_count"), g.n_expert, VT.UINT32)
    add(a("expert_used_count"), g.n_expert_used, VT.UINT32)
    add(a("attention.key_length"), g.head_dim, VT.UINT32)
    add(a("attention.value_length"), g.head_dim, VT.UINT32)
    add(a("expert_feed_forward_length"), g.n_ff_exp, VT.UINT32)
    add(a("expert_shared_feed_forward_length"), g.n_ff_shexp, VT.UINT32)
    if g.n_mtp_layer:  # _QwenMtpMixin.set_gguf_parameters, after Qwen2MoeModel's keys, before the ssm.* ones
        add(a("nextn_predict_layers"), g.n_mtp_layer, VT.UINT32)
    add(a("ssm.conv_kernel"), g.ssm_d_conv, VT.UINT32)
    add(a("ssm.state_size"), g.ssm_d_state, VT.UINT32)
    add(a("ssm.group_count"), g.ssm_n_k_heads, VT.UINT32)
    add(a("ssm.time_step_rank"), g.ssm_n_v_heads, VT.UINT32)
    add(a("ssm.inner_size"), g.ssm_d_inner, VT.UINT32)
    # an MTP block's entry says full attention (conversion/qwen.py _QwenMtpMixin)
    add(a("attention.recurrent_layers"), [not g.is_full_attention(l) for l in range(g.n_layer)] + [False] * g.n_mtp_layer,
        VT.ARRAY, VT.BOOL)
    add(a("full_attention_interval"), g.full_attention_interval, VT.UINT32)
    add(a("rope.dimension_count"), g.n_rot, VT.UINT32)
    if g.arch == "qwen4exp":
        _qwen4exp_metadata(add, a, g, zero_compress_ratios)
    return kv


def _qwen4exp_metadata(add, a, g: ModelGeometry, zero_compress_ratios: bool) -> None:
    add(a("hyper_connection.count"), g.hc, VT.UINT32)
    add(a("hyper_connection.low_rank"), g.hc_lowrank, VT.UINT32)
    add(a("attention.indexer.head_count"), g.idx_n_heads, VT.UINT32)
    add(a("attention.indexer.key_length"), g.idx_head_dim, VT.UINT32)
    add(a("attention.indexer.top_k"), g.idx_top_k, VT.UINT32)
    # the block size at each QSA layer; all zeros only to reproduce llama.cpp's converter (its
    # "full_attention" test never matches transformers' "indexed_attention")
    qsa = [g.has_qsa and g.is_full_attention(l) and not zero_compress_ratios for l in range(g.n_layer)]
    ratios = [g.idx_compress_ratio if q else 0 for q in qsa]
    add(a("attention.compress_ratios"), ratios, VT.ARRAY, VT.INT32)
    if not g.ple_layers:
        return
    add(a("ple.layers"), list(g.ple_layers), VT.ARRAY, VT.INT32)
    add(a("ple.ngram_size"), g.ple_ngram_size, VT.UINT32)
    add(a("ple.heads_per_ngram"), g.ple_heads_per_ngram, VT.UINT32)
    add(a("ple.conv_kernel"), g.ple_conv_kernel, VT.UINT32)
    add(a("ple.eos_token_id"), g.ple_eos_token_id, VT.UINT32)
    add(a("embedding_length_per_layer_input"), g.ple_row_dim, VT.UINT32)
    add(a("ple.layer_multipliers"), list(g.ple_multipliers), VT.ARRAY, VT.UINT64)
    add(a("ple.head_offsets"), list(g.ple_head_offsets), VT.ARRAY, VT.UINT64)
    add(a("ple.head_vocab_sizes"), list(g.ple_head_vocab_sizes), VT.ARRAY, VT.UINT64)


def _size_label(g: ModelGeometry, tensors: Sequence[SynthTensor]) -> str:
    # the converter's own rounding of parameter counts ("16x761K")
    n = lambda t: math.prod(t.shape)  # noqa: E731
    expert = sum(n(t) for t in tensors if t.role == "weight" and "_exps." in t.name)
    shared = sum(n(t) for t in tensors) - expert
    return gguf.size_label(shared + expert, shared, expert // g.n_expert, g.n_expert)


def _split_keys(index: int, count: int, n_tensors: int) -> list[tuple[str, object, VT, None]]:
    return [("split.no", index, VT.UINT16, None), ("split.count", count, VT.UINT16, None),
            ("split.tensors.count", n_tensors, VT.INT32, None)]


# ============================================================================ values

OUTPUT_GAIN = 4.0  # logits with a std of ~4: a random model still has clear greedy choices
NORM_SPREAD = 0.05  # stored norm gains are 1 +- this
CONV_RMS = 0.5  # 1 / sqrt(conv kernel 4)
ROUTER_HOT_LOGIT = 4.0  # router logit bonus of the hottest expert for an embedding-like input
ROUTER_ZIPF = 1.0  # the bonus of the expert of hotness rank r is ROUTER_HOT_LOGIT / r**ROUTER_ZIPF
EMBD_SHARED = 0.8  # per-element RMS of the shared direction in an embedding row (the noise has RMS 1)
_CHUNK_BYTES = 1 << 23

_ROLE_RULES = (
    (r"^token_embd\.weight$", "embedding"),
    (r"\.ffn_gate_inp\.weight$", "router"),
    (r"norm(_\w+)?\.weight$", "norm"),  # *_norm.weight and the PLE's ple_norm_{key,query,conv}
    (r"\.ssm_a$", "ssm_a"),
    (r"\.ssm_dt\.bias$", "ssm_dt"),
    (r"conv1d\.weight$", "conv"),
    (r"^per_layer_token_embd\.weight$", "table"),
)


_RANDOM_BLOCK_ROLES = ("weight", "table")  # iid values of a set RMS: random blocks when quantized


def _role(name: str) -> str:
    for pattern, role in _ROLE_RULES:
        if re.search(pattern, name):
            return role
    return "weight"


def _key(name: str, seed: int = 0) -> list[int]:
    """RNG entropy for (seed, name): a stable hash (Python's hash() is salted per process)."""
    return [seed, int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little")]


def _intended_rms(t: SynthTensor) -> float:
    """The RMS a 'weight' or 'table' tensor is generated with."""
    if t.role == "table":
        return 1.0
    return (OUTPUT_GAIN if t.name == "output.weight" else 1.0) / math.sqrt(t.shape[0])


def shared_direction(n_embd: int, seed: int) -> np.ndarray:
    """The unit vector every embedding row and every router row carries (float64)."""
    u = np.random.default_rng(_key("shared-direction", seed)).standard_normal(n_embd)
    return u / np.linalg.norm(u)


def _producer(t: SynthTensor, g: ModelGeometry, seed: int) -> Callable[[], Iterator[np.ndarray]]:
    def produce() -> Iterator[np.ndarray]:
        rng = np.random.default_rng(_key(t.name, seed))
        if t.role == "embedding":
            yield from _embedding_chunks(t, shared_direction(g.n_embd, seed), rng)
        elif t.role == "router":
            yield _router(t, g, shared_direction(g.n_embd, seed), rng)
        else:
            random = t.role in _RANDOM_BLOCK_ROLES and t.ggml.quantized
            chunks = _random_block_chunks(t, rng) if random else _float_chunks(t, rng)
            if t.name == "output.weight":
                chunks = _zero_rows(chunks, t.ggml.nbytes((t.shape[0],)), ~printable_tokens(g.n_vocab))
            yield from chunks

    return produce


@functools.lru_cache(maxsize=4)
def printable_tokens(n_vocab: int) -> np.ndarray:
    """bool per token of the synthetic vocabulary: its bytes are all printable ASCII or newline.

    The output head's rows of every other token (byte tokens of invalid UTF-8 or control bytes,
    merges holding one, the special tokens) are zero, so their logits are 0 while the others spread
    with a std of ~OUTPUT_GAIN: greedy and top-k sampling never reach them, and a random model's text
    is still random but printable. Zero bytes decode to zero in every GGML type (the scale is 0)."""
    vocab = synthetic_vocab(n_vocab)
    byte_of = {c: b for b, c in byte_to_unicode()}
    ok = set(range(0x20, 0x7F)) | {0x0A}
    return np.array([kind == TOKEN_NORMAL and all(byte_of[c] in ok for c in text)
                     for text, kind in zip(vocab.tokens, vocab.token_types.tolist())])


def _zero_rows(chunks: Iterator[np.ndarray], row_bytes: int, zero: np.ndarray) -> Iterator[np.ndarray]:
    """The tensor's chunks with the bytes of rows `zero` (bool per row) set to 0."""
    start = 0
    for chunk in chunks:
        b = np.array(chunk, copy=True).reshape(-1).view(np.uint8)
        first, end = start // row_bytes, -(-(start + b.size) // row_bytes)
        for r in (np.flatnonzero(zero[first:end]) + first).tolist():
            b[max(r * row_bytes - start, 0) : min((r + 1) * row_bytes - start, b.size)] = 0
        start += b.size
        yield b


def _random_block_chunks(t: SynthTensor, rng: np.random.Generator) -> Iterator[np.ndarray]:
    gt = t.ggml
    n_blocks = math.prod(t.shape) // gt.block_size
    per = max(1, _CHUNK_BYTES // gt.type_size)
    rms = _intended_rms(t)
    for start in range(0, n_blocks, per):
        yield sb.random_blocks(gt, min(per, n_blocks - start), rms, rng)


def _float_values(role: str, n: int, rms: float, rng: np.random.Generator) -> np.ndarray:
    if role == "norm":
        return 1.0 + NORM_SPREAD * rng.standard_normal(n)
    if role == "ssm_a":
        return -rng.uniform(1.0, 16.0, n)  # -exp(A_log), A_log = log(U(1, 16))
    if role == "ssm_dt":
        dt = np.exp(rng.uniform(math.log(1e-3), math.log(1e-1), n))
        return dt + np.log(-np.expm1(-dt))  # softplus^-1(dt): the GDN applies softplus(x + dt_bias)
    return (CONV_RMS if role == "conv" else rms) * rng.standard_normal(n)


def _float_chunks(t: SynthTensor, rng: np.random.Generator) -> Iterator[np.ndarray]:
    n = math.prod(t.shape)
    per = max(1, _CHUNK_BYTES // 4)
    rms = _intended_rms(t) if t.role in _RANDOM_BLOCK_ROLES else 0.0
    for start in range(0, n, per):
        x = _float_values(t.role, min(per, n - start), rms, rng).astype(np.float32)
        yield sb.quantize_rows(t.ggml, x) if t.ggml.quantized else sb.encode_floats(t.ggml, x)


def _embedding_chunks(t: SynthTensor, u: np.ndarray, rng: np.random.Generator) -> Iterator[np.ndarray]:
    # row = c_t * sqrt(E) * u + noise: every token shares direction u with its own strength c_t
    # (~EMBD_SHARED); the noise is uniform with RMS 1 (drawn from raw bytes: 3x faster than normals).
    n_embd, n_vocab = t.shape
    rows_per = max(1, (_CHUNK_BYTES // 4) // n_embd)
    su = (math.sqrt(n_embd) * u).astype(np.float32)
    for start in range(0, n_vocab, rows_per):
        n = min(rows_per, n_vocab - start)
        c = (EMBD_SHARED * (1.0 + 0.25 * rng.standard_normal(n))).astype(np.float32)
        noise = (sb.random_bytes(rng, n * n_embd).astype(np.float32) - 127.5) / np.float32(73.9)
        rows = noise.reshape(n, n_embd) + c[:, None] * su[None, :]
        yield sb.quantize_rows(t.ggml, rows)


def _router_bonus(n_expert: int, rng: np.random.Generator) -> np.ndarray:
    """Per-expert logit bonus: Zipf over hotness ranks, the ranks a random permutation of experts."""
    rank = rng.permutation(n_expert) + 1
    return ROUTER_HOT_LOGIT / rank.astype(np.float64) ** ROUTER_ZIPF


def _router(t: SynthTensor, g: ModelGeometry, u: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    # GGUF (E, X): one row of E per expert. For an RMS-normalised embedding row x, u.x is about
    # 0.6 sqrt(E) (EMBD_SHARED / sqrt(1 + EMBD_SHARED^2)), so row j = bonus_j u / (0.6 sqrt(E)) + noise
    # gives expert j a logit bonus of about bonus_j, on top of token-dependent logits of std ~1.
    n_embd, n_expert = t.shape
    bonus = _router_bonus(n_expert, rng)
    cos = EMBD_SHARED / math.sqrt(1.0 + EMBD_SHARED**2)
    noise = rng.standard_normal((n_expert, n_embd))
    # without this, each row's own random component along u (c * N(0, 1)) would be a second,
    # uncontrolled per-expert bonus: some experts would never be routed to at all
    noise -= np.outer(noise @ u, u)
    w = np.outer(bonus / (cos * math.sqrt(n_embd)), u) + noise / math.sqrt(n_embd)
    return sb.encode_floats(t.ggml, w.astype(np.float32))


# ============================================================================ writing


def output_paths(out: str | os.PathLike, n_files: int) -> list[Path]:
    """`DIR/NAME.gguf` for one file, `DIR/NAME-0000i-of-0000n.gguf` (gguf-split's names) for n."""
    out = Path(out)
    if out.suffix != ".gguf":
        raise SynthError(f"output {out}: expected a file name ending in .gguf")
    if n_files == 1:
        return [out]
    return [out.with_name(f"{out.stem}-{i:05d}-of-{n_files:05d}.gguf") for i in range(1, n_files + 1)]


def synth(arch: str, preset: str, out: str | os.PathLike, *, seed: int = 0, force: bool = False,
          progress: Callable[[int], None] | None = None, zero_compress_ratios: bool = False,
          mtp: bool = False) -> list[Path]:
    """Write the synthetic model; returns the files written (main shard first).

    Existing files are refused unless `force`. Every file is written under a temporary name and
    the set is renamed into place only when all are complete, so a failure leaves neither a
    partial set nor a mix of new and old shards.
    """
    plan = plan_model(arch, preset, zero_compress_ratios, mtp)
    paths = output_paths(out, len(plan.shards))
    existing = [str(p) for p in paths if p.exists()]
    if existing and not force:
        raise FileExistsError(f"{', '.join(existing)} already exist(s); pass --force to overwrite")
    if not paths[0].parent.is_dir():
        raise SynthError(f"output directory {paths[0].parent} does not exist")
    staged = [p.with_name(f".{p.name}.synth-{os.getpid()}") for p in paths]
    try:
        for i, (path, tensors) in enumerate(zip(staged, plan.shards)):
            _writer(plan, i, path, tensors, seed).write(progress)
        for tmp, path in zip(staged, paths):
            os.replace(tmp, path)
    finally:
        for tmp in staged:
            tmp.unlink(missing_ok=True)
    return paths


def _writer(plan: SynthPlan, index: int, path: Path, tensors: Sequence[SynthTensor], seed: int) -> GGUFWriter:
    w = GGUFWriter(path)
    keys = list(plan.metadata) if index == 0 else []
    if len(plan.shards) > 1:
        keys += _split_keys(index, len(plan.shards), len(plan.tensors))
    for key, value, vt, sub in keys:
        w.add(key, value, vt, sub)
    for t in tensors:
        w.add_tensor(t.name, t.shape, t.ggml.id, _producer(t, plan.geometry, seed))
    return w


def synth_command(arch: str, preset: str, out: str | os.PathLike, seed: int = 0, force: bool = False,
                  zero_compress_ratios: bool = False, mtp: bool = False) -> list[Path]:
    """`strata-pack synth`: synth() with a progress bar (tqdm, shown only on a terminal)."""
    from tqdm import tqdm

    total = plan_model(arch, preset, mtp=mtp).nbytes
    with tqdm(total=total, unit="B", unit_scale=True, desc=f"synth {preset} {arch}", disable=None) as bar:
        return synth(arch, preset, out, seed=seed, force=force, progress=bar.update,
                     zero_compress_ratios=zero_compress_ratios, mtp=mtp)

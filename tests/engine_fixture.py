"""A small synthetic qwen35moe model for the engine tests: GGUF written here, packed by strata-pack.

Self-contained (no torch, no converter): weights are drawn with unit-gain scales so every layer
moves the logits, stored in the GGML types a test asks for (F32 / F16 / BF16 / Q8_0 ...), and the
tokenizer is byte-level (256 byte tokens + the Qwen specials), so any text encodes.
The agreement with transformers is tests/engine/test_forward_reference.py's job; these models test the
engine's plumbing: the pack checks, expert serving by offset, the decode loop, the CLI, S12.

What it shares with `strata-pack synth` (tools/synth.py), so there is one way to lay out a synthetic
GGUF: the geometry's metadata keys (synth.arch_metadata), GPT-2's byte alphabet
(synth.byte_to_unicode), the encoders (synth_blocks.quantize_rows, encode_floats). What is its own,
on purpose: a geometry narrower than any preset (n_embd 64, so a test runs in seconds), the dense
and expert types a test picks, values drawn at unit gain from one RNG in tensor order (synth's
presets draw production-like statistics per tensor name), and a vocabulary of bytes only (synth's
has BPE merges): token id = byte + 3, EOS = 2.
"""

from __future__ import annotations

from math import prod
from pathlib import Path

import numpy as np

from strata.index_format.geometry import ModelGeometry, tensor_specs
from strata.engine.kernels.reference import dequantize
from strata.index_format.ggml_types import BY_NAME
from strata.tools import pack
from strata.tools.gguf_io import VT, GGUFWriter, read_gguf
from strata.tools.synth import arch_metadata, byte_to_unicode
from strata.tools.synth_blocks import decode_floats, encode_floats, quantize_rows

SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
EOS = 2
CHAT_TEMPLATE = (
    "{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def geometry(**over) -> ModelGeometry:
    """4 layers (3 Gated DeltaNet, 1 attention); rows are whole 32-blocks so Q8_0 experts fit."""
    v = dict(
        arch="qwen35moe", n_vocab=320, n_embd=64, n_layer=4, full_attention_interval=4, rms_eps=1e-6,
        n_head=4, n_head_kv=2, head_dim=32, n_rot=16, rope_freq_base=1e7, rope_sections=(4, 2, 2, 0),
        ssm_d_conv=4, ssm_d_state=16, ssm_n_k_heads=2, ssm_n_v_heads=4, ssm_d_inner=64,
        n_expert=8, n_expert_used=2, n_ff_exp=32, n_ff_shexp=64, recurrent_layers=(1, 1, 1, 0),
    )  # fmt: skip
    v.update(over)
    return ModelGeometry(**v)


def _bf16_round(x: np.ndarray) -> np.ndarray:
    # bf16-representable values: a BF16 and an F32 file of the same seed hold the same model
    bf16 = BY_NAME["BF16"]
    return decode_floats(bf16, encode_floats(bf16, x)).reshape(x.shape)


def values(name: str, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """f32 values in GGUF order (shape[0] contiguous); scales per role keep every component alive."""
    n = prod(shape)
    if name.endswith("ssm_a"):
        x = -(0.05 + 0.95 * rng.random(n))  # -exp(A_log), A in [0.05, 1]: a state that remembers
    elif name.endswith("norm.weight"):
        x = 1.0 + 0.1 * rng.standard_normal(n)  # gains near 1 (the folded 1 + w, and ssm_norm as is)
    elif name.endswith(("ssm_dt.bias", "ssm_conv1d.weight")):
        x = 0.5 * rng.standard_normal(n)
    elif name == "token_embd.weight":
        x = rng.standard_normal(n)
    else:
        gain = 3.0 if name.endswith("ffn_gate_inp.weight") else 2.0 if name == "output.weight" else 1.0
        x = rng.standard_normal(n) * (gain / np.sqrt(shape[0]))  # fan-in = ne0
    return _bf16_round(x.reshape(shape[::-1]))


def _metadata(w: GGUFWriter, g: ModelGeometry) -> None:
    w.add("general.architecture", g.arch, VT.STRING)
    for key, value, vt, sub in arch_metadata(g):
        w.add(key, value, vt, sub)
    _tokenizer(w, g.n_vocab)


def _tokenizer(w: GGUFWriter, n_vocab: int) -> None:
    tokens = list(SPECIALS) + [c for _, c in sorted(byte_to_unicode())]  # token 3 + b is byte b
    types = [3] * len(SPECIALS) + [1] * 256
    tokens += [f"[PAD{i}]" for i in range(len(tokens), n_vocab)]
    types += [5] * (n_vocab - len(types))
    w.add("tokenizer.ggml.model", "gpt2", VT.STRING)
    w.add("tokenizer.ggml.pre", "qwen35", VT.STRING)
    w.add("tokenizer.ggml.tokens", tokens, VT.ARRAY, VT.STRING)
    w.add("tokenizer.ggml.token_type", types, VT.ARRAY, VT.INT32)
    w.add("tokenizer.ggml.merges", [], VT.ARRAY, VT.STRING)
    w.add("tokenizer.ggml.eos_token_id", EOS, VT.UINT32)
    w.add("tokenizer.ggml.padding_token_id", 0, VT.UINT32)
    w.add("tokenizer.chat_template", CHAT_TEMPLATE, VT.STRING)


def type_for(name: str, shape: tuple[int, ...], types: dict[str, str]) -> str:
    """The GGML type of a tensor: 1-D tensors, norms, router and conv stay F32 (as the converter
    writes them); `types` maps a role ('experts', 'dense') or a full name to a type name."""
    if name in types:
        return types[name]
    if len(shape) == 1 or name.endswith(("_norm.weight", "ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight",
                                         "ssm_conv1d.weight")):
        return "F32"
    if "_exps" in name:
        return types.get("experts", "F32")
    return types.get("dense", "F32")


def write_gguf(path: Path, g: ModelGeometry, *, seed: int = 0, types: dict[str, str] | None = None) -> Path:
    rng = np.random.default_rng(seed)
    w = GGUFWriter(path)
    _metadata(w, g)
    for s in tensor_specs(g):
        t = BY_NAME[type_for(s.name, s.shape, types or {})]
        raw = quantize_rows(t, values(s.name, s.shape, rng))
        w.add_tensor(s.name, s.shape, t.id, lambda raw=raw: raw)
    return w.write()


def make_pack(tmp: Path, name: str = "model", *, seed: int = 0, types: dict[str, str] | None = None, **geo) -> Path:
    """GGUF at tmp/<name>.gguf and its pack at tmp/<name>-pack; returns the pack directory."""
    gguf = write_gguf(tmp / f"{name}.gguf", geometry(**geo), seed=seed, types=types)
    out = tmp / f"{name}-pack"
    pack.convert([gguf], out)
    return out


def tiny_qwen4exp(tmp: Path) -> Path:
    """strata-pack synth's `tiny` qwen4exp (hyper-connections, QSA, PLE; its quantized type mix),
    its first shard packed under tmp -> the pack's directory."""
    from strata.tools.synth import PRESETS, synth

    (tmp / "src").mkdir()
    shards = synth("qwen4exp", "tiny", tmp / "src" / "tiny.gguf")
    pack.convert(shards[:1], tmp / "q4", compress_ratio=PRESETS["tiny"].compress_ratio)
    return tmp / "q4"


def dequantized_copy(src: Path, dst: Path) -> Path:
    """The same GGUF (one shard) with every tensor stored as F32 holding its dequantized values."""
    f = read_gguf(src)
    w = GGUFWriter(dst)
    w.kv = dict(f.kv)
    for name, t in f.tensors.items():
        values = dequantize(np.asarray(f.tensor_bytes(name)), t.type_id, int(np.prod(t.shape)))
        w.add_tensor(name, t.shape, 0, lambda v=values: v.view(np.uint8))
    return w.write()

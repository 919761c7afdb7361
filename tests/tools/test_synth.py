"""tools/synth.py + tools/synth_blocks.py: synthetic GGUFs laid out as llama.cpp writes them.

References, none of them the code under test: our strict reader and the geometry contract,
gguf-py's dequantizer and quantizers (bit-exact ggml), the Q2_0 decoder transcribed from
ggml-quants.c in tests/reference/requant.py (gguf-py lacks type 42), the vendored gguf-py reader,
HF `tokenizers` and transformers' bytes_to_unicode, and the numbers the seed document prints
(native_experts.txt lines, the 0.444 GiB embedding).
"""

from __future__ import annotations

import dataclasses
import math

import gguf
import gguf.quants as gq
import numpy as np
import pytest

from strata.index_format.geometry import check_tensor_shapes
from strata.index_format.ggml_types import BY_ID, BY_NAME, TYPES
from strata.tools import synth as S
from strata.tools import synth_blocks as sb
from strata.tools.gguf_io import VT, read_gguf
from reference.requant import dequantize_q2_0

ARCHS = ("qwen4exp", "qwen35moe")


# ---------------------------------------------------------------------------- helpers


def decode(raw: np.ndarray, type_name: str) -> np.ndarray:
    """Flat float64 values of a tensor's bytes, decoded by the references (gguf-py; Q2_0, which
    it lacks: tests/reference/requant.py's transcription of ggml-quants.c)."""
    raw = np.ascontiguousarray(raw, dtype=np.uint8)
    if type_name == "Q2_0":
        return dequantize_q2_0(raw).astype(np.float64)
    t = BY_NAME[type_name]
    return gq.dequantize(raw.reshape(-1, t.type_size), gguf.GGMLQuantizationType[type_name]).astype(np.float64).ravel()


def tensor_values(files, name: str) -> np.ndarray:
    """A tensor as a numpy array in torch order (GGUF shape reversed)."""
    for f in files:
        if name in f.tensors:
            t = f.tensors[name]
            return decode(np.asarray(f.tensor_bytes(name)), BY_ID[t.type_id].name).reshape(t.shape[::-1])
    raise KeyError(name)


@pytest.fixture(scope="module", params=ARCHS)
def tiny(request, tmp_path_factory):
    arch = request.param
    paths = S.synth(arch, "tiny", tmp_path_factory.mktemp(arch) / f"tiny-{arch}.gguf", seed=0)
    return arch, paths, [read_gguf(p) for p in paths]


# ---------------------------------------------------------------------------- layout


def test_tiny_reads_back_into_the_presets_geometry(tiny):
    arch, paths, files = tiny
    from strata.tools.gguf_meta import geometry_from_gguf

    preset = S.PRESETS["tiny"]
    tensors = {k: v for f in files for k, v in f.tensors.items()}
    reading = geometry_from_gguf(files[0], tensors)  # the QSA block size is in the file: no ratio passed
    g, want = reading.geometry, preset.geometry(arch)
    check_tensor_shapes(g, {k: v.shape for k, v in tensors.items()}, source=paths[0].name)
    assert np.float32(g.rms_eps) == np.float32(want.rms_eps)  # stored as FLOAT32, as the converter does
    same = {"compress_ratios", "recurrent_layers", "rms_eps"}  # arrays only the file carries; f32 eps
    for f in dataclasses.fields(g):
        if f.name not in same:
            assert getattr(g, f.name) == getattr(want, f.name), f.name
    if arch == "qwen4exp":
        # the block size at the QSA layers (3 and 7), nothing elsewhere: no warning, no flag needed
        assert g.compress_ratios == tuple(preset.compress_ratio if l % 4 == 3 else 0 for l in range(g.n_layer))
        assert g.idx_compress_ratio == preset.compress_ratio
        assert max(g.ple_multipliers) > 2**53  # the trap the brief names: uint64, never floats
    assert reading.warnings == ()


def test_shards_are_llama_cpp_splits(tiny):
    arch, paths, files = tiny
    stem = f"tiny-{arch}"
    assert [p.name for p in paths] == [f"{stem}-00001-of-00002.gguf", f"{stem}-00002-of-00002.gguf"]
    n_total = sum(len(f.tensors) for f in files)
    for i, f in enumerate(files):
        assert f.kv["split.no"].type == VT.UINT16 and f.get("split.no") == i
        assert f.kv["split.count"].type == VT.UINT16 and f.get("split.count") == 2
        assert f.kv["split.tensors.count"].type == VT.INT32 and f.get("split.tensors.count") == n_total
        assert "general.alignment" not in f.kv and f.alignment == 32
    assert set(files[1].kv) == {"split.no", "split.count", "split.tensors.count"}  # metadata only in shard 1
    assert list(files[0].kv)[-3:] == ["split.no", "split.count", "split.tensors.count"]
    if arch == "qwen4exp":
        assert list(files[1].tensors) == ["per_layer_token_embd.weight"]  # the release's PLE shard
    # llama-quantize's order (weight_name_comparer): non-block tensors by name, then blocks by NUMBER
    order = [n for f in files for n in f.tensors]

    def key(name):
        return (int(name.split(".")[1]) if name.startswith("blk.") else -1, name)

    tail = [] if arch == "qwen35moe" else ["per_layer_token_embd.weight"]
    assert order == sorted(set(order) - set(tail), key=key) + tail


def test_metadata_tail_is_llama_quantizes(tiny):
    arch, _, files = tiny
    keys = list(files[0].kv)
    tail = ["general.quantization_version", "general.file_type", "quantize.imatrix.file",
            "quantize.imatrix.dataset", "quantize.imatrix.entries_count", "quantize.imatrix.chunks_count"]
    assert keys[-9:-3] == tail  # the imatrix keys: the IQ2/IQ3_XXS types are refused without one
    f = files[0]
    assert f.kv["general.file_type"].type == VT.UINT32
    assert f.get("general.file_type") == {"qwen4exp": 23, "qwen35moe": 15}[arch]  # MOSTLY_IQ3_XXS / Q4_K_M
    assert f.kv[f"{arch}.attention.recurrent_layers"].sub_type == VT.BOOL
    assert f.kv[f"{arch}.rope.dimension_sections"].sub_type == VT.INT32
    if arch == "qwen4exp":
        for k in ("ple.layer_multipliers", "ple.head_offsets", "ple.head_vocab_sizes"):
            assert f.kv[f"qwen4exp.{k}"].sub_type == VT.UINT64
        assert f.kv["qwen4exp.attention.compress_ratios"].sub_type == VT.INT32


# Expected types written from the preset's stated targets and llama-quant.cpp's fallback rules
# (tiny: n_embd 256, expert n_ff 64, shared n_ff 128, ssm inner 128, PLE rows of 64).
TINY_EXPERTS = {
    "qwen4exp": [("IQ2_XS", "IQ4_NL"), ("IQ2_XXS", "Q2_0"), ("IQ3_XXS", "IQ4_NL"), ("IQ2_XS", "Q2_0")],
    "qwen35moe": [("Q4_K", "Q8_0"), ("IQ3_XXS", "Q2_0")],
}
TINY_TYPES = {
    "qwen4exp": {"token_embd.weight": "Q5_0", "output.weight": "Q8_0", "per_layer_token_embd.weight": "IQ4_NL",
                 "blk.1.ple_conv1d.weight": "F16", "blk.0.ffn_gate_inp.weight": "F32",
                 "blk.0.ffn_down_shexp.weight": "IQ4_NL", "blk.0.ffn_gate_shexp.weight": "IQ4_XS",
                 "blk.3.indexer.k_proj.weight": "BF16", "blk.0.ssm_conv1d.weight": "F32",
                 "blk.0.hc_attn_up.weight": "Q8_0"},
    "qwen35moe": {"token_embd.weight": "Q4_0", "output.weight": "Q6_K", "blk.0.ssm_out.weight": "Q8_0",
                  "blk.3.attn_output.weight": "Q6_K", "blk.0.ffn_down_shexp.weight": "Q8_0",
                  "blk.0.ffn_gate_inp.weight": "F32", "blk.0.ffn_gate_inp_shexp.weight": "F32"},
}


def test_block_types_are_the_chosen_ones_after_fallback(tiny):
    arch, _, files = tiny
    types = {k: BY_ID[v.type_id].name for f in files for k, v in f.tensors.items()}
    for layer in range(8):
        gate_up, down = TINY_EXPERTS[arch][layer % len(TINY_EXPERTS[arch])]
        assert (types[f"blk.{layer}.ffn_gate_exps.weight"], types[f"blk.{layer}.ffn_up_exps.weight"],
                types[f"blk.{layer}.ffn_down_exps.weight"]) == (gate_up, gate_up, down), layer
    for name, want in TINY_TYPES[arch].items():
        assert types[name] == want, name
    for f in files:
        for name, t in f.tensors.items():
            if len(t.shape) == 1 or "norm" in name or not name.endswith(".weight"):
                assert types[name] == "F32", name  # the converter forces these


@pytest.mark.parametrize("target,ne0,want", [
    ("IQ2_XS", 2560, "IQ2_XS"), ("IQ2_XS", 640, "IQ4_NL"), ("IQ3_XXS", 48, "F16"), ("IQ4_XS", 160, "IQ4_NL"),
    ("Q2_0", 96, "Q4_0"), ("Q2_0", 640, "Q2_0"), ("Q4_K", 32, "Q5_0"), ("Q5_K", 64, "Q5_1"),
    ("Q6_K", 64, "Q8_0"), ("Q8_0", 4, "F16"), ("BF16", 4, "BF16"),
])
def test_fallback_follows_llama_quantize(target, ne0, want):
    assert S.resolve_type(target, (ne0, 8)) == want


# ---------------------------------------------------------------------------- values


def test_every_tensor_decodes_finite_at_its_intended_scale(tiny):
    arch, _, files = tiny
    n_embd = S.PRESETS["tiny"].dims["n_embd"]
    for f in files:
        for name, t in f.tensors.items():
            v = tensor_values(files, name).ravel()
            assert np.isfinite(v).all(), name
            rms, mean = float(np.sqrt(np.mean(v**2))), float(v.mean())
            tol = 0.08 if v.size >= 4096 else 0.2
            if "norm" in name:  # stored gains, +1 folded or (ssm_norm) ones-centred
                assert abs(mean - 1) < 0.05 and np.std(v) < 0.1, name
            elif name.endswith(".ssm_a"):
                assert (v <= -1).all() and (v >= -16).all(), name  # -exp(A_log)
            elif name.endswith(".ssm_dt.bias"):
                dt = np.log1p(np.exp(v))  # softplus
                assert (dt > 0.9e-3).all() and (dt < 0.11).all(), name
            elif name in ("token_embd.weight",) or name.endswith(".ffn_gate_inp.weight"):
                continue  # structured: see test_router_is_skewed
            elif name == "output.weight":
                continue  # rows of unprintable tokens are zero: see test_output_head_only_reaches_printable_tokens
            else:
                want = {"output.weight": 4 / math.sqrt(n_embd), "per_layer_token_embd.weight": 1.0}.get(
                    name, 0.5 if "conv1d" in name else 1 / math.sqrt(t.shape[0]))
                assert abs(rms / want - 1) < tol, (name, rms, want)
                assert abs(mean) < 0.1 * rms + 1e-3, (name, mean, rms)


def test_output_head_only_reaches_printable_tokens(tiny):
    """A random model's text is noise, but it should print: the head's rows of tokens whose bytes are
    not printable ASCII (or newline) are zero, the others random at the head's intended scale."""
    arch, _, files = tiny
    head = tensor_values(files, "output.weight")  # (n_vocab, n_embd)
    n_vocab, n_embd = head.shape
    table = dict((c, b) for b, c in S.byte_to_unicode())
    vocab = S.synthetic_vocab(n_vocab)
    printable = np.array([k == S.TOKEN_NORMAL and all(table[c] in set(range(32, 127)) | {10} for c in text)
                          for text, k in zip(vocab.tokens, vocab.token_types.tolist())])
    assert 0.3 < printable.mean() < 1 and not printable[-3:].any()  # the special tokens are silenced too
    assert not head[~printable].any()
    rms = float(np.sqrt(np.mean(head[printable] ** 2)))
    assert abs(rms / (4 / np.sqrt(n_embd)) - 1) < 0.08
    # the property it buys: for random hidden states, greedy choices decode to printable text
    h = np.random.default_rng(0).standard_normal((64, n_embd))
    assert printable[(h @ head.T).argmax(axis=1)].all()


def test_router_is_skewed(tiny):
    """Cheap proxy of routing: RMS-normalised embedding rows through each layer's router. Uniform
    routing would pick every expert for k/X = 25% of the tokens and give the colder half of the
    experts 50% of the picks."""
    arch, _, files = tiny
    emb = tensor_values(files, "token_embd.weight")  # (n_vocab, n_embd)
    x = emb / np.sqrt((emb**2).mean(axis=1, keepdims=True))
    k = S.PRESETS["tiny"].dims["n_expert_used"]
    hottest = []
    for layer in range(8):
        w = tensor_values(files, f"blk.{layer}.ffn_gate_inp.weight")  # (n_expert, n_embd)
        top = np.argsort(-(x @ w.T), axis=1)[:, :k]
        share = np.bincount(top.ravel(), minlength=w.shape[0]) / len(x)  # fraction of tokens per expert
        ranked = np.sort(share)[::-1]
        assert ranked[0] > 0.8, (layer, ranked[0])
        assert ranked[len(ranked) // 2:].sum() * len(x) / top.size < 0.35, layer
        hottest.append(int(np.argmax(share)))
    assert len(set(hottest)) >= 4  # each layer has its own hot experts: a profile per layer matters


@pytest.mark.parametrize("t", [t for t in TYPES if t.quantized], ids=lambda t: t.name)
def test_random_blocks_decode_at_the_intended_rms(t):
    rng = np.random.default_rng(5)
    n = 1024 if t.block_size == 256 else 8192
    blocks = sb.random_blocks(t, n, 0.02, rng)
    v = decode(blocks.ravel(), t.name)
    assert np.isfinite(v).all()
    assert abs(np.sqrt(np.mean(v**2)) / 0.02 - 1) < 0.04
    assert abs(v.mean()) < 0.05 * 0.02
    if t.fp16_fields:  # every block its own scale (ggml_types says where the fp16 d is)
        at = t.fp16_fields[0][0]
        d = blocks[:, at : at + 2].copy().view("<f2")
        assert len(np.unique(np.abs(d))) > 100  # (fp16 has ~1700 values within the jitter range)


@pytest.mark.parametrize("name", sb.STRUCTURED_TYPES)
def test_quantize_rows_is_bit_identical_to_gguf_py(name):
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((16, 128)) * rng.uniform(0.01, 4, (16, 1))).astype(np.float32)
    x[0, :32] = 0  # an all-zero block: d = 0 must not divide by zero
    ref = gq.quantize(x, gguf.GGMLQuantizationType[name]).view(np.uint8).ravel()
    assert np.array_equal(sb.quantize_rows(BY_NAME[name], x), ref)


# ---------------------------------------------------------------------------- files


def test_same_seed_same_bytes_other_seed_other_weights(tmp_path):
    a = S.synth("qwen4exp", "tiny", tmp_path / "a.gguf", seed=7)
    b = S.synth("qwen4exp", "tiny", tmp_path / "b.gguf", seed=7)
    c = S.synth("qwen4exp", "tiny", tmp_path / "c.gguf", seed=8)
    for pa, pb in zip(a, b):
        assert pa.read_bytes() == pb.read_bytes()
    fa, fc = read_gguf(a[0]), read_gguf(c[0])
    name = "blk.0.ffn_gate_exps.weight"
    assert fa.tensors[name].offset == fc.tensors[name].offset  # same layout ...
    assert bytes(fa.tensor_bytes(name)) != bytes(fc.tensor_bytes(name))  # ... other weights


def test_refuses_to_overwrite_without_force(tmp_path):
    out = tmp_path / "m.gguf"
    paths = S.synth("qwen35moe", "tiny", out)
    paths[1].unlink()  # even one existing shard is refused
    with pytest.raises(FileExistsError, match="m-00001-of-00002.gguf"):
        S.synth("qwen35moe", "tiny", out)
    assert not paths[1].exists()
    assert S.synth("qwen35moe", "tiny", out, force=True) == paths


def test_a_failure_leaves_no_file_behind_and_old_files_intact(tmp_path, monkeypatch):
    real = S._producer

    def failing(t, g, seed):
        if t.name == "per_layer_token_embd.weight":  # the second file fails after the first is complete
            raise OSError("disk full")
        return real(t, g, seed)

    monkeypatch.setattr(S, "_producer", failing)
    with pytest.raises(OSError, match="disk full"):
        S.synth("qwen4exp", "tiny", tmp_path / "m.gguf")
    assert list(tmp_path.iterdir()) == []
    old = [tmp_path / "m-00001-of-00002.gguf", tmp_path / "m-00002-of-00002.gguf"]
    for p in old:
        p.write_bytes(b"old")
    with pytest.raises(OSError, match="disk full"):
        S.synth("qwen4exp", "tiny", tmp_path / "m.gguf", force=True)
    assert sorted(tmp_path.iterdir()) == old and all(p.read_bytes() == b"old" for p in old)


@pytest.mark.parametrize("kwargs,match", [
    (dict(arch="llama"), "not supported"),
    (dict(preset="huge"), r"unknown preset 'huge' \(known: tiny, demo, seed-4l\)"),
    (dict(out="model.bin"), "ending in .gguf"),
    (dict(mtp=True), "--mtp: qwen4exp has no GGUF layout for an MTP block"),
])
def test_bad_requests_are_refused(tmp_path, kwargs, match):
    args = dict(arch="qwen4exp", preset="tiny", out=tmp_path / "m.gguf") | kwargs
    if "out" in kwargs:
        args["out"] = tmp_path / kwargs["out"]
    with pytest.raises(S.SynthError, match=match):
        S.synth(**args)


# ---------------------------------------------------------------------------- tokenizer


def gpt2_byte_alphabet() -> list[str]:
    """GPT-2's bytes_to_unicode as transformers has it (its insertion order is the id order:
    printable bytes first, then the others mapped to U+0100.. in byte order)."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return list(bytes_to_unicode().values())


def test_tokenizer_is_a_consistent_byte_level_bpe(tiny):
    arch, _, files = tiny
    f = files[0]
    tokens, types, merges = (f.get(f"tokenizer.ggml.{k}") for k in ("tokens", "token_type", "merges"))
    n_vocab = S.PRESETS["tiny"].dims["n_vocab"]
    assert len(tokens) == len(types) == n_vocab == len(set(tokens))
    assert tokens[:256] == gpt2_byte_alphabet()
    ids = {t: i for i, t in enumerate(tokens)}
    for i, m in enumerate(merges):
        a, b = m.split(" ")
        assert ids[a] < 256 + i and ids[b] < 256 + i and tokens[256 + i] == a + b
    assert len(merges) == n_vocab - 256 - 3
    assert tokens[-3:] == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    assert types[-3:] == [3, 3, 3] and set(types[:-3]) == {1}
    assert f.get("tokenizer.ggml.eos_token_id") == n_vocab - 1
    assert f.get("tokenizer.ggml.bos_token_id") == f.get("tokenizer.ggml.padding_token_id") == n_vocab - 3
    assert f.get("tokenizer.ggml.add_bos_token") is False and "<|im_start|>" in f.get("tokenizer.chat_template")
    tk = pytest.importorskip("tokenizers")
    bpe = tk.Tokenizer(tk.models.BPE(vocab=ids, merges=[tuple(m.split(" ")) for m in merges]))
    bpe.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = tk.decoders.ByteLevel()
    text = "the tea is neat, Ünïcödé ✓\n  done"
    enc = bpe.encode(text)
    assert bpe.decode(enc.ids) == text and len(enc.ids) < len(text.encode())  # merges apply


def test_production_vocabulary_is_complete_and_quick():
    v = S.synthetic_vocab(248320)
    assert len(v.tokens) == 248320 == len(set(v.tokens)) and len(v.merges) == 248320 - 259


# ---------------------------------------------------------------------------- presets


def test_seed_4l_lays_experts_out_as_the_seed_documents():
    """Numbers from the seed (6.2, 6.3): expert types and blob sizes of layers 0 and 1, and the
    gaps between the expert tensors' offsets in its native_experts.txt
    (`0 17 20 0 1868800 1227833216 1473813376 755052416`, `1 16 42 956825600 1305600 2016152832
    2235918592 1779301632`), which the tensors between them must fill exactly."""
    plan = S.plan_model("qwen4exp", "seed-4l")
    g = plan.geometry
    assert (g.n_embd, g.ssm_conv_channels, g.ssm_d_inner, g.n_expert, g.n_ff_exp, g.n_vocab, g.hc_lowrank) == \
        (2560, 10240, 6144, 512, 640, 248320, 320)
    assert g.full_attention_layers == (3,) and g.ple_layers == (1,)
    offset, at = 0, {}
    for t in plan.shards[0]:  # data-section offsets, 32-byte aligned as in the file
        at[t.name] = (offset, t)
        offset += -(-t.nbytes // 32) * 32
    seed = {0: (17, 20, 1868800, 1227833216, 1473813376, 755052416),
            1: (16, 42, 1305600, 2016152832, 2235918592, 1779301632)}
    for layer, (gu, d, blob, gate_off, up_off, down_off) in seed.items():
        (go, gate), (uo, up), (do, down) = (at[f"blk.{layer}.ffn_{k}_exps.weight"] for k in ("gate", "up", "down"))
        assert (gate.ggml.id, up.ggml.id, down.ggml.id) == (gu, gu, d)
        assert (gate.nbytes + up.nbytes + down.nbytes) // g.n_expert == blob
        assert (go - do, uo - go) == (gate_off - down_off, up_off - gate_off)
    embd = at["token_embd.weight"][1]
    engine_bytes = math.prod(embd.shape) // embd.ggml.block_size * embd.ggml.engine_block_bytes
    assert round(engine_bytes / 2**30, 3) == 0.444  # "pack ... + 0.444 GiB embd"


def test_demo_fits_the_readme_budget():
    for arch in ARCHS:
        assert S.plan_model(arch, "demo").nbytes < 300e6


# ---------------------------------------------------------------------------- the converter's own tools


def test_vendored_gguf_py_reads_our_files(tiny):
    arch, paths, files = tiny
    from reference.convert import ConverterError  # pytest puts tests/ on sys.path
    from reference.gguf_dump import describe

    try:
        d = describe(paths)
    except ConverterError as e:
        pytest.skip(f"vendored gguf-py (llama-cpp-python sdist) unavailable: {e}")
    ours = {k: v for f in files for k, v in f.tensors.items()}
    assert d["tensor_order"] == [n for f in files for n in f.tensors]
    for name, t in d["tensors"].items():
        assert (tuple(t.shape), t.ggml_type, t.offset, t.n_bytes) == \
            (ours[name].shape, ours[name].type_id, ours[name].offset, ours[name].nbytes), name
    meta = d["metadata"]
    assert meta["general.architecture"].value == arch
    assert meta["tokenizer.ggml.tokens"].value == files[0].get("tokenizer.ggml.tokens")
    if arch == "qwen4exp":
        assert meta["qwen4exp.ple.layer_multipliers"] == ("ARRAY[UINT64]", files[0].get("qwen4exp.ple.layer_multipliers"))


@pytest.mark.reference
def test_keys_and_value_types_match_the_real_converter(tiny):
    """Every key llama.cpp's converter writes for the tiny transformers model is in our file with
    the same value type, in the same relative order; ours adds only what a real Qwen tokenizer
    config and llama-quantize add."""
    arch, _, files = tiny
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from reference.convert import ConverterError, reference_gguf
    from reference.gguf_dump import describe

    try:
        ref = describe(reference_gguf(arch))["metadata"]
    except ConverterError as e:
        pytest.skip(f"llama.cpp converter unavailable: {e}")
    cosmetic = {"general.name", "general.finetune", "general.basename", "general.size_label"}
    moved = {"general.file_type", "general.quantization_version"}  # llama-quantize re-sets them at the end
    ours = {k: v for k, v in files[0].kv.items()}

    def vt(kv):
        return f"ARRAY[{kv.sub_type.name}]" if kv.type == VT.ARRAY else kv.type.name

    ref_keys = [k for k in ref if k not in cosmetic and not k.startswith("split.")]
    for k in ref_keys:
        assert k in ours and vt(ours[k]) == ref[k].type, k
    order = [k for k in ours if k in set(ref_keys) - moved]
    assert order == [k for k in ref_keys if k not in moved]
    extra = set(ours) - set(ref) - {"general.basename", "general.size_label"}
    assert extra <= {"tokenizer.ggml.bos_token_id", "tokenizer.ggml.add_bos_token", "split.no", "split.count",
                     "split.tensors.count", "quantize.imatrix.file", "quantize.imatrix.dataset",
                     "quantize.imatrix.entries_count", "quantize.imatrix.chunks_count"}


# ---------------------------------------------------------------------------- the MTP block


@pytest.fixture(scope="module")
def tiny_mtp(tmp_path_factory):
    paths = S.synth("qwen35moe", "tiny", tmp_path_factory.mktemp("mtp") / "tiny-mtp.gguf", seed=0, mtp=True)
    return paths, [read_gguf(p) for p in paths]


def test_mtp_block_is_written_as_llama_cpps_converter_writes_it(tiny_mtp):
    """conversion/qwen.py _QwenMtpMixin: block_count n_layer + 1, nextn_predict_layers 1 right after
    the expert sizes (set_gguf_parameters), the block's recurrent_layers entry false, and the block
    at blk.{n_layer}: a full-attention MoE layer with nextn.eh_proj / enorm / hnorm / shared_head_norm."""
    from strata.tools.gguf_meta import geometry_from_gguf

    paths, files = tiny_mtp
    n = S.PRESETS["tiny"].geometry("qwen35moe").n_layer
    f = files[0]
    keys = list(f.kv)
    assert f.get("qwen35moe.block_count") == n + 1 and f.get("qwen35moe.nextn_predict_layers") == 1
    assert keys.index("qwen35moe.nextn_predict_layers") == keys.index("qwen35moe.expert_shared_feed_forward_length") + 1
    assert f.get("qwen35moe.attention.recurrent_layers") == [l % 4 != 3 for l in range(n)] + [False]
    tensors = {k: v for g in files for k, v in g.tensors.items()}
    b = f"blk.{n}."
    assert sorted(k[len(b):] for k in tensors if k.startswith(b)) == sorted([
        "attn_norm.weight", "post_attention_norm.weight", "attn_q.weight", "attn_k.weight", "attn_v.weight",
        "attn_output.weight", "attn_q_norm.weight", "attn_k_norm.weight", "ffn_gate_inp.weight",
        "ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight", "ffn_gate_inp_shexp.weight",
        "ffn_gate_shexp.weight", "ffn_up_shexp.weight", "ffn_down_shexp.weight",
        "nextn.eh_proj.weight", "nextn.enorm.weight", "nextn.hnorm.weight", "nextn.shared_head_norm.weight"])
    assert tensors[b + "nextn.eh_proj.weight"].shape == (2 * 256, 256)
    g = geometry_from_gguf(f, tensors).geometry
    assert (g.n_layer, g.n_mtp_layer, g.mtp_shared_head_norm, g.mtp_embed_tokens, g.mtp_shared_head_head) == (n, 1, 1, 0, 0)
    check_tensor_shapes(g, {k: v.shape for k, v in tensors.items()}, source=paths[0].name)
    # the trunk splits where it does without the block; the block (last in file order) is a shard of its own
    assert len(paths) == 3 and all(k.startswith(b) for k in files[2].tensors)


def test_a_synth_mtp_model_packs_and_verifies(tiny_mtp, tmp_path, capsys):
    from strata.tools.pack_cli import main

    paths, _ = tiny_mtp
    assert main(["convert", str(paths[0]), "-o", str(tmp_path / "pack")]) == 0, capsys.readouterr().err
    assert main(["verify", str(tmp_path / "pack"), "--full"]) == 0, capsys.readouterr().err


@pytest.mark.reference
def test_mtp_keys_match_the_real_converter(tiny_mtp):
    """The keys of llama.cpp's conversion of a Qwen3.5-MoE checkpoint with its MTP block, in order."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from reference.convert import ConverterError, reference_gguf

    try:
        ref = read_gguf(reference_gguf("qwen35moe", "f32", mtp_num_hidden_layers=1)[0])
    except ConverterError as e:
        pytest.skip(f"llama.cpp converter unavailable: {e}")
    ours = tiny_mtp[1][0]
    arch_keys = [k for k in ref.kv if k.startswith("qwen35moe.")]
    assert [k for k in ours.kv if k in set(arch_keys)] == arch_keys
    n = ref.get("qwen35moe.block_count") - 1
    assert ref.get("qwen35moe.attention.recurrent_layers")[-1] is False
    ref_block = {k[len(f"blk.{n}."):] for k in ref.tensors if k.startswith(f"blk.{n}.")}
    n_ours = ours.get("qwen35moe.block_count") - 1
    ours_block = {k[len(f"blk.{n_ours}."):] for f in tiny_mtp[1] for k in f.tensors if k.startswith(f"blk.{n_ours}.")}
    assert ours_block == ref_block

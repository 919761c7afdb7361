"""Conformance with llama.cpp's own converter (issue 2 item 6).

A tiny random transformers checkpoint of each architecture is converted by the vendored
convert_hf_to_gguf.py (tests/reference, cached). Then:
- `strata-pack convert` accepts it and `strata-pack verify` passes;
- `strata-pack synth`, asked for the SAME geometry with the converter's F32 outtype, writes the same
  tensor names, shapes and types, and the same metadata keys with the same value types, in the
  same order (values differ: the weights and hash constants are random).
"""

from __future__ import annotations

from dataclasses import replace

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from reference.convert import reference_gguf  # noqa: E402

from strata.tools import pack, synth  # noqa: E402
from strata.tools.gguf_io import read_gguf  # noqa: E402
from strata.tools.gguf_meta import geometry_from_gguf  # noqa: E402

pytestmark = pytest.mark.reference

# keys only llama-quantize or gguf-split add, or that depend on the directory name
QUANTIZER_OR_COSMETIC = ("general.name", "general.finetune", "general.basename", "general.size_label",
                         "quantize.", "general.file_type", "general.quantization_version")
COMPRESS_RATIO = 4  # the tiny checkpoint's indexer_compress_ratio (not in the GGUF: all zeros)


def _load(paths):
    files = [read_gguf(p) for p in paths]
    tensors = {n: t for f in files for n, t in f.tensors.items()}
    return files, tensors


def _synth_like(arch, geometry, tmp_path, monkeypatch):
    """synth with a preset whose geometry is the reference's and whose types are the converter's F32."""
    base = synth.PRESETS["tiny"]
    g = geometry.to_values()
    dims = {k: g[k] for k in base.dims}
    q4 = {k: g[k] for k in base.qwen4exp} if arch == "qwen4exp" else base.qwen4exp
    f32 = synth.TypePlan(rules=((r".*", "F32"),), experts=(("F32", "F32"),), file_type=0)
    preset = replace(base, name="conformance", dims=dims, qwen4exp=q4, types={arch: f32},
                     compress_ratio=COMPRESS_RATIO, qwen35moe_shards=1)
    if arch == "qwen4exp":
        first = geometry.ple_head_vocab_sizes[0]
        preset = replace(preset, ple=dict(layer=geometry.ple_layers[0], ngram_size=geometry.ple_ngram_size,
                                          heads_per_ngram=geometry.ple_heads_per_ngram,
                                          conv_kernel=geometry.ple_conv_kernel, vocab_base=first))
    monkeypatch.setitem(synth.PRESETS, "conformance", preset)
    return synth.synth(arch, "conformance", tmp_path / "synth.gguf", seed=1)


@pytest.mark.parametrize("arch", ["qwen4exp", "qwen35moe"])
def test_strata_pack_accepts_the_real_converter_output(arch, tmp_path):
    paths = reference_gguf(arch, "bf16")
    out = tmp_path / "pack"
    pack.convert(paths, out, compress_ratio=COMPRESS_RATIO if arch == "qwen4exp" else None)
    rep = pack.verify_pack(out, full=True)
    assert rep.problems == []
    p = pack.read_pack(out)
    assert p.geometry.arch == arch and len(p.experts.layers) == p.geometry.n_layer


@pytest.mark.parametrize("arch", ["qwen4exp", "qwen35moe"])
def test_synth_writes_what_the_converter_writes(arch, tmp_path, monkeypatch):
    ref_files, ref_tensors = _load(reference_gguf(arch, "f32"))
    reading = geometry_from_gguf(ref_files[0], ref_tensors, compress_ratio=COMPRESS_RATIO if arch == "qwen4exp" else None)
    syn_files, syn_tensors = _load(_synth_like(arch, reading.geometry, tmp_path, monkeypatch))

    # tensors: names, shapes, types
    assert sorted(syn_tensors) == sorted(ref_tensors)
    for name, t in ref_tensors.items():
        assert (syn_tensors[name].shape, syn_tensors[name].type_id) == (t.shape, t.type_id), name

    # metadata of the main shard: same keys in the same order, same value types
    def keys(f):
        return [(k, kv.type, kv.sub_type) for k, kv in f.kv.items()
                if not k.startswith(QUANTIZER_OR_COSMETIC) and not k.startswith("split.")]

    ref_keys, syn_keys = keys(ref_files[0]), keys(syn_files[0])
    # synth writes a bos id and add_bos_token as real Qwen releases do; the tiny reference tokenizer
    # has neither, so the converter writes neither
    release_only = {"tokenizer.ggml.bos_token_id", "tokenizer.ggml.add_bos_token"} - {k for k, *_ in ref_keys}
    syn_keys = [k for k in syn_keys if k[0] not in release_only]
    assert syn_keys == ref_keys
    # the geometry the packer reads from both is the same contract
    assert geometry_from_gguf(syn_files[0], syn_tensors, compress_ratio=COMPRESS_RATIO if arch == "qwen4exp" else None
                              ).geometry.to_values().keys() == reading.geometry.to_values().keys()
    # split layout: qwen4exp's PLE table alone in shard 2, which carries only the split keys
    assert len(syn_files) == len(ref_files)
    for s, r in zip(syn_files[1:], ref_files[1:]):
        assert sorted(s.kv) == sorted(r.kv) == ["split.count", "split.no", "split.tensors.count"]
        assert sorted(s.tensors) == sorted(r.tensors)

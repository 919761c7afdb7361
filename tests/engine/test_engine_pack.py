"""engine/pack_reader.py, the weight table (S3): a pack opened, checked against its geometry and its GGUFs,
served in engine form. Every expected byte comes from the GGUF through the tools' own reader, never
from the engine's offset arithmetic.
"""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import numpy as np
import pytest

import engine_fixture as F
from strata.engine.pack_reader import Pack, PackError
from strata.index_format.geometry import GeometryError, write_geometry
from strata.index_format.manifest import Manifest, PackFile, fingerprint_file, read_manifest, write_manifest
from strata.tools.gguf_io import read_gguf


def _refingerprint(pack_dir: Path, name: str) -> None:
    """Record an edited pack file's new size and fingerprint, so the edit reaches the check behind them."""
    m = read_manifest(pack_dir / "manifest.txt")
    files = [PackFile(f.name, (pack_dir / f.name).stat().st_size, fingerprint_file(pack_dir / f.name))
             if f.name == name else f for f in m.files]
    write_manifest(pack_dir / "manifest.txt", Manifest(m.sources, files))


@pytest.fixture(scope="module")
def q8(tmp_path_factory) -> Path:
    """Q8_0 experts and F16 dense matrices: expert bytes differ in size from F32, scales are fp16."""
    return F.make_pack(tmp_path_factory.mktemp("q8"), types={"experts": "Q8_0", "dense": "F16"})


def test_dense_weights_are_the_gguf_bytes(q8):
    p = Pack.open(q8)
    gguf = read_gguf(q8.parent / "model.gguf")
    assert set(p.weights) == {n for n in gguf.tensors if "_exps" not in n}
    for name, w in p.weights.items():
        t = gguf.tensors[name]
        assert (w.shape, w.type_id) == (t.shape, t.type_id), name
        assert np.array_equal(w.raw, gguf.tensor_bytes(name)), name


def test_experts_are_views_of_the_gguf_at_their_offsets(q8):
    p = Pack.open(q8)
    g = p.geometry
    gguf = read_gguf(q8.parent / "model.gguf")
    for layer in range(g.n_layer):
        for role, k in (("gate", 0), ("up", 1), ("down", 2)):
            whole = np.asarray(gguf.tensor_bytes(f"blk.{layer}.ffn_{role}_exps.weight")).reshape(g.n_expert, -1)
            for e in (0, 3, g.n_expert - 1):
                got = p.expert(layer, e)[k]
                assert np.array_equal(got, whole[e]), (layer, role, e)
                # read in place from the mapped file: a view, never a copy, and read-only
                assert not got.flags.owndata and not got.flags.writeable
            # the whole tensor at once (the grouped kernel's input), also a view
            tensor = p.expert_tensors(layer)[k]
            assert np.array_equal(tensor, whole.reshape(-1)) and not tensor.flags.owndata and not tensor.flags.writeable
    assert [t.name for t in p.expert_types(0)] == ["Q8_0", "Q8_0"]
    with pytest.raises(IndexError, match="expert 8 of layer 0"):
        p.expert(0, g.n_expert)


def test_bf16_is_held_as_its_16_bits(tmp_path):
    d = F.make_pack(tmp_path, types={"dense": "BF16"})
    p = Pack.open(d)
    gguf = read_gguf(tmp_path / "model.gguf")
    w = p.weight("blk.0.attn_qkv.weight")
    assert w.type.name == "BF16"
    assert np.array_equal(w.raw, gguf.tensor_bytes("blk.0.attn_qkv.weight"))
    # the pack stores it as F32 (lossless, S3): twice the bytes the engine holds
    entry = p.index.by_name()["blk.0.attn_qkv.weight"]
    assert entry.pack.name == "F32" and entry.nbytes == 2 * w.raw.nbytes
    assert p.engine_bytes < p.pool_bytes


def test_a_bf16_pack_runs_the_f32_model_exactly(tmp_path):
    """The fixture's values are BF16-representable, so a BF16 file (stored F32 in the pack, held as
    16 bits by the engine) and an F32 file of the same seed are the same model: identical logits."""
    from strata.engine.kernels import cpu
    from strata.engine.model import Model

    before = cpu.threads_cap()
    cpu.set_threads(1)
    try:
        logits = []
        for name, types in (("bf16", {"dense": "BF16", "experts": "BF16"}), ("f32", {})):
            model = Model(Pack.open(F.make_pack(tmp_path, name, types=types)))
            s = model.new_session(8)
            logits.append(np.array([model.step(s, t).copy() for t in (5, 77, 140, 3, 200, 41, 9, 12)]))
    finally:
        cpu.set_threads(before)
    assert np.array_equal(logits[0], logits[1])


def test_a_bf16_tensor_that_is_not_bf16_is_refused(tmp_path):
    d = F.make_pack(tmp_path, types={"dense": "BF16"})
    entry = Pack.open(d).index.by_name()["blk.1.attn_gate.weight"]
    with open(d / "pool.bin", "r+b") as f:  # same size: only the content check can see it
        f.seek(entry.offset + 4 * 5)
        f.write(np.float32(0.1).tobytes())  # 0.1 has low bits: not a BF16 value
    with pytest.raises(ValueError, match=r"blk\.1\.attn_gate\.weight.*not BF16 values"):
        Pack.open(d)


def test_widened_bytes_counts_two_bytes_per_fp16_scale(tmp_path):
    d = F.make_pack(tmp_path, types={"dense": "Q8_0", "experts": "Q8_0"})
    gguf = read_gguf(tmp_path / "model.gguf")
    q8_dense = [t for n, t in gguf.tensors.items() if t.type_id == 8 and "_exps" not in n]
    assert q8_dense
    # Q8_0: one fp16 scale per 32 elements; widening it to f32 adds 2 bytes (experts stay in the GGUF)
    assert Pack.open(d).widened_bytes == sum(int(np.prod(t.shape)) // 32 * 2 for t in q8_dense)


def test_a_tensor_shape_the_geometry_does_not_expect_is_named(q8, tmp_path):
    d = tmp_path / "pack"
    shutil.copytree(q8, d)
    g = Pack.open(q8).geometry
    write_geometry(d / "geometry.txt", dataclasses.replace(g, n_ff_shexp=48))
    _refingerprint(d, "geometry.txt")
    with pytest.raises(GeometryError, match=r"blk\.0\.ffn_gate_shexp\.weight has shape \[64, 64\], the geometry requires \[64, 48\]"):
        Pack.open(d, native=q8.parent / "model.gguf")


def test_an_edited_pack_file_is_refused(q8, tmp_path):
    d = tmp_path / "pack"
    shutil.copytree(q8, d)
    path = d / "native_experts.txt"
    path.write_bytes(path.read_bytes().replace(b"n_expert 8", b"n_expert 9"))  # same size, other content
    with pytest.raises(PackError, match="native_experts.txt: fingerprint recorded"):
        Pack.open(d)


def test_a_moved_gguf_is_found_with_native(q8, tmp_path):
    moved = tmp_path / "elsewhere" / "renamed.gguf"
    moved.parent.mkdir()
    d = tmp_path / "pack"
    shutil.copytree(q8, d)
    shutil.copy(q8.parent / "model.gguf", moved)
    # the pack's sources.txt still points at the original; a pack copied to another machine would not
    (d / "sources.txt").write_text("# strata pack sources v1\nmodel.gguf %2Fnonexistent%2Fmodel.gguf\n")
    _refingerprint(d, "sources.txt")
    with pytest.raises(PackError, match=r"main GGUF model\.gguf: not found \(looked at /nonexistent/model\.gguf\); pass --native"):
        Pack.open(d)
    p = Pack.open(d, native=moved)  # renaming a GGUF does not change what it holds
    assert p.source_paths == {"model.gguf": moved}
    assert np.array_equal(p.expert(2, 5)[2], Pack.open(q8).expert(2, 5)[2])


def test_a_changed_gguf_is_refused_by_name(q8, tmp_path):
    changed = tmp_path / "model.gguf"
    shutil.copy(q8.parent / "model.gguf", changed)
    with open(changed, "ab") as f:
        f.write(b"\0" * 64)
    with pytest.raises(PackError, match=r"main GGUF model\.gguf at .* size recorded \d+, found \d+"):
        Pack.open(q8, native=changed)
    shutil.copy(q8.parent / "model.gguf", changed)
    with open(changed, "r+b") as f:  # same size, a byte of the header changed
        f.seek(100)
        b = f.read(1)
        f.seek(100)
        f.write(bytes([b[0] ^ 1]))
    with pytest.raises(PackError, match=r"main GGUF model\.gguf at .* fingerprint recorded fp1-[0-9a-f]{64}, found fp1-"):
        Pack.open(q8, native=changed)


def test_a_quantized_ple_table_is_read_row_by_row(tmp_path):
    """A quantized release may store the n-gram table in a block type (synth's tiny qwen4exp: IQ4_NL);
    each row the hash picks is decoded from its own bytes in the mapped PLE shard."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize as gguf_dequantize

    from strata.engine.model import Model
    from strata.tools import pack as tools_pack
    from strata.tools.synth import synth

    main, ple = synth("qwen4exp", "tiny", tmp_path / "m.gguf")
    tools_pack.convert([main], tmp_path / "pack", compress_ratio=16)
    p = Pack.open(tmp_path / "pack")
    assert p.ple.type.quantized
    table = read_gguf(ple).tensors["per_layer_token_embd.weight"]
    want = gguf_dequantize(np.asarray(read_gguf(ple).tensor_bytes(table.name)),
                           GGMLQuantizationType(table.type_id)).reshape(p.ple.rows, p.ple.row_dim)
    rows = np.array([0, 1, 777, p.ple.rows - 1])
    (layer,) = p.geometry.ple_layers
    assert np.array_equal(Model(p).ple[layer].table_rows(rows), want[rows])


def test_not_a_pack(tmp_path):
    with pytest.raises(PackError, match="no manifest.txt, so not a pack"):
        Pack.open(tmp_path)

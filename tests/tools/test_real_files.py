"""The files users have: GGUFs as llama.cpp's own tools write them.

- llama.cpp's quantizer drops trailing 1-dimensions when it writes a tensor (the converter's
  [n_embd, 1] ffn_gate_inp_shexp becomes [n_embd] in every quantized file). ggml compares shapes
  that way, so must we: such a file packs, verifies and runs exactly as the [n_embd, 1] one; any
  other difference is still refused, naming tensor, shape found and shape required.
- llama.cpp's converter exports a Qwen3.5-MoE checkpoint's MTP draft block by default; the trunk
  packs and runs from such a file unchanged (the block is packed after the trunk, its experts in
  place; it drafts only with --spec).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import engine_fixture as F
from strata.engine.pack_reader import Pack
from strata.index_format.geometry import GeometryError, check_tensor_shapes, same_shape, tensor_specs
from strata.tools.gguf_io import KV, VT, GGUFWriter, read_gguf
from strata.tools.pack_cli import main

SHEXP = "blk.0.ffn_gate_inp_shexp.weight"


def rewritten(src: Path, dst: Path, shapes) -> Path:
    """`src` written again with each tensor's shape replaced by shapes(name, shape); bytes unchanged."""
    f = read_gguf(src)
    w = GGUFWriter(dst, alignment=f.alignment)
    w.kv = dict(f.kv)
    for name, t in f.tensors.items():
        w.add_tensor(name, shapes(name, t.shape), t.type_id, lambda raw=np.asarray(f.tensor_bytes(name)): raw)
    return w.write()


def as_llama_quantize_writes(name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    dims = list(shape)
    while len(dims) > 1 and dims[-1] == 1:
        dims.pop()
    return tuple(dims)


def _logits(pack_dir: Path) -> np.ndarray:
    from strata.engine.kernels import cpu
    from strata.engine.model import Model

    before = cpu.get_threads()
    cpu.set_threads(1)
    try:
        model = Model(Pack.open(pack_dir))
        s = model.new_session(6)
        return np.array([model.step(s, t).copy() for t in (5, 77, 140, 3, 200, 41)])
    finally:
        cpu.set_threads(before)


def test_trailing_one_dims_pack_verify_and_run_as_the_converters_shape(tmp_path, capsys):
    g = F.geometry()
    full = F.write_gguf(tmp_path / "converter.gguf", g, types={"experts": "Q8_0", "dense": "Q8_0"})
    squeezed = rewritten(full, tmp_path / "quantizer.gguf", as_llama_quantize_writes)
    dropped = [n for n, t in read_gguf(squeezed).tensors.items() if t.shape != read_gguf(full).tensors[n].shape]
    assert SHEXP in dropped and read_gguf(squeezed).tensors[SHEXP].shape == (g.n_embd,)
    packs = []
    for gguf in (full, squeezed):
        out = tmp_path / f"{gguf.stem}-pack"
        assert main(["convert", str(gguf), "-o", str(out)]) == 0, capsys.readouterr().err
        assert main(["verify", str(out), "--full"]) == 0, capsys.readouterr().err
        packs.append(out)
    # the pack records the contract's shape, so the two packs index the same tensors
    assert (packs[0] / "index.txt").read_text().splitlines()[3:] == (packs[1] / "index.txt").read_text().splitlines()[3:]
    assert np.array_equal(_logits(packs[0]), _logits(packs[1]))


@pytest.mark.parametrize("shape", [(1, 64), (64, 2), (32,)])
def test_any_other_shape_difference_is_refused_by_name(tmp_path, capsys, shape):
    src = F.write_gguf(tmp_path / "model.gguf", F.geometry())
    bad = _with_other_shape(src, tmp_path / "bad.gguf", shape)
    out = tmp_path / "pack"
    assert main(["convert", str(bad), "-o", str(out)]) == 1
    err = capsys.readouterr().err
    assert f"tensor {SHEXP} has shape {list(shape)}, the geometry requires [64, 1]" in err
    assert not out.exists()


def _with_other_shape(src: Path, dst: Path, shape: tuple[int, ...]) -> Path:
    """`src` with SHEXP holding F32 zeros of another element count."""
    f = read_gguf(src)
    w = GGUFWriter(dst, alignment=f.alignment)
    w.kv = dict(f.kv)
    for name, t in f.tensors.items():
        if name == SHEXP:
            w.add_tensor(name, shape, 0, lambda: np.zeros(int(np.prod(shape)), np.float32).view(np.uint8))
        else:
            w.add_tensor(name, t.shape, t.type_id, lambda raw=np.asarray(f.tensor_bytes(name)): raw)
    return w.write()


def test_the_contract_compares_shapes_as_ggml_does():
    g = F.geometry()
    found = {s.name: s.shape for s in tensor_specs(g)}
    check_tensor_shapes(g, found, source="x")
    # trailing 1-dims, on either side, are no difference (the engine's load runs this same check)
    check_tensor_shapes(g, {**found, SHEXP: (64,)}, source="x")
    check_tensor_shapes(g, {**found, "blk.0.ssm_a": (4, 1, 1)}, source="x")
    assert same_shape((64, 1), (64,)) and same_shape((64,), (64, 1, 1, 1))
    assert not same_shape((1, 64), (64,)) and not same_shape((64, 1, 2), (64, 2))
    with pytest.raises(GeometryError, match=r"tensor blk\.0\.ssm_a has shape \[1, 4\], the geometry requires \[4\]"):
        check_tensor_shapes(g, {**found, "blk.0.ssm_a": (1, 4)}, source="x")


# --- a qwen35moe GGUF with its MTP block ------------------------------------------------------------


@pytest.mark.reference
def test_a_qwen35moe_gguf_with_its_mtp_block_runs_the_trunk_unchanged(tmp_path, capsys):
    """llama.cpp's converter exports a Qwen3.5-MoE checkpoint's MTP block by default (block_count
    n_layer + 1, nextn_predict_layers 1, blk.{n_layer} a full-attention MoE layer + nextn.*). The
    trunk packs and runs from that file exactly as from the same checkpoint converted --no-mtp; the
    block's dense tensors follow the trunk's in the pool, its experts are referenced in place."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from reference.convert import reference_gguf

    with_mtp = reference_gguf("qwen35moe", "f32", mtp_num_hidden_layers=1)[0]
    trunk = reference_gguf("qwen35moe", "f32", mtp=False, mtp_num_hidden_layers=1)[0]
    f, t = read_gguf(with_mtp), read_gguf(trunk)
    n_layer = t.get("qwen35moe.block_count")
    assert (f.get("qwen35moe.block_count"), f.get("qwen35moe.nextn_predict_layers")) == (n_layer + 1, 1)
    mtp_tensors = sorted(set(f.tensors) - set(t.tensors))
    assert f"blk.{n_layer}.nextn.eh_proj.weight" in mtp_tensors and f"blk.{n_layer}.ffn_gate_exps.weight" in mtp_tensors
    assert all(n.startswith(f"blk.{n_layer}.") for n in mtp_tensors)

    packs = []
    for gguf in (with_mtp, trunk):
        out = tmp_path / f"{'mtp' if gguf == with_mtp else 'trunk'}-pack"
        assert main(["convert", str(gguf), "-o", str(out)]) == 0, capsys.readouterr().err
        err = capsys.readouterr().err
        assert ("MTP draft block" in err) == (gguf == with_mtp), err
        assert main(["verify", str(out), "--full"]) == 0, capsys.readouterr().err
        packs.append(out)
    p = Pack.open(packs[0])
    assert (p.geometry.n_layer, p.geometry.n_mtp_layer) == (n_layer, 1)
    assert any("MTP draft block" in w and "--spec" in w for w in p.warnings)
    # the same dense tensors at the same offsets, then the MTP block's (its experts: native_experts.txt)
    with_lines, trunk_lines = ((p / "index.txt").read_text().splitlines()[3:] for p in packs)
    assert with_lines[: len(trunk_lines)] == trunk_lines
    mtp_dense = {line.split()[0] for line in with_lines[len(trunk_lines) :]}
    assert mtp_dense == {s.name for s in tensor_specs(p.geometry) if s.layer == n_layer and s.in_pool}
    assert f"blk.{n_layer}.nextn.eh_proj.weight" in mtp_dense and f"blk.{n_layer}.ffn_gate_exps.weight" not in mtp_dense
    assert [e.layer for e in p.experts.layers] == list(range(n_layer + 1))
    assert np.array_equal(_logits(packs[0]), _logits(packs[1]))


def test_an_mtp_block_marked_recurrent_is_refused(tmp_path, capsys):
    g = F.geometry()
    src = F.write_gguf(tmp_path / "model.gguf", g)
    f = read_gguf(src)
    w = GGUFWriter(tmp_path / "bad.gguf", alignment=f.alignment)
    w.kv = dict(f.kv)
    w.kv["qwen35moe.block_count"] = KV(VT.UINT32, g.n_layer + 1)
    w.kv["qwen35moe.nextn_predict_layers"] = KV(VT.UINT32, 1)
    w.kv["qwen35moe.attention.recurrent_layers"] = KV(VT.ARRAY, [bool(x) for x in g.recurrent_layers] + [True], VT.BOOL)
    for name, t in f.tensors.items():
        w.add_tensor(name, t.shape, t.type_id, lambda raw=np.asarray(f.tensor_bytes(name)): raw)
    assert main(["convert", str(w.write()), "-o", str(tmp_path / "pack")]) == 1
    assert "attention.recurrent_layers marks MTP layer(s) [4] recurrent" in capsys.readouterr().err

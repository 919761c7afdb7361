"""The files users have: GGUFs as llama.cpp's own tools write them.

- llama.cpp's quantizer drops trailing 1-dimensions when it writes a tensor (the converter's
  [n_embd, 1] ffn_gate_inp_shexp becomes [n_embd] in every quantized file). ggml compares shapes
  that way, so must we: such a file packs, verifies and runs exactly as the [n_embd, 1] one; any
  other difference is still refused, naming tensor, shape found and shape required.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import engine_fixture as F
from strata.engine.pack import Pack
from strata.index_format.geometry import GeometryError, check_tensor_shapes, same_shape, tensor_specs
from strata.tools.gguf_io import GGUFWriter, read_gguf
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


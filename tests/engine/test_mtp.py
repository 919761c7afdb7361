"""The MTP draft block (qwen35moe): in the geometry contract, in the pack, and its draft logits.

- The contract names every tensor of the block (llama.cpp's converter layout, blk.{n_layer}.*) with
  its shape; the optional nextn tensors are geometry fields, so the list stays exact.
- `strata-pack convert` packs it from the main GGUF or from a separate MTP-only GGUF (`--mtp`,
  llama.cpp's `convert_hf_to_gguf.py --mtp`): dense tensors after the trunk's in pool.bin, experts
  in place; both give the same pack. Bad MTP inputs are refused naming the file and tensor.
- engine/mtp.py's draft logits agree with tests/reference/mtp.py (float64 numpy, written from
  llama.cpp's graph_mtp) within the trunk's tolerance, REL_TOL of tests/engine/test_forward_reference.py.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import engine_fixture as F
from reference.mtp import load_mtp_weights, load_mtp_weights_from_checkpoint, mtp_forward
from strata.engine.model import Model
from strata.engine.mtp import MTPHead
from strata.engine.pack_reader import Pack, PackError
from strata.index_format.geometry import EXPERT, MTP, GeometryError, ModelGeometry, tensor_specs
from strata.tools.gguf_io import KV, VT, GGUFWriter, read_gguf
from strata.tools.pack_cli import main

bad = pytest.mark.bad_input

REL_TOL = 5e-5  # tests/engine/test_forward_reference.py's: the engine against float64, F32 weights
MARGIN = 5.0  # router top-k boundaries at least this many times the engine/reference disagreement
L = 4  # engine_fixture's n_layer: the MTP block is blk.4


def mtp_geometry(**over) -> ModelGeometry:
    """engine_fixture's model with the MTP block a Qwen3.5-MoE release carries (shared_head_norm,
    the trunk's embedding and head), unless `over` says otherwise."""
    return F.geometry(**{"n_mtp_layer": 1, "mtp_shared_head_norm": 1, **over})


def write_model(tmp: Path, name: str = "model", seed: int = 0, **over) -> Path:
    return F.write_gguf(tmp / f"{name}.gguf", mtp_geometry(**over), seed=seed)


def copy_gguf(src: Path, dst: Path, keep=lambda name: True, kv=None, shapes=None) -> Path:
    """`src` written again with only the tensors `keep` accepts, metadata edited by kv(dict)."""
    f = read_gguf(src)
    w = GGUFWriter(dst, alignment=f.alignment)
    w.kv = dict(f.kv)
    if kv:
        kv(w.kv)
    for name, t in f.tensors.items():
        if keep(name):
            shape = shapes(name, t.shape) if shapes else t.shape
            w.add_tensor(name, shape, t.type_id, lambda raw=np.asarray(f.tensor_bytes(name)): raw)
    return w.write()


def split_mtp(full: Path, trunk: Path, head: Path, n_layer: int = L) -> tuple[Path, Path]:
    """The two files llama.cpp's converter writes with --no-mtp and with --mtp: the trunk alone
    (block_count n_layer, no nextn_predict_layers) and the MTP-only GGUF (all the metadata, and only
    token_embd, output_norm, output and blk.{n_layer}.*: conversion/qwen.py _QwenMtpMixin mtp_only)."""
    arch = read_gguf(full).get("general.architecture")

    def trunk_kv(kv):
        kv[f"{arch}.block_count"] = KV(VT.UINT32, n_layer)
        del kv[f"{arch}.nextn_predict_layers"]
        rec = kv[f"{arch}.attention.recurrent_layers"]
        kv[f"{arch}.attention.recurrent_layers"] = KV(VT.ARRAY, rec.value[:n_layer], VT.BOOL)

    mtp = f"blk.{n_layer}."
    copy_gguf(full, trunk, keep=lambda n: not n.startswith(mtp), kv=trunk_kv)
    copy_gguf(full, head, keep=lambda n: n.startswith(mtp) or n in ("token_embd.weight", "output_norm.weight",
                                                                     "output.weight"))
    return trunk, head


def convert(*args) -> int:
    return main(["convert", *map(str, args)])


def refused(capsys, *messages: str) -> str:
    err = capsys.readouterr().err
    for m in messages:
        assert m in err, err
    assert "Traceback" not in err
    return err


# --- the geometry contract -------------------------------------------------------------------------


def test_the_contract_names_every_tensor_of_the_mtp_block():
    g = mtp_geometry(mtp_embed_tokens=1, mtp_shared_head_head=1)
    E, V, H, Hkv, D, X, Ff, Fs = 64, 320, 4, 2, 32, 8, 32, 64
    got = {s.name: s for s in tensor_specs(g) if s.layer == L}
    b = f"blk.{L}."
    want = {  # llama.cpp's load_block_mtp shapes (src/models/qwen35moe.cpp), GGUF order
        "attn_norm.weight": (E,), "post_attention_norm.weight": (E,),
        "attn_q.weight": (E, 2 * H * D), "attn_k.weight": (E, Hkv * D), "attn_v.weight": (E, Hkv * D),
        "attn_output.weight": (H * D, E), "attn_q_norm.weight": (D,), "attn_k_norm.weight": (D,),
        "ffn_gate_inp.weight": (E, X), "ffn_gate_exps.weight": (E, Ff, X), "ffn_up_exps.weight": (E, Ff, X),
        "ffn_down_exps.weight": (Ff, E, X), "ffn_gate_inp_shexp.weight": (E, 1), "ffn_gate_shexp.weight": (E, Fs),
        "ffn_up_shexp.weight": (E, Fs), "ffn_down_shexp.weight": (Fs, E),
        "nextn.eh_proj.weight": (2 * E, E), "nextn.enorm.weight": (E,), "nextn.hnorm.weight": (E,),
        "nextn.embed_tokens.weight": (E, V), "nextn.shared_head_head.weight": (E, V),
        "nextn.shared_head_norm.weight": (E,),
    }  # fmt: skip
    assert {n: s.shape for n, s in got.items()} == {b + n: shape for n, shape in want.items()}
    # experts stay in the GGUF like the trunk's; everything else is MTP, in the pool, not on the device
    for s in got.values():
        assert s.category == (EXPERT if "_exps" in s.name else MTP), s.name
        assert s.in_pool == ("_exps" not in s.name) and not s.multiplied
    # the optional tensors are exactly the ones the geometry says the block carries
    plain = {s.name for s in tensor_specs(mtp_geometry(mtp_shared_head_norm=0)) if s.layer == L}
    assert set(got) - plain == {b + "nextn.embed_tokens.weight", b + "nextn.shared_head_head.weight",
                                b + "nextn.shared_head_norm.weight"}


@pytest.mark.parametrize("over, message", [
    (dict(arch="qwen4exp"), "an MTP block in a qwen4exp model: no GGUF layout is defined"),
    (dict(n_mtp_layer=2), "2 MTP blocks: Strata knows one"),
    (dict(n_mtp_layer=0, mtp_shared_head_norm=1), "mtp_shared_head_norm is 1, expected 0 or 1, and 0 without"),
])
def test_impossible_mtp_geometries_are_refused(over, message):
    values = mtp_geometry().to_values() | over
    if over.get("arch") == "qwen4exp":
        values |= dict(hc=4, hc_lowrank=8)
    with pytest.raises(GeometryError, match=message):
        ModelGeometry(**values)


# --- packing ---------------------------------------------------------------------------------------


def test_convert_packs_the_block_dense_in_the_pool_experts_in_place(tmp_path, capsys):
    gguf = write_model(tmp_path)
    assert convert(gguf, "-o", tmp_path / "pack") == 0, capsys.readouterr().err
    assert "MTP draft block (layer 4" in capsys.readouterr().err
    assert main(["verify", str(tmp_path / "pack"), "--full"]) == 0, capsys.readouterr().err
    p = Pack.open(tmp_path / "pack")
    g = p.geometry
    assert (g.n_layer, g.n_mtp_layer, g.mtp_shared_head_norm, g.mtp_embed_tokens) == (L, 1, 1, 0)
    dense = [t.name for t in p.index.tensors if t.name.startswith(f"blk.{L}.")]
    assert dense == [s.name for s in tensor_specs(g) if s.layer == L and s.in_pool]
    assert [e.layer for e in p.experts.layers] == list(range(L + 1))
    # the MTP experts are the GGUF's bytes, referenced in place
    f = read_gguf(gguf)
    e = p.experts.layers[L]
    assert e.gate_off == f.tensors[f"blk.{L}.ffn_gate_exps.weight"].offset
    assert e.down_off == f.tensors[f"blk.{L}.ffn_down_exps.weight"].offset


def test_the_trunk_runs_unchanged_beside_the_block(tmp_path):
    """engine_fixture draws the tensors in contract order, the MTP block last: the same seed gives
    the same trunk, which must decode to the same logits with and without the block packed."""
    logits = []
    for name, geo in (("with", mtp_geometry()), ("without", F.geometry())):
        gguf = F.write_gguf(tmp_path / f"{name}.gguf", geo, seed=3)
        assert convert(gguf, "-o", tmp_path / f"{name}-pack") == 0
        m = Model(Pack.open(tmp_path / f"{name}-pack"))
        s = m.new_session(8)
        logits.append(np.stack([m.step(s, t).copy() for t in (5, 17, 42, 3)]))
    assert np.array_equal(logits[0], logits[1])


def test_a_separate_mtp_gguf_packs_as_the_block_in_the_main_gguf(tmp_path, capsys):
    full = write_model(tmp_path)
    trunk, head = split_mtp(full, tmp_path / "trunk.gguf", tmp_path / "mtp-trunk.gguf")
    assert convert(full, "-o", tmp_path / "a") == 0
    assert convert(trunk, "--mtp", head, "-o", tmp_path / "b") == 0, capsys.readouterr().err
    assert main(["verify", str(tmp_path / "b"), "--full"]) == 0, capsys.readouterr().err
    a, b = (tmp_path / "a"), (tmp_path / "b")
    assert (a / "pool.bin").read_bytes() == (b / "pool.bin").read_bytes()
    assert (a / "geometry.txt").read_text() == (b / "geometry.txt").read_text()
    assert (a / "index.txt").read_text().splitlines()[2:] == (b / "index.txt").read_text().splitlines()[2:]
    manifest = (b / "manifest.txt").read_text()
    assert "source main" in manifest and "source mtp" in manifest and "mtp-trunk.gguf" in manifest
    pb = Pack.open(b)
    assert pb.experts.layers[L].shard == "mtp-trunk.gguf"
    # the engine reads the block's experts from the MTP GGUF: the same draft logits from both packs
    out = []
    for p in (Pack.open(a), pb):
        head_ = MTPHead(p)
        st = head_.new_state(4)
        out.append(np.stack([head_.step(st, np.full(64, 0.5, np.float32) * k, tok, k).copy()
                             for k, tok in enumerate((7, 100, 3))]))
    assert np.array_equal(out[0], out[1])


@bad("file")
def test_an_mtp_gguf_of_another_model_is_refused(tmp_path, capsys):
    _, head = split_mtp(write_model(tmp_path, "other", n_expert=4, n_expert_used=2), tmp_path / "o-trunk.gguf",
                        tmp_path / "mtp-other.gguf")
    trunk, _ = split_mtp(write_model(tmp_path), tmp_path / "trunk.gguf", tmp_path / "mtp-trunk.gguf")
    assert convert(trunk, "--mtp", head, "-o", tmp_path / "pack") == 1
    refused(capsys, "--mtp mtp-other.gguf: its n_expert is 4, the main GGUF trunk.gguf has 8: the MTP GGUF is of "
                    "another model")
    assert not (tmp_path / "pack").exists()


@bad("file")
@pytest.mark.parametrize("case, message", [
    ("missing", "tensor blk.4.nextn.hnorm.weight is missing (required shape [64])"),
    ("shape", "tensor blk.4.nextn.eh_proj.weight has shape [64, 128], the geometry requires [128, 64]"),
    ("no-nextn", "--mtp mtp-trunk.gguf: metadata qwen35moe.nextn_predict_layers is missing or 0, so the file "
                 "carries no MTP block"),
    ("full", "--mtp mtp-trunk.gguf: holds trunk tensor blk.0."),
    ("main-has-one", "the main GGUF model.gguf already carries an MTP block (nextn_predict_layers 1)"),
    ("same-name", "the same file name as"),
])
def test_bad_mtp_inputs_are_refused(tmp_path, capsys, case, message):
    full = write_model(tmp_path)
    trunk, head = split_mtp(full, tmp_path / "trunk.gguf", tmp_path / "mtp.gguf")
    main_gguf, mtp_gguf = trunk, tmp_path / "mtp-trunk.gguf"
    if case == "missing":
        copy_gguf(head, mtp_gguf, keep=lambda n: n != f"blk.{L}.nextn.hnorm.weight")
    elif case == "shape":  # the fc's two halves read as one square matrix: the same bytes, the wrong shape
        copy_gguf(head, mtp_gguf, shapes=lambda n, s: s[::-1] if n.endswith("eh_proj.weight") else s)
    elif case == "no-nextn":  # the block's tensors, but metadata that says the file has none
        copy_gguf(head, mtp_gguf, kv=lambda kv: kv.pop("qwen35moe.nextn_predict_layers"))
    elif case == "full":
        copy_gguf(full, mtp_gguf)
    elif case == "main-has-one":
        main_gguf = full
        copy_gguf(head, mtp_gguf)
    else:
        (tmp_path / "b").mkdir()
        mtp_gguf = copy_gguf(head, tmp_path / "b" / "trunk.gguf")
    assert convert(main_gguf, "--mtp", mtp_gguf, "-o", tmp_path / "pack") == 1
    refused(capsys, message)
    assert not (tmp_path / "pack").exists()


@bad("file")
def test_an_mtp_gguf_beside_a_qwen4exp_model_is_refused(tmp_path, capsys):
    """The qwen4exp release ships its MTP head separately, but in no GGUF layout: llama.cpp's qwen4exp
    converter exports none (supports_mtp_export False) and its tensor list has no nextn tensors."""
    from strata.tools.synth import synth

    main_gguf = synth("qwen4exp", "tiny", tmp_path / "q4.gguf")[0]
    _, head = split_mtp(write_model(tmp_path), tmp_path / "trunk.gguf", tmp_path / "mtp-trunk.gguf")
    assert convert(main_gguf, "--mtp", head, "-o", tmp_path / "pack") == 1
    refused(capsys, "--mtp mtp-trunk.gguf: the main GGUF q4-00001-of-00002.gguf is qwen4exp, for which no GGUF "
                    "layout of an MTP block is defined")


@bad("file")
def test_a_pack_made_before_the_block_was_packed_is_refused(tmp_path, capsys):
    """Such a pack's geometry.txt says n_mtp_layer 1 (and has no mtp_* fields) while index.txt and
    native_experts.txt hold the trunk only: made here from a trunk pack, its geometry re-recorded."""
    from dataclasses import replace

    from strata.index_format.geometry import read_geometry, write_geometry
    from strata.index_format.manifest import Manifest, PackFile, fingerprint_file, read_manifest, write_manifest

    pack = F.make_pack(tmp_path)
    geo = pack / "geometry.txt"
    write_geometry(geo, replace(read_geometry(geo), n_mtp_layer=1))
    m = read_manifest(pack / "manifest.txt")
    files = [PackFile(f.name, geo.stat().st_size, fingerprint_file(geo)) if f.name == "geometry.txt" else f
             for f in m.files]
    write_manifest(pack / "manifest.txt", Manifest(m.sources, files))
    message = "the pack does not hold it: packs made before Strata packed the MTP block left it in the GGUF; convert"
    with pytest.raises(PackError, match=message):
        Pack.open(pack)
    assert main(["verify", str(pack)]) == 1
    refused(capsys, message)


@bad("file")
def test_the_draft_head_of_a_pack_without_one_is_refused(tmp_path):
    pack = F.make_pack(tmp_path)
    with pytest.raises(PackError, match="the model has no MTP block"):
        MTPHead(Pack.open(pack))


# --- the draft logits against the float64 reference ------------------------------------------------


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max() / np.abs(b).max())


@pytest.mark.parametrize("optional", [
    dict(),  # as a Qwen3.5-MoE release: its own shared_head_norm, the trunk's embedding and head
    dict(mtp_shared_head_norm=0),  # borrows output_norm too
    dict(mtp_embed_tokens=1, mtp_shared_head_head=1),  # carries all three
], ids=["release", "borrows-all", "own-all"])
def test_draft_logits_match_the_float64_reference(tmp_path, optional):
    """A chain of T pairs (h_p, token_{p+1}) through the head, each attending the earlier ones: the
    engine at positions p (its KV cache from slot 0), the reference at llama.cpp's p + 1."""
    gguf = write_model(tmp_path, seed=1, **optional)
    assert convert(gguf, "-o", tmp_path / "pack") == 0
    head = MTPHead(Pack.open(tmp_path / "pack"))
    T = 12
    rng = np.random.default_rng(7)
    h = rng.standard_normal((T, 64)).astype(np.float32) * 3.0  # the trunk's output-normed states
    tokens = rng.integers(0, 320, T)
    state = head.new_state(T)
    logits, hidden, router = [], [], []
    for p in range(T):
        logits.append(head.step(state, h[p], int(tokens[p]), p).copy())
        hidden.append(head.hidden.copy())
        router.append(head.moe.logits.reshape(-1).copy())  # [1, X]: one pair
    ref_w = load_mtp_weights([gguf])
    assert ref_w["n_layer"] == L
    ref = mtp_forward(ref_w["weights"], ref_w["hparams"], h, tokens, [p + 1 for p in range(T)])
    rel = _rel(np.stack(logits), ref["logits"])
    assert rel < REL_TOL, f"draft logits: max |engine - reference| / max |reference| = {rel:.3e}"
    assert _rel(np.stack(hidden), ref["hidden"]) < REL_TOL
    # no near-ties: each position's k-th/(k+1)-th router logits are far apart against the disagreement
    r = np.sort(ref["router"], axis=1)[:, ::-1]
    k = ref_w["hparams"]["n_expert_used"]
    err = np.abs(np.stack(router) - ref["router"]).max()
    assert (r[:, k - 1] - r[:, k]).min() > MARGIN * err
    # not vacuous: the hidden state first (the wrong concat order: eh_proj's halves exchanged) is far
    w = dict(ref_w["weights"])
    E = 64
    w["eh_proj"] = np.concatenate([w["eh_proj"][:, E:], w["eh_proj"][:, :E]], axis=1)
    swapped = mtp_forward(w, ref_w["hparams"], h, tokens, [p + 1 for p in range(T)])
    assert _rel(np.stack(logits), swapped["logits"]) > 1000 * REL_TOL


# --- llama.cpp's own files -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def real(tmp_path_factory):
    """llama.cpp's converter on the tiny Qwen3.5-MoE checkpoint with an MTP block, three ways: the
    default (block in the GGUF), --no-mtp (the trunk) and --mtp (the MTP-only GGUF)."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from reference.convert import ConverterError, reference_checkpoint, reference_gguf

    try:
        files = {how: reference_gguf("qwen35moe", "f32", mtp=how, mtp_num_hidden_layers=1)[0]
                 for how in (True, False, "only")}
    except ConverterError as e:
        pytest.skip(f"llama.cpp converter unavailable: {e}")
    d = tmp_path_factory.mktemp("real")
    # llama.cpp names the MTP-only file mtp-NAME.gguf; the three conversions share one name
    trunk, head = d / "tiny.gguf", d / "mtp-tiny.gguf"
    trunk.symlink_to(files[False])
    head.symlink_to(files["only"])
    return dict(full=files[True], trunk=trunk, head=head, dir=d,
                checkpoint=reference_checkpoint("qwen35moe", 0, mtp_num_hidden_layers=1))


@pytest.mark.reference
def test_llama_cpps_mtp_only_gguf_packs_as_the_block_in_its_main_gguf(real, capsys):
    head = read_gguf(real["head"])
    n_layer = read_gguf(real["trunk"]).get("qwen35moe.block_count")
    # the MTP-only layout: the trunk's embedding, norm and head copies and the block, nothing else
    assert {n for n in head.tensors if not n.startswith(f"blk.{n_layer}.")} == {
        "token_embd.weight", "output_norm.weight", "output.weight"}
    a, b = real["dir"] / "a", real["dir"] / "b"
    assert convert(real["full"], "-o", a) == 0, capsys.readouterr().err
    assert convert(real["trunk"], "--mtp", real["head"], "-o", b) == 0, capsys.readouterr().err
    assert main(["verify", str(b), "--full"]) == 0, capsys.readouterr().err
    assert (a / "pool.bin").read_bytes() == (b / "pool.bin").read_bytes()
    assert (a / "geometry.txt").read_text() == (b / "geometry.txt").read_text()
    assert Pack.open(b).experts.layers[n_layer].shard == "mtp-tiny.gguf"


@pytest.mark.reference
def test_draft_logits_of_llama_cpps_conversion_match_the_checkpoint(real, capsys):
    """The engine on the converter's GGUF against the float64 reference on the Hugging Face
    checkpoint it was converted from: the layout (names, eh_proj's halves, the folded +1 of every
    norm, q_proj's [query | gate] rows) as well as the arithmetic."""
    out = real["dir"] / "draft-pack"
    assert convert(real["full"], "-o", out) == 0, capsys.readouterr().err
    head = MTPHead(Pack.open(out))
    ref_w = load_mtp_weights_from_checkpoint(real["checkpoint"])
    E, V = ref_w["weights"]["eh_proj"].shape[0], ref_w["weights"]["head"].shape[0]
    T = 12
    rng = np.random.default_rng(11)
    h = rng.standard_normal((T, E)).astype(np.float32) * 3.0
    tokens = rng.integers(0, V, T)
    state = head.new_state(T)
    logits, router = [], []
    for p in range(T):
        logits.append(head.step(state, h[p], int(tokens[p]), p).copy())
        router.append(head.moe.logits.reshape(-1).copy())  # [1, X]: one pair
    ref = mtp_forward(ref_w["weights"], ref_w["hparams"], h, tokens, [p + 1 for p in range(T)])
    rel = _rel(np.stack(logits), ref["logits"])
    assert rel < REL_TOL, f"draft logits: max |engine - checkpoint reference| / max |reference| = {rel:.3e}"
    r, k = np.sort(ref["router"], axis=1)[:, ::-1], ref_w["hparams"]["n_expert_used"]
    assert (r[:, k - 1] - r[:, k]).min() > MARGIN * np.abs(np.stack(router) - ref["router"]).max()


def test_the_budget_counts_the_trunks_expert_pairs_and_leaves_the_block_off_the_device(tmp_path, capsys):
    """The expert cache holds the trunk's layers (its slot map is [n_layer, n_expert]); the block's
    matrices are not placed on the device with the trunk's (the drafting work will place them)."""
    from strata.tools.budget_cli import main as budget_main

    out = {}
    for name, geo in (("with", mtp_geometry()), ("without", F.geometry())):
        # Q8_0 matrices: fp16 scales the device widens, so a matrix placed there shows in its bytes
        gguf = F.write_gguf(tmp_path / f"{name}.gguf", geo, types={"dense": "Q8_0"})
        assert convert(gguf, "-o", tmp_path / name) == 0
        assert budget_main([str(tmp_path / name)]) == 0
        out[name] = capsys.readouterr().out
    assert f"{L * 8} (layer, expert) pairs" in out["with"]
    device = [line for line in out["with"].splitlines() if "device after" in line]
    assert device == [line for line in out["without"].splitlines() if "device after" in line]
    p = Pack.open(tmp_path / "with")
    mtp_bytes = sum(t.engine_nbytes for t in p.index.tensors if t.name.startswith(f"blk.{L}."))
    line = next(line for line in out["with"].splitlines() if "MTP draft block's dense weights" in line)
    assert line.split()[-1] == str(mtp_bytes) and "host" in line

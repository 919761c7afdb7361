"""strata-pack convert / verify / demo: GGUF -> pack, read back with the strict readers, and every
way a bad input or an interrupted run must fail clearly and leave nothing half-written.

The GGUFs are built here from tensor_specs() of a small ModelGeometry with our GGUFWriter and
random bytes kept beside them, so every byte check compares the pack with what the fixture wrote,
never with the packer's own arithmetic.

Not tools/synth.py's builder (which strata-pack synth and tests/engine_fixture.py share), on
purpose: this is the packer's test, so its metadata is written by a second route that varies what
a converter may vary (the PLE offsets and sizes as INT32 arrays where synth writes UINT64, no
embedding_length_per_layer_input, attention.compress_ratios overridable, a hand-made vocabulary with
non-ASCII merges), and its tensors are raw random bytes of any type mix, which synth's values,
made to look like a model's, are not.
"""

from __future__ import annotations

import dataclasses
import os
import struct
from pathlib import Path

import numpy as np
import pytest

from strata.index_format.errors import FormatError
from strata.index_format.geometry import EXPERT, PLE_TABLE, GeometryError, ModelGeometry, tensor_specs
from strata.index_format.ggml_types import BY_NAME
from strata.index_format.geometry import read_geometry
from strata.index_format.hparams import read_hparams
from strata.index_format.manifest import read_manifest
from strata.index_format.native_experts import read_native_experts
from strata.index_format.pack_index import read_index
from strata.index_format.pack_sources import read_sources, write_sources
from strata.index_format.ple_table import PleTable, read_ple_table, write_ple_table
from strata.index_format.tokenizer_flat import read_tokenizer
from strata.tools import pack
from strata.tools.gguf_io import VT, GGUFError, GGUFWriter
from strata.tools.pack_cli import main

T = BY_NAME
MULTIPLIERS = (2**63 + 12345, 2**53 + 1, 7)  # u64 beyond 2^53: a float would change them
TOKENS = ["<|endoftext|>", "<|im_start|>", "a", "b", "Ġ", "Ġa", "ab", "é", "Ġé", "ĊĊ"]
MERGES = ["Ġ a", "a b", "Ġ é"]


def tokens(g) -> list[str]:
    return TOKENS + [f"[PAD{i}]" for i in range(len(TOKENS), g.n_vocab)]


def geometry(arch: str = "qwen4exp", **over) -> ModelGeometry:
    v = dict(
        arch=arch, n_vocab=48, n_embd=64, n_layer=4, full_attention_interval=4, rms_eps=2.0**-20,
        n_head=2, n_head_kv=1, head_dim=32, n_rot=8, rope_freq_base=1e7, rope_sections=(2, 2, 0, 0),
        ssm_d_conv=4, ssm_d_state=16, ssm_n_k_heads=2, ssm_n_v_heads=4, ssm_d_inner=64,
        n_expert=4, n_expert_used=2, n_ff_exp=64, n_ff_shexp=64,
    )  # fmt: skip
    if arch == "qwen4exp":
        v.update(
            hc=2, hc_lowrank=8, idx_n_heads=2, idx_head_dim=32, idx_top_k=16, idx_compress_ratio=4,
            compress_ratios=(0, 0, 0, 4), ple_layers=(1,), ple_ngram_size=3, ple_heads_per_ngram=2,
            ple_conv_kernel=3, ple_eos_token_id=0, ple_row_dim=16, ple_table_rows=40, ple_multipliers=MULTIPLIERS,
            ple_head_offsets=(0, 10, 20, 30), ple_head_vocab_sizes=(10, 10, 10, 10),
        )  # fmt: skip
    v.update(over)
    return ModelGeometry(**v)


# Expert types per layer: (gate/up, down); sizes vary by layer, as in the seed's real file.
EXPERT_TYPES = [("Q4_0", "Q8_0"), ("Q2_0", "IQ4_NL"), ("BF16", "F16"), ("Q8_0", "Q8_0")]


def type_of(name: str, shape: tuple[int, ...], layer: int | None) -> str:
    if "_exps" in name:
        gu, d = EXPERT_TYPES[layer]
        return d if "down" in name else gu
    if len(shape) == 1 or shape[0] % 32:
        return "F32" if len(shape) == 1 else "BF16"
    if name == "output.weight" or "shexp" in name:
        return "Q8_0"
    if name.endswith("attn_gate.weight"):
        return "F16"
    if name.endswith("ssm_out.weight"):
        return "Q4_0"
    return "BF16"


@dataclasses.dataclass
class Model:
    g: ModelGeometry
    files: list[Path]  # what to pass as GGUF arguments
    ple: Path | None
    data: dict[str, bytes]  # tensor name -> the bytes the fixture wrote
    types: dict[str, int]


def _metadata(w: GGUFWriter, g: ModelGeometry, compress_ratios=None) -> None:
    a = g.arch
    u32 = lambda k, v: w.add(f"{a}.{k}", v, VT.UINT32)  # noqa: E731
    arr = lambda k, v, sub=VT.INT32: w.add(f"{a}.{k}", list(v), VT.ARRAY, sub)  # noqa: E731
    w.add("general.architecture", a, VT.STRING)
    for k, v in [("embedding_length", g.n_embd), ("block_count", g.n_layer),
                 ("full_attention_interval", g.full_attention_interval), ("attention.head_count", g.n_head),
                 ("attention.head_count_kv", g.n_head_kv), ("attention.key_length", g.head_dim),
                 ("attention.value_length", g.head_dim), ("rope.dimension_count", g.n_rot),
                 ("ssm.conv_kernel", g.ssm_d_conv), ("ssm.state_size", g.ssm_d_state),
                 ("ssm.group_count", g.ssm_n_k_heads), ("ssm.time_step_rank", g.ssm_n_v_heads),
                 ("ssm.inner_size", g.ssm_d_inner), ("expert_count", g.n_expert),
                 ("expert_used_count", g.n_expert_used), ("expert_feed_forward_length", g.n_ff_exp),
                 ("expert_shared_feed_forward_length", g.n_ff_shexp)]:
        u32(k, v)
    w.add(f"{a}.attention.layer_norm_rms_epsilon", g.rms_eps, VT.FLOAT32)
    w.add(f"{a}.rope.freq_base", g.rope_freq_base, VT.FLOAT32)
    arr("rope.dimension_sections", g.rope_sections)
    if a == "qwen4exp":
        u32("hyper_connection.count", g.hc)
        u32("hyper_connection.low_rank", g.hc_lowrank)
        arr("attention.compress_ratios", g.compress_ratios if compress_ratios is None else compress_ratios)
        u32("attention.indexer.head_count", g.idx_n_heads)
        u32("attention.indexer.key_length", g.idx_head_dim)
        u32("attention.indexer.top_k", g.idx_top_k)
        arr("ple.layers", g.ple_layers)
        for k in ("ngram_size", "heads_per_ngram", "conv_kernel", "eos_token_id"):
            u32(f"ple.{k}", getattr(g, f"ple_{k}"))
        arr("ple.layer_multipliers", g.ple_multipliers, VT.UINT64)
        arr("ple.head_offsets", g.ple_head_offsets)
        arr("ple.head_vocab_sizes", g.ple_head_vocab_sizes)
    w.add("tokenizer.ggml.model", "gpt2", VT.STRING)
    w.add("tokenizer.ggml.pre", "qwen35", VT.STRING)
    # padded to token_embd's rows, as llama.cpp's converter does (convert wants one token per row)
    w.add("tokenizer.ggml.tokens", tokens(g), VT.ARRAY, VT.STRING)
    w.add("tokenizer.ggml.token_type", [3, 3] + [1] * (len(TOKENS) - 2) + [5] * (g.n_vocab - len(TOKENS)), VT.ARRAY,
          VT.INT32)
    w.add("tokenizer.ggml.merges", MERGES, VT.ARRAY, VT.STRING)
    w.add("tokenizer.ggml.eos_token_id", 0, VT.UINT32)
    w.add("tokenizer.ggml.padding_token_id", 0, VT.UINT32)
    w.add("tokenizer.ggml.bos_token_id", 1, VT.UINT32)
    w.add("tokenizer.ggml.add_bos_token", False, VT.BOOL)
    w.add("tokenizer.chat_template", "{% for m in messages %}{{ m.content }}{% endfor %}", VT.STRING)


def finite(t, raw: np.ndarray) -> bytes:
    """Random bytes with every float a kernel reads made finite (convert refuses a NaN/inf weight): the
    top exponent bit of each F32 value, of each F16/BF16 value and of each fp16 block scale is cleared."""
    if t.name == "F32":
        raw.view(np.uint32)[:] &= ~np.uint32(1 << 30)
    elif t.name in ("F16", "BF16"):
        raw.view(np.uint16)[:] &= ~np.uint16(1 << 14)
    else:
        blocks = raw.reshape(-1, t.type_size)
        for off, n in t.fp16_fields:
            blocks[:, off + 1 : off + 2 * n : 2] &= np.uint8(0xBF)  # the high byte of each fp16: bit 14 is its 0x40
    return raw.tobytes()


def build(tmp: Path, arch: str = "qwen4exp", *, n_shards: int = 1, ple_separate: bool = True, seed: int = 0,
          meta=None, shape_over=None, type_over=None, **geo) -> Model:
    """Write a model's GGUF(s) under `tmp`: one file or `n_shards` split shards, the PLE table in its own file."""
    g = geometry(arch, **geo)
    rng = np.random.default_rng(seed)
    specs = tensor_specs(g)
    data, types, placed = {}, {}, [[] for _ in range(n_shards)]
    ple_specs = []
    for i, s in enumerate(specs):
        shape = (shape_over or {}).get(s.name, s.shape)
        t = T[(type_over or {}).get(s.name, type_of(s.name, shape, s.layer))]
        data[s.name] = finite(t, rng.integers(0, 256, size=t.nbytes(shape), dtype=np.uint8))
        types[s.name] = t.id
        if s.category == PLE_TABLE and ple_separate:
            ple_specs.append((s.name, shape, t.id))
        else:
            # later layers in later shards, the way gguf-split cuts a file in tensor order
            placed[min(n_shards - 1, i * n_shards // len(specs))].append((s.name, shape, t.id))
    stem = f"{arch}-tiny"
    names = [tmp / f"{stem}.gguf"] if n_shards == 1 else [tmp / f"{stem}-{k + 1:05d}-of-{n_shards:05d}.gguf" for k in range(n_shards)]
    for k, (path, tensors) in enumerate(zip(names, placed)):
        w = GGUFWriter(path)
        if k == 0:
            _metadata(w, g, *(meta or ()))
        if n_shards > 1:
            w.add("split.no", k, VT.UINT16)
            w.add("split.count", n_shards, VT.UINT16)
            w.add("split.tensors.count", sum(map(len, placed)), VT.INT32)
        for name, shape, tid in tensors:
            w.add_tensor(name, shape, tid, lambda b=data[name]: b)
        w.write()
    ple = None
    if ple_specs:
        ple = tmp / f"{stem}-ple.gguf"
        w = GGUFWriter(ple)
        for name, shape, tid in ple_specs:
            w.add_tensor(name, shape, tid, lambda b=data[name]: b)
        w.write()
    return Model(g, names, ple, data, types)


def subdir(tmp: Path, name: str) -> Path:
    (tmp / name).mkdir()
    return tmp / name


def convert(m: Model, out: Path, **kw):
    return pack.convert(m.files, out, ple_gguf=m.ple, **kw)


def no_leftovers(out: Path) -> None:
    """Nothing that looks like a pack, and no temp directory, beside `out`."""
    left = [p.name for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.")]
    assert not left, f"left behind: {left}"


# --- round trips ----------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["qwen4exp", "qwen35moe"])
def test_convert_reads_back_with_the_strict_readers(tmp_path, arch):
    m = build(tmp_path, arch)
    out = tmp_path / "pack"
    plan = convert(m, out)
    g = m.g
    assert plan.warnings == ()
    pool = (out / "pool.bin").read_bytes()
    idx = read_index(out / "index.txt", pool_size=len(pool))
    assert (out / "index.txt").read_text().splitlines()[1] == f"# from {m.files[0].name}"
    dense = [s for s in tensor_specs(g) if s.in_pool]
    assert [t.name for t in idx.tensors] == [s.name for s in dense]
    for t in idx.tensors:
        src = m.data[t.name]
        assert t.offset % 64 == 0 and t.src_type == m.types[t.name]
        got = pool[t.offset : t.offset + t.nbytes]
        if t.src_type == T["BF16"].id:
            # S3: lossless promotion: the F32's top 16 bits are the BF16, the low 16 are zero
            w = np.frombuffer(got, "<u4")
            assert np.array_equal((w >> 16).astype("<u2"), np.frombuffer(src, "<u2")), t.name
            assert not (w & 0xFFFF).any(), t.name
        else:
            assert got == src, t.name
    assert read_geometry(out / "geometry.txt") == g
    if arch == "qwen4exp":
        params = read_hparams(out / "geometry.txt")
        assert params["ple_multipliers"].kind == "u64" and params["ple_multipliers"].values == MULTIPLIERS
    tok = read_tokenizer(out / "tokenizer.txt")
    assert tok.tokens == tuple(t.encode("utf-8") for t in tokens(g))
    assert tok.merges[2] == ("Ġ".encode(), "é".encode())
    assert tok.special == {"bos": 1, "eos": 0, "pad": 0} and tok.add_bos is False
    assert tok.token_types[:3] == (3, 3, 1) and tok.chat_template.startswith("{% for m")
    man = read_manifest(out / "manifest.txt")
    assert [(s.role, s.name, s.size) for s in man.sources] == (
        [("main", m.files[0].name, m.files[0].stat().st_size)]
        + ([("ple", m.ple.name, m.ple.stat().st_size)] if m.ple else []))
    assert {f.name: f.size for f in man.files} == {
        p.name: p.stat().st_size for p in out.iterdir() if p.name != "manifest.txt"}
    assert pack.verify_pack(out, full=True).ok


def expert_bytes_check(m: Model, out: Path, picks) -> None:
    """Read experts through native_experts.txt's offsets and compare with the fixture's bytes of expert e."""
    g = m.g
    ne = read_native_experts(out / "native_experts.txt", n_embd=g.n_embd, n_ff=g.n_ff_exp, n_expert=g.n_expert,
                             layers=range(g.n_layer))
    assert ne.total == sum(len(m.data[s.name]) for s in tensor_specs(g) if s.category == EXPERT)
    for layer, e in picks:
        line = ne.layers[layer]
        path = m.files[0].parent / (line.shard or ne.gguf)
        raw = path.read_bytes()
        sizes = []
        for role, off in (("gate", line.gate_off), ("up", line.up_off), ("down", line.down_off)):
            whole = m.data[f"blk.{layer}.ffn_{role}_exps.weight"]
            size = len(whole) // g.n_expert  # expert e is the slowest dim: a contiguous slice
            sizes.append(size)
            assert raw[off + e * size : off + (e + 1) * size] == whole[e * size : (e + 1) * size], (layer, role, e)
        assert line.blob_bytes == sum(sizes)
        gu, d = EXPERT_TYPES[layer]
        assert (line.gu_type, line.d_type) == (T[gu].id, T[d].id)


def test_experts_are_referenced_in_place(tmp_path):
    m = build(tmp_path)
    out = tmp_path / "pack"
    convert(m, out)
    expert_bytes_check(m, out, [(0, 0), (0, 3), (1, 2), (2, 1), (3, 3)])
    # never copied: the pool holds dense bytes only
    assert (out / "pool.bin").stat().st_size < sum(len(b) for b in m.data.values()) - len(m.data["blk.0.ffn_gate_exps.weight"])


def test_split_shards_any_one_finds_the_rest(tmp_path):
    m = build(tmp_path, n_shards=3, ple_separate=False)
    out = tmp_path / "pack"
    pack.convert([m.files[1]], out)  # the middle shard: the others are found by name
    man = read_manifest(out / "manifest.txt")
    # the shard holding the PLE table is the `ple` source
    assert [(s.role, s.name) for s in man.sources] == [("main", m.files[0].name), ("shard", m.files[1].name),
                                                       ("ple", m.files[2].name)]
    ne = read_native_experts(out / "native_experts.txt")
    assert ne.gguf == m.files[0].name
    assert {l.shard for l in ne.layers} - {None}, "later layers live in later shards"
    expert_bytes_check(m, out, [(l, e) for l in range(4) for e in (0, 3)])
    ple = read_ple_table(out / "ple_table.txt", row_dim=16, rows=40)
    assert ple.shard == m.files[-1].name
    assert pack.verify_pack(out).ok
    # the PLE shard named twice (a shard of the split and --ple-gguf, as the engine's flags take it): one file
    pack.convert([m.files[0]], tmp_path / "pack2", ple_gguf=m.files[2])
    assert read_manifest(tmp_path / "pack2" / "manifest.txt").sources == man.sources


def test_ple_table_is_referenced_in_its_shard(tmp_path):
    m = build(tmp_path)
    out = tmp_path / "pack"
    convert(m, out)
    t = read_ple_table(out / "ple_table.txt", row_dim=16, rows=40)
    assert (t.name, t.shard, t.type_id) == ("per_layer_token_embd.weight", m.ple.name, T["BF16"].id)
    raw, table = m.ple.read_bytes(), m.data["per_layer_token_embd.weight"]
    for r in (0, 17, 39):  # served by offset: row r at offset + r * row_bytes
        assert raw[t.offset + r * t.row_bytes : t.offset + (r + 1) * t.row_bytes] == table[r * 32 : (r + 1) * 32]
    assert "per_layer_token_embd.weight" not in {e.name for e in read_index(out / "index.txt").tensors}


def test_ple_shard_missing_says_to_pass_it(tmp_path):
    m = build(tmp_path)
    with pytest.raises(GeometryError, match="per_layer_token_embd.weight.*--ple-gguf"):
        pack.convert(m.files, tmp_path / "pack")
    no_leftovers(tmp_path / "pack")


def test_a_gguf_without_a_chat_template_is_reported(tmp_path, capsys):
    from strata.tools.gguf_io import read_gguf

    src = read_gguf(build(tmp_path, "qwen35moe").files[0])
    dst = tmp_path / "no-template.gguf"
    w = GGUFWriter(dst)
    w.kv = {k: v for k, v in src.kv.items() if k != "tokenizer.chat_template"}
    for name, t in src.tensors.items():
        w.add_tensor(name, t.shape, t.type_id, lambda name=name: np.asarray(src.tensor_bytes(name)))
    w.write()
    assert main(["convert", str(dst), "-o", str(tmp_path / "pack")]) == 0
    err = capsys.readouterr().err
    assert "warning: the GGUF has no tokenizer.chat_template: strata generate --chat is refused for this pack" in err
    assert read_tokenizer(tmp_path / "pack" / "tokenizer.txt").chat_template is None


def test_all_zero_compress_ratios_warn_and_need_the_ratio(tmp_path, capsys):
    m = build(tmp_path, meta=[(0, 0, 0, 0)])
    out = tmp_path / "pack"
    with pytest.raises(GeometryError, match="--compress-ratio"):
        convert(m, out)
    args = ["convert", *map(str, m.files), "--ple-gguf", str(m.ple), "-o", str(out), "--compress-ratio", "4"]
    assert main(args) == 0
    cap = capsys.readouterr()
    assert "warning: attention.compress_ratios is all zeros" in cap.err
    assert "all zeros" not in cap.out and "## experts" in cap.out
    assert read_geometry(out / "geometry.txt").idx_compress_ratio == 4


# --- bad input: clear error, nothing written ------------------------------------------------------


def test_truncated_gguf(tmp_path):
    m = build(tmp_path, "qwen35moe")
    data = m.files[0].read_bytes()
    m.files[0].write_bytes(data[: len(data) - 100])
    with pytest.raises(GGUFError, match=r"qwen35moe-tiny.gguf: tensor \S+ needs bytes .*truncated"):
        convert(m, tmp_path / "pack")
    assert not (tmp_path / "pack").exists()
    no_leftovers(tmp_path / "pack")


def test_wrong_architecture(tmp_path):
    m = build(tmp_path, "qwen35moe")
    data = m.files[0].read_bytes()
    m.files[0].write_bytes(data.replace(b"qwen35moe", b"llama3xyz", 1))  # general.architecture's value
    with pytest.raises(GeometryError, match="general.architecture is 'llama3xyz'; Strata runs qwen4exp, qwen35moe"):
        convert(m, tmp_path / "pack")
    assert not (tmp_path / "pack").exists()


def test_wrong_shape_names_tensor_found_and_required(tmp_path, capsys):
    m = build(tmp_path, shape_over={"blk.3.indexer.k_proj.weight": (64, 64)})  # 2 key heads: one is required
    out = tmp_path / "pack"
    args = ["convert", str(m.files[0]), "--ple-gguf", str(m.ple), "-o", str(out)]
    assert main(args) == 1
    err = capsys.readouterr().err
    assert "tensor blk.3.indexer.k_proj.weight has shape [64, 64], the geometry requires [64, 32]" in err
    assert not out.exists()
    no_leftovers(out)


def _set_type(path: Path, tensor: str, new_type: int) -> None:
    """Patch a tensor's type id in the GGUF header (GGUFWriter refuses unknown types)."""
    data = bytearray(path.read_bytes())
    name = tensor.encode()
    at = data.index(struct.pack("<Q", len(name)) + name) + 8 + len(name)
    n_dims = struct.unpack_from("<I", data, at)[0]
    struct.pack_into("<I", data, at + 4 + 8 * n_dims, new_type)
    path.write_bytes(bytes(data))


def test_unknown_block_type_names_tensor_and_number(tmp_path, capsys):
    m = build(tmp_path, "qwen35moe")
    _set_type(m.files[0], "blk.2.ffn_down_exps.weight", 99)
    assert main(["convert", str(m.files[0]), "-o", str(tmp_path / "pack")]) == 1
    err = capsys.readouterr().err
    assert "tensor blk.2.ffn_down_exps.weight: unknown GGML type 99" in err
    assert not (tmp_path / "pack").exists()


def test_gate_and_up_types_must_agree(tmp_path):
    m = build(tmp_path, "qwen35moe", type_over={"blk.1.ffn_up_exps.weight": "Q8_0"})
    with pytest.raises(pack.PackError, match=r"layer 1: blk.1.ffn_gate_exps.weight is Q2_0 \(42\) but blk.1.ffn_up_exps.weight is Q8_0 \(8\)"):
        convert(m, tmp_path / "pack")


def test_missing_shard_is_named(tmp_path):
    m = build(tmp_path, "qwen35moe", n_shards=2)
    m.files[1].unlink()
    with pytest.raises(pack.PackError, match=r"qwen35moe-tiny-00002-of-00002.gguf: missing.*shard 2 of 2"):
        pack.convert([m.files[0]], tmp_path / "pack")


def test_shards_must_agree_on_split_count(tmp_path):
    m = build(tmp_path, "qwen35moe", n_shards=2)
    other = build(subdir(tmp_path, "x"), "qwen35moe", n_shards=3)
    os.replace(other.files[1], m.files[1])  # says split.count 3 under a name of 2
    with pytest.raises(pack.PackError, match=r"qwen35moe-tiny-00002-of-00002.gguf: split.count is 3, expected 2"):
        pack.convert([m.files[0]], tmp_path / "pack")


def test_tensor_in_two_shards(tmp_path):
    m = build(tmp_path, "qwen35moe")
    dup = tmp_path / "dup.gguf"
    w = GGUFWriter(dup)
    w.add_tensor("per_layer_token_embd.weight", (16, 4), 0, lambda: bytes(256))
    w.add_tensor("output.weight", (64, 48), 0, lambda: bytes(64 * 48 * 4))
    w.write()
    with pytest.raises(pack.PackError, match="tensor output.weight is in both qwen35moe-tiny.gguf and dup.gguf"):
        pack.convert(m.files, tmp_path / "pack", ple_gguf=dup)


# --- overwrite, --force, interruption -------------------------------------------------------------


def test_refuses_to_overwrite_without_force(tmp_path, capsys):
    m = build(tmp_path, "qwen35moe")
    out = tmp_path / "pack"
    convert(m, out)
    before = (out / "manifest.txt").read_bytes()
    assert main(["convert", str(m.files[0]), "-o", str(out)]) == 1
    assert "exists; pass --force" in capsys.readouterr().err
    assert (out / "manifest.txt").read_bytes() == before


def test_force_replaces_only_a_pack(tmp_path):
    m = build(tmp_path, "qwen35moe")
    notpack = tmp_path / "home"
    notpack.mkdir()
    (notpack / "thesis.tex").write_text("precious")
    with pytest.raises(pack.PackError, match="not a pack.*refusing to replace it even with --force"):
        convert(m, notpack, force=True)
    assert (notpack / "thesis.tex").read_text() == "precious"


def test_force_keeps_the_old_pack_when_conversion_fails(tmp_path, monkeypatch):
    old = build(subdir(tmp_path, "a"), "qwen35moe", seed=1)
    new = build(tmp_path, "qwen35moe", seed=2)
    out = tmp_path / "pack"
    convert(old, out)
    files = {p.name: p.read_bytes() for p in out.iterdir()}

    def boom(*a, **k):
        raise OSError("disk full (simulated)")

    monkeypatch.setattr(pack, "write_tokenizer", boom)  # after pool.bin and index.txt are written
    with pytest.raises(OSError, match="simulated"):
        convert(new, out, force=True)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == files
    no_leftovers(out)
    monkeypatch.undo()
    convert(new, out, force=True)  # and with nothing failing, --force does replace it
    assert (out / "pool.bin").read_bytes() != files["pool.bin"]
    assert pack.verify_pack(out).ok
    no_leftovers(out)


@pytest.mark.parametrize("exc", [KeyboardInterrupt, RuntimeError])
def test_interrupted_run_leaves_nothing_pack_like(tmp_path, monkeypatch, exc):
    m = build(tmp_path, "qwen35moe")
    out = tmp_path / "pack"
    real = pack._pack_chunks
    seen = []

    def interrupt_midway(src, info):
        seen.append(info.name)
        if len(seen) == 5:
            raise exc("simulated")
        return real(src, info)

    monkeypatch.setattr(pack, "_pack_chunks", interrupt_midway)
    with pytest.raises(exc):
        convert(m, out)
    assert len(seen) == 5 and not out.exists()
    no_leftovers(out)


def test_cli_interrupt_says_so(tmp_path, monkeypatch, capsys):
    m = build(tmp_path, "qwen35moe")

    def interrupt(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(pack, "write_index", interrupt)
    assert main(["convert", str(m.files[0]), "-o", str(tmp_path / "pack")]) == 130
    assert "interrupted" in capsys.readouterr().err
    assert not (tmp_path / "pack").exists()
    no_leftovers(tmp_path / "pack")


# --- verify ---------------------------------------------------------------------------------------


def test_verify_reports_a_changed_gguf_by_name(tmp_path, capsys):
    m = build(tmp_path)
    out = tmp_path / "pack"
    convert(m, out)
    assert main(["verify", str(out)]) == 0
    assert f"{out}: OK" in capsys.readouterr().out
    recorded = {s.name: s for s in read_manifest(out / "manifest.txt").sources}
    # same size, one byte of an expert changed (a re-quantized file)
    data = bytearray(m.files[0].read_bytes())
    data[-10] ^= 0xFF
    m.files[0].write_bytes(bytes(data))
    assert main(["verify", str(out)]) == 1
    err = capsys.readouterr().err
    rec = recorded[m.files[0].name].fingerprint
    assert f"source main {m.files[0].name} changed since packing" in err
    assert f"fingerprint recorded {rec}, found fp1-" in err and "NOT OK" in err
    # a PLE shard that grew
    with open(m.ple, "ab") as f:
        f.write(b"\0" * 64)
    assert main(["verify", str(out)]) == 1
    err = capsys.readouterr().err
    size = recorded[m.ple.name].size
    assert f"source ple {m.ple.name} changed since packing ({m.ple}): size recorded {size}, found {size + 64}" in err


def test_verify_finds_moved_ggufs_with_gguf_dir(tmp_path, capsys):
    m = build(tmp_path, "qwen35moe")
    out = tmp_path / "pack"
    convert(m, out)
    moved = tmp_path / "moved"
    moved.mkdir()
    os.replace(m.files[0], moved / m.files[0].name)
    assert main(["verify", str(out)]) == 1
    assert "not found at" in capsys.readouterr().err
    assert main(["verify", str(out), "--gguf-dir", str(moved)]) == 0


def test_verify_full_hashes_the_pool(tmp_path, capsys):
    m = build(tmp_path, "qwen35moe")
    out = tmp_path / "pack"
    convert(m, out)
    data = bytearray((out / "pool.bin").read_bytes())
    data[100] ^= 1
    (out / "pool.bin").write_bytes(bytes(data))
    assert main(["verify", str(out)]) == 0  # size only by default
    capsys.readouterr()
    assert main(["verify", str(out), "--full"]) == 1
    assert "pool.bin: fingerprint recorded sha256-" in capsys.readouterr().err


def _edit_expert_line(out: Path, layer: int, field: int, delta: int) -> None:
    lines = (out / "native_experts.txt").read_text().splitlines()
    fields = lines[2 + layer].split(" ")
    fields[field] = str(int(fields[field]) + delta)
    lines[2 + layer] = " ".join(fields)
    (out / "native_experts.txt").write_text("\n".join(lines) + "\n")


def test_verify_reads_every_index_line(tmp_path, capsys):
    m = build(tmp_path, "qwen35moe")
    out = tmp_path / "pack"
    convert(m, out)
    _edit_expert_line(out, 1, 4, 18)  # blob_bytes: the strict reader refuses the line
    assert main(["verify", str(out)]) == 1
    assert "native_experts.txt line 4, field blob_bytes: found" in capsys.readouterr().err


def test_verify_checks_expert_offsets_against_the_gguf(tmp_path, capsys):
    m = build(tmp_path, "qwen35moe")
    out = tmp_path / "pack"
    convert(m, out)
    line = read_native_experts(out / "native_experts.txt").layers[3]
    _edit_expert_line(out, 3, 7, 64)  # an aligned, disjoint down_off: valid text, wrong bytes
    read_native_experts(out / "native_experts.txt", n_embd=64, n_ff=64)
    assert main(["verify", str(out)]) == 1
    err = capsys.readouterr().err
    assert (f"blk.3.ffn_down_exps.weight: recorded at {m.files[0].name} offset {line.down_off + 64} type 8, "
            f"found at {m.files[0].name} offset {line.down_off} type 8") in err
    assert "native_experts.txt: fingerprint recorded fp1-" in err


def test_verify_without_manifest_is_not_a_pack(tmp_path, capsys):
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / "pool.bin").write_bytes(b"\0" * 64)
    assert main(["verify", str(tmp_path / "half")]) == 1
    assert "no manifest.txt, so not a pack" in capsys.readouterr().err


# --- the summary ----------------------------------------------------------------------------------


def test_summary_counts_pack_and_engine_forms(tmp_path):
    m = build(tmp_path)
    out = tmp_path / "pack"
    convert(m, out)
    s = pack.summarize(pack.read_pack(out))
    dense = [sp for sp in tensor_specs(m.g) if sp.in_pool]
    assert sum(c for _, c, *_ in s.by_type) == len(dense)
    bf16 = [sp for sp in dense if m.types[sp.name] == T["BF16"].id]
    n_bf16 = sum(int(np.prod(sp.shape)) for sp in bf16)
    assert (s.bf16_pack_bytes, s.bf16_engine_bytes) == (4 * n_bf16, 2 * n_bf16)
    # fp16 scales: one per 32-element block for Q8_0 and Q4_0 (the only scaled dense types here)
    scaled = sum(int(np.prod(sp.shape)) // 32 for sp in dense if m.types[sp.name] in (T["Q8_0"].id, T["Q4_0"].id))
    assert (s.scale_plane_bytes, s.widened_bytes) == (4 * scaled, 2 * scaled)
    # engine form: BF16 back to its 2 source bytes, every fp16 scale 2 bytes wider, the rest as in the GGUF
    assert s.engine_bytes == sum(len(m.data[sp.name]) for sp in dense) + 2 * scaled
    assert s.expert_bytes == sum(len(m.data[sp.name]) for sp in tensor_specs(m.g) if sp.category == EXPERT)
    assert [(l, gu, d) for l, gu, d, *_ in s.expert_layers] == [(l, gu, d) for l, (gu, d) in enumerate(EXPERT_TYPES)]


# --- the two pack files this module adds: ple_table.txt and sources.txt ---------------------------


def test_ple_table_round_trip_and_refusals(tmp_path):
    p = tmp_path / "ple_table.txt"
    t = PleTable("m-00001-of-00002.gguf", "per_layer_token_embd.weight", T["Q8_0"].id, 64, 10, 4096, 10 * 68,
                 "m-00002-of-00002.gguf")
    write_ple_table(p, t)
    text = p.read_text()
    assert read_ple_table(p, row_dim=64, rows=10) == t and t.row_bytes == 68
    write_ple_table(p, read_ple_table(p))
    assert p.read_text() == text  # write -> read -> write is byte-identical
    line = text.splitlines()[2].split(" ")
    for i, value, field in [(5, "681", "nbytes"), (4, "4100", "offset"), (1, "99", "type"), (2, "48", "ne0")]:
        bad = line.copy()
        bad[i] = value
        p.write_text("\n".join(text.splitlines()[:2] + [" ".join(bad)]) + "\n")
        with pytest.raises(FormatError, match=rf"line 3, field {field}: found {value}"):
            read_ple_table(p)
    p.write_text(text)
    with pytest.raises(FormatError, match=r"line 3, field ne1: found 10, expected 11 \(the geometry"):
        read_ple_table(p, rows=11)
    p.write_text(text + text.splitlines()[2] + "\n")
    with pytest.raises(FormatError, match="line 4: .*one table line only"):
        read_ple_table(p)
    p.write_text(text.replace(" m-00002-of-00002.gguf", " m-00001-of-00002.gguf"))
    with pytest.raises(FormatError, match="field shard: .*no shard field for the main GGUF"):
        read_ple_table(p)


def test_sources_round_trip_and_refusals(tmp_path):
    p = tmp_path / "sources.txt"
    paths = {"a b é.gguf": "/data/models dir/a b é.gguf"}
    with pytest.raises(ValueError, match="a bare file name"):  # names are bare file names without spaces
        write_sources(p, paths)
    paths = {"m.gguf": "/data/models dir/ü/m.gguf", "ple.gguf": "/x/ple.gguf"}
    write_sources(p, paths)
    assert read_sources(p) == paths
    assert "%20" in p.read_text() and "%C3%BC" in p.read_text()
    with pytest.raises(ValueError, match="absolute path"):
        write_sources(p, {"m.gguf": "models/m.gguf"})
    p.write_text("# strata pack sources v1\nm.gguf %2Fx%2Fother.gguf\n")
    with pytest.raises(FormatError, match="line 2, field path: found '/x/other.gguf', expected a path whose last component is m.gguf"):
        read_sources(p)
    p.write_text("# strata pack sources v1\nm.gguf %2fx%2Fm.gguf\n")
    with pytest.raises(FormatError, match="line 2, field path"):  # one spelling: %XX uppercase
        read_sources(p)


# --- tools/synth.py's models, through the command line --------------------------------------------


@pytest.mark.parametrize("arch", ["qwen4exp", "qwen35moe"])
def test_synth_tiny_packs_and_verifies(tmp_path, arch, capsys):
    from strata.tools.gguf_io import read_gguf
    from strata.tools.synth import get_preset

    assert main(["synth", "--arch", arch, "--preset", "tiny", "-o", str(tmp_path / "m.gguf")]) == 0
    cap = capsys.readouterr()
    shards = [Path(p) for p in cap.out.split()]  # the paths written, one a line
    assert shards == [tmp_path / f"m-0000{i}-of-00002.gguf" for i in (1, 2)] and all(p.is_file() for p in shards)
    assert f"pack with: strata-pack convert {shards[0]} -o PACK\n" in cap.err
    out = tmp_path / "pack"
    assert main(["convert", str(shards[-1]), "-o", str(out)]) == 0  # no extra flag; the last shard finds the first
    assert "warning" not in capsys.readouterr().err
    if arch == "qwen4exp":
        assert read_geometry(out / "geometry.txt").idx_compress_ratio == get_preset("tiny").compress_ratio
    assert main(["verify", str(out), "--full"]) == 0
    files = {p.name: read_gguf(p) for p in shards}
    tensors = {n: (f, t) for f in files.values() for n, t in f.tensors.items()}
    pool = np.fromfile(out / "pool.bin", dtype=np.uint8)
    for e in read_index(out / "index.txt").tensors:
        f, t = tensors[e.name]
        src = np.asarray(f.tensor_bytes(e.name))
        got = pool[e.offset : e.offset + e.nbytes]
        if t.type_id == T["BF16"].id:
            assert np.array_equal(got.view("<u4") >> 16, src.view("<u2")) and not (got.view("<u4") & 0xFFFF).any()
        else:
            assert np.array_equal(got, src), e.name
    ne = read_native_experts(out / "native_experts.txt")
    n = ne.n_expert
    for line in ne.layers[:: 3]:
        raw = np.fromfile(tmp_path / (line.shard or ne.gguf), dtype=np.uint8)
        for role, off in (("gate", line.gate_off), ("up", line.up_off), ("down", line.down_off)):
            f, t = tensors[f"blk.{line.layer}.ffn_{role}_exps.weight"]
            whole, size = np.asarray(f.tensor_bytes(t.name)), t.nbytes // n
            for e in (0, n - 1):
                assert np.array_equal(raw[off + e * size : off + (e + 1) * size], whole[e * size : (e + 1) * size])


def test_synth_reproduces_the_converter_bug_only_when_asked(tmp_path, capsys):
    from strata.tools.synth import get_preset

    ratio = get_preset("tiny").compress_ratio
    assert main(["synth", "--arch", "qwen4exp", "-o", str(tmp_path / "z.gguf"), "--zero-compress-ratios"]) == 0
    cap = capsys.readouterr()
    first = cap.out.split()[0]
    assert f"pack with: strata-pack convert {first} -o PACK --compress-ratio {ratio}" in cap.err
    assert main(["convert", first, "-o", str(tmp_path / "p")]) == 1
    assert "attention.compress_ratios is all zeros" in capsys.readouterr().err
    assert main(["convert", first, "-o", str(tmp_path / "p"), "--compress-ratio", str(ratio)]) == 0
    assert "warning: attention.compress_ratios is all zeros" in capsys.readouterr().err


@pytest.mark.slow
def test_demo_builds_reuses_and_rebuilds(tmp_path, capsys):
    out = tmp_path / "packs" / "demo"
    assert main(["demo", "-o", str(out), "--no-generate"]) == 0
    first = capsys.readouterr()
    assert "## experts" in first.out and "warning" not in first.err
    assert sorted(p.name for p in (tmp_path / "packs" / "demo-src").iterdir()) == [
        "qwen4exp-demo-00001-of-00002.gguf", "qwen4exp-demo-00002-of-00002.gguf"]
    manifest = (out / "manifest.txt").read_bytes()
    assert main(["demo", "-o", str(out), "--no-generate"]) == 0  # idempotent: the verified pack is reused
    again = capsys.readouterr()
    assert "reusing it" in again.err and again.out == first.out
    assert (out / "manifest.txt").read_bytes() == manifest
    with open(tmp_path / "packs" / "demo-src" / "qwen4exp-demo-00002-of-00002.gguf", "ab") as f:
        f.write(b"\0" * 32)  # a source that changed: the pack no longer verifies
    assert main(["demo", "-o", str(out), "--no-generate"]) == 1
    err = capsys.readouterr().err
    assert "source ple qwen4exp-demo-00002-of-00002.gguf changed since packing" in err and "--force" in err
    # the README's main job: the rebuilt pack generates on the CPU (32 greedy tokens, with --stats)
    assert main(["demo", "-o", str(out), "--force"]) == 0
    assert pack.verify_pack(out).ok
    captured = capsys.readouterr()  # generated text on stdout, --stats on stderr
    assert "## strata generate (CPU)" in captured.out and "decode   32 tokens" in captured.err
    no_leftovers(out)

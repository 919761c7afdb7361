"""The flat file formats (docs/index-format.md): round trips, and every single-line corruption refused.

Round trips are properties (write -> read -> equal, write -> read -> write byte-identical). For
index.txt and native_experts.txt every data line is corrupted in every way one edit can corrupt it
(a field dropped, a number moved by one, the file cut at a line boundary, two lines swapped, a line
doubled) and the reader must refuse it at the right line. The few edits that still spell a valid
file are named, with the reason, and asserted to read as what they spell.
"""

from __future__ import annotations

import os
import pickle

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from strata.index_format.errors import FormatError
from strata.index_format.ggml_types import BY_ID, BY_NAME
from strata.index_format.hparams import HParam, read_hparams, to_hparam, write_hparams
from strata.index_format.manifest import (
    Manifest,
    PackFile,
    SourceFile,
    check_file,
    fingerprint_file,
    full_sha256,
    matches_fingerprint,
    pack_fingerprint,
    read_manifest,
    write_manifest,
)
from strata.index_format.native_experts import (
    NativeExperts,
    blob_bytes_for,
    expert_bytes,
    read_native_experts,
    write_native_experts,
)
from strata.index_format.pack_index import PackIndex, TensorEntry, read_index, write_index
from strata.index_format.tokenizer_flat import FlatTokenizer, read_tokenizer, write_tokenizer

FEW = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
SOME = settings(max_examples=60, deadline=None)

NAME_CHARS = "".join(chr(c) for c in range(0x21, 0x7F))
names = st.text(alphabet=NAME_CHARS, min_size=1, max_size=12)
file_names = names.filter(lambda s: "/" not in s and "\\" not in s and s not in (".", ".."))


@pytest.fixture(scope="module")
def scratch(tmp_path_factory):
    return tmp_path_factory.mktemp("flat")


def _put(directory, name: str, text: str):
    path = directory / name
    path.write_bytes(text.encode("ascii"))
    return path


def _refused(read, path, line: int | None = None) -> FormatError:
    """read(path) must raise FormatError naming the file (and `line`, when given)."""
    with pytest.raises(FormatError) as info:
        read(path)
    e = info.value
    assert os.path.basename(e.path) == path.name and path.name in str(e)
    if line is not None:
        assert e.line == line, f"expected line {line}: {e}"
        assert f"{path.name} line {line}" in str(e)
    return e


def _lines(path) -> list[str]:
    return path.read_text().split("\n")[:-1]


def _join(lines: list[str]) -> str:
    return "".join(x + "\n" for x in lines)


# --- errors ---------------------------------------------------------------------------------------


def test_format_error_reads_as_file_line_field_found_expected():
    e = FormatError("pack/index.txt", 7, "offset", 100, "a multiple of 64")
    assert str(e) == "pack/index.txt line 7, field offset: found 100, expected a multiple of 64"
    assert isinstance(e, ValueError)
    again = pickle.loads(pickle.dumps(FormatError("a.txt", 2, "x", "0x", "a decimal integer", "hint")))
    assert str(again) == "a.txt line 2, field x: found '0x', expected a decimal integer (hint)"


# --- index.txt ------------------------------------------------------------------------------------

INDEX_FIELDS = 17
NUMERIC = range(1, INDEX_FIELDS)  # every field but the name


@st.composite
def pack_indexes(draw, max_tensors=6):
    tensor_names = draw(st.lists(names, min_size=1, max_size=max_tensors, unique=True))
    specs = []
    for name in tensor_names:
        t = BY_ID[draw(st.sampled_from(sorted(BY_ID)))]
        rest = draw(st.lists(st.integers(1, 3), min_size=0, max_size=3))
        specs.append((name, t.id, [t.block_size * draw(st.integers(1, 3))] + rest))
    return PackIndex.build(draw(file_names), specs)


def test_index_derived_fields_by_hand():
    # Numbers worked out from ggml-common.h by hand, not by the code under test.
    # Q4_K 256x3: 3 blocks of 144 B (d, dmin fp16 at 0); engine: 140 + 2*4 = 148 B a block.
    # BF16 [5]: pack F32 5*4 = 20 B at 448 (432 rounded up to 64); engine BF16 5*2 = 10 B.
    # Q2_0 64x2: 2 blocks of 2 + 16 = 18 B; engine 16 + 4 = 20 B a block; at 512 (468 -> 512).
    idx = PackIndex.build("m.gguf", [("a", 12, (256, 3)), ("b", 30, (5,)), ("c", 42, (64, 2, 1))])
    assert [t.fields() for t in idx.tensors] == [
        dict(zip(FIELD_NAMES, ["a", 12, 12, 12, 0, 432, 444, 2, 256, 3, 1, 1, 256, 144, 0, 2, 2])),
        dict(zip(FIELD_NAMES, ["b", 0, 30, 30, 448, 20, 10, 1, 5, 1, 1, 1, 1, 4, 0, 0, 0])),
        dict(zip(FIELD_NAMES, ["c", 42, 42, 42, 512, 36, 40, 3, 64, 2, 1, 1, 64, 18, 0, 1, 2])),
    ]
    assert idx.pool_bytes == 576


FIELD_NAMES = (
    "name pack_type engine_type src_type offset nbytes engine_nbytes n_dims ne0 ne1 ne2 ne3 "
    "block_size block_bytes scale_off scale_count scale_width"
).split()


@SOME
@given(idx=pack_indexes())
def test_index_round_trip(scratch, idx):
    path = scratch / "index.txt"
    write_index(path, idx)
    first = path.read_bytes()
    back = read_index(path, pool_size=idx.pool_bytes)
    assert back == idx
    assert back.by_name() == {t.name: t for t in idx.tensors}
    write_index(path, back)
    assert path.read_bytes() == first
    assert not [p for p in os.listdir(scratch) if ".tmp-" in p]


def _same_bytes_other_n_dims(fields: list[str], new_n_dims: int) -> bool:
    """n_dims 2 over ne (a, b, 1, 1) and n_dims 3 describe the same bytes: (a, b) vs (a, b, 1)."""
    ne = [int(x) for x in fields[8:12]]
    return 1 <= new_n_dims <= 4 and all(d == 1 for d in ne[new_n_dims:])


@FEW
@given(idx=pack_indexes())
def test_index_every_single_line_corruption_is_refused(scratch, idx):
    good = scratch / "good_index.txt"
    write_index(good, idx)
    lines = _lines(good)
    path = scratch / "index.txt"
    for i in range(3, len(lines)):
        fields = lines[i].split(" ")
        # (a) one field dropped: the line has 16 fields
        for j in range(INDEX_FIELDS):
            _put(scratch, "index.txt", _join(lines[:i] + [" ".join(fields[:j] + fields[j + 1 :])] + lines[i + 1 :]))
            _refused(read_index, path, i + 1)
        # (b) one number moved: every field is implied by the others (type table, shape, previous line)
        for j in NUMERIC:
            deltas = (-1, 1, -64, 64) if FIELD_NAMES[j] == "offset" else (-1, 1)
            for delta in deltas:
                changed = fields[:j] + [str(int(fields[j]) + delta)] + fields[j + 1 :]
                _put(scratch, "index.txt", _join(lines[:i] + [" ".join(changed)] + lines[i + 1 :]))
                if FIELD_NAMES[j] == "n_dims" and _same_bytes_other_n_dims(fields, int(fields[j]) + delta):
                    # The one edit that stays valid: trailing dims of 1 name the same bytes; the
                    # shape then differs only by those 1s, and the engine's per-role shape check
                    # (S2) compares shapes, so it is caught at load.
                    got = read_index(path).tensors[i - 3].shape
                    assert got == tuple(int(x) for x in fields[8 : 8 + int(fields[j]) + delta])
                    continue
                _refused(read_index, path, i + 1)
    # (c) cut at every line boundary: a header line missing, or fewer tensors than the header says
    for k in range(len(lines)):
        _put(scratch, "index.txt", _join(lines[:k]))
        _refused(read_index, path, k + 1 if k < 3 else 3)
    for i in range(3, len(lines)):
        # (d) two adjacent lines swapped: the first of them is no longer at the previous end
        if i + 1 < len(lines):
            _put(scratch, "index.txt", _join(lines[:i] + [lines[i + 1], lines[i]] + lines[i + 2 :]))
            _refused(read_index, path, i + 1)
        # (e) a line doubled: its name again
        _put(scratch, "index.txt", _join(lines[: i + 1] + [lines[i]] + lines[i + 1 :]))
        e = _refused(read_index, path, i + 2)
        assert e.field == "name"


@FEW
@given(idx=pack_indexes(max_tensors=3))
def test_index_header_corruption_is_refused(scratch, idx):
    good = scratch / "good_index.txt"
    write_index(good, idx)
    lines = _lines(good)
    n, pool = len(idx.tensors), idx.pool_bytes
    edits = {
        1: [lines[0].replace("v3", "v2"), lines[0] + " ", lines[0].replace("iq_pack", "pack")],
        2: ["# from", "# from a b.gguf", "# from dir/m.gguf", "#from m.gguf"],
        3: [
            f"# align 32 pool {pool} tensors {n}",
            f"# align 64 pool {pool + 1} tensors {n}",
            f"# align 64 pool {pool + 64} tensors {n}",
            f"# align 64 pool {pool} tensors {n + 1}",
            f"# align 64 pool {pool} tensors {n - 1}",
            f"# align 64 pool {pool} tensors {n} ",
            f"# align 64 pool 0{pool} tensors {n}",
            f"# align 64 pool {pool}",
        ],
    }
    path = scratch / "index.txt"
    for no, variants in edits.items():
        for text in variants:
            _put(scratch, "index.txt", _join(lines[: no - 1] + [text] + lines[no:]))
            _refused(read_index, path, no)
    for no in (1, 2, 3):  # a header line missing: the next line is not what that line must be
        _put(scratch, "index.txt", _join(lines[: no - 1] + lines[no:]))
        _refused(read_index, path, no)


def test_index_message_names_file_line_field_found_and_expected(scratch):
    idx = PackIndex.build("m.gguf", [(f"t{i}", 0, (64,)) for i in range(5)])
    path = scratch / "index.txt"
    write_index(path, idx)
    lines = _lines(path)
    fields = lines[6].split(" ")
    fields[4] = "100"
    _put(scratch, "index.txt", _join(lines[:6] + [" ".join(fields)] + lines[7:]))
    e = _refused(read_index, path, 7)
    assert (e.field, e.found, e.expected) == ("offset", 100, "a multiple of 64")
    assert "index.txt line 7, field offset: found 100, expected a multiple of 64" in str(e)
    fields[4] = "1024"  # aligned, but not where line 6's tensor ends (768)
    _put(scratch, "index.txt", _join(lines[:6] + [" ".join(fields)] + lines[7:]))
    assert "index.txt line 7, field offset: found 1024, expected 768" in str(_refused(read_index, path, 7))


def test_index_pool_size_must_match_pool_bin(scratch):
    idx = PackIndex.build("m.gguf", [("a", 8, (32, 2))])
    path = scratch / "index.txt"
    write_index(path, idx)
    assert read_index(path, pool_size=128).pool_bytes == 128  # 2 * 34 = 68 B, rounded up to 128
    e = _refused(lambda p: read_index(p, pool_size=68), path, 3)
    assert (e.field, e.found, e.expected) == ("pool", 128, 68)


@pytest.mark.parametrize(
    "edit",
    [
        lambda t: t.replace("\n", "\r\n"),
        lambda t: t[:-1],  # no newline at the end
        lambda t: t.replace(" 0 ", "  0 ", 1),
        lambda t: t.replace("\n", "\n\n", 3),  # a blank line among the tensors
        lambda t: t.replace("a 8 8 8 0", "a 8 8 8 00"),
        lambda t: t.replace("a 8 8 8 0", "a 8 8 8 +0"),
        lambda t: t.replace("a 8", "a\t8"),
        lambda t: t.replace("a 8", "\u00e9 8"),
    ],
)
def test_index_refuses_non_canonical_text(scratch, edit):
    idx = PackIndex.build("m.gguf", [("a", 8, (32, 2)), ("b", 0, (3,))])
    path = scratch / "index.txt"
    write_index(path, idx)
    path.write_bytes(edit(path.read_text()).encode("utf-8"))
    _refused(read_index, path)


def test_index_objects_and_writer_refuse_invalid_content(scratch):
    with pytest.raises(ValueError, match="nbytes"):
        TensorEntry("a", 8, 8, 8, 0, 67, 72, (32, 2))
    with pytest.raises(ValueError, match="pack_type"):
        TensorEntry("a", 30, 30, 30, 0, 10, 10, (5,))  # a BF16 source is packed as F32
    with pytest.raises(ValueError, match="offset"):
        PackIndex("m.gguf", 256, (TensorEntry.make("a", 0, (16,), 0), TensorEntry.make("b", 0, (16,), 128)))
    path = scratch / "index.txt"
    good = PackIndex.build("m.gguf", [("a", 0, (16,)), ("b", 0, (16,))])
    write_index(path, good)
    before = path.read_bytes()
    bad = PackIndex.build("m.gguf", [("a", 0, (16,)), ("b", 0, (16,))])
    object.__setattr__(bad, "pool_bytes", 64)  # bypasses the dataclass check; the writer still refuses
    _refused(lambda p: write_index(p, bad), path, 3)
    assert path.read_bytes() == before


# --- native_experts.txt ---------------------------------------------------------------------------

SHARDS = (None, "m-00002-of-00003.gguf", "m-00003-of-00003.gguf")


@st.composite
def native_experts(draw):
    n_embd, n_ff = 256 * draw(st.integers(1, 2)), 256 * draw(st.integers(1, 2))
    n_expert = draw(st.integers(1, 3))
    layers = sorted(draw(st.sets(st.integers(0, 60), min_size=1, max_size=4)))
    cursor = {s: 32 * draw(st.integers(0, 3)) for s in SHARDS}  # GGUF data is 32-aligned
    rows = []
    for layer in layers:
        gu, d = (BY_ID[draw(st.sampled_from(sorted(BY_ID)))] for _ in range(2))
        shard = draw(st.sampled_from(SHARDS))
        sizes = [n_expert * b for b in expert_bytes(gu, d, n_embd, n_ff)]
        offs = [0, 0, 0]
        for role in draw(st.permutations([0, 1, 2])):  # any order in the file, with gaps
            offs[role] = cursor[shard] + 32 * draw(st.integers(0, 2))
            cursor[shard] = -(-(offs[role] + sizes[role]) // 32) * 32
        rows.append((layer, gu.id, d.id, sum(sizes) // n_expert, *offs, shard))
    return NativeExperts.build("m-00001-of-00003.gguf", n_expert, rows), n_embd, n_ff


def test_native_experts_seed_numbers():
    # The seed's own file (6.3) and the brief's expert sizes: n_embd 2560, n_ff 640, 512 experts.
    assert blob_bytes_for(BY_NAME["IQ2_XS"].id, BY_NAME["IQ4_NL"].id, 2560, 640) == 1_868_800
    assert blob_bytes_for(BY_NAME["IQ2_XXS"].id, BY_NAME["Q2_0"].id, 2560, 640) == 1_305_600
    ne = NativeExperts.build(
        "Qwen3.8-Flash-Next-GSQ-RCO-IQ3_XXS-00001-of-00002.gguf",
        512,
        [(0, 17, 20, 1868800, 1227833216, 1473813376, 755052416, None), (1, 16, 42, 1305600, 2016152832, 2235918592, 1779301632, None)],
    )
    assert ne.layers[1].offset == 956825600
    assert ne.total == 512 * (1868800 + 1305600)


def _read_native(geo):
    n_embd, n_ff, n_expert, layers = geo
    return lambda p: read_native_experts(p, n_embd=n_embd, n_ff=n_ff, n_expert=n_expert, layers=layers)


@SOME
@given(case=native_experts())
def test_native_experts_round_trip(scratch, case):
    ne, n_embd, n_ff = case
    path = scratch / "native_experts.txt"
    write_native_experts(path, ne, n_embd=n_embd, n_ff=n_ff)
    first = path.read_bytes()
    back = _read_native((n_embd, n_ff, ne.n_expert, [e.layer for e in ne.layers]))(path)
    assert back == ne == read_native_experts(path)
    assert back.total == sum(ne.n_expert * e.blob_bytes for e in ne.layers)
    for e in ne.layers:
        assert back.shard_of(e.layer) == (e.shard or ne.gguf)
    write_native_experts(path, back)
    assert path.read_bytes() == first


@FEW
@given(case=native_experts())
def test_native_experts_every_single_line_corruption_is_refused(scratch, case):
    ne, n_embd, n_ff = case
    geo = (n_embd, n_ff, ne.n_expert, [e.layer for e in ne.layers])
    read = _read_native(geo)
    good = scratch / "good_native.txt"
    write_native_experts(good, ne)
    lines = _lines(good)
    path = scratch / "native_experts.txt"
    for i in range(2, len(lines)):
        fields = lines[i].split(" ")
        # (a) one field dropped. Dropping the optional shard leaves a valid line that points into the
        # main GGUF: only the manifest's fingerprint of this file catches that (test below).
        for j in range(8):
            _put(scratch, path.name, _join(lines[:i] + [" ".join(fields[:j] + fields[j + 1 :])] + lines[i + 1 :]))
            _refused(read, path, i + 1)
        # (b) one number moved by one: layers are given, types fix blob_bytes (no two adjacent
        # type ids have the same bytes per 256 elements), offset is a running sum, and the GGUF
        # offsets are multiples of 8 (the GGUF alignment is).
        for j in range(8):
            for delta in (-1, 1):
                changed = fields[:j] + [str(int(fields[j]) + delta)] + fields[j + 1 :]
                _put(scratch, path.name, _join(lines[:i] + [" ".join(changed)] + lines[i + 1 :]))
                _refused(read, path, i + 1)
    # (c) cut at every line boundary: header missing, no layer, or a total the lines do not add to
    for k in range(len(lines)):
        _put(scratch, path.name, _join(lines[:k]))
        _refused(read, path, k + 1 if k < 3 else 2)
        _refused(read_native_experts, path, k + 1 if k < 3 else 2)
    for i in range(2, len(lines)):
        # (d) two adjacent lines swapped, read with and without the geometry
        if i + 1 < len(lines):
            _put(scratch, path.name, _join(lines[:i] + [lines[i + 1], lines[i]] + lines[i + 2 :]))
            _refused(read, path, i + 1)
            _refused(read_native_experts, path, i + 1)
        # (e) a line doubled
        _put(scratch, path.name, _join(lines[: i + 1] + [lines[i]] + lines[i + 1 :]))
        _refused(read, path, i + 2)
        _refused(read_native_experts, path, i + 2)


def test_native_experts_dropped_shard_is_caught_by_the_manifest_fingerprint(scratch):
    ne = NativeExperts.build("m.gguf", 2, [(0, 8, 8, 3264, 0, 2176, 4352, "s.gguf")])
    path = scratch / "native_experts.txt"
    write_native_experts(path, ne, n_embd=32, n_ff=32)
    fp = fingerprint_file(path)
    path.write_text(path.read_text().replace(" s.gguf", ""))
    assert read_native_experts(path, n_embd=32, n_ff=32).shard_of(0) == "m.gguf"  # valid by itself
    assert not matches_fingerprint(path, fp)


@FEW
@given(case=native_experts())
def test_native_experts_header_corruption_is_refused(scratch, case):
    ne, n_embd, n_ff = case
    good = scratch / "good_native.txt"
    write_native_experts(good, ne)
    lines = _lines(good)
    counts = lines[1]
    variants = {
        1: [lines[0].replace("v3", "v2"), lines[0].replace(" [shard]", "")],
        2: [
            counts.replace(f"n_expert {ne.n_expert},", f"n_expert {ne.n_expert + 1},"),
            counts.replace(f"n_expert {ne.n_expert},", f"n_expert {ne.n_expert - 1},"),
            counts.replace(f"total {ne.total};", f"total {ne.total + 1};"),
            counts.replace(f"total {ne.total};", f"total {ne.total - 1};"),
            counts.replace(f"total {ne.total};", f"total 0{ne.total};"),
            counts.replace(f"in {ne.gguf},", "in a/b.gguf,"),
            counts.replace("beside it)", "beside it"),
        ],
    }
    path = scratch / "native_experts.txt"
    for no, texts in variants.items():
        for text in texts:
            _put(scratch, path.name, _join(lines[: no - 1] + [text] + lines[no:]))
            _refused(read_native_experts, path)  # n_expert +-1 shows at the first offset or the total


def test_native_experts_overlapping_ranges_are_refused(scratch):
    # One Q8_0 expert of n_embd = n_ff = 32: gate = up = down = 32 rows * 34 B = 1088 B; 2 experts: 2176 B.
    e = 2176
    cases = {
        "gate over up": [(0, 8, 8, 3264, 0, e - 8, 3 * e, None)],
        "down over an earlier layer": [(0, 8, 8, 3264, 0, e, 2 * e, None), (1, 8, 8, 3264, 3 * e, 4 * e, 2 * e + 8, None)],
    }
    path = scratch / "native_experts.txt"
    for rows in cases.values():
        lines = ["# strata native experts v3: layer gu_type d_type offset blob_bytes gate_off up_off down_off [shard]"]
        total = 2 * 3264 * len(rows)
        lines.append(f"# (n_expert 2, total {total}; absolute offsets in m.gguf, or in the named shard beside it)")
        lines += [" ".join(map(str, (r[0], r[1], r[2], 2 * 3264 * k, *r[3:7]))) for k, r in enumerate(rows)]
        _put(scratch, path.name, _join(lines))
        read_native_experts(path)  # without the geometry the split of blob_bytes is unknown
        _refused(lambda p: read_native_experts(p, n_embd=32, n_ff=32), path, len(lines))
    # The same offsets in two different files do not overlap.
    ne = NativeExperts.build("m.gguf", 2, [(0, 8, 8, 3264, 0, e, 2 * e, None), (1, 8, 8, 3264, 0, e, 2 * e, "s.gguf")])
    write_native_experts(path, ne, n_embd=32, n_ff=32)


def test_native_experts_message_names_everything(scratch):
    ne = NativeExperts.build("m.gguf", 2, [(0, 8, 8, 3264, 0, 2176, 4352, None), (1, 8, 8, 3264, 6528, 8704, 10880, None)])
    path = scratch / "native_experts.txt"
    write_native_experts(path, ne)
    path.write_text(path.read_text().replace("1 8 8 6528 3264", "1 8 8 6528 3265"))
    e = _refused(lambda p: read_native_experts(p, n_embd=32, n_ff=32), path, 4)
    assert "native_experts.txt line 4, field blob_bytes: found 3265, expected 3264" in str(e)


# --- geometry.txt ---------------------------------------------------------------------------------

keys = st.from_regex(r"[A-Za-z_][A-Za-z0-9_.\-]{0,12}", fullmatch=True)
finite = st.floats(allow_nan=False, allow_infinity=False)
plain_values = st.one_of(
    st.integers(-(2**63), 2**64 - 1),
    finite,
    st.text(min_size=1, max_size=20),
    st.booleans(),
    st.lists(st.integers(-(2**63), 2**63 - 1), min_size=1, max_size=4).map(tuple),
    st.lists(finite, min_size=1, max_size=4).map(tuple),
    st.lists(st.booleans(), min_size=1, max_size=4).map(tuple),
    st.lists(st.integers(0, 2**64 - 1), max_size=4).map(lambda v: HParam("u64", tuple(v))),
    st.lists(st.integers(-5, 5), max_size=0).map(lambda v: HParam("i64", tuple(v))),
)


@SOME
@given(values=st.dictionaries(keys, plain_values, max_size=8))
def test_hparams_round_trip(scratch, values):
    path = scratch / "geometry.txt"
    write_hparams(path, values)
    first = path.read_bytes()
    back = read_hparams(path)
    assert back == {k: to_hparam(k, v) for k, v in values.items()}
    for k, v in back.items():  # integers stay ints, floats stay the same double
        assert all(type(x) is {"i64": int, "u64": int, "f64": float, "str": str, "bool": bool}[v.kind] for x in v.values)
    write_hparams(path, back)
    assert path.read_bytes() == first


def test_hparams_u64_above_2_53_is_exact(scratch):
    mults = (0x9E3779B97F4A7C15, 2**53 + 1, 2**64 - 1)  # not representable as doubles
    path = scratch / "geometry.txt"
    write_hparams(path, {"ple.hash_mult": HParam("u64", mults), "n": 2**63, "eps": 1e-6})
    back = read_hparams(path)
    assert back["ple.hash_mult"].values == mults
    assert back["n"] == HParam("u64", (2**63,)) and back["n"].scalar() == 2**63
    assert back["eps"].scalar() == 1e-6
    with pytest.raises(ValueError):
        back["ple.hash_mult"].scalar()


@pytest.mark.parametrize(
    "line, field",
    [
        ("a i64 1 5\na i64 1 5", "key"),  # duplicate, reported on the second
        ("a i64 2 5", "count"),
        ("a i64 1 5 6", "count"),
        ("a i64 1 9223372036854775808", "value[0]"),
        ("a i64 1 -9223372036854775809", "value[0]"),
        ("a i64 1 -0", "value[0]"),
        ("a i64 1 05", "value[0]"),
        ("a u64 1 18446744073709551616", "value[0]"),
        ("a u64 1 -1", "value[0]"),
        ("a f64 1 1.5", "value[0]"),  # decimal: only float.hex() spellings are accepted
        ("a f64 1 0x1.8p+0", "value[0]"),  # 1.5, but not as float.hex() writes it
        ("a f64 1 inf", "value[0]"),
        ("a f64 1 nan", "value[0]"),
        ("a str 1 a%2", "value[0]"),
        ("a str 1 a%2f", "value[0]"),  # lowercase escape
        ("a str 1 %41", "value[0]"),  # 'A' escaped needlessly
        ("a str 1 %FF", "value[0]"),  # not UTF-8
        ("a str 2 x y", "count"),
        ("a bool 1 2", "value[0]"),
        ("a i32 1 5", "kind"),
        ("9a i64 1 5", "key"),
        ("a i64 x", "count"),
    ],
)
def test_hparams_refuses(scratch, line, field):
    path = _put(scratch, "geometry.txt", f"# strata geometry v1\nb bool 1 1\n{line}\n")
    e = _refused(read_hparams, path, 2 + line.count("\n") + 1)
    assert e.field == field


def test_hparams_writer_refuses_ambiguous_values(scratch):
    for bad in ({"a": (1, 2.0)}, {"a": ()}, {"a": (2**63,)}, {"a": float("nan")}, {"a": ""}, {"a b": 1}, {"a": None}):
        with pytest.raises(ValueError):
            write_hparams(scratch / "geometry.txt", bad)


# --- tokenizer.txt --------------------------------------------------------------------------------


@st.composite
def tokenizers(draw):
    tokens = draw(st.lists(st.binary(max_size=6), min_size=1, max_size=12))
    n = len(tokens)
    special = draw(st.dictionaries(st.sampled_from(["bos", "eos", "pad", "unk"]), st.integers(0, n - 1)))
    return FlatTokenizer(
        "gpt2",
        draw(names),
        tuple(tokens),
        tuple(draw(st.lists(st.integers(1, 6), min_size=n, max_size=n))),
        tuple(draw(st.lists(st.tuples(st.binary(min_size=1, max_size=4), st.binary(min_size=1, max_size=4)), max_size=8))),
        special,
        draw(st.booleans()),
        draw(st.none() | st.text(min_size=1, max_size=40)),
    )


@SOME
@given(t=tokenizers())
def test_tokenizer_round_trip(scratch, t):
    path = scratch / "tokenizer.txt"
    write_tokenizer(path, t)
    first = path.read_bytes()
    back = read_tokenizer(path)
    assert back == t
    write_tokenizer(path, back)
    assert path.read_bytes() == first


TOKENIZER = (
    "# strata tokenizer v1\nmodel gpt2\npre qwen2\ntokens 3\n0 1 61\n1 3 3c2f733e\n2 1 -\n"
    "merges 1\n61 62\nspecial bos 1\nspecial eos 1\nadd_bos 1\nchat_template 7b7b7d7d\n"
)


def test_tokenizer_reads_the_documented_example(scratch):
    t = read_tokenizer(_put(scratch, "tokenizer.txt", TOKENIZER))
    assert t.tokens == (b"a", b"</s>", b"") and t.token_types == (1, 3, 1)
    assert t.merges == ((b"a", b"b"),) and t.special == {"bos": 1, "eos": 1}
    assert t.add_bos is True and t.chat_template == "{{}}"


@pytest.mark.parametrize(
    "old, new, line",
    [
        ("1 3 3c2f733e", "2 3 3c2f733e", 6),  # ids not dense
        ("1 3 3c2f733e", "1 3 3C2F733E", 6),  # uppercase hex
        ("1 3 3c2f733e", "1 3 3c2f733", 6),  # odd length
        ("1 3 3c2f733e", "1 7 3c2f733e", 6),  # token type unknown
        ("tokens 3", "tokens 4", 8),  # one token line short: 'merges 1' read as a token
        ("merges 1\n", "merges 2\n", 10),
        ("special bos 1", "special bos 3", 10),  # id out of range
        ("special bos 1\nspecial eos 1", "special eos 1\nspecial bos 1", 11),  # order
        ("special bos 1\nspecial eos 1", "special bos 1\nspecial bos 1", 11),
        ("special bos 1", "special cls 1", 10),
        ("add_bos 1", "add_bos 2", 12),
        ("model gpt2", "model spm", 2),
        ("7b7b7d7d", "ff", 13),  # not UTF-8
        ("7b7b7d7d\n", "7b7b7d7d\nextra\n", 14),
        ("add_bos 1\n", "", 12),
    ],
)
def test_tokenizer_refuses(scratch, old, new, line):
    assert old in TOKENIZER
    _refused(read_tokenizer, _put(scratch, "tokenizer.txt", TOKENIZER.replace(old, new)), line)


# --- manifest.txt ---------------------------------------------------------------------------------

fingerprints = st.builds(lambda p, h: f"{p}-{h:064x}", st.sampled_from(["fp1", "sha256"]), st.integers(0, 2**256 - 1))


@st.composite
def manifests(draw):
    source_names = draw(st.lists(file_names, min_size=1, max_size=4, unique=True))
    roles = ["main"] + ["shard"] * (len(source_names) - 1)
    if len(roles) > 1 and draw(st.booleans()):
        roles[-1] = "ple"
    sizes = st.integers(0, 2**50)
    sources = tuple(SourceFile(r, draw(sizes), draw(fingerprints), n) for r, n in zip(roles, source_names))
    file_list = draw(st.lists(file_names.filter(lambda s: s != "manifest.txt"), max_size=5, unique=True))
    return Manifest(sources, tuple(PackFile(n, draw(sizes), draw(fingerprints)) for n in file_list))


@SOME
@given(m=manifests())
def test_manifest_round_trip(scratch, m):
    path = scratch / "manifest.txt"
    write_manifest(path, m)
    first = path.read_bytes()
    assert read_manifest(path) == m
    write_manifest(path, read_manifest(path))
    assert path.read_bytes() == first


FP = "fp1-" + "ab" * 32


@pytest.mark.parametrize(
    "body, line",
    [
        (f"source shard 5 {FP} a.gguf\n", 2),  # no main first
        (f"source main 5 {FP} a.gguf\nsource main 5 {FP} b.gguf\n", 3),
        (f"source main 5 {FP} a.gguf\nsource ple 5 {FP} b.gguf\nsource ple 5 {FP} c.gguf\n", 4),
        (f"source main 5 {FP} a.gguf\nsource shard 5 {FP} a.gguf\n", 3),
        (f"source main 5 {FP} a.gguf\nfile pool.bin 5 {FP}\nfile pool.bin 5 {FP}\n", 4),
        (f"source main 5 {FP} a.gguf\nfile pool.bin 5 {FP}\nsource shard 5 {FP} b.gguf\n", 4),
        (f"source main 5 {FP} a.gguf\nfile manifest.txt 5 {FP}\n", 3),
        (f"source main 5 {FP[:-1]} a.gguf\n", 2),
        (f"source main 5 md5-{'ab' * 32} a.gguf\n", 2),
        (f"source main 5 {FP} dir/a.gguf\n", 2),
        (f"source main -5 {FP} a.gguf\n", 2),
        (f"file pool.bin 5 {FP}\n", 2),
        ("", 2),
    ],
)
def test_manifest_refuses(scratch, body, line):
    _refused(read_manifest, _put(scratch, "manifest.txt", "# strata pack manifest v1\n" + body), line)


def test_fingerprint_is_sampled_and_catches_what_it_promises(scratch):
    size = 20 * (1 << 20) + 12345  # past 256 * 64 KiB, so the samples leave gaps
    data = bytearray(os.urandom(size))
    path = scratch / "big.gguf"
    path.write_bytes(data)
    fp, sha = fingerprint_file(path), full_sha256(path)
    assert fp.startswith("fp1-") and sha.startswith("sha256-") and fingerprint_file(path) == fp

    def changed(at: int | None = None, cut: int = 0) -> tuple[str, str]:
        d = bytearray(data)
        if at is not None:
            d[at] ^= 0xFF
        path.write_bytes(d[: len(d) - cut])
        return fingerprint_file(path), full_sha256(path)

    assert changed(at=100)[0] != fp  # the header
    assert changed(at=size - 10)[0] != fp  # the tail
    assert changed(cut=1)[0] != fp  # truncation
    assert changed(at=(size - (64 << 10)) * 128 // 255 + 7)[0] != fp  # inside a sample
    # Between two samples, past the first MiB: the sampled fingerprint cannot see it, sha256 does.
    gap = (size - (64 << 10)) * 100 // 255 + (64 << 10) + 10
    assert gap < (size - (64 << 10)) * 101 // 255 and gap > 1 << 20
    fp_gap, sha_gap = changed(at=gap)
    assert fp_gap == fp and sha_gap != sha
    assert check_file(path, size, sha) is not None and check_file(path, size, fp) is None
    assert "bytes" in check_file(path, size + 1, fp) and "missing" in check_file(scratch / "none", 1, fp)


def test_pack_fingerprint_follows_layout_and_sources_not_names(tmp_path):
    for name, text in (("index.txt", "i\n"), ("native_experts.txt", "n\n"), ("geometry.txt", "g\n"), ("tokenizer.txt", "t\n")):
        (tmp_path / name).write_text(text)
    fp_a, fp_b = "fp1-" + "a" * 64, "fp1-" + "b" * 64

    def with_source(fingerprint: str, name: str) -> str:
        write_manifest(tmp_path / "manifest.txt", Manifest((SourceFile("main", 10, fingerprint, name),), ()))
        return pack_fingerprint(tmp_path)

    base = with_source(fp_a, "m.gguf")
    assert base.startswith("pk1-") and base == with_source(fp_a, "renamed.gguf")
    assert with_source(fp_b, "m.gguf") != base
    (tmp_path / "tokenizer.txt").write_text("other\n")
    assert with_source(fp_a, "m.gguf") == base
    (tmp_path / "index.txt").write_text("j\n")
    assert with_source(fp_a, "m.gguf") != base

"""expert-profile.bin and the routing trace (docs/index-format.md): round trips as properties, and every
corruption refused with the file, the byte offset and the field.

Files are made here from random routing; expected values are computed in the test (ranked with
Python's sort, counted with loops), never taken from the code under test.
"""

from __future__ import annotations

import pickle
import struct
import zlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from strata.index_format.errors import BinaryFormatError, FormatError
from strata.index_format.expert_profile import (
    HEADER_BYTES,
    ExpertProfile,
    read_expert_profile,
    write_expert_profile,
)
from strata.index_format.routing_trace import TraceWriter, RoutingTrace, read_trace, write_trace

FP = "pk1-" + "0123456789abcdef" * 4
OTHER = "pk1-" + "fedcba9876543210" * 4
SOME = settings(max_examples=40, deadline=None)


def random_trace(rng, tokens=20, layers=3, experts=8, k=2, fp=FP) -> RoutingTrace:
    rows = [rng.choice(experts, k, replace=False) for _ in range(tokens * layers)]
    ids = np.array(rows, dtype=np.int64).reshape(tokens, layers, k)
    return RoutingTrace(fp, experts, ids)


def refix_crc(data: bytearray, header_bytes: int) -> bytearray:
    """Recompute the trailer, so a test reaches the field check behind the CRC."""
    body = bytes(data[header_bytes:-4])
    data[-4:] = zlib.crc32(bytes(data[:header_bytes]), zlib.crc32(body)).to_bytes(4, "little")
    return data


@st.composite
def count_matrices(draw):
    layers, experts = draw(st.integers(1, 5)), draw(st.integers(1, 9))
    m = np.array(draw(st.lists(st.integers(0, 1000), min_size=layers * experts, max_size=layers * experts)))
    m = m.reshape(layers, experts)
    if not m.any():
        m[0, 0] = 1
    top_k = draw(st.integers(1, experts))
    tokens = -(-int(m.sum(axis=1).max()) // top_k) + draw(st.integers(0, 3))
    return m, tokens, top_k


@SOME
@given(case=count_matrices())
def test_profile_round_trip_and_rank_order(case, tmp_path_factory):
    m, tokens, top_k = case
    p = ExpertProfile.from_counts(FP, m, tokens=tokens, top_k=top_k)
    expect = sorted(((-int(m[l, e]), l, e) for l in range(m.shape[0]) for e in range(m.shape[1]) if m[l, e]))
    assert [(-int(r["count"]), int(r["layer"]), int(r["expert"])) for r in p.records] == expect
    assert np.array_equal(p.count_matrix(), m)
    path = tmp_path_factory.mktemp("p") / "expert-profile.bin"
    write_expert_profile(path, p)
    first = path.read_bytes()
    assert len(first) == HEADER_BYTES + 12 * len(expect) + 4
    back = read_expert_profile(path, pack_fingerprint=FP, n_layer=m.shape[0], n_expert=m.shape[1], top_k=top_k)
    assert back == p and back.tokens == tokens
    write_expert_profile(path, back)
    assert path.read_bytes() == first  # write -> read -> write is byte-identical


def test_profile_header_bytes_as_documented(tmp_path):
    p = ExpertProfile.from_counts(FP, np.array([[3, 0, 1], [0, 2, 2]]), tokens=2, top_k=2)
    write_expert_profile(tmp_path / "p.bin", p)
    d = (tmp_path / "p.bin").read_bytes()
    assert d[:8] == b"STRATAEP" and struct.unpack_from("<IIIIQQ", d, 8) == (1, 2, 3, 2, 2, 4)
    assert d[40:108] == FP.encode()
    recs = [struct.unpack_from("<HHQ", d, 108 + 12 * i) for i in range(4)]
    assert recs == [(0, 0, 3), (1, 1, 2), (1, 2, 2), (0, 2, 1)]
    assert struct.unpack("<I", d[-4:])[0] == zlib.crc32(d[:108], zlib.crc32(d[108:-4]))


@pytest.fixture
def profile_file(tmp_path):
    rng = np.random.default_rng(7)
    p = random_trace(rng, tokens=30, layers=3, experts=8, k=2).to_profile()
    path = tmp_path / "expert-profile.bin"
    write_expert_profile(path, p)
    return path


def test_every_single_byte_change_is_refused(profile_file):
    good = profile_file.read_bytes()
    for i in range(len(good)):
        bad = bytearray(good)
        bad[i] ^= 0x5A
        profile_file.write_bytes(bad)
        with pytest.raises(BinaryFormatError) as e:
            read_expert_profile(profile_file)
        assert str(profile_file) in str(e.value) and e.value.offset is not None


def test_every_truncation_and_extension_is_refused(profile_file):
    good = profile_file.read_bytes()
    for n in range(len(good)):
        profile_file.write_bytes(good[:n])
        with pytest.raises(BinaryFormatError, match="truncated file|found the end of the file"):
            read_expert_profile(profile_file)
    profile_file.write_bytes(good + b"\0")
    with pytest.raises(BinaryFormatError, match=f"at byte {len(good)}.*trailing bytes"):
        read_expert_profile(profile_file)


def _edit(path, offset, fmt, value, header=HEADER_BYTES):
    d = bytearray(path.read_bytes())
    struct.pack_into(fmt, d, offset, value)
    path.write_bytes(refix_crc(d, header))


@pytest.mark.parametrize("offset, fmt, value, field, expected", [
    (8, "<I", 2, "version", "1"),
    (12, "<I", 0, "n_layer", "1..65536"),
    (16, "<I", 70000, "n_expert", "1..65536"),
    (20, "<I", 9, "top_k", "1..n_expert = 8"),
    (24, "<Q", 0, "tokens", "1.."),
    (32, "<Q", 0, "n_records", "1..n_layer"),
    (108 + 4, "<Q", 0, "count", "1..60"),  # tokens * top_k = 60
    (108, "<H", 3, "layer", "0..2"),
    (108 + 2, "<H", 8, "expert", "0..7"),
])
def test_each_field_checked_behind_the_crc(profile_file, offset, fmt, value, field, expected):
    _edit(profile_file, offset, fmt, value)
    with pytest.raises(BinaryFormatError) as e:
        read_expert_profile(profile_file)
    assert (e.value.offset, e.value.field) == (offset, field) and expected in str(e.value.expected), str(e.value)


def test_rank_order_and_duplicates_refused(profile_file):
    good = bytearray(profile_file.read_bytes())
    r0, r1 = good[108:120], good[120:132]
    swapped = bytearray(good)
    swapped[108:120], swapped[120:132] = r1, r0
    profile_file.write_bytes(refix_crc(swapped, HEADER_BYTES))
    with pytest.raises(BinaryFormatError, match="ranked count descending") as e:
        read_expert_profile(profile_file)
    assert e.value.offset in (120, 122, 124)
    doubled = bytearray(good)
    doubled[120:132] = r0
    profile_file.write_bytes(refix_crc(doubled, HEADER_BYTES))
    with pytest.raises(BinaryFormatError, match="each pair once"):
        read_expert_profile(profile_file)


def test_layer_total_cannot_exceed_tokens_times_top_k(tmp_path):
    p = ExpertProfile.from_counts(FP, np.array([[2, 2], [1, 0]]), tokens=2, top_k=2)
    write_expert_profile(tmp_path / "p.bin", p)
    _edit(tmp_path / "p.bin", 24, "<Q", 1)  # 1 token x top_k 2 = 2 uses, layer 0 counts 4
    with pytest.raises(BinaryFormatError, match="layer 0's counts sum to 4") as e:
        read_expert_profile(tmp_path / "p.bin")
    assert (e.value.offset, e.value.field) == (24, "tokens")
    with pytest.raises(ValueError, match="layer 0's counts sum to 4"):
        ExpertProfile.from_counts(FP, np.array([[2, 2]]), tokens=1, top_k=2)


def test_profile_of_another_pack_refused_naming_both(profile_file):
    with pytest.raises(BinaryFormatError) as e:
        read_expert_profile(profile_file, pack_fingerprint=OTHER)
    assert FP in str(e.value) and OTHER in str(e.value) and e.value.offset == 40
    with pytest.raises(BinaryFormatError, match="field n_expert"):
        read_expert_profile(profile_file, n_expert=9)


def test_foreign_file_and_bad_fingerprint(profile_file):
    good = profile_file.read_bytes()
    profile_file.write_bytes(b"GGUF" + good[4:])
    with pytest.raises(BinaryFormatError, match="at byte 0, field magic.*not a Strata expert profile"):
        read_expert_profile(profile_file)
    bad = bytearray(good)
    bad[44] = ord("G")  # not lowercase hex
    profile_file.write_bytes(refix_crc(bad, HEADER_BYTES))
    with pytest.raises(BinaryFormatError, match="at byte 40, field pack_fingerprint"):
        read_expert_profile(profile_file)


def test_in_memory_profile_checked_like_the_file():
    recs = [(0, 1, 5), (0, 0, 6)]  # not ranked
    with pytest.raises(ValueError, match="ranked"):
        ExpertProfile(FP, 1, 2, 1, 20, recs)
    with pytest.raises(ValueError, match="pack fingerprint"):
        ExpertProfile("pk1-xyz", 1, 2, 1, 20, [(0, 0, 6)])
    with pytest.raises(ValueError, match="non-negative integers"):
        ExpertProfile.from_counts(FP, np.array([[1, -1]]), tokens=1, top_k=1)


def test_errors_pickle_and_stay_format_errors(profile_file):
    profile_file.write_bytes(profile_file.read_bytes()[:50])
    with pytest.raises(BinaryFormatError) as e:
        read_expert_profile(profile_file)
    again = pickle.loads(pickle.dumps(e.value))
    assert isinstance(again, FormatError) and str(again) == str(e.value) and again.offset == 50


def test_writer_leaves_nothing_on_failure(tmp_path, monkeypatch):
    p = ExpertProfile.from_counts(FP, np.array([[1, 2]]), tokens=3, top_k=1)
    import strata.index_format._binary as B

    def boom(*a):
        raise OSError("disk full")

    monkeypatch.setattr(B.os, "fsync", boom)
    with pytest.raises(OSError, match="disk full"):
        write_expert_profile(tmp_path / "p.bin", p)
    assert list(tmp_path.iterdir()) == []


# --- the routing trace ------------------------------------------------------------------------------


@SOME
@given(seed=st.integers(0, 2**32 - 1), tokens=st.integers(0, 12), layers=st.integers(1, 4),
       experts=st.integers(1, 10), data=st.data())
def test_trace_round_trip_and_counts(seed, tokens, layers, experts, data, tmp_path_factory):
    k = data.draw(st.integers(1, experts))
    t = random_trace(np.random.default_rng(seed), tokens, layers, experts, k)
    path = tmp_path_factory.mktemp("t") / "trace.bin"
    write_trace(path, t)
    assert path.stat().st_size == 100 + 2 * tokens * layers * k + 4
    assert read_trace(path, pack_fingerprint=FP) == t
    if tokens:
        counts = np.zeros((layers, experts), np.int64)
        for tok in t.ids:
            for l in range(layers):
                for e in tok[l]:
                    counts[l, e] += 1
        p = t.to_profile()
        assert np.array_equal(p.count_matrix(), counts)
        assert p.layer_totals() == [tokens * k] * layers and p.tokens == tokens


def test_trace_streamed_equals_written_at_once(tmp_path):
    t = random_trace(np.random.default_rng(3), tokens=9)
    write_trace(tmp_path / "a.bin", t)
    with TraceWriter(tmp_path / "b.bin", pack_fingerprint=FP, n_layer=3, n_expert=8, top_k=2) as w:
        for tok in t.ids[:4]:
            w.append(tok)  # one token at a time, as the engine produces them
        w.append(t.ids[4:])
    assert (tmp_path / "a.bin").read_bytes() == (tmp_path / "b.bin").read_bytes()


def test_trace_writer_interrupted_leaves_nothing(tmp_path):
    with pytest.raises(RuntimeError):
        with TraceWriter(tmp_path / "t.bin", pack_fingerprint=FP, n_layer=1, n_expert=4, top_k=1) as w:
            w.append(np.array([[1]]))
            raise RuntimeError("interrupted")
    assert list(tmp_path.iterdir()) == []
    with TraceWriter(tmp_path / "t.bin", pack_fingerprint=FP, n_layer=1, n_expert=4, top_k=2) as w:
        with pytest.raises(BinaryFormatError, match="not already chosen"):
            w.append(np.array([[3, 3]]))
        with pytest.raises(ValueError, match=r"\[tokens, 1, 2\]"):
            w.append(np.array([[1, 2, 3]]))
        with pytest.raises(BinaryFormatError, match="an expert id in 0..3"):
            w.append(np.array([[1, 70000]]))  # would wrap to a valid-looking u16 if cast first


def test_trace_corruption_refused(tmp_path):
    path = tmp_path / "t.bin"
    write_trace(path, random_trace(np.random.default_rng(5), tokens=4, layers=2, experts=6, k=3))
    good = path.read_bytes()
    for i in range(len(good)):
        bad = bytearray(good)
        bad[i] ^= 0x01
        path.write_bytes(bad)
        with pytest.raises(BinaryFormatError):
            read_trace(path)
    for n in range(0, len(good), 7):
        path.write_bytes(good[:n])
        with pytest.raises(BinaryFormatError, match="truncated"):
            read_trace(path)


def test_trace_ids_checked_behind_the_crc(tmp_path):
    path = tmp_path / "t.bin"
    write_trace(path, RoutingTrace(FP, 6, np.array([[[0, 1, 2], [3, 4, 5]]])))
    d = bytearray(path.read_bytes())
    struct.pack_into("<H", d, 100 + 2 * 4, 6)  # token 0, layer 1, choice 1 -> id 6 of 6 experts
    path.write_bytes(refix_crc(d, 100))
    with pytest.raises(BinaryFormatError, match="token 0, layer 1, choice 1") as e:
        read_trace(path)
    assert (e.value.offset, e.value.field) == (108, "ids")
    struct.pack_into("<H", d, 108, 3)  # a duplicate in the row
    path.write_bytes(refix_crc(d, 100))
    with pytest.raises(BinaryFormatError, match="top-k picks distinct experts"):
        read_trace(path)
    write_trace(path, RoutingTrace(FP, 6, np.array([[[0, 1, 2], [3, 4, 5]]])))
    with pytest.raises(BinaryFormatError, match="recorded on another pack") as e:
        read_trace(path, pack_fingerprint=OTHER)
    assert FP in str(e.value) and OTHER in str(e.value)

"""tools/gguf_io against PyPI gguf's own writer and reader (the format's reference implementation)."""

import gguf
import numpy as np
import pytest

from strata.tools.gguf_io import VT, GGUFError, GGUFWriter, read_gguf, shard_names


def _reference_file(path):
    w = gguf.GGUFWriter(str(path), "qwen35moe")
    w.add_uint32("qwen35moe.block_count", 4)
    w.add_float32("qwen35moe.rope.freq_base", 1e7)
    w.add_string("general.name", "tiny ✓")
    w.add_array("qwen35moe.attention.compress_ratios", [0, 0, 0, 4])
    w.add_bool("tokenizer.ggml.add_bos_token", False)
    w.add_key_value("big", [2**63 + 5, 2**53 + 1], gguf.GGUFValueType.ARRAY, sub_type=gguf.GGUFValueType.UINT64)
    rng = np.random.default_rng(0)
    a = rng.standard_normal((3, 64), dtype=np.float32)
    w.add_tensor("a.weight", a)
    q = gguf.quants.quantize(a, gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("q.weight", q, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    return a, q


def test_reads_what_gguf_py_writes(tmp_path):
    p = tmp_path / "ref.gguf"
    a, q = _reference_file(p)
    f = read_gguf(p)
    assert f.get("qwen35moe.block_count") == 4 and f.kv["qwen35moe.block_count"].type == VT.UINT32
    assert f.get("general.name") == "tiny ✓"
    assert f.get("qwen35moe.attention.compress_ratios") == [0, 0, 0, 4]
    assert f.get("big") == [2**63 + 5, 2**53 + 1] and all(isinstance(x, int) for x in f.get("big"))
    assert f.tensors["a.weight"].shape == (64, 3)
    assert np.array_equal(np.asarray(f.tensor_bytes("a.weight")).view(np.float32).reshape(3, 64), a)
    assert bytes(f.tensor_bytes("q.weight")) == q.tobytes()


def test_gguf_py_reads_what_we_write(tmp_path):
    p = tmp_path / "ours.gguf"
    w = GGUFWriter(p)
    w.add("general.architecture", "qwen35moe", VT.STRING)
    w.add("x.ids", [1, 2, 3], VT.ARRAY, VT.INT32)
    data = np.arange(128, dtype=np.float32)
    w.add_tensor("t", (64, 2), 0, lambda: data)
    w.write()
    r = gguf.GGUFReader(str(p))
    t = r.tensors[0]
    assert t.name == "t" and list(t.shape) == [64, 2]
    assert np.array_equal(np.asarray(t.data).ravel(), data)
    assert read_gguf(p).get("x.ids") == [1, 2, 3]


def test_type_42_q2_0_round_trip(tmp_path):
    # PyPI gguf does not know type 42; our reader must.
    p = tmp_path / "q2.gguf"
    w = GGUFWriter(p)
    raw = np.random.default_rng(1).integers(0, 256, size=18 * 4, dtype=np.uint8)
    w.add_tensor("e", (128, 2), 42, lambda: raw)
    w.write()
    f = read_gguf(p)
    assert f.tensors["e"].type_id == 42 and f.tensors["e"].nbytes == 72
    assert bytes(f.tensor_bytes("e")) == raw.tobytes()


def test_truncated_file_names_the_tensor(tmp_path):
    p = tmp_path / "t.gguf"
    _reference_file(p)
    data = p.read_bytes()
    (tmp_path / "cut.gguf").write_bytes(data[:-40])
    with pytest.raises(GGUFError, match=r"cut.gguf: tensor q.weight needs bytes .* \(truncated\?\)"):
        read_gguf(tmp_path / "cut.gguf")
    (tmp_path / "head.gguf").write_bytes(data[:40])
    with pytest.raises(GGUFError, match=r"head.gguf: at byte \d+: truncated"):
        read_gguf(tmp_path / "head.gguf")
    (tmp_path / "bad.gguf").write_bytes(b"GGML" + data[4:])
    with pytest.raises(GGUFError, match="bad magic"):
        read_gguf(tmp_path / "bad.gguf")


def test_unknown_type_is_refused_by_name(tmp_path):
    p = tmp_path / "u.gguf"
    w = GGUFWriter(p)
    w.add_tensor("ok", (32,), 0, lambda: np.zeros(32, np.float32))
    w.write()
    data = bytearray(p.read_bytes())
    # the tensor info ends with type u32 + offset u64; poke the type to 99
    i = data.index(b"ok") + 2 + 4 + 8
    data[i : i + 4] = (99).to_bytes(4, "little")
    (tmp_path / "u2.gguf").write_bytes(bytes(data))
    with pytest.raises(GGUFError, match=r"u2.gguf: tensor ok: unknown GGML type 99"):
        read_gguf(tmp_path / "u2.gguf")


def test_writer_refuses_wrong_byte_count_and_leaves_nothing(tmp_path):
    p = tmp_path / "w.gguf"
    w = GGUFWriter(p)
    w.add_tensor("t", (32,), 0, lambda: np.zeros(31, np.float32))
    with pytest.raises(ValueError, match="producer gave 124 bytes, type and shape need 128"):
        w.write()
    assert list(tmp_path.iterdir()) == []


def test_shard_names(tmp_path):
    got = shard_names(tmp_path / "m-00002-of-00003.gguf")
    assert [g.name for g in got] == [f"m-0000{i}-of-00003.gguf" for i in (1, 2, 3)]
    assert shard_names(tmp_path / "plain.gguf") == [tmp_path / "plain.gguf"]

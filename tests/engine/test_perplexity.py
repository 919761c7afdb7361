"""`strata perplexity`: windows, PPL and its uncertainty, --save-logits / --kl-base, and the strict
reader of the KL base file (index_format/kl_base.py), on engine_fixture's tiny qwen35moe.

The perplexity is checked against one computed here independently: each window's logits from
`strata generate --dump-logits` (token by token, f32 KV), log-softmax in float64 by hand."""

from __future__ import annotations

import re
import struct
import zlib

import numpy as np
import pytest

import engine_fixture as F
from strata.engine import perplexity as P
from strata.engine.cli import main
from strata.engine.kernels import cpu
from strata.engine.tokenizer import Tokenizer
from strata.index_format import kl_base as K
from strata.index_format.errors import BinaryFormatError

CTX = 48
TEXT = ("The prompt path feeds a chunk of tokens at once; the decode path feeds one. Both must agree, "
        "and a quantized model is judged by how far its distributions move from its base model's. ") * 3


@pytest.fixture(autouse=True)
def restore_threads():
    before = cpu.threads_cap()
    yield
    cpu.set_threads(before)


@pytest.fixture(scope="module")
def packs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ppl")
    text = tmp / "text.txt"
    text.write_text(TEXT, encoding="utf-8")
    # the same seed's values: F32 experts, and Q8_0 experts (another quantization of one model)
    return F.make_pack(tmp, "f32"), F.make_pack(tmp, "q8", types={"experts": "Q8_0"}), text


def ppl(pack, text, *args):
    return main(["perplexity", "--pack", str(pack), "--file", str(text), "--ctx", str(CTX), "--pool-workers", "1", *args])


def printed(out: str, label: str) -> tuple[float, float]:
    m = re.search(rf"{re.escape(label)}\s+=?\s*([-+0-9.e]+) \+/- ([-+0-9.e]+)", out)
    assert m, out
    return float(m.group(1)), float(m.group(2))


def test_perplexity_is_exp_mean_nll_of_the_dumped_logits(packs, tmp_path, capsys):
    pack, _, text = packs
    ids = Tokenizer.load(pack / "tokenizer.txt").encode(TEXT)
    n_win = len(ids) // CTX
    assert n_win >= 3
    nll = []
    for w in range(n_win):
        window = ids[w * CTX : (w + 1) * CTX]
        dump = tmp_path / f"w{w}.npy"
        # the window minus its last token as the prompt, one greedy token: logits of positions 0..CTX-2
        assert main(["generate", "--pack", str(pack), "--pool-workers", "1", "--prompt-ids", " ".join(map(str, window[:-1])),
                     "-n", "1", "--temp", "0", "--kv", "f32", "--prefill", "off", "--dump-logits", str(dump)]) == 0
        x = np.load(dump).astype(np.float64)
        assert x.shape[0] == CTX - 1
        lse = x.max(axis=1) + np.log(np.exp(x - x.max(axis=1, keepdims=True)).sum(axis=1))
        first = CTX // 2  # llama.cpp's: the second half of each window is scored
        nll += [lse[p] - x[p, window[p + 1]] for p in range(first, CTX - 1)]
    capsys.readouterr()
    want = np.exp(np.mean(nll))
    want_err = want * np.std(nll, ddof=1) / np.sqrt(len(nll))
    for prefill in ("off", "16"):
        assert ppl(pack, text, "--kv", "f32", "--prefill", prefill) == 0
        out = capsys.readouterr().out
        got, err = printed(out, "PPL")
        assert got == pytest.approx(want, abs=1e-4 + 1e-5 * want)  # printed to 4 decimals
        assert err == pytest.approx(want_err, abs=1e-4 + 1e-5 * want_err)
        assert f"({len(nll)} tokens scored)" in out


def test_kl_against_its_own_logits_is_zero_to_the_storage_step_and_not_against_another_quantization(packs, tmp_path, capsys):
    f32, q8, text = packs
    base = tmp_path / "base.bin"
    assert ppl(f32, text, "--kv", "f32", "--save-logits", str(base)) == 0
    capsys.readouterr()
    b = K.read_kl_base(base)
    wins = P.windows(Tokenizer.load(f32 / "tokenizer.txt").encode(TEXT), CTX)
    assert np.array_equal(b.tokens, wins) and b.first == CTX // 2 and b.n_scored == CTX - 1 - CTX // 2
    # renormalised stored rows are within `step` of the true log-probs, so KL <= (e^step - 1)^2 (chi^2 bound)
    bound = float(np.expm1(b.records["step"].max()) ** 2)
    assert ppl(f32, text, "--kv", "f32", "--kl-base", str(base)) == 0
    out = capsys.readouterr().out
    kl_max = float(re.search(r"maximum KLD\s+(\S+)", out).group(1))
    assert 0 <= kl_max <= bound and "same top-1 token       100.000" in out
    assert abs(printed(out, "mean ln(PPL/PPL_base)")[0]) < 1e-5
    assert ppl(q8, text, "--kv", "f32", "--kl-base", str(base)) == 0
    other = capsys.readouterr().out
    median = float(re.search(r"median KLD\s+(\S+)", other).group(1))
    assert median > 100 * bound  # most positions, not a few, clearly above the storage's own error


def test_a_base_from_other_tokens_or_ctx_is_refused(packs, tmp_path, capsys):
    f32, _, text = packs
    base = tmp_path / "base.bin"
    assert ppl(f32, text, "--kv", "f32", "--save-logits", str(base), "--windows", "2") == 0
    other = tmp_path / "other.txt"
    other.write_text(TEXT.replace("prompt", "sample"), encoding="utf-8")
    capsys.readouterr()
    assert ppl(f32, other, "--kl-base", str(base), "--windows", "2") == 1
    assert "saved from other tokens" in capsys.readouterr().err
    assert main(["perplexity", "--pack", str(f32), "--file", str(text), "--ctx", "32", "--kl-base", str(base)]) == 1
    assert "saved with --ctx-size 48, this run has --ctx-size 32" in capsys.readouterr().err
    short = tmp_path / "short.txt"
    short.write_text("too short", encoding="utf-8")
    assert ppl(f32, short) == 1
    assert "fewer than one window of --ctx-size 48" in capsys.readouterr().err


# --- the file format ----------------------------------------------------------------------------------


def small_base(path, rng, *, n_vocab=11, n_ctx=6, n_windows=2):
    tokens = rng.integers(0, n_vocab, (n_windows, n_ctx))
    first = n_ctx // 2
    with K.KLBaseWriter(path, tokens=tokens, first=first, n_vocab=n_vocab, pack_fingerprint="pk1-" + "ab" * 32) as w:
        for win in tokens:
            x = rng.standard_normal((n_ctx - 1 - first, n_vocab)) * 3
            lp = P.log_softmax(x.astype(np.float32))
            nxt = win[first + 1 :]
            w.append(lp, lp.argmax(axis=1), -lp[np.arange(len(nxt)), nxt])
    return tokens


def rewrite(path, offset, data):
    """Patch bytes and recompute the CRC: the record checks, not the CRC, must refuse it."""
    raw = bytearray(path.read_bytes())
    raw[offset : offset + len(data)] = data
    end = len(raw) - 4
    crc = zlib.crc32(bytes(raw[K.HEADER_BYTES : end]))
    raw[end:] = zlib.crc32(bytes(raw[: K.HEADER_BYTES]), crc).to_bytes(4, "little")
    path.write_bytes(bytes(raw))


def test_kl_base_round_trip_and_strict_reader(tmp_path):
    rng = np.random.default_rng(5)
    path = tmp_path / "b.bin"
    tokens = small_base(path, rng)
    b = K.read_kl_base(path)
    assert np.array_equal(b.tokens, tokens) and b.records.shape == (2, 2)
    rec_size = K.record_dtype(11).itemsize
    rec0 = K.HEADER_BYTES + tokens.size * 4
    good = path.read_bytes()
    cases = [
        (lambda: path.write_bytes(good[:-5]), "truncated file"),
        (lambda: path.write_bytes(good + b"\0"), "trailing bytes"),
        (lambda: path.write_bytes(good[:200] + bytes([good[200] ^ 1]) + good[201:]), "field crc32"),
        (lambda: path.write_bytes(b"STRATAXX" + good[8:]), "field magic"),
        (lambda: rewrite(path, 8, struct.pack("<I", 2)), "field version: found 2"),
        (lambda: rewrite(path, 20, struct.pack("<I", 5)), "field first: found 5, expected 0..n_ctx - 2 = 4"),
        (lambda: rewrite(path, K.HEADER_BYTES + 4, struct.pack("<i", 11)), "field tokens: found 11"),
        (lambda: rewrite(path, rec0, struct.pack("<I", 11)), "field top1: found 11"),
        (lambda: rewrite(path, rec0 + rec_size + 4, struct.pack("<f", 0.5)), "field nll: found 0.5"),
        (lambda: rewrite(path, rec0 + 12, struct.pack("<f", -1.0)), "field step"),
    ]
    for damage, message in cases:
        path.write_bytes(good)
        damage()
        with pytest.raises(BinaryFormatError, match=re.escape(message)):
            K.read_kl_base(path)
    # a writer that fails leaves nothing behind
    with pytest.raises(ValueError, match="0 records written, the header promises 6"):
        with K.KLBaseWriter(tmp_path / "c.bin", tokens=tokens, first=2, n_vocab=11, pack_fingerprint="pk1-" + "ab" * 32):
            pass
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b.bin"]


def _poison(pack, tensor: str, value=np.nan) -> None:
    """Write `value` into the first element of an F32 tensor in pool.bin (size unchanged, so only
    `strata-pack verify --full` would notice)."""
    from strata.index_format.pack_index import read_index

    t = next(t for t in read_index(pack / "index.txt").tensors if t.name == tensor)
    with open(pack / "pool.bin", "r+b") as f:
        f.seek(t.offset)
        f.write(np.float32(value).tobytes())


@pytest.mark.bad_input("non-finite")
@pytest.mark.parametrize("with_base", [False, True])
def test_non_finite_logits_are_refused_not_scored(packs, tmp_path, capsys, with_base):
    good, _, text = packs
    args = []
    if with_base:
        base = tmp_path / "base.bin"
        assert ppl(good, text, "--save-logits", str(base)) == 0
        args = ["--kl-base", str(base)]
    bad = F.make_pack(tmp_path, "nan")
    _poison(bad, "output_norm.weight")
    capsys.readouterr()
    assert ppl(bad, text, *args) == 1
    out, err = capsys.readouterr()
    assert "PPL" not in out and "nan" not in out
    assert "window 0, position 24: the model's logit of token 0 is nan" in err
    assert "the pack's weights hold non-finite values: output_norm.weight: element 0 is nan" in err

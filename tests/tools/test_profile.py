"""strata-profile (tools/profile.py, tools/profile_cli.py): routing counts -> expert-profile.bin.

Models: synth's `tiny` qwen4exp and qwen35moe (skewed routers), with every tensor stored as F32
holding its dequantized values. Two reasons: the block-quantized tiny models compile a dozen Numba
kernels (about 45 s on the shared CI cores, past this file's budget), and with F32 weights the
batched prompt path and the token path route every position identically, so the counts can be
compared exactly. (With block-quantized weights each path quantizes its own activations, and a
float32 rounding difference can flip a router near-tie: measured on the quantized tiny qwen4exp,
26 of 7200 routed uses moved between the paths.)

Every count here is recomputed independently of the tool: a token-by-token engine run of the same
documents with MoE.route patched at class level, which records each position's experts.
"""

from __future__ import annotations

import contextlib
import io
import math
import re

import engine_fixture as F
import numpy as np
import pytest

from strata.engine.expert_plan import ProfileMismatch, check_profile, expected_hit_rate
from strata.engine.model import Model
from strata.engine.moe import MoE
from strata.engine.pack_reader import Pack
from strata.engine.tokenizer import Tokenizer
from strata.index_format.expert_profile import ExpertProfile, read_expert_profile
from strata.index_format.manifest import pack_fingerprint
from strata.index_format.routing_trace import read_trace
from strata.tools import profile as P
from strata.tools.profile_cli import main

ARCHS = ("qwen4exp", "qwen35moe")
N_DOCS = 10
HELD_OUT = 0.2
HELD_DOCS = [2, 7]  # h = round(10 * 0.2) = 2 documents, at floor((j + 1/2) * 10 / 2) for j = 0, 1
CTX = 48  # shorter than the longest documents: they run as several windows
WORDS = ("the expert router picks a few hot experts for most tokens while cold ones wait on the cpu "
         "memory slots fill once at startup and never change profile counts decide which stay").split()


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py



@pytest.fixture(scope="module")
def packs(tmp_path_factory):
    from strata.tools.pack import convert
    from strata.tools.synth import PRESETS, synth

    out = {}
    for arch in ARCHS:
        d = tmp_path_factory.mktemp(arch)
        (d / "src").mkdir()
        (d / "f32").mkdir()
        shards = [F.dequantized_copy(p, d / "f32" / p.name) for p in synth(arch, "tiny", d / "src" / "tiny.gguf")]
        ratio = PRESETS["tiny"].compress_ratio if arch == "qwen4exp" else None
        convert(shards[:1], d / "pack", compress_ratio=ratio)
        out[arch] = d / "pack"
    return out


def documents(seed: int = 0) -> list[str]:
    """N_DOCS paragraphs of 6..40 words; some span two lines."""
    rng = np.random.default_rng(seed)
    docs = []
    for i in range(N_DOCS):
        words = [WORDS[j] for j in rng.integers(0, len(WORDS), int(rng.integers(6, 40)))]
        cut = len(words) // 2
        docs.append(" ".join(words[:cut]) + ("\n" if i % 3 == 0 else " ") + " ".join(words[cut:]))
    return docs


def write_prompts(path, docs) -> None:
    # blank separators of several kinds: one empty line, two, and a whitespace-only line
    seps = ["\n\n", "\n\n\n", "\n   \n"]
    path.write_text("".join(d + seps[i % 3] for i, d in enumerate(docs)), encoding="utf-8")


def direct_run(model: Model, tok: Tokenizer, docs: list[str], monkeypatch) -> np.ndarray:
    """int64 [T, n_layer, top_k]: each position's experts, recorded by patching MoE.route and
    feeding every document token by token in windows of CTX (a fresh session each)."""
    g = model.geometry
    seen: list[tuple[int, np.ndarray]] = []
    original = MoE.route

    def route(self, be, x, logits=None):  # (logits: the router's product when forward made it beside the shared expert's)
        top, w = original(self, be, x, logits)
        seen.append((self.layer, np.array(top).reshape(-1)))  # one token: top is [1, k]
        return top, w

    rows = []
    with monkeypatch.context() as m:
        m.setattr(MoE, "route", route)
        for text in docs:
            ids = tok.encode(text)
            for a in range(0, len(ids), CTX):
                s = model.new_session(CTX, "f16")
                for t in ids[a : a + CTX]:
                    seen.clear()
                    model.step(s, t)
                    assert [l for l, _ in seen] == list(range(g.n_layer))
                    rows.append(np.stack([top for _, top in seen]))
    return np.array(rows, np.int64)


def counts_of(rows: np.ndarray, n_expert: int) -> np.ndarray:
    L = rows.shape[1]
    return np.stack([np.bincount(rows[:, l].ravel(), minlength=n_expert) for l in range(L)])


@pytest.fixture(scope="module")
def runs(packs, tmp_path_factory):
    """strata-profile on each pack (batched prompt path, chunks of 16) with --trace; what it printed."""
    out = {}
    for arch, pack in packs.items():
        d = tmp_path_factory.mktemp(f"run-{arch}")
        write_prompts(d / "prompts.txt", documents())
        argv = [str(pack), "--prompts", str(d / "prompts.txt"), "-o", str(d / "expert-profile.bin"),
                "--trace", str(d / "routing.trace"), "--ctx", str(CTX), "--prefill", "16", "--pool-workers", "1"]
        out[arch] = (d, argv)
    return out


@pytest.fixture(scope="module")
def results(runs):
    """Per arch: (exit status, stdout, stderr, run directory)."""
    got = {}
    for arch, (d, argv) in runs.items():
        o, e = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(o), contextlib.redirect_stderr(e):
            code = main(argv)
        got[arch] = (code, o.getvalue(), e.getvalue(), d)
    return got


@pytest.fixture(scope="module")
def reference(packs):
    """Per arch: (in-sample rows, held-out rows) from the direct token-by-token run."""
    mp = pytest.MonkeyPatch()
    out = {}
    try:
        for arch, pack in packs.items():
            model = Model(Pack.open(pack))
            tok = Tokenizer.load(pack / "tokenizer.txt")
            docs = documents()
            held = [docs[i] for i in HELD_DOCS]
            kept = [t for i, t in enumerate(docs) if i not in HELD_DOCS]
            out[arch] = (direct_run(model, tok, kept, mp), direct_run(model, tok, held, mp))
    finally:
        mp.undo()
    return out


# --- the profile against independent counts ---------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHS)
def test_profile_counts_equal_an_independent_recount(results, reference, packs, arch):
    code, stdout, stderr, d = results[arch]
    assert code == 0, stderr
    pack = packs[arch]
    g = Pack.open(pack).geometry
    prof = read_expert_profile(d / "expert-profile.bin")
    rows, _ = reference[arch]
    assert prof.pack_fingerprint == pack_fingerprint(pack)
    assert (prof.n_layer, prof.n_expert, prof.top_k) == (g.n_layer, g.n_expert, g.n_expert_used)
    assert prof.tokens == len(rows)  # every in-sample position, the held-out documents left out
    assert np.array_equal(prof.count_matrix(), counts_of(rows, g.n_expert))
    assert prof.layer_totals() == [len(rows) * g.n_expert_used] * g.n_layer
    # the documents were cut into windows, and the run used the batched prompt path
    assert any(len(Tokenizer.load(pack / "tokenizer.txt").encode(t)) > CTX for t in documents())
    assert "chunks of 16" in stderr


@pytest.mark.parametrize("arch", ARCHS)
def test_trace_round_trip_is_the_in_sample_routing_in_order(results, reference, packs, arch):
    _, _, _, d = results[arch]
    trace = read_trace(d / "routing.trace", pack_fingerprint=pack_fingerprint(packs[arch]))
    rows, _ = reference[arch]
    assert np.array_equal(trace.ids, rows)  # position by position, in the router's order
    assert trace.to_profile() == read_expert_profile(d / "expert-profile.bin")


def parse_table(stdout: str) -> list[tuple[int, int, str, str]]:
    found = re.findall(r"^\s*(\d+)%\s+(\d+)\s+(\d+\.\d)\s+(\d+\.\d|-)\s*$", stdout, re.M)
    return [(int(p), int(k), a, b) for p, k, a, b in found]


@pytest.mark.parametrize("arch", ARCHS)
def test_hit_rate_table_equals_expected_hit_rate(results, reference, packs, arch):
    _, stdout, _, _ = results[arch]
    g = Pack.open(packs[arch]).geometry
    fp = pack_fingerprint(packs[arch])
    rows, held_rows = reference[arch]
    mine = ExpertProfile.from_counts(fp, counts_of(rows, g.n_expert), tokens=len(rows), top_k=g.n_expert_used)
    held = ExpertProfile.from_counts(fp, counts_of(held_rows, g.n_expert), tokens=len(held_rows), top_k=g.n_expert_used)
    table = parse_table(stdout)
    pairs = g.n_layer * g.n_expert
    assert [p for p, *_ in table] == [1, 2, 5, 10, 20, 30, 50, 60, 80, 100]
    for p, slots, in_sample, held_out in table:
        assert slots == math.ceil(p * pairs / 100 - 1e-9) and slots * 100 >= p * pairs
        assert in_sample == f"{100 * expected_hit_rate(mine, slots):.1f}"
        assert held_out == f"{100 * expected_hit_rate(mine, slots, held):.1f}"
    assert "in-sample figures alone mislead" in stdout.lower() and "held-out" in stdout
    # the synth's skewed router: 10% of the slots serve far more than 10% of the uses
    assert expected_hit_rate(mine, math.ceil(pairs / 10)) > 0.2


def test_batched_and_token_paths_count_the_same(packs, tmp_path, capsys):
    """--prefill off (token by token) writes the same profile as the batched prompt path."""
    pack = packs["qwen35moe"]
    write_prompts(tmp_path / "p.txt", documents(seed=1))
    written = []
    for prefill in ("off", "32"):
        out = tmp_path / f"prof-{prefill}.bin"
        assert main([str(pack), "--prompts", str(tmp_path / "p.txt"), "-o", str(out), "--prefill", prefill,
                     "--ctx", "64", "--pool-workers", "1"]) == 0, capsys.readouterr().err
        written.append(out.read_bytes())
    assert written[0] == written[1]


def test_max_tokens_splits_the_budget(packs, tmp_path, capsys):
    pack = packs["qwen35moe"]
    write_prompts(tmp_path / "p.txt", documents())
    assert main([str(pack), "--prompts", str(tmp_path / "p.txt"), "-o", str(tmp_path / "p.bin"), "--max-tokens", "50",
                 "--trace", str(tmp_path / "t.trace"), "--pool-workers", "1"]) == 0
    err = capsys.readouterr().err
    assert "(40 tokens run), 2 held out (10 tokens run)" in err  # 50 - round(50 * 0.2) in-sample
    assert read_expert_profile(tmp_path / "p.bin").tokens == 40
    assert read_trace(tmp_path / "t.trace").n_tokens == 40


def test_no_held_out_text_prints_the_in_sample_column_only(packs, tmp_path, capsys):
    write_prompts(tmp_path / "p.txt", documents()[:2])
    assert main([str(packs["qwen35moe"]), "--prompts", str(tmp_path / "p.txt"), "-o", str(tmp_path / "p.bin"),
                 "--held-out", "0", "--pool-workers", "1"]) == 0
    out = capsys.readouterr().out
    table = parse_table(out)
    assert len(table) == 10 and all(held == "-" for *_, held in table)
    assert "no held-out text (--held-out 0)" in out and "in-sample figures alone mislead" in out.lower()


# --- the split and the budget -----------------------------------------------------------------------


@pytest.mark.parametrize("n", [2, 3, 5, 10, 11, 97])
@pytest.mark.parametrize("fraction", [0.01, 0.2, 0.5, 0.9])
def test_held_out_split_is_disjoint_deterministic_and_spread(n, fraction):
    held = P.held_out_documents(n, fraction)
    assert held == P.held_out_documents(n, fraction)
    h = min(max(round(n * fraction), 1), n - 1)
    assert len(held) == len(set(held)) == h and all(0 <= i < n for i in held)
    assert held == sorted(held)
    ids = [[i] * 3 for i in range(n)]  # document i is three tokens of value i
    c = P.plan_calibration(ids, fraction)
    assert sorted(c.in_docs + c.held_docs) == list(range(n)) and not set(c.in_docs) & set(c.held_docs)
    assert c.held_docs == held and [int(x[0]) for x in c.held_out] == held
    # spread: no stretch of documents without a held-out one is much longer than n / h
    gaps = np.diff([-1, *held, n])
    assert gaps.max() <= math.ceil(n / h) + 1


def test_budget_takes_documents_in_order_and_cuts_the_last():
    ids = [list(range(10 * i, 10 * i + 7)) for i in range(10)]  # 10 documents of 7 tokens
    c = P.plan_calibration(ids, 0.2, max_tokens=30)
    assert c.tokens == (24, 6)
    assert [d.tolist() for d in c.in_sample] == [ids[0], ids[1], ids[3], ids[4][:3]]
    assert [d.tolist() for d in c.held_out] == [ids[2][:6]]
    assert P.plan_calibration(ids, 0, max_tokens=9).tokens == (9, 0)


def test_documents_are_paragraphs(tmp_path):
    p = tmp_path / "p.txt"
    p.write_text("\n\n first line\nsecond line\n\n\n  \t \nthird\r\n\r\nfourth\n  \n", encoding="utf-8")
    assert P.read_documents(p) == [" first line\nsecond line", "third", "fourth"]


# --- the engine refuses a profile of another pack ---------------------------------------------------


def test_engine_refuses_a_profile_made_for_another_pack(results, packs):
    d = results["qwen35moe"][3]
    prof = read_expert_profile(d / "expert-profile.bin")
    mine, other = pack_fingerprint(packs["qwen35moe"]), pack_fingerprint(packs["qwen4exp"])
    g = Pack.open(packs["qwen4exp"]).geometry
    with pytest.raises(ProfileMismatch) as e:
        check_profile(prof, pack_fingerprint=other, n_layer=g.n_layer, n_expert=g.n_expert, top_k=g.n_expert_used)
    assert mine in str(e.value) and other in str(e.value)
    check_profile(prof, pack_fingerprint=mine, n_layer=g.n_layer, n_expert=g.n_expert, top_k=g.n_expert_used)


# --- bad input: a clear error, a non-zero exit, nothing written -------------------------------------


def _files(d):
    return sorted(p.name for p in d.iterdir())


@pytest.mark.parametrize("case, message", [
    ("missing pack", "nope: no such directory; a pack is the directory strata-pack convert writes"),
    ("not a pack", "no manifest.txt, so not a pack"),
    ("empty prompts", "no text (expected documents: paragraphs separated by blank lines)"),
    ("missing prompts", "No such file"),
    ("binary prompts", "not UTF-8 text"),
    ("one document", "at least 2 are needed to hold one out"),
    ("max tokens 0", "--max-tokens 0: expected at least 1"),
    ("held out 1", "--held-out 1.0: expected a fraction in [0, 1)"),
    ("output dir missing", "cannot write there"),
    ("output is a directory", "a directory; expected a file name"),
    ("trace is the output", "is the profile's path too"),
])
def test_bad_input_fails_clearly_and_writes_nothing(packs, tmp_path, capsys, case, message):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("one document\n\nand another\n", encoding="utf-8")
    (tmp_path / "notapack").mkdir()
    out = tmp_path / "expert-profile.bin"
    args = {"pack": str(packs["qwen35moe"]), "prompts": str(prompts), "-o": str(out), "extra": []}
    if case == "missing pack":
        args["pack"] = str(tmp_path / "nope")
    elif case == "not a pack":
        args["pack"] = str(tmp_path / "notapack")
    elif case == "empty prompts":
        prompts.write_text("\n  \n\t\n", encoding="utf-8")
    elif case == "missing prompts":
        args["prompts"] = str(tmp_path / "absent.txt")
    elif case == "binary prompts":
        prompts.write_bytes(b"caf\xe9\n")
    elif case == "one document":
        prompts.write_text("only one\nparagraph here\n", encoding="utf-8")
    elif case == "max tokens 0":
        args["extra"] = ["--max-tokens", "0"]
    elif case == "held out 1":
        args["extra"] = ["--held-out", "1"]
    elif case == "output dir missing":
        args["-o"] = str(tmp_path / "no" / "dir" / "p.bin")
    elif case == "output is a directory":
        args["-o"] = str(tmp_path / "notapack")
    elif case == "trace is the output":
        args["extra"] = ["--trace", str(out)]
    before = _files(tmp_path)
    code = main([args["pack"], "--prompts", args["prompts"], "-o", args["-o"], *args["extra"]])
    err = capsys.readouterr().err
    assert code != 0
    assert message in err and "strata-profile: error:" in err
    assert _files(tmp_path) == before  # no profile, no trace, no temp or probe file


def test_failure_after_the_run_leaves_neither_file(packs, tmp_path, capsys, monkeypatch):
    """A profile write that fails at the end removes the streamed trace too."""
    from strata.index_format import expert_profile

    def fail(path, profile):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(expert_profile, "write_expert_profile", fail)
    write_prompts(tmp_path / "p.txt", documents()[:3])
    before = _files(tmp_path)
    code = main([str(packs["qwen35moe"]), "--prompts", str(tmp_path / "p.txt"), "-o", str(tmp_path / "p.bin"),
                 "--trace", str(tmp_path / "t.trace"), "--pool-workers", "1"])
    assert code == 1 and "no space left on the device while writing" in capsys.readouterr().err
    assert _files(tmp_path) == before

"""Bad input against every CLI (issue: nothing silent): each case must be refused with a message naming
the flag or file, what was found and what was expected, a non-zero exit and no traceback, and the
flags before the model loads. Each case is marked `bad_input(kind)`; docs/reliability.md counts them."""

from __future__ import annotations

import numpy as np
import pytest

import engine_fixture as F
from strata.engine.cli import main
from strata.engine.kernels import cpu
from strata.tools.budget_cli import main as budget_main

bad = pytest.mark.bad_input


@pytest.fixture(scope="module")
def pack_dir(tmp_path_factory):
    return F.make_pack(tmp_path_factory.mktemp("bad"))


@pytest.fixture(autouse=True)
def restore_threads():
    before = cpu.get_threads()
    yield
    cpu.set_threads(before)


def gen(pack, *args):
    return main(["generate", "--pack", str(pack), "--pool-workers", "1", *args])


def refused(capsys, message: str) -> str:
    out, err = capsys.readouterr()
    assert message in err, err
    assert "Traceback" not in err
    return err


@bad("range")
@pytest.mark.parametrize("args, message", [
    (["--temp", "inf"], "--temp inf: expected a finite number >= 0 (0 is greedy)"),
    (["--temp", "nan"], "--temp nan: expected a finite number >= 0"),
    (["--temp", "-1"], "--temp -1.0: expected a finite number >= 0"),
    (["--top-p", "nan"], "--top-p nan: expected a number in (0, 1]"),
    (["--min-p", "inf"], "--min-p inf: expected a number in [0, 1]"),
    (["--repeat-penalty", "nan"], "--repeat-penalty nan: expected a finite number > 0"),
    (["--repeat-penalty", "inf"], "--repeat-penalty inf: expected a finite number > 0"),
    (["--top-k", "-1"], "--top-k -1: expected >= 0"),
])
def test_sampler_floats_must_be_finite_and_in_range(pack_dir, capsys, args, message):
    assert gen(pack_dir, "--prompt-ids", "1 2", "-n", "2", *args) == 1
    refused(capsys, message)


@bad("ascii-digits")
@pytest.mark.parametrize("args, message", [
    (["--prompt-ids", "1 \u0663 3"], "--prompt-ids: item 2 is '\u0663', expected a token id in 0..319"),
    (["--prompt-ids", "1 \u00b2"], "--prompt-ids: item 2 is '\u00b2', expected a token id"),
    (["--prompt-ids", "1", "--prefill", "\u00b2"], "--prefill '\u00b2': expected auto, off or a chunk size"),
    (["--prompt-ids", "1", "--expert-cache", "\u00b2"], "--expert-cache '\u00b2': expected auto or a number of slots"),
])
def test_counts_take_ascii_digits_only(pack_dir, capsys, args, message):
    assert gen(pack_dir, "-n", "1", *args) == 1
    refused(capsys, message)


@pytest.mark.parametrize("args, code, message", [
    pytest.param(["--vram-gib", "inf"], 1, "--vram-gib inf: expected a number in [0, 1073741824]", marks=bad("range")),
    pytest.param(["--expert-cache", "\u00b2"], 1, "--expert-cache '\u00b2': expected auto or a non-negative integer",
                 marks=bad("ascii-digits")),
    pytest.param(["--prefill", "\u0663"], 1, "--prefill '\u0663': expected auto, off or a chunk size",
                 marks=bad("ascii-digits")),
])
def test_budget_flags(pack_dir, capsys, args, code, message):
    assert budget_main([str(pack_dir), *args]) == code
    refused(capsys, message)


# --- files that change underneath a run -------------------------------------------------------------

_TRUNCATE_MIDWAY = """
import os, sys
from strata.engine.cli import main
from strata.engine.sampling import Sampler
gguf, sample = sys.argv[1], Sampler.sample
def truncate_then_sample(self, *a, **k):
    # the GGUF the experts are mapped from shrinks under the run (between the stat checks)
    os.truncate(gguf, 0)
    return sample(self, *a, **k)
Sampler.sample = truncate_then_sample
# the stat check between tokens would see the new size first; a truncation in the middle of a token is
# what only the SIGBUS handler can report, so the check is taken out here
from strata.engine.pack_reader import Pack
Pack.check_unchanged = lambda self: None
sys.exit(main(["generate", "--pack", sys.argv[2], "--pool-workers", "1", "--prompt-ids", "1 2", "-n", "8",
               "--temp", "0", "--prefill", "off"]))
"""


@bad("changed-underneath")
def test_a_source_gguf_truncated_during_generate_is_named_not_a_silent_sigbus(tmp_path):
    import subprocess
    import sys

    pack = F.make_pack(tmp_path, "shrinks")
    gguf = tmp_path / "shrinks.gguf"
    r = subprocess.run([sys.executable, "-c", _TRUNCATE_MIDWAY, str(gguf), str(pack)], capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 1, (r.returncode, r.stderr)
    assert f"{gguf} was truncated or rewritten while the engine was reading it" in r.stderr
    assert "Fatal Python error" not in r.stderr


@bad("changed-underneath")
def test_a_source_gguf_rewritten_in_place_at_the_same_size_stops_the_run(tmp_path, capsys, monkeypatch):
    import os

    from strata.engine.sampling import Sampler

    pack = F.make_pack(tmp_path, "rewritten")
    gguf = tmp_path / "rewritten.gguf"
    sample = Sampler.sample

    def rewrite_then_sample(self, *a, **k):
        # the same bytes written back: same size, a new mtime (what an in-place copy leaves)
        os.utime(gguf, ns=(os.stat(gguf).st_atime_ns, os.stat(gguf).st_mtime_ns + 10**9))
        return sample(self, *a, **k)

    monkeypatch.setattr(Sampler, "sample", rewrite_then_sample)
    assert gen(pack, "--prompt-ids", "1 2", "-n", "4", "--temp", "0") == 1
    refused(capsys, f"{gguf}: changed while the engine was running")


# --- checked before the load -------------------------------------------------------------------------


@pytest.fixture
def no_load(monkeypatch):
    """The load is where a check comes too late (10-36 s on a real model): here it fails the test."""
    import strata.engine.cli as cli

    def loaded(*a, **k):
        raise AssertionError("the model was loaded before the bad input was refused")

    monkeypatch.setattr(cli, "load_model", loaded)


def _gpu_present() -> bool:
    from strata.engine.kernels import gpu

    return gpu.available()[0]


@bad("before-load")
@pytest.mark.parametrize("args, message", [
    (["--prompt-ids", "1 2", "--max-context", "1"], "--ctx-size 1 is shorter than the prompt (2 tokens)"),
    (["--prompt-ids", "1 320"], "--prompt-ids: item 2 is '320', expected a token id in 0..319"),
    (["--prompt-ids", "1", "--dump-logits", "/nonexistent-dir/x.npy"],
     "--dump-logits /nonexistent-dir/x.npy: the directory /nonexistent-dir does not exist"),
    (["--prompt-ids", "1", "-n", "100000000000"], "-n 100000000000 (+ 1 prompt tokens = 100000000001): the session's KV cache and state needs"),
    (["--prompt-ids", "1", "-n", "8", "--max-context", "1000000000000"],
     "--ctx-size 1000000000000: the session's KV cache and state needs"),
    pytest.param(["--prompt-ids", "1", "--device", "gpu"], "--device gpu: ",
                 marks=pytest.mark.skipif(_gpu_present(), reason="a GPU is present: --device gpu is valid here")),
])
def test_generate_refuses_before_the_load(pack_dir, capsys, no_load, args, message):
    assert gen(pack_dir, "-n", "2", *args) == 1
    err = refused(capsys, message)
    if "needs" in message:  # both numbers: what it needs and what the host has
        assert "GiB" in err and "the host has" in err and "available" in err


@bad("before-load")
def test_a_context_beyond_the_trained_one_is_warned_about(pack_dir, tmp_path, capsys, monkeypatch):
    import dataclasses
    import shutil

    from strata.index_format.geometry import read_geometry, write_geometry

    pack = tmp_path / "pack"
    shutil.copytree(pack_dir, pack)
    g = read_geometry(pack / "geometry.txt")
    write_geometry(pack / "geometry.txt", dataclasses.replace(g, n_ctx_train=16))
    import strata.engine.cli as cli

    monkeypatch.setattr(cli, "load_model", lambda *a, **k: (_ for _ in ()).throw(ValueError("stopped at the load")))
    assert gen(pack, "--prompt-ids", "1", "-n", "2", "--max-context", "32") == 1
    refused(capsys, "warning: --ctx-size 32 is beyond the model's trained context (16 tokens)")


@bad("file")
def test_prompt_file_and_text_file_must_be_utf8(pack_dir, tmp_path, capsys, no_load):
    f = tmp_path / "latin1.txt"
    f.write_bytes(b"caf\xe9 au lait")
    assert gen(pack_dir, "--prompt-file", str(f)) == 1
    refused(capsys, f"--prompt-file {f}: not UTF-8 text: byte 3 is 0xe9")
    assert main(["perplexity", "--pack", str(pack_dir), "--file", str(f)]) == 1
    refused(capsys, f"--file {f}: not UTF-8 text: byte 3 is 0xe9")


@bad("before-load")
def test_perplexity_output_is_checked_before_the_load(pack_dir, tmp_path, capsys, no_load):
    f = tmp_path / "text.txt"
    f.write_text("abc " * 200, encoding="utf-8")
    assert main(["perplexity", "--pack", str(pack_dir), "--file", str(f), "--ctx", "32",
                 "--save-logits", "/nonexistent-dir/base.bin"]) == 1
    refused(capsys, "--save-logits /nonexistent-dir/base.bin: the directory /nonexistent-dir does not exist")


@bad("file")
@pytest.mark.parametrize("what, message", [
    ("missing", "no such directory; a pack is the directory strata-pack convert writes"),
    ("gguf", "a GGUF file, not a pack directory; a pack is the directory strata-pack convert writes"),
])
def test_pack_flag_says_what_it_found_and_what_a_pack_is(pack_dir, tmp_path, capsys, what, message):
    target = tmp_path / "nothing" if what == "missing" else pack_dir.parent / "model.gguf"
    assert main(["generate", "--pack", str(target), "--prompt", "a"]) == 1
    refused(capsys, f"{target}: {message}")


@bad("before-load")
def test_budget_refuses_a_context_the_host_cannot_hold(pack_dir, capsys):
    assert budget_main([str(pack_dir), "--max-context", "1000000000000"]) == 1
    err = refused(capsys, "--ctx-size 1000000000000: the session's KV cache and state needs")
    assert "the host has" in err


@bad("before-load")
def test_profile_refuses_a_context_the_host_cannot_hold(pack_dir, tmp_path, capsys, no_load):
    from strata.tools.profile_cli import main as profile_main

    docs = tmp_path / "docs.txt"
    docs.write_text("one document\n\nanother one\n", encoding="utf-8")
    assert profile_main([str(pack_dir), "--prompts", str(docs), "-o", str(tmp_path / "p.bin"),
                         "--ctx", "1000000000000"]) == 1
    refused(capsys, "--ctx-size 1000000000000: the session's KV cache and state needs")


# --- SIGTERM / SIGHUP clean up as Ctrl-C does ---------------------------------------------------------

_SIGNAL_MIDWAY = """
import importlib, os, signal, sys
module, attr, signame, cli = sys.argv[1:5]
target = importlib.import_module(module)
owner, name = (getattr(target, attr.split(".")[0]), attr.split(".")[1]) if "." in attr else (target, attr)
real = getattr(owner, name)
def signal_midway(*a, **k):
    os.kill(os.getpid(), getattr(signal, signame))  # delivered at the next bytecode, inside the run
    return real(*a, **k)
setattr(owner, name, signal_midway)
main = importlib.import_module(cli).main
sys.exit(main(sys.argv[5:]))
"""


def _run_signalled(where: str, signame: str, cli: str, *argv):
    import subprocess
    import sys

    module, attr = where.rsplit(":", 1)
    return subprocess.run([sys.executable, "-c", _SIGNAL_MIDWAY, module, attr, signame, cli, *map(str, argv)],
                          capture_output=True, text=True, timeout=600)


def _leftovers(d):
    return sorted(p.name for p in d.rglob("*") if ".tmp-" in p.name or ".old-" in p.name or ".probe-" in p.name)


@bad("signal")
@pytest.mark.parametrize("signame, code", [("SIGTERM", 143), ("SIGHUP", 129)])
def test_convert_cleans_up_on_sigterm_and_sighup(tmp_path, signame, code):
    gguf = F.write_gguf(tmp_path / "m.gguf", F.geometry())
    r = _run_signalled("strata.tools.pack:_pack_chunks", signame, "strata.tools.pack_cli", "convert", gguf, "-o",
                       tmp_path / "pack")
    assert r.returncode == code, r.stderr
    assert "interrupted" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "pack").exists() and _leftovers(tmp_path) == []


@bad("signal")
def test_perplexity_save_logits_cleans_up_on_sigterm(pack_dir, tmp_path):
    f = tmp_path / "text.txt"
    f.write_text("abcdefgh " * 40, encoding="utf-8")
    r = _run_signalled("strata.index_format.kl_base:KLBaseWriter.append", "SIGTERM", "strata.engine.cli", "perplexity",
                       "--pack", pack_dir, "--file", f, "--ctx", "32", "--pool-workers", "1", "--save-logits",
                       tmp_path / "base.bin")
    assert r.returncode == 143, r.stderr
    assert "interrupted" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "base.bin").exists() and _leftovers(tmp_path) == []


@bad("signal")
def test_profile_trace_cleans_up_on_sighup(pack_dir, tmp_path):
    docs = tmp_path / "docs.txt"
    docs.write_text("one document about experts\n\nanother document\n", encoding="utf-8")
    r = _run_signalled("strata.index_format.routing_trace:TraceWriter.append", "SIGHUP", "strata.tools.profile_cli",
                       pack_dir, "--prompts", docs, "-o", tmp_path / "p.bin", "--trace", tmp_path / "t.bin",
                       "--pool-workers", "1", "--held-out", "0")
    assert r.returncode == 129, r.stderr
    assert "interrupted" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "p.bin").exists() and not (tmp_path / "t.bin").exists() and _leftovers(tmp_path) == []


# --- non-finite weights: caught at convert / verify, named in a run -----------------------------------

NAN16, INF16 = b"\x00\x7e", b"\x00\x7c"  # fp16 NaN and +inf, little-endian


def _poison_gguf(path, tensor: str, at: int, raw: bytes, every: int | None = None, count: int = 1) -> None:
    from strata.tools.gguf_io import read_gguf

    t = read_gguf(path).tensors[tensor]
    with open(path, "r+b") as f:
        for i in range(count):
            f.seek(t.offset + at + i * (every or 0))
            f.write(raw)


@bad("non-finite")
@pytest.mark.parametrize("tensor, types, at, raw, message", [
    ("blk.2.attn_norm.weight", {}, 4 * 5, np.float32(np.nan).tobytes(),
     "tensor blk.2.attn_norm.weight (layer 2) F32: element 5 is nan, expected finite values"),
    ("blk.1.ssm_out.weight", {"dense": "Q8_0"}, 34 * 3, INF16,
     "tensor blk.1.ssm_out.weight (layer 1) Q8_0: block 3 fp16 scale 0 is inf, expected finite values"),
    ("output.weight", {"dense": "Q8_0"}, 0, NAN16, "tensor output.weight Q8_0: block 0 fp16 scale 0 is nan"),
])
def test_convert_refuses_non_finite_dense_weights(tmp_path, capsys, tensor, types, at, raw, message):
    from strata.tools.pack_cli import main as pack_main

    gguf = F.write_gguf(tmp_path / "m.gguf", F.geometry(), types=types)
    _poison_gguf(gguf, tensor, at, raw)
    assert pack_main(["convert", str(gguf), "-o", str(tmp_path / "pack")]) == 1
    refused(capsys, f"m.gguf: {message}")
    assert not (tmp_path / "pack").exists() and _leftovers(tmp_path) == []


@bad("non-finite")
def test_verify_scans_the_pool_for_non_finite_values(tmp_path, capsys):
    from strata.index_format.pack_index import read_index
    from strata.tools.pack_cli import main as pack_main

    pack = F.make_pack(tmp_path)
    t = next(t for t in read_index(pack / "index.txt").tensors if t.name == "blk.3.attn_norm.weight")
    with open(pack / "pool.bin", "r+b") as f:  # same size: only a scan sees it
        f.seek(t.offset + 4 * 7)
        f.write(np.float32(np.inf).tobytes())
    assert pack_main(["verify", str(pack)]) == 1
    refused(capsys, "tensor blk.3.attn_norm.weight (layer 3) F32: element 7 is inf, expected finite values")


@pytest.fixture
def nan_expert_pack(tmp_path):
    """Q8_0 experts; block 0's scale of every expert of layer 1's ffn_down is NaN (any routing meets one)."""
    from strata.index_format.ggml_types import BY_NAME
    from strata.index_format.native_experts import expert_bytes

    g = F.geometry()
    gguf = F.write_gguf(tmp_path / "model.gguf", g, types={"experts": "Q8_0"})
    q8 = BY_NAME["Q8_0"]
    per_expert = expert_bytes(q8, q8, g.n_embd, g.n_ff_exp)[2]
    _poison_gguf(gguf, "blk.1.ffn_down_exps.weight", 0, NAN16, every=per_expert, count=g.n_expert)
    from strata.tools import pack

    pack.convert([gguf], tmp_path / "model-pack")  # the experts are not read at convert
    return tmp_path / "model-pack"


@bad("non-finite")
def test_verify_full_scans_the_experts_and_names_layer_and_expert(nan_expert_pack, capsys):
    from strata.tools.pack_cli import main as pack_main

    assert pack_main(["verify", str(nan_expert_pack)]) == 0  # documented: the default reads no expert
    capsys.readouterr()
    assert pack_main(["verify", "--full", str(nan_expert_pack)]) == 1
    refused(capsys, "tensor blk.1.ffn_down_exps.weight (layer 1, expert 0) Q8_0: block 0 fp16 scale 0 of the tensor "
                    "is nan, expected finite values")


@bad("non-finite")
def test_a_run_that_meets_a_non_finite_value_names_tensor_layer_and_expert(nan_expert_pack, capsys):
    assert gen(nan_expert_pack, "--prompt-ids", "1 2 3", "-n", "2", "--temp", "0") == 1
    err = refused(capsys, "non-finite")
    assert "blk.1.ffn_down_exps.weight (layer 1, expert 0): block 0 fp16 scale 0 of the tensor is nan" in err


# --- strata-pack: what the message names --------------------------------------------------------------


def _pack_cli(*args):
    from strata.tools.pack_cli import main as pack_main

    return pack_main([str(a) for a in args])


@bad("file")
def test_convert_refuses_a_tokenizer_shorter_than_the_embedding(tmp_path, capsys, monkeypatch):
    real = F._tokenizer
    monkeypatch.setattr(F, "_tokenizer", lambda w, n_vocab: real(w, n_vocab - 11))
    gguf = F.write_gguf(tmp_path / "m.gguf", F.geometry())
    assert _pack_cli("convert", gguf, "-o", tmp_path / "pack") == 1
    refused(capsys, "m.gguf: tokenizer.ggml.tokens has 309 tokens, token_embd.weight has 320 rows; "
                    "expected one token per row")


@bad("file")
def test_convert_on_a_directory_says_so(pack_dir, tmp_path, capsys):
    assert _pack_cli("convert", tmp_path, "-o", tmp_path / "pack") == 1
    refused(capsys, f"{tmp_path}: a directory; expected the model's GGUF file")
    assert _pack_cli("convert", pack_dir, "-o", tmp_path / "pack") == 1
    refused(capsys, f"{pack_dir}: a directory (it is a pack: strata-pack verify checks one)")


@bad("file")
def test_verify_blames_a_pool_of_the_wrong_size_on_pool_bin(tmp_path, capsys):
    pack = F.make_pack(tmp_path)
    size = (pack / "pool.bin").stat().st_size
    with open(pack / "pool.bin", "ab") as f:
        f.write(b"\0" * 64)
    assert _pack_cli("verify", pack) == 1
    err = refused(capsys, f"{pack / 'pool.bin'}: {size + 64} bytes, expected {size}")
    assert "index.txt line" not in err


@bad("range")
def test_synth_refuses_a_negative_seed(tmp_path, capsys):
    assert _pack_cli("synth", "--arch", "qwen35moe", "-o", tmp_path / "m.gguf", "--seed", "-1") == 2
    refused(capsys, "--seed -1: expected an integer >= 0")
    assert not list(tmp_path.iterdir())


@bad("file")
def test_demo_refuses_a_non_pack_destination_before_synthesizing(tmp_path, capsys, monkeypatch):
    import strata.tools.synth as synth

    def synthesized(*a, **k):
        raise AssertionError("synthesized before the destination was checked")

    monkeypatch.setattr(synth, "synth_command", synthesized)
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("keep me", encoding="utf-8")
    assert _pack_cli("demo", "-o", out, "--no-generate") == 1
    refused(capsys, f"{out} exists and is not a pack (no manifest.txt)")
    assert (out / "notes.txt").read_text(encoding="utf-8") == "keep me"


def _dead_pid() -> int:
    import subprocess
    import sys

    p = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(p.stdout)


@bad("signal")
@pytest.mark.parametrize("out_exists", [False, True])
def test_force_recovers_or_removes_the_old_pack_a_killed_run_left(tmp_path, capsys, out_exists):
    from strata.index_format.manifest import read_manifest

    gguf = F.write_gguf(tmp_path / "m.gguf", F.geometry())
    out = tmp_path / "pack"
    assert _pack_cli("convert", gguf, "-o", out) == 0
    pid = _dead_pid()
    old = tmp_path / f".pack.old-{pid}"
    if out_exists:  # killed after the second rename: the new pack is in place, the old one beside it
        import shutil

        shutil.copytree(out, old)
    else:  # killed between the renames: the old pack moved aside, nothing at -o
        out.rename(old)
    capsys.readouterr()
    assert _pack_cli("convert", gguf, "-o", out, "--force") == 0
    err = capsys.readouterr().err
    if out_exists:
        assert f"removed {old}: the old pack left by a killed run (pid {pid})" in err
    else:
        assert f"restored {out} from {old.name}" in err
    assert read_manifest(out / "manifest.txt") and _leftovers(tmp_path) == []


def _refingerprint(pack, name: str) -> None:
    """What a careful editor does: record the edited file's size and fingerprint in the manifest."""
    from strata.index_format.manifest import Manifest, PackFile, fingerprint_file, read_manifest, write_manifest

    m = read_manifest(pack / "manifest.txt")
    files = [PackFile(f.name, (pack / name).stat().st_size, fingerprint_file(pack / name)) if f.name == name else f
             for f in m.files]
    write_manifest(pack / "manifest.txt", Manifest(m.sources, files))


@bad("file")
def test_verify_derives_the_geometry_again_from_the_gguf(tmp_path, capsys):
    import dataclasses

    from strata.index_format.geometry import read_geometry, write_geometry

    pack = F.make_pack(tmp_path)
    assert _pack_cli("verify", pack) == 0
    g = read_geometry(pack / "geometry.txt")
    write_geometry(pack / "geometry.txt", dataclasses.replace(g, n_expert_used=1))
    _refingerprint(pack, "geometry.txt")
    capsys.readouterr()
    assert _pack_cli("verify", pack) == 1
    refused(capsys, f"{pack / 'geometry.txt'}: n_expert_used is 1, the GGUF model.gguf gives 2 (edited since packing")


@bad("file")
def test_verify_full_sources_hashes_every_byte_of_the_ggufs(tmp_path, capsys):
    from strata.index_format.manifest import EDGE, N_SAMPLES, SAMPLE

    # many experts: a GGUF large enough that the sampled fingerprint leaves gaps between its samples
    gguf = F.write_gguf(tmp_path / "big.gguf", F.geometry(n_expert=512))
    pack = tmp_path / "pack"
    assert _pack_cli("convert", gguf, "-o", pack, "--hash-sources") == 0
    size = gguf.stat().st_size
    assert size > 2 * EDGE + N_SAMPLES * SAMPLE
    i = N_SAMPLES // 2
    at = (size - SAMPLE) * i // (N_SAMPLES - 1) + SAMPLE + 16  # just past sample i, before sample i + 1
    assert at + 1 < (size - SAMPLE) * (i + 1) // (N_SAMPLES - 1)
    with open(gguf, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0x01]))
    capsys.readouterr()
    assert _pack_cli("verify", pack, "--full") == 0  # documented: the sampled fingerprint cannot see it
    capsys.readouterr()
    assert _pack_cli("verify", pack, "--full-sources") == 1
    refused(capsys, "source main big.gguf changed since packing")


# --- a full disk -------------------------------------------------------------------------------------


def _disk_with(monkeypatch, free: int) -> None:
    import collections
    import shutil

    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10 * free + 1, 9 * free, free))


def _enospc(*a, **k):
    import errno

    raise OSError(errno.ENOSPC, "No space left on device")


@bad("disk-full")
def test_convert_checks_free_space_before_writing(tmp_path, capsys, monkeypatch):
    gguf = F.write_gguf(tmp_path / "m.gguf", F.geometry())
    _disk_with(monkeypatch, 1000)
    assert _pack_cli("convert", gguf, "-o", tmp_path / "pack") == 1
    err = refused(capsys, f"-o {tmp_path / 'pack'}: needs ")
    assert "the filesystem there has 0.00 GiB (1000 B) free" in err
    assert not (tmp_path / "pack").exists() and _leftovers(tmp_path) == []


@bad("disk-full")
def test_generate_dump_logits_checks_free_space_before_the_load(pack_dir, tmp_path, capsys, monkeypatch, no_load):
    _disk_with(monkeypatch, 1000)
    assert gen(pack_dir, "--prompt-ids", "1 2", "-n", "4", "--dump-logits", str(tmp_path / "l.npy")) == 1
    err = refused(capsys, f"--dump-logits {tmp_path / 'l.npy'}: needs ")
    assert f"({(2 + 4) * 320 * 4 + 128} B)" in err and "(1000 B) free" in err  # (prompt + n) f32 rows + header


@bad("disk-full")
def test_a_disk_that_fills_during_generate_names_the_output(pack_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(np, "save", _enospc)
    out = tmp_path / "l.npy"
    assert gen(pack_dir, "--prompt-ids", "1 2", "-n", "2", "--temp", "0", "--dump-logits", str(out)) == 1
    err = refused(capsys, f"no space left on the device while writing {out}; ")
    assert "GiB" in err and "free there now" in err
    assert _leftovers(tmp_path) == [] and not out.exists()


@bad("disk-full")
def test_profile_trace_on_a_full_disk_writes_nothing(pack_dir, tmp_path, capsys, monkeypatch):
    import os

    from strata.tools.profile_cli import main as profile_main

    docs = tmp_path / "docs.txt"
    docs.write_text("one document about experts\n\nanother document\n", encoding="utf-8")
    monkeypatch.setattr(os, "fsync", _enospc)  # the trace's commit is the first fsync of the run
    assert profile_main([str(pack_dir), "--prompts", str(docs), "-o", str(tmp_path / "p.bin"), "--trace",
                         str(tmp_path / "t.bin"), "--pool-workers", "1", "--held-out", "0"]) == 1
    refused(capsys, f"no space left on the device while writing {tmp_path / 'p.bin'}, {tmp_path / 't.bin'}")
    assert not (tmp_path / "p.bin").exists() and not (tmp_path / "t.bin").exists() and _leftovers(tmp_path) == []


@bad("disk-full")
def test_perplexity_save_logits_checks_free_space_before_the_load(pack_dir, tmp_path, capsys, monkeypatch, no_load):
    f = tmp_path / "text.txt"
    f.write_text("abcdefgh " * 40, encoding="utf-8")
    _disk_with(monkeypatch, 1000)
    assert main(["perplexity", "--pack", str(pack_dir), "--file", str(f), "--ctx", "32", "--save-logits",
                 str(tmp_path / "base.bin")]) == 1
    refused(capsys, f"--save-logits {tmp_path / 'base.bin'}: needs ")


def test_the_reliability_doc_counts_are_current():
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parent.parent / "scripts" / "bad_input_counts.py"
    r = subprocess.run([sys.executable, str(script), "--check"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr


@bad("file")
@pytest.mark.parametrize("path, why", [("/nonexistent-file.txt", "No such file or directory"), ("/", "Is a directory")])
def test_text_files_that_cannot_be_read_name_the_flag(pack_dir, tmp_path, capsys, no_load, path, why):
    assert gen(pack_dir, "--prompt-file", path) == 1
    refused(capsys, f"--prompt-file {path}: {why}; expected a UTF-8 text file")
    assert main(["perplexity", "--pack", str(pack_dir), "--file", path]) == 1
    refused(capsys, f"--file {path}: {why}; expected a UTF-8 text file")


@bad("range")
def test_budget_vram_gib_too_large_for_bytes(pack_dir, capsys):
    assert budget_main([str(pack_dir), "--vram-gib", "1e308"]) == 1
    refused(capsys, "--vram-gib 1e+308: expected a number in [0, 1073741824]")


@bad("range")
@pytest.mark.parametrize("n", ["0", "-1"])
def test_pool_workers_names_the_flag(pack_dir, capsys, n):
    assert main(["generate", "--pack", str(pack_dir), "--prompt-ids", "1", "-n", "1", "--pool-workers", n]) == 1
    refused(capsys, f"--threads {n}: ")  # the flag's name since -t; --pool-workers is its other spelling


@bad("file")
def test_other_unreadable_inputs_name_their_flag(pack_dir, tmp_path, capsys, no_load):
    from strata.tools.profile_cli import main as profile_main

    assert profile_main([str(pack_dir), "--prompts", "/", "-o", str(tmp_path / "p.bin")]) == 1
    refused(capsys, "--prompts /: Is a directory; expected a UTF-8 text file")
    f = tmp_path / "text.txt"
    f.write_text("abc " * 100, encoding="utf-8")
    assert main(["perplexity", "--pack", str(pack_dir), "--file", str(f), "--kl-base", "/nonexistent.bin"]) == 1
    refused(capsys, "--kl-base /nonexistent.bin: no such file; expected a file saved by strata perplexity --save-logits")
    gguf = F.write_gguf(tmp_path / "m.gguf", F.geometry())
    assert _pack_cli("convert", gguf, "-o", f / "pack") == 1
    refused(capsys, f"-o {f / 'pack'}: {f} is a file, not a directory")


@bad("file")
def test_every_command_says_what_a_pack_is(pack_dir, tmp_path, capsys):
    from strata.tools.profile_cli import main as profile_main

    gguf = pack_dir.parent / "model.gguf"
    message = f"{gguf}: a GGUF file, not a pack directory; a pack is the directory strata-pack convert writes"
    assert _pack_cli("verify", gguf) == 1
    refused(capsys, message)
    docs = tmp_path / "docs.txt"
    docs.write_text("one\n\ntwo\n", encoding="utf-8")
    assert profile_main([str(gguf), "--prompts", str(docs), "-o", str(tmp_path / "p.bin")]) == 1
    refused(capsys, message)
    assert budget_main([str(gguf)]) == 1
    refused(capsys, message)

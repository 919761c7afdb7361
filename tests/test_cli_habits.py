"""llama.cpp's command-line habits on all four Strata commands: -m/-t/-c/-p/-n -1/--ignore-eos/
--version/-h, one spelling per concept, stop tokens never printed, --device auto saying where it runs."""

from __future__ import annotations

import numpy as np
import pytest
import typer

import engine_fixture as F
from strata import __version__
from strata.engine import cli
from strata.engine.kernels import cpu, gpu
from strata.engine.sampling import Sampler, SamplerParams
from strata.engine.tokenizer import Tokenizer
from strata.tools import budget_cli, pack_cli, profile_cli

MAINS = {"strata": cli.main, "strata-pack": pack_cli.main, "strata-budget": budget_cli.main,
         "strata-profile": profile_cli.main}


@pytest.fixture(scope="module")
def pack_dir(tmp_path_factory):
    return F.make_pack(tmp_path_factory.mktemp("habits"))


@pytest.fixture(autouse=True)
def restore_threads():
    before = cpu.get_threads()
    yield
    cpu.set_threads(before)


@pytest.mark.parametrize("name", MAINS)
def test_version_and_h_on_every_command(name, capsys):
    main = MAINS[name]
    assert main(["--version"]) == 0
    assert capsys.readouterr().out == __version__ + "\n"
    assert main(["-h"]) == 0
    assert f"Usage: {name}" in capsys.readouterr().out


@pytest.mark.parametrize("argv", [["generate", "-h"], ["perplexity", "-h"]])
def test_h_on_every_subcommand(argv, capsys):
    assert cli.main(argv) == 0
    assert "Usage: strata " + argv[0] in capsys.readouterr().out
    for sub in ("convert", "verify", "synth", "demo"):
        assert pack_cli.main([sub, "-h"]) == 0
        assert f"Usage: strata-pack {sub}" in capsys.readouterr().out


def _params(app: typer.Typer, command: str | None) -> dict[str, tuple[str, ...]]:
    group = typer.main.get_command(app)
    cmd = group.commands[command] if command else group
    return {p.name: tuple(p.opts) for p in cmd.params}


# every command that runs or reads a pack: (app, subcommand, takes a context, takes threads)
PACK_COMMANDS = [(cli.app, "generate", True, True), (cli.app, "perplexity", True, True),
                 (budget_cli.app, None, True, False), (profile_cli.app, None, True, True),
                 (pack_cli.app, "verify", False, False)]


@pytest.mark.parametrize("app, command, has_ctx, has_threads", PACK_COMMANDS)
def test_one_spelling_per_concept(app, command, has_ctx, has_threads):
    params = _params(app, command)
    assert params["pack_arg"] == ("pack_arg",)  # the positional PACK
    assert params["pack"][:3] == ("-m", "--model", "--pack")
    ctx = [opts for opts in params.values() if "-c" in opts]
    assert ctx == ([ctx[0]] if has_ctx else []) and (not has_ctx or ctx[0][:2] == ("-c", "--ctx-size"))
    threads = [opts for opts in params.values() if "-t" in opts]
    assert threads == ([("-t", "--threads", "--pool-workers")] if has_threads else [])
    vram = [o for opts in params.values() for o in opts if o.startswith("--vram")]
    assert set(vram) <= {"--vram-budget-mib", "--vram-reserve-mib", "--vram-gib"}


def _gen(*args) -> int:
    return cli.main(["generate", *args])


def test_llama_cpp_spellings_run_the_same_as_the_long_ones(pack_dir, capsys):
    assert _gen("-m", str(pack_dir), "-t", "1", "-c", "16", "-p", "abc", "-n", "4", "--temp", "0") == 0
    short = capsys.readouterr().out
    assert _gen(str(pack_dir), "--pool-workers", "1", "--max-context", "16", "--prompt", "abc", "-n", "4",
                "--temp", "0") == 0
    assert capsys.readouterr().out == short and short.strip()
    assert _gen("--pack", str(pack_dir), "-m", str(pack_dir), "-p", "abc", "-n", "1") == 0  # both, the same pack
    capsys.readouterr()
    assert _gen(str(pack_dir), "-m", str(pack_dir.parent), "-p", "abc") == 1
    assert "two models" in capsys.readouterr().err


def test_n_minus_one_runs_until_the_context_is_full(pack_dir, capsys):
    assert _gen("-m", str(pack_dir), "-t", "1", "--prompt-ids", "1 2 3", "-n", "-1", "-c", "12", "--ignore-eos",
                "--temp", "0", "--stats") == 0
    err = capsys.readouterr().err
    # 12 positions: 3 prompt tokens and 9 generated ones are fed, the 10th is sampled from the last
    assert "decode   10 tokens" in err and "(stop: context)" in err


def _force_stop_on_second_draw(monkeypatch, stop: int):
    real, calls = Sampler.sample, []

    def sample(self, logits, history=()):
        calls.append(1)
        if len(calls) == 2:
            logits = logits.copy()
            logits[stop] = logits.max() + 100  # the model "wants" to stop here
        return real(self, logits, history)

    monkeypatch.setattr(Sampler, "sample", sample)


def test_stop_token_ends_the_text_without_being_printed(pack_dir, capsys, monkeypatch):
    tok = Tokenizer.load(pack_dir / "tokenizer.txt")
    (stop,) = tok.encode("<|im_end|>", add_special=False)
    assert stop in tok.stop_ids
    _force_stop_on_second_draw(monkeypatch, stop)
    assert _gen("-m", str(pack_dir), "-t", "1", "--prompt-ids", "1 2 3", "-n", "8", "--temp", "0", "--stats") == 0
    cap = capsys.readouterr()
    assert "decode   2 tokens" in cap.err and "(stop: eos)" in cap.err
    assert "<|im_end|>" not in cap.out and cap.out.endswith("\n")


def test_ignore_eos_generates_exactly_n_tokens(pack_dir, capsys, monkeypatch):
    tok = Tokenizer.load(pack_dir / "tokenizer.txt")
    (stop,) = tok.encode("<|im_end|>", add_special=False)
    _force_stop_on_second_draw(monkeypatch, stop)
    assert _gen("-m", str(pack_dir), "-t", "1", "--prompt-ids", "1 2 3", "-n", "8", "--temp", "0", "--stats",
                "--ignore-eos") == 0
    cap = capsys.readouterr()
    assert "decode   8 tokens" in cap.err and "(stop: length)" in cap.err and "<|im_end|>" not in cap.out


def test_banned_tokens_are_never_drawn():
    logits = np.zeros(16, np.float32)
    logits[3], logits[5] = 10, 9
    assert Sampler(16, SamplerParams(temperature=0)).sample(logits) == 3
    assert Sampler(16, SamplerParams(temperature=0), banned={3}).sample(logits) == 5
    s = Sampler(16, SamplerParams(temperature=1, top_k=0, top_p=1, min_p=0, seed=1), banned=frozenset(range(8)))
    assert all(s.sample(logits) >= 8 for _ in range(50))


def test_device_auto_says_where_it_runs_and_why(pack_dir, capsys):
    assert _gen("-m", str(pack_dir), "-t", "1", "--prompt-ids", "1", "-n", "1", "--device", "auto") == 0
    err = capsys.readouterr().err
    ok, why = gpu.available()
    expect = f"--device auto: CUDA GPU {why}; running the GPU tier" if ok else \
        f"--device auto: no CUDA GPU ({why}); running on the CPU"
    assert f"strata generate: {expect}" in err


@pytest.mark.parametrize("name, argv", [
    ("strata", ["generate", "-m", "{gguf}", "-p", "a"]),
    ("strata", ["perplexity", "{gguf}", "-f", "{gguf}"]),
    ("strata-budget", ["{gguf}"]),
    ("strata-profile", ["-m", "{gguf}", "--prompts", "{gguf}", "-o", "{out}"]),
    ("strata-pack", ["verify", "{gguf}"]),
])
def test_a_gguf_given_as_the_model_says_how_to_pack_it(pack_dir, tmp_path, capsys, name, argv):
    gguf = pack_dir.parent / "model.gguf"
    assert gguf.is_file()
    argv = [a.format(gguf=gguf, out=tmp_path / "p.bin") for a in argv]
    assert MAINS[name](argv) == 1
    err = capsys.readouterr().err
    assert "a GGUF file, not a pack directory" in err and f"strata-pack convert {gguf} -o packs/model" in err
    assert "Traceback" not in err


def test_budget_spellings_agree(pack_dir, capsys):
    assert budget_cli.main(["-m", str(pack_dir), "-c", "64", "--vram-budget-mib", "1024"]) == 0
    short = capsys.readouterr().out
    assert budget_cli.main([str(pack_dir), "--max-context", "64", "--vram-gib", "1"]) == 0
    assert capsys.readouterr().out == short and "--ctx-size 64" in short


def test_chat_system_turn_and_thinking_switch(pack_dir, capsys):
    tok = Tokenizer.load(pack_dir / "tokenizer.txt")
    assert _gen("-m", str(pack_dir), "-t", "1", "--chat", "--system", "Be brief.", "-p", "hi", "-n", "1", "--stats") == 0
    # the fixture's ChatML template, rendered by hand: a system turn, the user turn, the assistant's opening
    text = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert f"prefill  {len(tok.encode(text))} tokens" in capsys.readouterr().err
    assert _gen("-m", str(pack_dir), "--system", "x", "-p", "hi") == 2
    assert "give --chat too" in capsys.readouterr().err


def test_chat_on_a_pack_without_a_template_is_refused(pack_dir, capsys, monkeypatch):
    real = Tokenizer.load

    def load(path):
        tok = real(path)
        tok.chat_template = None  # as a GGUF without tokenizer.chat_template packs
        return tok

    monkeypatch.setattr(Tokenizer, "load", staticmethod(load))
    assert _gen("-m", str(pack_dir), "-t", "1", "--chat", "-p", "hi", "-n", "1") == 1
    err = capsys.readouterr().err
    assert "has no chat template" in err and "without --chat" in err and "Traceback" not in err

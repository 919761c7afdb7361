"""Every command in README.md runs as written.

The commands come from the README's ```sh blocks, in order, and run in one scratch folder, in this
process (the four CLIs' main()). Nothing is substituted but the paths the README's "Placeholders"
paragraph names: where a placeholder is read it becomes a file made from the tiny synthetic model
(its GGUF shards, its pack, text, a profile of that pack); where a command writes it (`-o`) it
becomes a fresh path. `packs/demo` is what the README's first command, `strata-pack demo`, writes.

What is not run, and what is checked instead (the test prints this table, so CI logs say it):
- `python3 -m pip install ...`: the test runs inside that install; checked: pyproject.toml is this
  project and declares the extras named.
- `python3 -m pytest ...`: this is that run.
- `strata-pack demo` runs with the `tiny` preset in place of `demo` (the full demo, synthesis and
  32 tokens on the CPU, runs in test_pack.py's test_demo_builds_reuses_and_rebuilds).
- a command with `--device gpu` runs as written; without a CUDA GPU it must stop with the README's
  documented refusal (exit 1, `--device gpu: <why>`), with one it must succeed.
"""

from __future__ import annotations

import re
import shlex
import shutil
import time
import tomllib
from pathlib import Path

import pytest

from strata.engine import cli
from strata.engine.kernels import cpu, gpu
from strata.tools import budget_cli, pack_cli, profile_cli, synth

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
MAINS = {"strata": cli.main, "strata-pack": pack_cli.main, "strata-budget": budget_cli.main,
         "strata-profile": profile_cli.main}
TEXT = ("The sky is blue because air scatters short wavelengths of sunlight more than long ones. "
        "Strata runs mixture-of-experts models on one machine, the hot experts on the GPU.\n")

pytestmark = pytest.mark.slow  # about a minute: some twenty commands on the tiny model


def readme_commands(text: str) -> list[list[str]]:
    """argv of every command in the ```sh blocks, in order (comments dropped, `a && b` split)."""
    commands = []
    for block in re.findall(r"```sh\n(.*?)```", text, re.S):
        for line in block.splitlines():
            words = shlex.split(line, comments=True)
            while words:
                cut = words.index("&&") if "&&" in words else len(words)
                commands.append(words[:cut])
                words = words[cut + 1:]
    return commands


def readme_placeholders(text: str) -> list[str]:
    para = re.search(r"^Placeholders in the examples below.*?(?=\n\n)", text, re.S | re.M)
    assert para, "README.md: the Placeholders paragraph is gone; the test needs it to know what to substitute"
    return re.findall(r"`([^`]+)`", para.group(0).split("`packs/demo` is")[0])


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """The tiny qwen4exp model as GGUF shards, its pack, a copy that lost its block size, texts, a profile."""
    d = tmp_path_factory.mktemp("readme-inputs")
    shards = synth.synth("qwen4exp", "tiny", d / "model.gguf")
    (d / "old").mkdir()
    old = synth.synth("qwen4exp", "tiny", d / "old" / "old.gguf", zero_compress_ratios=True)
    assert pack_cli.main(["convert", str(shards[0]), "-o", str(d / "pack")]) == 0
    (d / "p.txt").write_text(TEXT, encoding="utf-8")
    (d / "wiki.txt").write_text(TEXT * 12, encoding="utf-8")  # more than one 512-token window
    (d / "calibration.txt").write_text("\n\n".join([TEXT] * 10), encoding="utf-8")
    assert profile_cli.main(["-m", str(d / "pack"), "--prompts", str(d / "calibration.txt"), "-o",
                             str(d / "profile.bin"), "-t", "1"]) == 0
    gguf = str(shards[0])
    return {
        "packs/model": str(d / "pack"), "packs/base": str(d / "pack"), "packs/quant": str(d / "pack"),
        "Model-00001-of-00002.gguf": gguf, "/new/place/Model-00001-of-00002.gguf": gguf, "model.gguf": gguf,
        "model-ple.gguf": str(shards[1]), "old.gguf": str(old[0]), "/data": str(d),
        "p.txt": str(d / "p.txt"), "wiki.txt": str(d / "wiki.txt"), "calibration.txt": str(d / "calibration.txt"),
        "expert-profile.bin": str(d / "profile.bin"),
    }


def _substitute(argv: list[str], files: dict[str, str], fresh: Path) -> list[str]:
    out = []
    for i, word in enumerate(argv):
        if word in files and i > 0 and argv[i - 1] in ("-o", "--out"):
            out.append(str(fresh / Path(word).name))  # written by the command: a new path, never the input
        else:
            out.append(files.get(word, word))
    return out


def test_every_readme_command_runs_as_written(files, tmp_path, monkeypatch, capsys):
    text = README.read_text(encoding="utf-8")
    placeholders = readme_placeholders(text)
    commands = readme_commands(text)
    assert set(placeholders) == set(files), "the README's placeholders and the files this test makes differ"
    used = {w for argv in commands for w in argv}
    assert set(placeholders) <= used, f"placeholders no command uses: {set(placeholders) - used}"
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(pack_cli, "DEMO_PRESET", "tiny")
    threads = cpu.get_threads()
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    has_gpu = gpu.available()[0]
    report = []
    try:
        for n, argv in enumerate(commands):
            shown = shlex.join(argv)
            if argv[:4] == ["python3", "-m", "pip", "install"]:
                target = argv[-1]
                extras = re.findall(r"\[(\w+)\]", target)
                assert target.startswith(".") and pyproject["name"] == "strata", shown
                assert all(e in pyproject["optional-dependencies"] for e in extras), shown
                report.append(("checked, not run (this test runs in that install)", shown))
                continue
            if argv[:3] == ["python3", "-m", "pytest"]:
                report.append(("not run (this is that run)", shown))
                continue
            assert argv[0] in MAINS, f"README command {n + 1}: {shown}: not a Strata command"
            run = _substitute(argv, files, tmp_path / f"out-{n}")
            (tmp_path / f"out-{n}").mkdir()
            capsys.readouterr()
            t0 = time.perf_counter()
            rc = MAINS[argv[0]](run[1:])
            seconds = time.perf_counter() - t0
            cpu.set_threads(threads)  # a command's -t must not leak into the next one
            err = capsys.readouterr().err
            if "--device" in argv and argv[argv.index("--device") + 1] == "gpu" and not has_gpu:
                assert rc == 1 and f"{argv[0]} generate: error: --device gpu: " in err, (shown, rc, err)
                report.append((f"{seconds:5.1f} s  ran: the documented refusal (no CUDA GPU here)", shown))
                continue
            assert rc == 0, f"README command {n + 1} failed ({rc}): {shown}\n{err}"
            assert "Traceback" not in err, (shown, err)
            how = "ran (tiny preset)" if argv[:2] == ["strata-pack", "demo"] else "ran"
            report.append((f"{seconds:5.1f} s  " + (how if run == argv else how + ", placeholders substituted"), shown))
    finally:
        with capsys.disabled():
            print("\nREADME commands:")
            for how, shown in report:
                print(f"  {how:55s} {shown}")
    assert len(report) == len(commands)

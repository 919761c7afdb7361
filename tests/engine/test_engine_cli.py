"""`strata generate`: flags, streaming text, --dump-logits, --stats, and clear refusals."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

import engine_fixture as F
from strata.engine.cli import main
from strata.engine.kernels import cpu
from strata.engine.model import Model
from strata.engine.pack_reader import Pack
from strata.engine.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def pack_dir(tmp_path_factory):
    return F.make_pack(tmp_path_factory.mktemp("cli"))


@pytest.fixture(autouse=True)
def restore_threads():
    before = cpu.threads_cap()
    yield
    cpu.set_threads(before)


def gen(pack_dir, *args):
    return main(["generate", "--pack", str(pack_dir), "--pool-workers", "1", *args])


EXACT = ("--kv", "f32", "--prefill", "off")  # the path greedy_by_hand takes: token by token, f32 KV


def greedy_by_hand(pack_dir, prompt: list[int], n: int) -> tuple[list[int], np.ndarray]:
    model = Model(Pack.open(pack_dir))
    s = model.new_session(len(prompt) + n)
    fed, rows = list(prompt), []
    for pos in range(len(prompt) + n - 1):
        rows.append(model.step(s, fed[pos]).copy())
        if pos >= len(prompt) - 1:
            fed.append(int(rows[-1].argmax()))
    return fed[len(prompt):], np.array(rows)


def test_greedy_text_and_logits_of_every_position(pack_dir, tmp_path, capsys):
    out = tmp_path / "logits.npy"
    assert gen(pack_dir, "--prompt-ids", "5 77 140 3", "-n", "6", "--temp", "0", "--dump-logits", str(out), *EXACT) == 0
    tokens, rows = greedy_by_hand(pack_dir, [5, 77, 140, 3], 6)
    tok = Tokenizer.load(pack_dir / "tokenizer.txt")
    assert capsys.readouterr().out == tok.decode(tokens) + "\n"
    got = np.load(out)
    assert got.dtype == np.float32 and got.shape == (4 + 6 - 1, 320)
    assert np.array_equal(got, rows)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp file left


def test_text_prompt_chat_and_stats(pack_dir, capsys):
    assert gen(pack_dir, "--prompt", "héllo", "--chat", "-n", "3", "--seed", "5", "--stats") == 0
    err = capsys.readouterr().err
    for line in ("load ", "prefill  ", "decode   3 tokens", "sampling seed 5", "expert routing counts"):
        assert line in err
    # the chat template wraps the one user turn: <|im_start|>user\nhéllo<|im_end|>\n<|im_start|>assistant\n
    n_prompt = len(Tokenizer.load(pack_dir / "tokenizer.txt").encode(
        "<|im_start|>user\nhéllo<|im_end|>\n<|im_start|>assistant\n"))
    assert f"prefill  {n_prompt} tokens" in err
    # every fed position routes n_expert_used experts in each of the 4 layers
    assert err.count(f"  {(n_prompt + 2) * 2}  ") >= 4


def test_prompt_file(pack_dir, tmp_path, capsys):
    p = tmp_path / "prompt.txt"
    p.write_text("abc", encoding="utf-8")
    assert gen(pack_dir, "--prompt-file", str(p), "-n", "2", "--temp", "0", *EXACT) == 0
    tokens, _ = greedy_by_hand(pack_dir, Tokenizer.load(pack_dir / "tokenizer.txt").encode("abc"), 2)
    assert capsys.readouterr().out == Tokenizer.load(pack_dir / "tokenizer.txt").decode(tokens) + "\n"


@pytest.mark.parametrize("args, code, message", [
    ([], 2, "exactly one of --prompt, --prompt-file, --prompt-ids"),
    (["--prompt", "a", "--prompt-ids", "1"], 2, "exactly one of"),
    (["--prompt", "a", "--device", "tpu"], 2, "--device 'tpu'"),
    (["--prompt-ids", "1 999"], 1, "item 2 is '999', expected a token id in 0..319"),
    (["--prompt-ids", "1 2 3", "--max-context", "2"], 1, "--ctx-size 2 is shorter than the prompt (3 tokens)"),
    (["--prompt", "a", "--top-p", "0"], 1, "--top-p 0.0"),
    (["--prompt", "a", "-n", "-2"], 2, "-n -2: expected -1 (until a stop token or the context is full) or a count >= 0"),
])
def test_bad_flags_exit_nonzero_with_a_message(pack_dir, capsys, args, code, message):
    assert gen(pack_dir, *args) == code
    assert message in capsys.readouterr().err


def test_a_bad_or_moved_pack(pack_dir, tmp_path, capsys):
    assert main(["generate", "--pack", str(tmp_path), "--prompt", "a"]) == 1
    assert "not a pack" in capsys.readouterr().err
    moved = tmp_path / "moved.gguf"
    shutil.move(pack_dir.parent / "model.gguf", moved)
    try:
        assert gen(pack_dir, "--prompt-ids", "1", "-n", "1") == 1
        assert "main GGUF model.gguf: not found" in capsys.readouterr().err
        assert gen(pack_dir, "--prompt-ids", "1", "-n", "1", "--native", str(moved)) == 0
    finally:
        shutil.move(moved, pack_dir.parent / "model.gguf")

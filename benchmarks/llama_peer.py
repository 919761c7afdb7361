"""llama.cpp on the same GGUF, in the same benchmark run: the peer every speed figure is compared with.

A benchmark never types in llama.cpp's figure from another machine or model: it runs llama.cpp
(llama-cpp-python 0.3.36, built for this CPU by ../shared/peer/install_llama_cpu.sh) on the very
GGUF the Strata pack was made from, with the same threads, interleaving rounds with Strata's so a
busy host slows both alike. Where llama.cpp cannot be run, the benchmark says "not measured".

llama_cpp is found as tests/reference/llama_cpp_ref.py finds it: the python named by
STRATA_LLAMA_PYTHON (a separate venv is fine), else this python if it imports llama_cpp. The model
stays loaded in a worker process (_llama_peer_worker.py) between rounds.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

WORKER = Path(__file__).with_name("_llama_peer_worker.py")


def find_python() -> tuple[str | None, str]:
    """(a python that imports llama_cpp, how it was found) or (None, why not)."""
    env = os.environ.get("STRATA_LLAMA_PYTHON")
    candidates = [(env, f"STRATA_LLAMA_PYTHON={env}")] if env else [(sys.executable, "this python")]
    for python, how in candidates:
        try:
            p = subprocess.run([python, "-c", "import llama_cpp; print(llama_cpp.__version__)"], capture_output=True,
                               text=True, timeout=120)
        except (OSError, subprocess.TimeoutExpired) as e:
            return None, f"{how}: {e}"
        if p.returncode == 0:
            return python, f"{how} (llama_cpp {p.stdout.strip()})"
        return None, (f"{how} does not import llama_cpp; set STRATA_LLAMA_PYTHON to a python that does "
                      "(../shared/peer/install_llama_cpu.sh builds one)")
    return None, "no python to try"


class Peer:
    """llama.cpp with `gguf` loaded once, timing decode and prefill on request."""

    def __init__(self, python: str, gguf: Path, threads: int, ctx: int):
        self.proc = subprocess.Popen([python, str(WORKER), str(gguf), str(threads), str(ctx)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, bufsize=1)
        first = self.proc.stdout.readline().split()
        if first[:1] != ["ready"]:
            err = self.proc.stderr.read()[-3000:]
            self.proc.kill()
            raise RuntimeError(f"llama.cpp did not load {gguf}: {err or first}")
        self.n_vocab = int(first[1])

    def _ask(self, line: str) -> list[float]:
        self.proc.stdin.write(line + "\n")
        answer = self.proc.stdout.readline()
        if not answer or answer.startswith("error"):
            raise RuntimeError(f"llama.cpp worker: {answer.strip() or self.proc.stderr.read()[-3000:]}")
        return [float(x) for x in answer.split()]

    def decode(self, prompt: int, tokens: int, seed: int) -> list[float]:
        """Seconds of each of `tokens` single-token evals after a `prompt`-token prompt."""
        return self.decode_cpu(prompt, tokens, seed)[0]

    def decode_cpu(self, prompt: int, tokens: int, seed: int) -> tuple[list[float], float]:
        """decode's seconds, and the worker's CPU seconds (all its threads) over those evals."""
        out = self._ask(f"decode {prompt} {tokens} {seed}")
        return out[:-1], out[-1]

    def prefill(self, length: int, seed: int) -> float:
        """Seconds to evaluate a `length`-token prompt (batches of 512) from an empty context."""
        return self._ask(f"prefill {length} {seed}")[0]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()

"""llama.cpp's own quantizer and logits, for the conformance suite (tests/tools/test_conformance_llama.py).

llama-cpp-python 0.3.36 is a C++ build (about 20 minutes on 2 cores; ../shared/peer/install_llama_cpu.sh
builds it into a venv) that CI does not have. It is used wherever it can be found:

    STRATA_LLAMA_PYTHON=/path/to/venv/bin/python   a python that imports llama_cpp (a separate venv:
                                                   it needs nothing of Strata's), or else
    the running python, when it imports llama_cpp itself.

`llama_python()` says which, or why neither (the suite skips with that reason). Everything runs
through `_llama_cpp.py` in a subprocess, so a crash in the C++ (SIGILL on a native build on hosts
that report AMX) fails one call with its exit status instead of killing pytest.

MIXES are the types a released mix uses, each a `llama_model_quantize` call on the converter's F32
output: the plain ftypes (F32, BF16, Q8_0, Q4_K_M, IQ3_XXS, IQ2_XXS, IQ2_XS, IQ4_NL) with the
quantizer's own per-tensor choices, Q2_0 experts through tensor-type overrides on a Q8_0 base with
a Q6_K head, and the release's own layer pattern (IQ2_XS + IQ4_NL experts on layer 0, IQ2_XXS +
Q2_0 on the others). The IQ types get a uniform importance matrix (all ones), which the quantizer
accepts (BRIEF section 5).
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from strata.tools.gguf_io import read_gguf

from . import convert

ENV = "STRATA_LLAMA_PYTHON"
_SCRIPT = Path(__file__).with_name("_llama_cpp.py")
QUANT_VERSION = 1  # part of the cache key: bump when a mix changes

# ggml type numbers (ggml.h) and llama_ftype numbers (llama.h) of llama.cpp 0.3.36
Q8_0, Q2_0, Q6_K, IQ2_XXS, IQ2_XS, IQ4_NL = 8, 42, 14, 16, 17, 20
EXPS = r"blk\.\d+\.ffn_(gate|up|down)_exps\.weight"


@dataclass(frozen=True)
class Mix:
    ftype: int
    overrides: tuple[tuple[str, int], ...] = ()  # (regex, ggml type), first match wins
    output_type: int | None = None
    imatrix: bool = False


MIXES = {
    "F32": Mix(0),
    "BF16": Mix(32),
    "Q8_0": Mix(7),
    "Q4_K_M": Mix(15),
    "IQ3_XXS": Mix(23, imatrix=True),
    "Q2_0-experts": Mix(7, ((EXPS, Q2_0),), output_type=Q6_K),
    "IQ2_XXS": Mix(19, imatrix=True),
    "IQ2_XS": Mix(20, imatrix=True),
    "IQ4_NL": Mix(25),
    "release": Mix(7, ((r"blk\.0\.ffn_(gate|up)_exps\.weight", IQ2_XS), (r"blk\.0\.ffn_down_exps\.weight", IQ4_NL),
                       (r"blk\.\d+\.ffn_(gate|up)_exps\.weight", IQ2_XXS), (r"blk\.\d+\.ffn_down_exps\.weight", Q2_0)),
                   output_type=Q6_K, imatrix=True),
}


class LlamaCppError(RuntimeError):
    """llama.cpp could not quantize or evaluate a file."""


def llama_python() -> tuple[str | None, str]:
    """(python that imports llama_cpp, where it came from) or (None, why there is none)."""
    env = os.environ.get(ENV)
    if env:
        proc = subprocess.run([env, "-c", "import llama_cpp"], capture_output=True, text=True)
        if proc.returncode != 0:
            last = (proc.stderr.strip().splitlines() or [f"exit status {proc.returncode}"])[-1]
            return None, f"{ENV}={env} cannot import llama_cpp ({last})"
        return env, f"{ENV}={env}"
    if importlib.util.find_spec("llama_cpp") is not None:
        return sys.executable, "llama_cpp imported by this python"
    return None, (f"llama_cpp (llama-cpp-python 0.3.36) is not importable here: set {ENV} to a python that "
                  "imports it (../shared/peer/install_llama_cpu.sh builds one)")


def _run(args: list[str]) -> None:
    python, why = llama_python()
    if python is None:
        raise LlamaCppError(why)
    proc = subprocess.run([python, str(_SCRIPT), *args], capture_output=True, text=True)
    if proc.returncode != 0:
        raise LlamaCppError(f"_llama_cpp.py {args[0]} failed (rc {proc.returncode}):\n{proc.stderr[-4000:]}")


def _imatrix_sizes(src: Path, path: Path) -> None:
    # one entry per matrix: ne0 * n_expert floats (ne0 for a 2-D tensor), as llama-quantize reads it
    f = read_gguf(src)
    lines = [f"{n} {t.shape[0] * (t.shape[2] if len(t.shape) > 2 else 1)}" for n, t in f.tensors.items() if len(t.shape) >= 2]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


def quantize(src: Path, dst: Path, mix: Mix) -> Path:
    args = ["quantize", str(src), str(dst), str(mix.ftype)]
    for pattern, t in mix.overrides:
        args += ["--override", f"{pattern}={t}"]
    if mix.output_type is not None:
        args += ["--output-type", str(mix.output_type)]
    with tempfile.TemporaryDirectory() as tmp:
        if mix.imatrix:
            sizes = Path(tmp) / "imatrix.txt"
            _imatrix_sizes(src, sizes)
            args += ["--imatrix", str(sizes)]
        _run(args)
    return dst


def quantized_gguf(arch: str, mix: str, seed: int = 0, **overrides) -> Path:
    """Cached: the tiny `arch` model's F32 conversion quantized by llama.cpp in `mix`."""
    src = convert.reference_gguf(arch, "f32", seed=seed, split_ple=False, **overrides)[0]
    key = hashlib.sha256(f"{src.parent.name}|{MIXES[mix]}|{QUANT_VERSION}".encode()).hexdigest()[:16]
    target = convert.cache_root() / "llama-quant" / f"{arch}-{mix}-s{seed}-{key}"
    out = target / f"tiny-{arch}-{mix}.gguf"
    if out.is_file():
        return out
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{arch}-{mix}-", dir=target.parent))
    try:
        quantize(src, tmp / out.name, MIXES[mix])
        convert._publish(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def logits(gguf: Path, prompts: np.ndarray) -> np.ndarray:
    """llama.cpp's logits at every position of each prompt ([P, n] token ids, each one batch from
    an empty context), float32 [P, n, n_vocab]."""
    with tempfile.TemporaryDirectory() as tmp:
        np.save(Path(tmp) / "tokens.npy", np.asarray(prompts, np.int64).reshape(len(prompts), -1))
        _run(["logits", str(gguf), str(Path(tmp) / "tokens.npy"), str(Path(tmp) / "out.npy")])
        return np.load(Path(tmp) / "out.npy")

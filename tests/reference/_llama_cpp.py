"""llama.cpp itself (llama-cpp-python 0.3.36), driven as a script in a subprocess.

usage: python _llama_cpp.py quantize SRC DST FTYPE [--imatrix SIZES] [--override REGEX=TYPE]...
                                                  [--output-type TYPE]
       python _llama_cpp.py logits GGUF PROMPTS.npy OUT.npy

Run by the python that can import llama_cpp (STRATA_LLAMA_PYTHON, see llama_cpp_ref.py): it needs
only llama_cpp and numpy, nothing of Strata's, so a separate venv works.

quantize: `llama_model_quantize` with the default parameters, `ftype` a llama_ftype number, TYPE a
ggml type number. SIZES is a text file of "tensor_name n" lines: a UNIFORM importance matrix (all
ones, n = ne0 * n_expert) for each, which the quantizer accepts for the IQ types that need one.
logits: every position's logits of each prompt (a row of token ids in PROMPTS.npy, [P, n]), each
evaluated from an empty context in one batch with llama.cpp's defaults (one thread), written as
float32 [P, n, n_vocab].
"""

from __future__ import annotations

import ctypes
import sys

import numpy as np


def _quantize(argv: list[str]) -> int:
    import llama_cpp as L

    src, dst, ftype = argv[0], argv[1], int(argv[2])
    params = L.llama_model_quantize_default_params()
    params.ftype = ftype
    params.nthread = 1
    keep = []  # the ctypes buffers must outlive the call
    overrides, sizes = [], None
    i = 3
    while i < len(argv):
        flag, value = argv[i], argv[i + 1]
        i += 2
        if flag == "--imatrix":
            sizes = [(line.split()[0], int(line.split()[1])) for line in open(value, encoding="utf-8") if line.strip()]
        elif flag == "--override":
            pattern, t = value.rsplit("=", 1)
            overrides.append((pattern, int(t)))
        elif flag == "--output-type":
            params.output_tensor_type = int(value)
        else:
            print(f"_llama_cpp.py quantize: unknown flag {flag}", file=sys.stderr)
            return 2
    if overrides:
        arr = (L.llama_model_tensor_override * (len(overrides) + 1))()
        for k, (pattern, t) in enumerate(overrides):
            arr[k].pattern, arr[k].type = pattern.encode(), t
        arr[len(overrides)].pattern = None
        keep.append(arr)
        params.tt_overrides = arr
    if sizes:
        arr = (L.llama_model_imatrix_data * (len(sizes) + 1))()
        for k, (name, n) in enumerate(sizes):
            ones = (ctypes.c_float * n)(*([1.0] * n))
            keep.append(ones)
            arr[k].name, arr[k].data, arr[k].size = name.encode(), ones, n
        arr[len(sizes)].name = None
        keep.append(arr)
        params.imatrix = arr
    rc = L.llama_model_quantize(src.encode(), dst.encode(), ctypes.byref(params))
    if rc != 0:
        print(f"llama_model_quantize {src} -> {dst} (ftype {ftype}) failed: {rc}", file=sys.stderr)
        return 1
    return 0


def _logits(argv: list[str]) -> int:
    from llama_cpp import Llama

    gguf, tokens_path, out = argv
    prompts = np.load(tokens_path)  # [P, n]
    n = prompts.shape[1]
    llm = Llama(model_path=gguf, n_ctx=max(64, n), n_batch=n, n_ubatch=n, logits_all=True, n_threads=1,
                n_threads_batch=1, verbose=False)
    logits = []
    for row in prompts:
        llm.reset()  # the next eval clears the KV cache and the recurrent state from position 0
        llm.eval([int(t) for t in row])
        logits.append(np.array(llm.scores[:n], dtype=np.float32))
    np.save(out, np.stack(logits))
    return 0


def main() -> int:
    if len(sys.argv) < 2 or sys.argv[1] not in ("quantize", "logits"):
        print(__doc__, file=sys.stderr)
        return 2
    return (_quantize if sys.argv[1] == "quantize" else _logits)(sys.argv[2:])


if __name__ == "__main__":
    sys.exit(main())

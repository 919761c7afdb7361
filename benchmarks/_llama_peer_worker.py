"""llama.cpp (llama-cpp-python) timing a GGUF for benchmarks/llama_peer.py, in its own process.

usage: python _llama_peer_worker.py GGUF THREADS CTX

Run by the python that imports llama_cpp (STRATA_LLAMA_PYTHON: a separate venv works, this script
needs nothing of Strata's). It loads the model once, prints "ready N_VOCAB", then answers one
command per stdin line with one line of numbers:

    decode P N SEED   -> N seconds: each of N single-token evals after a P-token prompt (fresh context),
                         then one more: this process's CPU seconds (all its threads) over those N evals
    prefill L SEED    -> 1 second: one L-token prompt evaluated in batches of 512, from a fresh context

The token ids are drawn from SEED in [0, N_VOCAB) by numpy, as the Strata side draws them.
"""

from __future__ import annotations

import sys
import time

import numpy as np


def main() -> int:
    import llama_cpp as L

    path, threads, ctx = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    llm = L.Llama(model_path=path, n_threads=threads, n_threads_batch=threads, n_ctx=ctx, n_batch=512,
                  n_ubatch=512, verbose=False)
    n_vocab = llm.n_vocab()
    print(f"ready {n_vocab}", flush=True)
    for line in sys.stdin:
        words = line.split()
        if not words:
            continue
        if words[0] == "decode":
            p, n, seed = map(int, words[1:4])
            ids = np.random.default_rng(seed).integers(0, n_vocab, p + n).tolist()
            llm.reset()
            llm.eval(ids[:p])
            out = []
            c0 = time.process_time()
            for t in ids[p:]:
                t0 = time.perf_counter()
                llm.eval([t])
                out.append(time.perf_counter() - t0)
            out.append(time.process_time() - c0)  # on a shared host: the time it ran, not waited
        elif words[0] == "prefill":
            length, seed = map(int, words[1:3])
            ids = np.random.default_rng(seed).integers(0, n_vocab, length).tolist()
            llm.reset()
            t0 = time.perf_counter()
            llm.eval(ids)
            out = [time.perf_counter() - t0]
        else:
            print(f"error unknown command {words[0]}", flush=True)
            continue
        print(" ".join(f"{x:.6f}" for x in out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

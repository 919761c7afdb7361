"""Prefill benchmark: prompt tokens per second of the batched prompt path (--prefill CHUNK) against
the token-by-token path (--prefill off), side by side, on the `seed-4l` synthetic model (production
widths, 4 layers: 3 Gated DeltaNet + 1 QSA, 512 experts, qwen4exp, its IQ3_XXS-style type mix).

    python benchmarks/prefill.py [--threads 2] [--lengths 512,4096] [--chunk 1024] [--sample 16]
                                 [--sample-every 256]
                                 [--cache .cache/bench] [--arch qwen4exp] [--prepare-only]
    python benchmarks/prefill.py --threads 8 --lengths 512 --sweep 1,2,4,8   # the batched path's stages
                                 # at each thread count (decode.py's `sweep`), no side-by-side table

The model is made once with tools/synth.py and packed into --cache (outside git), then reused;
every expert byte is read once before timing (--no-pretouch: not), so neither engine reads the disk.
Each length L gets a random prompt of L tokens and two sessions, fed IN TURN, so a busy host
slows both paths alike: session A takes each chunk through the batched path (timed; the LM head for
the last position only, as `strata generate` does), then session B takes the same tokens through
`Model.step` (timed; the decode path computes every position's logits, as --prefill off does).
Up to 1024 tokens (or with --sample 0) B feeds every token so. Beyond, B goes in pieces of
--sample-every tokens whatever the chunk: each piece's first --sample tokens one at a time (timed),
the rest batched (not timed), and the piece's token-by-token time is its sampled time per token
times its length. A token's cost grows slowly with its position (attention), so this slightly
underestimates the token-by-token time and the speed-up; the sample does not move with --chunk, so
chunk sizes compare on the same estimate. The table says which rows are sampled.

llama.cpp (benchmarks/llama_peer.py: STRATA_LLAMA_PYTHON, or this python if it imports llama_cpp)
evaluates the same L token ids of the same GGUF with the same threads right after Strata's batched
path (batches of 512, its default); the last column is Strata's batched tok/s over llama.cpp's.
Without llama.cpp the table says "not measured".
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import numpy as np


REPO = Path(__file__).resolve().parents[1]


def ensure_pack(cache: Path, arch: str) -> Path:
    """The seed-4l pack in `cache`, made (synth + strata-pack convert) only when absent."""
    from strata.tools import pack as tools_pack
    from strata.tools.synth import PRESETS, synth_command

    pack_dir = cache / f"seed-4l-{arch}-pack"
    if (pack_dir / "manifest.txt").is_file():
        return pack_dir
    cache.mkdir(parents=True, exist_ok=True)
    gguf = cache / f"seed-4l-{arch}.gguf"
    paths = sorted(cache.glob(f"seed-4l-{arch}*.gguf"))
    if not paths:
        paths = synth_command(arch, "seed-4l", gguf)
    print(f"packing {paths[0].name} ...", file=sys.stderr)
    ratio = PRESETS["seed-4l"].compress_ratio if arch == "qwen4exp" else None
    tools_pack.convert(paths[:1], pack_dir, compress_ratio=ratio)
    return pack_dir


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def side_by_side(model, prompt, chunk: int, kv: str, sample: int | None, every: int) -> tuple[float, float]:
    """(seconds of the batched path, seconds of the token-by-token path, measured or sampled)."""
    L = len(prompt)
    a_s, b_s = model.new_session(L, kv), model.new_session(L, kv)
    batched = one_by_one = 0.0
    for a in range(0, L, chunk):
        piece = prompt[a : a + chunk]
        batched += timed(lambda: model.forward(a_s, piece, 1 if a + chunk >= L else 0))
        step = len(piece) if sample is None else every
        for p in range(a, a + len(piece), step):
            part = prompt[p : min(p + step, a + len(piece))]
            k = len(part) if sample is None else min(sample, len(part))
            one_by_one += timed(lambda: [model.step(b_s, int(t)) for t in part[:k]]) * len(part) / k
            if k < len(part):
                model.forward(b_s, part[k:], 0)
    return batched, one_by_one


def sweep(model, counts: list[int], L: int, chunk: int, kv: str) -> int:
    """The batched path's stages on an L-token prompt at each thread count (decode.py's sweep)."""
    import decode

    prompt = np.random.default_rng(L).integers(0, model.geometry.n_vocab, L)

    def run(timers) -> list[float]:
        s = model.new_session(L, kv)
        timers.reset()
        t = sum(timed(lambda: model.forward(s, prompt[a : a + chunk], 1 if a + chunk >= L else 0)) for a in range(0, L, chunk))
        return [t / L] * L  # L "steps" of the mean: the stages' sums are then divided by L

    what = f"a {L}-token prompt in chunks of {chunk} per run; ms per token of the prompt (1000 / it = tok/s)"
    print(decode.machine())
    print(decode.sweep(model, counts, 0, 0, run=run, what=what))
    return 0


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{cpu}, {os.cpu_count()} logical CPUs visible"


def main(argv=None) -> int:
    from strata.engine.budget import PREFILL_AUTO_CHUNK_CPU

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--lengths", default="512,4096")
    ap.add_argument("--chunk", type=int, default=PREFILL_AUTO_CHUNK_CPU, help="default: --prefill auto's chunk on the CPU")
    ap.add_argument("--sample", type=int, default=16,
                    help="beyond 1024 tokens: tokens of each --sample-every fed one by one (0: every token)")
    ap.add_argument("--sample-every", type=int, default=256)
    ap.add_argument("--kv", default="f16")
    ap.add_argument("--arch", default="qwen4exp")
    ap.add_argument("--cache", type=Path, default=REPO / ".cache" / "bench")
    ap.add_argument("--prepare-only", action="store_true", help="make the model and stop")
    ap.add_argument("--no-pretouch", action="store_true", help="do not read the expert bytes once before timing")
    ap.add_argument("--sweep", default="", help="thread counts, e.g. 1,2,4,8: the batched path's stages at each count "
                    "on the first length (decode.py's sweep), instead of the side-by-side table")
    a = ap.parse_args(argv)
    pack_dir = ensure_pack(a.cache, a.arch)
    if a.prepare_only:
        return 0
    from tabulate import tabulate

    from strata.engine.kernels import cpu
    from strata.engine.model import Model
    from strata.engine.ops import reuse_freed_memory, single_blas_thread
    from strata.engine.pack_reader import Pack

    cpu.set_threads(a.threads)
    single_blas_thread()  # as `strata generate` does
    reuse_freed_memory()
    t0 = time.perf_counter()
    model = Model(Pack.open(pack_dir))
    model.warm_up()
    s = model.new_session(a.chunk + 1, a.kv)
    model.forward(s, np.zeros(a.chunk, np.int64), 1)  # the prompt path's first call (BLAS, numba) out of the timing
    print(f"loaded and warmed up in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    # a prompt's routed experts are nearly all of them: untouched, the first chunk (and whichever
    # engine runs first) reads them from the disk where this VM's page cache had dropped them
    # (2026-12-05: 97 tok/s at 512 against 181 for the same path warm)
    if not a.no_pretouch:
        import decode

        print(f"read every expert byte, the PLE table and the embeddings once in {decode.pretouch(model):.1f} s", file=sys.stderr)
    if a.sweep:
        return sweep(model, [int(x) for x in a.sweep.split(",")], int(a.lengths.split(",")[0]), a.chunk, a.kv)
    import llama_peer

    lengths = [int(x) for x in a.lengths.split(",")]
    python, peer_how = llama_peer.find_python()
    peer = None
    if python is not None:
        gguf = sorted(a.cache.glob(f"seed-4l-{a.arch}*.gguf"))[0]
        peer = llama_peer.Peer(python, gguf, a.threads, max(lengths) + 8)
        peer.prefill(64, 999)  # its first eval allocates its buffers
    load = os.getloadavg()[0]
    rows = []
    for L in lengths:
        # the ids the llama.cpp worker draws for `prefill L L`
        prompt = np.random.default_rng(L).integers(0, model.geometry.n_vocab, L)
        sample = None if L <= 1024 or a.sample <= 0 else a.sample
        tb, tt = side_by_side(model, prompt, a.chunk, a.kv, sample, a.sample_every)
        how = f"all {L}" if sample is None else f"the first {sample} of every {a.sample_every}"
        tl = peer.prefill(L, L) if peer is not None else None
        print(f"{L}: batched {L / tb:.2f} tok/s, token by token {L / tt:.2f} tok/s ({how})"
              + (f", llama.cpp {L / tl:.2f} tok/s" if tl else ""), file=sys.stderr)
        peer_cols = (f"{L / tl:.2f}", f"{tl / tb:.2f}x") if tl else ("not measured", "-")
        rows.append((L, f"{L / tb:.2f}", f"{tb:.1f}", f"{L / tt:.2f}", f"{tt:.1f}", f"{tt / tb:.1f}x", how, *peer_cols))
    if peer is not None:
        peer.close()
    commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    print(f"prefill, seed-4l {a.arch}, {a.threads} threads, --kv {a.kv}, chunk {a.chunk}; {machine()}; "
          f"{time.strftime('%Y-%m-%d %H:%M %Z')}; git {commit} + working tree; "
          f"1-minute load average {load:.2f} at the start, {os.getloadavg()[0]:.2f} at the end")
    print(f"llama.cpp: {peer_how}")
    print(tabulate(rows, headers=["tokens", "batched tok/s", "batched s", "token-by-token tok/s", "token-by-token s",
                                  "speed-up", "token-by-token measured on", "llama.cpp tok/s", "batched / llama.cpp"],
                   tablefmt="github", disable_numparse=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())

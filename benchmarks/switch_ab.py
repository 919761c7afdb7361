"""Settings read at a process's start, side by side: the decode token (and the prompt) under two or
more environments, each in its own process (a kernel switch is read when the kernels are built,
OpenMP's settings when its pool starts, so one process cannot hold both), the processes rotated
round by round on the same pack and ids; each side against the first.

    python benchmarks/switch_ab.py STRATA_ROWDOT_PREFETCH_CACHE=l1 STRATA_ROWDOT_PREFETCH_CACHE=l2 \\
        [more sides] [--arch qwen4exp] [--preset seed-4l] [--threads 1,2] [--rounds 4] [--tokens 32] [--prompt 0]

Each process: the pack opened, the token path warmed (its kernels compiled or loaded, so a round
times no compilation), 8 token steps, then --tokens steps timed one by one (median ms); with
--prompt N also one N-token prompt through the batched path (best of 2, tok/s). A side's setting
is VAR=VALUE (several joined by commas); "-" runs the environment as it is. The logits of the timed
steps are compared across the sides: a switch that only changes speed must not move a bit.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]


def worker(arch: str, preset: str, threads: int, tokens: int, prompt: int) -> dict:
    sys.path.insert(0, str(REPO / "benchmarks"))
    import decode as D

    from strata.engine.kernels import cpu
    from strata.engine.model import Model
    from strata.engine.pack_reader import Pack

    cpu.set_threads(threads)
    model = Model(Pack.open(D.ensure_pack(arch, preset)))
    model.warm_up(prompt_path=prompt > 0)
    D.pretouch(model)
    ids = np.random.default_rng(0).integers(0, model.geometry.n_vocab, 8 + tokens + prompt).tolist()
    s = model.new_session(len(ids) + 1)
    for tok in ids[:8]:
        model.step(s, tok)
    wall, h = [], hashlib.sha256()
    for tok in ids[8 : 8 + tokens]:
        t0 = time.perf_counter()
        logits = model.step(s, tok)
        wall.append(time.perf_counter() - t0)
        h.update(np.ascontiguousarray(logits, np.float32).tobytes())
    out = {"ms": 1e3 * float(np.median(wall)), "logits": h.hexdigest()[:16]}
    if prompt:
        best = 0.0
        for _ in range(2):
            p = model.new_session(prompt + 1)
            t0 = time.perf_counter()
            model.forward(p, ids[8 + tokens : 8 + tokens + prompt], 1)
            best = max(best, prompt / (time.perf_counter() - t0))
        out["prompt_tok_s"] = best
    return out


def parse_env(text: str) -> dict:
    if text == "-":
        return {}
    env = {}
    for part in text.split(","):
        k, sep, v = part.partition("=")
        if not sep or not k:
            raise SystemExit(f"switch_ab.py: a side's setting is VAR=VALUE[,VAR=VALUE] or -, got {part!r}")
        env[k] = v
    return env


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("sides", nargs="+", help="VAR=VALUE[,VAR=VALUE] or - (the environment as it is), two or more; "
                                            "the first is the baseline")
    ap.add_argument("--arch", default="qwen4exp", choices=("qwen4exp", "qwen35moe"))
    ap.add_argument("--preset", default="seed-4l")
    ap.add_argument("--threads", default="1,2", help="comma-separated thread counts")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=0, help="also time one prompt of this many tokens (0: none)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args.arch, args.preset, int(args.threads), args.tokens, args.prompt)))
        return 0
    if len(args.sides) < 2:
        ap.error("give two or more sides (the first is the baseline)")
    envs = [parse_env(t) for t in args.sides]
    from tabulate import tabulate

    sys.path.insert(0, str(REPO / "benchmarks"))
    import decode as D

    print(f"{D.machine()}; {args.preset} {args.arch}; sides: " + "; ".join(f"{i}: {t}" for i, t in enumerate(args.sides)), flush=True)
    rows, failed = [], False
    for n in (int(x) for x in args.threads.split(",")):
        res = [[] for _ in envs]
        for r in range(args.rounds):
            order = [(i + r) % len(envs) for i in range(len(envs))]  # who goes first rotates
            for i in order:
                cmd = [sys.executable, __file__, "-", "--worker", "--arch", args.arch, "--preset", args.preset,
                       "--threads", str(n), "--tokens", str(args.tokens), "--prompt", str(args.prompt)]
                p = subprocess.run(cmd, env=dict(os.environ, **envs[i]), capture_output=True, text=True)
                if p.returncode != 0:
                    print(f"switch_ab.py: side {i} ({args.sides[i]}) failed:\n{p.stderr[-3000:]}", file=sys.stderr)
                    return 1
                res[i].append(json.loads(p.stdout.strip().splitlines()[-1]))
        base = np.median([g["ms"] for g in res[0]])
        pbase = np.median([g["prompt_tok_s"] for g in res[0]]) if args.prompt else None
        for i, got in enumerate(res):
            ms = np.array([g["ms"] for g in got])
            row = [n, args.sides[i], " ".join(f"{x:.1f}" for x in ms), f"{np.median(ms):.1f}",
                   "(baseline)" if i == 0 else f"{base / np.median(ms):.3f}x"]
            if args.prompt:
                tps = np.median([g["prompt_tok_s"] for g in got])
                row.append(f"{tps:.1f}" + ("" if i == 0 else f" ({tps / pbase:.3f}x)"))
            rows.append(row)
        failed |= len({g["logits"] for got in res for g in got}) != 1
    heads = ["threads", "side", "ms/token (rounds)", "median", "token speed-up"]
    print(tabulate(rows, headers=heads + (["prompt tok/s"] if args.prompt else []), tablefmt="github", disable_numparse=True))
    print("logits of the timed steps: " + ("DIFFERENT between the sides" if failed else "identical to the bit on every side"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

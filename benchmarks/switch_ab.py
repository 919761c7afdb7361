"""A compile-time kernel switch, before and after: the decode token (and the prompt) under two
environments, each in its own process (the switches are read when the kernels are built, so one
process cannot hold both), the processes alternated round by round on the same pack and ids.

    python benchmarks/switch_ab.py STRATA_ROWDOT_PREFETCH_CACHE=l1 STRATA_ROWDOT_PREFETCH_CACHE=l2 \\
        [--arch qwen4exp] [--preset seed-4l] [--threads 1,2] [--rounds 4] [--tokens 32] [--prompt 0]

Each process: the pack opened, the token path warmed (its kernels compiled or loaded, so a round
times no compilation), 8 token steps, then --tokens steps timed one by one (median ms); with
--prompt N also one N-token prompt through the batched path (best of 2, tok/s). A side's setting
is VAR=VALUE (several joined by commas); "-" runs the environment as it is. The logits of the timed
steps are compared across the two sides: a switch that only changes speed must not move a bit.
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
    ap.add_argument("before", help="VAR=VALUE[,VAR=VALUE] or - (the environment as it is)")
    ap.add_argument("after")
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
    sides = {"before": parse_env(args.before), "after": parse_env(args.after)}
    from tabulate import tabulate

    sys.path.insert(0, str(REPO / "benchmarks"))
    import decode as D

    print(f"{D.machine()}; {args.preset} {args.arch}; before: {args.before}; after: {args.after}", flush=True)
    rows, digests, failed = [], set(), False
    for n in (int(x) for x in args.threads.split(",")):
        res = {k: [] for k in sides}
        for r in range(args.rounds):
            for name in (("before", "after") if r % 2 == 0 else ("after", "before")):  # who goes first alternates
                cmd = [sys.executable, __file__, "-", "-", "--worker", "--arch", args.arch, "--preset", args.preset,
                       "--threads", str(n), "--tokens", str(args.tokens), "--prompt", str(args.prompt)]
                env = dict(os.environ, **sides[name])
                p = subprocess.run(cmd, env=env, capture_output=True, text=True)
                if p.returncode != 0:
                    print(f"switch_ab.py: the {name} process failed:\n{p.stderr[-3000:]}", file=sys.stderr)
                    return 1
                got = json.loads(p.stdout.strip().splitlines()[-1])
                res[name].append(got)
                digests.add((n, got["logits"]))
        b, a = (np.array([g["ms"] for g in res[k]]) for k in ("before", "after"))
        row = [n, " ".join(f"{x:.1f}" for x in b), " ".join(f"{x:.1f}" for x in a), f"{np.median(b) / np.median(a):.3f}x"]
        if args.prompt:
            pb, pa = (np.array([g["prompt_tok_s"] for g in res[k]]) for k in ("before", "after"))
            row.append(f"{np.median(pa) / np.median(pb):.3f}x ({np.median(pb):.1f} -> {np.median(pa):.1f} tok/s)")
        rows.append(row)
        failed |= len({d for t, d in digests if t == n}) != 1
    heads = ["threads", "before ms/token (rounds)", "after ms/token (rounds)", "token speed-up (medians)"]
    print(tabulate(rows, headers=heads + (["prompt speed-up"] if args.prompt else []), tablefmt="github", disable_numparse=True))
    print("logits of the timed steps: " + ("DIFFERENT between the sides" if failed else "identical to the bit on both sides"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

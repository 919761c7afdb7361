"""The IQ2/IQ3 grid types' one-token kernel (rowdot.py) in cache, one thread, under settings of
STRATA_ROWDOT_IQ_CODES side by side: super-blocks a second of thread CPU time on one expert-sized
matrix (640 x 2560, in L2), so the figure is the kernel's own work, not the memory's.

    python benchmarks/grid_kernels.py [SIDE ...] [--rounds 3] [--calls 300]

SIDE: a value of STRATA_ROWDOT_IQ_CODES (IQ2_XS,IQ2_XXS,IQ3_XXS; 0 for none) or "default" (the
variable unset); default: `default 0`, the kernels as they ship against every type's loads.

Each side runs in its own process (the switch is read when the kernels are built), the sides
rotated round by round; a process times 7 passes of --calls calls and keeps the best (the machine
may be shared: the best pass is the one least disturbed). The outputs of the sides are compared:
the forms must give the same bits.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import subprocess
import sys
import time

TYPES = ("IQ2_XXS", "IQ2_XS", "IQ3_XXS")
N_IN, N_OUT = 2560, 640


def worker(calls: int) -> None:
    import numpy as np

    from strata.engine.kernels import cpu, rowdot
    from strata.engine.kernels.actq import quantize_act

    cpu.set_threads(1)
    rng = np.random.default_rng(0)
    act = quantize_act(rng.standard_normal(N_IN).astype(np.float32))
    for name in TYPES:
        sb = rowdot.IQTYPES[name]
        rb = N_IN // 256 * sb
        raw = rng.integers(0, 256, N_OUT * rb, dtype=np.uint8)
        raw.reshape(-1, sb)[:, :2] = (0, 0x3C)  # d = 1.0 (fp16): finite outputs to compare
        kernel = rowdot.one_kernel(name, False, False)
        out = np.zeros(N_OUT, np.float32)
        kernel(raw, rb, act.q, act.d, act.s16, out, 1)  # compiled or loaded before timing
        best = float("inf")
        for _ in range(7):
            t0 = time.process_time()
            for _ in range(calls):
                kernel(raw, rb, act.q, act.d, act.s16, out, 1)
            best = min(best, (time.process_time() - t0) / calls)
        print(name, N_OUT * N_IN / 256 / best / 1e6, hashlib.sha256(out.tobytes()).hexdigest()[:16])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("sides", nargs="*", default=["default", "0"], help="STRATA_ROWDOT_IQ_CODES values; default: the variable unset")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        worker(a.calls)
        return 0
    sides = a.sides
    got: dict = {s: {t: [] for t in TYPES} for s in sides}
    bits: dict = {}
    for r in range(a.rounds):
        for s in sides:
            env = {k: v for k, v in os.environ.items() if k != "STRATA_ROWDOT_IQ_CODES"}
            if s != "default":
                env["STRATA_ROWDOT_IQ_CODES"] = s
            res = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", "--calls", str(a.calls)],
                                 env=env, capture_output=True, text=True)
            if res.returncode:
                print(f"side {s!r}: the worker failed:\n{res.stderr[-2000:]}", file=sys.stderr)
                return 1
            for line in res.stdout.split("\n"):
                if line:
                    name, rate, digest = line.split()
                    got[s][name].append(float(rate))
                    bits.setdefault(name, set()).add(digest)
            print(f"round {r + 1}/{a.rounds}: {s}", file=sys.stderr, flush=True)
    print(f"one thread, {N_OUT} x {N_IN} in cache, M super-blocks a second (median of {a.rounds} rounds; each the best of 7 passes)")
    print(f"| type | {' | '.join(f'IQ_CODES={s}' for s in sides)} | {' | '.join(f'{s} / {sides[0]}' for s in sides[1:])} |")
    print("|---" * (2 * len(sides)) + "|")
    for name in TYPES:
        med = [statistics.median(got[s][name]) for s in sides]
        print(f"| {name} | {' | '.join(f'{m:.1f}' for m in med)} | {' | '.join(f'{m / med[0]:.2f}x' for m in med[1:])} |")
    same = all(len(v) == 1 for v in bits.values())
    print("outputs: identical to the bit on every side" if same else f"outputs DIFFER between sides: {bits}")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())

"""Each kernel's own device time in a captured token step and a captured verify of 1 + 2 rows, by
NVIDIA Nsight Compute (ncu), and the verify's extra time split into parts:

    python3 benchmarks/ncu_forward.py --pack .cache/bench/seed-4l-qwen35moe-pack

runs itself twice under ncu (`--forward step`, `--forward verify`: the tier started, the forward
made and captured four times, then replayed twice inside the profiler's range, the second one
counted) and prints, for the verify against the token step, the routed experts (mvx), the LM head
(the forward's last product), the other products, and every other kernel by name. ncu runs a
graph's kernels one at a time (no clocks or caches touched here: --clock-control none
--cache-control none), so each figure is that kernel alone and the sums exceed the graphs' own
device time (verify_profile.py's `graph ms`). Why: verify_profile.py's eager table times each
launch between CUDA events, ~8 us of a launch's overhead in every row; this has none. Needs a CUDA
GPU and ncu (--ncu, default: on PATH, else /usr/local/cuda/bin/ncu). Ratios only against this run.
"""

from __future__ import annotations

import argparse
import collections
import csv
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

PRODUCT = re.compile(r"^(mv|mvf|mvfm|mvm|mvx|mmq|mmt|mm|fmv|fmvm|fmt)<")


def forward(which: str, pack: Path, threads: int) -> None:
    """The profiled process: one captured token step or verify of 1 + 2 rows, twice in the range."""
    import cupy as cp

    from strata.engine.kernels import cpu
    from strata.engine.model import Model
    from strata.engine.pack_reader import Pack
    from strata.engine.speculative import Snapshot
    from strata.engine.tier import GpuTier, TierOptions

    cpu.set_threads(threads)
    model = Model(Pack.open(pack))
    g, ctx = model.geometry, 1024
    tier = GpuTier.start(model, TierOptions(max_context=ctx, kv="f32", prefill_chunk=64, step="device",
                                            expert_cache=g.n_layer * g.n_expert, spec=3, draft=False))
    model.warm_up()
    be, rng, V = model.backend, np.random.default_rng(0), g.n_vocab
    be.verify_graphs = True
    s = model.new_session(ctx)
    model.forward(s, rng.integers(3, V, 32), n_logits=1)
    snaps, ban = [Snapshot(s, be) for _ in range(3)], np.zeros(0, np.int32)

    def run():
        if which == "step":
            model.step_pick(s, int(rng.integers(3, V)), ban)
        else:
            model.forward(s, rng.integers(3, V, 3), n_logits=3, saved=snaps[:2], pick=ban)

    for _ in range(4):  # eager, captured, replayed
        run()
    be.rt.synchronize()
    cp.cuda.runtime.profilerStart()
    for _ in range(2):
        run()
    be.rt.synchronize()
    cp.cuda.runtime.profilerStop()
    tier.stop()


def kernels(path: Path) -> list[tuple[str, float]]:
    """(name without its arguments, us) in launch order, of the second of the two forwards ncu saw."""
    rows = [r for r in csv.reader(path.open()) if r]
    head = next((i for i, r in enumerate(rows) if "Kernel Name" in r), None)
    if head is None:
        raise SystemExit(f"{path}: no kernel rows in ncu's output (did the forward run? see its stderr)")
    kn, t = rows[head].index("Kernel Name"), rows[head].index("gpu__time_duration.sum")
    scale = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3}[rows[head + 1][t]]
    ks = [(re.sub(r"\(.*", "", r[kn]).replace("void ", "").strip(), float(r[t].replace(",", "")) * scale) for r in rows[head + 2 :]]
    if len(ks) % 2:
        raise SystemExit(f"{path}: {len(ks)} kernels, expected two equal forwards")
    return ks[len(ks) // 2 :]


def parts(ks: list[tuple[str, float]]) -> dict[str, float]:
    last = max(i for i, (n, _) in enumerate(ks) if PRODUCT.match(n) and not n.startswith("mvx<"))
    out: dict[str, float] = collections.defaultdict(float)
    for i, (n, us) in enumerate(ks):
        key = "LM head (the last product)" if i == last else "routed experts (mvx)" if n.startswith("mvx<") else \
            "other products" if PRODUCT.match(n) else n
        out[key] += us
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pack", type=Path, required=True)
    ap.add_argument("--threads", type=int, default=8)
    ap.add_argument("--ncu", default=shutil.which("ncu") or "/usr/local/cuda/bin/ncu")
    ap.add_argument("--forward", choices=("step", "verify"), help="(the profiled process: one forward)")
    a = ap.parse_args(argv)
    if a.forward:
        forward(a.forward, a.pack, a.threads)
        return 0
    got = {}
    with tempfile.TemporaryDirectory() as tmp:
        for which in ("step", "verify"):
            out = Path(tmp) / f"{which}.csv"
            cmd = [a.ncu, "--profile-from-start", "off", "--clock-control", "none", "--cache-control", "none",
                   "--metrics", "gpu__time_duration.sum", "--csv", "--page", "raw",
                   sys.executable, os.path.abspath(__file__), "--forward", which, "--pack", str(a.pack), "--threads", str(a.threads)]
            print(f"ncu: the {which} ...", file=sys.stderr, flush=True)
            with out.open("w") as f:
                rc = subprocess.run(cmd, stdout=f).returncode
            if rc:
                print(f"ncu exited {rc} on the {which}", file=sys.stderr)
                return 1
            got[which] = kernels(out)
    a_, b_ = parts(got["step"]), parts(got["verify"])
    ta, tb = sum(a_.values()), sum(b_.values())
    print(f"{a.pack.name}: each kernel's device time under ncu, us (the token step's {len(got['step'])} kernels, "
          f"the verify's {len(got['verify'])})")
    print(f"{'part':>34} {'token step':>10} {'verify 1+2':>10} {'extra':>8}")
    for k in sorted(set(a_) | set(b_), key=lambda k: -(b_.get(k, 0.0) - a_.get(k, 0.0))):
        x, y = a_.get(k, 0.0), b_.get(k, 0.0)
        print(f"{k[:34]:>34} {x:10.1f} {y:10.1f} {y - x:+8.1f}")
    print(f"{'all':>34} {ta:10.1f} {tb:10.1f} {tb - ta:+8.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

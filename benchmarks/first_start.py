"""First start and warm start: how long a new user waits, and what the default thread count costs on a
busy host.

    python benchmarks/first_start.py [--venv /tmp/strata-fresh] [--skip-fresh] [--busy 1] [--rounds 2]

1. First start, fresh venv: a new virtual environment, `pip install <this checkout>` (not editable: the
   kernels' disk cache then starts empty inside that venv, as for a user), then `strata-pack demo`
   into a new directory, timed (wall and CPU seconds of the whole command, the kernels' compilation
   included). The install itself is timed apart: it is pip's and the network's time, not ours.
2. Warm start: the same venv, `strata generate -m <the demo pack> -p Hello -n 1 --temp 0`, timed
   --rounds times.
3. Threads on a busy host: --busy processes spinning on the CPU (one by default: "one other busy
   process"), then `strata generate` on the demo pack decoding 64 tokens with the default thread
   count, -t 1 and -t 2, interleaved, --rounds rounds; the decode tok/s each (from --stats) and the
   default's ratio to the best fixed choice. The busy processes are stopped at the end.

Everything runs in subprocesses of the venv's own python, as a user's commands would.
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def timed(cmd: list[str], env=None) -> tuple[float, float, str, str]:
    """(wall s, CPU s of the command and its children, stdout, stderr); raises on failure."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, stdin=subprocess.DEVNULL)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    if p.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} exited with {p.returncode}:\n{p.stderr[-3000:]}")
    return wall, cpu, p.stdout, p.stderr


def make_venv(venv: Path) -> float:
    if venv.exists():
        shutil.rmtree(venv)
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", str(REPO)], check=True)
    return time.perf_counter() - t0


def spin() -> None:
    while True:
        pass


def decode_tps(stderr: str) -> float:
    m = re.search(r"^decode .*-> ([0-9.]+) tok/s", stderr, re.M)
    if not m:
        raise SystemExit(f"no decode line in --stats:\n{stderr[-2000:]}")
    return float(m.group(1))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--venv", type=Path, default=Path(tempfile.gettempdir()) / "strata-fresh-venv")
    ap.add_argument("--skip-fresh", action="store_true", help="reuse --venv and its demo pack (steps 2 and 3 only)")
    ap.add_argument("--busy", type=int, default=1, help="spinning processes beside the thread measurement")
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    bin_ = a.venv / "bin"
    work = a.venv / "demo-work"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NUMBA_", "PYTHONPATH"))}
    print(f"# first_start.py, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {platform.node()}, "
          f"{os.cpu_count()} CPUs, python {platform.python_version()}")
    rows = []
    if not a.skip_fresh:
        install_s = make_venv(a.venv)
        rows.append(("pip install (not ours: the registry's and pip's time)", f"{install_s:.1f}", "-"))
        work.mkdir(parents=True)
        wall, cpu, _, err = timed([str(bin_ / "strata-pack"), "demo", "-o", str(work / "demo")], env)
        (work / "first-start.stderr").write_text(err)
        compiled = re.search(r"compiled (\d+) kernels here", err)
        helper = "failed: " + err.split("second process exited with")[1].splitlines()[0] if "second process exited" in err else "ok"
        rows.append((f"first `strata-pack demo` ({compiled.group(1) if compiled else '?'} kernels compiled in it, the "
                     f"prompt path's in a second process: {helper}; stderr in {work / 'first-start.stderr'})",
                     f"{wall:.1f}", f"{cpu:.1f}"))
    pack = work / "demo"
    for r in range(a.rounds):
        wall, cpu, _, _ = timed([str(bin_ / "strata"), "generate", "-m", str(pack), "-p", "Hello", "-n", "1", "--temp", "0"], env)
        rows.append((f"warm `strata generate -n 1`, round {r + 1}", f"{wall:.2f}", f"{cpu:.2f}"))
    print("\n## First and warm start (wall and CPU seconds)\n")
    print("| step | wall s | CPU s |\n|---|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")

    import multiprocessing as mp

    busy = [mp.get_context("spawn").Process(target=spin, daemon=True) for _ in range(a.busy)]
    for p in busy:
        p.start()
    try:
        time.sleep(1.0)
        speeds: dict[str, list[float]] = {"default": [], "-t 1": [], "-t 2": []}
        for _ in range(a.rounds):
            for name in speeds:
                flags = [] if name == "default" else name.split()
                _, _, _, err = timed([str(bin_ / "strata"), "generate", "-m", str(pack), "-p", "Hello", "-n", "64",
                                      "--temp", "0", "--ignore-eos", "--stats", *flags], env)
                speeds[name].append(decode_tps(err))
    finally:
        for p in busy:
            p.terminate()
    best_fixed = max(max(speeds["-t 1"]), max(speeds["-t 2"]))
    print(f"\n## Decode tok/s with {a.busy} spinning process(es) beside it ({a.rounds} rounds, interleaved)\n")
    print("| threads | " + " | ".join(f"round {i + 1}" for i in range(a.rounds)) + " | best / default |")
    print("|---|" + "---|" * a.rounds + "---|")
    for name, v in speeds.items():
        ratio = best_fixed / max(v)
        print(f"| {name} | " + " | ".join(f"{x:.1f}" for x in v) + f" | {ratio:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

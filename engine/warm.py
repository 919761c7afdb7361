"""Getting a loaded model's kernels ready: loaded from the disk cache, or on a first start compiled,
in two processes, saying so.

A fresh install has no compiled kernels: the demo model's ~30 kernels took ~116 s of one core to
compile (2026-12-01), in silence, inside a 7-minute first `strata-pack demo` on a busy 2-core host.
Numba compiles one kernel at a time per process (a global compiler lock), but the disk cache
(kernels/jit.py) is shared between processes. So when the first kernel of the token step turns out
not to be cached, a second process starts that opens the same pack and runs the prompt path's
warm-up (the panel and grouped kernels, about half the work), while this one compiles the token
step's; this one then runs the prompt path's warm-up itself and finds those kernels in the cache.
Both give the same machine code: a kernel compiled in either process is the same cached entry.
If the helper fails, nothing is lost but time: this process compiles what is missing itself.

    python -m strata.engine.warm PACK [--native GGUF] [--ple-gguf GGUF]   (the helper; no output)
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from .kernels import jit


def warm_up(model, prompt_path: bool, helper_argv: list[str] | None, log: Callable[[str], None]) -> int:
    """model.warm_up(prompt_path), with the first start's second process (`helper_argv`: the pack's
    arguments for it; None: none) and progress on `log`; returns the number of kernels compiled here."""
    compiled: list[str] = []
    helper: list[subprocess.Popen] = []
    t0 = time.perf_counter()

    def missed(tag: str, where: str) -> None:
        if not compiled:
            log(f"compiling the kernels for this machine's CPU (first start only; later starts load them from {where})")
            if prompt_path and helper_argv is not None:
                helper.append(_start_helper(helper_argv))
                log("  the prompt path's kernels compile in a second process meanwhile")
        compiled.append(tag)
        log(f"  compiling {tag.rsplit('-', 1)[0]} ({time.perf_counter() - t0:.0f} s)")

    with jit.on_compile(missed):
        model.warm_up_token()
        for p in helper:
            _join(p, log)
        model.warm_up(prompt_path, token=False)
    if compiled:
        log(f"compiled {len(compiled)} kernels here in {time.perf_counter() - t0:.0f} s")
    return len(compiled)


def _start_helper(argv: list[str]) -> subprocess.Popen:
    # -P: no current directory on sys.path. Run from a clone of this repository (as README says),
    # `python -m` found the checkout's top-level strata/ folder (the namespace's bare __init__.py)
    # before the installed package, and the helper died on "No module named 'strata.engine'".
    return subprocess.Popen([sys.executable, "-P", "-m", "strata.engine.warm", *argv], stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def _join(p: subprocess.Popen, log) -> None:
    _, err = p.communicate()
    if p.returncode != 0:
        last = (err or b"").decode(errors="replace").strip().splitlines()[-1:] or ["no message"]
        log(f"  the second process exited with {p.returncode} ({last[0]}); compiling its kernels here")


def helper_argv(pack: Path, native: Path | None, ple_gguf: Path | None) -> list[str]:
    argv = [str(pack)]
    if native is not None:
        argv += ["--native", str(native)]
    if ple_gguf is not None:
        argv += ["--ple-gguf", str(ple_gguf)]
    return argv


def _main(argv: list[str]) -> int:
    from .kernels import cpu
    from .model import Model
    from .pack_reader import Pack

    pack, native, ple = argv[0], None, None
    rest = argv[1:]
    while rest:
        flag, value, rest = rest[0], rest[1], rest[2:]
        if flag == "--native":
            native = value
        elif flag == "--ple-gguf":
            ple = value
        else:
            raise SystemExit(f"strata.engine.warm: unknown argument {flag}")
    cpu.set_threads(1)  # it compiles; the other process runs
    model = Model(Pack.open(Path(pack), native=native and Path(native), ple_gguf=ple and Path(ple)))
    model.warm_up_prompt(select=False)  # QSA's top-k: the other process's last token step
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))

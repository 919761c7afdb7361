"""The GPU tier's kernel modules on a first start: compiled side by side, in processes of their own.

NVRTC compiles a module on one core, 12-16 s a block type's on the H100's host, and the tier's
startup compiled its block types' modules, actq's and the device step's one after another: seed-4l
qwen35moe's took 71 s of compiling (2026-12-06), most of its first start. CuPy keeps a module asked
for by name expressions on disk, keyed by its source, options and names, and a later process loads
it (measured there: the device step's module 7.44 s compiled, 0.13 s loaded). So the startup asks
`ahead` first: the modules this card has not compiled yet are compiled in spawned processes at
once (each its own CUDA context; they have exited before the startup measures free memory) into
that cache, and the startup's own compiles then load them. On an H200's host (2026-12-06) the demo
pack's 12 modules took 20.2 s so, against ~123 s one after another; its next start took 3.9 s in all.

Which modules are compiled already: a marker file per module in CuPy's cache folder, named by a
hash of what CuPy keys the module by (its source text, options and names) and of the CuPy and
NVRTC versions and the card's architecture. Kept in that folder, the markers go when the cache is
cleared. A marker that lies costs only time: the startup compiles that module itself, as before.
Nothing here can change a result: every module is compiled from the same source by the same
compiler, in whichever process.

    STRATA_COMPILE_AHEAD=0     the startup compiles every module itself, one after another
    STRATA_COMPILE_AHEAD=N     at most N processes (default: the host's cores, at most 16)
"""

from __future__ import annotations

import functools
import hashlib
import multiprocessing as mp
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ..kernels import gpu

DEVICE_STEP = "device step"  # the key of engine/tier/device.py's module (device_kernels.cu)
MOST_PROCESSES = 16
FLOAT_KEYS = frozenset(t.name for t in gpu.TYPES if not t.quantized)


def module_source(key: str) -> tuple[Path, list[str]]:
    """The source file and the kernels (name expressions) of a module: a type name's, "actq"'s or
    DEVICE_STEP's."""
    if key == DEVICE_STEP:
        from . import device  # (imported here: the device step's module pulls in the whole tier)

        return device.KERNELS, list(device._NAMES)
    return gpu.SOURCE, gpu.module_names(key)


def compile_one(key: str) -> None:
    """Compile (or load) one module in this process, as its first use would."""
    if key == DEVICE_STEP:
        path, names = module_source(key)
        gpu.runtime().compile(names, source=path)
    else:
        gpu.compile_module(key)


def cache_dir() -> Path | None:
    """CuPy's kernel cache folder, or None where it keeps no disk cache (CUPY_CACHE_IN_MEMORY)."""
    if os.environ.get("CUPY_CACHE_IN_MEMORY", "0") not in ("", "0"):
        return None
    return Path(os.environ.get("CUPY_CACHE_DIR") or Path.home() / ".cupy" / "kernel_cache")


def marker(key: str, folder: Path, card: str) -> Path:
    """The marker of `key`'s module compiled for `card` (its versions and architecture) in `folder`."""
    path, names = module_source(key)
    h = hashlib.sha256()
    for part in (key, _source_digest(path), "\0".join(gpu.OPTIONS), "\0".join(names), card):
        h.update(part.encode())
        h.update(b"\1")
    return folder / f"strata-module-{h.hexdigest()[:32]}.ok"


@functools.lru_cache(maxsize=None)
def _source_digest(path: Path) -> str:
    """A source file's hash, read once a process (every block type's marker hashes the same file)."""
    return hashlib.sha256(path.read_bytes()).hexdigest()


def card_of(rt) -> str:
    """What besides the source decides a compiled module: CuPy's and NVRTC's versions and the
    architecture of the current device."""
    cp = rt.cp
    try:
        nvrtc = ".".join(map(str, cp.cuda.nvrtc.getVersion()))
    except Exception:  # noqa: BLE001 (an unknown version only makes the marker stricter than CuPy's key)
        nvrtc = "?"
    return f"cupy {cp.__version__} nvrtc {nvrtc} sm {cp.cuda.Device().compute_capability}"


def write_marker(path: Path) -> None:
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text("compiled\n")
    tmp.replace(path)


def _child(job: tuple) -> tuple[str, float, str]:
    """A spawned process's work: compile one module into CuPy's cache (`compile`, compile_one
    unless a test gives another), then mark it."""
    key, folder, card, compile = job
    t0 = time.perf_counter()
    try:
        compile(key)
        write_marker(marker(key, Path(folder), card))
    except Exception as e:  # noqa: BLE001 (the startup compiles it itself and raises the real error there)
        return key, time.perf_counter() - t0, f"{type(e).__name__}: {e}".splitlines()[0][:200]
    return key, time.perf_counter() - t0, ""


@dataclass
class Ahead:
    """What `ahead` did: the modules it found compiled, those it compiled and in how many
    processes, those that failed (key -> why), each process's (key, seconds, why or ""), and its
    wall time."""

    cached: list[str] = field(default_factory=list)
    rows: list[tuple[str, float, str]] = field(default_factory=list)
    compiled: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)
    processes: int = 0
    seconds: float = 0.0
    why_not: str = ""  # why it compiled nothing ahead ("" where it did or had nothing to do)


def processes_wanted() -> int:
    """STRATA_COMPILE_AHEAD's process count: 0 off, default the host's cores (at most 16)."""
    v = os.environ.get("STRATA_COMPILE_AHEAD", "")
    if v == "":
        return min(MOST_PROCESSES, os.cpu_count() or 1)
    try:
        n = int(v)
    except ValueError:
        raise ValueError(f"STRATA_COMPILE_AHEAD={v!r}: expected 0 (off) or a number of processes") from None
    if n < 0:
        raise ValueError(f"STRATA_COMPILE_AHEAD={v!r}: expected 0 (off) or a number of processes")
    return n


def card_of_runtime(rt) -> str | None:
    """card_of for CuPy's runtime; None for another (the host emulation compiles nothing)."""
    return card_of(rt) if isinstance(rt, gpu.CupyRuntime) else None


def ahead(keys: Sequence[str], card: str | None, log: Callable[[str], None] = lambda _: None, *,
          processes: int | None = None, pool: Callable | None = None, compile: Callable[[str], None] = compile_one) -> Ahead:
    """Compile the modules of `keys` that this card (card_of_runtime; None: nothing to do) has not
    compiled yet, in parallel processes, into CuPy's disk cache: this process then loads them.
    `processes`: the most at once (default STRATA_COMPILE_AHEAD's); `pool(n)`: a pool of n
    workers with map (default spawned processes); `compile(key)`: one module's compile, a
    top-level function (a spawned process imports it)."""
    a = Ahead()
    t0 = time.perf_counter()
    n_most = processes_wanted() if processes is None else processes
    folder = cache_dir()
    if card is None:
        a.why_not = "not on CuPy's runtime"
        return a
    if folder is None:
        a.why_not = "CuPy keeps no disk cache (CUPY_CACHE_IN_MEMORY)"
        return a
    if n_most <= 1:
        a.why_not = "STRATA_COMPILE_AHEAD=0" if n_most == 0 else "one process"
        return a
    missing = []
    for key in dict.fromkeys(keys):
        (a.cached if marker(key, folder, card).exists() else missing).append(key)
    if len(missing) < 2:  # one module compiles as fast in the startup itself
        return a
    folder.mkdir(parents=True, exist_ok=True)
    a.processes = min(n_most, len(missing))
    log(f"compiling {len(missing)} GPU kernel modules for this card in {a.processes} processes "
        f"(first start only; later starts load them from {folder})")
    make = pool if pool is not None else mp.get_context("spawn").Pool  # spawn: a forked child cannot use CUDA
    # the slowest first (a block type's module, ~15 s; the device step's ~7 s; a float type's or actq's a few)
    order = sorted(missing, key=lambda k: (k == "actq", k in FLOAT_KEYS, k == DEVICE_STEP))
    try:
        with make(a.processes) as p:
            rows = p.map(_child, [(k, str(folder), card, compile) for k in order], chunksize=1)
    except Exception as e:  # noqa: BLE001 (nothing lost but time: the startup compiles them itself)
        a.failed = dict.fromkeys(missing, f"the processes failed: {type(e).__name__}: {e}")
        log(f"  compiling in parallel failed ({type(e).__name__}: {e}); the startup compiles them one by one")
        a.seconds = time.perf_counter() - t0
        return a
    a.rows = rows
    for key, s, why in rows:
        if why:
            a.failed[key] = why
            log(f"  {key}: failed in its process ({why}); the startup compiles it itself")
        else:
            a.compiled.append(key)
    a.seconds = time.perf_counter() - t0
    log(f"  {len(a.compiled)} modules compiled in {a.seconds:.1f} s ({sum(s for _, s, _ in rows):.0f} s of compiling, "
        f"the longest {max(s for _, s, _ in rows):.1f} s)")
    return a


def mark_loaded(keys: Sequence[str], card: str | None) -> None:
    """Mark modules this process has compiled (or loaded) itself: a start that compiled one by one
    (STRATA_COMPILE_AHEAD=0, or a failed process) leaves what it compiled marked as well."""
    folder = cache_dir()
    if folder is None or card is None or not folder.is_dir():
        return
    for key in keys:
        m = marker(key, folder, card)
        if not m.exists():
            write_marker(m)


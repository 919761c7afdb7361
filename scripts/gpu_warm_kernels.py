"""Compile every GPU kernel module once, in parallel processes, into CuPy's on-disk kernel cache.

    python3 scripts/gpu_warm_kernels.py [PROCESSES]    # default: the machine's cores, at most 16

scripts/gpu_suite.sh runs it before its test shards. NVRTC compiles a module on one core, 12-16 s a
block type's on the H100's host (7 at once), and the shard holding tests/gpu/test_kernels_gpu.py compiled every
block type's module itself, one after another: on a fresh H100 (2026-12-06) it was cut at its 520 s
limit after 239 of its 271 tests while the other three shards finished in 215-274 s. CuPy 14 keeps a
module asked for by name expressions on disk, keyed by its source, options and names, and a later
process loads it (measured there: the device step's module 7.44 s compiled, 0.13 s loaded; Q4_K's
14.80 s and 0.01 s), so the shards then load what this compiled. On that H100 all 25 modules took
45 s at 16 processes (435 s of compiling, 15-28 s a block type's), and the kernel tests' products
of 9 block types (few_row, matmul_many: 21 tests) then ran in 8 s.
Prints a table: module, seconds, result. Exit status 1 when a module failed to compile.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import sys
import time


def _compile(key: str) -> tuple[str, float, str]:
    from strata.engine.kernels import gpu

    t0 = time.perf_counter()
    try:
        if key == "device step":  # engine/tier/device.py's fused row operations
            from strata.engine.tier import device

            gpu.runtime().compile(device._NAMES, source=device.KERNELS)
        else:
            gpu.compile_module(key)
    except Exception as e:  # noqa: BLE001 (reported in the table; the shards then show it too)
        return key, time.perf_counter() - t0, f"FAILED {type(e).__name__}: {e}".splitlines()[0][:200]
    return key, time.perf_counter() - t0, "ok"


def module_keys() -> list[str]:
    """Every module the engine compiles: each block type's, the device step's, actq's; the block
    types' first (the slowest), so that no long compile starts last."""
    from strata.index_format.ggml_types import TYPES

    return [t.name for t in TYPES if t.quantized] + ["device step"] + [t.name for t in TYPES if not t.quantized] + ["actq"]


def main(argv: list[str]) -> int:
    from strata.engine.kernels import gpu

    ok, why = gpu.available()
    if not ok:
        print(f"gpu_warm_kernels: no GPU ({why})", file=sys.stderr)
        return 1
    procs = int(argv[0]) if argv else min(16, os.cpu_count() or 1)
    keys = module_keys()
    t0 = time.perf_counter()
    # spawn: each process its own CUDA context (a forked one cannot use the parent's)
    with mp.get_context("spawn").Pool(procs) as pool:
        rows = pool.map(_compile, keys, chunksize=1)
    print(f"{'module':>11} {'s':>6}  result")
    for key, s, result in rows:
        print(f"{key:>11} {s:6.1f}  {result}")
    print(f"{len(keys)} modules in {time.perf_counter() - t0:.1f} s, {procs} processes")
    return 0 if all(r == "ok" for _, _, r in rows) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

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
It takes the GPU tier's own first-start path (engine/tier/compile_ahead.py), which skips what is
marked compiled for this card already. Prints a table: module, seconds, result. Exit status 1 when
a module failed to compile.
"""

from __future__ import annotations

import os
import sys


def module_keys() -> list[str]:
    """Every module the engine compiles: each block type's, the device step's, actq's, each block
    type's few-row products' (gpu.ROWS); the block types' first (the slowest), so that no long
    compile starts last."""
    from strata.index_format.ggml_types import TYPES

    from strata.engine.kernels import gpu
    from strata.engine.tier.compile_ahead import DEVICE_STEP

    return ([t.name for t in TYPES if t.quantized] + [DEVICE_STEP] + [t.name for t in TYPES if not t.quantized] + ["actq"]
            + [t.name + gpu.ROWS for t in TYPES if t.quantized])


def main(argv: list[str]) -> int:
    from strata.engine.kernels import gpu

    ok, why = gpu.available()
    if not ok:
        print(f"gpu_warm_kernels: no GPU ({why})", file=sys.stderr)
        return 1
    from strata.engine.tier import compile_ahead

    procs = int(argv[0]) if argv else min(compile_ahead.MOST_PROCESSES, os.cpu_count() or 1)
    keys = module_keys()
    # the engine's own first-start path (the GPU tier's startup takes it too): the modules not yet
    # marked compiled for this card, in `procs` spawned processes, each marked once compiled
    a = compile_ahead.ahead(keys, compile_ahead.card_of(gpu.runtime()), print, processes=procs)
    print(f"{'module':>11} {'s':>6}  result")
    for key, s, why in a.rows:
        print(f"{key:>11} {s:6.1f}  {'FAILED ' + why if why else 'ok'}")
    for key in a.cached:
        print(f"{key:>11} {'':>6}  compiled before")
    print(f"{len(keys)} modules in {a.seconds:.1f} s, {len(a.compiled)} compiled in {a.processes} processes, "
          f"{len(a.cached)} compiled before{'; ' + a.why_not if a.why_not else ''}")
    return 1 if a.failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

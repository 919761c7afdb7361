"""The GPU tests dealt to scripts/gpu_suite.sh's shards (pytest processes run side by side).

    python3 scripts/gpu_shards.py SHARDS LOG_DIR FILE...    # reads LOG_DIR/gpu_collected.txt,
                                                            # writes LOG_DIR/gpu_shard_K.txt

gpu_collected.txt is `pytest --collect-only -q` of the files, its node ids cut at their parameters
and counted (`uniq -c`): a count per test function ("tests/gpu/test_x.py::test_y"). Each function
goes, the largest count first, to the shard with the fewest tests so far, and a shard runs its
functions' node ids. Dealt by line count, test_kernels_gpu.py (255 tests, the module compiles of
every block type) shared its shard with another file and was cut at 430 s after 223 tests while two
shards had finished in 30 and 170 s (2026-12-05); dealt by file, it had a shard of its own and was
still cut at ~500 s (2026-12-06, an H100, every module compiled before: its own tests take that
long) while the other three finished in 53, 99 and 129 s. A file the collection did not list
counts 1 and still runs whole, so its own collection error shows in its shard's log.
"""

from __future__ import annotations

import sys
from pathlib import Path


def deal(counts: dict[str, int], files: list[str], shards: int) -> list[list[str]]:
    """The files' tests -> `shards` lists of node ids (some empty where there are fewer): each
    counted key of a file (a test function's "file::name", or the file itself), else the file
    whole, by count, the largest first, to the least loaded shard."""
    units = []
    for f in dict.fromkeys(files):
        mine = [k for k in counts if k == f or k.startswith(f + "::")]
        units += mine or [f]
    load, dealt = [0] * shards, [[] for _ in range(shards)]
    for u in sorted(units, key=lambda u: (-counts.get(u, 0), u)):
        k = load.index(min(load))
        load[k] += max(counts.get(u, 0), 1)
        dealt[k].append(u)
    return dealt


def read_counts(text: str) -> dict[str, int]:
    """`uniq -c` lines ("    24 tests/gpu/test_kernels_gpu.py::test_deq_h") -> {key: count}."""
    counts = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[0].isdigit():
            counts[parts[1]] = int(parts[0])
    return counts


def main(argv: list[str]) -> int:
    if len(argv) < 3 or not argv[0].isdigit() or int(argv[0]) < 1:
        print("usage: gpu_shards.py SHARDS LOG_DIR FILE...", file=sys.stderr)
        return 2
    shards, log, files = int(argv[0]), Path(argv[1]), argv[2:]
    collected = log / "gpu_collected.txt"
    counts = read_counts(collected.read_text()) if collected.exists() else {}
    for k, fs in enumerate(deal(counts, files, shards)):
        (log / f"gpu_shard_{k}.txt").write_text(" ".join(fs))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

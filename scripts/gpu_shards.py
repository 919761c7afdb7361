"""The GPU tests dealt to scripts/gpu_suite.sh's shards (pytest processes run side by side).

    python3 scripts/gpu_shards.py SHARDS LOG_DIR FILE...    # reads LOG_DIR/gpu_collected.txt,
                                                            # writes LOG_DIR/gpu_shard_K.txt

gpu_collected.txt is `pytest --collect-only -q` of the files, its node ids cut at their parameters
and counted (`uniq -c`): a count per test function ("tests/gpu/test_x.py::test_y"). Each function
goes, the heaviest first (its count, or the measured seconds of SECONDS' few), to the shard with
the least so far, and a shard runs its functions' node ids. Dealt by line count, test_kernels_gpu.py (255 tests, the module compiles of
every block type) shared its shard with another file and was cut at 430 s after 223 tests while two
shards had finished in 30 and 170 s (2026-12-05); dealt by file, it had a shard of its own and was
still cut at ~500 s (2026-12-06, an H100, every module compiled before: its own tests take that
long) while the other three finished in 53, 99 and 129 s. A file the collection did not list
counts 1 and still runs whole, so its own collection error shows in its shard's log.
"""

from __future__ import annotations

import sys
from pathlib import Path


# Test functions that take far longer than their count says, in seconds on a card (summed over their
# parameters; 2026-12-06, `--durations` of an H100 and an H200 run), weighed as SECONDS / PER_TEST
# tests: a shard dealt by count alone took two of them and was cut at 330 s while another finished
# in 48 s. scripts/gpu_suite_summary.py prints a run's slowest functions to update this from.
SECONDS = {
    "tests/gpu/test_device_step.py::test_the_device_step_gives_the_cpu_logits_for_qwen4exp": 47,
    "tests/gpu/test_device_ahead.py::test_qwen4exp_runs_ahead_with_the_plain_loops_tokens_and_states": 34,
    "tests/gpu/test_gpu_tier.py::test_logits_are_bit_identical_whatever_the_split_qwen4exp": 32,
    "tests/gpu/test_device_step.py::test_the_device_step_gives_the_cpu_logits": 30,  # (two of its cases: 25)
    "tests/gpu/test_device_prompt.py::test_the_qwen4exp_chunk_path_has_the_host_paths_bits": 30,  # (one case: 26)
    "tests/gpu/test_device_step.py::test_the_prompts_dense_products_through_cublas_keep_the_cpu_logits": 13,
    # estimated, not timed alone: its shard was cut inside it twice, and 4 tests with it took 260 s
    # (before its rows were cut to a third)
    "tests/gpu/test_kernels_gpu.py::test_mmt_keeps_mm_bits_on_long_rows_and_many_tiles": 60,
    "tests/gpu/test_device_step.py::test_qwen4exp_blocks_on_the_device_are_the_cpus": 8,
}
PER_TEST = 0.35  # seconds a test on average (2026-12-06: 169 tests in 48-71 s a shard without those)


def weight(counts: dict[str, int], unit: str) -> int:
    """A unit's share of a shard, in tests: its count, or its SECONDS' worth where that is more."""
    return max(counts.get(unit, 0), 1, round(SECONDS.get(unit, 0) / PER_TEST))


def deal(counts: dict[str, int], files: list[str], shards: int) -> list[list[str]]:
    """The files' tests -> `shards` lists of node ids (some empty where there are fewer): each
    counted key of a file (a test function's "file::name", or the file itself), else the file
    whole, by weight (its count, or its SECONDS), the largest first, to the least loaded shard."""
    units = []
    for f in dict.fromkeys(files):
        mine = [k for k in counts if k == f or k.startswith(f + "::")]
        units += mine or [f]
    load, dealt = [0] * shards, [[] for _ in range(shards)]
    for u in sorted(units, key=lambda u: (-weight(counts, u), u)):
        k = load.index(min(load))
        load[k] += weight(counts, u)
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

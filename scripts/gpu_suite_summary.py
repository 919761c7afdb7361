"""The table scripts/gpu_suite.sh prints last: GPU test counts (each failure's first line), the
benchmark's device and summary lines, where the logs are, PASS or FAIL.

    python3 scripts/gpu_suite_summary.py LOG_DIR PYTEST_EXIT BENCH_EXIT|skipped    (exit 0 = PASS)

PASS needs pytest's exit 0 and at least one test that ran (all-skipped, no GPU seen, is a FAIL),
and the GPU tier benchmark's table with every configuration's logits equal to the CPU run's (B2)
and every mem_mark within 1% of the card's used memory (B3).
"""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET
from pathlib import Path


def test_rows(log: Path, test_rc: int) -> tuple[list[tuple[str, str]], bool]:
    suites, missing = [], []
    for path in sorted(log.glob("gpu_tests*.xml")):  # one a shard (gpu_suite.sh runs several pytest processes)
        try:
            root = ET.parse(path).getroot()
        except (OSError, ET.ParseError) as e:
            missing.append(f"{path.name}: {e}")
            continue
        suites += [root] if root.tag == "testsuite" else list(root)
    for path in sorted(log.glob("gpu_tests_*.log")):  # a shard its time limit cut wrote its log, not its file
        if not path.with_suffix(".xml").exists():
            shard = path.stem.rsplit("_", 1)[-1]
            files = log / f"gpu_shard_{shard}.txt"
            missing.append(f"shard {shard} left no result file (cut at its time limit?)"
                           + (f": {files.read_text().strip()}" if files.exists() else ""))
    if not suites or missing:
        why = " (timed out)" if test_rc == 124 else ""
        what = "; ".join(missing) or "no result file"
        if not suites:
            return [("GPU tests", f"{what}; pytest exit {test_rc}{why} -- see gpu_tests.log")], False
    n = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    passed = n["tests"] - n["failures"] - n["errors"] - n["skipped"]
    rows = [("GPU tests", f"{passed} passed, {n['failures']} failed, {n['errors']} errors, {n['skipped']} skipped (pytest exit {test_rc})")]
    if missing:  # a shard cut by its timeout leaves no file: its tests are not counted above
        rows.append(("  NO RESULT", "; ".join(missing)[:200]))
    cases = [c for s in suites for c in s.iter("testcase")]
    for case in cases:
        for bad in case.findall("failure") + case.findall("error"):
            first = (bad.get("message") or "").strip().splitlines()[:1]
            rows.append(("  FAILED", f"{case.get('name')}: {first[0][:200] if first else '(no message)'}"))
    for secs, fn in slowest(cases):  # (gpu_shards.py's SECONDS are taken from these)
        rows.append(("  slowest", f"{secs:6.1f} s  {fn}"))
    skips = [(c.get("name"), s.get("message") or "") for c in cases for s in c.findall("skipped")]
    for name, why in skips[:3]:
        rows.append(("  skipped", f"{name}: {why[:200]}"))
    if len(skips) > 3:
        rows.append(("  skipped", f"... and {len(skips) - 3} more"))
    return rows, test_rc == 0 and passed > 0 and not missing


def slowest(cases, n: int = 8) -> list[tuple[float, str]]:
    """The n test functions that took longest, each its parameters' seconds summed: (seconds,
    "tests/x.py::test_y"), from JUnit testcases (classname "tests.x", name "test_y[param]")."""
    total: dict[str, float] = {}
    for c in cases:
        fn = c.get("classname", "").replace(".", "/") + ".py::" + (c.get("name") or "").split("[")[0]
        total[fn] = total.get(fn, 0.0) + float(c.get("time") or 0.0)
    return sorted(((v, k) for k, v in total.items()), reverse=True)[:n]


def tier_rows(log: Path, bench_rc: int) -> tuple[list[tuple[str, str]], bool]:
    """benchmarks/gpu_tier.py's table, one row per configuration, and whether it holds B2 and B3:
    every configuration's logits equal the CPU run's, every mem_mark within 1% of the card's use."""
    path = log / "bench_gpu_tier.md"
    if not path.exists():
        return [("tier bench", f"no table (exit {bench_rc}{', timed out' if bench_rc == 124 else ''}): see bench_gpu_tier.log")], False
    rows, ok = [], True
    for line in path.read_text(errors="replace").splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 12 and cells[0] not in ("config",) and not set(cells[0]) <= set("-: "):
            rows.append(("  " + cells[0], f"slots {cells[1]} ({cells[2]}), hit rate {cells[5]}, prefill {cells[6]} tok/s, "
                                          f"decode {cells[7]} tok/s ({cells[8]} cpu), mem_mark {cells[10]}, "
                                          f"logits == cpu: {cells[11]}"))
            worst = cells[10].split("%")[0]
            ok = ok and cells[11] == "yes" and (worst == "-" or float(worst) < 1.0)
    if not ok:
        rows.append(("  BROKEN", "a configuration's logits differ from the CPU run's (B2) or a mem_mark is off by 1% or more (B3)"))
    return [("tier bench", path.read_text(errors="replace").splitlines()[0][:200])] + rows, ok and len(rows) > 1


def bench_rows(log: Path, bench_rc: int) -> list[tuple[str, str]]:
    path = log / "bench_kernels_gpu.log"
    if not path.exists():
        return [("kernel bench", "not run (SKIP_KERNEL_BENCH)")]
    lines = path.read_text(errors="replace").splitlines()
    device = [l for l in lines if "streaming read" in l and not l.startswith("summary:")]
    summary = [l for l in lines if l.startswith("summary:")]
    last = next((l for l in reversed(lines) if l.strip()), "empty log")[:200]
    return [
        ("bench device", device[0] if device else "-"),
        ("bench summary", summary[-1] if summary else f"none (exit {bench_rc}{', timed out' if bench_rc == 124 else ''}): {last}"),
    ]


def serve_rows(log: Path) -> list[tuple[str, str]]:
    """benchmarks/serve_streams.py's table, one row per stream count (informational: not in PASS)."""
    path = log / "bench_serve.log"
    if not path.is_file():
        return [("serve bench", "not run")]
    rows = [l for l in path.read_text(errors="replace").splitlines() if l.startswith("| ") and l[2:3].isdigit()]
    if not rows:
        return [("serve bench", "no table: see bench_serve.log")]
    out = [("serve bench", "streams: aggregate decode tok/s, vs 1 stream, time to first token (median, max)")]
    return out + [("  " + c[0], ", ".join(c[1:])) for c in ([x.strip() for x in r.strip("|").split("|")] for r in rows)]


def line_rows(log: Path, name: str, label: str, keep) -> list[tuple[str, str]]:
    """The lines of a benchmark's log that `keep` picks (informational: not in PASS)."""
    path = log / name
    if not path.is_file():
        return [(label, "not run")]
    lines = [l.strip() for l in path.read_text(errors="replace").splitlines() if keep(l)]
    return [(label, lines[0][:200])] + [("", l[:200]) for l in lines[1:]] if lines else [(label, f"no result: see {name}")]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    log, test_rc = Path(argv[0]), int(argv[1])
    rows, ok = test_rows(log, test_rc)
    if argv[2] == "skipped":  # SKIP_BENCH=1: the tests alone
        tier, tier_ok = [("benchmarks", "not run (SKIP_BENCH=1)")], True
    else:
        tier, tier_ok = tier_rows(log, int(argv[2]))
    ok = ok and tier_ok
    rows += tier + bench_rows(log, 0) + serve_rows(log)
    rows += line_rows(log, "bench_device_sample.log", "sample bench", lambda l: "ms/token" in l)
    rows += line_rows(log, "bench_spec.log", "spec bench", lambda l: l.startswith(("target", "--spec 0")) or "verify" in l)
    # seed-4l's verify of 1 + 2 rows (graph ms; run ahead, the wall a verify against its graph)
    rows += line_rows(log, "bench_verify4.log", "verify4", lambda l: l.strip().startswith(("verify 1+2", "always right", "always wrong")))
    rows += line_rows(log, "bench_ncu_forward.log", "ncu verify4", lambda l: l.strip().startswith(("routed experts", "LM head", "all ")))
    # serve_streams --gpu-step device --spec 2: its header row and one row per stream count
    rows += line_rows(log, "bench_serve_spec.log", "serve spec bench", lambda l: l.startswith("| ") and "---" not in l)
    rows += [("logs", str(log)), ("result", "PASS" if ok else "FAIL")]
    width = max(len(k) for k, _ in rows)
    print("\n== gpu_suite summary")
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

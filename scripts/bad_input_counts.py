"""Count the test suite's bad-input cases by kind, from the tests themselves (never typed by hand).

Every test of bad input, corruption or interruption carries `@pytest.mark.bad_input("kind")`; each
collected case (a parametrized test counts once per parameter set) is counted under its kind.
docs/reliability.md holds the table between two marker lines; this script prints it, rewrites it
(--write), or exits 1 when the document is out of date (--check, run by tests/test_bad_input.py).

    python3 scripts/bad_input_counts.py [--write | --check]
"""

from __future__ import annotations

import collections
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "reliability.md"
BEGIN, END = "<!-- bad-input counts: scripts/bad_input_counts.py --write -->", "<!-- end of bad-input counts -->"

# The kinds, in the order the document explains them; a kind not listed here fails the count.
KINDS = {
    "non-finite": "NaN/inf in weights or logits",
    "range": "numbers out of range (non-finite floats, negative counts)",
    "ascii-digits": "counts written with non-ASCII digits",
    "before-load": "flags and sizes refused before the model loads",
    "file": "files that are not what they should be (pack, GGUF, text, tokenizer, geometry)",
    "changed-underneath": "mapped files truncated or rewritten during a run",
    "signal": "SIGTERM/SIGHUP and killed runs",
    "disk-full": "a full disk",
}

_COLLECT = """
import collections, json, sys
import pytest

class Count:
    def __init__(self):
        self.kinds = collections.Counter()
    def pytest_collection_modifyitems(self, items):
        for item in items:
            for mark in item.iter_markers("bad_input"):
                self.kinds[mark.args[0]] += 1

c = Count()
rc = pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider", *sys.argv[1:]], plugins=[c])
print("COUNTS " + json.dumps(dict(c.kinds)))
sys.exit(0 if rc in (0, 5) else rc)
"""


def count() -> dict[str, int]:
    """kind -> collected cases, over the test files that use the marker (only those are imported)."""
    import json

    files = [str(p) for p in sorted((ROOT / "tests").rglob("test_*.py")) if "bad_input" in p.read_text(encoding="utf-8")]
    r = subprocess.run([sys.executable, "-c", _COLLECT, *files], cwd=ROOT, capture_output=True, text=True)
    line = next((l for l in r.stdout.splitlines() if l.startswith("COUNTS ")), None)
    if r.returncode or line is None:
        raise SystemExit(f"collection failed ({r.returncode}):\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}")
    counts = json.loads(line[len("COUNTS "):])
    unknown = sorted(set(counts) - set(KINDS))
    if unknown:
        raise SystemExit(f"bad_input kinds {unknown} are not in scripts/bad_input_counts.py KINDS: add them with a line")
    return counts


def table(counts: dict[str, int]) -> str:
    rows = ["| kind | what | cases |", "| --- | --- | ---: |"]
    rows += [f"| `{k}` | {what} | {counts.get(k, 0)} |" for k, what in KINDS.items()]
    rows.append(f"| | total | {sum(counts.values())} |")
    return "\n".join([BEGIN, *rows, END])


def _replace(doc: str, block: str) -> str:
    a, b = doc.index(BEGIN), doc.index(END) + len(END)
    return doc[:a] + block + doc[b:]


def main(argv: list[str]) -> int:
    block = table(count())
    if not argv:
        print(block)
        return 0
    doc = DOC.read_text(encoding="utf-8")
    if argv == ["--write"]:
        DOC.write_text(_replace(doc, block), encoding="utf-8")
        return 0
    if argv == ["--check"]:
        if _replace(doc, block) != doc:
            print(f"{DOC}: the bad-input counts are out of date; run: python3 scripts/bad_input_counts.py --write\n"
                  + block, file=sys.stderr)
            return 1
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

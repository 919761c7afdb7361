"""The one-way doors between the rooms: tools -> engine -> index_format.

The engine never parses GGUF or JSON (S4: a parser error decodes to a plausible weight and plausible
logits, worse than a crash), and the shared contract in index_format depends on nothing heavier than
numpy. Checked on the source (every import statement, at any depth), not by importing.
"""

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

FORBIDDEN = {
    "engine": {"gguf", "json", "strata.tools", "simplejson", "orjson", "ujson"},
}
INDEX_FORMAT_ALLOWED = set(sys.stdlib_module_names) - {"json"} | {"numpy", "strata"}


def _imports(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(), filename=str(path))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append((node.lineno, node.module))
        elif isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", "")) in ("import_module", "__import__"):
            if node.args and isinstance(node.args[0], ast.Constant):
                out.append((node.lineno, str(node.args[0].value)))
    return out


def _py_files(room: str) -> list[Path]:
    files = sorted((ROOT / room).rglob("*.py"))
    assert files, f"no python files under {room}/"
    return files


def _violations(room: str, bad) -> list[str]:
    return [
        f"{f.relative_to(ROOT)}:{line} imports {mod}"
        for f in _py_files(room)
        for line, mod in _imports(f)
        if bad(mod)
    ]


def test_engine_never_imports_gguf_json_or_tools():
    forbidden = FORBIDDEN["engine"]
    bad = lambda m: any(m == f or m.startswith(f + ".") for f in forbidden)
    assert _violations("engine", bad) == []


def test_index_format_depends_on_numpy_at_most():
    def bad(m):
        top = m.split(".")[0]
        return top not in INDEX_FORMAT_ALLOWED or m.startswith(("strata.tools", "strata.engine"))

    assert _violations("index_format", bad) == []


@pytest.mark.parametrize("snippet", ["import json", "from gguf import GGUFReader", "import strata.tools.gguf_io"])
def test_the_check_catches_a_forbidden_import(tmp_path, monkeypatch, snippet):
    # The checker itself must be able to fail: plant a forbidden import in a copy of the room.
    room = tmp_path / "engine"
    room.mkdir()
    (room / "bad.py").write_text(f"def f():\n    {snippet}\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    forbidden = FORBIDDEN["engine"]
    assert _violations("engine", lambda m: any(m == f or m.startswith(f + ".") for f in forbidden))

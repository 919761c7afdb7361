"""User-facing text says what a rule is; it never cites a requirement label a user cannot look up
(S8, B2, "round 194", an issue number). Checked on every command's help, every string the code
can print (string constants that are not docstrings) and the README."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from strata.engine import cli
from strata.tools import budget_cli, pack_cli, profile_cli

ROOT = Path(__file__).resolve().parent.parent
LABEL = re.compile(r"\b[SB][0-9]{1,2}\b|\bround [0-9]+|\bissue [0-9]+|\bseed #[0-9]+")

HELP = [(cli.main, []), (cli.main, ["generate"]), (cli.main, ["perplexity"]), (pack_cli.main, []),
        (pack_cli.main, ["convert"]), (pack_cli.main, ["verify"]), (pack_cli.main, ["synth"]),
        (pack_cli.main, ["demo"]), (budget_cli.main, []), (profile_cli.main, [])]


@pytest.mark.parametrize("main, argv", HELP)
def test_help_cites_no_labels(main, argv, capsys):
    assert main([*argv, "-h"]) == 0
    text = capsys.readouterr().out
    assert "Usage:" in text and not LABEL.findall(text), LABEL.findall(text)


def _printable_strings(path: Path):
    tree = ast.parse(path.read_text(encoding="utf-8"))
    docs = {id(n.body[0].value) for n in ast.walk(tree)
            if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and n.body
            and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
    for n in ast.walk(tree):
        if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docs:
            yield n.lineno, n.value


def test_messages_cite_no_labels():
    found = [f"{p.relative_to(ROOT)}:{line}: {s[:80]!r}"
             for folder in ("engine", "tools", "index_format", "strata")
             for p in sorted((ROOT / folder).rglob("*.py"))
             for line, s in _printable_strings(p) if LABEL.search(s)]
    assert found == []


def test_readme_cites_no_labels():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert LABEL.findall(text) == []

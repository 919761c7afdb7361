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


# The GPU planner (the memory plan and the expert-slot plan) is a room of its own: the CPU forward
# does not import it, directly or through another module, so the model runs, and is read, without
# it. Only the GPU tier, which allocates from the plan, and the CLI, which prints it, may reach it.
PLANNER = {"strata.engine.budget", "strata.engine.expert_plan"}
MAY_PLAN = {"strata.engine.cli"} | PLANNER
TIER = "strata.engine.tier"  # the GPU tier's package: each of its modules may reach the planner


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(["strata", *parts])


def _engine_imports(path: Path) -> set[str]:
    """The strata.engine modules `path` imports, at any depth, relative imports resolved ("from . import
    budget" and "from .budget import X" both name strata.engine.budget)."""
    package = _module_name(path).split(".")
    if path.name != "__init__.py":
        package.pop()
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(package[: len(package) - node.level + 1]) if node.level else ""
            mod = ".".join(p for p in (base, node.module or "") if p)
            out.add(mod)
            out |= {f"{mod}.{a.name}" for a in node.names}  # "from . import budget" imports a module
    return {m for m in out if m.startswith("strata.engine")}


def _reaches_planner(root: Path = None) -> dict[str, list[str]]:
    """For every engine module outside MAY_PLAN that reaches the planner: the import chain to it."""
    root = root or ROOT
    files = {_module_name(f): f for f in sorted((root / "engine").rglob("*.py"))}
    graph = {m: {i for i in _engine_imports(f) if i in files} for m, f in files.items()}
    bad = {}
    for start in sorted(m for m in files.keys() - MAY_PLAN if m != TIER and not m.startswith(TIER + ".")):
        chains, seen = [[start]], {start}
        while chains:
            chain = chains.pop(0)
            if chain[-1] in PLANNER:
                bad[start] = chain
                break
            for nxt in sorted(graph[chain[-1]] - seen):
                seen.add(nxt)
                chains.append(chain + [nxt])
    return bad


def test_the_cpu_forward_never_imports_the_gpu_planner():
    assert _reaches_planner() == {}


def test_the_planner_check_follows_relative_and_indirect_imports(tmp_path, monkeypatch):
    # The checker must be able to fail: a forward module importing a cache that imports the planner.
    room = tmp_path / "engine"
    room.mkdir()
    (room / "__init__.py").write_text("")
    (room / "budget.py").write_text("")
    (room / "kvcache.py").write_text("from .budget import KV_BLOCK\n")
    (room / "model.py").write_text("def f():\n    from . import kvcache\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert _reaches_planner(tmp_path) == {
        "strata.engine.kvcache": ["strata.engine.kvcache", "strata.engine.budget"],
        "strata.engine.model": ["strata.engine.model", "strata.engine.kvcache", "strata.engine.budget"],
    }


# The blocks compute through their backend (engine/backend.py): a block that called a kernel or an
# operation itself would run it on the CPU whatever backend it was given, and the GPU token step
# could not reuse it unchanged. Plain numpy stays allowed for host bookkeeping (positions, token ids,
# the rows of each sequence).
BLOCK_MODULES = ("model.py", "moe.py", "qsa.py", "hyper.py", "ple.py", "mtp.py")
COMPUTE = {"attention", "delta_rule", "delta_rule_step", "chunk_delta_rule", "conv_many", "rmsnorm", "gated_rmsnorm_",
           "gate_", "silu_", "sigmoid", "softplus", "l2norm_", "grouped_rmsnorm", "grouped_rmsnorm_q", "route_topk",
           "combine", "_combine", "mix_tail", "_mix_tail", "_inject", "conv_taps", "_conv_taps", "add_output",
           "_add_output", "torch_topk_set", "quantize_act", "matvec", "matmul", "matmul_grouped", "dequantize"}
# what a block may do outside its backend, and why: MoE.products IS the CPU's expert products (the
# backend's expert server calls it for its misses), and MoE._token_products its one-token form
# (MoE.forward takes it only without an expert server, where `routed` would call products); the embedding rows and the PLE table's rows are
# host-side reads of the pack (the GPU token step takes them up in one copy; Model._embd_row keeps
# the rows it decoded), the MTP head's embedding rows too
ALLOWED = {"moe.py MoE.products", "moe.py MoE._token_products", "model.py Model._forward_rows", "model.py Model._embd_row", "model.py _BlockRows.__call__", "mtp.py MTPHead._embed"}


def _direct_compute_calls(path: Path) -> list[str]:
    bad = []
    tree = ast.parse(path.read_text(), filename=str(path))
    for cls in (n for n in tree.body if isinstance(n, ast.ClassDef)):
        for fn in (n for n in cls.body if isinstance(n, ast.FunctionDef)):
            if fn.name == "__init__" or f"{path.name} {cls.name}.{fn.name}" in ALLOWED:
                continue
            for call in (n for n in ast.walk(fn) if isinstance(n, ast.Call)):
                f = call.func
                name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None
                through_backend = isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id == "be"
                if name in COMPUTE and not through_backend:
                    bad.append(f"{path.name}:{call.lineno} {cls.name}.{fn.name} calls {name} itself")
    return bad


def test_the_blocks_compute_through_their_backend():
    assert [b for m in BLOCK_MODULES for b in _direct_compute_calls(ROOT / "engine" / m)] == []


def test_the_backend_check_catches_a_direct_call(tmp_path):
    (tmp_path / "model.py").write_text("class Block:\n    def forward(self, be, x):\n        return attention(x)\n")
    assert _direct_compute_calls(tmp_path / "model.py") == ["model.py:3 Block.forward calls attention itself"]

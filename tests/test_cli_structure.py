"""The shape of gmlx_cli: its import graph has no cycle, commands are thin over their parts, and
no file grows past what one screen of concepts holds. The graph counts every import, those inside
functions too (the lazy ones that keep `gmlx --help` fast are imports all the same)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from cli_helpers import run

from gmlx.errors import GmlxError

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "gmlx_cli"
MAX_LINES = 300


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted((ROOT / PACKAGE).rglob("*.py"))}


def imported(name: str, path: Path, known: set[str]) -> set[str]:
    """The gmlx_cli modules `name` imports, anywhere in its source. `from P import X` is module P.X
    where that is a module, else P itself."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package, up level - 1
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            out |= {f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names}
    return {m for m in out if m in known and m != name}


def import_graph() -> dict[str, set[str]]:
    mods = modules()
    return {name: imported(name, path, set(mods)) for name, path in mods.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as a path that returns to its start, or None (depth-first, three colours)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_the_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_the_graph_sees_every_kind_of_import(tmp_path):
    pkg = tmp_path / "p"
    pkg.mkdir()
    (pkg / "m.py").write_text("import p.a\nfrom p import b\nfrom .c import x\n\ndef f():\n    from p.d import y\n")
    known = {"p", "p.m", "p.a", "p.b", "p.c", "p.d"}
    assert imported("p.m", pkg / "m.py", known) == {"p.a", "p.b", "p.c", "p.d"}


def test_gmlx_cli_has_no_import_cycle():
    graph = import_graph()
    assert "gmlx_cli.app" in graph and graph["gmlx_cli.generate"], "the graph reads no imports"
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_gmlx_cli_files_stay_short():
    long = {str(p.relative_to(ROOT)): n for p in modules().values()
            if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_LINES}
    assert not long, f"over {MAX_LINES} lines: {long}"


@pytest.mark.parametrize("args", [("generate", "x"), ("doctor",), ("bench", "--no-warmup"), ("sweep-cap", "--no-warmup"),
                                  ("serve", "--port", "0")])
def test_every_command_loads_its_model_through_mains_seam(args, tmp_path):
    """main(load_model=...) is the one way a command gets its model (gmlx_cli/loader.py)."""
    asked = []

    def load_model(path):
        asked.append(path)
        raise GmlxError("the seam was asked")

    r = run(*args, *(("--out", str(tmp_path)) if args[0] in ("bench", "sweep-cap") else ()), load_model=load_model)
    assert r.code == 1 and "gmlx: error: the seam was asked" in r.stderr, r.stderr
    assert asked == [None]

"""The import graph, read from the source with `ast`: no circle, each layer imports only the
ones below it (objectives < search_spaces < runners < tuner), and nothing outside tests/
imports from tests/ (a benchmark must run where pytest is not installed)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("objectives", "search_spaces", "runners", "tuner")
LAYER = {name: rank for rank, name in enumerate(PACKAGES)}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, Path]:
    found = {}
    for top in (*PACKAGES, "testing", "bench", "tests"):
        for path in (ROOT / top).rglob("*.py"):
            found[module_name(path)] = path
    return found


def imports_of(path: Path, known: dict[str, Path]) -> set[str]:
    """Every project module the file imports, at the top, in a function or for type checking."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # `from package import module` names a module; `from module import name` does not.
            names = [f"{node.module}.{alias.name}" for alias in node.names] + [node.module]
        else:
            continue
        found |= {name for name in names if name in known}
    return found


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports_of(path, known) - {name} for name, path in known.items()}


def test_no_import_circle(graph):
    # Tarjan's strongly connected components: a component of two or more modules is a circle.
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in graph[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for node in graph:
        if node not in index:
            visit(node)
    assert circles == []


def test_each_layer_imports_only_the_layers_below(graph):
    upward = [
        f"{name} -> {target}"
        for name, targets in graph.items()
        for target in targets
        if name.split(".")[0] in LAYER
        and target.split(".")[0] in LAYER
        and LAYER[target.split(".")[0]] > LAYER[name.split(".")[0]]
    ]
    assert upward == []


def test_nothing_but_tests_imports_tests(graph):
    assert [
        f"{name} -> {target}"
        for name, targets in graph.items()
        for target in targets
        if target.split(".")[0] == "tests" and name.split(".")[0] != "tests"
    ] == []


def test_runners_keep_their_concerns_in_subpackages():
    top_level = {path.stem for path in (ROOT / "runners").glob("*.py")}
    assert top_level == {"__init__", "base", "registry", "hf"}
    assert {path.name for path in (ROOT / "runners").iterdir() if path.is_dir()} >= {
        "engines",
        "load",
        "quality",
        "sim",
    }

"""The package's import structure: no import cycles among trio_helpers modules, and a cheap ``import trio_helpers``.

The graph is read from the source with ``ast`` (every ``import`` and ``from ... import``, including those inside
functions, which run later but still tie two modules together), not by importing anything.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "trio_helpers"


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _resolve(importer: str, node: ast.ImportFrom) -> str:
    """The absolute module a ``from ... import`` names (relative imports resolved against ``importer``)."""
    if not node.level:
        return node.module or ""
    is_package = MODULES[importer].name == "__init__.py"
    base = importer.split(".")
    base = base if is_package else base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imports_of(name: str) -> set[str]:
    """The trio_helpers modules that module ``name`` imports, anywhere in its source."""
    tree = ast.parse(MODULES[name].read_text(encoding="utf-8"), filename=str(MODULES[name]))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            target = _resolve(name, node)
            for alias in node.names:  # `from trio_helpers import tracking` imports the module trio_helpers.tracking
                submodule = f"{target}.{alias.name}"
                found.add(submodule if submodule in MODULES else target)
    return {m for m in found if m in MODULES and m != name}


def import_graph() -> dict[str, set[str]]:
    return {name: imports_of(name) for name in MODULES}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as ``[a, b, ..., a]``, or None if it is acyclic (depth-first search)."""
    state: dict[str, str] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        state[node] = "done"
        stack.pop()
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_graph_reader_sees_every_kind_of_import() -> None:
    graph = import_graph()
    assert "trio_helpers.offline.service" in MODULES and "trio_helpers.recipes.grpo" in MODULES
    assert "trio_helpers.rl" in graph["trio_helpers.loop"]  # a top-level `from trio_helpers.rl import ...`
    assert "trio_helpers.tracking" in graph["trio_helpers.loop"]  # `from trio_helpers import tracking` in a def
    assert "trio_helpers.backend" in graph["trio_helpers"]  # the package's lazy connect()
    assert "trio_helpers.offline.catalog" in graph["trio_helpers.offline.service"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
    assert tangles({"a": {"b"}, "b": {"a", "c"}, "c": set(), "d": {"d"}}) == [{"a", "b"}]


def tangles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one module: each holds every module of some cycles."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[set[str]] = []

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
            component = set()
            while True:
                member = stack.pop()
                component.add(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(component)

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_import_cycles_among_trio_helpers_modules() -> None:
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)
    assert tangles(import_graph()) == []


@pytest.mark.parametrize("low, high", [("trio_helpers.rl", "trio_helpers.loop"),
                                       ("trio_helpers.rollouts", "trio_helpers.loop"),
                                       ("trio_helpers.loop", "trio_helpers.grpo"),
                                       ("trio_helpers.loop", "trio_helpers.distillation")])
def test_the_layers_point_one_way(low, high) -> None:
    """The pieces know nothing of the loop, and the loop nothing of its scorers."""
    graph = import_graph()
    assert low in graph[high] and high not in graph[low]
    assert "trio_helpers.grpo" not in graph["trio_helpers.distillation"]
    assert "trio_helpers.distillation" not in graph["trio_helpers.grpo"]


def test_import_trio_helpers_stays_cheap() -> None:
    code = ("import sys, trio_helpers\n"
            "heavy = [m for m in ('pytrio', 'transformers', 'datasets', 'torch', 'swanlab') if m in sys.modules]\n"
            "print(','.join(heavy))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT,
                          check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "", f"import trio_helpers imported {done.stdout.strip()}"

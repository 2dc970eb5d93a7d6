"""The import graph of trainer/, api/ and worker/: no cycle (function-level imports count) and no forbidden direction.

- ``trainer`` is a library: it imports nothing from ``api`` or ``worker``.
- The API never imports ``worker`` (it enqueues by task name). The one exception is the command line, ``api.cli``,
  the composition root that starts a worker (``proxima worker``, ``proxima serve``); nothing the app imports reaches
  it or ``worker``.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("trainer", "api", "worker")
CLI_MAY_IMPORT_WORKER = {"api.cli"}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path, modules: set[str]) -> set[str]:
    """Every project module ``path`` imports, at any depth of the file (function bodies included)."""
    out: set[str] = set()
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # ``from trainer import metrics`` imports the submodule trainer.spec.metrics when there is one
            names = [f"{node.module}.{a.name}" for a in node.names] + [node.module]
        else:
            continue
        for name in names:
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name and name.split(".")[0] in PACKAGES and name not in PACKAGES:
                out.add(name)
    return out


@functools.cache
def import_graph() -> dict[str, set[str]]:
    """Module → the project modules it imports; parsed once per run (every test reads the same tree)."""
    files = [p for pkg in PACKAGES for p in (REPO / pkg).rglob("*.py")]
    modules = {_module_name(p) for p in files}
    graph = {_module_name(p): _imports(p, modules) for p in files}
    return {m: deps - {m} for m, deps in graph.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as a path a → … → a, or None (depth-first search with colours)."""
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for d in sorted(graph.get(m, ())):
            if state.get(d) == 1:
                return [*stack[stack.index(d) :], d]
            if d not in state and (found := visit(d)):
                return found
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m)):
            return found
    return None


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        m = todo.pop()
        if m not in seen:
            seen.add(m)
            todo += graph.get(m, ())
    return seen


def test_the_cycle_finder_finds_a_cycle_through_a_function_level_import(tmp_path: Path) -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert find_cycle(graph) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
    src = tmp_path / "m.py"
    src.write_text("def f():\n    from trainer.generation import rollout\n    import api.db\n")
    assert _imports(src, {"trainer.generation.rollout", "api.db", "trainer", "api"}) == {
        "trainer.generation.rollout",
        "api.db",
    }


def test_no_import_cycle_in_the_project() -> None:
    assert find_cycle(import_graph()) is None


@pytest.mark.parametrize("module", sorted(m for m in import_graph() if m.startswith("trainer")))
def test_the_trainer_imports_neither_the_api_nor_the_worker(module: str) -> None:
    bad = {d for d in import_graph()[module] if d.split(".")[0] in ("api", "worker")}
    assert not bad, f"{module} imports {sorted(bad)}"


def test_the_api_never_imports_the_worker_but_from_the_command_line() -> None:
    graph = import_graph()
    for module, deps in graph.items():
        if module.startswith("api") and module not in CLI_MAY_IMPORT_WORKER:
            assert not {d for d in deps if d.startswith("worker")}, module
    app = reachable(graph, "api.app")
    assert not {m for m in app if m.startswith("worker")}
    assert not app & CLI_MAY_IMPORT_WORKER

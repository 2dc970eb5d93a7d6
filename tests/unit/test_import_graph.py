"""The import graph of trainer/, api/, worker/ and proxima/: no cycle (function-level imports count) and every arrow in
the allowed direction.

- ``trainer`` is a library: it imports nothing from ``api``, ``worker`` or ``proxima``. Inside it the wings import
  one way: spec ← grading ← algorithms ← generation ← agents ← loops ← serving ← builtin_models ← the top-level
  modules (``trainer.cli``, ``trainer.train``); a wing imports only wings to its left.
- The API imports only ``trainer.spec`` and ``trainer.grading`` (both torch-free) and never ``worker`` (it enqueues by
  task name); the worker may import the API's core; ``proxima`` (the console script, the composition root that starts
  the API, a worker and the inference server) sits above all of them and nothing imports it.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("trainer", "api", "worker", "proxima")
# The trainer's wings, lowest first; "" is the package's top-level modules (trainer.cli, trainer.train).
WINGS = ("spec", "grading", "algorithms", "generation", "agents", "loops", "serving", "builtin_models", "")
API_MAY_IMPORT = ("trainer.spec", "trainer.grading")


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


def wing(module: str) -> str:
    """``trainer.loops.rl`` → ``loops``; a top-level module of the package (``trainer.cli``) → ``""``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in WINGS else ""


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """Every ``a -> b`` between two trainer modules where b's wing is not to the left of a's (nor a's own)."""
    rank = {w: i for i, w in enumerate(WINGS)}
    return sorted(
        f"{m} -> {d}"
        for m, deps in graph.items()
        if m.startswith("trainer.")
        for d in deps
        if d.startswith("trainer.") and rank[wing(d)] > rank[wing(m)]
    )


def test_the_wing_check_finds_an_upward_import() -> None:
    graph = {"trainer.spec.config": {"trainer.grading.graders"}, "trainer.loops.rl": {"trainer.spec.config"}}
    assert upward_imports(graph) == ["trainer.spec.config -> trainer.grading.graders"]
    assert upward_imports({"trainer.cli": {"trainer.loops.rl"}, "trainer.loops.rl": {"trainer.loops.steps"}}) == []
    assert wing("trainer.cli") == "" and wing("trainer.builtin_models") == "builtin_models"


def test_the_trainer_wings_import_only_the_wings_below_them() -> None:
    assert upward_imports(import_graph()) == []


def test_every_trainer_module_is_in_a_wing_or_at_the_top() -> None:
    top = {m for m in import_graph() if m.startswith("trainer.") and wing(m) == ""}
    assert top == {"trainer.cli", "trainer.train"}


def test_the_api_imports_only_the_spec_and_grading_wings_and_nothing_of_the_worker() -> None:
    bad = {
        f"{module} -> {d}"
        for module, deps in import_graph().items()
        if module.split(".")[0] == "api"
        for d in deps
        if d.split(".")[0] in ("worker", "proxima") or (d.startswith("trainer.") and not d.startswith(API_MAY_IMPORT))
    }
    assert not bad, sorted(bad)


def test_nothing_imports_the_console_package_and_the_worker_never_imports_it() -> None:
    bad = {
        f"{module} -> {d}"
        for module, deps in import_graph().items()
        if not module.startswith("proxima")
        for d in deps
        if d.startswith("proxima")
    }
    assert not bad, sorted(bad)

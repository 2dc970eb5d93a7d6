"""Sizes a reader can hold: across trainer/, api/, worker/ and proxima/, no class over 300 lines and no function over
60 (the syntax tree's span, decorators excluded). Migrations and the built-in models' training recipes
(trainer/builtin_models/tiny_*.py: a model's whole recipe reads best as one script) are left out."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("trainer", "api", "worker", "proxima")
MAX_CLASS_LINES = 300
MAX_FUNCTION_LINES = 60
EXEMPT = ("trainer/builtin_models/tiny_arith.py", "trainer/builtin_models/tiny_calc.py")


def offenders(path: Path, rel: str) -> list[str]:
    """``rel:Name (N lines)`` for each class over MAX_CLASS_LINES and each function (methods and nested ones too)
    over MAX_FUNCTION_LINES in one file."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.ClassDef):
            limit = MAX_CLASS_LINES
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            limit = MAX_FUNCTION_LINES
        else:
            continue
        lines = (node.end_lineno or node.lineno) - node.lineno + 1
        if lines > limit:
            found.append(f"{rel}:{node.name} ({lines} lines)")
    return found


def project_files() -> list[tuple[Path, str]]:
    files = []
    for pkg in PACKAGES:
        for path in sorted((REPO / pkg).rglob("*.py")):
            rel = path.relative_to(REPO).as_posix()
            if rel not in EXEMPT:
                files.append((path, rel))
    return files


def test_the_size_check_names_a_long_function_and_a_long_class(tmp_path: Path) -> None:
    body = "".join(f"    x{i} = {i}\n" for i in range(59))
    src = tmp_path / "m.py"
    src.write_text(f"def short():\n{body}\ndef long():\n{body}    x = 0\n\nclass C:\n" + "    a = 1\n" * 300)
    assert offenders(src, "m.py") == ["m.py:long (61 lines)", "m.py:C (301 lines)"]


def test_the_walk_covers_every_wing_and_leaves_out_only_the_recipes() -> None:
    rels = {rel for _, rel in project_files()}
    assert {"trainer/loops/rl.py", "api/app.py", "worker/tasks.py"} <= rels
    assert not rels & set(EXEMPT) and not any(rel.startswith("migrations/") for rel in rels)


def test_no_class_over_300_lines_and_no_function_over_60() -> None:
    found = [o for path, rel in project_files() for o in offenders(path, rel)]
    assert not found, "\n".join(found)

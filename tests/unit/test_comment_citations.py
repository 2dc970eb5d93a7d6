"""No comment, docstring or description string cites what a reader of the repository cannot open.

Guards against citations of the design document that is not in the repository ("design", the section sign and a number)
and of this project's own issue tracker ("issue" or "issues" and a number), which point a reader at nothing: say the
reason in plain words, or point at a README section, docs/ or a module instead. References to other projects' public
trackers stay allowed: a number after "TRL issue", "open-r1 issue", "transformers issue" (``EXTERNAL_PROJECTS``: add a
project there when citing its tracker), and GitHub-style ``#123`` refs, which these patterns never match.

Walks the Python sources of the project's packages, tests and benchmarks, the dashboard's own scripts and pages
(``api/static``, without the vendored third-party code), README.md and docs/*.md; BENCHMARKS.md and bench/README.md
are dated records and keep their wording.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PY_FOLDERS = ("trainer", "api", "worker", "proxima", "tests", "bench")
SKIP_PARTS = {".venv", "node_modules", "__pycache__", "vendor"}

# Built from pieces so that this file does not match itself.
DESIGN = re.compile("design" + r"\s+§\s*\d", re.IGNORECASE)
ISSUE = re.compile(r"\b[Ii]" + r"ssues?\s+\d")
EXTERNAL_PROJECTS = ("TRL", "open-r1", "transformers")
EXTERNAL = re.compile(r"(?:" + "|".join(re.escape(p) for p in EXTERNAL_PROJECTS) + r")(?:'s)?\s+$", re.IGNORECASE)


def _files() -> list[Path]:
    files = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    for folder in PY_FOLDERS:
        files += sorted((ROOT / folder).rglob("*.py"))
    for ext in ("*.js", "*.html"):
        files += sorted((ROOT / "api" / "static").rglob(ext))
    return [f for f in files if f.is_file() and not SKIP_PARTS & set(f.relative_to(ROOT).parts)]


def _citations(name: str, text: str) -> list[str]:
    """``name:line: the line`` for each citation in ``text``."""
    found = []
    for m in [*DESIGN.finditer(text), *ISSUE.finditer(text)]:
        if m.re is ISSUE and EXTERNAL.search(text[max(0, m.start() - 40) : m.start()]):
            continue
        line = text.count("\n", 0, m.start()) + 1
        snippet = text.splitlines()[line - 1].strip()
        found.append((line, f"{name}:{line}: {snippet[:120]}"))
    return [c for _, c in sorted(found)]


def test_the_walk_finds_the_sources() -> None:
    names = {str(f.relative_to(ROOT)) for f in _files()}
    assert {"README.md", "api/status.py", "trainer/spec/config.py", "api/static/js/views/sessions.js"} <= names
    assert not [n for n in names if n.startswith(".venv") or "/vendor/" in n]


def test_the_patterns_tell_internal_citations_from_external_ones() -> None:
    sample = "\n".join(
        [
            "# (design " + "§3)",
            "# (issue " + "12, finding 4)",
            "# Issues " + "13 and 14",
            "# TRL issue " + "2617, open-r1 issue " + "239, transformers issue " + "35352, verl#7495",
        ]
    )
    assert [c.split(":")[1] for c in _citations("sample.py", sample)] == ["1", "2", "3"]


def test_no_comment_cites_the_design_document_or_the_projects_own_issues() -> None:
    found = [
        c
        for f in _files()
        for c in _citations(str(f.relative_to(ROOT)), f.read_text(encoding="utf-8", errors="replace"))
    ]
    assert not found, (
        "citations a reader of the repository cannot follow (say the reason in plain words, or point at a README "
        "section, docs/ or a module):\n" + "\n".join(found)
    )

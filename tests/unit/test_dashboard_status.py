"""The dashboard's job statuses come from ``api.status.JobStatus``: ``js/status.js`` is generated, never a file, and
every name a dashboard module imports from it exists."""

from __future__ import annotations

import re
from pathlib import Path

from fastapi import FastAPI
from fastapi.testclient import TestClient

from api.routes import dashboard
from api.status import PAUSABLE, TERMINAL_STATUSES, JobStatus

JS_DIR = Path(dashboard.STATIC_DIR) / "js"
NAMED_IMPORT = re.compile(r"import\s*\{([^}]*)\}\s*from\s*[\"']([^\"']+)[\"']")


def exports(body: str) -> set[str]:
    return set(re.findall(r"^export const (\w+)", body, flags=re.MULTILINE))


def test_the_status_module_is_served_from_the_enum_with_its_groups() -> None:
    app = FastAPI()
    dashboard.install(app)
    r = TestClient(app).get("/dashboard/js/status.js")
    assert r.status_code == 200 and r.headers["content-type"] == "text/javascript; charset=utf-8"
    assert r.headers["content-security-policy"] == dashboard.SECURITY_HEADERS["content-security-policy"]
    for s in JobStatus:
        assert f'export const {s.name} = "{s.value}";\n' in r.text
    order = "VALIDATING_FILES, QUEUED, RUNNING, PAUSED, SUCCEEDED, FAILED, CANCELLED"
    assert f"export const STATUSES = [{order}];" in r.text
    terminal = re.search(r"export const TERMINAL = new Set\(\[(.*)\]\);", r.text)
    pausable = re.search(r"export const PAUSABLE = new Set\(\[(.*)\]\);", r.text)
    assert terminal and {JobStatus[n] for n in terminal.group(1).split(", ")} == TERMINAL_STATUSES
    assert pausable and [JobStatus[n] for n in pausable.group(1).split(", ")] == list(PAUSABLE)
    assert not (JS_DIR / "status.js").exists(), "a static status.js would be a copy; the route serves it"


def test_every_status_name_a_dashboard_module_imports_is_exported() -> None:
    body, _ = dashboard.status_module()
    exported = exports(body) | {"statusLabel"}
    importers = {}
    for path in JS_DIR.rglob("*.js"):
        if "vendor" in path.parts:
            continue
        for names, target in NAMED_IMPORT.findall(path.read_text()):
            if (path.parent / target).resolve() == (JS_DIR / "status.js").resolve():
                importers[path.name] = {n.strip() for n in names.split(",") if n.strip()}
    assert importers, "the dashboard imports its statuses from status.js"
    for module, names in importers.items():
        assert names <= exported, f"{module} imports {sorted(names - exported)}"

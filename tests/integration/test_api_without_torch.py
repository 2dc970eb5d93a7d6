"""The API process never imports torch: not when its modules are imported, not when ``proxima
serve`` builds the app, and not while it serves the requests that validate a spec, store a dataset and create a job.

Each check runs in a fresh interpreter: the test process itself has torch loaded by other tests.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def run_fresh(code: str, *, env_home: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)}
    if env_home is not None:
        env["PROXIMA_HOME"] = str(env_home)
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )


@pytest.mark.parametrize("module", ["api.app", "api.cli", "api.services.jobs", "api.services.graders", "proxima.cli"])
def test_importing_the_api_imports_no_torch(module: str) -> None:
    out = run_fresh(f"import sys, {module}; print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))")
    assert out.returncode == 0, out.stderr
    assert out.stdout == "[]\n"


def test_serving_spec_dataset_and_job_requests_imports_no_torch(tmp_path: Path) -> None:
    """The app as ``proxima serve`` builds it (embedded backends under a fresh home), through its start-up and the
    requests a job's creation makes: a grader dry run, an upload, a job create with its spec and grader parsed."""
    code = """
        import json, sys
        from fastapi.testclient import TestClient
        from api.cli import prepare_database, serving_app
        from api.auth import create_key
        from api.db import session_scope
        from api.settings import get_settings

        prepare_database()
        with session_scope(get_settings().db_url) as s:
            _, key = create_key(s, tenant_name="local")
        grader = {"type": "string_check", "name": "exact", "input": "{{sample.output_text}}",
                  "reference": "{{item.answer}}", "operation": "eq"}
        headers = {"authorization": f"Bearer {key}"}
        statuses = []
        with TestClient(serving_app()) as client:
            r = client.post("/v1/fine_tuning/alpha/graders/run", headers=headers,
                            json={"grader": grader, "model_sample": "4", "item": {"answer": "4"}})
            statuses.append(r.status_code)
            row = json.dumps({"prompt": "What is 2 + 2?", "answer": "4"}).encode() + b"\\n"
            r = client.post("/v1/files", headers=headers, files={"file": ("t.jsonl", row)},
                            data={"purpose": "fine-tune"})
            statuses.append(r.status_code)
            body = {"model": "tiny-arith", "training_file": r.json()["id"],
                    "method": {"type": "grpo", "grpo": {"grader": grader}}}
            r = client.post("/v1/fine_tuning/jobs", headers=headers, json=body)
            statuses.append(r.status_code)
            statuses.append(r.json()["status"])
        print(json.dumps({"statuses": statuses, "torch": sorted(m for m in sys.modules if m.split(".")[0] == "torch")}))
    """
    out = run_fresh(code, env_home=tmp_path / "home")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.splitlines()[-1]) == {"statuses": [200, 200, 200, "validating_files"], "torch": []}

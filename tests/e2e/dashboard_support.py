"""A real deployment for the dashboard's browser tests: ``proxima serve`` (API and one worker) on a fresh PostgreSQL
database, a Redis database and an artifact folder, with the tiny random model offered as ``tiny-random``.

Jobs are made the way a user makes them, over the REST API: upload the datasets, create the job. API keys are
created in-process, as ``proxima keys create`` does.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from api.auth import create_key
from api.db import session_scope
from api.migrate import upgrade
from api.status import TERMINAL_STATUSES
from tests.redis_dbs import claim_redis_url, release_redis_url

from .conftest import create_pg_database, drop_pg_database

MODEL = "tiny-random"
CHROMIUM = Path("/usr/bin/chromium")

# A multi grader with two named sub-graders, so the dashboard has per-grader curves to draw.
GRADER: dict[str, Any] = {
    "type": "multi",
    "name": "arith",
    "graders": {
        "sim": {
            "type": "text_similarity",
            "name": "sim",
            "input": "{{sample.output_text}}",
            "reference": "{{item.answer}}",
            "evaluation_metric": "fuzzy_match",
        },
        "exact": {
            "type": "string_check",
            "name": "exact",
            "input": "{{sample.output_text}}",
            "reference": "{{item.answer}}",
            "operation": "eq",
        },
    },
    "calculate_output": "0.7 * sim + 0.3 * exact",
}


def hyperparameters(*, steps: int, **overrides: Any) -> dict[str, Any]:
    """Small batches and short completions: a step of the random 2-layer model takes a fraction of a second."""
    return {
        "max_steps": steps,
        "batch_size": 2,
        "group_size": 4,
        "max_completion_tokens": 4,
        "checkpoint_interval": 2,
        "eval_interval": 2,
        "eval_prompts": 4,
        "precision": "fp32",
        "learning_rate": 1e-2,
        **overrides,
    }


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class DashboardServer:
    """``proxima serve`` in its own process group; :meth:`close` stops it and drops its database."""

    def __init__(self, root: Path, *, model_dir: Path, model: str = MODEL, env: dict[str, str] | None = None) -> None:
        self.root = root
        home = root / "home"
        shutil.copytree(model_dir, home / "models" / model)
        self.database_url = create_pg_database()
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.env = (
            {k: v for k, v in os.environ.items() if not k.startswith("PROXIMA_")}
            | {
                "PROXIMA_HOME": str(home),
                "PROXIMA_DATABASE_URL": self.database_url,
                "PROXIMA_BROKER_URL": claim_redis_url(),
                "PROXIMA_ARTIFACTS": str(root / "artifacts"),
                "PROXIMA_BASE_MODELS": json.dumps([model]),
                "PROXIMA_PORT": str(self.port),
            }
            | (env or {})
        )
        upgrade(self.database_url)
        self.log_path = root / "server.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 120.0) -> None:
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "proxima.cli", "serve"],
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # serve, its worker and the worker's trainer: one group to stop
            )
        deadline = time.monotonic() + timeout
        while True:
            try:
                if httpx.get(f"{self.base}/readyz", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"proxima serve did not become ready:\n{self.logs()}")
            time.sleep(0.3)

    def logs(self) -> str:
        return self.log_path.read_text(errors="replace")[-6000:] if self.log_path.exists() else ""

    def api_key(self, tenant: str) -> str:
        with session_scope(self.database_url) as session:
            _, key = create_key(session, tenant_name=tenant)
        return key

    def client(self, key: str) -> httpx.Client:
        return httpx.Client(
            base_url=f"{self.base}/v1", headers={"Authorization": f"Bearer {key}"}, timeout=httpx.Timeout(30.0)
        )

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)  # serve stops its worker, which stops its trainer
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=30)
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)  # anything of the group still there
            self.proc.wait()
        release_redis_url(self.env["PROXIMA_BROKER_URL"])
        drop_pg_database(self.database_url)


def upload(client: httpx.Client, path: Path) -> str:
    with path.open("rb") as fh:
        r = client.post("/files", files={"file": (path.name, fh, "application/jsonl")}, data={"purpose": "fine-tune"})
    r.raise_for_status()
    return str(r.json()["id"])


def create_job(
    client: httpx.Client, *, training_file: str, validation_file: str, suffix: str, hp: dict[str, Any]
) -> dict[str, Any]:
    body = {
        "model": MODEL,
        "training_file": training_file,
        "validation_file": validation_file,
        "suffix": suffix,
        "seed": 7,
        "method": {"type": "grpo", "grpo": {"grader": GRADER, "hyperparameters": hp}},
    }
    r = client.post("/fine_tuning/jobs", json=body)
    assert r.status_code == 200, r.text
    return dict(r.json())


def wait_job(
    client: httpx.Client,
    job_id: str,
    check: Callable[[dict[str, Any]], bool],
    *,
    what: str,
    server: DashboardServer,
    timeout: float = 120.0,
) -> dict[str, Any]:
    """Poll the job until ``check(job)`` holds; a job that ends first, or a timeout, fails with the server's log."""
    deadline = time.monotonic() + timeout
    while True:
        job: dict[str, Any] = client.get(f"/fine_tuning/jobs/{job_id}").json()
        if check(job):
            return job
        if job["status"] in TERMINAL_STATUSES:
            raise AssertionError(f"{job_id} ended {job['status']} ({job.get('error')}) before {what}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what} of {job_id}:\n{server.logs()}")
        time.sleep(0.3)


def metrics(client: httpx.Client, job_id: str) -> list[dict[str, Any]]:
    r = client.get(f"/fine_tuning/jobs/{job_id}/metrics")
    r.raise_for_status()
    return list(r.json()["data"])


# What reaches past the right edge of a narrow viewport: each element (tag, classes, text) whose box ends beyond
# ``width``, deepest first, so that a failing width check names the culprit instead of a number.
_OVERFLOWING_JS = """(width) => {
  const out = [];
  for (const el of document.querySelectorAll("body *")) {
    const r = el.getBoundingClientRect();
    if (r.width === 0 || r.right <= width + 0.5) continue;
    if ([...el.children].some((c) => c.getBoundingClientRect().right > width + 0.5)) continue;
    const names = typeof el.className === "string" ? el.className.trim().split(/\\s+/).filter(Boolean) : [];
    const cls = names.map((n) => "." + n).join("");
    const text = (el.textContent || "").trim().slice(0, 60);
    out.push(`${el.tagName.toLowerCase()}${cls} right=${Math.round(r.right)}: ${text}`);
  }
  return out;
}"""


def overflowing(page: Any, width: int) -> list[str]:
    """The innermost elements that end beyond ``width`` pixels (an empty list when the page fits)."""
    result: list[str] = page.evaluate(_OVERFLOWING_JS, width)
    return result


def assert_fits(page: Any, width: int, *, settle_ms: int = 5_000) -> None:
    """Nothing on the page is wider than a ``width``-pixel viewport once it has laid itself out again; the message
    names what is. The charts refit in a ResizeObserver callback, which runs at the next frame, not at once after a
    viewport change: right after one, a chart can still have its old width (CI saw 404 px at 390, loaded)."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    with contextlib.suppress(PlaywrightTimeout):
        page.wait_for_function("(w) => document.documentElement.scrollWidth <= w", arg=width, timeout=settle_ms)
    scroll = page.evaluate("document.documentElement.scrollWidth")
    assert scroll <= width, f"the page is {scroll}px wide at a {width}px viewport: {overflowing(page, width)}"

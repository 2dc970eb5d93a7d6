"""``proxima jobs follow`` against the real app: a job's messages print after the progress line of the step they
follow (a checkpoint after its step's metrics), in the order they happened."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from rich.console import Console

from api import cli
from api.repositories import runs
from tests.integration.conftest import Tenant, set_job

STEPS = 3


def _metrics(db: Callable[[], Any], job_id: str, step: int) -> None:
    """A step's metrics as the worker records them: the row, then the metrics event."""
    values = {"reward/mean": step / 10, "kl/mean": 0.01 * step}
    with db() as s:
        runs.upsert_metrics(s, job_id=job_id, step=step, values=values)
    with db() as s:
        runs.add_event(
            s,
            job_id=job_id,
            level="info",
            message=f"Step {step}/{STEPS}",
            type="metrics",
            data={"step": step, "total_steps": STEPS, **values},
        )


def _message(db: Callable[[], Any], job_id: str, message: str, **data: Any) -> None:
    with db() as s:
        runs.add_event(s, job_id=job_id, level="info", message=message, data=data or None)


def _order(output: str, *needles: str) -> list[int]:
    lines = output.splitlines()
    found = []
    for needle in needles:
        hits = [i for i, line in enumerate(lines) if needle in line]
        assert len(hits) == 1, (needle, output)
        found.append(hits[0])
    return found


def test_follow_prints_each_checkpoint_after_the_metrics_line_of_its_step(
    queued_job: dict[str, Any], db: Callable[[], Any], base_url: str, tenant_a: Tenant
) -> None:
    job_id = queued_job["id"]
    set_job(db, job_id, status="running", total_steps=STEPS)
    _message(db, job_id, "Fine-tuning job started")
    for step in range(1, STEPS + 1):
        _metrics(db, job_id, step)
        if step >= 2:
            _message(db, job_id, f"Checkpoint created at step {step}", step=step)
    _message(db, job_id, "The job has successfully completed")
    set_job(db, job_id, status="succeeded")

    env = {k: v for k, v in os.environ.items() if not k.startswith("PROXIMA_")}
    env |= {"PROXIMA_API_BASE": base_url, "PROXIMA_API_KEY": tenant_a.key}
    out = subprocess.run(
        [sys.executable, "-m", "proxima.cli", "jobs", "follow", job_id],
        env=env,
        text=True,
        capture_output=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    order = _order(
        out.stderr,
        "Fine-tuning job started",
        f"step 1/{STEPS}  reward 0.100  kl 0.0100",
        f"step 2/{STEPS}",
        "Checkpoint created at step 2",
        f"step 3/{STEPS}",
        "Checkpoint created at step 3",
        "The job has successfully completed",
        f"{job_id}: succeeded",
    )
    assert order == sorted(order), out.stderr


def test_follow_holds_a_checkpoint_read_before_its_step_metrics_until_they_arrive(
    queued_job: dict[str, Any],
    db: Callable[[], Any],
    base_url: str,
    tenant_a: Tenant,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The worker writes the checkpoint's event and the step's metrics separately: a poll may read the checkpoint
    first. It waits for its step's line, while later polls go on."""
    job_id = queued_job["id"]
    set_job(db, job_id, status="running", total_steps=STEPS)
    out = io.StringIO()
    monkeypatch.setattr(cli, "console", Console(file=out, soft_wrap=True, no_color=True))
    client = cli.Client(base_url, tenant_a.key)
    requests = [0]

    def count(_: httpx.Response) -> None:
        requests[0] += 1

    client.http.event_hooks["response"].append(count)

    def wait_polls(n: int) -> None:
        target, deadline = requests[0] + 3 * n, time.monotonic() + 30  # 3 requests a poll
        while requests[0] < target:
            assert time.monotonic() < deadline, "follow stopped polling"
            time.sleep(0.01)

    followed: dict[str, Any] = {}
    thread = threading.Thread(target=lambda: followed.update(cli.follow_job(client, job_id, poll=0.02)))
    thread.start()
    try:
        _metrics(db, job_id, 1)
        _message(db, job_id, "Checkpoint created at step 2", step=2)  # before step 2's metrics
        _message(db, job_id, "Pause requested: the trainer stops after step 3 at the latest", completed_step=2)
        wait_polls(3)
        assert "Checkpoint created at step 2" not in out.getvalue()
        _metrics(db, job_id, 2)
        _metrics(db, job_id, 3)
        set_job(db, job_id, status="succeeded")
        thread.join(timeout=30)
    finally:
        set_job(db, job_id, status="succeeded")
        thread.join(timeout=30)
        client.http.close()
    assert followed["status"] == "succeeded"
    order = _order(
        out.getvalue(),
        "step 1/3",
        "step 2/3",
        "Checkpoint created at step 2",
        "Pause requested",
        "step 3/3",
    )
    assert order == sorted(order), out.getvalue()

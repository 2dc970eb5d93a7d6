"""The Celery task name exists once (``api.tasks``): the API enqueues by it, the worker registers under it."""

from __future__ import annotations

from typing import Any

from api import tasks
from worker import sweeper
from worker.tasks import run_job_task


def test_the_worker_registers_the_task_under_the_apis_name() -> None:
    assert tasks.RUN_JOB == "proxima.jobs.run"
    assert run_job_task.name == tasks.RUN_JOB


def test_the_sweeper_enqueues_by_that_name(monkeypatch: Any) -> None:
    sent: list[tuple[str, list[str]]] = []

    class App:
        def send_task(self, name: str, args: list[str], queue: str) -> None:
            sent.append((name, args, queue))

    class Session:
        def __enter__(self) -> Session:
            return self

        def __exit__(self, *_: object) -> None:
            pass

    monkeypatch.setattr(sweeper, "session_scope", lambda url: Session())
    monkeypatch.setattr(sweeper, "held_job_ids", lambda app, **kw: set())
    monkeypatch.setattr(sweeper.runs, "settle_abandoned", lambda s, **kw: [])
    monkeypatch.setattr(sweeper.runs, "expired_jobs", lambda s, **kw: [])
    monkeypatch.setattr(sweeper.runs, "waiting_jobs", lambda s, **kw: ["ftjob-a"])
    monkeypatch.setattr(sweeper.runs, "mark_enqueued", lambda s, job_id: None)
    monkeypatch.setattr(sweeper.runs, "job_gpus", lambda s, job_ids: {"ftjob-a": 1})

    class Settings:
        db_url = "sqlite://"
        lease_seconds = 30.0
        max_job_gpus = 1
        worker_devices = None

    assert sweeper.sweep_once(App(), Settings()) == ["ftjob-a"]  # type: ignore[arg-type]
    assert sent == [("proxima.jobs.run", ["ftjob-a"], "celery")]

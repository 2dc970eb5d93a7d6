"""worker.sweeper reads which eval runs still have a ``proxima.evals.run`` message waiting (here on the embedded
broker; Redis in tests/integration/test_api_evals.py), so that it re-sends only the lost ones."""

from __future__ import annotations

from pathlib import Path

from celery import Celery

from api.tasks import RUN_EVAL, RUN_JOB
from worker.sweeper import held_task_ids


def test_the_broker_holds_the_runs_whose_messages_wait_and_not_the_jobs(tmp_path: Path) -> None:
    app = Celery("test-eval-broker", broker=f"sqla+sqlite:///{tmp_path / 'broker.db'}")
    for run_id in ("evalrun_a", "evalrun_b"):
        app.send_task(RUN_EVAL, args=[run_id])
    app.send_task(RUN_JOB, args=["ftjob-x"])  # a job's: not a run's wake-up call
    queue = [app.conf.task_default_queue]
    assert held_task_ids(app, task=RUN_EVAL, reserved_grace_s=30, queues=queue) == {"evalrun_a", "evalrun_b"}
    assert held_task_ids(app, task=RUN_JOB, reserved_grace_s=30, queues=queue) == {"ftjob-x"}

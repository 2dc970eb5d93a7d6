"""worker.broker: the sweeper reads which jobs still have a wake-up message waiting, so that it re-sends only lost
ones. Here on the embedded broker (kombu's SQLAlchemy transport on a SQLite file); Redis is read in the e2e tests."""

from __future__ import annotations

import json
from pathlib import Path

from celery import Celery

from api.tasks import RUN_JOB
from worker.broker import held_job_ids, job_id_of


def test_the_embedded_broker_holds_the_jobs_whose_messages_wait_and_not_those_taken(tmp_path: Path) -> None:
    app = Celery("test-broker", broker=f"sqla+sqlite:///{tmp_path / 'broker.db'}")
    for job_id in ("ftjob-a", "ftjob-b", "ftjob-c"):
        app.send_task(RUN_JOB, args=[job_id])
    app.send_task("other.task", args=["ftjob-x"])  # not a job's wake-up call
    assert held_job_ids(app, reserved_grace_s=30) == {"ftjob-a", "ftjob-b", "ftjob-c"}

    with app.connection_for_read() as conn:  # a worker takes the oldest message (closing gives it back)
        taken = conn.default_channel.basic_get(app.conf.task_default_queue)
        assert taken is not None and taken.headers["task"] == RUN_JOB
        assert held_job_ids(app, reserved_grace_s=30) == {"ftjob-b", "ftjob-c"}


def test_a_message_that_is_not_a_job_wake_up_call_has_no_job_id() -> None:
    assert job_id_of("not json") is None
    assert job_id_of(json.dumps({"headers": {"task": "other"}, "body": "[]"})) is None
    assert job_id_of(json.dumps({"headers": {"task": RUN_JOB}, "body": "not json"})) is None
    body = json.dumps([["ftjob-z"], {}, {}])
    assert job_id_of(json.dumps({"headers": {"task": RUN_JOB}, "body": body, "properties": {}})) == "ftjob-z"

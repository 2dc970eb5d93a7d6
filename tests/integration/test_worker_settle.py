"""A running job whose worker died after a cancel or a pause was asked for, a request nobody would ever act on
otherwise (no worker claims a job with a cancel pending): the sweeper's repository function ends it, on the real
database, as the API then shows; and the progress writes a worker may run twice through a database outage record
once."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import httpx

from tests.integration.conftest import add_checkpoint, assert_error, set_job

LEASE = 30.0


def settle(db: Callable[[], Any]) -> list[tuple[str, str]]:
    from api.repositories import runs

    with db() as s:
        return [(job_id, str(status)) for job_id, status in runs.settle_abandoned(s, grace_seconds=LEASE)]


def events(api: httpx.Client, job_id: str) -> list[str]:
    return [e["message"] for e in api.get(f"/v1/fine_tuning/jobs/{job_id}/events").json()["data"]]


def running_with_a_dead_worker(db: Callable[[], Any], job_id: str, *, expired_ago: float = 2 * LEASE) -> None:
    set_job(db, job_id, status="running", lease_owner="dead-worker", lease_expires_at=time.time() - expired_ago)


def test_a_cancel_of_a_job_whose_worker_died_ends_it_cancelled(
    api: httpx.Client, queued_job: dict[str, Any], db: Callable[[], Any]
) -> None:
    job_id = queued_job["id"]
    running_with_a_dead_worker(db, job_id)
    r = api.post(f"/v1/fine_tuning/jobs/{job_id}/cancel")
    assert r.status_code == 200 and r.json()["status"] == "running", r.text  # asked: its worker would stop it

    assert (job_id, "cancelled") in settle(db)
    job = api.get(f"/v1/fine_tuning/jobs/{job_id}").json()
    assert job["status"] == "cancelled" and job["finished_at"] is not None
    assert events(api, job_id)[0] == "The job was cancelled (its worker had stopped)"
    assert_error(api.post(f"/v1/fine_tuning/jobs/{job_id}/cancel"), 409, code="job_not_cancellable")
    assert job_id not in dict(settle(db))  # once


def test_a_pause_of_a_job_whose_worker_died_ends_it_paused_at_its_last_checkpoint_and_resume_queues_it(
    api: httpx.Client, queued_job: dict[str, Any], db: Callable[[], Any], artifact_store: Any
) -> None:
    job_id = queued_job["id"]
    add_checkpoint(db, artifact_store, job_id, 4)
    running_with_a_dead_worker(db, job_id)
    assert api.post(f"/v1/fine_tuning/jobs/{job_id}/pause").status_code == 200

    assert (job_id, "paused") in settle(db)
    assert api.get(f"/v1/fine_tuning/jobs/{job_id}").json()["status"] == "paused"
    assert events(api, job_id)[0] == (
        "The job was paused (its worker had stopped): resume continues from its checkpoint at step 4"
    )
    r = api.post(f"/v1/fine_tuning/jobs/{job_id}/resume")
    assert r.status_code == 200 and r.json()["status"] == "queued", r.text


def test_a_job_whose_lease_is_live_or_only_just_expired_is_left_to_its_worker(
    api: httpx.Client, queued_job: dict[str, Any], db: Callable[[], Any]
) -> None:
    job_id = queued_job["id"]
    set_job(db, job_id, status="running", lease_owner="live-worker", lease_expires_at=time.time() + LEASE)
    assert api.post(f"/v1/fine_tuning/jobs/{job_id}/cancel").json()["status"] == "running"
    assert job_id not in dict(settle(db))
    running_with_a_dead_worker(db, job_id, expired_ago=1)  # a worker cut off from the database may yet renew
    assert job_id not in dict(settle(db))
    running_with_a_dead_worker(db, job_id)
    assert dict(settle(db))[job_id] == "cancelled"


def test_progress_written_twice_is_recorded_once(queued_job: dict[str, Any], db: Callable[[], Any]) -> None:
    from sqlalchemy import func, select

    from api import ids
    from api.orm import JobEvent, Rollout
    from api.repositories import runs

    job_id, event_id = queued_job["id"], ids.event_id()
    for _ in range(2):  # a unit of work written again after a COMMIT whose answer was lost
        with db() as s:
            runs.add_event(s, job_id=job_id, level="info", message="Step 1/2", event_id=event_id)
            runs.add_rollouts(s, job_id=job_id, step=1, rollouts=[{"prompt": "a"}, {"prompt": "b"}])
    with db() as s:
        assert s.scalar(select(func.count()).select_from(JobEvent).where(JobEvent.id == event_id)) == 1
        assert s.scalar(select(func.count()).select_from(Rollout).where(Rollout.job_id == job_id)) == 2
        assert runs.event_exists(s, event_id=event_id) and not runs.event_exists(s, event_id=ids.event_id())

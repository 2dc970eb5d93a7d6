"""The job status is one enum (``api.status.JobStatus``): what the database stores, what the ORM reads back, what
the API's schema publishes and what the lifecycle groups are made of."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx
import pytest
from sqlalchemy.exc import StatementError

from api.status import CLAIMABLE, LEASED, NOT_STARTED, PAUSABLE, TERMINAL_STATUSES, WAITING, JobStatus

# The job statuses in the order of a job's life as the API documents them (api/status.py): OpenAI's six, from
# validating_files to the three terminal ones, then our own paused.
DESIGN_ORDER = ["validating_files", "queued", "running", "succeeded", "failed", "cancelled", "paused"]


def test_the_statuses_are_the_designs() -> None:
    assert [s.value for s in JobStatus] == DESIGN_ORDER
    assert sorted(TERMINAL_STATUSES) == ["cancelled", "failed", "succeeded"]
    assert (WAITING, NOT_STARTED) == (("validating_files", "queued"), ("validating_files", "queued", "paused"))
    assert (CLAIMABLE, LEASED) == (("queued", "running"), ("validating_files", "running"))
    assert PAUSABLE == ("validating_files", "queued", "running")


@pytest.mark.parametrize("status", list(JobStatus))
def test_a_pause_is_accepted_exactly_in_the_pausable_statuses(
    api: httpx.Client, queued_job: dict[str, Any], db: Callable[[], Any], status: JobStatus
) -> None:
    from api.orm import Job

    with db() as s:
        s.get(Job, queued_job["id"]).status = status
    r = api.post(f"/v1/fine_tuning/jobs/{queued_job['id']}/pause")
    if status in PAUSABLE or status is JobStatus.PAUSED:  # pausing a paused job is a no-op
        assert r.status_code == 200, r.text
    else:
        assert r.status_code == 409 and r.json()["error"]["code"] == "job_not_pausable", r.text


def test_the_api_schema_publishes_exactly_the_enum(anon: httpx.Client) -> None:
    schemas = anon.get("/openapi.json").json()["components"]["schemas"]
    assert schemas["JobStatus"]["enum"] == DESIGN_ORDER
    assert schemas["FineTuningJob"]["properties"]["status"] == {"$ref": "#/components/schemas/JobStatus"}


def test_the_orm_reads_a_member_and_refuses_to_write_anything_else(
    queued_job: dict[str, Any], db: Callable[[], Any]
) -> None:
    from api.orm import Job

    with db() as s:
        status = s.get(Job, queued_job["id"]).status
    assert type(status) is JobStatus and status is JobStatus.QUEUED
    with pytest.raises(StatementError, match="'queueing' is not a valid JobStatus"), db() as s:
        s.get(Job, queued_job["id"]).status = "queueing"
        s.flush()
    with db() as s:
        assert s.get(Job, queued_job["id"]).status is JobStatus.QUEUED


def test_a_cancel_that_lands_as_the_worker_pauses_the_run_still_cancels_it(
    api: httpx.Client, queued_job: dict[str, Any], db: Callable[[], Any]
) -> None:
    """The worker read no cancel, then the cancel set its flag on the running job, then the worker writes `paused`:
    that write is refused (the cancel wins) and the worker finishes the job cancelled instead."""
    from api.orm import Job
    from api.repositories import runs

    job_id = queued_job["id"]
    with db() as s:
        job = s.get(Job, job_id)
        job.status, job.lease_owner, job.lease_expires_at, job.pause_requested = "running", "w1", 2e9, True
    assert api.post(f"/v1/fine_tuning/jobs/{job_id}/cancel").json()["status"] == "running"  # asked, not yet done
    with db() as s:
        assert not runs.finish(s, job_id=job_id, worker_id="w1", status=JobStatus.PAUSED)
        assert s.get(Job, job_id).status == "running"
        assert runs.finish(s, job_id=job_id, worker_id="w1", status=JobStatus.CANCELLED)
    assert api.get(f"/v1/fine_tuning/jobs/{job_id}").json()["status"] == "cancelled"


def test_a_cancel_of_a_job_that_paused_between_its_two_updates_cancels_it(
    api: httpx.Client, queued_job: dict[str, Any], db: Callable[[], Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The API read `running`; before its first conditional update the worker paused the job, so the update for a
    running job finds none: the cancel tries the not-started update again instead of returning a paused job."""
    from api.orm import Job
    from api.repositories import jobs as jobs_repo

    job_id = queued_job["id"]
    with db() as s:
        s.get(Job, job_id).status = "running"
    real = jobs_repo.transition
    calls: list[tuple[str, ...]] = []

    def racing(session: Any, *, job: Any, from_statuses: tuple[str, ...], **values: Any) -> bool:
        calls.append(tuple(from_statuses))
        if len(calls) == 1:  # the worker pauses the job right after the first update missed it
            ok = real(session, job=job, from_statuses=from_statuses, **values)
            with db() as other:
                other.get(Job, job_id).status = "paused"
            session.expire_all()
            return ok
        return real(session, job=job, from_statuses=from_statuses, **values)

    monkeypatch.setattr(jobs_repo, "transition", racing)
    assert api.post(f"/v1/fine_tuning/jobs/{job_id}/cancel").json()["status"] == "cancelled"
    assert calls[:2] == [tuple(NOT_STARTED), (JobStatus.RUNNING,)] and calls[2] == tuple(NOT_STARTED)

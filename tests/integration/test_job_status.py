"""The job status is one enum (``api.status.JobStatus``): what the database stores, what the ORM reads back, what
the API's schema publishes and what the lifecycle groups are made of."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx
import pytest
from sqlalchemy.exc import StatementError

from api.status import CLAIMABLE, LEASED, NOT_STARTED, PAUSABLE, TERMINAL_STATUSES, WAITING, JobStatus

DESIGN_ORDER = ["validating_files", "queued", "running", "succeeded", "failed", "cancelled", "paused"]  # design §2


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

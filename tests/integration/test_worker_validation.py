"""The worker's ``validating_files`` phase on the real database and store: its races with cancel, pause and other
workers, files gone since the job was created, and the sweeper's view of jobs waiting for it."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import httpx

from tests.integration.conftest import job_body, jsonl, prompts, set_job, upload, validate


def create(api: httpx.Client, training_file: str) -> str:
    r = api.post("/v1/fine_tuning/jobs", json=job_body(training_file))
    assert r.status_code == 200 and r.json()["status"] == "validating_files", r.text
    return str(r.json()["id"])


def job_row(db: Callable[[], Any], job_id: str) -> Any:
    from api.orm import Job

    with db() as s:
        row = s.get(Job, job_id)
        s.expunge(row)
        return row


def test_a_cancel_that_arrives_while_the_files_are_read_wins(
    api: httpx.Client, training_file: str, settings: Any, db: Callable[[], Any]
) -> None:
    from api.repositories import runs

    job_id = create(api, training_file)
    with db() as s:
        assert runs.claim_validation(s, job_id=job_id, worker_id="w1", lease_seconds=30)
    assert api.post(f"/v1/fine_tuning/jobs/{job_id}/cancel").json()["status"] == "cancelled"
    with db() as s:
        assert not runs.end_validation(s, job_id=job_id, worker_id="w1", error=None)
    row = job_row(db, job_id)
    assert row.status == "cancelled" and row.error is None


def test_a_second_worker_cannot_validate_a_job_whose_lease_is_held(
    api: httpx.Client, training_file: str, settings: Any, db: Callable[[], Any]
) -> None:
    from api.repositories import runs

    job_id = create(api, training_file)
    with db() as s:
        assert runs.claim_validation(s, job_id=job_id, worker_id="w1", lease_seconds=30)
    assert validate(settings, job_id, worker_id="w2") == "skipped"
    assert job_row(db, job_id).status == "validating_files"
    with db() as s:  # the first worker's lease expires (it died): the job can be validated again
        assert runs.claim_validation(s, job_id=job_id, worker_id="w3", lease_seconds=30, at=time.time() + 31)


def test_a_paused_job_is_not_validated_and_a_cancelled_one_is_not_either(
    api: httpx.Client, training_file: str, settings: Any, db: Callable[[], Any]
) -> None:
    paused = create(api, training_file)
    assert api.post(f"/v1/fine_tuning/jobs/{paused}/pause").json()["status"] == "paused"
    assert validate(settings, paused) == "skipped"
    assert job_row(db, paused).status == "paused"
    cancelled = create(api, training_file)
    assert api.post(f"/v1/fine_tuning/jobs/{cancelled}/cancel").json()["status"] == "cancelled"
    assert validate(settings, cancelled) == "skipped"
    assert job_row(db, cancelled).status == "cancelled"


def test_a_file_deleted_before_validation_fails_the_job_as_invalid_file(
    api: httpx.Client, settings: Any, db: Callable[[], Any]
) -> None:
    file_id = upload(api, jsonl(prompts(2))).json()["id"]
    job_id = create(api, file_id)
    assert api.delete(f"/v1/files/{file_id}").status_code == 200
    assert validate(settings, job_id) == "failed"
    row = job_row(db, job_id)
    message = f"file {file_id} no longer exists: upload it again and create a new job"
    assert row.status == "failed" and row.lease_owner is None and row.finished_at is not None
    assert row.error == {"code": "invalid_file", "message": message, "param": "training_file"}


def test_contents_missing_from_the_store_fail_the_job_as_invalid_file(
    api: httpx.Client, settings: Any, db: Callable[[], Any], artifact_store: Any
) -> None:
    from api.orm import File

    file_id = upload(api, jsonl(prompts(2))).json()["id"]
    job_id = create(api, file_id)
    with db() as s:
        artifact_store.delete(s.get(File, file_id).storage_key)
    assert validate(settings, job_id) == "failed"
    assert job_row(db, job_id).error == {
        "code": "invalid_file",
        "message": f"file {file_id}'s contents are missing from the artifact store",
        "param": "training_file",
    }


def test_run_job_validates_first_and_a_bad_file_never_reaches_the_trainer(
    api: httpx.Client, settings: Any, db: Callable[[], Any]
) -> None:
    from worker.tasks import run_job

    file_id = upload(api, jsonl([{"text": "no prompt"}])).json()["id"]
    job_id = create(api, file_id)
    assert run_job(job_id, settings=settings, worker_id="w1") == "failed"
    row = job_row(db, job_id)
    assert row.attempts == 0 and row.started_at is None and row.lease_owner is None
    assert row.error == {
        "code": "invalid_file",
        "message": f"training file {file_id}, line 1: no prompt: expected a 'messages' list or a 'prompt' string",
        "param": "training_file",
    }


def test_the_sweeper_re_enqueues_a_job_left_validating_by_a_dead_worker(
    api: httpx.Client, training_file: str, db: Callable[[], Any]
) -> None:
    from api.repositories import runs

    job_id = create(api, training_file)
    now = time.time()
    set_job(db, job_id, enqueued_at=now - 60, lease_owner="dead", lease_expires_at=now - 1)
    with db() as s:
        stranded = runs.stranded_jobs(s, expired_grace_seconds=30, queued_grace_seconds=30, at=now, limit=10_000)
    assert job_id in stranded
    set_job(db, job_id, lease_expires_at=now + 30)  # a live lease: a worker is reading the files
    with db() as s:
        stranded = runs.stranded_jobs(s, expired_grace_seconds=30, queued_grace_seconds=30, at=now, limit=10_000)
    assert job_id not in stranded

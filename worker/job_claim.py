"""The lease of one attempt at a job: its claim (one conditional UPDATE), its release, and the failure a worker error
leaves on a job it holds. The heartbeat that renews the lease while the trainer runs is ``worker.lease``."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from api import ids
from api.db import session_scope
from api.repositories import runs
from api.settings import Settings
from api.status import JobStatus
from trainer.spec.config import JobSpec, SpecError
from worker.errors import ErrorCode
from worker.job_context import ClaimedJob
from worker.outbox import retry_db

log = logging.getLogger("proxima.worker")


def claim(settings: Settings, job_id: str, worker_id: str) -> ClaimedJob | None:
    """Claim the job; None when it is not claimable. A try whose COMMIT landed unseen (the connection lost) is told
    by the lease it left: ours."""
    at = time.time()
    with session_scope(settings.db_url) as s:
        if not runs.claim(s, job_id=job_id, worker_id=worker_id, lease_seconds=settings.lease_seconds, at=at):
            job = runs.get_job(s, job_id=job_id)
            if job is None or job.lease_owner != worker_id or job.status != JobStatus.RUNNING:
                return None
        job = runs.get_job(s, job_id=job_id)
        assert job is not None
        try:
            return ClaimedJob(
                job_id=job.id,
                tenant_id=job.tenant_id,
                model=job.model,
                suffix=job.suffix,
                spec=JobSpec.from_stored(job.spec),
                training_file=job.training_file,
                validation_file=job.validation_file,
                attempt=job.attempts,
                claimed_at=at,
            )
        except SpecError:  # parsed when the job was created: stored by an older version that no model here reads
            log.exception("job %s: its stored spec does not parse", job_id)
    retry_db(f"job {job_id}: record the worker error", worker_error_recorder(settings.db_url, job_id, worker_id))
    return None


def release(url: str, job_id: str, worker_id: str) -> None:
    with session_scope(url) as s:
        runs.release_lease(s, job_id=job_id, worker_id=worker_id)


def worker_error_recorder(url: str, job_id: str, worker_id: str) -> Callable[[], None]:
    """The write that fails a job this worker holds with ``internal_error`` (its event id fixed now, so a retry
    records it once)."""
    event_id = ids.event_id()

    def record() -> None:
        with session_scope(url) as s:
            if runs.finish(
                s,
                job_id=job_id,
                worker_id=worker_id,
                status=JobStatus.FAILED,
                error={"code": ErrorCode.INTERNAL_ERROR, "message": "internal worker error", "param": None},
            ):
                message = "The job failed: internal worker error"
                runs.add_event(s, job_id=job_id, level="error", message=message, event_id=event_id)

    return record

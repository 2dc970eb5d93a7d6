"""All SQL a worker runs: the lease (claim, renew, release), file validation, progress, events, metrics,
checkpoints, rollouts, result files, the outcome, and the sweeper's queries.

The lease is the only thing that decides who runs a job: every claim and renewal is one conditional UPDATE whose
row count says whether it won, so it is atomic on PostgreSQL and SQLite alike and a redelivered broker message is
harmless. Functions take a session and never commit: the worker commits at its unit-of-work boundary.

The writes of a running job's progress are idempotent (an event carries the id it was given when it arrived, metrics
and rollouts replace their step's, a checkpoint row its step's), so that the worker can write a unit of work again
when it cannot tell whether the database committed it (a connection lost during COMMIT) and nothing is written twice.
"""

from __future__ import annotations

import time
from typing import Any

from sqlalchemy import delete, func, or_, select, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from api import ids
from api.orm import Checkpoint, File, Job, JobEvent, JobMetric, Rollout, now
from api.repositories import webhooks
from api.status import CLAIMABLE, LEASED, TERMINAL_STATUSES, WAITING, JobStatus
from api.tasks import gpus_of


def _lease_free(at: float) -> Any:
    return or_(Job.lease_owner.is_(None), Job.lease_expires_at.is_(None), Job.lease_expires_at < at)


def _enqueued_before(t: float) -> Any:
    return or_(Job.enqueued_at.is_(None), Job.enqueued_at < t)


def claim(session: Session, *, job_id: str, worker_id: str, lease_seconds: float, at: float | None = None) -> bool:
    """Take the job if it is claimable and nobody holds a live lease; True when this worker now owns it."""
    at = time.time() if at is None else at
    result = session.execute(
        update(Job)
        .where(
            Job.id == job_id,
            Job.status.in_(CLAIMABLE),
            _lease_free(at),
            Job.cancel_requested.is_(False),
        )
        .values(
            lease_owner=worker_id,
            lease_expires_at=at + lease_seconds,
            status=JobStatus.RUNNING,
            attempts=Job.attempts + 1,
            started_at=func.coalesce(Job.started_at, int(at)),
            error=None,
        )
        .execution_options(synchronize_session=False)
    )
    return result.rowcount == 1  # type: ignore[attr-defined]


def claim_validation(
    session: Session, *, job_id: str, worker_id: str, lease_seconds: float, at: float | None = None
) -> bool:
    """Take a ``validating_files`` job's lease to validate its files (the status stays); True when this worker now
    holds it. The same conditions as :func:`claim`: nobody else holds a live lease and no cancel is pending."""
    at = time.time() if at is None else at
    result = session.execute(
        update(Job)
        .where(
            Job.id == job_id,
            Job.status == JobStatus.VALIDATING_FILES,
            _lease_free(at),
            Job.cancel_requested.is_(False),
        )
        .values(lease_owner=worker_id, lease_expires_at=at + lease_seconds)
        .execution_options(synchronize_session=False)
    )
    return result.rowcount == 1  # type: ignore[attr-defined]


def end_validation(session: Session, *, job_id: str, worker_id: str, error: dict[str, Any] | None) -> bool:
    """The files' verdict: ``queued`` when ``error`` is None, else ``failed`` with it; the lease is released either
    way. Only if the lease is still ours and the job still ``validating_files`` (a cancel or a pause that arrived
    meanwhile wins); False when nothing was written."""
    values: dict[str, Any] = {"lease_owner": None, "lease_expires_at": None}
    if error is None:
        values["status"] = JobStatus.QUEUED
    else:
        values.update(status=JobStatus.FAILED, error=error, finished_at=now(), estimated_finish=None)
    result = session.execute(
        update(Job)
        .where(Job.id == job_id, Job.lease_owner == worker_id, Job.status == JobStatus.VALIDATING_FILES)
        .values(**values)
        .execution_options(synchronize_session=False)
    )
    if result.rowcount != 1:  # type: ignore[attr-defined]
        return False
    if error is not None:  # the webhook event commits with the status change (api.repositories.webhooks)
        webhooks.job_status_changed(session, job_id=job_id, status=JobStatus.FAILED)
    return True


def renew_lease(
    session: Session, *, job_id: str, worker_id: str, lease_seconds: float, at: float | None = None
) -> bool:
    """Extend our lease; False when it is no longer ours (expired and taken, or released)."""
    at = time.time() if at is None else at
    result = session.execute(
        update(Job)
        .where(Job.id == job_id, Job.lease_owner == worker_id, Job.status.in_(LEASED))
        .values(lease_expires_at=at + lease_seconds)
        .execution_options(synchronize_session=False)
    )
    return result.rowcount == 1  # type: ignore[attr-defined]


def release_lease(session: Session, *, job_id: str, worker_id: str) -> None:
    session.execute(
        update(Job)
        .where(Job.id == job_id, Job.lease_owner == worker_id)
        .values(lease_owner=None, lease_expires_at=None)
        .execution_options(synchronize_session=False)
    )


def get_job(session: Session, *, job_id: str) -> Job | None:
    return session.get(Job, job_id)


def get_file(session: Session, *, file_id: str) -> File | None:
    return session.get(File, file_id)


def control_flags(session: Session, *, job_id: str) -> tuple[bool, bool]:
    """(cancel_requested, pause_requested), read fresh from the database."""
    row = session.execute(select(Job.cancel_requested, Job.pause_requested).where(Job.id == job_id)).one_or_none()
    return (bool(row[0]), bool(row[1])) if row is not None else (True, False)


def latest_checkpoint(session: Session, *, job_id: str) -> Checkpoint | None:
    """The newest checkpoint whose objects are complete in the store (rows are written after the upload)."""
    return session.scalars(
        select(Checkpoint).where(Checkpoint.job_id == job_id).order_by(Checkpoint.step_number.desc()).limit(1)
    ).first()


def metric_rows(session: Session, *, job_id: str, up_to: int | None = None) -> list[JobMetric]:
    q = select(JobMetric).where(JobMetric.job_id == job_id)
    if up_to is not None:
        q = q.where(JobMetric.step <= up_to)
    return list(session.scalars(q.order_by(JobMetric.step)))


def forget_after(session: Session, *, job_id: str, step: int) -> None:
    """Drop the metrics and rollouts a crashed attempt wrote beyond the checkpoint it resumes from: the resumed run
    trains those steps again and writes them anew."""
    session.execute(delete(JobMetric).where(JobMetric.job_id == job_id, JobMetric.step > step))
    session.execute(delete(Rollout).where(Rollout.job_id == job_id, Rollout.step > step))


def _insert_ignoring_duplicates(session: Session, model: type[Any], row: dict[str, Any], key: list[str]) -> None:
    """INSERT ``row`` unless a row with the same unique ``key`` exists (then nothing is written)."""
    dialect = session.get_bind().dialect.name
    if dialect == "postgresql":
        session.execute(postgresql.insert(model).values(**row).on_conflict_do_nothing(index_elements=key))
    elif dialect == "sqlite":
        session.execute(sqlite.insert(model).values(**row).on_conflict_do_nothing(index_elements=key))
    elif session.scalars(select(model).filter_by(**{k: row[k] for k in key})).first() is None:
        session.add(model(**row))


def add_event(
    session: Session,
    *,
    job_id: str,
    level: str,
    message: str,
    type: str = "message",
    data: dict[str, Any] | None = None,
    event_id: str | None = None,
    created_at: int | None = None,
) -> None:
    """Record an event. With ``event_id`` (given once, when the event happened) the write is idempotent: an event of
    that id already recorded is left as it is."""
    row = {
        "id": event_id or ids.event_id(),
        "job_id": job_id,
        "level": level,
        "message": message,
        "type": type,
        "data": data,
        "created_at": now() if created_at is None else created_at,
    }
    _insert_ignoring_duplicates(session, JobEvent, row, ["id"])


def event_exists(session: Session, *, event_id: str) -> bool:
    """Whether an event of this id is recorded: the mark that a unit of work which wrote it was committed."""
    return session.scalar(select(JobEvent.seq).where(JobEvent.id == event_id)) is not None


def upsert_metrics(session: Session, *, job_id: str, step: int, values: dict[str, Any]) -> None:
    """One row per (job, step); a resumed run that rewrites a step replaces it."""
    dialect = session.get_bind().dialect.name
    row = {"job_id": job_id, "step": step, "values": values, "created_at": now()}
    if dialect == "postgresql":
        pg = postgresql.insert(JobMetric).values(**row)
        session.execute(
            pg.on_conflict_do_update(index_elements=["job_id", "step"], set_={"values": pg.excluded["values"]})
        )
    elif dialect == "sqlite":
        lite = sqlite.insert(JobMetric).values(**row)
        session.execute(
            lite.on_conflict_do_update(index_elements=["job_id", "step"], set_={"values": lite.excluded["values"]})
        )
    else:
        session.merge(JobMetric(**row))


def add_rollouts(session: Session, *, job_id: str, step: int, rollouts: list[dict[str, Any]]) -> None:
    """The step's sampled rollouts, replacing any recorded for that step (a step's rollouts arrive in one piece)."""
    session.execute(delete(Rollout).where(Rollout.job_id == job_id, Rollout.step == step))
    session.add_all(Rollout(job_id=job_id, step=step, data=r) for r in rollouts)


def add_checkpoint(
    session: Session, *, job_id: str, step: int, metrics: dict[str, Any], storage_key: str
) -> Checkpoint:
    """Record a checkpoint whose objects are already in the store (a rewritten step updates its row)."""
    existing = session.scalars(
        select(Checkpoint).where(Checkpoint.job_id == job_id, Checkpoint.step_number == step)
    ).first()
    if existing is not None:
        existing.metrics, existing.storage_key = metrics, storage_key
        return existing
    ckpt = Checkpoint(id=ids.checkpoint_id(), job_id=job_id, step_number=step, metrics=metrics, storage_key=storage_key)
    session.add(ckpt)
    return ckpt


def update_progress(
    session: Session,
    *,
    job_id: str,
    current_step: int,
    total_steps: int | None,
    trained_tokens: int | None,
    estimated_finish: int | None,
) -> None:
    values: dict[str, Any] = {"current_step": current_step, "estimated_finish": estimated_finish}
    if total_steps is not None:
        values["total_steps"] = total_steps
    if trained_tokens is not None:
        values["trained_tokens"] = trained_tokens
    session.execute(update(Job).where(Job.id == job_id).values(**values).execution_options(synchronize_session=False))


def add_result_file(
    session: Session, *, tenant_id: str, filename: str, size: int, storage_key: str, file_id: str
) -> File:
    f = File(
        id=file_id,
        tenant_id=tenant_id,
        filename=filename,
        purpose="fine-tune-results",
        bytes=size,
        lines=0,
        storage_key=storage_key,
    )
    session.add(f)
    return f


def finish(
    session: Session,
    *,
    job_id: str,
    worker_id: str,
    status: JobStatus,
    error: dict[str, Any] | None = None,
    fine_tuned_model: str | None = None,
    result_files: list[str] | None = None,
) -> bool:
    """Set the outcome and release the lease, if the lease is still ours; False when it is not (nothing written).
    ``paused`` is written only while no cancel is requested; False then too."""
    values: dict[str, Any] = {"status": status, "lease_owner": None, "lease_expires_at": None, "estimated_finish": None}
    if status in TERMINAL_STATUSES:
        values["finished_at"] = now()
    if status == JobStatus.PAUSED:
        values["pause_requested"] = False  # the request is consumed; resume re-queues the job
    if error is not None:
        values["error"] = error
    if fine_tuned_model is not None:
        values["fine_tuned_model"] = fine_tuned_model
    if result_files is not None:
        values["result_files"] = result_files
    where = [Job.id == job_id, Job.lease_owner == worker_id]
    if status == JobStatus.PAUSED:
        where.append(Job.cancel_requested.is_(False))  # a cancel asked meanwhile wins: the worker finishes cancelled
    result = session.execute(update(Job).where(*where).values(**values).execution_options(synchronize_session=False))
    if result.rowcount != 1:  # type: ignore[attr-defined]
        return False
    webhooks.job_status_changed(session, job_id=job_id, status=status)  # commits with the status change
    return True


def expired_jobs(session: Session, *, grace_seconds: float, at: float | None = None, limit: int = 100) -> list[str]:
    """Running jobs whose worker is gone: a lease expired more than ``grace_seconds`` ago (the grace lets a live
    worker that lost the database for a while renew before anyone else is woken for its job), last enqueued longer
    ago than that too (one sweep does not pile messages on another), and no cancel or pause requested
    (:func:`settle_abandoned` ends those)."""
    at = time.time() if at is None else at
    q = (
        select(Job.id)
        .where(
            Job.status == JobStatus.RUNNING,
            _lease_free(at - grace_seconds),
            _enqueued_before(at - grace_seconds),
            Job.cancel_requested.is_(False),
            Job.pause_requested.is_(False),
        )
        .order_by(Job.created_at)
        .limit(limit)
    )
    return list(session.scalars(q))


def job_gpus(session: Session, *, job_ids: list[str]) -> dict[str, int]:
    """How many devices each job asks for (its spec's ``resources.gpus``: its queue, ``api.tasks.queue_for``)."""
    if not job_ids:
        return {}
    rows = session.execute(select(Job.id, Job.spec).where(Job.id.in_(job_ids)))
    return {job_id: gpus_of(spec or {}) for job_id, spec in rows}


def waiting_jobs(session: Session, *, grace_seconds: float, at: float | None = None, limit: int = 100) -> list[str]:
    """Jobs waiting for a worker (``validating_files`` or ``queued``), held by nobody (or by a dead worker's expired
    lease), no cancel requested, and enqueued longer ago than ``grace_seconds``, oldest first: the ones whose broker
    message may be lost. Whether it is lost is for the caller to tell (the sweeper looks in the broker)."""
    at = time.time() if at is None else at
    q = (
        select(Job.id)
        .where(
            Job.status.in_(WAITING),
            _lease_free(at),
            _enqueued_before(at - grace_seconds),
            Job.cancel_requested.is_(False),
        )
        .order_by(Job.created_at)
        .limit(limit)
    )
    return list(session.scalars(q))


def stranded_jobs(
    session: Session,
    *,
    expired_grace_seconds: float,
    queued_grace_seconds: float,
    at: float | None = None,
    limit: int = 100,
) -> list[str]:
    """:func:`expired_jobs` and :func:`waiting_jobs` together: every job that may need a new broker message. Paused,
    cancelled and finished jobs never qualify."""
    return expired_jobs(session, grace_seconds=expired_grace_seconds, at=at, limit=limit) + waiting_jobs(
        session, grace_seconds=queued_grace_seconds, at=at, limit=limit
    )


def settle_abandoned(
    session: Session, *, grace_seconds: float, at: float | None = None, limit: int = 100
) -> list[tuple[str, JobStatus]]:
    """End the running jobs whose worker died (a lease expired more than ``grace_seconds`` ago) after a cancel or a
    pause was requested, as their worker would have: ``cancelled``, or ``paused`` at the latest stored checkpoint
    (where a resume continues). Each is one conditional UPDATE, so two sweepers settle a job once; an event says
    what happened. Returns the jobs settled and the status each ended in."""
    at = time.time() if at is None else at
    candidates = session.execute(
        select(Job.id, Job.cancel_requested)
        .where(
            Job.status == JobStatus.RUNNING,
            _lease_free(at - grace_seconds),
            or_(Job.cancel_requested.is_(True), Job.pause_requested.is_(True)),
        )
        .order_by(Job.created_at)
        .limit(limit)
    ).all()
    settled: list[tuple[str, JobStatus]] = []
    for job_id, cancel in candidates:
        status = JobStatus.CANCELLED if cancel else JobStatus.PAUSED
        values: dict[str, Any] = {"status": status, "lease_owner": None, "lease_expires_at": None}
        values["estimated_finish"] = None
        if cancel:
            values["finished_at"] = now()
        else:
            values["pause_requested"] = False  # the request is consumed; resume re-queues the job
        flag = Job.cancel_requested.is_(True) if cancel else Job.pause_requested.is_(True)
        result = session.execute(
            update(Job)
            .where(Job.id == job_id, Job.status == JobStatus.RUNNING, _lease_free(at - grace_seconds), flag)
            .values(**values)
            .execution_options(synchronize_session=False)
        )
        if result.rowcount != 1:  # type: ignore[attr-defined]
            continue  # another sweeper settled it, or its worker came back
        webhooks.job_status_changed(session, job_id=job_id, status=status)
        if cancel:
            message = "The job was cancelled (its worker had stopped)"
        else:
            ck = latest_checkpoint(session, job_id=job_id)
            where = f"its checkpoint at step {ck.step_number}" if ck is not None else "the start: it had no checkpoint"
            message = f"The job was paused (its worker had stopped): resume continues from {where}"
        add_event(session, job_id=job_id, level="info", message=message)
        settled.append((job_id, status))
    return settled


def mark_enqueued(session: Session, *, job_id: str, at: float | None = None) -> None:
    at = time.time() if at is None else at
    session.execute(
        update(Job).where(Job.id == job_id).values(enqueued_at=at).execution_options(synchronize_session=False)
    )

"""SQL for jobs as the API sees them: a tenant's jobs, their events, metrics, checkpoints and rollouts.

The worker's side (claiming, leases, writing progress) lives in ``api.repositories.runs``. Status changes that race
with a worker are conditional updates (``transition``): the row changes only if it is still in an expected state.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from sqlalchemy import Connection, Row, Text, bindparam, cast, inspect, or_, select, tuple_, update
from sqlalchemy.orm import Session

from api import ids
from api.orm import Checkpoint, Job, JobEvent, JobMetric, Rollout, now
from api.repositories import webhooks
from api.status import JobStatus


def add(session: Session, *, row: Job) -> Job:
    session.add(row)
    session.flush()
    return row


def get(session: Session, *, tenant_id: str, job_id: str) -> Job | None:
    return session.scalar(select(Job).where(Job.id == job_id, Job.tenant_id == tenant_id))


# The job's row with its columns under the ORM's attribute names (``metadata_`` for the ``metadata`` column), which
# reads like a ``Job`` without the ORM's per-row work. Built once: building a select of 27 labelled columns costs
# more CPU than running it (0.25 ms a call on the 2-core CI machine).
_JOB_ROW = select(*(column.label(attr.key) for attr in inspect(Job).column_attrs for column in attr.columns)).where(
    Job.id == bindparam("job_id"), Job.tenant_id == bindparam("tenant_id")
)


def get_row(conn: Connection, *, tenant_id: str, job_id: str) -> Row[Any] | None:
    """``get`` on a plain connection (the hot job read, ``api.db.read``): a row with ``Job``'s attribute names."""
    return conn.execute(_JOB_ROW, {"job_id": job_id, "tenant_id": tenant_id}).one_or_none()


def page(
    session: Session,
    *,
    tenant_id: str,
    after: Job | None,
    limit: int,
    metadata: Mapping[str, str] | None = None,
    metadata_null: bool = False,
) -> tuple[list[Job], bool]:
    """The tenant's jobs, newest first; ``metadata`` keeps jobs whose metadata has every pair,
    ``metadata_null`` those without metadata. (rows, has_more)."""
    stmt = select(Job).where(Job.tenant_id == tenant_id)
    for key, value in (metadata or {}).items():
        stmt = stmt.where(Job.metadata_[key].as_string() == value)
    if metadata_null:
        # A JSON column stores Python None as JSON 'null' unless the value was never set (SQL NULL).
        stmt = stmt.where(or_(Job.metadata_.is_(None), cast(Job.metadata_, Text) == "null"))
    if after is not None:
        stmt = stmt.where(tuple_(Job.created_at, Job.id) < tuple_(after.created_at, after.id))
    stmt = stmt.order_by(Job.created_at.desc(), Job.id.desc()).limit(limit + 1)
    rows = list(session.scalars(stmt))
    return rows[:limit], len(rows) > limit


def transition(session: Session, *, job: Job, from_statuses: Iterable[JobStatus], **values: Any) -> bool:
    """Set ``values`` on the job only if its status is still one of ``from_statuses`` (a worker may have moved it
    meanwhile); refreshes ``job`` either way and says whether the update happened. A new status that sends a webhook
    event (cancelled, paused) records it in the same transaction (``api.repositories.webhooks``)."""
    result = session.execute(
        update(Job)
        .where(Job.id == job.id, Job.status.in_(list(from_statuses)))
        .values(**values)
        .execution_options(synchronize_session=False)
    )
    session.refresh(job)
    if not result.rowcount:  # type: ignore[attr-defined]
        return False
    if "status" in values:
        webhooks.job_status_changed(session, job_id=job.id, status=JobStatus(values["status"]))
    return True


def get_by_model(session: Session, *, tenant_id: str, fine_tuned_model: str) -> Job | None:
    """The tenant's job that produced ``fine_tuned_model``."""
    return session.scalars(
        select(Job).where(Job.tenant_id == tenant_id, Job.fine_tuned_model == fine_tuned_model).limit(1)
    ).first()


def succeeded_models(session: Session, *, tenant_id: str) -> list[tuple[str, int]]:
    """(fine_tuned_model, finished_at) of the tenant's succeeded jobs, newest first."""
    rows = session.execute(
        select(Job.fine_tuned_model, Job.finished_at, Job.created_at)
        .where(
            Job.tenant_id == tenant_id,
            Job.status == JobStatus.SUCCEEDED,
            Job.fine_tuned_model.is_not(None),
            Job.model_deleted_at.is_(None),
        )
        .order_by(Job.created_at.desc())
    )
    return [(str(m), int(f or c)) for m, f, c in rows]


def mark_model_deleted(session: Session, *, job: Job) -> bool:
    """Record that the tenant deleted the job's fine-tuned model (once: a second delete changes nothing); whether this
    call recorded it."""
    result = session.execute(
        update(Job)
        .where(Job.id == job.id, Job.model_deleted_at.is_(None))
        .values(model_deleted_at=now())
        .execution_options(synchronize_session=False)
    )
    session.refresh(job)
    return bool(result.rowcount)  # type: ignore[attr-defined]


# -- events ---------------------------------------------------------------------------------------------------


def add_event(
    session: Session, *, job_id: str, level: str, message: str, data: dict[str, Any] | None = None
) -> JobEvent:
    row = JobEvent(
        id=ids.event_id(), job_id=job_id, level=level, message=message, type="message", data=data, created_at=now()
    )
    session.add(row)
    session.flush()
    return row


def get_event(session: Session, *, job_id: str, event_id: str) -> JobEvent | None:
    return session.scalar(select(JobEvent).where(JobEvent.job_id == job_id, JobEvent.id == event_id))


def events_page(session: Session, *, job_id: str, after: JobEvent | None, limit: int) -> tuple[list[JobEvent], bool]:
    """Newest first (by insertion order); (rows, has_more)."""
    stmt = select(JobEvent).where(JobEvent.job_id == job_id)
    if after is not None:
        stmt = stmt.where(JobEvent.seq < after.seq)
    rows = list(session.scalars(stmt.order_by(JobEvent.seq.desc()).limit(limit + 1)))
    return rows[:limit], len(rows) > limit


# -- checkpoints ----------------------------------------------------------------------------------------------


def get_checkpoint(session: Session, *, job_id: str, checkpoint_id: str) -> Checkpoint | None:
    return session.scalar(select(Checkpoint).where(Checkpoint.job_id == job_id, Checkpoint.id == checkpoint_id))


def checkpoints_page(
    session: Session, *, job_id: str, after: Checkpoint | None, limit: int
) -> tuple[list[Checkpoint], bool]:
    """Latest step first; (rows, has_more)."""
    stmt = select(Checkpoint).where(Checkpoint.job_id == job_id)
    if after is not None:
        stmt = stmt.where(Checkpoint.step_number < after.step_number)
    rows = list(session.scalars(stmt.order_by(Checkpoint.step_number.desc()).limit(limit + 1)))
    return rows[:limit], len(rows) > limit


# -- metrics and rollouts -------------------------------------------------------------------------------------


MetricRow = Row[int, dict[str, float]]
"""(step, values) of one step's metrics."""


def metrics(session: Session, *, job_id: str, after_step: int | None, limit: int | None) -> list[MetricRow]:
    """The per-step series ordered by step, from the step after ``after_step``: rows of ``(step, values)``, not ORM
    objects (a long run's 10,000 rows cost half the CPU this way)."""
    stmt = select(JobMetric.step, JobMetric.values).where(JobMetric.job_id == job_id)
    if after_step is not None:
        stmt = stmt.where(JobMetric.step > after_step)
    stmt = stmt.order_by(JobMetric.step.asc())
    if limit is not None:
        stmt = stmt.limit(limit)
    return list(session.execute(stmt).all())


def rollout_steps(session: Session, *, job_id: str) -> list[int]:
    return list(session.scalars(select(Rollout.step).where(Rollout.job_id == job_id).distinct().order_by(Rollout.step)))


def rollouts(session: Session, *, job_id: str, step: int) -> list[Rollout]:
    return list(
        session.scalars(select(Rollout).where(Rollout.job_id == job_id, Rollout.step == step).order_by(Rollout.id))
    )

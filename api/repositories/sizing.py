"""SQL of a job's sizing: the length hyperparameters the worker fits to the data in ``validating_files``,
and the measured step times of past jobs that estimate a new one's duration.

Functions take a session and never commit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sqlalchemy import and_, exists, func, select, update
from sqlalchemy.orm import Session

from api.orm import Job, JobEvent, JobMetric
from api.status import JobStatus

# -- lengths fitted in validating_files -----------------------------------------------------------------------------


def creation_data(session: Session, *, job_id: str) -> dict[str, Any] | None:
    """The data of the job's first event (its creation's: the lengths left at their default)."""
    row = session.scalar(select(JobEvent.data).where(JobEvent.job_id == job_id).order_by(JobEvent.seq).limit(1))
    return dict(row) if isinstance(row, dict) else None


def set_spec(session: Session, *, job_id: str, worker_id: str, spec: dict[str, Any]) -> bool:
    """Store the job's spec with its lengths fitted to the data (``JobSpec.to_json``), only while this worker validates
    the job's files (its lease, status ``validating_files``); False when nothing was written."""
    result = session.execute(
        update(Job)
        .where(Job.id == job_id, Job.lease_owner == worker_id, Job.status == JobStatus.VALIDATING_FILES)
        .values(spec=spec)
        .execution_options(synchronize_session=False)
    )
    return result.rowcount == 1  # type: ignore[attr-defined]


# -- measured throughput --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MeasuredJob:
    """A past job's spec and the metrics of its latest steps (for the aggregate only: never shown as such)."""

    spec: dict[str, Any]
    steps: list[dict[str, float | None]]


def measured_jobs(
    session: Session, *, model: str, methods: list[str], jobs: int = 20, steps_per_job: int = 50
) -> list[MeasuredJob]:
    """The ``jobs`` most recently started jobs of any tenant on ``model`` with one of ``methods`` that recorded
    training steps, each with the metrics of its latest ``steps_per_job`` steps (step 0, validation only, left out)."""
    has_steps = exists().where(JobMetric.job_id == Job.id, JobMetric.step > 0)
    recent = list(
        session.execute(
            select(Job.id, Job.spec)
            .where(
                Job.model == model,
                Job.spec["method"]["type"].as_string().in_(methods),
                Job.started_at.is_not(None),
                has_steps,
            )
            .order_by(Job.started_at.desc(), Job.id)
            .limit(jobs)
        )
    )
    if not recent:
        return []
    rank = func.row_number().over(partition_by=JobMetric.job_id, order_by=JobMetric.step.desc()).label("recency")
    ranked = (
        select(JobMetric.job_id, JobMetric.step, JobMetric.values, rank)
        .where(and_(JobMetric.job_id.in_([r.id for r in recent]), JobMetric.step > 0))
        .subquery()
    )
    steps: dict[str, list[tuple[int, dict[str, float | None]]]] = {r.id: [] for r in recent}
    for job_id, step, values, _ in session.execute(select(ranked).where(ranked.c.recency <= steps_per_job)):
        steps[job_id].append((step, dict(values)))
    return [
        MeasuredJob(spec=dict(r.spec), steps=[v for _, v in sorted(steps[r.id], key=lambda s: s[0])]) for r in recent
    ]

"""SQL for the orphan clean-up: which stored keys still have a row. These reads cross tenants on purpose (the
clean-up is the service's own housekeeping); nothing here is reachable from a route."""

from __future__ import annotations

from collections.abc import Collection

from sqlalchemy import select
from sqlalchemy.orm import Session

from api.orm import Checkpoint, File, Job

# PostgreSQL takes far more, but a bounded IN list keeps each statement small and its plan cheap.
_BATCH = 500


def _batches(values: Collection[str]) -> list[list[str]]:
    ordered = sorted(values)
    return [ordered[i : i + _BATCH] for i in range(0, len(ordered), _BATCH)]


def live_file_keys(session: Session, *, keys: Collection[str]) -> set[str]:
    """The keys among ``keys`` that a file not marked deleted stores its bytes under."""
    found: set[str] = set()
    for batch in _batches(keys):
        found.update(
            session.scalars(select(File.storage_key).where(File.storage_key.in_(batch), File.deleted.is_(False)))
        )
    return found


def checkpoint_prefixes(session: Session, *, prefixes: Collection[str]) -> set[str]:
    """The checkpoint folders among ``prefixes`` that a checkpoint row points to."""
    found: set[str] = set()
    for batch in _batches(prefixes):
        found.update(session.scalars(select(Checkpoint.storage_key).where(Checkpoint.storage_key.in_(batch))))
    return found


def leased_jobs(session: Session, *, job_ids: Collection[str], at: float) -> set[str]:
    """The jobs among ``job_ids`` that a worker holds right now (an unexpired lease): they may be mid-upload."""
    found: set[str] = set()
    for batch in _batches(job_ids):
        found.update(session.scalars(select(Job.id).where(Job.id.in_(batch), Job.lease_expires_at > at)))
    return found

"""All SQL of the Tinker-compatible API: client sessions, training sessions and their lease, samplers, the
request queue, saved checkpoints.

A training session is leased like a job (``api.repositories.runs``): every claim and renewal is one conditional
UPDATE whose row count says whether it won. Requests are rows: the API inserts them (a resent request finds its row
by ``dedupe_key`` and is the same request), the session's owner runs them in order and writes their results. Functions
take a session and never commit: the caller commits at its unit-of-work boundary.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection, Row, and_, case, delete, exists, func, or_, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, aliased

from api import ids
from api.notify import DONE_CHANNEL, QUEUED_CHANNEL, notify
from api.orm import (
    Sampler,
    SessionCheckpoint,
    SessionRequest,
    TinkerClientSession,
    TrainingSession,
    now,
)

PENDING, RUNNING, DONE, FAILED = "pending", "running", "done", "failed"

# -- client sessions ------------------------------------------------------------------------------------------------


def create_client_session(
    session: Session, *, id: str, tenant_id: str, tags: list[str], user_metadata: dict[str, Any] | None, sdk: str | None
) -> TinkerClientSession:
    row = TinkerClientSession(id=id, tenant_id=tenant_id, tags=tags, user_metadata=user_metadata, sdk_version=sdk)
    session.add(row)
    session.flush()
    return row


def client_session(session: Session, *, tenant_id: str, id: str) -> TinkerClientSession | None:
    return session.scalar(
        select(TinkerClientSession).where(TinkerClientSession.id == id, TinkerClientSession.tenant_id == tenant_id)
    )


def heartbeat(session: Session, *, tenant_id: str, id: str) -> TinkerClientSession | None:
    row = client_session(session, tenant_id=tenant_id, id=id)
    if row is not None and row.finished_at is None:
        row.last_heartbeat_at = now()
    return row


def finish_client_session(session: Session, *, tenant_id: str, id: str, reason: str) -> bool:
    """Mark the client session finished and close its sessions (their workers unload them once idle)."""
    row = client_session(session, tenant_id=tenant_id, id=id)
    if row is None:
        return False
    if row.finished_at is None:
        row.finished_at, row.finish_reason = now(), reason
        session.execute(
            update(TrainingSession)
            .where(TrainingSession.client_session_id == id, TrainingSession.closed_at.is_(None))
            .values(closed_at=now())
            .execution_options(synchronize_session=False)
        )
    return True


def client_session_children(session: Session, *, id: str) -> tuple[list[str], list[str]]:
    """The ids of the client session's training runs and of its samplers."""
    runs = session.scalars(
        select(TrainingSession.id).where(TrainingSession.client_session_id == id, TrainingSession.kind == "training")
    ).all()
    samplers = session.scalars(select(Sampler.id).where(Sampler.client_session_id == id)).all()
    return list(runs), list(samplers)


def list_client_sessions(session: Session, *, tenant_id: str, limit: int, offset: int) -> list[str]:
    return list(
        session.scalars(
            select(TinkerClientSession.id)
            .where(TinkerClientSession.tenant_id == tenant_id)
            .order_by(TinkerClientSession.created_at.desc(), TinkerClientSession.id)
            .limit(limit)
            .offset(offset)
        ).all()
    )


# -- training sessions ----------------------------------------------------------------------------------------------


def training_session(session: Session, *, tenant_id: str, id: str) -> TrainingSession | None:
    return session.scalar(
        select(TrainingSession).where(TrainingSession.id == id, TrainingSession.tenant_id == tenant_id)
    )


def add_training_session(session: Session, row: TrainingSession) -> TrainingSession:
    """Insert the row, or return the one already there (a resent create: the id is derived from the SDK's counter)."""
    existing = session.get(TrainingSession, row.id)
    if existing is not None:
        return existing
    session.add(row)
    session.flush()
    return row


def training_runs_page(
    session: Session, *, tenant_id: str, limit: int, offset: int
) -> tuple[list[TrainingSession], int]:
    """A page of the tenant's training runs, newest first, by offset (as the SDK pages them); and how many there are."""
    where = (TrainingSession.tenant_id == tenant_id, TrainingSession.kind == "training")
    rows = session.scalars(
        select(TrainingSession)
        .where(*where)
        .order_by(TrainingSession.created_at.desc(), TrainingSession.id)
        .limit(limit)
        .offset(offset)
    ).all()
    total = session.scalar(select(func.count()).select_from(TrainingSession).where(*where))
    return list(rows), int(total or 0)


def training_sessions_page(
    session: Session, *, tenant_id: str, after: str | None, limit: int
) -> tuple[list[TrainingSession], bool]:
    """Training sessions newest first (created_at, then id), those after ``after``'s position (none if unknown, or
    another tenant's); (rows, has_more)."""
    stmt = select(TrainingSession).where(TrainingSession.tenant_id == tenant_id, TrainingSession.kind == "training")
    if after is not None:
        anchor = session.execute(
            select(TrainingSession.created_at, TrainingSession.id).where(
                TrainingSession.id == after, TrainingSession.tenant_id == tenant_id
            )
        ).first()
        if anchor is None:
            return [], False
        stmt = stmt.where(
            or_(
                TrainingSession.created_at < anchor[0],
                and_(TrainingSession.created_at == anchor[0], TrainingSession.id > anchor[1]),
            )
        )
    order = (TrainingSession.created_at.desc(), TrainingSession.id)
    rows = list(session.scalars(stmt.order_by(*order).limit(limit + 1)).all())
    return rows[:limit], len(rows) > limit


# -- samplers -------------------------------------------------------------------------------------------------------


def add_sampler(session: Session, row: Sampler) -> Sampler:
    existing = session.get(Sampler, row.id)
    if existing is not None:
        return existing
    session.add(row)
    session.flush()
    return row


def sampler(session: Session, *, tenant_id: str, id: str) -> Sampler | None:
    return session.scalar(select(Sampler).where(Sampler.id == id, Sampler.tenant_id == tenant_id))


# -- checkpoints ----------------------------------------------------------------------------------------------------


def checkpoint(session: Session, *, tenant_id: str, session_id: str, kind: str, name: str) -> SessionCheckpoint | None:
    return session.scalar(
        select(SessionCheckpoint).where(
            SessionCheckpoint.tenant_id == tenant_id,
            SessionCheckpoint.session_id == session_id,
            SessionCheckpoint.kind == kind,
            SessionCheckpoint.name == name,
        )
    )


def checkpoints_by_run(
    session: Session, *, tenant_id: str, session_ids: Sequence[str]
) -> dict[str, list[SessionCheckpoint]]:
    """The checkpoints of each of these training sessions, oldest first: one query for a whole page of sessions."""
    rows = session.scalars(
        select(SessionCheckpoint)
        .where(SessionCheckpoint.tenant_id == tenant_id, SessionCheckpoint.session_id.in_(session_ids))
        .order_by(SessionCheckpoint.created_at, SessionCheckpoint.id)
    ).all()
    out: dict[str, list[SessionCheckpoint]] = {id: [] for id in session_ids}
    for row in rows:
        out[row.session_id].append(row)
    return out


def latest_checkpoints(
    session: Session, *, tenant_id: str, session_ids: Sequence[str], kinds: Sequence[str]
) -> dict[str, dict[str, SessionCheckpoint]]:
    """The newest checkpoint of each kind of each of these training sessions (session id -> kind -> row), in one
    query however many sessions and checkpoints there are."""
    newest_first = func.row_number().over(
        partition_by=(SessionCheckpoint.session_id, SessionCheckpoint.kind),
        order_by=(SessionCheckpoint.created_at.desc(), SessionCheckpoint.id.desc()),
    )
    ranked = (
        select(SessionCheckpoint, newest_first.label("rank"))
        .where(
            SessionCheckpoint.tenant_id == tenant_id,
            SessionCheckpoint.session_id.in_(session_ids),
            SessionCheckpoint.kind.in_(kinds),
        )
        .subquery()
    )
    newest = aliased(SessionCheckpoint, ranked)
    out: dict[str, dict[str, SessionCheckpoint]] = {id: {} for id in session_ids}
    for row in session.scalars(select(newest).where(ranked.c.rank == 1)).all():
        out[row.session_id][row.kind] = row
    return out


def checkpoints_page(session: Session, *, tenant_id: str, limit: int, offset: int) -> list[SessionCheckpoint]:
    """A page of all the tenant's checkpoints, newest first, by offset (as the SDK pages them)."""
    return list(
        session.scalars(
            select(SessionCheckpoint)
            .where(SessionCheckpoint.tenant_id == tenant_id)
            .order_by(SessionCheckpoint.created_at.desc(), SessionCheckpoint.id.desc())
            .limit(limit)
            .offset(offset)
        ).all()
    )


def state_in_use(session: Session, *, storage_key: str) -> bool:
    """Whether a training session still starts from the state saved at ``storage_key`` (created from it)."""
    found = session.scalar(select(TrainingSession.id).where(TrainingSession.saved_state_key == storage_key).limit(1))
    return found is not None


def export_by_token(conn: Connection, *, token: str) -> Row[str, int | None] | None:
    """(storage key, expiry) of the exported weights that ``token`` downloads (the hot read of a download)."""
    return conn.execute(
        select(SessionCheckpoint.storage_key, SessionCheckpoint.expires_at).where(
            SessionCheckpoint.download_token == token, SessionCheckpoint.kind == "external_weights"
        )
    ).first()


def delete_checkpoint(session: Session, *, tenant_id: str, session_id: str, kind: str, name: str) -> str | None:
    """Forget the checkpoint; its storage key (for the caller to delete the bytes), or None when there was none."""
    row = checkpoint(session, tenant_id=tenant_id, session_id=session_id, kind=kind, name=name)
    if row is None:
        return None
    key = row.storage_key
    session.delete(row)
    return key


def set_checkpoint_ttl(
    session: Session, *, tenant_id: str, session_id: str, kind: str, name: str, ttl_seconds: int | None
) -> bool:
    row = checkpoint(session, tenant_id=tenant_id, session_id=session_id, kind=kind, name=name)
    if row is None:
        return False
    row.expires_at = None if ttl_seconds is None else now() + ttl_seconds
    return True


def record_checkpoint(
    session: Session,
    *,
    tenant_id: str,
    session_id: str,
    kind: str,
    name: str,
    storage_key: str,
    size_bytes: int,
    optimizer_steps: int,
    ttl_seconds: int | None,
) -> None:
    """Write (or replace: the same path saved again) a checkpoint row. Exported weights get their download token
    here, with the export: the GET that lists their URLs only reads it."""
    session.execute(
        delete(SessionCheckpoint).where(
            SessionCheckpoint.session_id == session_id, SessionCheckpoint.kind == kind, SessionCheckpoint.name == name
        )
    )
    session.add(
        SessionCheckpoint(
            tenant_id=tenant_id,
            session_id=session_id,
            kind=kind,
            name=name,
            storage_key=storage_key,
            size_bytes=size_bytes,
            optimizer_steps=optimizer_steps,
            expires_at=None if ttl_seconds is None else now() + ttl_seconds,
            download_token=ids.download_token() if kind == "external_weights" else None,
        )
    )


# -- requests (the API's side) --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Enqueued:
    id: str
    new: bool


def enqueue(session: Session, row: SessionRequest) -> Enqueued:
    """Insert the request, or return the one with its ``dedupe_key`` (the SDK resends a request it got no answer
    to). Nothing else is written: the session's row belongs to its worker (no lock the API and the worker wait on)."""
    existing = session.scalar(select(SessionRequest.id).where(SessionRequest.dedupe_key == row.dedupe_key))
    if existing is not None:
        return Enqueued(existing, False)
    try:
        with session.begin_nested():
            session.add(row)
            session.flush()
    except IntegrityError:  # a concurrent resend won the race
        existing = session.scalar(select(SessionRequest.id).where(SessionRequest.dedupe_key == row.dedupe_key))
        if existing is None:
            raise
        return Enqueued(existing, False)
    notify(session, QUEUED_CHANNEL, row.session_id)  # wakes the worker serving the session, at commit
    return Enqueued(row.id, True)


def request_outcome(conn: Connection, *, tenant_id: str, id: str) -> Row[str, bytes | None, str | None, Any] | None:
    """(status, result, result_format, error) of the tenant's request: the cheap read of a poll."""
    return conn.execute(
        select(SessionRequest.status, SessionRequest.result, SessionRequest.result_format, SessionRequest.error).where(
            SessionRequest.id == id, SessionRequest.tenant_id == tenant_id
        )
    ).first()


def recent_requests(session: Session, *, session_id: str, limit: int) -> list[SessionRequest]:
    return list(
        session.scalars(
            select(SessionRequest)
            .where(SessionRequest.session_id == session_id)
            .order_by(SessionRequest.seq.desc())
            .limit(limit)
        ).all()
    )


# -- the worker's side: lease, queue, results -----------------------------------------------------------------------


def _lease_free(at: float) -> Any:
    return or_(
        TrainingSession.lease_owner.is_(None),
        TrainingSession.lease_expires_at.is_(None),
        TrainingSession.lease_expires_at < at,
    )


def _has_work() -> Any:
    """Requests waiting, or one a lost owner was running (its client is still polling for the outcome)."""
    return exists().where(
        SessionRequest.session_id == TrainingSession.id, SessionRequest.status.in_((PENDING, RUNNING))
    )


def claimable(session: Session, *, at: float, limit: int = 8) -> list[str]:
    """Sessions with requests waiting and no live owner, the longest-waiting first."""
    oldest = (
        select(func.min(SessionRequest.seq))
        .where(SessionRequest.session_id == TrainingSession.id, SessionRequest.status.in_((PENDING, RUNNING)))
        .scalar_subquery()
    )
    return list(
        session.scalars(
            select(TrainingSession.id).where(_lease_free(at), _has_work()).order_by(oldest).limit(limit)
        ).all()
    )


def claim(session: Session, *, id: str, worker_id: str, lease_seconds: float, at: float | None = None) -> bool:
    at = time.time() if at is None else at
    result = session.execute(
        update(TrainingSession)
        .where(TrainingSession.id == id, _lease_free(at))
        .values(lease_owner=worker_id, lease_expires_at=at + lease_seconds)
        .execution_options(synchronize_session=False)
    )
    return result.rowcount == 1  # type: ignore[attr-defined]


def renew(session: Session, *, id: str, worker_id: str, lease_seconds: float, at: float | None = None) -> bool:
    at = time.time() if at is None else at
    result = session.execute(
        update(TrainingSession)
        .where(TrainingSession.id == id, TrainingSession.lease_owner == worker_id)
        .values(lease_expires_at=at + lease_seconds)
        .execution_options(synchronize_session=False)
    )
    return result.rowcount == 1  # type: ignore[attr-defined]


def release(session: Session, *, id: str, worker_id: str) -> None:
    session.execute(
        update(TrainingSession)
        .where(TrainingSession.id == id, TrainingSession.lease_owner == worker_id)
        .values(lease_owner=None, lease_expires_at=None, loaded_on=None)
        .execution_options(synchronize_session=False)
    )


def mark_loaded(session: Session, *, id: str, worker_id: str, restored: bool) -> None:
    values: dict[str, Any] = {"loaded_on": worker_id}
    if restored:
        values["restores"] = TrainingSession.restores + 1
    session.execute(
        update(TrainingSession)
        .where(TrainingSession.id == id, TrainingSession.lease_owner == worker_id)
        .values(**values)
        .execution_options(synchronize_session=False)
    )


def fail_in_flight(session: Session, *, id: str, message: str) -> int:
    """Fail the requests a lost worker was running (the new owner continues from the saved state without them), and
    move the session's order past them: the requests the SDK numbered after them run next."""
    running = session.execute(
        select(SessionRequest.id, SessionRequest.seq_id).where(
            SessionRequest.session_id == id, SessionRequest.status == RUNNING
        )
    ).all()
    for request_id, seq_id in running:
        finish_request(
            session,
            request_id=request_id,
            result=None,
            result_format=None,
            error={"error": message, "category": "server"},
        )
        advance(session, id=id, seq_id=seq_id)
    return len(running)


def next_request(session: Session, *, id: str, next_seq_id: int) -> SessionRequest | None:
    """The next request to run: the training request the SDK numbered next, or any sampling request, in arrival
    order. A training request whose turn has not come (its predecessor not yet arrived) waits."""
    return session.scalar(
        select(SessionRequest)
        .where(
            SessionRequest.session_id == id,
            SessionRequest.status == PENDING,
            or_(SessionRequest.seq_id.is_(None), SessionRequest.seq_id <= next_seq_id),
        )
        .order_by(SessionRequest.seq)
        .limit(1)
    )


def start_request(session: Session, *, request_id: str) -> None:
    session.execute(
        update(SessionRequest)
        .where(SessionRequest.id == request_id, SessionRequest.status == PENDING)
        .values(status=RUNNING)
        .execution_options(synchronize_session=False)
    )


def finish_request(
    session: Session,
    *,
    request_id: str,
    result: bytes | None,
    result_format: str | None,
    error: dict[str, Any] | None,
    loss: float | None = None,
) -> None:
    session.execute(
        update(SessionRequest)
        .where(SessionRequest.id == request_id)
        .values(
            status=FAILED if error is not None else DONE,
            result=result,
            result_format=result_format,
            error=error,
            loss=loss,
            finished_at=time.time(),
        )
        .execution_options(synchronize_session=False)
    )
    notify(session, DONE_CHANNEL, request_id)  # wakes the API's held polls of it, at commit


def advance(
    session: Session,
    *,
    id: str,
    seq_id: int | None,
    optimizer_steps: int | None = None,
    loss: float | None = None,
) -> None:
    """After a request ran: the next training request's turn, the counts, the step count, the last loss."""
    values: dict[str, Any] = {"request_count": TrainingSession.request_count + 1, "last_request_at": now()}
    if seq_id is not None:
        values["next_seq_id"] = case(
            (TrainingSession.next_seq_id > seq_id, TrainingSession.next_seq_id), else_=seq_id + 1
        )
    if optimizer_steps is not None:
        values["optimizer_steps"] = optimizer_steps
    if loss is not None:
        values["last_loss"] = loss
    session.execute(
        update(TrainingSession)
        .where(TrainingSession.id == id)
        .values(**values)
        .execution_options(synchronize_session=False)
    )


def set_saved_state(session: Session, *, id: str, key: str, steps: int, optimizer: bool = True) -> str | None:
    """Point the session at a newly saved state; the previous autosave's key (to delete), if it was one."""
    row = session.get(TrainingSession, id)
    assert row is not None
    previous = row.saved_state_key
    row.saved_state_key, row.saved_steps, row.saved_state_optimizer = key, steps, optimizer
    return previous


def idle_since(session: Session, *, id: str) -> float | None:
    """When the session's last request finished (or arrived), for the idle unload."""
    last = session.scalar(
        select(func.max(func.coalesce(SessionRequest.finished_at, SessionRequest.created_at))).where(
            SessionRequest.session_id == id
        )
    )
    return None if last is None else float(last)


def closed(session: Session, *, id: str) -> bool:
    return session.scalar(select(TrainingSession.closed_at).where(TrainingSession.id == id)) is not None


def waiting_requests(session: Session, *, id: str) -> int:
    return int(
        session.scalar(
            select(func.count())
            .select_from(SessionRequest)
            .where(and_(SessionRequest.session_id == id, SessionRequest.status == PENDING))
        )
        or 0
    )


def pending_requests(session: Session, *, id: str) -> list[SessionRequest]:
    return list(
        session.scalars(
            select(SessionRequest)
            .where(SessionRequest.session_id == id, SessionRequest.status == PENDING)
            .order_by(SessionRequest.seq)
        ).all()
    )


def pending_samples(session: Session, *, id: str, after_seq: int, limit: int) -> list[SessionRequest]:
    """The session's waiting sample requests that arrived after request ``after_seq``, oldest first."""
    return list(
        session.scalars(
            select(SessionRequest)
            .where(
                SessionRequest.session_id == id,
                SessionRequest.status == PENDING,
                SessionRequest.kind == "sample",
                SessionRequest.seq > after_seq,
            )
            .order_by(SessionRequest.seq)
            .limit(limit)
        ).all()
    )


def checkpoint_steps(session: Session, *, storage_key: str) -> int:
    """The optimiser steps of the state saved at ``storage_key``."""
    steps = session.scalar(
        select(SessionCheckpoint.optimizer_steps).where(SessionCheckpoint.storage_key == storage_key).limit(1)
    )
    return int(steps or 0)


def tenant_of(session: Session, *, id: str) -> str | None:
    return session.scalar(select(TrainingSession.tenant_id).where(TrainingSession.id == id))


def set_steps(session: Session, *, id: str, optimizer_steps: int) -> None:
    """The step count of the state a worker loaded (a restore goes back to the saved state's)."""
    session.execute(
        update(TrainingSession)
        .where(TrainingSession.id == id)
        .values(optimizer_steps=optimizer_steps)
        .execution_options(synchronize_session=False)
    )

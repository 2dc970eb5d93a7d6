"""SQL for webhooks: a tenant's endpoints, the outbox of events, the deliveries a worker claims and their attempts.

``job_status_changed`` is called by the repositories that change a job's status (``api.repositories.runs`` and
``api.repositories.jobs``), ``eval_run_finished`` by the one that ends an eval run (``api.repositories.evals``), in the
same transaction, right after the conditional UPDATE that won: the event and its deliveries commit with the change or
not at all, so a crash between the change and the POST loses nothing, and a change written twice (a unit of work
retried) is an UPDATE that does not win the second time, hence one event. Each event names its subject (type and id:
the payload's ``data.id``).

Deliveries are claimed like jobs: a claim is a conditional UPDATE that moves ``next_attempt_at`` past the time the
POST may take (a claim's expiry); on PostgreSQL the candidates are read ``FOR UPDATE SKIP LOCKED`` so that workers
claiming at once take different rows. A worker that dies mid-POST leaves the delivery due again when its claim
expires. Functions take a session and never commit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sqlalchemy import delete, select, tuple_, update
from sqlalchemy.orm import Session

from api import ids, webhook_events
from api.orm import EvalRun, Job, WebhookAttempt, WebhookDelivery, WebhookEndpoint, WebhookEvent, now
from api.status import EvalRunStatus, JobStatus

PENDING, DELIVERED, FAILED = "pending", "delivered", "failed"
RETRYING = "retrying"  # an attempt's outcome: failed, another one is scheduled


# -- endpoints ------------------------------------------------------------------------------------------------


def add_endpoint(session: Session, *, row: WebhookEndpoint) -> WebhookEndpoint:
    session.add(row)
    session.flush()
    return row


def get_endpoint(session: Session, *, tenant_id: str, endpoint_id: str) -> WebhookEndpoint | None:
    return session.scalar(
        select(WebhookEndpoint).where(WebhookEndpoint.id == endpoint_id, WebhookEndpoint.tenant_id == tenant_id)
    )


def endpoints_page(
    session: Session, *, tenant_id: str, after: WebhookEndpoint | None, limit: int
) -> tuple[list[WebhookEndpoint], bool]:
    """The tenant's endpoints, newest first; (rows, has_more)."""
    stmt = select(WebhookEndpoint).where(WebhookEndpoint.tenant_id == tenant_id)
    if after is not None:
        stmt = stmt.where(tuple_(WebhookEndpoint.created_at, WebhookEndpoint.id) < tuple_(after.created_at, after.id))
    stmt = stmt.order_by(WebhookEndpoint.created_at.desc(), WebhookEndpoint.id.desc()).limit(limit + 1)
    rows = list(session.scalars(stmt))
    return rows[:limit], len(rows) > limit


def delete_endpoint(session: Session, *, endpoint: WebhookEndpoint) -> None:
    """The endpoint, its pending deliveries and its delivery log."""
    session.execute(delete(WebhookAttempt).where(WebhookAttempt.endpoint_id == endpoint.id))
    session.execute(delete(WebhookDelivery).where(WebhookDelivery.endpoint_id == endpoint.id))
    session.delete(endpoint)
    session.flush()


# -- the outbox -----------------------------------------------------------------------------------------------


def job_status_changed(session: Session, *, job_id: str, status: JobStatus, at: float | None = None) -> str | None:
    """Record the event a job's arrival in ``status`` sends (none for most statuses); its id, or None when no
    endpoint wants it."""
    event_type = webhook_events.event_type_for(status)
    if event_type is None:  # most statuses: no event, and no read
        return None
    tenant_id = session.scalar(select(Job.tenant_id).where(Job.id == job_id))
    return _subject_event(session, tenant_id, event_type, webhook_events.JOB_SUBJECT, job_id, at)


def eval_run_finished(session: Session, *, run_id: str, status: EvalRunStatus, at: float | None = None) -> str | None:
    """Record the event an eval run's end in ``status`` (completed, failed, canceled) sends; its id, or None when no
    endpoint wants it."""
    event_type = webhook_events.EVAL_RUN_EVENTS.get(status)
    if event_type is None:
        return None
    tenant_id = session.scalar(select(EvalRun.tenant_id).where(EvalRun.id == run_id))
    return _subject_event(session, tenant_id, event_type, webhook_events.EVAL_RUN_SUBJECT, run_id, at)


def _subject_event(
    session: Session, tenant_id: str | None, event_type: str, subject_type: str, subject_id: str, at: float | None
) -> str | None:
    """``record_event`` for a subject's change, when the subject still exists."""
    if tenant_id is None:
        return None
    return record_event(
        session, tenant_id=tenant_id, event_type=event_type, subject_type=subject_type, subject_id=subject_id, at=at
    )


def record_event(
    session: Session,
    *,
    tenant_id: str,
    event_type: str,
    subject_type: str,
    subject_id: str,
    at: float | None = None,
) -> str | None:
    """Record an event with one delivery, due now, for each of the tenant's endpoints subscribed to its type at this
    moment; its id, or None (nothing written) when no endpoint wants it."""
    endpoints = [
        endpoint_id
        for endpoint_id, types in session.execute(
            select(WebhookEndpoint.id, WebhookEndpoint.event_types).where(WebhookEndpoint.tenant_id == tenant_id)
        )
        if event_type in (types or ())
    ]
    if not endpoints:
        return None
    at = now() if at is None else at
    event = WebhookEvent(
        id=ids.webhook_event_id(),
        tenant_id=tenant_id,
        type=event_type,
        subject_type=subject_type,
        subject_id=subject_id,
        created_at=int(at),
    )
    session.add(event)
    session.flush()  # the event's row before its deliveries' (their foreign key)
    session.add_all(
        WebhookDelivery(
            event_id=event.id,
            endpoint_id=endpoint_id,
            status=PENDING,
            attempts=0,
            next_attempt_at=float(at),
            created_at=int(at),
        )
        for endpoint_id in endpoints
    )
    session.flush()
    return event.id


def add_sent_event(
    session: Session,
    *,
    event: WebhookEvent,
    endpoint_id: str,
    started_at: float,
    duration_ms: int,
    status_code: int | None,
    error: str | None,
) -> WebhookAttempt:
    """An event POSTed once to one endpoint already (a test event): its row, its delivery, finished (delivered, or
    failed: a test is not retried), and the attempt's line in the endpoint's log."""
    outcome = DELIVERED if error is None else FAILED
    session.add(event)
    session.flush()
    delivery = WebhookDelivery(
        event_id=event.id,
        endpoint_id=endpoint_id,
        status=outcome,
        attempts=1,
        next_attempt_at=None,
        created_at=event.created_at,
        finished_at=now(),
    )
    session.add(delivery)
    session.flush()
    attempt = WebhookAttempt(
        id=ids.webhook_delivery_id(),
        delivery_id=delivery.id,
        endpoint_id=endpoint_id,
        attempt=1,
        created_at=int(started_at),
        duration_ms=duration_ms,
        status_code=status_code,
        error=error,
        outcome=outcome,
        next_retry_at=None,
    )
    session.add(attempt)
    session.flush()
    return attempt


# -- delivering -----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DueDelivery:
    """What a worker needs to POST one claimed delivery (plain values: the session is closed by then)."""

    delivery_id: int
    attempt: int  # the number this attempt will have (1 for the first)
    event_id: str
    event_type: str
    event_created_at: int
    subject_id: str  # the payload's data.id
    endpoint_id: str
    url: str
    secrets: tuple[str, ...]  # the current secret, then a rotated-out one still valid


def claim_due(session: Session, *, at: float, claim_seconds: float, limit: int) -> list[DueDelivery]:
    """Claim up to ``limit`` pending deliveries due at ``at`` (oldest due first) until ``at + claim_seconds``."""
    candidates = list(
        session.execute(
            select(WebhookDelivery.id, WebhookDelivery.next_attempt_at)
            .where(WebhookDelivery.status == PENDING, WebhookDelivery.next_attempt_at <= at)
            .order_by(WebhookDelivery.next_attempt_at)
            .limit(limit)
            .with_for_update(skip_locked=True)  # PostgreSQL; SQLite (one process) has no row locks and ignores it
        )
    )
    claimed: list[int] = []
    for delivery_id, due in candidates:
        won = session.execute(
            update(WebhookDelivery)
            .where(
                WebhookDelivery.id == delivery_id,
                WebhookDelivery.status == PENDING,
                WebhookDelivery.next_attempt_at == due,
            )
            .values(next_attempt_at=at + claim_seconds)
            .execution_options(synchronize_session=False)
        )
        if won.rowcount == 1:  # type: ignore[attr-defined]
            claimed.append(delivery_id)
    if not claimed:
        return []
    rows = session.execute(
        select(WebhookDelivery, WebhookEvent, WebhookEndpoint)
        .join(WebhookEvent, WebhookEvent.id == WebhookDelivery.event_id)
        .join(WebhookEndpoint, WebhookEndpoint.id == WebhookDelivery.endpoint_id)
        .where(WebhookDelivery.id.in_(claimed))
        .order_by(WebhookDelivery.id)
    )
    out = []
    for delivery, event, endpoint in rows:
        keys = [endpoint.secret]
        if endpoint.previous_secret and (endpoint.previous_secret_expires_at or 0) > at:
            keys.append(endpoint.previous_secret)
        out.append(
            DueDelivery(
                delivery_id=delivery.id,
                attempt=delivery.attempts + 1,
                event_id=event.id,
                event_type=event.type,
                event_created_at=event.created_at,
                subject_id=event.subject_id,
                endpoint_id=endpoint.id,
                url=endpoint.url,
                secrets=tuple(keys),
            )
        )
    return out


def record_attempt(
    session: Session,
    *,
    due: DueDelivery,
    started_at: float,
    duration_ms: int,
    status_code: int | None,
    error: str | None,
    outcome: str,
    next_attempt_at: float | None,
) -> bool:
    """Write an attempt's outcome: the delivery ``delivered``, ``failed`` (given up) or due again at
    ``next_attempt_at`` (``retrying``), and its line in the log. False (nothing written) when the delivery is gone
    (its endpoint deleted meanwhile) or no longer pending."""
    values: dict[str, Any] = {"attempts": due.attempt}
    if outcome == RETRYING:
        values["next_attempt_at"] = next_attempt_at
    else:
        values.update(status=outcome, next_attempt_at=None, finished_at=now())
    won = session.execute(
        update(WebhookDelivery)
        .where(WebhookDelivery.id == due.delivery_id, WebhookDelivery.status == PENDING)
        .values(**values)
        .execution_options(synchronize_session=False)
    )
    if won.rowcount != 1:  # type: ignore[attr-defined]
        return False
    session.add(
        WebhookAttempt(
            id=ids.webhook_delivery_id(),
            delivery_id=due.delivery_id,
            endpoint_id=due.endpoint_id,
            attempt=due.attempt,
            created_at=int(started_at),
            duration_ms=duration_ms,
            status_code=status_code,
            error=error,
            outcome=outcome,
            next_retry_at=None if next_attempt_at is None or outcome != RETRYING else int(next_attempt_at),
        )
    )
    return True


# -- the delivery log -----------------------------------------------------------------------------------------

AttemptRow = tuple[WebhookAttempt, WebhookEvent]


def get_attempt(session: Session, *, endpoint_id: str, attempt_id: str) -> WebhookAttempt | None:
    return session.scalar(
        select(WebhookAttempt).where(WebhookAttempt.endpoint_id == endpoint_id, WebhookAttempt.id == attempt_id)
    )


def attempts_page(
    session: Session, *, endpoint_id: str, after: WebhookAttempt | None, limit: int
) -> tuple[list[AttemptRow], bool]:
    """The endpoint's attempts with their events, newest first; (rows, has_more)."""
    stmt = (
        select(WebhookAttempt, WebhookEvent)
        .join(WebhookDelivery, WebhookDelivery.id == WebhookAttempt.delivery_id)
        .join(WebhookEvent, WebhookEvent.id == WebhookDelivery.event_id)
        .where(WebhookAttempt.endpoint_id == endpoint_id)
    )
    if after is not None:
        stmt = stmt.where(WebhookAttempt.seq < after.seq)
    rows = [(a, e) for a, e in session.execute(stmt.order_by(WebhookAttempt.seq.desc()).limit(limit + 1))]
    return rows[:limit], len(rows) > limit

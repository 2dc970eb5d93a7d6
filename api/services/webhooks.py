"""Webhook endpoints: a tenant's create, list, retrieve, update, delete and rotate, and the delivery log.

An endpoint's URL obeys the deployment's policy for URLs a tenant makes it call (``trainer.grading.url_policy``, the
endpoint graders' settings ``grader_url_*``): checked here after resolving its host (so these functions block on DNS:
routes call them from a waiting thread), and again at every delivery, pinned to the checked address
(``worker.webhooks``). The signing secret is shown in the create and rotate answers only.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import httpx
from sqlalchemy.orm import Session

from api import ids, webhook_events
from api.auth import Caller
from api.errors import InvalidRequest, NotFound
from api.orm import WebhookEndpoint, WebhookEvent, now
from api.repositories import webhooks as webhooks_repo
from api.schemas_webhooks import WebhookEndpointCreate, WebhookEndpointUpdate
from api.settings import Settings
from trainer.grading.url_policy import CLIENT_OPTIONS, UrlPolicy
from trainer.spec.urls import UrlRefused

MAX_LIST_LIMIT = 100
DEFAULT_LIST_LIMIT = 20
KEEP_OLD_SECRET_S = 24 * 3600
USER_AGENT = "Proxima-Webhooks/1"
MAX_ERROR_CHARS = 500


def url_policy(settings: Settings) -> UrlPolicy:
    """The endpoint graders' policy: the same schemes and networks."""
    return UrlPolicy(
        schemes=tuple(settings.grader_url_schemes),
        allow_networks=tuple(settings.grader_url_allow_networks),
        deny_networks=tuple(settings.grader_url_deny_networks),
    )


def _check_url(url: str, settings: Settings) -> str:
    try:
        url_policy(settings).resolve_sync(url)
    except UrlRefused as err:
        raise InvalidRequest(f"url: {err}", param="url", code="url_not_allowed") from None
    return url


def _check_event_types(event_types: list[str]) -> list[str]:
    for i, event_type in enumerate(event_types):
        if event_type not in webhook_events.EVENT_TYPES:
            raise InvalidRequest(
                f"event_types[{i}]: {event_type!r} is not an event type; valid: "
                f"{', '.join(webhook_events.EVENT_TYPES)}",
                param="event_types",
                code="invalid_event_type",
            )
    return list(dict.fromkeys(event_types))  # in the order given, each once


def create(*, session: Session, settings: Settings, tenant: Caller, body: WebhookEndpointCreate) -> WebhookEndpoint:
    at = now()
    row = WebhookEndpoint(
        id=ids.webhook_endpoint_id(),
        tenant_id=tenant.id,
        name=body.name,
        url=_check_url(body.url, settings),
        event_types=_check_event_types(body.event_types),
        secret=webhook_events.new_secret(),
        created_at=at,
        updated_at=at,
    )
    return webhooks_repo.add_endpoint(session, row=row)


def get(*, session: Session, tenant: Caller, endpoint_id: str) -> WebhookEndpoint:
    row = webhooks_repo.get_endpoint(session, tenant_id=tenant.id, endpoint_id=endpoint_id)
    if row is None:
        raise NotFound("webhook endpoint", endpoint_id, param="webhook_endpoint_id")
    return row


def page(*, session: Session, tenant: Caller, after: str | None, limit: int) -> tuple[list[WebhookEndpoint], bool]:
    cursor = None
    if after is not None:
        cursor = webhooks_repo.get_endpoint(session, tenant_id=tenant.id, endpoint_id=after)
        if cursor is None:
            raise InvalidRequest(f"no such webhook endpoint: {after!r}", param="after")
    return webhooks_repo.endpoints_page(session, tenant_id=tenant.id, after=cursor, limit=limit)


def update(
    *, session: Session, settings: Settings, tenant: Caller, endpoint_id: str, body: WebhookEndpointUpdate
) -> WebhookEndpoint:
    """Change what the body names; deliveries already owed keep going to the endpoint (at its new URL)."""
    row = get(session=session, tenant=tenant, endpoint_id=endpoint_id)
    changed = False
    if body.name is not None and body.name != row.name:
        row.name, changed = body.name, True
    if body.url is not None and body.url != row.url:
        row.url, changed = _check_url(body.url, settings), True
    if body.event_types is not None:
        event_types = _check_event_types(body.event_types)
        if event_types != list(row.event_types):
            row.event_types, changed = event_types, True
    if changed:
        row.updated_at = now()
    session.flush()
    return row


def delete(*, session: Session, tenant: Caller, endpoint_id: str) -> str:
    """The endpoint, the deliveries still owed to it and its log."""
    row = get(session=session, tenant=tenant, endpoint_id=endpoint_id)
    webhooks_repo.delete_endpoint(session, endpoint=row)
    return endpoint_id


def rotate_secret(
    *, session: Session, tenant: Caller, endpoint_id: str, keep_old_for_24_hours: bool
) -> WebhookEndpoint:
    """A new secret signs every delivery from now on (including retries of earlier events); with
    ``keep_old_for_24_hours`` the old one signs them too, for 24 hours, so that receivers can switch over."""
    row = get(session=session, tenant=tenant, endpoint_id=endpoint_id)
    at = now()
    if keep_old_for_24_hours:
        row.previous_secret, row.previous_secret_expires_at = row.secret, at + KEEP_OLD_SECRET_S
    else:
        row.previous_secret, row.previous_secret_expires_at = None, None
    row.secret = webhook_events.new_secret()
    row.updated_at = at
    session.flush()
    return row


def deliveries(
    *, session: Session, tenant: Caller, endpoint_id: str, after: str | None, limit: int
) -> tuple[list[webhooks_repo.AttemptRow], bool]:
    """The endpoint's delivery log: every attempt, newest first."""
    endpoint = get(session=session, tenant=tenant, endpoint_id=endpoint_id)
    cursor = None
    if after is not None:
        cursor = webhooks_repo.get_attempt(session, endpoint_id=endpoint.id, attempt_id=after)
        if cursor is None:
            raise InvalidRequest(f"no such delivery of this endpoint: {after!r}", param="after")
    return webhooks_repo.attempts_page(session, endpoint_id=endpoint.id, after=cursor, limit=limit)


# -- one POST of an event (the worker's delivery loop, and the test of an endpoint) ----------------------------


@dataclass(frozen=True)
class Outcome:
    status_code: int | None
    error: str | None  # None: delivered

    @property
    def delivered(self) -> bool:
        return self.error is None


def post(client: httpx.Client, policy: UrlPolicy, due: webhooks_repo.DueDelivery, *, timeout: float) -> Outcome:
    """One signed POST of the event to the endpoint, connected to the address its host resolves to now if the policy
    allows it. The answer's body is not read."""
    body = webhook_events.payload(
        event_id=due.event_id, event_type=due.event_type, created_at=due.event_created_at, subject_id=due.subject_id
    )
    try:
        pinned = policy.resolve_sync(due.url, timeout=timeout)  # DNS within the delivery's limit too
    except UrlRefused as err:
        return Outcome(None, f"the URL is refused: {err}"[:MAX_ERROR_CHARS])
    signed = webhook_events.headers(secrets=due.secrets, msg_id=due.event_id, timestamp=int(time.time()), body=body)
    headers = {**signed, **pinned.headers, "user-agent": USER_AGENT}
    try:
        with client.stream(
            "POST", pinned.request_url, content=body, headers=headers, extensions=pinned.extensions, timeout=timeout
        ) as response:
            status = response.status_code
    except httpx.TimeoutException:
        return Outcome(None, f"no answer within {timeout:g}s")
    except httpx.HTTPError as err:
        return Outcome(None, f"{type(err).__name__}: {err}"[:MAX_ERROR_CHARS])
    if 200 <= status < 300:
        return Outcome(status, None)
    return Outcome(status, f"HTTP {status}")


@dataclass(frozen=True)
class PreparedTest:
    """A test event to POST: what ``prepare_test`` read, so that the POST needs no session."""

    tenant: Caller
    event: WebhookEvent  # not added to any session until ``record_test``
    due: webhooks_repo.DueDelivery


@dataclass(frozen=True)
class SentTest:
    test: PreparedTest
    started_at: float
    duration_ms: int
    outcome: Outcome


def prepare_test(*, session: Session, tenant: Caller, endpoint_id: str, event_type: str) -> PreparedTest:
    """A signed sample event of ``event_type`` (one an endpoint may subscribe to, else a 400 naming it; its
    ``data.id`` the endpoint's, which no job or run has) for the endpoint, as its deliveries are made: the current
    secret and a rotated-out one still valid. Nothing is written."""
    if event_type not in webhook_events.EVENT_TYPES:
        raise InvalidRequest(
            f"event_type {event_type!r} is not one Proxima sends; valid: {', '.join(webhook_events.EVENT_TYPES)}",
            param="event_type",
            code="invalid_event_type",
        )
    endpoint = get(session=session, tenant=tenant, endpoint_id=endpoint_id)
    at = now()
    event = WebhookEvent(
        id=ids.webhook_event_id(),
        tenant_id=tenant.id,
        type=event_type,
        subject_type=webhook_events.ENDPOINT_SUBJECT,
        subject_id=endpoint.id,
        created_at=at,
    )
    keys = [endpoint.secret]
    if endpoint.previous_secret and (endpoint.previous_secret_expires_at or 0) > at:
        keys.append(endpoint.previous_secret)
    due = webhooks_repo.DueDelivery(
        delivery_id=0,  # none yet: written with the outcome
        attempt=1,
        event_id=event.id,
        event_type=event.type,
        event_created_at=at,
        subject_id=endpoint.id,
        endpoint_id=endpoint.id,
        url=endpoint.url,
        secrets=tuple(keys),
    )
    return PreparedTest(tenant=tenant, event=event, due=due)


def post_test(*, settings: Settings, test: PreparedTest) -> SentTest:
    """POST the test event now, once, within ``webhook_timeout_s`` (the URL policy checked again at the address it
    connects to). Call it with no session open: it may take that long, and a connection or transaction held
    meanwhile is one that other requests cannot have."""
    started = time.time()
    with httpx.Client(**CLIENT_OPTIONS) as client:
        outcome = post(client, url_policy(settings), test.due, timeout=settings.webhook_timeout_s)
    return SentTest(test, started, int((time.time() - started) * 1000), outcome)


def record_test(*, session: Session, sent: SentTest) -> webhooks_repo.AttemptRow:
    """The test's attempt, recorded in the endpoint's delivery log (finished: a test is not retried), and its
    event: the answer. Nothing was written before the POST ended, so no worker could claim the delivery meanwhile;
    an endpoint deleted since is a 404."""
    test = sent.test
    get(session=session, tenant=test.tenant, endpoint_id=test.due.endpoint_id)
    attempt = webhooks_repo.add_sent_event(
        session,
        event=test.event,
        endpoint_id=test.due.endpoint_id,
        started_at=sent.started_at,
        duration_ms=sent.duration_ms,
        status_code=sent.outcome.status_code,
        error=sent.outcome.error,
    )
    return attempt, test.event

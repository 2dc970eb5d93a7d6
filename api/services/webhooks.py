"""Webhook endpoints: a tenant's create, list, retrieve, update, delete and rotate, and the delivery log.

An endpoint's URL obeys the deployment's policy for URLs a tenant makes it call (``trainer.grading.url_policy``, the
endpoint graders' settings ``grader_url_*``): checked here after resolving its host (so these functions block on DNS:
routes call them from a waiting thread), and again at every delivery, pinned to the checked address
(``worker.webhooks``). The signing secret is shown in the create and rotate answers only.
"""

from __future__ import annotations

from sqlalchemy.orm import Session

from api import ids, webhook_events
from api.auth import Caller
from api.errors import InvalidRequest, NotFound
from api.orm import WebhookEndpoint, now
from api.repositories import webhooks as webhooks_repo
from api.schemas_webhooks import WebhookEndpointCreate, WebhookEndpointUpdate
from api.settings import Settings
from trainer.grading.url_policy import UrlPolicy
from trainer.spec.urls import UrlRefused

MAX_LIST_LIMIT = 100
DEFAULT_LIST_LIMIT = 20
KEEP_OLD_SECRET_S = 24 * 3600


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

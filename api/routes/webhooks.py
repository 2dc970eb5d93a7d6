"""``/v1/webhook_endpoints``: OpenAI's webhook endpoints (``client.webhooks.create/list/retrieve/update/delete/
rotate_secret``), ``/v1/webhook_event_types``, and our extensions: an endpoint's delivery log and its test."""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any, TypeVar

from fastapi import APIRouter, Query
from starlette.concurrency import run_in_threadpool

from api.db import session_scope
from api.deps import SessionDep, SettingsDep, TenantDep, session_slot
from api.errors import InvalidRequest, responses
from api.routes.files import AfterCursor
from api.schemas import CursorListObject, cursor_list
from api.schemas_webhooks import (
    WebhookDeliveryObject,
    WebhookEndpointCreate,
    WebhookEndpointDeleted,
    WebhookEndpointObject,
    WebhookEndpointTestResult,
    WebhookEndpointUpdate,
    WebhookEndpointWithSecret,
    WebhookEventTypeList,
    WebhookRotateSecret,
    WebhookTest,
)
from api.services import webhooks as webhooks_service
from api.webhook_events import EVENT_TYPES

router = APIRouter(tags=["webhooks"])
PREFIX = "/v1/webhook_endpoints"

Limit = Annotated[int, Query(ge=1, le=webhooks_service.MAX_LIST_LIMIT)]
T = TypeVar("T")


@router.post(PREFIX, response_model=WebhookEndpointWithSecret, summary="Create a webhook endpoint (shows its secret)")
def create_endpoint(
    body: WebhookEndpointCreate, session: SessionDep, settings: SettingsDep, tenant: TenantDep
) -> WebhookEndpointWithSecret:
    row = webhooks_service.create(session=session, settings=settings, tenant=tenant, body=body)
    return WebhookEndpointWithSecret.with_secret(row)


@router.get(PREFIX, response_model=CursorListObject[WebhookEndpointObject], summary="List webhook endpoints")
def list_endpoints(
    session: SessionDep,
    tenant: TenantDep,
    after: AfterCursor = None,
    limit: Limit = webhooks_service.DEFAULT_LIST_LIMIT,
) -> CursorListObject[WebhookEndpointObject]:
    rows, has_more = webhooks_service.page(session=session, tenant=tenant, after=after, limit=limit)
    items = [WebhookEndpointObject.from_row(r) for r in rows]
    return CursorListObject[WebhookEndpointObject](**cursor_list(items, has_more=has_more))


@router.get(PREFIX + "/{webhook_endpoint_id}", response_model=WebhookEndpointObject, summary="Retrieve an endpoint")
def retrieve_endpoint(webhook_endpoint_id: str, session: SessionDep, tenant: TenantDep) -> WebhookEndpointObject:
    row = webhooks_service.get(session=session, tenant=tenant, endpoint_id=webhook_endpoint_id)
    return WebhookEndpointObject.from_row(row)


@router.post(PREFIX + "/{webhook_endpoint_id}", response_model=WebhookEndpointObject, summary="Update an endpoint")
def update_endpoint(
    webhook_endpoint_id: str, body: WebhookEndpointUpdate, session: SessionDep, settings: SettingsDep, tenant: TenantDep
) -> WebhookEndpointObject:
    row = webhooks_service.update(
        session=session, settings=settings, tenant=tenant, endpoint_id=webhook_endpoint_id, body=body
    )
    return WebhookEndpointObject.from_row(row)


@router.delete(
    PREFIX + "/{webhook_endpoint_id}",
    response_model=WebhookEndpointDeleted,
    summary="Delete an endpoint (and the deliveries still owed to it)",
)
def delete_endpoint(webhook_endpoint_id: str, session: SessionDep, tenant: TenantDep) -> WebhookEndpointDeleted:
    return WebhookEndpointDeleted(
        id=webhooks_service.delete(session=session, tenant=tenant, endpoint_id=webhook_endpoint_id)
    )


@router.post(
    PREFIX + "/{webhook_endpoint_id}/rotate_secret",
    response_model=WebhookEndpointWithSecret,
    summary="Rotate an endpoint's signing secret (shows the new one)",
)
def rotate_secret(
    webhook_endpoint_id: str, session: SessionDep, tenant: TenantDep, body: WebhookRotateSecret | None = None
) -> WebhookEndpointWithSecret:
    keep = body.keep_old_secret_active_for_24_hours if body is not None else False
    row = webhooks_service.rotate_secret(
        session=session, tenant=tenant, endpoint_id=webhook_endpoint_id, keep_old_for_24_hours=keep
    )
    return WebhookEndpointWithSecret.with_secret(row)


@router.post(
    PREFIX + "/{webhook_endpoint_id}/test",
    response_model=WebhookEndpointTestResult,
    responses=responses(400, 404),
    summary="Send a signed sample event to an endpoint now (recorded in its delivery log, not retried)",
)
async def test_endpoint(
    webhook_endpoint_id: str, body: WebhookTest, settings: SettingsDep, tenant: TenantDep
) -> WebhookEndpointTestResult:
    # No request session: the POST may take webhook_timeout_s, and holds no connection, transaction or session slot;
    # the endpoint is read in one short session and the attempt written in another.
    test = await _in_session(
        settings.db_url,
        webhooks_service.prepare_test,
        tenant=tenant,
        endpoint_id=webhook_endpoint_id,
        event_type=body.event_type,
    )
    sent = await run_in_threadpool(webhooks_service.post_test, settings=settings, test=test)
    await _in_session(settings.db_url, webhooks_service.record_test, sent=sent)
    status = sent.outcome.status_code
    if status is None:  # not reached: refused by the URL policy, no connection, no answer in time
        raise InvalidRequest(
            f"the endpoint could not be reached: {sent.outcome.error}", param="url", code="endpoint_unreachable"
        )
    return WebhookEndpointTestResult(
        webhook_endpoint_id=webhook_endpoint_id, event_type=body.event_type, status_code=status
    )


async def _in_session(url: str, fn: Callable[..., T], /, **kwargs: Any) -> T:
    """``fn(session=..., **kwargs)`` in a unit of work of its own (committed), within a session slot."""
    async with session_slot(url):
        return await run_in_threadpool(_scoped, url, fn, kwargs)


def _scoped(url: str, fn: Callable[..., T], kwargs: dict[str, Any]) -> T:
    with session_scope(url) as session:
        return fn(session=session, **kwargs)


@router.get(
    PREFIX + "/{webhook_endpoint_id}/deliveries",
    response_model=CursorListObject[WebhookDeliveryObject],
    summary="An endpoint's delivery log: every attempt, newest first (extension)",
)
def list_deliveries(
    webhook_endpoint_id: str,
    session: SessionDep,
    tenant: TenantDep,
    after: AfterCursor = None,
    limit: Limit = webhooks_service.DEFAULT_LIST_LIMIT,
) -> CursorListObject[WebhookDeliveryObject]:
    rows, has_more = webhooks_service.deliveries(
        session=session, tenant=tenant, endpoint_id=webhook_endpoint_id, after=after, limit=limit
    )
    items = [WebhookDeliveryObject.from_row(attempt, event) for attempt, event in rows]
    return CursorListObject[WebhookDeliveryObject](**cursor_list(items, has_more=has_more))


@router.get("/v1/webhook_event_types", response_model=WebhookEventTypeList, summary="The event types to subscribe to")
def list_event_types(tenant: TenantDep) -> WebhookEventTypeList:
    return WebhookEventTypeList(data=list(EVENT_TYPES))

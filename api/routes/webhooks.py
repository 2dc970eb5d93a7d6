"""``/v1/webhook_endpoints``: OpenAI's webhook endpoints (``client.webhooks.create/list/retrieve/update/delete/
rotate_secret``), ``/v1/webhook_event_types``, and our extension, an endpoint's delivery log."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query

from api.deps import SessionDep, SettingsDep, TenantDep
from api.routes.files import AfterCursor
from api.schemas import CursorListObject, cursor_list
from api.schemas_webhooks import (
    WebhookDeliveryObject,
    WebhookEndpointCreate,
    WebhookEndpointDeleted,
    WebhookEndpointObject,
    WebhookEndpointUpdate,
    WebhookEndpointWithSecret,
    WebhookEventTypeList,
    WebhookRotateSecret,
)
from api.services import webhooks as webhooks_service
from api.webhook_events import EVENT_TYPES

router = APIRouter(tags=["webhooks"])
PREFIX = "/v1/webhook_endpoints"

Limit = Annotated[int, Query(ge=1, le=webhooks_service.MAX_LIST_LIMIT)]


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

"""API schemas of webhooks, shaped as OpenAI's ``/v1/webhook_endpoints`` (``openai.types.webhooks``): an endpoint,
the endpoint with its signing secret (the create and rotate answers only), a deleted endpoint, the event types; and
our extensions, the endpoint's delivery log (``GET /v1/webhook_endpoints/{id}/deliveries``) and its test
(``POST /v1/webhook_endpoints/{id}/test``, answered with the attempt)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

from api import webhook_events
from api.orm import WebhookAttempt, WebhookEndpoint, WebhookEvent
from api.schemas import _Request

MAX_NAME_CHARS = 256  # webhook_endpoints.name


class WebhookEndpointCreate(_Request):
    name: str = Field(min_length=1, max_length=MAX_NAME_CHARS, description="a human-readable name")
    url: str = Field(min_length=1, description="where deliveries are POSTed (https unless the deployment allows http)")
    event_types: list[str] = Field(
        min_length=1, description=f"the events delivered to it, among {', '.join(webhook_events.EVENT_TYPES)}"
    )


class WebhookEndpointUpdate(_Request):
    name: str | None = Field(None, min_length=1, max_length=MAX_NAME_CHARS)
    url: str | None = Field(None, min_length=1)
    event_types: list[str] | None = Field(None, min_length=1, description="the complete new set of event types")


class WebhookRotateSecret(_Request):
    keep_old_secret_active_for_24_hours: bool = Field(
        False, description="deliveries are signed with the old secret too for 24 hours (false: it stops at once)"
    )


class WebhookEndpointObject(BaseModel):
    id: str
    object: Literal["webhook_endpoint"] = "webhook_endpoint"
    name: str
    url: str
    event_types: list[str]
    created_at: int
    updated_at: int | None = None
    signing_secret_hint: str | None = None

    @classmethod
    def fields_of(cls, row: WebhookEndpoint) -> dict[str, Any]:
        return {
            "id": row.id,
            "name": row.name,
            "url": row.url,
            "event_types": list(row.event_types),
            "created_at": row.created_at,
            "updated_at": row.updated_at,
            "signing_secret_hint": webhook_events.secret_hint(row.secret),
        }

    @classmethod
    def from_row(cls, row: WebhookEndpoint) -> WebhookEndpointObject:
        return cls.model_validate(cls.fields_of(row))


class WebhookEndpointWithSecret(WebhookEndpointObject):
    """The create and rotate answers: the only ones that show the secret."""

    signing_secret: str

    @classmethod
    def with_secret(cls, row: WebhookEndpoint) -> WebhookEndpointWithSecret:
        return cls.model_validate({**cls.fields_of(row), "signing_secret": row.secret})


class WebhookEndpointDeleted(BaseModel):
    id: str
    object: Literal["webhook_endpoint.deleted"] = "webhook_endpoint.deleted"
    deleted: bool = True


class WebhookEventTypeList(BaseModel):
    object: Literal["list"] = "list"
    data: list[str]


class WebhookTest(_Request):
    """``client.webhooks.test``'s body: the type of the sample event to send."""

    event_type: str = Field(description="one of the event types an endpoint may subscribe to")


class WebhookEndpointTestResult(BaseModel):
    """OpenAI's answer to a test: the receiver answered (``status_code`` says how); one that could not be reached
    is a 400 ``endpoint_unreachable`` instead. The attempt is in the endpoint's delivery log either way."""

    object: Literal["webhook_endpoint.test"] = "webhook_endpoint.test"
    webhook_endpoint_id: str
    event_type: str
    status_code: int = Field(description="the HTTP status the endpoint answered")
    success: Literal[True] = True


class WebhookDeliveryObject(BaseModel):
    """One attempt at delivering an event to the endpoint (extension: OpenAI shows its log only in its dashboard)."""

    id: str
    object: Literal["webhook_endpoint.delivery"] = "webhook_endpoint.delivery"
    webhook_endpoint_id: str
    event_id: str = Field(description="the event's id, also the delivery's `webhook-id` header")
    event_type: str
    subject_type: Literal["fine_tuning.job", "eval.run", "webhook_endpoint"] = Field(
        description="what the event is about: a job, an eval run, or the endpoint itself (a test event)"
    )
    subject_id: str = Field(description="the event's `data.id`")
    job_id: str | None = Field(description="the event's `data.id` when it is about a job, else null")
    attempt: int = Field(description="1 for the event's first attempt at this endpoint")
    created_at: int = Field(description="when the attempt was made")
    duration_ms: int
    status_code: int | None = Field(description="the endpoint's HTTP status; null when there was no answer")
    error: str | None = Field(description="why the attempt failed; null when it was delivered")
    status: Literal["delivered", "retrying", "failed"] = Field(
        description="delivered (a 2xx); retrying (another attempt at next_retry_at); failed (given up)"
    )
    next_retry_at: int | None

    @classmethod
    def from_row(cls, attempt: WebhookAttempt, event: WebhookEvent) -> WebhookDeliveryObject:
        return cls(
            id=attempt.id,
            webhook_endpoint_id=attempt.endpoint_id,
            event_id=event.id,
            event_type=event.type,
            subject_type=event.subject_type,  # type: ignore[arg-type]
            subject_id=event.subject_id,
            job_id=event.subject_id if event.subject_type == webhook_events.JOB_SUBJECT else None,
            attempt=attempt.attempt,
            created_at=attempt.created_at,
            duration_ms=attempt.duration_ms,
            status_code=attempt.status_code,
            error=attempt.error,
            status=attempt.outcome,  # type: ignore[arg-type]
            next_retry_at=attempt.next_retry_at,
        )

"""Webhook events as OpenAI sends them, signed as Standard Webhooks (https://www.standardwebhooks.com).

A job that ends (or pauses) or an eval run that ends becomes an event ``{"id": "evt_…", "object": "event",
"created_at", "type", "data": {"id": <its subject's id>}}`` (OpenAI's ``openai.types.webhooks``
``FineTuningJob*WebhookEvent`` and ``EvalRun*WebhookEvent``); the subject (a job, an eval run, or an endpoint for a
test event) is recorded with the event. Each delivery is a POST of that JSON with three headers:

- ``webhook-id``: the event's id (the same on every retry, so that a receiver can drop a duplicate);
- ``webhook-timestamp``: unix seconds when this attempt was sent (a receiver refuses one too old: OpenAI's client
  allows 5 minutes either way, so each retry is signed afresh);
- ``webhook-signature``: ``v1,<base64 HMAC-SHA256 of "{id}.{timestamp}.{body}">`` keyed with the base64-decoded part
  of the ``whsec_…`` secret after its prefix; while a rotated-out secret stays valid, a second ``v1,…`` signed with
  it follows after a space (a receiver accepts any one that matches).

That is what ``openai.OpenAI().webhooks.unwrap(body, headers, secret=…)`` verifies. The signing is the few lines of
``hmac`` below rather than a dependency: the scheme is fixed by the standard and checked in the tests by the official
client itself.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import secrets
from collections.abc import Iterable
from typing import Any

from api.status import EvalRunStatus, JobStatus

SECRET_PREFIX = "whsec_"
SECRET_BYTES = 32

EVENT_BY_STATUS: dict[JobStatus, str] = {
    JobStatus.SUCCEEDED: "fine_tuning.job.succeeded",
    JobStatus.FAILED: "fine_tuning.job.failed",
    JobStatus.CANCELLED: "fine_tuning.job.cancelled",
    JobStatus.PAUSED: "fine_tuning.job.paused",  # ours: OpenAI's jobs do not pause
}
"""The statuses whose arrival is an event, and the event's type."""
EVAL_RUN_EVENTS: dict[EvalRunStatus, str] = {
    EvalRunStatus.COMPLETED: "eval.run.succeeded",
    EvalRunStatus.FAILED: "eval.run.failed",
    EvalRunStatus.CANCELED: "eval.run.canceled",
}
"""An eval run's final statuses and the event each sends (OpenAI's names)."""
EVENT_TYPES: tuple[str, ...] = (*EVENT_BY_STATUS.values(), *EVAL_RUN_EVENTS.values())
"""Every event type an endpoint may subscribe to, in the lifecycles' order."""
TEST_EVENT = "webhook_endpoint.test"
"""The event ``POST /v1/webhook_endpoints/{id}/test`` sends (its ``data.id`` is the endpoint's): not subscribed to."""

JOB_SUBJECT, EVAL_RUN_SUBJECT, ENDPOINT_SUBJECT = "fine_tuning.job", "eval.run", "webhook_endpoint"
"""What an event can be about (``webhook_events.subject_type``)."""


def event_type_for(status: JobStatus | str) -> str | None:
    """The event a job's arrival in ``status`` sends, or None when that status sends none."""
    return EVENT_BY_STATUS.get(JobStatus(status))


def new_secret() -> str:
    """A signing secret: ``whsec_`` and 32 random bytes in base64 (the form OpenAI's client decodes)."""
    return SECRET_PREFIX + base64.b64encode(secrets.token_bytes(SECRET_BYTES)).decode("ascii")


def secret_hint(secret: str) -> str:
    """What a listing shows of a secret: enough to tell two apart, too little to sign with."""
    return f"{SECRET_PREFIX}…{secret[-4:]}"


def payload(*, event_id: str, event_type: str, created_at: int, subject_id: str) -> bytes:
    """The event's JSON body, compact and in a fixed key order (a retry sends the same bytes)."""
    body: dict[str, Any] = {
        "id": event_id,
        "object": "event",
        "created_at": created_at,
        "type": event_type,
        "data": {"id": subject_id},
    }
    return json.dumps(body, separators=(",", ":")).encode()


def _key(secret: str) -> bytes:
    return base64.b64decode(secret.removeprefix(SECRET_PREFIX)) if secret.startswith(SECRET_PREFIX) else secret.encode()


def signature(*, secret: str, msg_id: str, timestamp: int, body: bytes) -> str:
    """``v1,<base64 HMAC-SHA256 of "{msg_id}.{timestamp}.{body}">``."""
    signed = f"{msg_id}.{timestamp}.".encode() + body
    digest = hmac.new(_key(secret), signed, hashlib.sha256).digest()
    return "v1," + base64.b64encode(digest).decode("ascii")


def headers(*, secrets: Iterable[str], msg_id: str, timestamp: int, body: bytes) -> dict[str, str]:
    """The Standard Webhooks headers of one delivery attempt, signed with each of ``secrets`` (the current one
    first; a rotated-out one still valid after it)."""
    signatures = " ".join(signature(secret=s, msg_id=msg_id, timestamp=timestamp, body=body) for s in secrets)
    return {
        "content-type": "application/json",
        "webhook-id": msg_id,
        "webhook-timestamp": str(timestamp),
        "webhook-signature": signatures,
    }

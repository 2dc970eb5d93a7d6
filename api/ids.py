"""Object ids with OpenAI's prefixes: ``file-…``, ``ftjob-…``, ``ftevent-…``, ``ftckpt_…``, ``eval_…`` and others."""

from __future__ import annotations

import secrets

_ALPHABET = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"


def _token(n: int = 24) -> str:
    return "".join(secrets.choice(_ALPHABET) for _ in range(n))


def file_id() -> str:
    return f"file-{_token()}"


def job_id() -> str:
    return f"ftjob-{_token()}"


def event_id() -> str:
    return f"ftevent-{_token()}"


def checkpoint_id() -> str:
    return f"ftckpt_{_token()}"


def tenant_id() -> str:
    return f"org-{_token(16)}"


def api_key() -> str:
    return f"sk-prx-{_token(40)}"


def fine_tuned_model_name(*, model: str, tenant_id: str, suffix: str | None, job_id: str) -> str:
    """``ft:<base>:<tenant>:<suffix>:<id>``, the job id without its ``ftjob-`` prefix."""
    return f"ft:{model}:{tenant_id}:{suffix or ''}:{job_id.removeprefix('ftjob-')}"


def webhook_endpoint_id() -> str:
    return f"whep_{_token()}"


def webhook_event_id() -> str:
    """A webhook event's id (OpenAI's events are ``evt_…``); also its deliveries' ``webhook-id`` header."""
    return f"evt_{_token()}"


def webhook_delivery_id() -> str:
    """One attempt at delivering an event to an endpoint (a line of the endpoint's delivery log)."""
    return f"whdel_{_token()}"


def tinker_session_id() -> str:
    """A Tinker client session (the SDK derives its training runs' ids from it: ``<id>:train:<n>``)."""
    return f"sess-{_token(20)}"


def tinker_request_id() -> str:
    """A Tinker request, the handle of its future."""
    return f"req-{_token()}"


def download_token() -> str:
    """The capability in an exported weights' download URL."""
    return _token(40)


def eval_id() -> str:
    """An eval (OpenAI's are ``eval_…``)."""
    return f"eval_{_token()}"


def eval_run_id() -> str:
    """A run of an eval (OpenAI's are ``evalrun_…``)."""
    return f"evalrun_{_token()}"


def output_item_id() -> str:
    """One graded item of an eval run (OpenAI's are ``outputitem_…``)."""
    return f"outputitem_{_token()}"

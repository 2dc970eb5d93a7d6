"""The webhook delivery loop: every worker process runs one (a thread beside the sweeper), so deliveries go out
whenever any worker runs.

Deliveries come from the database, never from memory: the event and one delivery per subscribed endpoint were
written in the transaction that changed the job's status (``api.repositories.webhooks``). Every
``webhook_poll_interval_s`` the loop claims the deliveries that are due (a claim is a conditional UPDATE, taken
``FOR UPDATE SKIP LOCKED`` on PostgreSQL, so two workers never POST the same one at once) and POSTs each, signed as
Standard Webhooks (``api.webhook_events``), with ``webhook_timeout_s``:

- a 2xx is ``delivered``;
- anything else (a 3xx, 4xx or 5xx, a timeout, a refused connection, a URL the policy now refuses) is retried after
  ``webhook_retry_base_s``, then twice as long each time, at most ``webhook_retry_max_delay_s`` apart, until
  ``webhook_retry_horizon_s`` after the event: then the delivery is ``failed`` (given up), which its log says.

Every attempt is a line of the endpoint's delivery log. A worker that dies mid-POST leaves its claimed deliveries due
again when their claim expires: delivery is at least once, and ``webhook-id`` (the event's id, the same on every
attempt) lets a receiver drop a duplicate.

SSRF: the URL was checked when it was set, and is checked again here by resolving its host and connecting to the
checked address itself (``trainer.grading.url_policy.Pinned``): a name that resolved to a public address then and
resolves to an internal one now (DNS rebinding) is refused, never connected to. Redirects are not followed.
"""

from __future__ import annotations

import logging
import threading
import time

import httpx

from api.db import session_scope
from api.repositories import webhooks as webhooks_repo
from api.services.webhooks import post, url_policy
from api.settings import Settings
from trainer.grading.url_policy import CLIENT_OPTIONS
from worker.outbox import is_transient

log = logging.getLogger("proxima.webhooks")

BATCH = 10
"""Deliveries one round claims at once (and POSTs one after the other)."""
CLAIM_MARGIN_S = 30.0


def retry_delay(settings: Settings, attempt: int) -> float:
    """The wait after failed attempt number ``attempt`` (1, 2, ...): base, 2 x base, 4 x base, ..., at most the cap."""
    return float(min(settings.webhook_retry_base_s * 2.0 ** min(attempt - 1, 62), settings.webhook_retry_max_delay_s))


def deliver_due(settings: Settings, client: httpx.Client, *, limit: int = BATCH) -> int:
    """Claim the deliveries due now (at most ``limit``), POST each and record the outcome; how many were claimed."""
    policy = url_policy(settings)
    claim_seconds = limit * (settings.webhook_timeout_s + 5.0) + CLAIM_MARGIN_S  # covers POSTing the whole batch
    with session_scope(settings.db_url) as s:
        due = webhooks_repo.claim_due(s, at=time.time(), claim_seconds=claim_seconds, limit=limit)
    for d in due:
        started = time.time()
        outcome = post(client, policy, d, timeout=settings.webhook_timeout_s)
        duration_ms = int((time.time() - started) * 1000)
        next_attempt_at: float | None = None
        if outcome.delivered:
            result = webhooks_repo.DELIVERED
        else:
            next_attempt_at = time.time() + retry_delay(settings, d.attempt)
            gave_up = next_attempt_at > d.event_created_at + settings.webhook_retry_horizon_s
            result = webhooks_repo.FAILED if gave_up else webhooks_repo.RETRYING
        with session_scope(settings.db_url) as s:
            webhooks_repo.record_attempt(
                s,
                due=d,
                started_at=started,
                duration_ms=duration_ms,
                status_code=outcome.status_code,
                error=outcome.error,
                outcome=result,
                next_attempt_at=next_attempt_at if result == webhooks_repo.RETRYING else None,
            )
        log.info(
            "webhook %s (%s) to %s, attempt %d: %s",
            d.event_id,
            d.event_type,
            d.endpoint_id,
            d.attempt,
            result if outcome.delivered else f"{result} ({outcome.error})",
        )
    return len(due)


class WebhookDeliverer(threading.Thread):
    """The loop: :func:`deliver_due` every ``webhook_poll_interval_s`` (at once again after a full batch)."""

    def __init__(self, settings: Settings) -> None:
        super().__init__(daemon=True, name="proxima-webhooks")
        self.settings = settings
        self.stopped = threading.Event()

    def run(self) -> None:
        with httpx.Client(**CLIENT_OPTIONS) as client:
            while not self.stopped.is_set():
                claimed = 0
                try:
                    claimed = deliver_due(self.settings, client)
                except Exception as err:  # a database hiccup: try again next round
                    if is_transient(err):
                        log.warning("webhook round skipped: the database is unavailable (%s)", type(err).__name__)
                    else:
                        log.warning("webhook round failed", exc_info=True)
                if claimed < BATCH:
                    self.stopped.wait(self.settings.webhook_poll_interval_s)

    def stop(self) -> None:
        self.stopped.set()

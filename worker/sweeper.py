"""The sweeper: re-enqueues jobs the broker no longer holds a message for.

The database is the truth and a broker message only a wake-up call (design §1), so every worker runs a sweeper thread
that sends a new message for (a) running jobs whose lease expired (their worker died, and its unacknowledged
message may not come back for an hour) and (b) queued jobs nobody holds whose last message is older than a grace
period (the broker may have lost it). A job re-enqueued twice is harmless: the lease lets one worker run it.
"""

from __future__ import annotations

import logging
import threading

from celery import Celery

from api.db import session_scope
from api.repositories import runs
from api.settings import Settings
from api.tasks import RUN_JOB

log = logging.getLogger("proxima.sweeper")

SWEEP_INTERVAL_S = 5.0
QUEUED_GRACE_S = 30.0


def sweep_once(app: Celery, settings: Settings, *, queued_grace_seconds: float = QUEUED_GRACE_S) -> list[str]:
    """Re-enqueue every stranded job once; returns their ids."""
    sent = []
    with session_scope(settings.db_url) as s:
        stranded = runs.stranded_jobs(
            s, expired_grace_seconds=settings.lease_seconds, queued_grace_seconds=queued_grace_seconds
        )
    for job_id in stranded:
        app.send_task(RUN_JOB, args=[job_id])
        with session_scope(settings.db_url) as s:
            runs.mark_enqueued(s, job_id=job_id)
        log.info("re-enqueued stranded job %s", job_id)
        sent.append(job_id)
    return sent


class Sweeper(threading.Thread):
    def __init__(
        self,
        app: Celery,
        settings: Settings,
        *,
        interval: float = SWEEP_INTERVAL_S,
        queued_grace_seconds: float = QUEUED_GRACE_S,
    ) -> None:
        super().__init__(daemon=True, name="proxima-sweeper")
        self.app, self.settings = app, settings
        self.interval, self.queued_grace_seconds = interval, queued_grace_seconds
        self.stopped = threading.Event()

    def run(self) -> None:
        while not self.stopped.wait(self.interval):
            try:
                sweep_once(self.app, self.settings, queued_grace_seconds=self.queued_grace_seconds)
            except Exception:  # a database or broker hiccup: try again next round
                log.warning("sweep failed", exc_info=True)

    def stop(self) -> None:
        self.stopped.set()

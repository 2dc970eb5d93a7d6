"""The heartbeat that keeps a worker's lease on a job alive while it validates the job's files or trains it.

Only a lease actually lost stops the attempt: a renewal that finds the job held by someone else (or no longer in a
leased status). A renewal that cannot reach the database is tried again every second, however long the outage, and
the lease is then renewed as soon as the database answers, if nobody took it meanwhile (nobody is woken for a running
job until its lease has been expired for a while: ``runs.expired_jobs``). While the renewals fail, :meth:`holds`
turns False once the last renewal's lease may have run out, so the worker stops writing until one succeeds.
"""

from __future__ import annotations

import logging
import threading
import time

from api.db import session_scope
from api.repositories import runs
from api.settings import Settings
from worker.outbox import is_transient

log = logging.getLogger("proxima.worker")

OUTAGE_RETRY_S = 1.0
CLOCK_MARGIN = 0.1
"""The share of the lease held back in :meth:`Heartbeat.holds`, for clock differences between machines."""


class Heartbeat(threading.Thread):
    """Renews the lease every third of its length; sets ``lost`` when the lease is no longer ours."""

    def __init__(self, settings: Settings, job_id: str, worker_id: str, *, claimed_at: float | None = None) -> None:
        super().__init__(daemon=True, name=f"lease-{job_id}")
        self.settings, self.job_id, self.worker_id = settings, job_id, worker_id
        self.lost = threading.Event()
        self.done = threading.Event()
        # The claim set the lease to expire lease_seconds after it.
        self.expires_at = (time.time() if claimed_at is None else claimed_at) + settings.lease_seconds

    def holds(self) -> bool:
        """True while the lease is certainly ours: not lost, and the last renewal's expiry not yet near."""
        margin = self.settings.lease_seconds * CLOCK_MARGIN
        return not self.lost.is_set() and time.time() < self.expires_at - margin

    def run(self) -> None:
        lease = self.settings.lease_seconds
        wait = lease / 3
        failing_since: float | None = None
        while not self.done.wait(wait):
            at = time.time()
            try:
                with session_scope(self.settings.db_url) as s:
                    ok = runs.renew_lease(s, job_id=self.job_id, worker_id=self.worker_id, lease_seconds=lease, at=at)
            except Exception as err:
                # Retried however long it lasts: only a renewal that the database refuses means the lease is lost.
                if not is_transient(err):
                    log.exception("job %s: lease renewal error", self.job_id)
                elif failing_since is None:
                    log.warning("job %s: lease renewal failed (%s); retrying", self.job_id, type(err).__name__)
                failing_since = failing_since or at
                wait = OUTAGE_RETRY_S
                continue
            if not ok:
                log.warning("job %s: lease lost by %s", self.job_id, self.worker_id)
                self.lost.set()
                return
            if failing_since is not None:
                log.warning("job %s: lease renewed after %.1f s of failures", self.job_id, at - failing_since)
                failing_since = None
            self.expires_at = at + lease
            wait = lease / 3

"""The heartbeat that keeps a worker's lease on a job alive while it validates the job's files or trains it."""

from __future__ import annotations

import logging
import threading
import time

from api.db import session_scope
from api.repositories import runs
from api.settings import Settings

log = logging.getLogger("proxima.worker")


class Heartbeat(threading.Thread):
    """Renews the lease every third of its length; sets ``lost`` when the lease is no longer ours (or could not be
    renewed before it expired, e.g. the database was unreachable)."""

    def __init__(self, settings: Settings, job_id: str, worker_id: str) -> None:
        super().__init__(daemon=True, name=f"lease-{job_id}")
        self.settings, self.job_id, self.worker_id = settings, job_id, worker_id
        self.lost = threading.Event()
        self.done = threading.Event()

    def run(self) -> None:
        lease = self.settings.lease_seconds
        renewed = time.time()
        while not self.done.wait(lease / 3):
            try:
                with session_scope(self.settings.db_url) as s:
                    ok = runs.renew_lease(s, job_id=self.job_id, worker_id=self.worker_id, lease_seconds=lease)
            except Exception:
                log.warning("job %s: lease renewal failed", self.job_id, exc_info=True)
                ok = time.time() < renewed + lease
            else:
                renewed = time.time() if ok else renewed
            if not ok:
                log.warning("job %s: lease lost by %s", self.job_id, self.worker_id)
                self.lost.set()
                return

"""A worker's lease on one Tinker session while it serves it: taken over from an owner that was lost (failing the
request that owner was running), renewed every third of its length, released at the end. The claim itself is the
session host's (``worker.sessions``)."""

from __future__ import annotations

import logging
import time

from sqlalchemy.exc import SQLAlchemyError

from api.db import session_scope
from api.orm import TrainingSession
from api.repositories import tinker as repo
from api.settings import Settings

log = logging.getLogger("proxima.worker.sessions")

CLOCK_MARGIN = 0.1  # the share of a lease held back for clock differences between machines


class SessionLease:
    """The lease this worker holds on session ``session_id``."""

    def __init__(self, settings: Settings, session_id: str, worker_id: str) -> None:
        self.settings, self.id, self.worker_id = settings, session_id, worker_id
        self.last_renewal = time.time()

    def take_over(self) -> TrainingSession | None:
        """Fail what a lost owner was running; read the session (None: it is gone)."""
        with session_scope(self.settings.db_url) as s:
            row = s.get(TrainingSession, self.id)
            if row is None:
                return None
            steps = row.saved_steps
            failed = repo.fail_in_flight(
                s,
                id=self.id,
                message=f"the worker serving this session was lost while it ran this request; the session continues "
                f"from its last saved state (after {steps} optimiser steps) on another worker: repeat the requests "
                "made since then",
            )
            if failed:
                log.warning("session %s: %d request(s) of a lost worker failed", self.id, failed)
                s.flush()
                s.refresh(row)  # its order moved past them
            s.expunge(row)
            return row

    def renew(self) -> bool:
        """Renew the lease every third of its length; False once it is lost. A renewal the database does not answer
        is tried again at the next turn, while the last one's lease has not run out (less a margin for clocks)."""
        lease = self.settings.lease_seconds
        if time.time() - self.last_renewal < lease / 3:
            return True
        try:
            with session_scope(self.settings.db_url) as s:
                ok = repo.renew(s, id=self.id, worker_id=self.worker_id, lease_seconds=lease)
        except SQLAlchemyError as err:
            log.warning("session %s: lease renewal failed (%s); retrying", self.id, type(err).__name__)
            return time.time() - self.last_renewal < lease * (1 - CLOCK_MARGIN)
        self.last_renewal = time.time()
        return ok

    def release(self) -> None:
        with session_scope(self.settings.db_url) as s:
            repo.release(s, id=self.id, worker_id=self.worker_id)

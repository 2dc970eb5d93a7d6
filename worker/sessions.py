"""Tinker training sessions on a worker: lease a session with waiting requests, hold its model in a child
process (``worker.session_process``), run its requests in the SDK's order, write their results.

A worker holds at most ``PROXIMA_WORKER_SESSIONS`` sessions at once, beside its jobs (Celery's ``--concurrency``):
the :class:`SessionHost` thread claims a session when it has room, and each claimed session gets a
:class:`SessionServer` thread. The database decides everything, as for jobs: a claim is one conditional UPDATE on the
session's lease, renewed while it serves.

What a session survives:

- **idle**: without a request for ``session_idle_s`` its state is saved to the artifact store (if it changed since
  the last save), its model unloaded and its lease released; the next request makes it claimable, and whichever
  worker claims it loads the saved state.
- **its worker's death**: the lease runs out; the next owner fails the request that was running (the client gets
  an error naming the saved state the session continues from) and loads the last saved state: the state is saved
  every ``session_autosave_steps`` optimiser steps (default: every step), and at every explicit save.

A server's parts: its lease (``worker.session_lease``), the state in its child and its saves (``worker.session_state``,
the child itself ``worker.session_child``), and its requests (``worker.session_requests``).
"""

from __future__ import annotations

import logging
import shutil
import tempfile
import threading
import time
from pathlib import Path

from sqlalchemy.exc import SQLAlchemyError

from api import notify
from api.db import session_scope
from api.orm import SessionRequest, TrainingSession
from api.repositories import tinker as repo
from api.settings import Settings
from worker.errors import JobError
from worker.models import resolve_model, store_for
from worker.session_lease import SessionLease
from worker.session_requests import OUTAGE_RETRY_S, RequestHandler
from worker.session_state import SessionState

log = logging.getLogger("proxima.worker.sessions")

CLAIM_POLL_S = 0.25  # how often a worker with room looks for a session to claim
REQUEST_POLL_S = (0.005, 0.01, 0.02, 0.05)  # how often a serving session looks for its next request
NOTIFIED_POLL_S = 0.5  # ... and where the API's notifications wake it (PostgreSQL)


class SessionServer(threading.Thread):
    """Serves one leased session until it is idle, closed and drained, or its lease is lost."""

    def __init__(
        self, settings: Settings, session_id: str, worker_id: str, *, listener: notify.Listener | None = None
    ) -> None:
        super().__init__(daemon=True, name=f"session-{session_id}")
        self.settings, self.id, self.worker_id = settings, session_id, worker_id
        self.listener = listener  # wakes the server when a request for it is queued (PostgreSQL)
        self.queued = threading.Event()
        self.stopping = threading.Event()
        self.scratch = Path(tempfile.mkdtemp(prefix="proxima-session-"))
        self.lease = SessionLease(settings, session_id, worker_id)
        self.state = SessionState(settings, session_id, store_for(settings), self.scratch)
        self.requests = RequestHandler(settings, session_id, self.state, self.lease)

    def run(self) -> None:
        if self.listener is not None:
            self.listener.add(self.id, self.queued.set)
        try:
            row = self.lease.take_over()
            if row is None:
                return
            self._load(row)
            self._serve()
        except Exception:
            log.exception("session %s: serving failed", self.id)
        finally:
            self._shut_down()

    def _shut_down(self) -> None:
        """Let the model go and the lease with it; the session's scratch folder is removed."""
        if self.listener is not None:
            self.listener.discard(self.id, self.queued.set)
        self.state.stop()
        self.lease.release()
        shutil.rmtree(self.scratch, ignore_errors=True)

    def _load(self, row: TrainingSession) -> None:
        try:
            model_path = resolve_model(row.base_model, self.settings.home / "models")
        except JobError as err:
            self._fail_waiting(err.message)
            raise
        self.state.load(row, model_path)
        self.requests.next_seq_id = row.next_seq_id
        with session_scope(self.settings.db_url) as s:
            repo.mark_loaded(s, id=self.id, worker_id=self.worker_id, restored=row.loaded_on is not None)
            if self.state.steps != row.optimizer_steps:
                repo.set_steps(s, id=self.id, optimizer_steps=self.state.steps)

    def _fail_waiting(self, message: str) -> None:
        with session_scope(self.settings.db_url) as s:
            for req in repo.pending_requests(s, id=self.id):
                repo.finish_request(
                    s, request_id=req.id, result=None, result_format=None, error={"error": message, "category": "user"}
                )

    def _serve(self) -> None:
        idle_from, attempt = time.time(), 0
        while not self.stopping.is_set():
            if not self.lease.renew():
                log.warning("session %s: lease lost; unloading", self.id)
                return
            self.queued.clear()  # before the read: a request queued after it wakes the wait below
            try:
                req = self._next()
            except SQLAlchemyError as err:  # the database away a moment: the lease decides how long we wait
                log.warning("session %s: reading its requests failed (%s)", self.id, type(err).__name__)
                time.sleep(OUTAGE_RETRY_S)
                continue
            if req is not None:
                self.requests.handle(req)
                idle_from, attempt = time.time(), 0
                continue
            if time.time() - idle_from >= self.settings.session_idle_s or self._closed_and_drained():
                self.state.unload()
                log.info("session %s: idle, unloaded", self.id)
                return
            backoff = REQUEST_POLL_S[min(attempt, len(REQUEST_POLL_S) - 1)]
            self.queued.wait(NOTIFIED_POLL_S if self.listener is not None else backoff)
            attempt += 1

    def _next(self) -> SessionRequest | None:
        with session_scope(self.settings.db_url) as s:
            req = repo.next_request(s, id=self.id, next_seq_id=self.requests.next_seq_id)
            if req is not None:
                repo.start_request(s, request_id=req.id)
                s.expunge(req)
            return req

    def _closed_and_drained(self) -> bool:
        with session_scope(self.settings.db_url) as s:
            return repo.closed(s, id=self.id) and repo.waiting_requests(s, id=self.id) == 0


class SessionHost(threading.Thread):
    """Claims sessions while this worker has room for one more, and serves each in a :class:`SessionServer`."""

    def __init__(self, settings: Settings, worker_id: str, *, capacity: int, poll_s: float = CLAIM_POLL_S) -> None:
        super().__init__(daemon=True, name="session-host")
        self.settings, self.worker_id, self.capacity, self.poll_s = settings, worker_id, capacity, poll_s
        self.servers: dict[str, SessionServer] = {}
        self.done = threading.Event()
        self.listener: notify.Listener | None = None

    def run(self) -> None:
        if notify.supported(self.settings.db_url):
            self.listener = notify.Listener(self.settings.db_url, notify.QUEUED_CHANNEL).start()
        while not self.done.wait(self.poll_s):
            self.servers = {k: v for k, v in self.servers.items() if v.is_alive()}
            if len(self.servers) >= self.capacity:
                continue
            try:
                claimed = self._claim()
            except Exception:  # the database down: try again at the next poll
                log.warning("session host: claim failed", exc_info=True)
                continue
            if claimed is not None:
                server = SessionServer(self.settings, claimed, self.worker_id, listener=self.listener)
                self.servers[claimed] = server
                server.start()

    def _claim(self) -> str | None:
        at = time.time()
        with session_scope(self.settings.db_url) as s:
            for candidate in repo.claimable(s, at=at):
                if candidate in self.servers:
                    continue
                if repo.claim(
                    s, id=candidate, worker_id=self.worker_id, lease_seconds=self.settings.lease_seconds, at=at
                ):
                    return candidate
        return None

    def stop(self) -> None:
        self.done.set()
        for server in list(self.servers.values()):
            server.stopping.set()
        for server in list(self.servers.values()):
            server.queued.set()
            server.join(timeout=30)
        if self.listener is not None:
            self.listener.stop()

"""Wake-ups for Tinker requests between the API and the workers: PostgreSQL's LISTEN/NOTIFY.

The database stays the truth: a waiter always re-reads its row, and keeps its own polling schedule as the fallback
(a notification lost with a connection costs one poll interval, never a result). Where the database is not
PostgreSQL (the embedded SQLite default) nothing is sent and the polling is all there is.

- ``DONE_CHANNEL``: a worker wrote a request's outcome; payload the request id. The API's held ``retrieve_future`` polls
  wait on it.
- ``QUEUED_CHANNEL``: the API queued a request for a session; payload the session id. The worker serving it waits on it.
"""

from __future__ import annotations

import contextlib
import logging
import select
import threading
from collections.abc import Callable
from typing import Any

from sqlalchemy import text
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session

log = logging.getLogger("proxima.notify")

DONE_CHANNEL = "proxima_tinker_done"
QUEUED_CHANNEL = "proxima_tinker_queued"
RECONNECT_S = 1.0


def notify(session: Session, channel: str, payload: str) -> None:
    """Notify ``channel`` when ``session`` commits (PostgreSQL; elsewhere nothing)."""
    if session.get_bind().dialect.name == "postgresql":
        session.execute(text("SELECT pg_notify(:channel, :payload)"), {"channel": channel, "payload": payload})


def supported(db_url: str) -> bool:
    return make_url(db_url).get_backend_name() == "postgresql"


class Listener:
    """One PostgreSQL connection LISTENing on ``channel`` in a daemon thread; callbacks registered for a payload are
    called (in that thread) when it is notified. Reconnects every second while the database is away."""

    def __init__(self, db_url: str, channel: str) -> None:
        self.url, self.channel = make_url(db_url), channel
        self._waiters: dict[str, set[Callable[[], None]]] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name=f"listen-{channel}")

    def start(self) -> Listener:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def add(self, payload: str, wake: Callable[[], None]) -> None:
        """Call ``wake`` at the next notification of ``payload`` (and every one after, until :meth:`discard`)."""
        with self._lock:
            self._waiters.setdefault(payload, set()).add(wake)

    def discard(self, payload: str, wake: Callable[[], None]) -> None:
        with self._lock:
            waiting = self._waiters.get(payload)
            if waiting is not None:
                waiting.discard(wake)
                if not waiting:
                    del self._waiters[payload]

    def _connect(self) -> Any:
        import psycopg2  # type: ignore[import-untyped]

        u = self.url
        options = {k: v for k, v in u.query.items() if isinstance(v, str)}  # sslmode and the like, as the URL says
        conn = psycopg2.connect(
            host=u.host,
            port=u.port,
            user=u.username,
            password=u.password,
            dbname=u.database,
            **({"connect_timeout": "5"} | options),
        )
        conn.autocommit = True
        with conn.cursor() as cur:
            cur.execute(f'LISTEN "{self.channel}"')
        return conn

    def _run(self) -> None:
        conn = None
        while not self._stop.is_set():
            try:
                if conn is None:
                    conn = self._connect()
                if select.select([conn], [], [], 0.5)[0]:
                    conn.poll()
                    while conn.notifies:
                        self._wake(conn.notifies.pop(0).payload)
            except Exception as err:  # the database away, or the connection dropped: poll until it is back
                log.debug("listener on %s: %s; reconnecting", self.channel, err)
                if conn is not None:
                    with contextlib.suppress(Exception):  # it is being thrown away
                        conn.close()
                conn = None
                self._stop.wait(RECONNECT_S)
        if conn is not None:
            conn.close()

    def _wake(self, payload: str) -> None:
        with self._lock:
            waiting = list(self._waiters.get(payload, ()))
        for wake in waiting:
            wake()

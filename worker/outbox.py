"""Database writes that ride out an outage: a transient error (the server restarting, a connection reset, a pool
with no connection to give) is retried, a bug is not.

A running job's progress goes through an :class:`Outbox`: the trainer's messages become writes, kept in the order they
arrived and written one unit of work at a time; a write that meets a transient error stays at the head and is tried
again a little later, while the trainer trains on and its next messages queue behind it. Writes are idempotent
(``api.repositories.runs``), so one written again after a connection lost during its COMMIT is not recorded twice.
Writes wait, too, while the worker cannot be sure it still holds the job's lease: a worker cut off from the database
past its lease writes nothing until a renewal proves the job is still its own.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from sqlalchemy import exc

log = logging.getLogger("proxima.worker")

T = TypeVar("T")

DB_PATIENCE_S = 600.0
"""How long a write that must happen before the worker can go on (claim, outcome) is retried through an outage."""
RETRY_MIN_S, RETRY_MAX_S = 0.2, 2.0


class DatabaseUnavailable(Exception):
    """The database stayed unreachable longer than the worker waits for it: the attempt is given up (its lease runs
    out, and another worker resumes the job from its latest recorded checkpoint)."""


def is_transient(err: BaseException) -> bool:
    """An error that says the database could not be reached or dropped the connection, not that the statement was
    wrong: the same statement may succeed later."""
    if isinstance(err, exc.DBAPIError) and err.connection_invalidated:
        return True
    return isinstance(err, exc.OperationalError | exc.InterfaceError | exc.TimeoutError)


def retry_db(what: str, fn: Callable[[], T], *, patience_s: float = DB_PATIENCE_S) -> T:
    """``fn()``, retried with backoff while it fails with a transient database error, for up to ``patience_s``; the
    last error is raised after that (or at once when it is not transient). ``fn`` is a whole unit of work: it opens
    its own session, and must be safe to run again after a try whose COMMIT may have landed."""
    deadline = time.monotonic() + patience_s
    delay = RETRY_MIN_S
    while True:
        try:
            return fn()
        except Exception as err:
            if not is_transient(err) or time.monotonic() + delay > deadline:
                raise
            log.warning("%s: database unavailable (%s); retrying in %.1f s", what, type(err).__name__, delay)
            time.sleep(delay)
            delay = min(delay * 2, RETRY_MAX_S)


@dataclass(frozen=True)
class Write:
    """One unit of work: ``run()`` opens its own session, commits, and can run again without writing twice."""

    what: str
    run: Callable[[], None]


class Outbox:
    """Writes in arrival order; :meth:`flush` writes as many as it can now. ``may_write`` is asked before each: False
    holds them (the lease is not known to be ours)."""

    def __init__(self, may_write: Callable[[], bool]) -> None:
        self.may_write = may_write
        self.pending: deque[Write] = deque()
        self._retry_at = 0.0
        self._delay = RETRY_MIN_S
        self._down_since: float | None = None

    def add(self, write: Write) -> None:
        self.pending.append(write)

    def flush(self) -> bool:
        """Write what can be written now; True when nothing is left. A transient error ends the round (the write is
        tried again after a backoff); any other error is raised."""
        now = time.monotonic()
        if now < self._retry_at:
            return not self.pending
        while self.pending:
            if not self.may_write():
                return False
            write = self.pending[0]
            try:
                write.run()
            except Exception as err:
                if not is_transient(err):
                    raise
                if self._down_since is None:
                    self._down_since = now
                    log.warning("database unavailable (%s: %s); buffering the job's progress", write.what, err)
                self._retry_at = time.monotonic() + self._delay
                self._delay = min(self._delay * 2, RETRY_MAX_S)
                return False
            self.pending.popleft()
            if self._down_since is not None:
                log.warning("database back after %.1f s; writing the buffered progress", now - self._down_since)
                self._down_since = None
            self._delay = RETRY_MIN_S
        return True

    def drain(self, *, patience_s: float = DB_PATIENCE_S, give_up: Callable[[], bool] = lambda: False) -> bool:
        """Flush until nothing is left (True), ``give_up()`` says to stop, or ``patience_s`` passes (False)."""
        deadline = time.monotonic() + patience_s
        while not self.flush():
            if give_up() or time.monotonic() > deadline:
                return False
            time.sleep(0.1)
        return True

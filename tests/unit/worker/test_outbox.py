"""worker.outbox: a running job's progress rides out a database outage: written in order, nothing lost, nothing twice,
nothing while the lease is not known to be ours; a bug is not retried."""

from __future__ import annotations

import pytest
from sqlalchemy import exc

from worker import outbox as ob
from worker.outbox import Outbox, Write, is_transient, retry_db


def outage(n: int) -> exc.OperationalError:
    return exc.OperationalError("INSERT ...", {}, Exception(f"server closed the connection unexpectedly ({n})"))


class Database:
    """Records writes; fails the next ``down`` of them with a transient error."""

    def __init__(self) -> None:
        self.rows: list[str] = []
        self.down = 0

    def write(self, name: str) -> Write:
        def run() -> None:
            if self.down:
                self.down -= 1
                raise outage(self.down)
            self.rows.append(name)

        return Write(name, run)


@pytest.fixture(autouse=True)
def no_backoff(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ob, "RETRY_MIN_S", 0.0)
    monkeypatch.setattr(ob, "RETRY_MAX_S", 0.0)
    monkeypatch.setattr(ob.time, "sleep", lambda s: None)


def test_writes_held_through_an_outage_are_written_in_order_once() -> None:
    db = Database()
    box = Outbox(may_write=lambda: True)
    box.add(db.write("metrics 1"))
    assert box.flush() and db.rows == ["metrics 1"]
    db.down = 3
    for name in ("event 2", "metrics 2", "checkpoint 2"):
        box.add(db.write(name))
        assert not box.flush()  # the database is down: the write stays at the head
    assert db.rows == ["metrics 1"] and len(box.pending) == 3
    assert box.flush()  # back
    assert db.rows == ["metrics 1", "event 2", "metrics 2", "checkpoint 2"]


def test_nothing_is_written_while_the_lease_is_not_known_to_be_ours() -> None:
    db, ours = Database(), [False]
    box = Outbox(may_write=lambda: ours[0])
    box.add(db.write("metrics 1"))
    assert not box.flush() and db.rows == []
    ours[0] = True
    assert box.drain(patience_s=1) and db.rows == ["metrics 1"]


def test_a_write_that_fails_for_another_reason_is_raised_not_retried() -> None:
    box = Outbox(may_write=lambda: True)

    def bug() -> None:
        raise exc.IntegrityError("INSERT ...", {}, Exception("duplicate key"))

    box.add(Write("bug", bug))
    with pytest.raises(exc.IntegrityError):
        box.flush()


def test_drain_gives_up_when_told_to() -> None:
    db = Database()
    db.down = 10**6
    box = Outbox(may_write=lambda: True)
    box.add(db.write("metrics 1"))
    assert not box.drain(patience_s=60, give_up=lambda: True)


def test_retry_db_retries_transient_errors_only() -> None:
    calls = []

    def flaky() -> str:
        calls.append(1)
        if len(calls) < 3:
            raise outage(len(calls))
        return "done"

    assert retry_db("flaky", flaky) == "done" and len(calls) == 3
    with pytest.raises(ValueError):
        retry_db("bug", lambda: (_ for _ in ()).throw(ValueError("bug")))
    with pytest.raises(exc.OperationalError):
        retry_db("down", lambda: (_ for _ in ()).throw(outage(0)), patience_s=0)


def test_transient_means_the_connection_not_the_statement() -> None:
    assert is_transient(outage(0))
    assert is_transient(exc.InterfaceError("SELECT 1", {}, Exception("connection already closed")))
    assert is_transient(exc.TimeoutError("QueuePool limit reached"))
    invalidated = exc.DBAPIError("SELECT 1", {}, Exception("reset"), connection_invalidated=True)
    assert is_transient(invalidated)
    assert not is_transient(exc.IntegrityError("INSERT", {}, Exception("duplicate key")))
    assert not is_transient(exc.ProgrammingError("SELEC", {}, Exception("syntax error")))

"""api.notify on the real PostgreSQL: a notification reaches a listener when its transaction commits (not before,
not at all on a rollback), only the callbacks of its payload are called, and a listener whose connection is killed
reconnects and hears the next one."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator

import psycopg2  # type: ignore[import-untyped]
import pytest
from sqlalchemy.engine import make_url

from api import notify
from api.db import session_scope
from tests.waiting import wait_until

CHANNEL = "proxima_test_channel"


@pytest.fixture
def listener(pg_url: str) -> Iterator[notify.Listener]:
    started = notify.Listener(pg_url, CHANNEL).start()
    try:
        wait_until_listening(pg_url)
        yield started
    finally:
        started.stop()


def backends_listening(pg_url: str, channel: str = CHANNEL) -> list[int]:
    """The server processes of the connections whose last statement was ``LISTEN channel`` (a listener's)."""
    u = make_url(pg_url)
    with psycopg2.connect(host=u.host, port=u.port, user=u.username, dbname=u.database) as conn, conn.cursor() as cur:
        cur.execute(
            "SELECT pid FROM pg_stat_activity WHERE datname = %s AND query = %s", (u.database, f'LISTEN "{channel}"')
        )
        return [row[0] for row in cur.fetchall()]


def heard_later(pg_url: str, listener: notify.Listener) -> None:
    """Notify a payload of its own, committed now, and wait until the listener calls its callback: the listener has
    then dispatched every notification committed before it (PostgreSQL delivers them in commit order)."""
    heard, payload = threading.Event(), f"probe-{uuid.uuid4().hex}"
    listener.add(payload, heard.set)
    try:
        with session_scope(pg_url) as s:
            notify.notify(s, CHANNEL, payload)
        assert heard.wait(10), "the listener did not hear a later notification"
    finally:
        listener.discard(payload, heard.set)


def wait_until_listening(pg_url: str) -> None:
    wait_until(lambda: backends_listening(pg_url), "the listener to connect")


def test_a_notification_arrives_at_commit_for_its_own_payload_only(pg_url: str, listener: notify.Listener) -> None:
    mine, other = threading.Event(), threading.Event()
    listener.add("req-1", mine.set)
    listener.add("req-2", other.set)
    with session_scope(pg_url) as s:
        notify.notify(s, CHANNEL, "req-1")
        s.flush()
        heard_later(pg_url, listener)  # committed while this transaction is open: heard, and mine not yet
        assert not mine.is_set()  # not before the commit
    assert mine.wait(5) and not other.is_set()


def test_a_rolled_back_notification_is_never_sent_and_a_discarded_callback_is_not_called(
    pg_url: str, listener: notify.Listener
) -> None:
    woken = threading.Event()
    listener.add("req-3", woken.set)
    with pytest.raises(RuntimeError), session_scope(pg_url) as s:
        notify.notify(s, CHANNEL, "req-3")
        raise RuntimeError("rolled back")
    heard_later(pg_url, listener)
    assert not woken.is_set()
    listener.discard("req-3", woken.set)
    with session_scope(pg_url) as s:
        notify.notify(s, CHANNEL, "req-3")
    heard_later(pg_url, listener)
    assert not woken.is_set()


def test_a_listener_whose_connection_is_killed_reconnects(pg_url: str, listener: notify.Listener) -> None:
    u = make_url(pg_url)
    (pid,) = backends_listening(pg_url)
    with psycopg2.connect(host=u.host, port=u.port, user=u.username, dbname=u.database) as conn, conn.cursor() as cur:
        cur.execute("SELECT pg_terminate_backend(%s)", (pid,))
    wait_until(lambda: backends_listening(pg_url) not in ([], [pid]), "the listener to reconnect", timeout=15)
    woken = threading.Event()
    listener.add("req-4", woken.set)
    with session_scope(pg_url) as s:
        notify.notify(s, CHANNEL, "req-4")
    assert woken.wait(5)


def test_only_postgresql_urls_are_listened_to() -> None:
    assert notify.supported("postgresql+psycopg2://u@h/db") and not notify.supported("sqlite:////tmp/x.db")

"""Database engine and sessions (SQLAlchemy 2). Code never commits except at the request or task boundary.

Every PostgreSQL connection has three time limits, so that a database that is down, frozen or cut off by the network
costs a request seconds and a 503 (``api.errors``), never a hang:

- connect: libpq's ``connect_timeout`` (``CONNECT_TIMEOUT_S``);
- statement: ``statement_timeout`` (``STATEMENT_TIMEOUT_MS``), enforced by the server;
- socket: libpq's ``tcp_user_timeout`` (``SOCKET_TIMEOUT_MS``: sent data left unacknowledged that long drops the
  connection) and, for a server that acknowledges but does not answer (a frozen process), this process's own wait
  for any answer (``_wait``, psycopg2's wait callback) is bounded by the same value; TCP keep-alives find a peer
  that went away while a connection sat idle.

Each is a libpq parameter: a ``PROXIMA_DATABASE_URL`` that sets one (``?connect_timeout=10``,
``?options=-c statement_timeout=30000``, ``?tcp_user_timeout=60000``) keeps its own value. The socket timeout must
exceed the statement timeout, or the client gives up on a statement the server would still finish.

A plain ``postgresql://`` or ``postgres://`` URL, as providers print it, means psycopg2, the driver installed
(``driver_url``; SQLAlchemy 2 would otherwise load psycopg 3).
"""

from __future__ import annotations

import select
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import lru_cache
from typing import Any, TypeVar

import psycopg2  # type: ignore[import-untyped]
import psycopg2.extensions as ext  # type: ignore[import-untyped]
from sqlalchemy import URL, Engine, NullPool, create_engine, event, make_url
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import DeclarativeBase, Session, sessionmaker

# Connections per API or worker process. The API also admits at most this many requests with an open session at a
# time (``api.deps.get_session``), so a request that holds a connection never waits behind one that waits for one.
POOL_SIZE = 20
MAX_OVERFLOW = 20
# SQLAlchemy's own defaults for a SQLite file, spelt out because ``pool_capacity`` counts them.
SQLITE_POOL_SIZE = 5
SQLITE_MAX_OVERFLOW = 10
# Idle connections the read engine keeps (``read_engine_for``).
READ_POOL_SIZE = 4

CONNECT_TIMEOUT_S = 5
STATEMENT_TIMEOUT_MS = 10_000
SOCKET_TIMEOUT_MS = 15_000
# An idle pooled connection whose peer vanished is found within about idle + interval * count seconds.
KEEPALIVES = {"keepalives": 1, "keepalives_idle": 10, "keepalives_interval": 5, "keepalives_count": 3}


class Base(DeclarativeBase):
    pass


def driver_url(url: str) -> str:
    """``url`` with the driver this project installs named: ``postgresql://`` and ``postgres://`` (what providers
    print) become ``postgresql+psycopg2://``; any other URL is returned as it is."""
    parsed = make_url(url)
    if parsed.drivername not in ("postgresql", "postgres"):
        return url
    return parsed.set(drivername="postgresql+psycopg2").render_as_string(hide_password=False)


def _options(parsed: URL) -> str:
    value = parsed.query.get("options", "")
    return " ".join(value) if isinstance(value, tuple) else value


def _timeouts(parsed: URL) -> dict[str, Any]:
    """psycopg2 connect arguments for the time limits the URL does not set itself (URL parameters win: SQLAlchemy
    lets ``connect_args`` override them, so only the missing ones are given)."""
    defaults: dict[str, Any] = {
        "connect_timeout": CONNECT_TIMEOUT_S,
        "tcp_user_timeout": SOCKET_TIMEOUT_MS,
        **KEEPALIVES,
    }
    args = {k: v for k, v in defaults.items() if k not in parsed.query}
    options = _options(parsed)
    if "statement_timeout" not in options:
        args["options"] = f"{options} -c statement_timeout={STATEMENT_TIMEOUT_MS}".strip()
    return args


# psycopg2 connection -> (connect timeout, socket timeout) in seconds (None: no limit).
_limits: weakref.WeakKeyDictionary[Any, tuple[float | None, float | None]] = weakref.WeakKeyDictionary()


def _limits_of(conn: Any) -> tuple[float | None, float | None]:
    try:
        return _limits[conn]
    except KeyError:
        pass
    params = conn.info.dsn_parameters
    connect = float(params.get("connect_timeout") or 0)
    socket = float(params.get("tcp_user_timeout") or 0) / 1000
    limits = (max(connect, 2.0) if connect else None, socket or None)  # libpq takes a connect_timeout under 2 as 2
    _limits[conn] = limits
    return limits


def _wait(conn: Any) -> None:
    """psycopg2's wait callback: run the connection's exchange with the server as ``psycopg2.extras.wait_select``
    does, but wait at most the connection's limit for each answer (the connect timeout while connecting, the socket
    timeout after). On timeout psycopg2 closes the connection (SQLAlchemy then discards it from its pool) and the
    statement raises ``OperationalError``: a 503 in the API, a retry in the worker."""
    connect_limit, socket_limit = _limits_of(conn)
    limit = connect_limit if conn.status == ext.STATUS_SETUP else socket_limit
    timeout_ms = None if limit is None else int(limit * 1000)
    while True:
        state = conn.poll()
        if state == ext.POLL_OK:
            return
        poller = select.poll()  # not select.select: a busy process may hold descriptors above FD_SETSIZE
        poller.register(conn.fileno(), select.POLLIN if state == ext.POLL_READ else select.POLLOUT)
        if not poller.poll(timeout_ms):
            raise psycopg2.OperationalError(f"the database server did not answer within {limit:g} s")


_wait_installed = False


def _install_wait_callback() -> None:
    """Once per process, before its first PostgreSQL connection (the callback is psycopg2's global)."""
    global _wait_installed
    if not _wait_installed:
        ext.set_wait_callback(_wait)
        _wait_installed = True


def _pg_engine(url: str, **kwargs: Any) -> Engine:
    parsed = make_url(driver_url(url))
    if parsed.get_driver_name() == "psycopg2":
        _install_wait_callback()
        kwargs["connect_args"] = {**_timeouts(parsed), **kwargs.get("connect_args", {})}
    return create_engine(parsed, **kwargs)


def engine_without_timeouts(url: str) -> Engine:
    """An engine whose connections have no statement or socket timeout, for statements that may rightly run long
    (migrations on a large database); not pooled. Connect timeout and keep-alives as usual."""
    parsed = make_url(driver_url(url))
    if parsed.get_driver_name() != "psycopg2":
        return make_engine(url)
    _install_wait_callback()
    args = {**_timeouts(parsed), "tcp_user_timeout": 0, "options": f"{_options(parsed)} -c statement_timeout=0".strip()}
    return create_engine(parsed, poolclass=NullPool, connect_args=args)


def _sqlite_in_memory(url: str) -> bool:
    return make_url(url).database in (None, "", ":memory:")


def make_engine(url: str) -> Engine:
    if url.startswith("sqlite"):
        pool = {} if _sqlite_in_memory(url) else {"pool_size": SQLITE_POOL_SIZE, "max_overflow": SQLITE_MAX_OVERFLOW}
        engine = create_engine(url, connect_args={"check_same_thread": False, "timeout": 30}, **pool)

        @event.listens_for(engine, "connect")
        def _sqlite_pragmas(conn, _record):  # type: ignore[no-untyped-def]
            cur = conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")  # readers do not block the worker's writes
            cur.execute("PRAGMA foreign_keys=ON")
            cur.execute("PRAGMA busy_timeout=30000")
            cur.close()

        return engine
    return _pg_engine(url, pool_pre_ping=True, pool_size=POOL_SIZE, max_overflow=MAX_OVERFLOW, pool_timeout=60)


def pool_capacity(url: str) -> int | None:
    """The most connections ``engine_for(url)`` opens at once; None where the pool has no such limit (an in-memory
    SQLite database keeps one connection per thread)."""
    if url.startswith("sqlite"):
        return None if _sqlite_in_memory(url) else SQLITE_POOL_SIZE + SQLITE_MAX_OVERFLOW
    return POOL_SIZE + MAX_OVERFLOW


@lru_cache
def engine_for(url: str) -> Engine:
    return make_engine(url)


@lru_cache
def sessionmaker_for(url: str) -> sessionmaker[Session]:
    return sessionmaker(engine_for(url), expire_on_commit=False)


@lru_cache
def read_engine_for(url: str) -> Engine:
    """The engine of the hot reads (``read``): autocommit, so a read is one round trip to PostgreSQL (no BEGIN, no
    COMMIT), and no pre-ping (another round trip on every checkout); ``read`` retries on a fresh connection instead
    when a pooled one turns out dead. It keeps few idle connections: the API's session slots bound how many are in
    use across both engines. SQLite (the embedded default) shares the one engine."""
    if url.startswith("sqlite"):
        return engine_for(url)
    return _pg_engine(
        url,
        isolation_level="AUTOCOMMIT",
        pool_size=READ_POOL_SIZE,
        max_overflow=POOL_SIZE + MAX_OVERFLOW - READ_POOL_SIZE,
        pool_timeout=60,
    )


def dispose_engines(url: str) -> None:
    """Close every pooled connection of ``url`` in this process (both engines), as before dropping a database."""
    engine_for(url).dispose()
    read_engine_for(url).dispose()


T = TypeVar("T")


def read(url: str, fn: Callable[..., T], /, **kwargs: Any) -> T:
    """``fn(connection, **kwargs)`` on a ``read_engine_for`` connection: statements that only read, each its own
    transaction. A connection that PostgreSQL closed while it sat in the pool (a restart, an idle timeout) fails on
    first use; SQLAlchemy then invalidates it and the pool's older connections, and the read runs once more."""
    try:
        with read_engine_for(url).connect() as conn:
            return fn(conn, **kwargs)
    except DBAPIError as err:
        if not err.connection_invalidated:
            raise
    with read_engine_for(url).connect() as conn:
        return fn(conn, **kwargs)


@contextmanager
def session_scope(url: str) -> Iterator[Session]:
    """A unit of work for tasks and scripts: commits on success, rolls back on error."""
    session = sessionmaker_for(url)()
    try:
        yield session
        session.commit()
    except BaseException:
        session.rollback()
        raise
    finally:
        session.close()

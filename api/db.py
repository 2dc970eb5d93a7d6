"""Database engine and sessions (SQLAlchemy 2). Code never commits except at the request or task boundary."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import lru_cache
from typing import Any, TypeVar

from sqlalchemy import Engine, create_engine, event, make_url
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


class Base(DeclarativeBase):
    pass


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
    return create_engine(url, pool_pre_ping=True, pool_size=POOL_SIZE, max_overflow=MAX_OVERFLOW, pool_timeout=60)


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
    return create_engine(
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

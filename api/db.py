"""Database engine and sessions (SQLAlchemy 2). Code never commits except at the request or task boundary."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from functools import lru_cache

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.orm import DeclarativeBase, Session, sessionmaker


class Base(DeclarativeBase):
    pass


def make_engine(url: str) -> Engine:
    if url.startswith("sqlite"):
        engine = create_engine(url, connect_args={"check_same_thread": False, "timeout": 30})

        @event.listens_for(engine, "connect")
        def _sqlite_pragmas(conn, _record):  # type: ignore[no-untyped-def]
            cur = conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")  # readers do not block the worker's writes
            cur.execute("PRAGMA foreign_keys=ON")
            cur.execute("PRAGMA busy_timeout=30000")
            cur.close()

        return engine
    # As many connections as the threadpool that runs sync routes (anyio: 40), so a burst queues instead of failing.
    return create_engine(url, pool_pre_ping=True, pool_size=20, max_overflow=20, pool_timeout=60)


@lru_cache
def engine_for(url: str) -> Engine:
    return make_engine(url)


@lru_cache
def sessionmaker_for(url: str) -> sessionmaker[Session]:
    return sessionmaker(engine_for(url), expire_on_commit=False)


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

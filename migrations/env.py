"""Alembic environment: the URL is the one the service uses (settings), or one passed in the Alembic config."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from alembic import context
from sqlalchemy import Connection

from api import orm  # noqa: F401  (registers the tables on Base.metadata)
from api.db import Base, engine_without_timeouts
from api.settings import get_settings

config = context.config
url = config.get_main_option("sqlalchemy.url") or get_settings().db_url


def run_offline() -> None:
    context.configure(url=url, target_metadata=Base.metadata, literal_binds=True, render_as_batch=True)
    with context.begin_transaction():
        context.run_migrations()


@contextmanager
def _sqlite_foreign_keys_off(connection: Connection) -> Iterator[None]:
    """Batch mode on SQLite copies a table, drops the old one and renames the copy; with foreign keys on, that DROP
    deletes (ON DELETE CASCADE) every row that points at the table. So they are off while migrating, and the
    result is checked before it is committed. The pragma is a no-op inside a transaction: it is set before."""
    if connection.dialect.name != "sqlite":
        yield
        return
    connection.exec_driver_sql("PRAGMA foreign_keys=OFF")
    connection.commit()
    try:
        yield
    finally:
        connection.rollback()  # nothing left open: a failed migration's transaction must not hold the pragma
        connection.exec_driver_sql("PRAGMA foreign_keys=ON")
        connection.commit()


def _check_foreign_keys(connection: Connection) -> None:
    """With foreign keys off nothing stopped a migration from leaving a row that points at nothing: fail instead
    of committing it."""
    if connection.dialect.name != "sqlite":
        return
    broken = connection.exec_driver_sql("PRAGMA foreign_key_check").all()
    if broken:
        shown = ", ".join(f"{row[0]} row {row[1]} -> {row[2]}" for row in broken[:10])
        raise RuntimeError(f"the migration left {len(broken)} rows whose foreign key points at nothing: {shown}")


def run_online() -> None:
    # no statement or socket time limit: a migration on a large table may rightly take minutes
    with engine_without_timeouts(url).connect() as connection, _sqlite_foreign_keys_off(connection):
        # render_as_batch: SQLite cannot ALTER most things; batch mode copies the table instead.
        context.configure(connection=connection, target_metadata=Base.metadata, render_as_batch=True)
        with context.begin_transaction():
            context.run_migrations()
            _check_foreign_keys(connection)
        connection.commit()


if context.is_offline_mode():
    run_offline()
else:
    run_online()

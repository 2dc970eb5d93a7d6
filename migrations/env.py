"""Alembic environment: the URL is the one the service uses (settings), or one passed in the Alembic config."""

from __future__ import annotations

from alembic import context

from api import orm  # noqa: F401  (registers the tables on Base.metadata)
from api.db import Base, engine_without_timeouts
from api.settings import get_settings

config = context.config
url = config.get_main_option("sqlalchemy.url") or get_settings().db_url


def run_offline() -> None:
    context.configure(url=url, target_metadata=Base.metadata, literal_binds=True, render_as_batch=True)
    with context.begin_transaction():
        context.run_migrations()


def run_online() -> None:
    # no statement or socket time limit: a migration on a large table may rightly take minutes
    with engine_without_timeouts(url).connect() as connection:
        # render_as_batch: SQLite cannot ALTER most things; batch mode copies the table instead.
        context.configure(connection=connection, target_metadata=Base.metadata, render_as_batch=True)
        with context.begin_transaction():
            context.run_migrations()
        connection.commit()


if context.is_offline_mode():
    run_offline()
else:
    run_online()

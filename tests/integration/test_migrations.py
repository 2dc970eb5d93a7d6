"""Alembic: one head, up and down on SQLite and PostgreSQL, and no drift between the ORM models and the migrations."""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from pathlib import Path

import psycopg2
import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import create_engine, inspect

from api import orm  # noqa: F401  (registers the tables)
from api.db import Base
from api.migrate import alembic_config, downgrade, upgrade

TABLES = {"tenants", "api_keys", "files", "jobs", "job_events", "job_metrics", "checkpoints", "rollouts"}


@pytest.fixture(params=["sqlite", "postgresql"])
def empty_db(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'm.db'}"
        return
    name = f"proxima_mig_{secrets.token_hex(6)}"
    admin = psycopg2.connect(host="127.0.0.1", user="postgres", dbname="test")
    admin.autocommit = True
    admin.cursor().execute(f'CREATE DATABASE "{name}"')
    try:
        yield f"postgresql+psycopg2://postgres@127.0.0.1:5432/{name}"
    finally:
        admin.cursor().execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        admin.close()


def test_there_is_exactly_one_head() -> None:
    assert len(ScriptDirectory.from_config(alembic_config("sqlite://")).get_heads()) == 1


def test_upgrade_builds_the_schema_without_drift_and_downgrade_removes_it(empty_db: str) -> None:
    upgrade(empty_db)
    engine = create_engine(empty_db)
    try:
        assert set(inspect(engine).get_table_names()) >= TABLES
        with engine.connect() as conn:
            diff = compare_metadata(MigrationContext.configure(conn), Base.metadata)
        assert diff == [], diff
        indexes = {ix["name"] for ix in inspect(engine).get_indexes("jobs")}
        assert "ix_jobs_tenant_created" in indexes
        downgrade(empty_db)
        assert not TABLES & set(inspect(engine).get_table_names())
        upgrade(empty_db)  # and up again from base
        assert set(inspect(engine).get_table_names()) >= TABLES
    finally:
        engine.dispose()

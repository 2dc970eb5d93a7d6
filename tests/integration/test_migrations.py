"""Alembic: one head, up and down on SQLite and PostgreSQL, and no drift between the ORM models and the migrations."""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg2
import pytest
import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import MetaData, Table, create_engine, inspect, select

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


def _row(table: Table, **values: Any) -> dict[str, Any]:
    """``values`` and a value of its type for every other required column, as the table is at this revision."""
    filler = {sa.String: "x", sa.Integer: 0, sa.BigInteger: 0, sa.Boolean: False, sa.Float: 0.0, sa.JSON: {}}
    row = dict(values)
    for column in table.columns:
        if column.name not in row and not column.nullable and column.server_default is None:
            row[column.name] = next(v for t, v in filler.items() if isinstance(column.type, t))
    return row


def _rl_spec(method: str, **hp: Any) -> dict[str, Any]:
    return {"model": "tiny-arith", "method": {"type": method, method: {"hyperparameters": hp}}}


def test_0005_moves_an_rl_specs_eval_samples_to_eval_prompts_and_back(empty_db: str) -> None:
    upgrade(empty_db, "0004")
    engine = create_engine(empty_db)
    try:
        meta = MetaData()
        tenants, jobs = (Table(name, meta, autoload_with=engine) for name in ("tenants", "jobs"))
        specs = {
            "rl": _rl_spec("grpo", eval_samples=300, eval_interval=5),  # the first 300 prompts, then
            "dpo": _rl_spec("dpo", eval_samples=7),  # unchanged: a preference file's first 7 pairs, still
        }
        with engine.begin() as conn:
            conn.execute(tenants.insert().values(_row(tenants, id="t1")))
            for job_id, spec in specs.items():
                conn.execute(jobs.insert().values(_row(jobs, id=job_id, tenant_id="t1", spec=spec)))

        def stored() -> dict[str, dict[str, Any]]:
            with engine.connect() as conn:
                rows = conn.execute(select(jobs.c.id, jobs.c.spec)).all()
            return {job_id: spec["method"][spec["method"]["type"]]["hyperparameters"] for job_id, spec in rows}

        upgrade(empty_db, "0005")
        assert stored() == {
            "rl": {"eval_prompts": 300, "eval_samples": None, "eval_interval": 5},
            "dpo": {"eval_samples": 7},
        }
        downgrade(empty_db, "0004")
        assert stored() == {"rl": {"eval_samples": 300, "eval_interval": 5}, "dpo": {"eval_samples": 7}}
    finally:
        engine.dispose()


# Every table with a foreign key at 0004 that a later migration's batch copy (SQLite) puts at risk, and its row.
_CHILD_ROWS: dict[str, dict[str, Any]] = {
    "jobs": {"id": "j1", "tenant_id": "t1"},
    "job_events": {"seq": 1, "id": "ev1", "job_id": "j1"},
    "job_metrics": {"job_id": "j1", "step": 1},
    "checkpoints": {"id": "cp1", "job_id": "j1"},
    "rollouts": {"id": 1, "job_id": "j1"},
    "webhook_endpoints": {"id": "we1", "tenant_id": "t1"},
    "webhook_events": {"id": "wev1", "tenant_id": "t1", "job_id": "j1"},
    "webhook_deliveries": {"id": 1, "event_id": "wev1", "endpoint_id": "we1"},
    "webhook_attempts": {"seq": 1, "id": "wa1", "delivery_id": 1, "endpoint_id": "we1"},
}


def _ids(engine: sa.Engine) -> dict[str, set[tuple[Any, ...]]]:
    """Each table's rows, as the primary keys the migrations leave alone."""
    meta = MetaData()
    found = {}
    for name in ("tenants", *_CHILD_ROWS):
        table = Table(name, meta, autoload_with=engine)
        with engine.connect() as conn:
            found[name] = {tuple(row) for row in conn.execute(select(*table.primary_key.columns))}
    return found


def test_upgrade_and_downgrade_keep_the_rows_that_point_at_a_copied_table(empty_db: str) -> None:
    upgrade(empty_db, "0004")
    engine = create_engine(empty_db)
    try:
        meta = MetaData()
        with engine.begin() as conn:
            tenants = Table("tenants", meta, autoload_with=conn)
            conn.execute(tenants.insert().values(_row(tenants, id="t1")))
            for name, values in _CHILD_ROWS.items():
                table = Table(name, meta, autoload_with=conn)
                conn.execute(table.insert().values(_row(table, **values)))
        before = _ids(engine)
        assert all(len(rows) == 1 for rows in before.values()), before

        upgrade(empty_db)
        assert _ids(engine) == before
        events = Table("webhook_events", MetaData(), autoload_with=engine)
        with engine.connect() as conn:
            assert conn.execute(select(events.c.subject_type, events.c.subject_id)).all() == [("fine_tuning.job", "j1")]

        downgrade(empty_db, "0004")
        assert _ids(engine) == before
        events = Table("webhook_events", MetaData(), autoload_with=engine)
        with engine.connect() as conn:
            assert conn.execute(select(events.c.job_id)).all() == [("j1",)]
    finally:
        engine.dispose()

"""The hot read path (``api.db.read``, ``api.deps.read_only``): one autocommit statement per job poll, a retry on a
connection that PostgreSQL closed while it sat in the pool, and the same job object as the ORM path."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import httpx
import psycopg2  # type: ignore[import-untyped]
import pytest
from sqlalchemy import Connection, event, text
from sqlalchemy.exc import ProgrammingError

from api import db as dbm
from tests.integration.conftest import PG_ADMIN_DSN, set_job


@pytest.fixture
def statements(settings: Any) -> Iterator[list[tuple[str, bool]]]:
    """Every statement the read engine sends, with whether its connection was in autocommit."""
    seen: list[tuple[str, bool]] = []
    engine = dbm.read_engine_for(settings.db_url)

    def record(conn: Connection, cursor: Any, statement: str, *_: Any) -> None:
        seen.append((statement, bool(conn.connection.dbapi_connection.autocommit)))  # type: ignore[union-attr]

    event.listen(engine, "before_cursor_execute", record)
    yield seen
    event.remove(engine, "before_cursor_execute", record)


def _backend_pids(url: str) -> set[int]:
    """The PostgreSQL backend of every connection idle in the read engine's pool."""
    pids = set()
    pool = dbm.read_engine_for(url).pool
    conns = [pool.connect() for _ in range(pool.checkedin())]  # type: ignore[attr-defined]
    for c in conns:
        pids.add(c.dbapi_connection.get_backend_pid())  # type: ignore[union-attr]
    for c in conns:
        c.close()
    return pids


def test_a_job_poll_is_one_statement_on_an_autocommit_connection_with_no_ping(
    api: httpx.Client, queued_job: dict[str, Any], statements: list[tuple[str, bool]], settings: Any
) -> None:
    for _ in range(5):
        assert api.get(f"/v1/fine_tuning/jobs/{queued_job['id']}").status_code == 200
    assert len(statements) == 5, statements
    assert all(autocommit and sql.lstrip().upper().startswith("SELECT") for sql, autocommit in statements)
    assert dbm.read_engine_for(settings.db_url).pool._pre_ping is False  # type: ignore[attr-defined]


def test_the_polled_job_equals_the_listed_job_field_for_field(
    api: httpx.Client, queued_job: dict[str, Any], db: Callable[[], Any]
) -> None:
    # The poll builds the job from a Core row, the list from ORM objects: every field must agree, JSON ones too.
    set_job(
        db,
        queued_job["id"],
        status="failed",
        error={"code": "out_of_memory", "message": "CUDA out of memory", "param": None},
        metadata_={"team": "rl", "run": "7"},
        result_files=["file-abc"],
        trained_tokens=1234,
        finished_at=1_790_000_000,
        current_step=3,
        total_steps=10,
    )
    polled = api.get(f"/v1/fine_tuning/jobs/{queued_job['id']}").json()
    listed = next(
        j for j in api.get("/v1/fine_tuning/jobs", params={"limit": 100}).json()["data"] if j["id"] == polled["id"]
    )
    assert polled == listed
    assert polled["error"] == {"code": "out_of_memory", "message": "CUDA out of memory", "param": None}
    assert (polled["metadata"], polled["result_files"], polled["current_step"]) == (
        {"team": "rl", "run": "7"},
        ["file-abc"],
        3,
    )


def test_a_read_on_a_connection_postgresql_closed_runs_again_on_a_fresh_one(settings: Any) -> None:
    url = settings.db_url
    assert dbm.read(url, lambda c: c.execute(text("SELECT 1")).scalar()) == 1  # one connection now idle in the pool
    stale = _backend_pids(url)
    assert stale
    admin = psycopg2.connect(PG_ADMIN_DSN)
    admin.autocommit = True
    with admin.cursor() as cur:  # as a PostgreSQL restart or an idle timeout would
        cur.execute("SELECT pg_terminate_backend(pid) FROM unnest(%s) AS pid", (list(stale),))
    admin.close()

    calls: list[int] = []

    def backend(conn: Connection) -> int:
        calls.append(1)
        return int(conn.execute(text("SELECT pg_backend_pid()")).scalar_one())

    pid = dbm.read(url, backend)
    assert pid not in stale
    assert len(calls) == 2  # the first attempt met the closed connection


def test_a_read_that_fails_for_another_reason_is_not_run_again(settings: Any) -> None:
    calls: list[int] = []

    def bad(conn: Connection) -> None:
        calls.append(1)
        conn.execute(text("SELECT * FROM no_such_table"))

    with pytest.raises(ProgrammingError):
        dbm.read(settings.db_url, bad)
    assert calls == [1]


def test_a_new_api_process_opens_its_read_connection_at_start_not_at_the_first_poll(settings: Any) -> None:
    from fastapi.testclient import TestClient

    from api.app import create_app

    # Its own engine (another URL), so that no earlier test's connection is in the pool.
    fresh = settings.model_copy(update={"database_url": f"{settings.db_url}?application_name=warm-up"})
    try:
        assert dbm.read_engine_for(fresh.db_url).pool.checkedin() == 0  # type: ignore[attr-defined]
        with TestClient(create_app(fresh)):
            assert dbm.read_engine_for(fresh.db_url).pool.checkedin() == 1  # type: ignore[attr-defined]
    finally:
        dbm.dispose_engines(fresh.db_url)


def test_an_api_whose_database_is_not_migrated_still_starts_with_a_warning(
    settings: Any, tmp_path: Any, caplog: pytest.LogCaptureFixture
) -> None:
    from fastapi.testclient import TestClient

    from api.app import create_app

    empty = settings.model_copy(update={"database_url": f"sqlite:///{tmp_path / 'empty.db'}"})
    with caplog.at_level("WARNING", logger="proxima.api"), TestClient(create_app(empty)) as client:
        assert client.get("/healthz").status_code == 200
    assert any("not warmed up" in r.getMessage() for r in caplog.records)

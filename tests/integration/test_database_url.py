"""``PROXIMA_DATABASE_URL`` as a provider prints it: ``postgresql://`` and ``postgres://`` mean
psycopg2, the driver installed (SQLAlchemy 2 alone would load psycopg 3, which is not), for the API, migrations and
scripts alike."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.testclient import TestClient
from pydantic import ValidationError

from tests.integration.conftest import Tenant


@pytest.fixture(params=["postgresql", "postgres"])
def plain_url(request: pytest.FixtureRequest, pg_url: str) -> str:
    assert pg_url.startswith("postgresql+psycopg2://")
    return pg_url.replace("postgresql+psycopg2://", f"{request.param}://", 1)


def test_the_api_serves_on_a_plain_url(plain_url: str, settings: Any, tenant_a: Tenant, monkeypatch: Any) -> None:
    from api.app import create_app
    from api.settings import Settings

    monkeypatch.setenv("PROXIMA_DATABASE_URL", plain_url)
    from_env = Settings(home=settings.home, broker_url=settings.broker_url, artifacts=settings.artifacts)
    assert from_env.db_url.startswith("postgresql+psycopg2://")
    with TestClient(create_app(from_env)) as client:
        assert client.get("/readyz").json()["checks"]["database"] == "ok"
        response = client.get("/v1/files", headers={"authorization": f"Bearer {tenant_a.key}"})
        assert response.status_code == 200, response.text


def test_migrations_and_sessions_take_a_plain_url(plain_url: str) -> None:
    from sqlalchemy import text

    from api.db import dispose_engines, engine_for, session_scope
    from api.migrate import upgrade

    upgrade(plain_url)  # at head already: connects, finds nothing to do
    with session_scope(plain_url) as session:
        assert session.execute(text("SELECT 1")).scalar() == 1
    assert engine_for(plain_url).dialect.driver == "psycopg2"
    dispose_engines(plain_url)


def test_a_url_that_is_not_one_fails_at_start_naming_the_variable(monkeypatch: Any) -> None:
    from api.settings import Settings

    monkeypatch.setenv("PROXIMA_DATABASE_URL", "not a url")
    with pytest.raises(ValidationError, match="database_url"):
        Settings()


def test_the_driver_is_named_once_and_the_rest_kept() -> None:
    from api.db import driver_url

    assert (
        driver_url("postgres://u:p%40ss@db.example.com:6543/app?sslmode=require")
        == "postgresql+psycopg2://u:p%40ss@db.example.com:6543/app?sslmode=require"
    )
    assert driver_url("postgresql+psycopg2://u@h/d") == "postgresql+psycopg2://u@h/d"
    assert driver_url("sqlite:////tmp/x.db") == "sqlite:////tmp/x.db"

"""``/readyz``: it needs no key, so it says only which backend is down (database, broker,
store), never the driver's message with hosts, ports and database names; that goes to the log."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from tests.integration.conftest import assert_error

SECRET_DB = "billing_prod_7f3a"  # no such database on the test server: its error names it
SECRET_PORT = 1  # nothing listens there


def broken(settings: Any, backend: str, tmp_path: Path) -> Any:
    if backend == "database":
        return settings.model_copy(update={"database_url": f"postgresql://postgres@127.0.0.1:5432/{SECRET_DB}"})
    if backend == "broker":
        return settings.model_copy(update={"broker_url": f"redis://127.0.0.1:{SECRET_PORT}/0"})
    blocker = tmp_path / "artifacts"
    blocker.write_text("a file where the store's folder should be")
    return settings.model_copy(update={"artifacts": str(blocker)})


@pytest.mark.expected_5xx(503)
@pytest.mark.parametrize("backend", ["database", "broker", "store"])
def test_readyz_names_the_backend_that_is_down_and_logs_why(
    settings: Any, backend: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from api.app import create_app

    with TestClient(create_app(broken(settings, backend, tmp_path)), raise_server_exceptions=False) as client:
        with caplog.at_level("WARNING", logger="proxima.api.health"):
            response = client.get("/readyz")
        error = assert_error(response, 503, param=None, code="not_ready")
        assert error["message"] == f"not ready: {backend}: unavailable"
        assert response.headers["retry-after"].isdigit()
        for leak in (SECRET_DB, "5432", "127.0.0.1", f":{SECRET_PORT}", str(tmp_path), "Error"):
            assert leak not in response.text, leak
        logged = "\n".join(r.getMessage() for r in caplog.records if f"the {backend} is down" in r.getMessage())
        assert logged, caplog.text
        detail = {"database": SECRET_DB, "broker": f"127.0.0.1:{SECRET_PORT}", "store": str(tmp_path)}[backend]
        assert detail in logged, logged
        assert client.get("/healthz").status_code == 200


def test_readyz_checks_every_backend(anon: Any) -> None:
    response = anon.get("/readyz")
    assert response.status_code == 200, response.text
    assert response.json() == {"status": "ok", "checks": {"database": "ok", "broker": "ok", "store": "ok"}}


@pytest.mark.expected_5xx(503)
def test_a_store_that_cannot_be_opened_is_a_503_on_the_routes_that_need_it(
    settings: Any, tenant_a: Any, tmp_path: Path
) -> None:
    from api.app import create_app

    with TestClient(create_app(broken(settings, "store", tmp_path)), raise_server_exceptions=False) as client:
        response = client.post(
            "/v1/files",
            headers={"authorization": f"Bearer {tenant_a.key}"},
            files={"file": ("d.jsonl", b'{"prompt": "x"}\n')},
            data={"purpose": "fine-tune"},
        )
        error = assert_error(response, 503)
        assert str(tmp_path) not in error["message"]
        assert response.headers["retry-after"].isdigit()

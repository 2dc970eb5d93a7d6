"""The embedded default (SQLite database, SQLAlchemy-on-SQLite broker, local artifacts; no servers) serves the API."""

from __future__ import annotations

import sqlite3
from pathlib import Path

from tests.integration.conftest import http_client, job_body, jsonl, prompts, serve, upload, validate


def test_embedded_defaults_create_and_enqueue_a_job(tmp_path: Path) -> None:
    from api.app import create_app
    from api.auth import create_key
    from api.db import session_scope
    from api.settings import Settings

    settings = Settings(
        home=tmp_path / "home",
        database_url=None,
        broker_url=None,
        artifacts=None,
        base_models=["tiny-arith"],
        run_migrations=True,
    )
    assert settings.db_url.startswith("sqlite:") and settings.celery_broker_url.startswith("sqla+sqlite:")
    with serve(create_app(settings)) as url:
        with session_scope(settings.db_url) as s:  # the app migrated the SQLite file at start-up
            _, key = create_key(s, tenant_name="local")
        with http_client(url, key) as api:
            assert api.get("/readyz").status_code == 200
            file_id = upload(api, jsonl(prompts(3))).json()["id"]
            job = api.post("/v1/fine_tuning/jobs", json=job_body(file_id)).json()
            assert job["status"] == "validating_files", job
            assert validate(settings, job["id"]) == "queued"  # the worker's phase, on SQLite and the folder store
            assert api.get(f"/v1/fine_tuning/jobs/{job['id']}").json()["status"] == "queued"
            assert api.get(f"/v1/fine_tuning/jobs/{job['id']}/events").json()["data"][0]["message"] == (
                "Validated files; job queued"
            )
            assert api.get(f"/v1/files/{file_id}/content").content == jsonl(prompts(3))
    assert (settings.home / "artifacts" / "files").is_dir()
    with sqlite3.connect(settings.home / "broker.db") as broker:
        bodies = [row[0] for row in broker.execute("SELECT payload FROM kombu_message")]
    assert len(bodies) == 1 and job["id"] in str(bodies[0])

"""The API when PostgreSQL fails: down, every route that needs it answers 503 with
``Retry-After`` in OpenAI's envelope and the service recovers by itself when it returns; frozen (every server
process stopped, its sockets still accepting), requests answer 503 within seconds instead of hanging; a statement
held past the statement timeout is a 503 too.

The database is a cluster of this module's own (tests/e2e/postgres_cluster.py), reached through the plain
``postgresql://`` URL a provider prints with short time limits as libpq parameters; the API is a
`proxima serve --no-worker` process.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.postgres_cluster import PostgresCluster, postgres_cluster
from tests.redis_dbs import claim_redis_url, release_redis_url
from tests.waiting import wait_until

REPO = Path(__file__).resolve().parents[2]
# libpq's own parameters: connect 2 s, statements 2 s, the socket 3 s (more than a statement may take).
LIMITS = {"connect_timeout": "2", "tcp_user_timeout": "3000", "options": "-c%20statement_timeout%3D2000"}
FROZEN_ANSWER_S = 12.0  # socket timeout + a reconnect's connect timeout, with room for a loaded machine


@dataclass
class Api:
    base: str
    key: str
    url: str
    file_id: str
    job_id: str
    proc: subprocess.Popen[bytes]

    def client(self, *, timeout: float = 30) -> httpx.Client:
        return httpx.Client(base_url=self.base, headers={"authorization": f"Bearer {self.key}"}, timeout=timeout)


@pytest.fixture(scope="module")
def cluster() -> Iterator[PostgresCluster]:
    with postgres_cluster() as pg:
        pg.create_database("proxima")
        yield pg


@pytest.fixture(scope="module")
def api(cluster: PostgresCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Api]:
    from api.auth import create_key
    from api.db import dispose_engines, session_scope
    from api.migrate import upgrade

    url = cluster.url("proxima", **LIMITS)
    upgrade(url)
    with session_scope(url) as s:
        _, key = create_key(s, tenant_name="faults")
    root = tmp_path_factory.mktemp("faults")
    port = _free_port()
    broker = claim_redis_url()
    env = {k: v for k, v in os.environ.items() if not k.startswith("PROXIMA_")} | {
        "PROXIMA_HOME": str(root / "home"),
        "PROXIMA_DATABASE_URL": url,
        "PROXIMA_BROKER_URL": broker,
        "PROXIMA_ARTIFACTS": str(root / "artifacts"),
    }
    log = (root / "server.log").open("w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "proxima.cli", "serve", "--no-worker", "--no-inference", "--port", str(port)],
        cwd=REPO,
        env=env,
        stdout=log,
        stderr=log,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: _ready(base) or proc.poll() is not None, timeout=60, what="the API")
        assert proc.poll() is None, (root / "server.log").read_text()
        with httpx.Client(base_url=base, headers={"authorization": f"Bearer {key}"}, timeout=30) as client:
            uploaded = client.post(
                "/v1/files",
                files={"file": ("t.jsonl", b'{"prompt": "1 + 1", "answer": "2"}\n')},
                data={"purpose": "fine-tune"},
            )
            assert uploaded.status_code == 200, uploaded.text
            created = client.post("/v1/fine_tuning/jobs", json=supervised_job(uploaded.json()["id"]))
            assert created.status_code == 200, created.text
        yield Api(base, key, url, uploaded.json()["id"], created.json()["id"], proc)
    finally:
        proc.terminate()
        proc.wait(timeout=15)
        release_redis_url(broker)
        log.close()
        cluster.thaw()
        dispose_engines(url)


def supervised_job(training_file: str) -> dict[str, Any]:
    return {"model": "tiny-arith", "training_file": training_file, "method": {"type": "supervised", "supervised": {}}}


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _ready(base: str) -> bool:
    try:
        return httpx.get(f"{base}/readyz", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


EVAL = {
    "name": "e",
    "data_source_config": {"type": "custom", "item_schema": {"type": "object"}},
    "testing_criteria": [
        {"type": "string_check", "name": "g", "input": "{{item.a}}", "reference": "a", "operation": "eq"}
    ],
}
EVAL_ROWS = {"type": "jsonl", "source": {"type": "file_content", "content": [{"item": {"a": "a"}}]}}


def requests_for_every_route(api: Api) -> list[tuple[str, str, dict[str, Any]]]:
    """One request per ``/v1`` operation of the document, on the real objects, with a body where one is taken."""
    document = httpx.get(f"{api.base}/openapi.json").json()
    ids = {
        "file_id": api.file_id,
        "fine_tuning_job_id": api.job_id,
        "checkpoint_id": "ftckpt_none",
        "model_id": "tiny-arith",
        "webhook_endpoint_id": "whep_none",
        "session_id": "sess-none:train:0",
        "eval_id": "eval_none",
        "run_id": "evalrun_none",
        "output_item_id": "outputitem_none",
    }
    chat = {"model": "tiny-arith", "messages": [{"role": "user", "content": "What is 1 + 1?"}], "max_tokens": 2}
    endpoint = {"name": "e", "url": "https://example.com/hook", "event_types": ["fine_tuning.job.succeeded"]}
    bodies: dict[tuple[str, str], dict[str, Any]] = {
        ("POST", "/v1/files"): {"files": {"file": ("t.jsonl", b'{"prompt": "x"}\n')}, "data": {"purpose": "fine-tune"}},
        ("POST", "/v1/fine_tuning/jobs"): {"json": supervised_job(api.file_id)},
        ("POST", "/v1/fine_tuning/alpha/graders/run"): {
            "json": {"grader": {"type": "string_check", "name": "g", "input": "a", "reference": "a", "operation": "eq"}}
            | {"model_sample": "a"}
        },
        ("POST", "/v1/fine_tuning/alpha/graders/validate"): {
            "json": {"grader": {"type": "string_check", "name": "g", "input": "a", "reference": "a", "operation": "eq"}}
        },
        ("POST", "/v1/fine_tuning/estimates"): {"json": supervised_job(api.file_id)},
        # a base model's completion needs the database only to check the key (no inference server runs here)
        ("POST", "/v1/chat/completions"): {"json": chat},
        ("POST", "/v1/completions"): {"json": {"model": "tiny-arith", "prompt": "What is 1 + 1?", "max_tokens": 2}},
        ("POST", "/v1/webhook_endpoints"): {"json": endpoint},
        ("POST", "/v1/webhook_endpoints/{webhook_endpoint_id}"): {"json": {"name": "f"}},
        ("POST", "/v1/webhook_endpoints/{webhook_endpoint_id}/rotate_secret"): {"json": {}},
        ("POST", "/v1/webhook_endpoints/{webhook_endpoint_id}/test"): {"json": {"event_type": "eval.run.failed"}},
        ("POST", "/v1/evals"): {"json": EVAL},
        ("POST", "/v1/evals/{eval_id}"): {"json": {"name": "f"}},
        ("POST", "/v1/evals/{eval_id}/runs"): {"json": {"data_source": EVAL_ROWS}},
        ("POST", "/v1/evals/{eval_id}/runs/{run_id}/cancel"): {"json": {}},
    }
    out = []
    for template, item in document["paths"].items():
        if not template.startswith("/v1/"):
            continue
        path = template.format(**ids)
        for method in item:
            out.append((method.upper(), path, bodies.get((method.upper(), template), {})))
    assert len(out) >= 20, out
    return out


def assert_unavailable(response: httpx.Response) -> None:
    assert response.status_code == 503, (response.request.method, response.request.url, response.text)
    body = response.json()
    assert body == {
        "error": {
            "message": "the database is unavailable; retry later",
            "type": "server_error",
            "param": None,
            "code": "service_unavailable",
        }
    }, body
    assert int(response.headers["retry-after"]) > 0


def assert_serving(api: Api) -> None:
    with api.client() as client:
        wait_until(
            lambda: client.get(f"/v1/fine_tuning/jobs/{api.job_id}").status_code == 200,
            timeout=30,
            what="the API to serve again",
        )
        assert client.get("/v1/files").status_code == 200
        assert client.get("/readyz").status_code == 200


@pytest.mark.alone
def test_postgres_down_every_route_answers_503_with_retry_after_then_recovers(
    api: Api, cluster: PostgresCluster
) -> None:
    routes = requests_for_every_route(api)
    cluster.stop()
    try:
        with api.client(timeout=15) as client:
            for method, path, kwargs in routes:
                started = time.monotonic()
                response = client.request(method, path, **kwargs)
                # graders/run and graders/validate need the database only to check the key: a 503 all the same.
                assert_unavailable(response)
                assert time.monotonic() - started < 5, (method, path)
            ready = client.get("/readyz")
            assert ready.status_code == 503 and ready.json()["error"]["message"] == "not ready: database: unavailable"
            assert client.get("/healthz").status_code == 200
    finally:
        cluster.start()
    assert_serving(api)


@pytest.mark.alone
def test_postgres_frozen_requests_answer_503_within_seconds_then_recover(api: Api, cluster: PostgresCluster) -> None:
    assert_serving(api)  # connections pooled: the freeze finds them open, mid-conversation next

    def request(args: tuple[str, str]) -> tuple[httpx.Response, float]:
        method, path = args
        started = time.monotonic()
        with api.client(timeout=30) as client:
            response = client.request(method, path)
        return response, time.monotonic() - started

    wanted = [
        ("GET", f"/v1/fine_tuning/jobs/{api.job_id}"),  # the poll: its own read engine
        ("GET", f"/v1/fine_tuning/jobs/{api.job_id}/events"),
        ("GET", "/v1/files"),
        ("GET", f"/v1/files/{api.file_id}"),
        ("POST", f"/v1/fine_tuning/jobs/{api.job_id}/pause"),
        ("GET", "/v1/models"),
        ("GET", "/readyz"),
    ]
    cluster.freeze()
    frozen_at = time.monotonic()
    try:
        with ThreadPoolExecutor(len(wanted)) as pool:
            results = list(pool.map(request, wanted))
        assert time.monotonic() - frozen_at < 20  # the freeze would have lasted 20 s
    finally:
        cluster.thaw()
    for (method, path), (response, seconds) in zip(wanted, results, strict=True):
        assert seconds < FROZEN_ANSWER_S, (method, path, seconds)
        if path == "/readyz":
            assert response.status_code == 503 and "database: unavailable" in response.text, response.text
        else:
            assert_unavailable(response)
    assert_serving(api)


def test_a_statement_past_the_statement_timeout_is_a_503(api: Api) -> None:
    import psycopg2  # type: ignore[import-untyped]

    locker = psycopg2.connect(api.url.split("?")[0])  # a plain postgresql:// URL is a libpq connection string
    try:
        with locker.cursor() as cur:  # holds the job's row: the cancel's update waits for it
            cur.execute("SELECT id FROM jobs WHERE id = %s FOR UPDATE", (api.job_id,))
            started = time.monotonic()
            with api.client() as client:
                response = client.post(f"/v1/fine_tuning/jobs/{api.job_id}/cancel")
            assert_unavailable(response)
            assert 1.5 < time.monotonic() - started < 8  # the 2 s statement timeout, not the lock's release
    finally:
        locker.rollback()
        locker.close()
    with api.client() as client:
        assert client.post(f"/v1/fine_tuning/jobs/{api.job_id}/cancel").json()["status"] == "cancelled"


def test_time_limits_are_set_on_every_connection(cluster: PostgresCluster) -> None:
    from sqlalchemy import text

    from api.db import engine_for, read_engine_for

    plain = cluster.url("proxima")  # no parameter: the defaults
    for engine in (engine_for(plain), read_engine_for(plain)):
        with engine.connect() as conn:
            assert conn.execute(text("SHOW statement_timeout")).scalar() == "10s"
            params = conn.connection.dbapi_connection.info.dsn_parameters  # type: ignore[union-attr]
            assert (params["connect_timeout"], params["tcp_user_timeout"], params["keepalives"]) == ("5", "15000", "1")
        engine.dispose()
    tuned = cluster.url("proxima", **LIMITS)  # the URL's own values win
    with engine_for(tuned).connect() as conn:
        assert conn.execute(text("SHOW statement_timeout")).scalar() == "2s"
        params = conn.connection.dbapi_connection.info.dsn_parameters  # type: ignore[union-attr]
        assert (params["connect_timeout"], params["tcp_user_timeout"]) == ("2", "3000")


def test_long_statements_need_the_engine_without_timeouts(cluster: PostgresCluster) -> None:
    """Migrations on a large database may rightly run past the limits: ``engine_without_timeouts`` lifts the
    statement and socket timeouts (and only there)."""
    from sqlalchemy import text
    from sqlalchemy.exc import OperationalError

    from api.db import engine_for, engine_without_timeouts
    from api.errors import database_unavailable

    tuned = cluster.url("proxima", **LIMITS)
    with pytest.raises(OperationalError) as cancelled, engine_for(tuned).connect() as conn:
        conn.execute(text("SELECT pg_sleep(3.5)"))  # past the statement (2 s) and the socket (3 s) timeouts
    assert database_unavailable(cancelled.value)  # the API's 503
    engine = engine_without_timeouts(tuned)
    with engine.connect() as conn:
        assert conn.execute(text("SHOW statement_timeout")).scalar() == "0"
        conn.execute(text("SELECT pg_sleep(3.5)"))
    engine.dispose()

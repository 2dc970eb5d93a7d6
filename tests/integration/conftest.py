"""The real service for API tests: a fresh PostgreSQL database, a Redis database, a local artifact folder and the
app served by uvicorn on a free port, all created once per test session.

Every HTTP client made here records any 5xx response; an autouse fixture fails the test that caused one, so
"no 500 anywhere" is checked by every API test, not only by the ones that look for it.
"""

from __future__ import annotations

import json
import secrets
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import psycopg2  # type: ignore[import-untyped]
import pytest
import redis
import uvicorn
from sqlalchemy.orm import Session

from tests.redis_dbs import claim_redis_url, release_redis_url
from tests.remote_grader_servers import Servers, serve_remote_graders

PG_ADMIN_DSN = "postgresql://postgres@127.0.0.1:5432/test"
PG_URL = "postgresql+psycopg2://postgres@127.0.0.1:5432/{db}"
CELERY_QUEUE = "celery"
MAX_UPLOAD_BYTES = 64 * 1024

SERVER_ERRORS: list[str] = []


def _record_5xx(response: Any) -> None:
    if response.status_code >= 500:
        response.read()
        SERVER_ERRORS.append(
            f"{response.request.method} {response.request.url} -> {response.status_code}: {response.text[:500]}"
        )


@pytest.fixture(autouse=True)
def no_server_errors(request: pytest.FixtureRequest) -> Iterator[None]:
    """Fail any test during which the service answered with a 5xx (a 500 is always a bug), except the codes a test
    provokes on purpose and names with ``@pytest.mark.expected_5xx(503, ...)``."""
    marker = request.node.get_closest_marker("expected_5xx")
    allowed = {f" -> {code}:" for code in (marker.args if marker else ())}
    SERVER_ERRORS.clear()
    yield
    errors = [e for e in SERVER_ERRORS if not any(a in e for a in allowed)]
    SERVER_ERRORS.clear()
    assert not errors, "server errors:\n" + "\n".join(errors)


def http_client(base_url: str, key: str | None = None, **kwargs: Any) -> httpx.Client:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    return httpx.Client(
        base_url=base_url, headers=headers, timeout=30, event_hooks={"response": [_record_5xx]}, **kwargs
    )


ANY: Any = object()  # "not checked" for assert_error's param and code (None is a value to check)


def assert_error(
    response: Any,
    status: int,
    *,
    param: str | None = ANY,
    code: str | None = ANY,
    message_contains: str | None = None,
) -> dict[str, Any]:
    """The response (httpx's or the test client's) is ``status`` with OpenAI's error envelope, and the given
    param, code and message."""
    assert response.status_code == status, (response.status_code, response.text)
    body = response.json()
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"]
    if param is not ANY:
        assert error["param"] == param, error
    if code is not ANY:
        assert error["code"] == code, error
    if message_contains is not None:
        assert message_contains in error["message"], error
    return error  # type: ignore[no-any-return]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def serve(app: Any) -> Iterator[str]:
    """Serve an ASGI app with uvicorn in a background thread; yields its base URL."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, name=f"uvicorn-{port}", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


# -- backends -------------------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def pg_url() -> Iterator[str]:
    """A fresh database migrated to head, dropped at the end."""
    from api.db import dispose_engines
    from api.migrate import upgrade

    name = f"proxima_test_{secrets.token_hex(6)}"
    admin = psycopg2.connect(PG_ADMIN_DSN)
    admin.autocommit = True
    with admin.cursor() as cur:
        cur.execute(f'CREATE DATABASE "{name}"')
    url = PG_URL.format(db=name)
    try:
        upgrade(url)
        yield url
    finally:
        dispose_engines(url)
        with admin.cursor() as cur:
            cur.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        admin.close()


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    url = claim_redis_url()
    yield url
    client = redis.Redis.from_url(url)
    client.flushdb()
    client.close()
    release_redis_url(url)


@pytest.fixture(scope="session")
def settings(pg_url: str, redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Any:
    from api.settings import Settings

    home = tmp_path_factory.mktemp("proxima-home")
    return Settings(
        home=home,
        database_url=pg_url,
        broker_url=redis_url,
        artifacts=str(home / "artifacts"),
        base_models=["tiny-arith"],
        max_upload_bytes=MAX_UPLOAD_BYTES,
    )


@pytest.fixture(scope="session")
def base_url(settings: Any) -> Iterator[str]:
    from api.app import create_app

    with serve(create_app(settings)) as url:
        yield url


@pytest.fixture
def db(settings: Any) -> Callable[[], Any]:
    """``with db() as s:`` a committed unit of work on the test database."""
    from api.db import session_scope

    return lambda: session_scope(settings.db_url)


@pytest.fixture(scope="session")
def artifact_store(settings: Any) -> Any:
    from api.storage import store_from_url

    return store_from_url(settings.artifacts_url)


@pytest.fixture
def queue_length(redis_url: str) -> Callable[[], int]:
    """Messages waiting on the Celery queue (no worker runs in these tests)."""
    client = redis.Redis.from_url(redis_url)
    return lambda: int(client.llen(CELERY_QUEUE))


# -- tenants and clients --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Tenant:
    id: str
    key: str


def make_tenant(settings: Any, name: str) -> Tenant:
    from api.auth import create_key
    from api.db import session_scope

    with session_scope(settings.db_url) as s:
        tenant, key = create_key(s, tenant_name=name)
        return Tenant(id=tenant.id, key=key)


@pytest.fixture(scope="session")
def tenant_a(settings: Any, base_url: str) -> Tenant:
    return make_tenant(settings, f"acme-{secrets.token_hex(3)}")


@pytest.fixture(scope="session")
def tenant_b(settings: Any, base_url: str) -> Tenant:
    return make_tenant(settings, f"globex-{secrets.token_hex(3)}")


@pytest.fixture
def api(base_url: str, tenant_a: Tenant) -> Iterator[httpx.Client]:
    with http_client(base_url, tenant_a.key) as client:
        yield client


@pytest.fixture
def api_b(base_url: str, tenant_b: Tenant) -> Iterator[httpx.Client]:
    with http_client(base_url, tenant_b.key) as client:
        yield client


@pytest.fixture
def anon(base_url: str) -> Iterator[httpx.Client]:
    with http_client(base_url) as client:
        yield client


# -- datasets and jobs ----------------------------------------------------------------------------------------

GRADER = {
    "type": "string_check",
    "name": "exact",
    "input": "{{sample.output_text}}",
    "reference": "{{item.answer}}",
    "operation": "eq",
}


def prompts(n: int = 4) -> list[dict[str, Any]]:
    return [{"messages": [{"role": "user", "content": f"What is {i} + {i}?"}], "answer": str(2 * i)} for i in range(n)]


def jsonl(rows: list[Any]) -> bytes:
    return b"".join(json.dumps(r).encode() + b"\n" for r in rows)


def upload(
    client: httpx.Client, content: bytes, *, filename: str = "train.jsonl", purpose: str = "fine-tune"
) -> httpx.Response:
    return client.post("/v1/files", files={"file": (filename, content, "application/jsonl")}, data={"purpose": purpose})


def job_body(training_file: str, **overrides: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": "tiny-arith",
        "training_file": training_file,
        "method": {"type": "grpo", "grpo": {"grader": GRADER, "hyperparameters": {"batch_size": 2, "group_size": 2}}},
    }
    body.update(overrides)
    return body


@pytest.fixture
def training_file(api: httpx.Client) -> str:
    response = upload(api, jsonl(prompts()))
    assert response.status_code == 200, response.text
    return str(response.json()["id"])


def validate(settings: Any, job_id: str, *, worker_id: str = "test-worker") -> str:
    """The worker's ``validating_files`` phase for one job, run here as the Celery task would run it (no worker runs
    in these tests): ``queued``, ``failed`` or ``skipped``."""
    from api.storage import store_from_url
    from worker.validation import validate_files

    return validate_files(job_id, settings=settings, store=store_from_url(settings.artifacts_url), worker_id=worker_id)


@pytest.fixture
def queued_job(api: httpx.Client, training_file: str, settings: Any) -> dict[str, Any]:
    """A job whose files a worker has validated: ``queued``, waiting for a worker to train it."""
    response = api.post("/v1/fine_tuning/jobs", json=job_body(training_file))
    assert response.status_code == 200, response.text
    assert response.json()["status"] == "validating_files", response.json()
    assert validate(settings, response.json()["id"]) == "queued"
    job: dict[str, Any] = api.get(f"/v1/fine_tuning/jobs/{response.json()['id']}").json()
    assert job["status"] == "queued", job
    return job


def set_job(db: Callable[[], Any], job_id: str, **values: Any) -> None:
    """Move a job as a worker would (no worker runs in these tests)."""
    from api.orm import Job

    with db() as s:
        s.query(Job).filter(Job.id == job_id).update(values)


def add_checkpoint(db: Callable[[], Any], store: Any, job_id: str, step: int, *, archive: bytes | None = b"tgz") -> str:
    from api import ids
    from api.orm import Checkpoint

    ckpt_id, key = ids.checkpoint_id(), f"jobs/{job_id}/checkpoints/step-{step:06d}"
    if archive is not None:
        store.put_bytes(f"{key}/adapter.tar.gz", archive)
    s: Session
    with db() as s:
        s.add(
            Checkpoint(
                id=ckpt_id,
                job_id=job_id,
                step_number=step,
                metrics={"reward/mean": step / 10},
                storage_key=key,
                created_at=int(time.time()),
            )
        )
    return ckpt_id


@pytest.fixture
def tmp_home(tmp_path: Path) -> Path:
    return tmp_path / "home"


@pytest.fixture(scope="module")
def servers() -> Iterator[Servers]:
    """The remote graders' local services (tests/remote_grader_servers.py): a judge, endpoint graders, embeddings."""
    with serve_remote_graders() as s:
        yield s


@pytest.fixture
def fresh_remote_graders(servers: Servers) -> None:
    """No requests recorded by the services before the test."""
    servers.state.clear()

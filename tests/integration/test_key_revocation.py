"""``proxima keys list`` and ``proxima keys revoke``; a revoked key, or a deleted tenant's, fails at once on every
API process despite their key caches."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import psycopg2  # type: ignore[import-untyped]
import pytest
from sqlalchemy import event, make_url

from api import auth
from api.db import engine_for
from tests.integration.conftest import (
    Tenant,
    assert_error,
    free_port,
    http_client,
    jsonl,
    make_tenant,
    prompts,
    upload,
)


def _env(settings: Any, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PROXIMA_")}
    return env | {
        "PROXIMA_HOME": str(settings.home),
        "PROXIMA_DATABASE_URL": settings.database_url,
        "PROXIMA_BROKER_URL": settings.broker_url,
        "PROXIMA_ARTIFACTS": settings.artifacts_url,
        **extra,
    }


def proxima(settings: Any, *args: str) -> subprocess.CompletedProcess[str]:
    """`proxima ARGS` in a process of its own, as an admin runs it."""
    return subprocess.run(
        [sys.executable, "-m", "proxima.cli", *args], env=_env(settings), text=True, capture_output=True, timeout=60
    )


@pytest.fixture
def cli(settings: Any, monkeypatch: pytest.MonkeyPatch) -> Callable[..., Any]:
    """`proxima ARGS` in this process (faster where no second process matters): its result has exit_code, stdout,
    stderr."""
    from typer.testing import CliRunner

    from api import cli as cli_module
    from proxima.cli import app

    monkeypatch.setattr(cli_module, "_settings", lambda: settings)
    runner = CliRunner()
    return lambda *args: runner.invoke(app, list(args))


@pytest.fixture(scope="module")
def two_apis(settings: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[str]]:
    """Two `proxima serve --no-worker` processes on the test database: two key caches, two listeners."""
    logs = tmp_path_factory.mktemp("two-apis")
    procs, urls = [], []
    try:
        for i in range(2):
            port = free_port()
            log = (logs / f"api-{i}.log").open("w")
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", "proxima.cli", "serve", "--no-worker", "--no-inference"],
                    env=_env(settings, PROXIMA_PORT=str(port)),
                    stdout=log,
                    stderr=log,
                )
            )
            urls.append(f"http://127.0.0.1:{port}")
        for proc, url in zip(procs, urls, strict=True):
            deadline = time.monotonic() + 60
            while True:
                try:
                    if httpx.get(url + "/readyz", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                assert proc.poll() is None and time.monotonic() < deadline, "\n".join(
                    p.read_text() for p in logs.iterdir()
                )
                time.sleep(0.1)
        yield urls
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()


def _warm(urls: list[str], key: str) -> None:
    """The key works on every process and sits in each one's cache."""
    for url in urls:
        with http_client(url, key) as c:
            for _ in range(3):
                assert c.get("/v1/files").status_code == 200


def _refused_everywhere(urls: list[str], key: str, *, within: float = 0.0) -> None:
    """Every process refuses the key: at its next request, or (``within`` seconds) once it has had the time to
    receive PostgreSQL's notification of a change made here a moment ago (up to tens of milliseconds on a loaded
    machine; the key cache alone would have served the key for 10 s)."""
    deadline = time.monotonic() + within
    for url in urls:
        with http_client(url, key) as c:
            while (r := c.get("/v1/files")).status_code == 200 and time.monotonic() < deadline:
                time.sleep(0.01)
            assert_error(r, 401, code="invalid_api_key")


def _new_tenant(settings: Any, name: str) -> Tenant:
    return make_tenant(settings, f"{name}-{secrets.token_hex(3)}")


def _key_id(settings: Any, key: str) -> int:
    with psycopg2.connect(_dsn(settings)) as conn, conn.cursor() as cur:
        cur.execute("SELECT id FROM api_keys WHERE key_hash = %s", (auth.hash_key(key),))
        return int(cur.fetchone()[0])


def _dsn(settings: Any) -> str:
    return make_url(settings.database_url).set(drivername="postgresql").render_as_string(hide_password=False)


def _sql(settings: Any, statement: str, *params: Any) -> None:
    conn = psycopg2.connect(_dsn(settings))
    try:
        with conn, conn.cursor() as cur:
            cur.execute(statement, params)
    finally:
        conn.close()


def test_keys_list_shows_every_tenant_with_its_key_ids_and_prefixes_never_the_keys(
    settings: Any, cli: Callable[..., Any]
) -> None:
    a = _new_tenant(settings, "listed")
    created = cli("keys", "create", "--tenant", f"listed-revoked-{secrets.token_hex(3)}")
    assert created.exit_code == 0, created.output
    second = created.stdout.strip()
    revoked = cli("keys", "revoke", second)  # the whole key names it too
    assert revoked.exit_code == 0, revoked.output

    out = cli("keys", "list", "--json")
    assert out.exit_code == 0, out.output
    assert a.key not in out.output and second not in out.output
    by_id = {r["tenant"]["id"]: r["keys"] for r in json.loads(out.stdout)}
    (mine,) = by_id[a.id]
    assert mine == {
        "id": _key_id(settings, a.key),
        "prefix": a.key[:10],
        "created_at": mine["created_at"],
        "revoked_at": None,
    }
    (gone,) = next(keys for keys in by_id.values() if keys and keys[0]["prefix"] == second[:10])
    assert gone["revoked_at"] >= gone["created_at"] > 0

    text = cli("keys", "list")
    assert text.exit_code == 0, text.output
    assert a.key not in text.output and second not in text.output
    assert f"key {_key_id(settings, a.key)}" in text.stdout and f"{a.key[:10]}…" in text.stdout
    assert "revoked 20" in text.stdout and "active" in text.stdout


def test_revoke_via_cli_fails_the_key_at_once_on_both_api_processes(settings: Any, two_apis: list[str]) -> None:
    victim, bystander = _new_tenant(settings, "revoked"), _new_tenant(settings, "bystander")
    _warm(two_apis, victim.key)
    _warm(two_apis, bystander.key)

    out = proxima(settings, "keys", "revoke", victim.key[:10])
    assert out.returncode == 0, out.stderr
    assert f"revoked key {_key_id(settings, victim.key)}" in out.stderr

    _refused_everywhere(two_apis, victim.key)  # the very next request, 10 s cache or not
    _warm(two_apis, bystander.key)  # other keys keep working

    again = proxima(settings, "keys", "revoke", str(_key_id(settings, victim.key)))
    assert again.returncode == 0 and "already revoked" in again.stderr, again.stderr


def test_deleting_a_tenant_fails_its_key_at_once_on_both_api_processes(settings: Any, two_apis: list[str]) -> None:
    victim = _new_tenant(settings, "deleted")
    _warm(two_apis, victim.key)
    _sql(settings, "DELETE FROM tenants WHERE id = %s", victim.id)  # its keys go by the cascade
    _refused_everywhere(two_apis, victim.key, within=1.0)


def test_a_revocation_while_the_listening_connections_are_down_still_fails_the_key_at_once(
    settings: Any, two_apis: list[str]
) -> None:
    """Nothing hears the revocation's notification: the processes notice their listener is gone and look the key up."""
    victim, other = _new_tenant(settings, "unheard"), _new_tenant(settings, "unheard-other")
    _warm(two_apis, victim.key)
    db = make_url(settings.database_url).database
    _sql(
        settings,
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s AND query = %s",
        db,
        f"LISTEN {auth.REVOCATION_CHANNEL}",
    )
    _sql(settings, "UPDATE api_keys SET revoked_at = 1 WHERE key_hash = %s", auth.hash_key(victim.key))
    _refused_everywhere(two_apis, victim.key, within=1.0)  # the time to see the listener's connection closed
    _warm(two_apis, other.key)  # the listeners come back, and with them the cache


def test_revoke_refuses_an_ambiguous_or_unknown_reference(settings: Any, cli: Callable[..., Any]) -> None:
    _new_tenant(settings, "ambiguous-1")
    _new_tenant(settings, "ambiguous-2")
    ambiguous = cli("keys", "revoke", "sk-prx-")
    assert ambiguous.exit_code == 2 and "name one by its id" in ambiguous.output, ambiguous.output
    unknown = cli("keys", "revoke", "sk-prx-not-a-key-at-all")
    assert unknown.exit_code == 2 and "no key matches" in unknown.output, unknown.output
    assert cli("keys", "revoke", "99999999999").exit_code == 2


def test_a_cached_key_costs_no_query_until_its_revocation_arrives(settings: Any, base_url: str) -> None:
    """The cache still saves the key lookup on the hot path; the revocation alone ends that, with no time passing."""
    victim = _new_tenant(settings, "cached")
    lookups: list[str] = []

    def count(_conn: Any, _cursor: Any, statement: str, *_: Any) -> None:
        if "api_keys" in statement:
            lookups.append(statement)

    engine = engine_for(settings.db_url)
    event.listen(engine, "before_cursor_execute", count)
    try:
        with http_client(base_url, victim.key) as c:
            assert c.get("/v1/models").status_code == 200
            first = len(lookups)
            for _ in range(5):
                assert c.get("/v1/models").status_code == 200
            assert len(lookups) == first  # served from the cache
            listener = auth.revocations(settings.db_url)
            assert listener is not None
            heard = listener.epoch()
            _sql(settings, "UPDATE api_keys SET revoked_at = 1 WHERE key_hash = %s", auth.hash_key(victim.key))
            deadline = time.monotonic() + 10
            while listener.epoch() == heard:  # this process (the app's) hears of it
                assert time.monotonic() < deadline, "the revocation's notification never came"
                time.sleep(0.001)
            assert_error(c.get("/v1/models"), 401, code="invalid_api_key")
            assert len(lookups) == first + 1
    finally:
        event.remove(engine, "before_cursor_execute", count)


def test_an_upload_whose_tenant_is_deleted_mid_request_answers_401(settings: Any, base_url: str) -> None:
    """The key was good when the request began; the tenant is gone when its file row is written (a foreign-key
    error, a 500 before)."""
    victim = _new_tenant(settings, "deleted-mid-upload")
    body = jsonl(prompts(2))
    boundary = "proxima-test-boundary"

    def chunks() -> Iterator[bytes]:
        yield (
            f'--{boundary}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nfine-tune\r\n'
            f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="t.jsonl"\r\n'
            "Content-Type: application/jsonl\r\n\r\n"
        ).encode()
        yield body
        _sql(settings, "DELETE FROM tenants WHERE id = %s", victim.id)
        yield f"\r\n--{boundary}--\r\n".encode()

    objects = Path(settings.artifacts_url, "files", victim.id)
    with http_client(base_url, victim.key) as c:
        assert upload(c, jsonl(prompts(1))).status_code == 200  # the key is cached
        before = set(objects.iterdir())
        response = c.post(
            "/v1/files", content=chunks(), headers={"content-type": f"multipart/form-data; boundary={boundary}"}
        )
    assert_error(response, 401, code="invalid_api_key")
    assert set(objects.iterdir()) == before, "the refused upload left its object behind"

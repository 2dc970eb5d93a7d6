"""``/healthz`` (the process is up) and ``/readyz`` (the database, the broker and the artifact store answer).

``/readyz`` needs no key, so its answer names only the backends that are down; why (the driver's message, with
hosts, ports and database names) goes to the log.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from urllib.parse import unquote, urlparse

import redis
from fastapi import APIRouter
from fastapi.responses import JSONResponse
from kombu import Connection
from sqlalchemy import text
from starlette.concurrency import run_in_threadpool

from api.db import engine_for
from api.deps import SettingsDep, get_store
from api.errors import RETRY_AFTER_S, error_json, responses
from api.schemas import Health
from api.settings import Settings
from api.storage import ArtifactStore, LocalStore

log = logging.getLogger("proxima.api.health")

router = APIRouter(tags=["health"])

TIMEOUT_S = 2.0


def check_database(settings: Settings) -> None:
    with engine_for(settings.db_url).connect() as conn:
        conn.execute(text("SELECT 1"))


def check_broker(settings: Settings) -> None:
    url = settings.celery_broker_url
    scheme = urlparse(url).scheme
    if scheme in ("redis", "rediss"):
        client = redis.Redis.from_url(url, socket_connect_timeout=TIMEOUT_S, socket_timeout=TIMEOUT_S)
        try:
            client.ping()
        finally:
            client.close()
    elif scheme == "sqla+sqlite":
        # The embedded broker is a SQLite file that kombu creates on first use: its folder must be writable.
        folder = Path(unquote(url.removeprefix("sqla+sqlite:///"))).parent
        if not (folder.is_dir() and os.access(folder, os.W_OK)):
            raise OSError(f"broker folder {folder} is not a writable directory")
    else:
        with Connection(url, connect_timeout=TIMEOUT_S) as conn:
            conn.ensure_connection(max_retries=1, timeout=TIMEOUT_S)


def check_store(store: ArtifactStore) -> None:
    if isinstance(store, LocalStore):
        if not (store.root.is_dir() and os.access(store.root, os.W_OK)):
            raise OSError(f"artifact folder {store.root} is not a writable directory")
    else:
        store.exists("readyz-probe")  # a request to the bucket: raises when it cannot be reached


@router.get("/healthz", response_model=Health, summary="The process is up")
def healthz() -> Health:
    return Health()


@router.get(
    "/readyz",
    response_model=Health,
    summary="The database, the broker and the artifact store are reachable",
    responses=responses(503),
)
async def readyz(settings: SettingsDep) -> Health | JSONResponse:
    async def store() -> None:
        await run_in_threadpool(check_store, await get_store(settings))  # making the store may fail too

    checks = (
        ("database", lambda: run_in_threadpool(check_database, settings)),
        ("broker", lambda: run_in_threadpool(check_broker, settings)),
        ("store", store),
    )
    down: list[str] = []
    for name, check in checks:
        try:
            await check()
        except Exception as err:  # any failure means not ready: the client learns which, the log why
            log.warning("readyz: the %s is down: %s: %s", name, type(err).__name__, err)
            down.append(name)
    if down:
        return error_json(
            503,
            "not ready: " + "; ".join(f"{name}: unavailable" for name in down),
            "server_error",
            code="not_ready",
            **{"retry-after": str(RETRY_AFTER_S)},
        )
    return Health(checks={"database": "ok", "broker": "ok", "store": "ok"})

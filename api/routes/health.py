"""``/healthz`` (the process is up) and ``/readyz`` (the database and the broker answer)."""

from __future__ import annotations

import os
from pathlib import Path
from urllib.parse import unquote, urlparse

import redis
from fastapi import APIRouter
from kombu import Connection
from sqlalchemy import text

from api.db import engine_for
from api.deps import SettingsDep
from api.errors import Unavailable
from api.schemas import Health
from api.settings import Settings

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


@router.get("/healthz", response_model=Health, summary="The process is up")
def healthz() -> Health:
    return Health()


@router.get(
    "/readyz",
    response_model=Health,
    summary="The database and the broker are reachable",
    responses={503: {"description": "not ready (OpenAI error envelope)"}},
)
def readyz(settings: SettingsDep) -> Health:
    failures: list[str] = []
    for name, check in (("database", check_database), ("broker", check_broker)):
        try:
            check(settings)
        except Exception as err:  # any failure means not ready; the message says which and why
            failures.append(f"{name}: {type(err).__name__}: {err}")
    if failures:
        raise Unavailable("not ready: " + "; ".join(failures), code="not_ready")
    return Health(checks={"database": "ok", "broker": "ok"})

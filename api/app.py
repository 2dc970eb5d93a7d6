"""The FastAPI application: routes, the error envelope, request ids and the upload size guard.

``create_app(settings)`` builds an app bound to one settings object (tests pass theirs; ``proxima serve`` passes
none and gets the environment's). OpenAPI docs are at ``/docs``.
"""

from __future__ import annotations

import contextvars
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI
from sqlalchemy.exc import SQLAlchemyError
from starlette.concurrency import run_in_threadpool
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api import errors
from api.errors import envelope
from api.routes import dashboard, files, graders, health, jobs, models
from api.services import jobs as jobs_service
from api.settings import Settings, get_settings

log = logging.getLogger("proxima.api.access")
startup_log = logging.getLogger("proxima.api")

REQUEST_ID_HEADER = "x-request-id"
request_id: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="-")

# Multipart framing around the file: boundaries, part headers and the `purpose` field.
MULTIPART_SLACK_BYTES = 16 * 1024


def _install_log_record_factory() -> None:
    """Every log record gets ``request_id`` (``-`` outside a request), usable as ``%(request_id)s``."""
    previous = logging.getLogRecordFactory()
    if getattr(previous, "_proxima_request_id", False):
        return

    def factory(*args: Any, **kwargs: Any) -> logging.LogRecord:
        record = previous(*args, **kwargs)
        record.request_id = request_id.get()
        return record

    factory._proxima_request_id = True  # type: ignore[attr-defined]
    logging.setLogRecordFactory(factory)


class RequestIdMiddleware:
    """Echo the client's ``x-request-id`` (or make one), expose it to log records, log one line per request (at
    info) and a warning for a request slower than ``slow_ms``."""

    def __init__(self, app: ASGIApp, *, slow_ms: float) -> None:
        self.app = app
        self.slow_ms = slow_ms

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        incoming = dict(scope["headers"]).get(REQUEST_ID_HEADER.encode(), b"").decode("latin-1")
        rid = incoming[:128] if incoming and incoming.isprintable() else f"req_{uuid.uuid4().hex}"
        token = request_id.set(rid)
        start, status = time.perf_counter(), 500

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                extra = [(REQUEST_ID_HEADER.encode(), rid.encode("latin-1"))]
                if status == 409:  # a conflict is final: tell OpenAI's clients not to retry it
                    extra.append((b"x-should-retry", b"false"))
                message["headers"] = [*message.get("headers", []), *extra]
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            ms = (time.perf_counter() - start) * 1e3
            log.info("%s %s %d %.1fms", scope["method"], scope["path"], status, ms)
            if ms > self.slow_ms:
                log.warning("slow request %s: %s %s %d %.1fms", rid, scope["method"], scope["path"], status, ms)
            request_id.reset(token)


class UploadGuardMiddleware:
    """Refuse an upload whose declared length is over the limit before its body is read (413, OpenAI envelope).
    Uploads without a length, or within it, are still held to the limit byte by byte while they are stored."""

    def __init__(self, app: ASGIApp, *, max_upload_bytes: int) -> None:
        self.app = app
        self.limit = max_upload_bytes + MULTIPART_SLACK_BYTES

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST" and scope["path"].rstrip("/") == "/v1/files":
            length = dict(scope["headers"]).get(b"content-length", b"")
            if length.isdigit() and int(length) > self.limit:
                body = envelope(
                    f"the upload exceeds the limit of {self.limit - MULTIPART_SLACK_BYTES} bytes",
                    "invalid_request_error",
                    "file",
                    "file_too_large",
                )
                payload = json.dumps(body).encode()
                await send(
                    {
                        "type": "http.response.start",
                        "status": 413,
                        "headers": [
                            (b"content-type", b"application/json"),
                            (b"content-length", str(len(payload)).encode()),
                            (b"connection", b"close"),
                        ],
                    }
                )
                await send({"type": "http.response.body", "body": payload})
                return
        await self.app(scope, receive, send)


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or get_settings()
    _install_log_record_factory()

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if settings.database_url is None or settings.broker_url is None or settings.artifacts is None:
            settings.home.mkdir(parents=True, exist_ok=True)  # the embedded backends live under PROXIMA_HOME
        if settings.run_migrations:
            from api.migrate import upgrade

            upgrade(settings.db_url)
        try:
            await run_in_threadpool(jobs_service.warm_up_reads, settings.db_url)
        except SQLAlchemyError as err:  # not migrated yet, or the database is down: /readyz says which
            startup_log.warning("the database reads were not warmed up: %s", err)
        yield

    app = FastAPI(
        title="Proxima",
        version="0.1.0",
        description="Self-hosted RL fine-tuning with OpenAI's fine-tuning API.",
        lifespan=lifespan,
        docs_url="/docs",
    )
    errors.install(app)
    for router in (files.router, jobs.router, graders.router, models.router, health.router):
        app.include_router(router)
    dashboard.install(app)
    app.add_middleware(UploadGuardMiddleware, max_upload_bytes=settings.max_upload_bytes)
    app.add_middleware(RequestIdMiddleware, slow_ms=settings.slow_request_ms)
    # Routes read the settings from here (api.deps.SettingsDep). Not through app.dependency_overrides: while any
    # override is set, FastAPI re-inspects every dependency's signature on every request (a fifth of a job read).
    app.state.settings = settings
    return app

"""The FastAPI application: routes, the error envelope, request ids and the request guard (``api.guards``).

``create_app(settings)`` builds an app bound to one settings object (tests pass theirs; ``proxima serve`` passes
none and gets the environment's). OpenAPI docs are at ``/docs`` and ``/redoc`` (``api.routes.docs``); the document
at ``/openapi.json`` says what the API really answers (``document_errors``), since clients are generated from it.
"""

from __future__ import annotations

import contextvars
import logging
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from sqlalchemy.exc import SQLAlchemyError
from starlette.concurrency import run_in_threadpool
from starlette.routing import BaseRoute, Mount, Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api import errors, notify
from api.guards import RequestGuard
from api.routes import (
    dashboard,
    docs,
    evals,
    files,
    graders,
    health,
    inference,
    jobs,
    models,
    tinker,
    training_sessions,
    webhooks,
)
from api.services import jobs as jobs_service
from api.settings import Settings, get_settings

log = logging.getLogger("proxima.api.access")
startup_log = logging.getLogger("proxima.api")

REQUEST_ID_HEADER = "x-request-id"
LONG_POLLS = frozenset({"/api/v1/retrieve_future"})  # held on purpose until a result or a timeout: never "slow"
request_id: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="-")

SECURITY_SCHEME = "bearerAuth"


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
            if ms > self.slow_ms and scope["path"] not in LONG_POLLS:
                log.warning("slow request %s: %s %s %d %.1fms", rid, scope["method"], scope["path"], status, ms)
            request_id.reset(token)


def create_app(settings: Settings | None = None) -> FastAPI:
    """The app bound to ``settings`` (the environment's when none): its routes, error envelope, OpenAPI document,
    request guard and request ids; the database is prepared when it starts (:func:`_lifespan`)."""
    settings = settings or get_settings()
    _install_log_record_factory()
    app = FastAPI(
        title="Proxima",
        version="0.1.0",
        description="Self-hosted RL fine-tuning with OpenAI's fine-tuning API.",
        lifespan=partial(_lifespan, settings=settings),
        docs_url=None,  # FastAPI's pages load scripts from a CDN: ours are served from the package (api.routes.docs)
        redoc_url=None,
    )
    errors.install(app)
    app.state.routes = _install_routes(app)
    app.openapi = lambda: _openapi(app)  # type: ignore[method-assign]
    app.add_middleware(RequestGuard, settings=settings, routes=app.state.routes)
    app.add_middleware(RequestIdMiddleware, slow_ms=settings.slow_request_ms)
    # Routes read the settings from here (api.deps.SettingsDep). Not through app.dependency_overrides: while any
    # override is set, FastAPI re-inspects every dependency's signature on every request (a fifth of a job read).
    app.state.settings = settings
    return app


@asynccontextmanager
async def _lifespan(app: FastAPI, *, settings: Settings) -> AsyncIterator[None]:
    """The app's life: the database migrated (when asked) and its reads warmed up before the first request, and the
    listener of the workers' notifications (where the database sends them) while it serves."""
    if settings.database_url is None or settings.broker_url is None or settings.artifacts is None:
        settings.home.mkdir(parents=True, exist_ok=True)  # the embedded backends live under PROXIMA_HOME
    if settings.run_migrations:
        from api.migrate import upgrade

        upgrade(settings.db_url)
    try:
        await run_in_threadpool(jobs_service.warm_up_reads, settings.db_url)
    except SQLAlchemyError as err:  # not migrated yet, or the database is down: /readyz says which
        startup_log.warning("the database reads were not warmed up: %s", err)
    # Tinker's held polls are woken by the workers' notifications where the database sends them
    listener = None
    if notify.supported(settings.db_url):
        listener = notify.Listener(settings.db_url, notify.DONE_CHANNEL).start()
    app.state.tinker_done = listener
    try:
        yield
    finally:
        if listener is not None:
            listener.stop()


def _install_routes(app: FastAPI) -> list[BaseRoute]:
    """Include every router, the dashboard and the docs. Returns every route and mount, flat (FastAPI wraps an
    included router in one opaque entry): what a 405's Allow lists and what names a bad path parameter."""
    routers = (
        files.router,
        jobs.router,
        jobs.estimates_router,
        graders.router,
        models.router,
        inference.router,
        health.router,
        webhooks.router,
        evals.router,
        tinker.router,
        training_sessions.router,
    )
    for router in routers:
        app.include_router(router)
    dashboard.install(app)
    docs.install(app)
    return [
        *(r for r in app.router.routes if isinstance(r, Route | Mount)),
        *(r for router in (*routers, dashboard.router, docs.router) for r in router.routes),
    ]


def _openapi(app: FastAPI) -> dict[str, Any]:
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
        document_errors(schema)
        app.openapi_schema = schema
    return app.openapi_schema


def document_errors(schema: dict[str, Any]) -> None:
    """Make the generated document say what the API answers: the bearer key on every ``/v1`` operation, and the
    error answers that every operation of a kind can give, each with the envelope's schema. A route documents its
    own particular errors (a 409, a 507) with ``errors.responses``.

    - any operation: 400 (a parameter that is not UTF-8 text without NUL, or that fails validation), never the 422
      FastAPI documents by default (``api.errors`` answers 400);
    - ``/v1``: 401 (no or a wrong key) and 503 (the database or the store is down or too slow);
    - with a path parameter: 404; with a body: 413 (``api.guards`` bounds every body).
    """
    components = schema.setdefault("components", {})
    schemas = components.setdefault("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):
        schemas.pop(name, None)
    error_schema = errors.ErrorResponse.model_json_schema(ref_template="#/components/schemas/{model}")
    schemas.update(error_schema.pop("$defs", {}))
    schemas["ErrorResponse"] = error_schema
    components["securitySchemes"] = {
        SECURITY_SCHEME: {
            "type": "http",
            "scheme": "bearer",
            "description": "An API key (`proxima keys create`), sent as `Authorization: Bearer <key>`",
        }
    }
    for path, item in schema.get("paths", {}).items():
        for operation in item.values():
            statuses = {400}
            if path.startswith("/v1/"):
                operation["security"] = [{SECURITY_SCHEME: []}]
                statuses |= {401, 503}
            if any(p.get("in") == "path" for p in operation.get("parameters", ())):
                statuses.add(404)
            if "requestBody" in operation:
                statuses.add(413)
            answers = operation.setdefault("responses", {})
            answers.pop("422", None)
            for status, spec in errors.responses(*sorted(statuses)).items():
                if str(status) not in answers:
                    answers[str(status)] = _error_answer(spec)
            operation["responses"] = dict(sorted(answers.items()))


def _error_answer(spec: dict[str, Any]) -> dict[str, Any]:
    answer: dict[str, Any] = {
        "description": spec["description"],
        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}},
    }
    if "headers" in spec:
        answer["headers"] = spec["headers"]
    return answer

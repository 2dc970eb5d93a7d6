"""FastAPI dependencies: ``SettingsDep``, ``SessionDep``, ``TenantDep``, ``StoreDep``.

The settings, session and tenant dependencies are ``async`` so that they cost no trip through the threadpool on the
event loop's side: a sync dependency is one more hand-off to a worker thread and back, and a job poll went through
seven of them. Only the database work itself runs in threads.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import nullcontext
from functools import lru_cache
from typing import Annotated

import anyio
from anyio.lowlevel import RunVar
from fastapi import Depends, Request
from sqlalchemy.orm import Session
from starlette.concurrency import run_in_threadpool

from api.auth import cached_tenant, tenant_for_key
from api.db import pool_capacity, session_scope
from api.errors import Unauthorized
from api.orm import Tenant
from api.settings import Settings
from api.storage import ArtifactStore, store_from_url


async def app_settings(request: Request) -> Settings:
    """The settings the app was built with (``create_app(settings)``; tests pass theirs there)."""
    return request.app.state.settings  # type: ignore[no-any-return]


SettingsDep = Annotated[Settings, Depends(app_settings)]

# Per event loop (one per API process), per database: how many requests may hold a session at once.
_session_slots: RunVar[dict[str, anyio.Semaphore]] = RunVar("proxima_session_slots")


def _slots(url: str) -> anyio.Semaphore | None:
    capacity = pool_capacity(url)
    if capacity is None:
        return None
    try:
        slots = _session_slots.get()
    except LookupError:
        slots = {}
        _session_slots.set(slots)
    if url not in slots:
        slots[url] = anyio.Semaphore(capacity)
    return slots[url]


async def get_session(settings: SettingsDep) -> AsyncIterator[Session]:
    """One session per request, committed (or rolled back) and closed at the request boundary.

    At most as many requests hold a session as the pool has connections; the others wait here, on the event loop.
    Without that limit a burst deadlocks: every threadpool thread waits in the pool for a connection while every
    connection belongs to a request waiting for a thread to run its next step, until the pool's timeout (503s).
    """
    async with _slots(settings.db_url) or nullcontext():
        scope = session_scope(settings.db_url)
        session = scope.__enter__()  # a Session object: no I/O before its first query
        try:
            yield session
        except BaseException as err:
            with anyio.CancelScope(shield=True):
                suppressed = await anyio.to_thread.run_sync(
                    scope.__exit__, type(err), err, err.__traceback__, limiter=anyio.CapacityLimiter(1)
                )
            if not suppressed:
                raise
        else:
            # Its own limiter: the commit never waits for a threadpool thread while holding a connection.
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(scope.__exit__, None, None, None, limiter=anyio.CapacityLimiter(1))


# scope="function": commit before the response is sent, so a client that reads right after sees the change.
SessionDep = Annotated[Session, Depends(get_session, scope="function")]


async def get_tenant(request: Request, session: SessionDep) -> Tenant:
    header = request.headers.get("authorization", "")
    scheme, _, key = header.partition(" ")
    key = key.strip()
    if scheme.lower() != "bearer" or not key:
        raise Unauthorized("Missing API key: send 'Authorization: Bearer <key>'", code="missing_api_key")
    tenant = cached_tenant(key) or await run_in_threadpool(tenant_for_key, session, key)
    if tenant is None:
        raise Unauthorized("Incorrect API key provided", code="invalid_api_key")
    return tenant


TenantDep = Annotated[Tenant, Depends(get_tenant)]


@lru_cache
def _store(url: str, endpoint_url: str | None) -> ArtifactStore:
    return store_from_url(url, endpoint_url=endpoint_url)


def get_store(settings: SettingsDep) -> ArtifactStore:
    return _store(settings.artifacts_url, settings.s3_endpoint_url)


StoreDep = Annotated[ArtifactStore, Depends(get_store)]

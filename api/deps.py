"""FastAPI dependencies: ``SettingsDep``, ``SessionDep``, ``TenantDep``, ``StoreDep``.

The settings, session and tenant dependencies are ``async`` so that they cost no trip through the threadpool on the
event loop's side: a sync dependency is one more hand-off to a worker thread and back, and a job poll went through
seven of them. Only the database work itself runs in threads.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager, nullcontext
from functools import lru_cache
from typing import Annotated, Any, TypeVar

import anyio
from anyio.lowlevel import RunVar
from fastapi import Depends, Request
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session
from starlette.concurrency import run_in_threadpool

from api.auth import Caller, cached_tenant, lookup_tenant, tenant_exists
from api.db import pool_capacity, read, session_scope
from api.errors import Unauthorized
from api.settings import Settings
from api.storage import ArtifactStore, StorageError, store_from_url


async def app_settings(request: Request) -> Settings:
    """The settings the app was built with (``create_app(settings)``; tests pass theirs there)."""
    return request.app.state.settings


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


def session_slot(url: str) -> AbstractAsyncContextManager[Any]:
    """Admission to the database: at most as many requests hold a session at once as the pool has connections; the
    others wait here, on the event loop. Without that limit a burst deadlocks: every threadpool thread waits in the
    pool for a connection while every connection belongs to a request waiting for a thread to run its next step,
    until the pool's timeout (503s)."""
    return _slots(url) or nullcontext()


def _tenant_for_key(url: str, key: str) -> Caller | None:
    with session_scope(url) as session:
        return lookup_tenant(session, url, key)


async def get_tenant(request: Request, settings: SettingsDep) -> Caller:
    """The tenant of the request's API key: from this process's key cache (``api.auth``: a revoked key is never
    served from it), else from the database (its own read, so that a route that needs no session opens none)."""
    header = request.headers.get("authorization", "")
    scheme, _, key = header.partition(" ")
    key = key.strip()
    if scheme.lower() != "bearer" or not key:
        raise Unauthorized("Missing API key: send 'Authorization: Bearer <key>'", code="missing_api_key")
    tenant = cached_tenant(settings.db_url, key)
    if tenant is None:
        async with session_slot(settings.db_url):
            tenant = await run_in_threadpool(_tenant_for_key, settings.db_url, key)
    if tenant is None:
        raise Unauthorized("Incorrect API key provided", code="invalid_api_key")
    return tenant


TenantDep = Annotated[Caller, Depends(get_tenant)]

TINKER_KEY_PREFIX = "tml-"
"""The Tinker SDK refuses a key that does not start with this: a tenant's Tinker key is ``tml-`` + its Proxima key."""


async def get_tinker_tenant(request: Request, settings: SettingsDep) -> Caller:
    """The tenant of a Tinker SDK request: ``X-API-Key: tml-<Proxima key>`` (the SDK sends no Authorization)."""
    header = request.headers.get("x-api-key", "").strip()
    if not header:
        raise Unauthorized("Missing API key: send 'X-API-Key: tml-<key>'", code="missing_api_key")
    key = header.removeprefix(TINKER_KEY_PREFIX)
    tenant = cached_tenant(settings.db_url, key) if key != header else None
    if tenant is None and key != header:
        async with session_slot(settings.db_url):
            tenant = await run_in_threadpool(_tenant_for_key, settings.db_url, key)
    if tenant is None:
        raise Unauthorized("Incorrect API key provided: a Tinker key is 'tml-' + a Proxima key", code="invalid_api_key")
    return tenant


TinkerTenantDep = Annotated[Caller, Depends(get_tinker_tenant)]


async def get_tinker_session(settings: SettingsDep, tenant: TinkerTenantDep) -> AsyncIterator[Session]:
    """:func:`get_session` for the Tinker SDK's requests (their key is ``X-API-Key``)."""
    async with _request_session(settings, tenant) as session:
        yield session


TinkerSessionDep = Annotated[Session, Depends(get_tinker_session, scope="function")]


async def get_session(settings: SettingsDep, tenant: TenantDep) -> AsyncIterator[Session]:
    """One session per authenticated request, committed (or rolled back) and closed at the request boundary, within
    a ``session_slot``. A session that never touched the database is closed on the event loop (no I/O), not in a
    thread.

    The tenant is resolved first (FastAPI caches it for the route's own ``TenantDep``): a key lookup takes a slot of
    its own, and a request that held one slot while waiting for a second could deadlock a burst.

    A tenant deleted while its request ran (after the key was checked) makes the request's writes fail on their
    foreign key: that is a 401, as the same request a moment later would get, not a 500."""
    async with _request_session(settings, tenant) as session:
        yield session


@asynccontextmanager
async def _request_session(settings: Settings, tenant: Caller) -> AsyncIterator[Session]:
    async with session_slot(settings.db_url):
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
                if isinstance(err, IntegrityError):
                    await _unless_tenant_gone(settings.db_url, tenant, err)
                raise
        else:
            if _untouched(session):
                scope.__exit__(None, None, None)  # commits nothing and closes: no connection was checked out
                return
            # Its own limiter: the commit never waits for a threadpool thread while holding a connection.
            with anyio.CancelScope(shield=True):
                try:
                    await anyio.to_thread.run_sync(scope.__exit__, None, None, None, limiter=anyio.CapacityLimiter(1))
                except IntegrityError as err:
                    await _unless_tenant_gone(settings.db_url, tenant, err)
                    raise


def _tenant_exists(url: str, tenant_id: str) -> bool:
    with session_scope(url) as session:
        return tenant_exists(session, tenant_id=tenant_id)


async def _unless_tenant_gone(url: str, tenant: Caller, err: IntegrityError) -> None:
    """Raise a 401 in place of ``err`` when the request's tenant no longer exists (deleted during the request)."""
    if not await anyio.to_thread.run_sync(_tenant_exists, url, tenant.id, limiter=anyio.CapacityLimiter(1)):
        raise Unauthorized("Incorrect API key provided: its tenant no longer exists", code="invalid_api_key") from err


def _untouched(session: Session) -> bool:
    return not session.in_transaction() and not (session.new or session.dirty or session.deleted)


# scope="function": commit before the response is sent, so a client that reads right after sees the change.
SessionDep = Annotated[Session, Depends(get_session, scope="function")]

T = TypeVar("T")


async def read_only(url: str, fn: Callable[..., T], /, **kwargs: Any) -> T:
    """``fn(connection, **kwargs)`` through ``api.db.read`` (autocommit, one round trip a statement), in one trip
    through the threadpool, within a ``session_slot``. For the hot reads, a job poll above all: a request session
    costs a second trip to close it, a pre-ping and a BEGIN/COMMIT pair, about twice the CPU of the read itself."""
    async with session_slot(url):
        return await run_in_threadpool(read, url, fn, **kwargs)


@lru_cache
def _store(url: str, endpoint_url: str | None) -> ArtifactStore:
    try:
        return store_from_url(url, endpoint_url=endpoint_url)
    except OSError as err:  # the folder cannot be made (a file in its place, no permission): a 503, not a 500
        raise StorageError(f"the artifact store at {url!r} cannot be opened: {err}") from err


async def get_store(settings: SettingsDep) -> ArtifactStore:  # async: no I/O, so no trip through a thread
    return _store(settings.artifacts_url, settings.s3_endpoint_url)


StoreDep = Annotated[ArtifactStore, Depends(get_store)]

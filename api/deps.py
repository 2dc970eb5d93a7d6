"""FastAPI dependencies: ``SettingsDep``, ``SessionDep``, ``TenantDep``, ``StoreDep``."""

from __future__ import annotations

from collections.abc import Iterator
from functools import lru_cache
from typing import Annotated

from fastapi import Depends, Request
from sqlalchemy.orm import Session

from api.auth import tenant_for_key
from api.db import session_scope
from api.errors import Unauthorized
from api.orm import Tenant
from api.settings import Settings, get_settings
from api.storage import ArtifactStore, store_from_url

SettingsDep = Annotated[Settings, Depends(get_settings)]


def get_session(settings: SettingsDep) -> Iterator[Session]:
    """One session per request, committed at the request boundary."""
    with session_scope(settings.db_url) as session:
        yield session


# scope="function": commit before the response is sent, so a client that reads right after sees the change.
SessionDep = Annotated[Session, Depends(get_session, scope="function")]


def get_tenant(request: Request, session: SessionDep) -> Tenant:
    header = request.headers.get("authorization", "")
    scheme, _, key = header.partition(" ")
    if scheme.lower() != "bearer" or not key:
        raise Unauthorized("Missing API key: send 'Authorization: Bearer <key>'", code="missing_api_key")
    tenant = tenant_for_key(session, key.strip())
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

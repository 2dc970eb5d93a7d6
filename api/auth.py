"""API keys: stored as sha256 hashes; ``Authorization: Bearer <key>`` resolves to a tenant."""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass

from sqlalchemy import select
from sqlalchemy.orm import Session

from api import ids
from api.orm import ApiKey, Tenant


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def create_key(session: Session, *, tenant_name: str) -> tuple[Tenant, str]:
    """A new key for the tenant (created when missing); the key itself is only ever returned here."""
    tenant = session.scalar(select(Tenant).where(Tenant.name == tenant_name))
    if tenant is None:
        tenant = Tenant(id=ids.tenant_id(), name=tenant_name)
        session.add(tenant)
        session.flush()
    key = ids.api_key()
    session.add(ApiKey(tenant_id=tenant.id, key_hash=hash_key(key), prefix=key[:10]))
    return tenant, key


@dataclass(frozen=True, slots=True)
class Caller:
    """The tenant a request acts for, as routes and services see it: its fields, not a session-bound row (one
    object per key, shared by the requests of the key cache's lifetime)."""

    id: str
    name: str
    created_at: int


KEY_CACHE_SECONDS = 10.0
"""A key's tenant is remembered this long in each API process: one query less on every request (the hot path of
a job poll). A revoked key therefore keeps working for at most this long."""

_key_cache: dict[str, tuple[float, Caller]] = {}


def cached_tenant(key: str) -> Caller | None:
    """The key's tenant if this process looked it up less than ``KEY_CACHE_SECONDS`` ago, else None (no I/O)."""
    hit = _key_cache.get(hash_key(key))
    if hit is not None and hit[0] > time.monotonic():
        return hit[1]
    return None


def tenant_for_key(session: Session, key: str) -> Caller | None:
    cached = cached_tenant(key)
    if cached is not None:
        return cached
    digest = hash_key(key)
    tenant = session.scalar(
        select(Tenant)
        .join(ApiKey, ApiKey.tenant_id == Tenant.id)
        .where(ApiKey.key_hash == digest, ApiKey.revoked_at.is_(None))
    )
    if tenant is None:
        return None
    caller = Caller(id=tenant.id, name=tenant.name, created_at=tenant.created_at)
    if len(_key_cache) > 10_000:
        _key_cache.clear()
    _key_cache[digest] = (time.monotonic() + KEY_CACHE_SECONDS, caller)
    return caller

"""API keys: stored as sha256 hashes; ``Authorization: Bearer <key>`` resolves to a tenant."""

from __future__ import annotations

import hashlib

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


def tenant_for_key(session: Session, key: str) -> Tenant | None:
    row = session.scalar(select(ApiKey).where(ApiKey.key_hash == hash_key(key), ApiKey.revoked_at.is_(None)))
    return session.get(Tenant, row.tenant_id) if row else None

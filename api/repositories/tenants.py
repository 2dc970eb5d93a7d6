"""SQL for tenants (API keys are in ``api.auth``)."""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.orm import Session

from api.orm import Tenant


def get(session: Session, *, tenant_id: str) -> Tenant | None:
    return session.get(Tenant, tenant_id)


def get_by_name(session: Session, *, name: str) -> Tenant | None:
    return session.scalar(select(Tenant).where(Tenant.name == name))

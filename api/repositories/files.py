"""SQL for ``files``. Every read filters by tenant: another tenant's file does not exist."""

from __future__ import annotations

from typing import Literal

from sqlalchemy import select, tuple_
from sqlalchemy.orm import Session

from api.orm import File


def add(session: Session, *, row: File) -> File:
    session.add(row)
    session.flush()
    return row


def get(session: Session, *, tenant_id: str, file_id: str) -> File | None:
    """The tenant's file, None when missing, deleted or another tenant's."""
    return session.scalar(select(File).where(File.id == file_id, File.tenant_id == tenant_id, File.deleted.is_(False)))


def page(
    session: Session,
    *,
    tenant_id: str,
    purpose: str | None,
    after: File | None,
    limit: int,
    order: Literal["asc", "desc"],
) -> tuple[list[File], bool]:
    """One page ordered by (created_at, id), starting after the row ``after``; (rows, has_more)."""
    stmt = select(File).where(File.tenant_id == tenant_id, File.deleted.is_(False))
    if purpose is not None:
        stmt = stmt.where(File.purpose == purpose)
    key = tuple_(File.created_at, File.id)
    if after is not None:
        bound = tuple_(after.created_at, after.id)
        stmt = stmt.where(key > bound if order == "asc" else key < bound)
    if order == "asc":
        stmt = stmt.order_by(File.created_at.asc(), File.id.asc())
    else:
        stmt = stmt.order_by(File.created_at.desc(), File.id.desc())
    rows = list(session.scalars(stmt.limit(limit + 1)))
    return rows[:limit], len(rows) > limit


def mark_deleted(session: Session, *, row: File) -> None:
    row.deleted = True
    session.flush()

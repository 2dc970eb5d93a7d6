"""SQL for ``files``. Every read a route makes filters by tenant: another tenant's file does not exist. The expiry
reads (:func:`is_expired` for the worker about its job's own file, :func:`expired` for the sweeper) cross tenants."""

from __future__ import annotations

from typing import Literal

from sqlalchemy import ColumnElement, or_, select, tuple_
from sqlalchemy.orm import Session

from api.orm import File, now


def _live(at: int) -> ColumnElement[bool]:
    """Not deleted and not expired at ``at``: an expired file is gone for its tenant before the sweeper removes it."""
    return File.deleted.is_(False) & or_(File.expires_at.is_(None), File.expires_at > at)


def add(session: Session, *, row: File) -> File:
    session.add(row)
    session.flush()
    return row


def get(session: Session, *, tenant_id: str, file_id: str) -> File | None:
    """The tenant's file, None when missing, deleted, expired or another tenant's."""
    return session.scalar(select(File).where(File.id == file_id, File.tenant_id == tenant_id, _live(now())))


def get_expired(session: Session, *, tenant_id: str, file_id: str) -> File | None:
    """The tenant's file when it has expired but is not deleted yet (the sweeper's next pass deletes it)."""
    return session.scalar(
        select(File).where(
            File.id == file_id, File.tenant_id == tenant_id, File.deleted.is_(False), File.expires_at <= now()
        )
    )


def is_expired(session: Session, *, file_id: str, at: int) -> bool:
    """Whether the file (any tenant's: the worker asks for a job's own file) has an expiry at or before ``at``."""
    expires_at = session.scalar(select(File.expires_at).where(File.id == file_id))
    return expires_at is not None and expires_at <= at


def expired(session: Session, *, at: int, limit: int) -> list[File]:
    """Up to ``limit`` files of any tenant, not deleted yet, whose expiry is at or before ``at`` (the sweeper's)."""
    stmt = select(File).where(File.deleted.is_(False), File.expires_at <= at).order_by(File.expires_at, File.id)
    return list(session.scalars(stmt.limit(limit)))


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
    stmt = select(File).where(File.tenant_id == tenant_id, _live(now()))
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

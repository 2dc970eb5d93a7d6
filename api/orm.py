"""Storage models (SQLAlchemy 2, typed). They never leave the service layer: API schemas are built from them."""

from __future__ import annotations

import time
from typing import Any

from sqlalchemy import JSON, BigInteger, Boolean, Dialect, Float, ForeignKey, Index, Integer, String, Text
from sqlalchemy.orm import Mapped, mapped_column
from sqlalchemy.types import TypeDecorator

from api.db import Base
from api.status import JobStatus


def now() -> int:
    return int(time.time())


class Tenant(Base):
    __tablename__ = "tenants"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    name: Mapped[str] = mapped_column(String(128), unique=True)
    created_at: Mapped[int] = mapped_column(BigInteger, default=now)


class ApiKey(Base):
    __tablename__ = "api_keys"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), index=True)
    key_hash: Mapped[str] = mapped_column(String(64), unique=True)  # sha256 hex of the key: keys are not stored
    prefix: Mapped[str] = mapped_column(String(16))  # the first characters, to recognise a key in listings
    created_at: Mapped[int] = mapped_column(BigInteger, default=now)
    revoked_at: Mapped[int | None] = mapped_column(BigInteger, nullable=True)


class File(Base):
    __tablename__ = "files"
    __table_args__ = (Index("ix_files_tenant_created", "tenant_id", "created_at"),)

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    filename: Mapped[str] = mapped_column(String(512))
    purpose: Mapped[str] = mapped_column(String(32))
    bytes: Mapped[int] = mapped_column(BigInteger)
    lines: Mapped[int] = mapped_column(Integer, default=0)
    storage_key: Mapped[str] = mapped_column(String(512))
    created_at: Mapped[int] = mapped_column(BigInteger, default=now)
    deleted: Mapped[bool] = mapped_column(Boolean, default=False)


class _Status(TypeDecorator[JobStatus]):
    """A job's status: VARCHAR(32) in the database (no migration, no database enum to alter when a status is
    added), :class:`JobStatus` in Python; writing a value that is not a status fails before it reaches SQL."""

    impl = String(32)
    cache_ok = True

    def process_bind_param(self, value: Any, dialect: Dialect) -> str | None:
        return None if value is None else JobStatus(value).value

    def process_result_value(self, value: Any, dialect: Dialect) -> JobStatus | None:
        return None if value is None else JobStatus(value)


class Job(Base):
    __tablename__ = "jobs"
    __table_args__ = (
        Index("ix_jobs_tenant_created", "tenant_id", "created_at"),
        Index("ix_jobs_status", "status"),
    )

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    model: Mapped[str] = mapped_column(String(256))
    training_file: Mapped[str] = mapped_column(String(64))
    validation_file: Mapped[str | None] = mapped_column(String(64), nullable=True)
    status: Mapped[JobStatus] = mapped_column(_Status())
    spec: Mapped[dict[str, Any]] = mapped_column(JSON)  # the validated spec, hyperparameters resolved
    seed: Mapped[int] = mapped_column(Integer, default=0)
    suffix: Mapped[str | None] = mapped_column(String(64), nullable=True)
    metadata_: Mapped[dict[str, str] | None] = mapped_column("metadata", JSON, nullable=True)
    error: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    fine_tuned_model: Mapped[str | None] = mapped_column(String(512), nullable=True)
    result_files: Mapped[list[str]] = mapped_column(JSON, default=list)
    trained_tokens: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    estimated_finish: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    created_at: Mapped[int] = mapped_column(BigInteger, default=now)
    started_at: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    finished_at: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    current_step: Mapped[int] = mapped_column(Integer, default=0)
    total_steps: Mapped[int | None] = mapped_column(Integer, nullable=True)
    # The claim: one owner at a time, renewed while running; an expired lease makes the job claimable again.
    lease_owner: Mapped[str | None] = mapped_column(String(128), nullable=True)
    lease_expires_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    cancel_requested: Mapped[bool] = mapped_column(Boolean, default=False)
    pause_requested: Mapped[bool] = mapped_column(Boolean, default=False)
    enqueued_at: Mapped[float | None] = mapped_column(Float, nullable=True)


class JobEvent(Base):
    __tablename__ = "job_events"
    __table_args__ = (Index("ix_job_events_job_seq", "job_id", "seq"),)

    seq: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    id: Mapped[str] = mapped_column(String(64), unique=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    created_at: Mapped[int] = mapped_column(BigInteger, default=now)
    level: Mapped[str] = mapped_column(String(8))
    message: Mapped[str] = mapped_column(Text)
    type: Mapped[str] = mapped_column(String(16), default="message")
    data: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)


class JobMetric(Base):
    __tablename__ = "job_metrics"

    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True)
    step: Mapped[int] = mapped_column(Integer, primary_key=True)  # the primary key is the (job, step) index
    values: Mapped[dict[str, float]] = mapped_column(JSON)
    created_at: Mapped[int] = mapped_column(BigInteger, default=now)


class Checkpoint(Base):
    __tablename__ = "checkpoints"
    __table_args__ = (Index("ix_checkpoints_job_step", "job_id", "step_number", unique=True),)

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    step_number: Mapped[int] = mapped_column(Integer)
    metrics: Mapped[dict[str, float]] = mapped_column(JSON)
    storage_key: Mapped[str] = mapped_column(String(512))  # folder of the checkpoint in the artifact store
    created_at: Mapped[int] = mapped_column(BigInteger, default=now)


class Rollout(Base):
    __tablename__ = "rollouts"
    __table_args__ = (Index("ix_rollouts_job_step", "job_id", "step"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    step: Mapped[int] = mapped_column(Integer)
    data: Mapped[dict[str, Any]] = mapped_column(JSON)

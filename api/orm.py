"""Storage models (SQLAlchemy 2, typed). They never leave the service layer: API schemas are built from them."""

from __future__ import annotations

import time
from typing import Any

from sqlalchemy import JSON, BigInteger, Boolean, Dialect, Float, ForeignKey, Index, Integer, LargeBinary, String, Text
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
    # From `expires_after` at upload; the sweeper deletes the file once this unix time has passed.
    expires_at: Mapped[int | None] = mapped_column(BigInteger, nullable=True)


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
    # When the tenant deleted the fine-tuned model: the job still names it, but it no longer resolves.
    model_deleted_at: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
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


# -- webhooks: endpoints, the outbox of events, one delivery per (event, endpoint), its attempts ---------------------


class WebhookEndpoint(Base):
    __tablename__ = "webhook_endpoints"
    __table_args__ = (Index("ix_webhook_endpoints_tenant_created", "tenant_id", "created_at"),)

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    name: Mapped[str] = mapped_column(String(256))
    url: Mapped[str] = mapped_column(String(2048))
    event_types: Mapped[list[str]] = mapped_column(JSON)
    # Stored as it is, not hashed: every delivery is signed with it (api.webhook_events).
    secret: Mapped[str] = mapped_column(String(128))
    # The secret before a rotation that kept it valid a while, and until when (unix seconds).
    previous_secret: Mapped[str | None] = mapped_column(String(128), nullable=True)
    previous_secret_expires_at: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    created_at: Mapped[int] = mapped_column(BigInteger, default=now)
    updated_at: Mapped[int] = mapped_column(BigInteger, default=now)


class WebhookEvent(Base):
    """The outbox: written in the same transaction as the job's (or eval run's) status change, so no event is lost to a
    crash."""

    __tablename__ = "webhook_events"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    type: Mapped[str] = mapped_column(String(64))
    # What the event is about, its payload's ``data.id``: a job, an eval run, an endpoint (a test event).
    subject_type: Mapped[str] = mapped_column(String(32))
    subject_id: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[int] = mapped_column(BigInteger, default=now)


class WebhookDelivery(Base):
    """An event owed to one endpoint (subscribed when the event happened): ``pending`` until ``delivered`` or, past
    the retry horizon, ``failed``. ``next_attempt_at`` is when it is due (and, once claimed, the claim's expiry)."""

    __tablename__ = "webhook_deliveries"
    __table_args__ = (
        Index("ix_webhook_deliveries_event_endpoint", "event_id", "endpoint_id", unique=True),
        Index("ix_webhook_deliveries_due", "status", "next_attempt_at"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    event_id: Mapped[str] = mapped_column(ForeignKey("webhook_events.id", ondelete="CASCADE"))
    endpoint_id: Mapped[str] = mapped_column(ForeignKey("webhook_endpoints.id", ondelete="CASCADE"))
    status: Mapped[str] = mapped_column(String(16), default="pending")
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    next_attempt_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    created_at: Mapped[int] = mapped_column(BigInteger, default=now)
    finished_at: Mapped[int | None] = mapped_column(BigInteger, nullable=True)


class WebhookAttempt(Base):
    """One POST of a delivery: the endpoint's delivery log."""

    __tablename__ = "webhook_attempts"
    __table_args__ = (Index("ix_webhook_attempts_endpoint_seq", "endpoint_id", "seq"),)

    seq: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    id: Mapped[str] = mapped_column(String(64), unique=True)
    delivery_id: Mapped[int] = mapped_column(ForeignKey("webhook_deliveries.id", ondelete="CASCADE"))
    endpoint_id: Mapped[str] = mapped_column(ForeignKey("webhook_endpoints.id", ondelete="CASCADE"))
    attempt: Mapped[int] = mapped_column(Integer)
    created_at: Mapped[int] = mapped_column(BigInteger, default=now)
    duration_ms: Mapped[int] = mapped_column(Integer, default=0)
    status_code: Mapped[int | None] = mapped_column(Integer, nullable=True)
    error: Mapped[str | None] = mapped_column(Text, nullable=True)
    outcome: Mapped[str] = mapped_column(String(16))  # delivered | retrying | failed (given up)
    next_retry_at: Mapped[int | None] = mapped_column(BigInteger, nullable=True)


# -- the Tinker-compatible API: client sessions, training sessions (leased like jobs), their requests ------------------


class TinkerClientSession(Base):
    """The SDK's ``ServiceClient`` session: created once per client, kept alive by heartbeats, finished by
    ``close()``. It groups the training sessions and samplers the client made."""

    __tablename__ = "tinker_client_sessions"
    __table_args__ = (Index("ix_tinker_client_sessions_tenant_created", "tenant_id", "created_at"),)

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    tags: Mapped[list[str]] = mapped_column(JSON, default=list)
    user_metadata: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    sdk_version: Mapped[str | None] = mapped_column(String(64), nullable=True)
    created_at: Mapped[int] = mapped_column(BigInteger, default=now)
    last_heartbeat_at: Mapped[int] = mapped_column(BigInteger, default=now)
    finished_at: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    finish_reason: Mapped[str | None] = mapped_column(String(32), nullable=True)


class TrainingSession(Base):
    """A model held by one worker for many requests: a training session (``<client session>:train:<n>``, the SDK's
    model id) or a sampler of a base model or a saved adapter (``…:sample:<n>``). Leased like a job: one owner at a
    time, renewed while it serves; an expired lease makes it claimable, and the next owner continues from
    ``saved_state_key`` (the last state saved: after every optimiser step, at an idle unload, or an explicit save)."""

    __tablename__ = "training_sessions"
    __table_args__ = (
        Index("ix_training_sessions_tenant_created", "tenant_id", "created_at"),
        Index("ix_training_sessions_client", "client_session_id"),
    )

    id: Mapped[str] = mapped_column(String(160), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    client_session_id: Mapped[str] = mapped_column(ForeignKey("tinker_client_sessions.id", ondelete="CASCADE"))
    kind: Mapped[str] = mapped_column(String(16))  # training | sampling
    base_model: Mapped[str] = mapped_column(String(256))
    lora: Mapped[dict[str, Any]] = mapped_column(JSON)  # rank, seed, train_mlp, train_attn, train_unembed
    user_metadata: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    # What a worker loads before serving: a saved state (a folder in the artifact store), with or without its
    # optimiser state; none: a fresh adapter.
    saved_state_key: Mapped[str | None] = mapped_column(String(512), nullable=True)
    saved_state_optimizer: Mapped[bool] = mapped_column(Boolean, default=True)
    saved_steps: Mapped[int] = mapped_column(Integer, default=0)  # optimiser steps in the saved state
    optimizer_steps: Mapped[int] = mapped_column(Integer, default=0)
    next_seq_id: Mapped[int] = mapped_column(Integer, default=1)  # the SDK's per-model order: the next to run
    request_count: Mapped[int] = mapped_column(Integer, default=0)
    last_loss: Mapped[float | None] = mapped_column(Float, nullable=True)
    restores: Mapped[int] = mapped_column(Integer, default=0)  # times it continued from a saved state
    loaded_on: Mapped[str | None] = mapped_column(String(128), nullable=True)  # the worker holding it in memory
    lease_owner: Mapped[str | None] = mapped_column(String(128), nullable=True)
    lease_expires_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    created_at: Mapped[int] = mapped_column(BigInteger, default=now)
    last_request_at: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    closed_at: Mapped[int | None] = mapped_column(BigInteger, nullable=True)


class Sampler(Base):
    """The SDK's sampling session: which weights it samples (a training session's sampler snapshot, or the base
    model) and the training session that serves its requests."""

    __tablename__ = "tinker_samplers"
    __table_args__ = (Index("ix_tinker_samplers_serving", "serving_id"),)

    id: Mapped[str] = mapped_column(String(160), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    client_session_id: Mapped[str] = mapped_column(ForeignKey("tinker_client_sessions.id", ondelete="CASCADE"))
    serving_id: Mapped[str] = mapped_column(ForeignKey("training_sessions.id", ondelete="CASCADE"))
    base_model: Mapped[str] = mapped_column(String(256))
    model_path: Mapped[str | None] = mapped_column(String(512), nullable=True)  # tinker://…/sampler_weights/…
    weights_key: Mapped[str | None] = mapped_column(String(512), nullable=True)  # the adapter's store folder
    created_at: Mapped[int] = mapped_column(BigInteger, default=now)


class SessionRequest(Base):
    """One request of the protocol (a future): queued by the API, run in order by the worker that holds its
    session, its result (JSON or protobuf bytes) or error kept for the client's polls."""

    __tablename__ = "session_requests"
    __table_args__ = (
        Index("ix_session_requests_session_status", "session_id", "status", "seq"),
        Index("ix_session_requests_dedupe", "dedupe_key", unique=True),
    )

    seq: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    id: Mapped[str] = mapped_column(String(64), unique=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    session_id: Mapped[str] = mapped_column(ForeignKey("training_sessions.id", ondelete="CASCADE"))
    sampler_id: Mapped[str | None] = mapped_column(String(160), nullable=True)
    kind: Mapped[str] = mapped_column(String(32))
    seq_id: Mapped[int | None] = mapped_column(Integer, nullable=True)  # the SDK's order (training requests)
    dedupe_key: Mapped[str] = mapped_column(String(256))  # a resent request is the same request
    payload: Mapped[bytes] = mapped_column(LargeBinary)
    status: Mapped[str] = mapped_column(String(16), default="pending")  # pending | running | done | failed
    result: Mapped[bytes | None] = mapped_column(LargeBinary, nullable=True)
    result_format: Mapped[str | None] = mapped_column(String(8), nullable=True)  # json | proto
    error: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)  # {"error", "category"}
    loss: Mapped[float | None] = mapped_column(Float, nullable=True)
    created_at: Mapped[float] = mapped_column(Float)
    finished_at: Mapped[float | None] = mapped_column(Float, nullable=True)


class SessionCheckpoint(Base):
    """A saved state, sampler weights or exported weights of a training session (``tinker://<id>/<kind>/<name>``)."""

    __tablename__ = "session_checkpoints"
    __table_args__ = (Index("ix_session_checkpoints_path", "session_id", "kind", "name", unique=True),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    session_id: Mapped[str] = mapped_column(ForeignKey("training_sessions.id", ondelete="CASCADE"))
    kind: Mapped[str] = mapped_column(String(24))  # weights | sampler_weights | external_weights
    name: Mapped[str] = mapped_column(String(256))
    storage_key: Mapped[str] = mapped_column(String(512))
    size_bytes: Mapped[int] = mapped_column(BigInteger, default=0)
    optimizer_steps: Mapped[int] = mapped_column(Integer, default=0)
    created_at: Mapped[int] = mapped_column(BigInteger, default=now)
    expires_at: Mapped[int | None] = mapped_column(BigInteger, nullable=True)  # None: kept until deleted
    # Exported weights (``external_weights``) are fetched by a plain GET of ``/api/v1/weights/<token>/<file>``, as
    # the SDK's download does: the token is the capability, valid until ``expires_at``.
    download_token: Mapped[str | None] = mapped_column(String(64), nullable=True, unique=True)


# -- evals: OpenAI's Evals API (an eval's criteria, its runs leased like jobs, each run's graded items) --------------


class Eval(Base):
    __tablename__ = "evals"
    __table_args__ = (Index("ix_evals_tenant_created", "tenant_id", "created_at"),)

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    name: Mapped[str] = mapped_column(String(256))
    data_source_config: Mapped[dict[str, Any]] = mapped_column(JSON)  # {type: custom, item_schema, include_sample…}
    testing_criteria: Mapped[list[dict[str, Any]]] = mapped_column(JSON)  # validated graders + pass rules
    metadata_: Mapped[dict[str, str] | None] = mapped_column("metadata", JSON, nullable=True)
    created_at: Mapped[int] = mapped_column(BigInteger, default=now)
    updated_at: Mapped[int] = mapped_column(BigInteger, default=now)


class EvalRun(Base):
    """A run: claimed by one worker at a time with a lease it renews; an expired lease makes it claimable again, and
    the next owner goes on after the output items already written."""

    __tablename__ = "eval_runs"
    __table_args__ = (
        Index("ix_eval_runs_eval_created", "eval_id", "created_at"),
        Index("ix_eval_runs_status", "status"),
    )

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    eval_id: Mapped[str] = mapped_column(ForeignKey("evals.id", ondelete="CASCADE"))
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    name: Mapped[str] = mapped_column(String(256))
    status: Mapped[str] = mapped_column(String(16))  # api.status.EvalRunStatus
    data_source: Mapped[dict[str, Any]] = mapped_column(JSON)  # as validated (inline content included)
    model: Mapped[str | None] = mapped_column(String(512), nullable=True)
    metadata_: Mapped[dict[str, str] | None] = mapped_column("metadata", JSON, nullable=True)
    error: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    result_counts: Mapped[dict[str, int] | None] = mapped_column(JSON, nullable=True)
    per_testing_criteria_results: Mapped[list[dict[str, Any]] | None] = mapped_column(JSON, nullable=True)
    per_model_usage: Mapped[list[dict[str, Any]] | None] = mapped_column(JSON, nullable=True)
    created_at: Mapped[int] = mapped_column(BigInteger, default=now)
    started_at: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    finished_at: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    lease_owner: Mapped[str | None] = mapped_column(String(128), nullable=True)
    lease_expires_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    cancel_requested: Mapped[bool] = mapped_column(Boolean, default=False)
    enqueued_at: Mapped[float | None] = mapped_column(Float, nullable=True)


class EvalOutputItem(Base):
    """One data source item of a run, sampled (a completions run) and graded by every criterion."""

    __tablename__ = "eval_output_items"
    __table_args__ = (Index("ix_eval_output_items_run_item", "run_id", "datasource_item_id", unique=True),)

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    run_id: Mapped[str] = mapped_column(ForeignKey("eval_runs.id", ondelete="CASCADE"))
    eval_id: Mapped[str] = mapped_column(String(64))
    datasource_item_id: Mapped[int] = mapped_column(Integer)  # the item's index in the data source
    datasource_item: Mapped[dict[str, Any]] = mapped_column(JSON)
    sample: Mapped[dict[str, Any]] = mapped_column(JSON)  # {} for a jsonl row without one: never JSON null
    results: Mapped[list[dict[str, Any]]] = mapped_column(JSON)
    status: Mapped[str] = mapped_column(String(8))  # pass | fail
    errored: Mapped[bool] = mapped_column(Boolean, default=False)  # the sample or a criterion produced no score
    created_at: Mapped[int] = mapped_column(BigInteger, default=now)

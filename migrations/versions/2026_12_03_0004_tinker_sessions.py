"""tinker sessions: client sessions, training sessions leased like jobs, samplers, requests, checkpoints

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-03 07:36:44.575769
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:

    op.create_table(
        "tinker_client_sessions",
        sa.Column("id", sa.String(length=64), nullable=False),
        sa.Column("tenant_id", sa.String(length=64), nullable=False),
        sa.Column("tags", sa.JSON(), nullable=False),
        sa.Column("user_metadata", sa.JSON(), nullable=True),
        sa.Column("sdk_version", sa.String(length=64), nullable=True),
        sa.Column("created_at", sa.BigInteger(), nullable=False),
        sa.Column("last_heartbeat_at", sa.BigInteger(), nullable=False),
        sa.Column("finished_at", sa.BigInteger(), nullable=True),
        sa.Column("finish_reason", sa.String(length=32), nullable=True),
        sa.ForeignKeyConstraint(["tenant_id"], ["tenants.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
    )
    with op.batch_alter_table("tinker_client_sessions", schema=None) as batch_op:
        batch_op.create_index("ix_tinker_client_sessions_tenant_created", ["tenant_id", "created_at"], unique=False)

    op.create_table(
        "training_sessions",
        sa.Column("id", sa.String(length=160), nullable=False),
        sa.Column("tenant_id", sa.String(length=64), nullable=False),
        sa.Column("client_session_id", sa.String(length=64), nullable=False),
        sa.Column("kind", sa.String(length=16), nullable=False),
        sa.Column("base_model", sa.String(length=256), nullable=False),
        sa.Column("lora", sa.JSON(), nullable=False),
        sa.Column("user_metadata", sa.JSON(), nullable=True),
        sa.Column("saved_state_key", sa.String(length=512), nullable=True),
        sa.Column("saved_state_optimizer", sa.Boolean(), nullable=False),
        sa.Column("saved_steps", sa.Integer(), nullable=False),
        sa.Column("optimizer_steps", sa.Integer(), nullable=False),
        sa.Column("next_seq_id", sa.Integer(), nullable=False),
        sa.Column("request_count", sa.Integer(), nullable=False),
        sa.Column("last_loss", sa.Float(), nullable=True),
        sa.Column("restores", sa.Integer(), nullable=False),
        sa.Column("loaded_on", sa.String(length=128), nullable=True),
        sa.Column("lease_owner", sa.String(length=128), nullable=True),
        sa.Column("lease_expires_at", sa.Float(), nullable=True),
        sa.Column("created_at", sa.BigInteger(), nullable=False),
        sa.Column("last_request_at", sa.BigInteger(), nullable=True),
        sa.Column("closed_at", sa.BigInteger(), nullable=True),
        sa.ForeignKeyConstraint(["client_session_id"], ["tinker_client_sessions.id"], ondelete="CASCADE"),
        sa.ForeignKeyConstraint(["tenant_id"], ["tenants.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
    )
    with op.batch_alter_table("training_sessions", schema=None) as batch_op:
        batch_op.create_index("ix_training_sessions_client", ["client_session_id"], unique=False)
        batch_op.create_index("ix_training_sessions_tenant_created", ["tenant_id", "created_at"], unique=False)

    op.create_table(
        "session_checkpoints",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("tenant_id", sa.String(length=64), nullable=False),
        sa.Column("session_id", sa.String(length=160), nullable=False),
        sa.Column("kind", sa.String(length=24), nullable=False),
        sa.Column("name", sa.String(length=256), nullable=False),
        sa.Column("storage_key", sa.String(length=512), nullable=False),
        sa.Column("size_bytes", sa.BigInteger(), nullable=False),
        sa.Column("optimizer_steps", sa.Integer(), nullable=False),
        sa.Column("created_at", sa.BigInteger(), nullable=False),
        sa.Column("expires_at", sa.BigInteger(), nullable=True),
        sa.Column("download_token", sa.String(length=64), nullable=True),
        sa.ForeignKeyConstraint(["session_id"], ["training_sessions.id"], ondelete="CASCADE"),
        sa.ForeignKeyConstraint(["tenant_id"], ["tenants.id"], ondelete="CASCADE"),
        sa.UniqueConstraint("download_token"),
        sa.PrimaryKeyConstraint("id"),
    )
    with op.batch_alter_table("session_checkpoints", schema=None) as batch_op:
        batch_op.create_index("ix_session_checkpoints_path", ["session_id", "kind", "name"], unique=True)

    op.create_table(
        "session_requests",
        sa.Column("seq", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("id", sa.String(length=64), nullable=False),
        sa.Column("tenant_id", sa.String(length=64), nullable=False),
        sa.Column("session_id", sa.String(length=160), nullable=False),
        sa.Column("sampler_id", sa.String(length=160), nullable=True),
        sa.Column("kind", sa.String(length=32), nullable=False),
        sa.Column("seq_id", sa.Integer(), nullable=True),
        sa.Column("dedupe_key", sa.String(length=256), nullable=False),
        sa.Column("payload", sa.LargeBinary(), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("result", sa.LargeBinary(), nullable=True),
        sa.Column("result_format", sa.String(length=8), nullable=True),
        sa.Column("error", sa.JSON(), nullable=True),
        sa.Column("loss", sa.Float(), nullable=True),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.Column("finished_at", sa.Float(), nullable=True),
        sa.ForeignKeyConstraint(["session_id"], ["training_sessions.id"], ondelete="CASCADE"),
        sa.ForeignKeyConstraint(["tenant_id"], ["tenants.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("seq"),
        sa.UniqueConstraint("id"),
    )
    with op.batch_alter_table("session_requests", schema=None) as batch_op:
        batch_op.create_index("ix_session_requests_dedupe", ["dedupe_key"], unique=True)
        batch_op.create_index("ix_session_requests_session_status", ["session_id", "status", "seq"], unique=False)

    op.create_table(
        "tinker_samplers",
        sa.Column("id", sa.String(length=160), nullable=False),
        sa.Column("tenant_id", sa.String(length=64), nullable=False),
        sa.Column("client_session_id", sa.String(length=64), nullable=False),
        sa.Column("serving_id", sa.String(length=160), nullable=False),
        sa.Column("base_model", sa.String(length=256), nullable=False),
        sa.Column("model_path", sa.String(length=512), nullable=True),
        sa.Column("weights_key", sa.String(length=512), nullable=True),
        sa.Column("created_at", sa.BigInteger(), nullable=False),
        sa.ForeignKeyConstraint(["client_session_id"], ["tinker_client_sessions.id"], ondelete="CASCADE"),
        sa.ForeignKeyConstraint(["serving_id"], ["training_sessions.id"], ondelete="CASCADE"),
        sa.ForeignKeyConstraint(["tenant_id"], ["tenants.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
    )
    with op.batch_alter_table("tinker_samplers", schema=None) as batch_op:
        batch_op.create_index("ix_tinker_samplers_serving", ["serving_id"], unique=False)


def downgrade() -> None:

    with op.batch_alter_table("tinker_samplers", schema=None) as batch_op:
        batch_op.drop_index("ix_tinker_samplers_serving")

    op.drop_table("tinker_samplers")
    with op.batch_alter_table("session_requests", schema=None) as batch_op:
        batch_op.drop_index("ix_session_requests_session_status")
        batch_op.drop_index("ix_session_requests_dedupe")

    op.drop_table("session_requests")
    with op.batch_alter_table("session_checkpoints", schema=None) as batch_op:
        batch_op.drop_index("ix_session_checkpoints_path")

    op.drop_table("session_checkpoints")
    with op.batch_alter_table("training_sessions", schema=None) as batch_op:
        batch_op.drop_index("ix_training_sessions_tenant_created")
        batch_op.drop_index("ix_training_sessions_client")

    op.drop_table("training_sessions")
    with op.batch_alter_table("tinker_client_sessions", schema=None) as batch_op:
        batch_op.drop_index("ix_tinker_client_sessions_tenant_created")

    op.drop_table("tinker_client_sessions")

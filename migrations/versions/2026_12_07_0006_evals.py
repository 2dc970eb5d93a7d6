"""evals: evals, eval_runs (leased like jobs), eval_output_items; webhook events about any subject

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-07 23:05:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    _create_evals()
    _create_runs()
    _create_items()
    _webhook_subjects()


def _create_evals() -> None:
    op.create_table(
        "evals",
        sa.Column("id", sa.String(length=64), nullable=False),
        sa.Column("tenant_id", sa.String(length=64), nullable=False),
        sa.Column("name", sa.String(length=256), nullable=False),
        sa.Column("data_source_config", sa.JSON(), nullable=False),
        sa.Column("testing_criteria", sa.JSON(), nullable=False),
        sa.Column("metadata", sa.JSON(), nullable=True),
        sa.Column("created_at", sa.BigInteger(), nullable=False),
        sa.Column("updated_at", sa.BigInteger(), nullable=False),
        sa.ForeignKeyConstraint(["tenant_id"], ["tenants.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
    )
    with op.batch_alter_table("evals", schema=None) as batch_op:
        batch_op.create_index("ix_evals_tenant_created", ["tenant_id", "created_at"], unique=False)


def _create_runs() -> None:
    op.create_table(
        "eval_runs",
        sa.Column("id", sa.String(length=64), nullable=False),
        sa.Column("eval_id", sa.String(length=64), nullable=False),
        sa.Column("tenant_id", sa.String(length=64), nullable=False),
        sa.Column("name", sa.String(length=256), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("data_source", sa.JSON(), nullable=False),
        sa.Column("model", sa.String(length=512), nullable=True),
        sa.Column("metadata", sa.JSON(), nullable=True),
        sa.Column("error", sa.JSON(), nullable=True),
        sa.Column("result_counts", sa.JSON(), nullable=True),
        sa.Column("per_testing_criteria_results", sa.JSON(), nullable=True),
        sa.Column("per_model_usage", sa.JSON(), nullable=True),
        sa.Column("created_at", sa.BigInteger(), nullable=False),
        sa.Column("started_at", sa.BigInteger(), nullable=True),
        sa.Column("finished_at", sa.BigInteger(), nullable=True),
        sa.Column("lease_owner", sa.String(length=128), nullable=True),
        sa.Column("lease_expires_at", sa.Float(), nullable=True),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("cancel_requested", sa.Boolean(), nullable=False),
        sa.Column("enqueued_at", sa.Float(), nullable=True),
        sa.ForeignKeyConstraint(["eval_id"], ["evals.id"], ondelete="CASCADE"),
        sa.ForeignKeyConstraint(["tenant_id"], ["tenants.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
    )
    with op.batch_alter_table("eval_runs", schema=None) as batch_op:
        batch_op.create_index("ix_eval_runs_eval_created", ["eval_id", "created_at"], unique=False)
        batch_op.create_index("ix_eval_runs_status", ["status"], unique=False)


def _create_items() -> None:
    op.create_table(
        "eval_output_items",
        sa.Column("id", sa.String(length=64), nullable=False),
        sa.Column("run_id", sa.String(length=64), nullable=False),
        sa.Column("eval_id", sa.String(length=64), nullable=False),
        sa.Column("datasource_item_id", sa.Integer(), nullable=False),
        sa.Column("datasource_item", sa.JSON(), nullable=False),
        sa.Column("sample", sa.JSON(), nullable=False),
        sa.Column("results", sa.JSON(), nullable=False),
        sa.Column("status", sa.String(length=8), nullable=False),
        sa.Column("errored", sa.Boolean(), nullable=False),
        sa.Column("created_at", sa.BigInteger(), nullable=False),
        sa.ForeignKeyConstraint(["run_id"], ["eval_runs.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
    )
    with op.batch_alter_table("eval_output_items", schema=None) as batch_op:
        batch_op.create_index("ix_eval_output_items_run_item", ["run_id", "datasource_item_id"], unique=True)


def _webhook_subjects() -> None:
    # Webhook events were about jobs only: each now names its subject (a job's existing events keep theirs).
    with op.batch_alter_table("webhook_events", schema=None) as batch_op:
        batch_op.alter_column("job_id", new_column_name="subject_id", existing_type=sa.String(length=64))
        batch_op.add_column(
            sa.Column("subject_type", sa.String(length=32), nullable=False, server_default="fine_tuning.job")
        )
    with op.batch_alter_table("webhook_events", schema=None) as batch_op:
        batch_op.alter_column("subject_type", server_default=None, existing_type=sa.String(length=32))


def downgrade() -> None:
    # Events about anything but a job cannot be told apart from a job's once the subject's type is gone.
    op.execute("DELETE FROM webhook_events WHERE subject_type != 'fine_tuning.job'")
    with op.batch_alter_table("webhook_events", schema=None) as batch_op:
        batch_op.drop_column("subject_type")
        batch_op.alter_column("subject_id", new_column_name="job_id", existing_type=sa.String(length=64))
    with op.batch_alter_table("eval_output_items", schema=None) as batch_op:
        batch_op.drop_index("ix_eval_output_items_run_item")
    op.drop_table("eval_output_items")
    with op.batch_alter_table("eval_runs", schema=None) as batch_op:
        batch_op.drop_index("ix_eval_runs_status")
        batch_op.drop_index("ix_eval_runs_eval_created")
    op.drop_table("eval_runs")
    with op.batch_alter_table("evals", schema=None) as batch_op:
        batch_op.drop_index("ix_evals_tenant_created")
    op.drop_table("evals")

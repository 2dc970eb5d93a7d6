"""file expiry and model deletion: files.expires_at, jobs.model_deleted_at; RL specs' eval_samples → eval_prompts

The online RL methods' ``eval_samples`` now has OpenAI's meaning (completions per validation prompt); what it meant
before (the first N validation prompts) is ``eval_prompts``. A stored spec is read back by the new code, so its value
moves to the field that keeps its meaning. Downgrade moves it back, and stores a ``reinforcement`` job as the
``grpo`` job the earlier code made of it (the same recipe and hyperparameters).

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-07 22:55:00.000000
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


# The methods as they are named at this revision (a migration does not import the code that changes later).
RL_METHODS = ("grpo", "reinforcement", "dr_grpo", "dapo", "rloo", "reinforce", "ppo")

_jobs = sa.table("jobs", sa.column("id", sa.String), sa.column("spec", sa.JSON))


def eval_samples_to_prompts(spec: dict[str, Any]) -> dict[str, Any]:
    """An online RL spec's ``eval_samples`` (the first N prompts) as ``eval_prompts``; other specs unchanged."""
    method = spec.get("method", {})
    hp = method.get(method.get("type"), {}).get("hyperparameters")
    if method.get("type") not in RL_METHODS or not isinstance(hp, dict) or "eval_prompts" in hp:
        return spec
    hp["eval_prompts"] = hp.pop("eval_samples", None)
    hp["eval_samples"] = None
    return spec


def eval_prompts_to_samples(spec: dict[str, Any]) -> dict[str, Any]:
    """The reverse, for the code before this revision: ``eval_prompts`` back to ``eval_samples`` (completions per
    prompt are dropped: that code sampled one), ``reinforcement`` as ``grpo``."""
    method = spec.get("method", {})
    if method.get("type") == "reinforcement":
        method["type"] = "grpo"
        method["grpo"] = method.pop("reinforcement", {})
    hp = method.get(method.get("type"), {}).get("hyperparameters")
    if isinstance(hp, dict) and "eval_prompts" in hp:
        hp["eval_samples"] = hp.pop("eval_prompts")
    return spec


def _rewrite_specs(change: Callable[[dict[str, Any]], dict[str, Any]]) -> None:
    conn = op.get_bind()
    for job_id, spec in conn.execute(sa.select(_jobs.c.id, _jobs.c.spec)).all():
        new = change(json.loads(json.dumps(spec)))  # a copy: the row's value is compared to it
        if new != spec:
            conn.execute(_jobs.update().where(_jobs.c.id == job_id).values(spec=new))


def upgrade() -> None:
    with op.batch_alter_table("files", schema=None) as batch_op:
        batch_op.add_column(sa.Column("expires_at", sa.BigInteger(), nullable=True))
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.add_column(sa.Column("model_deleted_at", sa.BigInteger(), nullable=True))
    _rewrite_specs(eval_samples_to_prompts)


def downgrade() -> None:
    _rewrite_specs(eval_prompts_to_samples)
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.drop_column("model_deleted_at")
    with op.batch_alter_table("files", schema=None) as batch_op:
        batch_op.drop_column("expires_at")

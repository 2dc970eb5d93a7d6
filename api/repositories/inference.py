"""SQL of model resolution for chat and text completions: which job, final adapter and checkpoint a model name
means, for one tenant. Plain reads on a connection (``api.db.read``): no transaction is held while the request is
then forwarded to the inference server."""

from __future__ import annotations

from sqlalchemy import Connection, Row, case, select

from api.orm import Checkpoint, File, Job
from api.status import JobStatus

ADAPTER_SUFFIX = "-adapter.tar.gz"
"""The file name ending of a job's final adapter among its result files (``worker.tasks``)."""


JobNames = Row[str, str, str, str | None, JobStatus, str | None, list[str]]
"""(id, tenant_id, model, suffix, status, fine_tuned_model, result_files) of a job."""
CheckpointKey = Row[str, str]
"""(id, storage_key) of a checkpoint."""


def job(conn: Connection, *, tenant_id: str, job_id: str) -> JobNames | None:
    """The columns that name the tenant's job's models: id, tenant_id, model, suffix, status, fine_tuned_model,
    result_files. ``fine_tuned_model`` is None once the tenant deleted the model (``DELETE /v1/models/{model}``): it
    no longer resolves, while the job's checkpoints still do."""
    live_model = case((Job.model_deleted_at.is_(None), Job.fine_tuned_model), else_=None).label("fine_tuned_model")
    stmt = select(Job.id, Job.tenant_id, Job.model, Job.suffix, Job.status, live_model, Job.result_files).where(
        Job.id == job_id, Job.tenant_id == tenant_id
    )
    return conn.execute(stmt).one_or_none()


def final_adapter_key(conn: Connection, *, tenant_id: str, file_ids: list[str]) -> str | None:
    """The storage key of the final adapter archive among a job's result files (None when it was deleted)."""
    if not file_ids:
        return None
    stmt = (
        select(File.storage_key)
        .where(
            File.id.in_(file_ids),
            File.tenant_id == tenant_id,
            File.deleted.is_(False),
            File.filename.endswith(ADAPTER_SUFFIX, autoescape=True),
        )
        .limit(1)
    )
    key = conn.execute(stmt).scalar_one_or_none()
    return None if key is None else str(key)


def checkpoint_created_at(conn: Connection, *, checkpoint_id: str) -> int | None:
    """When the checkpoint was made (its model object's ``created``)."""
    created = conn.execute(select(Checkpoint.created_at).where(Checkpoint.id == checkpoint_id)).scalar_one_or_none()
    return None if created is None else int(created)


def checkpoint(conn: Connection, *, job_id: str, step: int) -> CheckpointKey | None:
    """The id and storage key (a folder) of the job's checkpoint at ``step``."""
    stmt = select(Checkpoint.id, Checkpoint.storage_key).where(
        Checkpoint.job_id == job_id, Checkpoint.step_number == step
    )
    return conn.execute(stmt).one_or_none()

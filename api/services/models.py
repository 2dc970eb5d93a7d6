"""``/v1/models``: the base models this deployment offers, the tenant's fine-tuned models and their checkpoints;
deleting a fine-tuned model.

A checkpoint (``ft:…:ckpt-step-N``, as the job's checkpoint list names it) is not listed, as with OpenAI, but it is
retrieved while chat completions serve it: both resolve the name the same way (``api.services.inference.resolve``).
A deleted model is neither listed, retrieved nor served; its job still names it in ``fine_tuned_model``.
"""

from __future__ import annotations

from sqlalchemy.orm import Session

from api.auth import Caller
from api.errors import Forbidden, ModelNotFound, NotFound
from api.repositories import inference as inference_repo
from api.repositories import jobs as jobs_repo
from api.schemas import ModelDeleted, ModelObject
from api.services import inference
from api.settings import Settings
from api.status import JobStatus

OWNER = "proxima"


def list_models(*, session: Session, settings: Settings, tenant: Caller) -> list[ModelObject]:
    base = [ModelObject(id=name, created=0, owned_by=OWNER) for name in settings.base_models]
    tuned = [
        ModelObject(id=name, created=created, owned_by=tenant.id)
        for name, created in jobs_repo.succeeded_models(session, tenant_id=tenant.id)
    ]
    return base + tuned


def _checkpoint_model(*, session: Session, settings: Settings, tenant: Caller, model_id: str) -> ModelObject | None:
    """The model object of one of the tenant's checkpoints that chat completions would serve, else None."""
    conn = session.connection()
    try:
        target = inference.resolve(conn, settings=settings, tenant=tenant, model=model_id)
    except ModelNotFound:
        return None
    if target.adapter is None:
        return None
    created = inference_repo.checkpoint_created_at(conn, checkpoint_id=target.served)
    if created is None:  # the final adapter of a job: listed already, or not the tenant's to see
        return None
    return ModelObject(id=model_id, created=created, owned_by=tenant.id)


def get_model(*, session: Session, settings: Settings, tenant: Caller, model_id: str) -> ModelObject:
    for model in list_models(session=session, settings=settings, tenant=tenant):
        if model.id == model_id:
            return model
    found = _checkpoint_model(session=session, settings=settings, tenant=tenant, model_id=model_id)
    if found is None:
        raise NotFound("model", model_id, param="model")
    return found


def delete_model(*, session: Session, settings: Settings, tenant: Caller, model_id: str) -> ModelDeleted:
    """Delete one of the tenant's fine-tuned models: recorded on its job, after which the name is 404 for retrieval,
    chat completions and a new job's grader. A base model or a checkpoint is a 403 (only a fine-tuned model can be
    deleted); another tenant's model, or one already deleted, is a 404, as OpenAI tells neither apart from none."""
    if model_id in settings.base_models:
        raise Forbidden(
            f"model {model_id!r} is a base model: only a fine-tuned model can be deleted",
            param="model",
            code="model_not_deletable",
        )
    job = jobs_repo.get_by_model(session, tenant_id=tenant.id, fine_tuned_model=model_id)
    if job is None or job.status != JobStatus.SUCCEEDED or job.model_deleted_at is not None:
        if _checkpoint_model(session=session, settings=settings, tenant=tenant, model_id=model_id) is not None:
            raise Forbidden(
                f"model {model_id!r} is a checkpoint: only a job's fine-tuned model can be deleted",
                param="model",
                code="model_not_deletable",
            )
        raise NotFound("model", model_id, param="model")
    jobs_repo.mark_model_deleted(session, job=job)
    return ModelDeleted(id=model_id, deleted=True)

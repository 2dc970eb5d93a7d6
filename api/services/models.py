"""``GET /v1/models``: the base models this deployment offers and the tenant's fine-tuned models."""

from __future__ import annotations

from sqlalchemy.orm import Session

from api.auth import Caller
from api.errors import NotFound
from api.repositories import jobs as jobs_repo
from api.schemas import ModelObject
from api.settings import Settings

OWNER = "proxima"


def list_models(*, session: Session, settings: Settings, tenant: Caller) -> list[ModelObject]:
    base = [ModelObject(id=name, created=0, owned_by=OWNER) for name in settings.base_models]
    tuned = [
        ModelObject(id=name, created=created, owned_by=tenant.id)
        for name, created in jobs_repo.succeeded_models(session, tenant_id=tenant.id)
    ]
    return base + tuned


def get_model(*, session: Session, settings: Settings, tenant: Caller, model_id: str) -> ModelObject:
    for model in list_models(session=session, settings=settings, tenant=tenant):
        if model.id == model_id:
            return model
    raise NotFound("model", model_id, param="model")

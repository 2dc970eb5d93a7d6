"""``/v1/models``: base models offered and the tenant's fine-tuned models."""

from __future__ import annotations

from fastapi import APIRouter

from api.deps import SessionDep, SettingsDep, TenantDep
from api.schemas import ListObject, ModelObject
from api.services import models as models_service

router = APIRouter(prefix="/v1/models", tags=["models"])


@router.get("", response_model=ListObject[ModelObject], summary="List models")
def list_models(session: SessionDep, settings: SettingsDep, tenant: TenantDep) -> ListObject[ModelObject]:
    return ListObject[ModelObject](data=models_service.list_models(session=session, settings=settings, tenant=tenant))


@router.get("/{model_id}", response_model=ModelObject, summary="Retrieve a model")
def retrieve_model(model_id: str, session: SessionDep, settings: SettingsDep, tenant: TenantDep) -> ModelObject:
    return models_service.get_model(session=session, settings=settings, tenant=tenant, model_id=model_id)

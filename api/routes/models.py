"""``/v1/models``: base models offered, the tenant's fine-tuned models and checkpoints; deleting a fine-tuned model."""

from __future__ import annotations

from fastapi import APIRouter

from api.deps import SessionDep, SettingsDep, TenantDep
from api.errors import responses
from api.schemas import ListObject, ModelDeleted, ModelObject
from api.services import models as models_service

router = APIRouter(prefix="/v1/models", tags=["models"])


@router.get("", response_model=ListObject[ModelObject], summary="List models")
def list_models(session: SessionDep, settings: SettingsDep, tenant: TenantDep) -> ListObject[ModelObject]:
    return ListObject[ModelObject](data=models_service.list_models(session=session, settings=settings, tenant=tenant))


@router.get("/{model_id}", response_model=ModelObject, responses=responses(404), summary="Retrieve a model")
def retrieve_model(model_id: str, session: SessionDep, settings: SettingsDep, tenant: TenantDep) -> ModelObject:
    return models_service.get_model(session=session, settings=settings, tenant=tenant, model_id=model_id)


@router.delete(
    "/{model_id}",
    response_model=ModelDeleted,
    responses=responses(403, 404),
    summary="Delete a fine-tuned model",
)
def delete_model(model_id: str, session: SessionDep, settings: SettingsDep, tenant: TenantDep) -> ModelDeleted:
    return models_service.delete_model(session=session, settings=settings, tenant=tenant, model_id=model_id)

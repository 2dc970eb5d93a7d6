"""``/v1/training_sessions``: the tenant's Tinker training sessions as the dashboard lists them: request
counts, the last loss, optimiser steps, where each is loaded, and its saved states."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query

from api.deps import SessionDep, TenantDep
from api.routes.files import AfterCursor
from api.schemas import ListObject
from api.schemas_tinker import TrainingSessionObject
from api.services import tinker as tinker_service

router = APIRouter(prefix="/v1/training_sessions", tags=["training sessions"])

Limit = Annotated[int, Query(ge=1, le=tinker_service.MAX_LIST_LIMIT)]
RECENT_REQUESTS = 50


@router.get("", response_model=ListObject[TrainingSessionObject], summary="List Tinker training sessions")
def list_training_sessions(
    session: SessionDep, tenant: TenantDep, after: AfterCursor = None, limit: Limit = 20
) -> ListObject[TrainingSessionObject]:
    rows, has_more = tinker_service.page(session, tenant=tenant, after=after, limit=limit)
    data = [TrainingSessionObject.from_row(r, c) for r, c in rows]
    return ListObject[TrainingSessionObject](data=data, has_more=has_more)


@router.get("/{session_id}", response_model=TrainingSessionObject, summary="Retrieve a Tinker training session")
def retrieve_training_session(session_id: str, session: SessionDep, tenant: TenantDep) -> TrainingSessionObject:
    row, checkpoints, requests = tinker_service.detail(
        session, tenant=tenant, session_id=session_id, recent=RECENT_REQUESTS
    )
    return TrainingSessionObject.from_row(row, checkpoints, requests)

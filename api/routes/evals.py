"""``/v1/evals``: OpenAI's Evals API (``client.evals``, ``client.evals.runs``, ``client.evals.runs.output_items``).

Creating an eval checks its criteria as job creation checks a grader (python sources in a sandbox, remote graders'
URLs resolved): those routes are plain ``def``, a thread of their own. Runs are executed by the workers
(``proxima.evals.run``); a run is canceled by ``POST …/runs/{run_id}`` (OpenAI's documented path) or
``POST …/runs/{run_id}/cancel`` (the path its Python client calls)."""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Depends, Query, Request

from api.deps import SessionDep, SettingsDep, TenantDep
from api.errors import responses
from api.orm import Eval
from api.routes.files import AfterCursor
from api.schemas import CursorListObject, cursor_list
from api.schemas_evals import (
    EvalCreate,
    EvalDeleted,
    EvalObject,
    EvalRunDeleted,
    EvalRunObject,
    EvalUpdate,
    OutputItemObject,
    RunCreate,
)
from api.services import evals as evals_service
from api.status import EvalRunStatus

router = APIRouter(prefix="/v1/evals", tags=["evals"])

Limit = Annotated[int, Query(ge=1, le=evals_service.MAX_LIST_LIMIT)]
OrderQuery = Annotated[Literal["asc", "desc"], Query(description="by creation time (output items: data source order)")]
RunStatusQuery = Annotated[EvalRunStatus | None, Query()]
ItemStatusQuery = Annotated[Literal["pass", "fail"] | None, Query()]


def _base_url(request: Request) -> str:
    return str(request.base_url)


BaseUrl = Annotated[str, Depends(_base_url)]
"""This API's address as the caller reached it: a run's report_url is absolute, as OpenAI's is."""


def _eval(row: Eval) -> EvalObject:
    return EvalObject.from_row(
        row,
        data_source_config=evals_service.data_source_config_view(row.data_source_config),
        criteria=[evals_service.criterion_view(c) for c in row.testing_criteria],
    )


@router.post("", response_model=EvalObject, summary="Create an eval")
def create_eval(body: EvalCreate, session: SessionDep, settings: SettingsDep, tenant: TenantDep) -> EvalObject:
    return _eval(evals_service.create(session=session, settings=settings, tenant=tenant, body=body))


@router.get("", response_model=CursorListObject[EvalObject], summary="List evals")
def list_evals(
    session: SessionDep,
    tenant: TenantDep,
    after: AfterCursor = None,
    limit: Limit = evals_service.DEFAULT_LIST_LIMIT,
    order: OrderQuery = "asc",
    order_by: Annotated[Literal["created_at", "updated_at"], Query()] = "created_at",
) -> CursorListObject[EvalObject]:
    rows, has_more = evals_service.page(
        session=session, tenant=tenant, after=after, limit=limit, order=order, order_by=order_by
    )
    return CursorListObject[EvalObject](**cursor_list([_eval(r) for r in rows], has_more=has_more))


@router.get("/{eval_id}", response_model=EvalObject, summary="Retrieve an eval")
def retrieve_eval(eval_id: str, session: SessionDep, tenant: TenantDep) -> EvalObject:
    return _eval(evals_service.get(session=session, tenant=tenant, eval_id=eval_id))


@router.post("/{eval_id}", response_model=EvalObject, summary="Update an eval's name and metadata")
def update_eval(eval_id: str, body: EvalUpdate, session: SessionDep, tenant: TenantDep) -> EvalObject:
    return _eval(evals_service.update(session=session, tenant=tenant, eval_id=eval_id, body=body))


@router.delete("/{eval_id}", response_model=EvalDeleted, summary="Delete an eval, its runs and their items")
def delete_eval(eval_id: str, session: SessionDep, tenant: TenantDep) -> EvalDeleted:
    return EvalDeleted(eval_id=evals_service.delete(session=session, tenant=tenant, eval_id=eval_id))


@router.post("/{eval_id}/runs", response_model=EvalRunObject, summary="Create a run (queued for a worker)")
def create_run(
    eval_id: str, body: RunCreate, session: SessionDep, settings: SettingsDep, tenant: TenantDep, base_url: BaseUrl
) -> EvalRunObject:
    row = evals_service.create_run(session=session, settings=settings, tenant=tenant, eval_id=eval_id, body=body)
    return EvalRunObject.from_row(row, base_url=base_url)


@router.get("/{eval_id}/runs", response_model=CursorListObject[EvalRunObject], summary="List an eval's runs")
def list_runs(
    eval_id: str,
    session: SessionDep,
    tenant: TenantDep,
    base_url: BaseUrl,
    after: AfterCursor = None,
    limit: Limit = evals_service.DEFAULT_LIST_LIMIT,
    order: OrderQuery = "asc",
    status: RunStatusQuery = None,
) -> CursorListObject[EvalRunObject]:
    rows, has_more = evals_service.runs_page(
        session=session, tenant=tenant, eval_id=eval_id, after=after, limit=limit, order=order, status=status
    )
    runs = [EvalRunObject.from_row(r, base_url=base_url) for r in rows]
    return CursorListObject[EvalRunObject](**cursor_list(runs, has_more=has_more))


@router.get("/{eval_id}/runs/{run_id}", response_model=EvalRunObject, summary="Retrieve a run")
def retrieve_run(eval_id: str, run_id: str, session: SessionDep, tenant: TenantDep, base_url: BaseUrl) -> EvalRunObject:
    row = evals_service.get_run(session=session, tenant=tenant, eval_id=eval_id, run_id=run_id)
    return EvalRunObject.from_row(row, base_url=base_url)


@router.post("/{eval_id}/runs/{run_id}", response_model=EvalRunObject, responses=responses(409), summary="Cancel a run")
def cancel_run(eval_id: str, run_id: str, session: SessionDep, tenant: TenantDep, base_url: BaseUrl) -> EvalRunObject:
    row = evals_service.cancel_run(session=session, tenant=tenant, eval_id=eval_id, run_id=run_id)
    return EvalRunObject.from_row(row, base_url=base_url)


@router.post(
    "/{eval_id}/runs/{run_id}/cancel",
    response_model=EvalRunObject,
    responses=responses(409),
    summary="Cancel a run (the path of OpenAI's Python client)",
)
def cancel_run_by_client_path(
    eval_id: str, run_id: str, session: SessionDep, tenant: TenantDep, base_url: BaseUrl
) -> EvalRunObject:
    return cancel_run(eval_id, run_id, session, tenant, base_url)


@router.delete("/{eval_id}/runs/{run_id}", response_model=EvalRunDeleted, summary="Delete a run and its items")
def delete_run(eval_id: str, run_id: str, session: SessionDep, tenant: TenantDep) -> EvalRunDeleted:
    return EvalRunDeleted(
        run_id=evals_service.delete_run(session=session, tenant=tenant, eval_id=eval_id, run_id=run_id)
    )


@router.get(
    "/{eval_id}/runs/{run_id}/output_items",
    response_model=CursorListObject[OutputItemObject],
    summary="List a run's output items, in the data source's order",
)
def list_output_items(
    eval_id: str,
    run_id: str,
    session: SessionDep,
    tenant: TenantDep,
    after: AfterCursor = None,
    limit: Limit = evals_service.DEFAULT_LIST_LIMIT,
    order: OrderQuery = "asc",
    status: ItemStatusQuery = None,
) -> CursorListObject[OutputItemObject]:
    rows, has_more = evals_service.items_page(
        session=session,
        tenant=tenant,
        eval_id=eval_id,
        run_id=run_id,
        after=after,
        limit=limit,
        order=order,
        status=status,
    )
    items = [OutputItemObject.from_row(r) for r in rows]
    return CursorListObject[OutputItemObject](**cursor_list(items, has_more=has_more))


@router.get(
    "/{eval_id}/runs/{run_id}/output_items/{output_item_id}",
    response_model=OutputItemObject,
    summary="Retrieve an output item",
)
def retrieve_output_item(
    eval_id: str, run_id: str, output_item_id: str, session: SessionDep, tenant: TenantDep
) -> OutputItemObject:
    row = evals_service.get_item(session=session, tenant=tenant, eval_id=eval_id, run_id=run_id, item_id=output_item_id)
    return OutputItemObject.from_row(row)

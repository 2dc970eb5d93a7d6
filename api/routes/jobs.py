"""``/v1/fine_tuning/jobs``: OpenAI's fine-tuning jobs, plus pause/resume, metrics, rollouts and adapters."""

from __future__ import annotations

import re
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request
from fastapi.responses import Response, StreamingResponse
from pydantic_core import to_json
from sqlalchemy import Connection

from api.auth import Caller
from api.deps import SessionDep, SettingsDep, StoreDep, TenantDep, read_only
from api.errors import InvalidRequest, responses
from api.routes.files import AfterCursor, attachment, stream
from api.schemas import (
    CheckpointObject,
    CursorListObject,
    FineTuningJob,
    JobCreate,
    JobEstimate,
    JobEventObject,
    ListObject,
    MetricsPoint,
    RolloutList,
    cursor_list,
)
from api.services import estimates as estimates_service
from api.services import jobs as jobs_service

router = APIRouter(prefix="/v1/fine_tuning/jobs", tags=["fine-tuning"])
# Not under /jobs: a path there is a job's id (GET /v1/fine_tuning/jobs/{id}).
estimates_router = APIRouter(prefix="/v1/fine_tuning", tags=["fine-tuning"])

_METADATA_KEY = re.compile(r"^metadata\[(.+)\]$")


def metadata_filter(request: Request) -> tuple[dict[str, str], bool]:
    """OpenAI's ``metadata[k]=v`` query filter (every pair must match) or ``metadata=null`` (jobs without any)."""
    pairs = {m.group(1): v for k, v in request.query_params.multi_items() if (m := _METADATA_KEY.match(k))}
    raw = request.query_params.get("metadata")
    if raw is not None and raw != "null":
        raise InvalidRequest("use metadata[key]=value to filter, or metadata=null", param="metadata")
    if raw == "null" and pairs:
        raise InvalidRequest("metadata=null cannot be combined with metadata[key]=value", param="metadata")
    return pairs, raw == "null"


@router.post("", response_model=FineTuningJob, summary="Create a fine-tuning job")
def create_job(body: JobCreate, session: SessionDep, settings: SettingsDep, tenant: TenantDep) -> FineTuningJob:
    job = jobs_service.create(session=session, settings=settings, tenant=tenant, body=body)
    return FineTuningJob.from_row(job)


@estimates_router.post(
    "/estimates",
    response_model=JobEstimate,
    summary="Estimate a fine-tuning job (extension): its steps and duration from the measured throughput",
)
def estimate_job(body: JobCreate, session: SessionDep, settings: SettingsDep, tenant: TenantDep) -> JobEstimate:
    """The body of ``POST /v1/fine_tuning/jobs``, checked as job creation checks it; nothing is created."""
    return estimates_service.estimate(session=session, settings=settings, tenant=tenant, body=body)


@router.get("", response_model=ListObject[FineTuningJob], summary="List fine-tuning jobs, newest first")
def list_jobs(
    request: Request,
    session: SessionDep,
    tenant: TenantDep,
    after: AfterCursor = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 20,
) -> ListObject[FineTuningJob]:
    metadata, metadata_null = metadata_filter(request)
    rows, has_more = jobs_service.page(
        session=session, tenant=tenant, after=after, limit=limit, metadata=metadata, metadata_null=metadata_null
    )
    return ListObject[FineTuningJob](data=[FineTuningJob.from_row(r) for r in rows], has_more=has_more)


def _job_json(conn: Connection, *, tenant: Caller, job_id: str) -> bytes:
    return to_json(FineTuningJob.from_row(jobs_service.get_view(conn=conn, tenant=tenant, job_id=job_id)))


@router.get("/{fine_tuning_job_id}", response_model=FineTuningJob, summary="Retrieve a fine-tuning job")
async def retrieve_job(fine_tuning_job_id: str, settings: SettingsDep, tenant: TenantDep) -> Response:
    # Every client's poll, so it is lean: one trip through the threadpool and one round trip to the database
    # (``read_only``), and the object built there is the JSON sent (FastAPI would validate it once more against the
    # response model before serialising it).
    body = await read_only(settings.db_url, _job_json, tenant=tenant, job_id=fine_tuning_job_id)
    return Response(content=body, media_type="application/json")


@router.post(
    "/{fine_tuning_job_id}/cancel", response_model=FineTuningJob, responses=responses(409), summary="Cancel a job"
)
def cancel_job(fine_tuning_job_id: str, session: SessionDep, tenant: TenantDep) -> FineTuningJob:
    return FineTuningJob.from_row(jobs_service.cancel(session=session, tenant=tenant, job_id=fine_tuning_job_id))


@router.post(
    "/{fine_tuning_job_id}/pause",
    response_model=FineTuningJob,
    responses=responses(409),
    summary="Pause a job at its next checkpoint",
)
def pause_job(fine_tuning_job_id: str, session: SessionDep, tenant: TenantDep) -> FineTuningJob:
    return FineTuningJob.from_row(jobs_service.pause(session=session, tenant=tenant, job_id=fine_tuning_job_id))


@router.post(
    "/{fine_tuning_job_id}/resume",
    response_model=FineTuningJob,
    responses=responses(409),
    summary="Resume a paused job",
)
def resume_job(fine_tuning_job_id: str, session: SessionDep, settings: SettingsDep, tenant: TenantDep) -> FineTuningJob:
    job = jobs_service.resume(session=session, settings=settings, tenant=tenant, job_id=fine_tuning_job_id)
    return FineTuningJob.from_row(job)


@router.get(
    "/{fine_tuning_job_id}/events", response_model=ListObject[JobEventObject], summary="A job's events, newest first"
)
def list_events(
    fine_tuning_job_id: str,
    session: SessionDep,
    tenant: TenantDep,
    after: AfterCursor = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 20,
) -> ListObject[JobEventObject]:
    rows, has_more = jobs_service.events(
        session=session, tenant=tenant, job_id=fine_tuning_job_id, after=after, limit=limit
    )
    return ListObject[JobEventObject](data=[JobEventObject.from_row(r) for r in rows], has_more=has_more)


@router.get(
    "/{fine_tuning_job_id}/checkpoints",
    response_model=CursorListObject[CheckpointObject],
    summary="A job's checkpoints, latest step first",
)
def list_checkpoints(
    fine_tuning_job_id: str,
    session: SessionDep,
    tenant: TenantDep,
    after: AfterCursor = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 10,
) -> CursorListObject[CheckpointObject]:
    job, rows, has_more = jobs_service.checkpoints(
        session=session, tenant=tenant, job_id=fine_tuning_job_id, after=after, limit=limit
    )
    items = [CheckpointObject.from_row(r, job=job) for r in rows]
    return CursorListObject[CheckpointObject](**cursor_list(items, has_more=has_more))


@router.get(
    "/{fine_tuning_job_id}/checkpoints/{checkpoint_id}/adapter",
    response_class=StreamingResponse,
    responses={200: {"content": {"application/gzip": {}}}},
    summary="Download a checkpoint's PEFT adapter (.tar.gz) — extension",
)
def download_adapter(
    fine_tuning_job_id: str, checkpoint_id: str, session: SessionDep, store: StoreDep, tenant: TenantDep
) -> StreamingResponse:
    job, ckpt, fh = jobs_service.open_adapter(
        session=session, store=store, tenant=tenant, job_id=fine_tuning_job_id, checkpoint_id=checkpoint_id
    )
    name = f"{job.id}-step-{ckpt.step_number}-adapter.tar.gz"
    return StreamingResponse(
        stream(fh), media_type="application/gzip", headers={"content-disposition": attachment(name)}
    )


@router.get(
    "/{fine_tuning_job_id}/metrics",
    response_model=ListObject[MetricsPoint],
    summary="The per-step metric series, by step — extension",
)
def list_metrics(
    fine_tuning_job_id: str,
    session: SessionDep,
    tenant: TenantDep,
    after_step: Annotated[int | None, Query(ge=0, le=2**31 - 1)] = None,
    limit: Annotated[int | None, Query(ge=1, le=1_000_000)] = None,
) -> Response:
    rows, has_more = jobs_service.metrics(
        session=session, tenant=tenant, job_id=fine_tuning_job_id, after_step=after_step, limit=limit
    )
    # Up to tens of thousands of points: serialise once, in pydantic-core, rather than validating a model per row.
    body = {"object": "list", "data": [{"step": r.step, "metrics": r.values} for r in rows], "has_more": has_more}
    return Response(content=to_json(body), media_type="application/json")


@router.get(
    "/{fine_tuning_job_id}/rollouts",
    response_model=RolloutList,
    summary="Sampled prompts, completions and rewards of one step (default: the latest) — extension",
)
def list_rollouts(
    fine_tuning_job_id: str,
    session: SessionDep,
    tenant: TenantDep,
    step: Annotated[int | None, Query(ge=0, le=2**31 - 1)] = None,
) -> RolloutList:
    shown, steps, rows = jobs_service.rollouts(session=session, tenant=tenant, job_id=fine_tuning_job_id, step=step)
    data: list[dict[str, Any]] = [{"object": "fine_tuning.job.rollout", **r.data, "step": r.step} for r in rows]
    return RolloutList(data=data, step=shown, steps=steps)

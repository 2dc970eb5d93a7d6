"""``/v1/fine_tuning/alpha/graders``: OpenAI's grader dry-run and validation.

Both are ``async``: the grader runs in a grading process, a python grader's code in a sandbox, a remote grader's
requests on a waiting thread (``api.services.graders``), and the request waits for it without holding one of the
API's threads."""

from __future__ import annotations

from fastapi import APIRouter

from api.deps import SettingsDep, TenantDep
from api.errors import responses
from api.schemas import GraderRunRequest, GraderRunResponse, GraderValidateRequest, GraderValidateResponse
from api.services import graders as graders_service

router = APIRouter(prefix="/v1/fine_tuning/alpha/graders", tags=["graders"])


@router.post(
    "/run", response_model=GraderRunResponse, responses=responses(429), summary="Score one sample with a grader"
)
async def run_grader(body: GraderRunRequest, tenant: TenantDep, settings: SettingsDep) -> GraderRunResponse:
    return await graders_service.run(
        grader=body.grader, model_sample=body.model_sample, item=body.item, settings=settings
    )


@router.post("/validate", response_model=GraderValidateResponse, responses=responses(429), summary="Check a grader")
async def validate_grader(
    body: GraderValidateRequest, tenant: TenantDep, settings: SettingsDep
) -> GraderValidateResponse:
    return GraderValidateResponse(grader=await graders_service.validate(grader=body.grader, settings=settings))

"""``/api/v1/…``: the protocol of Thinking Machines' official ``tinker`` SDK, served for our tenants.

Point the SDK at the service (``ServiceClient(base_url="http://host:8000", api_key="tml-<Proxima key>")``) and its
training, sampling and checkpoint calls run on Proxima's workers. Requests that need a model are queued as futures
(``api.services.tinker``) and polled with ``retrieve_future``, which holds each poll up to ``PROXIMA_SESSION_POLL_S``
and answers 408 "try again" while the request waits: the SDK polls again at once, without a sleep of its own.

These routes are the SDK's contract, not OpenAI's: they are left out of the OpenAPI document (its clients are
generated from it, and these take raw bodies the SDK writes) and answer errors in the envelope the SDK reads as an
``APIStatusError`` with the message. Their answers are still typed (``api.schemas_tinker``, the SDK's own shapes).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Annotated, Literal

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from api.auth import Caller
from api.deps import SettingsDep, StoreDep, TinkerSessionDep, TinkerTenantDep, read_only
from api.notify import Listener
from api.schemas_tinker import (
    Accepted,
    CheckpointList,
    ClientConfig,
    ClientSessionInfo,
    CreateModelBody,
    CreateSamplingSessionBody,
    CreateSessionBody,
    DynamicConfig,
    Empty,
    ExternalWeightsUrls,
    FinishBody,
    FutureBody,
    Healthy,
    HeartbeatAck,
    LoadWeightsBody,
    ModelFuture,
    ModelInfo,
    ModelRefBody,
    OptimStepBody,
    SampleBody,
    SampleFuture,
    SamplerInfo,
    SamplingSessionCreated,
    SaveWeightsBody,
    ServerCapabilities,
    SessionCreated,
    SessionFinishedDetail,
    SessionIds,
    SessionRefBody,
    TrainingRun,
    TrainingRunList,
    TryAgain,
    TtlBody,
    WeightsInfo,
    WeightsInfoBody,
    parse,
)
from api.services import tinker as svc

router = APIRouter(prefix="/api/v1", tags=["tinker"], include_in_schema=False)


async def raw_body(request: Request) -> bytes:
    """The body, read on the event loop, so that the route itself can be a plain function: FastAPI runs those in its
    threadpool, and their database work never blocks the loop (a row lock waited for on the loop would stall every
    other request, the one holding it included)."""
    return await request.body()


RawBody = Annotated[bytes, Depends(raw_body)]

POLL_STEP_S = (0.01, 0.02, 0.05, 0.1)  # a poll re-reads the request this often: quickly at first, then every 0.1 s
NOTIFIED_POLL_S = 1.0  # ... and this often where notifications wake it (PostgreSQL)

# -- the client: configuration, session, telemetry ------------------------------------------------------------------


@router.post("/client/config", response_model=ClientConfig)
async def client_config(tenant: TinkerTenantDep) -> ClientConfig:
    return ClientConfig()


@router.post("/client/dynamic_config", response_model=DynamicConfig)
async def dynamic_config(tenant: TinkerTenantDep) -> DynamicConfig:
    return DynamicConfig()


@router.post("/create_session", response_model=SessionCreated)
def create_session(raw: RawBody, session: TinkerSessionDep, tenant: TinkerTenantDep) -> SessionCreated:
    return svc.create_session(session, tenant=tenant, body=parse(CreateSessionBody, raw))


@router.post("/session_heartbeat", response_model=HeartbeatAck, responses={410: {"model": SessionFinishedDetail}})
def session_heartbeat(raw: RawBody, session: TinkerSessionDep, tenant: TinkerTenantDep) -> HeartbeatAck | Response:
    body = parse(SessionRefBody, raw)
    if not svc.heartbeat(session, tenant=tenant, session_id=body.session_id):  # 410 ends the SDK's heartbeat loop
        gone = SessionFinishedDetail(detail=f"session {body.session_id} has finished")
        return JSONResponse(gone.model_dump(), status_code=410)
    return HeartbeatAck()


@router.post("/sessions/{session_id}/finish", response_model=Empty)
def finish_session(session_id: str, raw: RawBody, session: TinkerSessionDep, tenant: TinkerTenantDep) -> Empty:
    return svc.finish_session(session, tenant=tenant, session_id=session_id, body=parse(FinishBody, raw))


@router.post("/telemetry", response_model=Accepted)
async def telemetry(tenant: TinkerTenantDep) -> Accepted:
    """The SDK's usage events: accepted and not kept (this service has its own metrics)."""
    return Accepted()


@router.get("/healthz", response_model=Healthy)
async def healthz() -> Healthy:
    return Healthy()


@router.get("/get_server_capabilities", response_model=ServerCapabilities)
async def server_capabilities(settings: SettingsDep, tenant: TinkerTenantDep) -> ServerCapabilities:
    return svc.server_capabilities(settings)


# -- training -------------------------------------------------------------------------------------------------------


@router.post("/create_model", response_model=ModelFuture)
def create_model(
    raw: RawBody, session: TinkerSessionDep, settings: SettingsDep, tenant: TinkerTenantDep
) -> ModelFuture:
    return svc.create_model(session, settings=settings, tenant=tenant, body=parse(CreateModelBody, raw))


@router.post("/get_info", response_model=ModelInfo)
def get_info(raw: RawBody, session: TinkerSessionDep, tenant: TinkerTenantDep) -> ModelInfo:
    return svc.get_info(session, tenant=tenant, model_id=parse(ModelRefBody, raw).model_id)


@router.post("/forward_backward", response_model=ModelFuture)
def forward_backward(raw: RawBody, request: Request, session: TinkerSessionDep, tenant: TinkerTenantDep) -> ModelFuture:
    encoding = request.headers.get("content-encoding")
    return svc.forward_backward(session, tenant=tenant, body=raw, content_encoding=encoding)


@router.post("/optim_step", response_model=ModelFuture)
def optim_step(raw: RawBody, session: TinkerSessionDep, tenant: TinkerTenantDep) -> ModelFuture:
    return svc.optim_step(session, tenant=tenant, body=parse(OptimStepBody, raw))


@router.post("/save_weights", response_model=ModelFuture)
def save_weights(raw: RawBody, session: TinkerSessionDep, tenant: TinkerTenantDep) -> ModelFuture:
    return svc.save_weights(session, tenant=tenant, body=parse(SaveWeightsBody, raw), kind="weights")


@router.post("/save_weights_external", response_model=ModelFuture)
def save_weights_external(raw: RawBody, session: TinkerSessionDep, tenant: TinkerTenantDep) -> ModelFuture:
    return svc.save_weights(session, tenant=tenant, body=parse(SaveWeightsBody, raw), kind="external_weights")


@router.post("/save_weights_for_sampler", response_model=ModelFuture)
def save_weights_for_sampler(raw: RawBody, session: TinkerSessionDep, tenant: TinkerTenantDep) -> ModelFuture:
    return svc.save_weights_for_sampler(session, tenant=tenant, body=parse(SaveWeightsBody, raw))


@router.post("/load_weights", response_model=ModelFuture)
def load_weights(
    raw: RawBody, session: TinkerSessionDep, settings: SettingsDep, tenant: TinkerTenantDep
) -> ModelFuture:
    return svc.load_weights(session, settings=settings, tenant=tenant, body=parse(LoadWeightsBody, raw))


@router.post("/weights_info", response_model=WeightsInfo)
def weights_info(raw: RawBody, session: TinkerSessionDep, tenant: TinkerTenantDep) -> WeightsInfo:
    return svc.weights_info(session, tenant=tenant, path=parse(WeightsInfoBody, raw).tinker_path)


# -- sampling -------------------------------------------------------------------------------------------------------


@router.post("/create_sampling_session", response_model=SamplingSessionCreated)
def create_sampling_session(
    raw: RawBody, session: TinkerSessionDep, settings: SettingsDep, tenant: TinkerTenantDep
) -> SamplingSessionCreated:
    body = parse(CreateSamplingSessionBody, raw)
    return svc.create_sampling_session(session, settings=settings, tenant=tenant, body=body)


@router.get("/samplers/{sampler_id}", response_model=SamplerInfo)
def get_sampler(sampler_id: str, session: TinkerSessionDep, tenant: TinkerTenantDep) -> SamplerInfo:
    return svc.get_sampler(session, tenant=tenant, sampler_id=sampler_id)


@router.post("/asample", response_model=SampleFuture)
def asample(raw: RawBody, session: TinkerSessionDep, tenant: TinkerTenantDep) -> SampleFuture:
    return svc.sample(session, tenant=tenant, body=parse(SampleBody, raw))


# -- futures --------------------------------------------------------------------------------------------------------


@router.post("/retrieve_future", response_model=None, responses={408: {"model": TryAgain}})
async def retrieve_future(raw: RawBody, settings: SettingsDep, tenant: TinkerTenantDep, request: Request) -> Response:
    """The request's result once it has one (the worker's bytes as they are, or a ``RequestFailed``); until then the
    poll is held (up to ``session_poll_s``) and answered 408 with "try again"."""
    body = parse(FutureBody, raw)
    listener: Listener | None = getattr(request.app.state, "tinker_done", None)
    found = await _held_poll(
        settings.db_url, listener, tenant=tenant, request_id=body.request_id, hold_s=settings.session_poll_s
    )
    if found is None:
        return JSONResponse(TryAgain(request_id=body.request_id).model_dump(), status_code=408)
    if found.failed is not None:
        return JSONResponse(found.failed.model_dump())
    return Response(found.body, media_type=found.media_type)


async def _held_poll(
    db_url: str, listener: Listener | None, *, tenant: Caller, request_id: str, hold_s: float
) -> svc.Outcome | None:
    """The request's outcome, read until it has one or ``hold_s`` has passed. Each read is one short query; nothing
    holds a database connection while waiting. On PostgreSQL the worker's notification (``api.notify``) wakes the
    poll at once; the reads go on, more slowly, in case a notification is lost."""
    deadline = time.monotonic() + hold_s
    woken, loop = asyncio.Event(), asyncio.get_running_loop()

    def wake() -> None:
        loop.call_soon_threadsafe(woken.set)

    if listener is not None:
        listener.add(request_id, wake)
    try:
        for attempt in range(1_000_000):
            woken.clear()  # before the read: a notification after it is not missed
            found = await read_only(db_url, svc.outcome, tenant=tenant, request_id=request_id)
            left = deadline - time.monotonic()
            if found is not None or left <= 0:
                return found
            step = NOTIFIED_POLL_S if listener is not None else POLL_STEP_S[min(attempt, len(POLL_STEP_S) - 1)]
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(woken.wait(), timeout=min(step, left))
    finally:
        if listener is not None:
            listener.discard(request_id, wake)
    return None


# -- REST: training runs, checkpoints, sessions, weight downloads ---------------------------------------------------


@router.get("/training_runs", response_model=TrainingRunList)
def list_training_runs(
    session: TinkerSessionDep, tenant: TinkerTenantDep, limit: int = 20, offset: int = 0
) -> TrainingRunList:
    return svc.training_runs(session, tenant=tenant, limit=limit, offset=offset)


@router.get("/training_runs/{run_id}", response_model=TrainingRun)
def get_training_run(run_id: str, session: TinkerSessionDep, tenant: TinkerTenantDep) -> TrainingRun:
    return svc.training_run_info(session, tenant=tenant, run_id=run_id)


@router.get("/training_runs/{run_id}/checkpoints", response_model=CheckpointList)
def list_run_checkpoints(run_id: str, session: TinkerSessionDep, tenant: TinkerTenantDep) -> CheckpointList:
    return svc.run_checkpoints(session, tenant=tenant, run_id=run_id)


@router.get("/checkpoints", response_model=CheckpointList)
def list_user_checkpoints(
    session: TinkerSessionDep, tenant: TinkerTenantDep, limit: int = 100, offset: int = 0
) -> CheckpointList:
    return svc.user_checkpoints(session, tenant=tenant, limit=limit, offset=offset)


@router.delete("/training_runs/{run_id}/checkpoints/{kind}/{name}", response_model=Empty)
def delete_checkpoint(
    run_id: str, kind: str, name: str, session: TinkerSessionDep, store: StoreDep, tenant: TinkerTenantDep
) -> Empty:
    return svc.delete_checkpoint(session, store=store, tenant=tenant, run_id=run_id, kind=kind, name=name)


@router.put("/training_runs/{run_id}/checkpoints/{kind}/{name}/ttl", response_model=Empty)
def set_checkpoint_ttl(
    run_id: str, kind: str, name: str, raw: RawBody, session: TinkerSessionDep, tenant: TinkerTenantDep
) -> Empty:
    body = parse(TtlBody, raw)
    return svc.set_checkpoint_ttl(session, tenant=tenant, run_id=run_id, kind=kind, name=name, body=body)


@router.get(
    "/training_runs/{run_id}/checkpoints/{kind}/{name}/external_weights_urls", response_model=ExternalWeightsUrls
)
def external_weights_urls(
    run_id: str,
    kind: Literal["external_weights"],
    name: str,
    request: Request,
    session: TinkerSessionDep,
    store: StoreDep,
    tenant: TinkerTenantDep,
) -> ExternalWeightsUrls:
    base_url = str(request.base_url).rstrip("/")
    return svc.external_weights_urls(session, store=store, tenant=tenant, run_id=run_id, name=name, base_url=base_url)


@router.get("/weights/{token}/{filename}", response_model=None)
async def download_weights(token: str, filename: str, settings: SettingsDep, store: StoreDep) -> Response:
    """One file of exported weights, for whoever holds the URL's token (until the export expires). The row is read,
    and its connection returned, before the file is opened: a slow store holds no database connection."""
    key = await read_only(settings.db_url, svc.export_key, token=token, filename=filename)
    handle = await asyncio.to_thread(svc.open_export, store, key=key, filename=filename)
    return StreamingResponse(iter(lambda: handle.read(1 << 20), b""), media_type="application/octet-stream")


@router.get("/sessions", response_model=SessionIds)
def list_sessions(session: TinkerSessionDep, tenant: TinkerTenantDep, limit: int = 20, offset: int = 0) -> SessionIds:
    return svc.list_sessions(session, tenant=tenant, limit=limit, offset=offset)


@router.get("/sessions/{session_id}", response_model=ClientSessionInfo)
def get_session(session_id: str, session: TinkerSessionDep, tenant: TinkerTenantDep) -> ClientSessionInfo:
    return svc.client_session_info(session, tenant=tenant, session_id=session_id)

"""``/api/v1/…``: the protocol of Thinking Machines' official ``tinker`` SDK (issue 17), served for our tenants.

Point the SDK at the service (``ServiceClient(base_url="http://host:8000", api_key="tml-<Proxima key>")``) and its
training, sampling and checkpoint calls run on Proxima's workers. Requests that need a model are queued as futures
(``api.services.tinker``) and polled with ``retrieve_future``, which holds each poll up to ``PROXIMA_SESSION_POLL_S``
and answers 408 "try again" while the request waits: the SDK polls again at once, without a sleep of its own.

These routes are the SDK's contract, not OpenAI's: they are left out of the OpenAPI document (its clients are
generated from it) and answer errors in the envelope the SDK reads as an ``APIStatusError`` with the message.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import json
import time
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from sqlalchemy import select

from api import ids
from api.deps import SettingsDep, StoreDep, TinkerSessionDep, TinkerTenantDep, read_only
from api.errors import NotFound
from api.notify import Listener
from api.orm import SessionCheckpoint, SessionRequest, TrainingSession
from api.repositories import tinker as repo
from api.services import tinker as svc

router = APIRouter(prefix="/api/v1", tags=["tinker"], include_in_schema=False)


async def raw_body(request: Request) -> bytes:
    """The body, read on the event loop, so that the route itself can be a plain function: FastAPI runs those in its
    threadpool, and their database work never blocks the loop (a row lock waited for on the loop would stall every
    other request, the one holding it included)."""
    return await request.body()


RawBody = Annotated[bytes, Depends(raw_body)]

PROTOBUF = "application/x-protobuf"
POLL_STEP_S = (0.01, 0.02, 0.05, 0.1)  # a poll re-reads the request this often: quickly at first, then every 0.1 s
NOTIFIED_POLL_S = 1.0  # ... and this often where notifications wake it (PostgreSQL)

# -- the client: configuration, session, telemetry ------------------------------------------------------------------


@router.post("/client/config")
async def client_config(tenant: TinkerTenantDep) -> dict[str, Any]:
    """Plain HTTP/1.1 with httpx (not the SDK's pyqwest transport), keys only (no JWT exchange), uncompressed
    forward_backward bodies; the single-request poller."""
    return {
        "pjwt_auth_enabled": False,
        "use_pyqwest_transport": False,
        "proto_compress_fwdbwd": False,
        "sample_use_retrieve_futures": False,
        "custom_loss_server_side": False,
    }


@router.post("/client/dynamic_config")
async def dynamic_config(tenant: TinkerTenantDep) -> dict[str, Any]:
    return {"refresh_interval_sec": 300, "sample_cancel_enabled": False}


@router.post("/create_session")
def create_session(raw: RawBody, session: TinkerSessionDep, tenant: TinkerTenantDep) -> dict[str, Any]:
    body = svc.parse(svc.CreateSessionBody, raw)
    row = repo.create_client_session(
        session,
        id=ids.tinker_session_id(),
        tenant_id=tenant.id,
        tags=body.tags,
        user_metadata=body.user_metadata,
        sdk=body.sdk_version,
    )
    return {"type": "create_session", "session_id": row.id}


@router.post("/session_heartbeat")
def session_heartbeat(raw: RawBody, session: TinkerSessionDep, tenant: TinkerTenantDep) -> Response:
    body = svc.parse(svc.SessionRefBody, raw)
    row = repo.heartbeat(session, tenant_id=tenant.id, id=body.session_id)
    if row is None:
        raise NotFound("session", body.session_id, param="session_id")
    if row.finished_at is not None:  # 410 ends the SDK's heartbeat loop
        return JSONResponse({"detail": f"session {row.id} has finished"}, status_code=410)
    return JSONResponse({"type": "session_heartbeat"})


@router.post("/sessions/{session_id}/finish")
def finish_session(session_id: str, raw: RawBody, session: TinkerSessionDep, tenant: TinkerTenantDep) -> dict[str, Any]:
    body = svc.parse(svc.FinishBody, raw)
    if not repo.finish_client_session(session, tenant_id=tenant.id, id=session_id, reason=body.reason.type):
        raise NotFound("session", session_id, param="session_id")
    return {}


@router.post("/telemetry")
async def telemetry(tenant: TinkerTenantDep) -> dict[str, str]:
    """The SDK's usage events: accepted and not kept (this service has its own metrics)."""
    return {"status": "accepted"}


@router.get("/healthz")
async def healthz() -> dict[str, str]:
    return {"status": "ok"}


@router.get("/get_server_capabilities")
async def server_capabilities(settings: SettingsDep, tenant: TinkerTenantDep) -> dict[str, Any]:
    models = [{"model_name": m, "trainable": True, "sampleable": True} for m in settings.base_models]
    return {"supported_models": models}


# -- training -------------------------------------------------------------------------------------------------------


@router.post("/create_model")
def create_model(
    raw: RawBody, session: TinkerSessionDep, settings: SettingsDep, tenant: TinkerTenantDep
) -> dict[str, Any]:
    body = svc.parse(svc.CreateModelBody, raw)
    return svc.create_model(session, settings=settings, tenant=tenant, body=body)


@router.post("/get_info")
def get_info(raw: RawBody, session: TinkerSessionDep, tenant: TinkerTenantDep) -> dict[str, Any]:
    body = svc.parse(svc.ModelRefBody, raw)
    return svc.get_info(session, tenant=tenant, model_id=body.model_id)


@router.post("/forward_backward")
def forward_backward(
    raw: RawBody, request: Request, session: TinkerSessionDep, tenant: TinkerTenantDep
) -> dict[str, Any]:
    return svc.forward_backward(
        session, tenant=tenant, body=raw, content_encoding=request.headers.get("content-encoding")
    )


@router.post("/optim_step")
def optim_step(raw: RawBody, session: TinkerSessionDep, tenant: TinkerTenantDep) -> dict[str, Any]:
    body = svc.parse(svc.OptimStepBody, raw)
    return svc.optim_step(session, tenant=tenant, body=body)


@router.post("/save_weights")
def save_weights(raw: RawBody, session: TinkerSessionDep, tenant: TinkerTenantDep) -> dict[str, Any]:
    body = svc.parse(svc.SaveWeightsBody, raw)
    return svc.save_weights(session, tenant=tenant, body=body, kind="weights")


@router.post("/save_weights_external")
def save_weights_external(raw: RawBody, session: TinkerSessionDep, tenant: TinkerTenantDep) -> dict[str, Any]:
    body = svc.parse(svc.SaveWeightsBody, raw)
    return svc.save_weights(session, tenant=tenant, body=body, kind="external_weights")


@router.post("/save_weights_for_sampler")
def save_weights_for_sampler(raw: RawBody, session: TinkerSessionDep, tenant: TinkerTenantDep) -> dict[str, Any]:
    body = svc.parse(svc.SaveWeightsBody, raw)
    return svc.save_weights_for_sampler(session, tenant=tenant, body=body)


@router.post("/load_weights")
def load_weights(
    raw: RawBody, session: TinkerSessionDep, settings: SettingsDep, tenant: TinkerTenantDep
) -> dict[str, Any]:
    body = svc.parse(svc.LoadWeightsBody, raw)
    return svc.load_weights(session, settings=settings, tenant=tenant, body=body)


@router.post("/weights_info")
def weights_info(raw: RawBody, session: TinkerSessionDep, tenant: TinkerTenantDep) -> dict[str, Any]:
    body = svc.parse(svc.WeightsInfoBody, raw)
    return svc.weights_info(session, tenant=tenant, tinker_path=body.tinker_path)


# -- sampling -------------------------------------------------------------------------------------------------------


@router.post("/create_sampling_session")
def create_sampling_session(
    raw: RawBody, session: TinkerSessionDep, settings: SettingsDep, tenant: TinkerTenantDep
) -> dict[str, Any]:
    body = svc.parse(svc.CreateSamplingSessionBody, raw)
    return svc.create_sampling_session(session, settings=settings, tenant=tenant, body=body)


@router.get("/samplers/{sampler_id}")
def get_sampler(sampler_id: str, session: TinkerSessionDep, tenant: TinkerTenantDep) -> dict[str, Any]:
    return svc.get_sampler(session, tenant=tenant, sampler_id=sampler_id)


@router.post("/asample")
def asample(raw: RawBody, session: TinkerSessionDep, tenant: TinkerTenantDep) -> dict[str, Any]:
    body = svc.parse(svc.SampleBody, raw)
    return svc.sample(session, tenant=tenant, body=body)


# -- futures --------------------------------------------------------------------------------------------------------


@router.post("/retrieve_future")
async def retrieve_future(raw: RawBody, settings: SettingsDep, tenant: TinkerTenantDep, request: Request) -> Response:
    """The request's result once it has one; until then the poll is held (up to ``session_poll_s``) and answered
    408 with "try again". Each read is one short query; nothing holds a database connection while waiting. On
    PostgreSQL the worker's notification (``api.notify``) wakes the poll at once; the reads go on, more slowly, in
    case a notification is lost."""
    body = svc.parse(svc.FutureBody, raw)
    deadline = time.monotonic() + settings.session_poll_s
    listener: Listener | None = getattr(request.app.state, "tinker_done", None)
    woken, loop = asyncio.Event(), asyncio.get_running_loop()

    def wake() -> None:
        loop.call_soon_threadsafe(woken.set)

    if listener is not None:
        listener.add(body.request_id, wake)
    try:
        for attempt in range(1_000_000):
            woken.clear()  # before the read: a notification after it is not missed
            row = await read_only(settings.db_url, _finished, tenant_id=tenant.id, request_id=body.request_id)
            if row is not None:
                return _result(row)
            left = deadline - time.monotonic()
            if left <= 0:
                break
            step = NOTIFIED_POLL_S if listener is not None else POLL_STEP_S[min(attempt, len(POLL_STEP_S) - 1)]
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(woken.wait(), timeout=min(step, left))
    finally:
        if listener is not None:
            listener.discard(body.request_id, wake)
    return JSONResponse({"type": "try_again", "request_id": body.request_id, "queue_state": "active"}, status_code=408)


def _finished(conn: Any, *, tenant_id: str, request_id: str) -> tuple[str, bytes | None, str | None, Any] | None:
    found = conn.execute(
        select(SessionRequest.status, SessionRequest.result, SessionRequest.result_format, SessionRequest.error).where(
            SessionRequest.id == request_id, SessionRequest.tenant_id == tenant_id
        )
    ).first()
    if found is None:
        raise NotFound("request", request_id, param="request_id")
    status, result, result_format, error = found
    return None if status in (repo.PENDING, repo.RUNNING) else (status, result, result_format, error)


def _result(row: tuple[str, bytes | None, str | None, Any]) -> Response:
    status, result, result_format, error = row
    if status == repo.FAILED:
        payload = error if isinstance(error, dict) else json.loads(error or "{}")
        return JSONResponse({"error": payload.get("error", "failed"), "category": payload.get("category", "unknown")})
    if result_format == "proto":
        return Response(result or b"", media_type=PROTOBUF)
    return Response(result or b"{}", media_type="application/json")


# -- REST: training runs, checkpoints, sessions, weight downloads ---------------------------------------------------


def _when(ts: int | float | None) -> str | None:
    return None if ts is None else dt.datetime.fromtimestamp(ts, dt.UTC).isoformat()


def _run_object(row: TrainingSession, tenant_id: str, checkpoints: list[Any]) -> dict[str, Any]:
    last: dict[str, dict[str, Any] | None] = {"weights": None, "sampler_weights": None}
    for c in checkpoints:
        if c.kind in last:
            last[c.kind] = _checkpoint_object(row.id, c)
    return {
        "training_run_id": row.id,
        "base_model": row.base_model,
        "model_owner": tenant_id,
        "is_lora": True,
        "corrupted": False,
        "lora_rank": row.lora.get("rank"),
        "last_request_time": _when(row.last_request_at or row.created_at),
        "last_checkpoint": last["weights"],
        "last_sampler_checkpoint": last["sampler_weights"],
        "user_metadata": row.user_metadata,
    }


CHECKPOINT_TYPES = {"weights": "training", "sampler_weights": "sampler", "external_weights": "external"}


def _checkpoint_object(run_id: str, c: Any) -> dict[str, Any]:
    return {
        "checkpoint_id": f"{c.kind}/{c.name}",
        "checkpoint_type": CHECKPOINT_TYPES[c.kind],
        "time": _when(c.created_at),
        "tinker_path": f"{svc.TINKER_SCHEME}{run_id}/{c.kind}/{c.name}",
        "size_bytes": c.size_bytes,
        "public": False,
        "expires_at": _when(c.expires_at),
    }


@router.get("/training_runs")
def list_training_runs(
    session: TinkerSessionDep, tenant: TinkerTenantDep, limit: int = 20, offset: int = 0
) -> dict[str, Any]:
    limit, offset = max(1, min(limit, 100)), max(0, offset)
    rows = repo.list_training_sessions(session, tenant_id=tenant.id, limit=limit, offset=offset)
    total = repo.count_training_sessions(session, tenant_id=tenant.id)
    runs = [_run_object(r, tenant.id, repo.checkpoints(session, tenant_id=tenant.id, session_id=r.id)) for r in rows]
    return {"training_runs": runs, "cursor": {"offset": offset, "limit": limit, "total_count": total}}


@router.get("/training_runs/{run_id}")
def get_training_run(run_id: str, session: TinkerSessionDep, tenant: TinkerTenantDep) -> dict[str, Any]:
    row = svc.training_run(session, tenant, run_id, param="run_id")
    return _run_object(row, tenant.id, repo.checkpoints(session, tenant_id=tenant.id, session_id=row.id))


@router.get("/training_runs/{run_id}/checkpoints")
def list_run_checkpoints(run_id: str, session: TinkerSessionDep, tenant: TinkerTenantDep) -> dict[str, Any]:
    row = svc.training_run(session, tenant, run_id, param="run_id")
    rows = repo.checkpoints(session, tenant_id=tenant.id, session_id=row.id)
    return {"checkpoints": [_checkpoint_object(row.id, c) for c in rows]}


@router.get("/checkpoints")
def list_user_checkpoints(
    session: TinkerSessionDep, tenant: TinkerTenantDep, limit: int = 100, offset: int = 0
) -> dict[str, Any]:
    rows = repo.checkpoints(session, tenant_id=tenant.id)
    page = rows[::-1][max(0, offset) : max(0, offset) + max(1, min(limit, 1000))]
    return {"checkpoints": [_checkpoint_object(c.session_id, c) for c in page]}


def _checkpoint_ref(run_id: str, kind: str, name: str) -> svc.TinkerPath:
    return svc.parse_path(f"{svc.TINKER_SCHEME}{run_id}/{kind}/{name}", param="checkpoint_id")


@router.delete("/training_runs/{run_id}/checkpoints/{kind}/{name}")
def delete_checkpoint(
    run_id: str, kind: str, name: str, session: TinkerSessionDep, store: StoreDep, tenant: TinkerTenantDep
) -> dict[str, Any]:
    path = _checkpoint_ref(run_id, kind, name)
    key = repo.delete_checkpoint(session, tenant_id=tenant.id, session_id=path.run_id, kind=path.kind, name=path.name)
    if key is None:
        raise NotFound("checkpoint", str(path), param="checkpoint_id")
    if not _in_use(session, key):
        store.delete_prefix(key)
    return {}


def _in_use(session: Any, key: str) -> bool:
    """Whether a training session still starts from ``key`` (created from that state): then the bytes stay."""
    return session.scalar(select(TrainingSession.id).where(TrainingSession.saved_state_key == key).limit(1)) is not None


@router.put("/training_runs/{run_id}/checkpoints/{kind}/{name}/ttl")
def set_checkpoint_ttl(
    run_id: str, kind: str, name: str, raw: RawBody, session: TinkerSessionDep, tenant: TinkerTenantDep
) -> dict[str, Any]:
    path = _checkpoint_ref(run_id, kind, name)
    body = svc.parse(svc.TtlBody, raw)
    ok = repo.set_checkpoint_ttl(
        session,
        tenant_id=tenant.id,
        session_id=path.run_id,
        kind=path.kind,
        name=path.name,
        ttl_seconds=body.ttl_seconds,
    )
    if not ok:
        raise NotFound("checkpoint", str(path), param="checkpoint_id")
    return {}


@router.get("/training_runs/{run_id}/checkpoints/{kind}/{name}/external_weights_urls")
def external_weights_urls(
    run_id: str,
    kind: Literal["external_weights"],
    name: str,
    request: Request,
    session: TinkerSessionDep,
    store: StoreDep,
    tenant: TinkerTenantDep,
) -> dict[str, Any]:
    """Unauthenticated download URLs of the exported adapter's files (the SDK fetches them with a plain GET)."""
    path = _checkpoint_ref(run_id, kind, name)
    row = repo.checkpoint(session, tenant_id=tenant.id, session_id=path.run_id, kind=path.kind, name=path.name)
    if row is None:
        raise NotFound("checkpoint", str(path), param="checkpoint_id")
    if row.download_token is None:
        row.download_token = ids.download_token()
    files = store.list(row.storage_key)
    base = str(request.base_url).rstrip("/")
    urls = {
        key.removeprefix(row.storage_key + "/"): f"{base}/api/v1/weights/{row.download_token}/"
        f"{key.removeprefix(row.storage_key + '/')}"
        for key in files
    }
    expires = row.expires_at or int(time.time()) + 7 * 86_400
    return {"urls": urls, "expires": _when(expires)}


@router.get("/weights/{token}/{filename}")
async def download_weights(token: str, filename: str, settings: SettingsDep, store: StoreDep) -> Response:
    """One file of exported weights, for whoever holds the URL's token (until the export expires)."""
    found = await read_only(settings.db_url, _export_by_token, token=token)
    if found is None or "/" in filename or filename.startswith("."):
        raise NotFound("weights", filename, param="filename")
    key, expires_at = found
    if expires_at is not None and expires_at < time.time():
        raise NotFound("weights", filename, param="filename")
    try:
        handle = await asyncio.to_thread(store.open, f"{key}/{filename}")
    except Exception:
        raise NotFound("weights", filename, param="filename") from None
    return StreamingResponse(iter(lambda: handle.read(1 << 20), b""), media_type="application/octet-stream")


def _export_by_token(conn: Any, *, token: str) -> tuple[str, int | None] | None:
    row = conn.execute(
        select(SessionCheckpoint.storage_key, SessionCheckpoint.expires_at).where(
            SessionCheckpoint.download_token == token, SessionCheckpoint.kind == "external_weights"
        )
    ).first()
    return None if row is None else (row[0], row[1])


@router.get("/sessions")
def list_sessions(
    session: TinkerSessionDep, tenant: TinkerTenantDep, limit: int = 20, offset: int = 0
) -> dict[str, Any]:
    ids_ = repo.list_client_sessions(session, tenant_id=tenant.id, limit=max(1, min(limit, 100)), offset=max(0, offset))
    return {"sessions": ids_}


@router.get("/sessions/{session_id}")
def get_session(session_id: str, session: TinkerSessionDep, tenant: TinkerTenantDep) -> dict[str, Any]:
    row = repo.client_session(session, tenant_id=tenant.id, id=session_id)
    if row is None:
        raise NotFound("session", session_id, param="session_id")
    runs, samplers = repo.client_session_children(session, id=row.id)
    return {"training_run_ids": runs, "sampler_ids": samplers, "user_metadata": row.user_metadata}

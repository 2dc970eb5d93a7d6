"""The Tinker-compatible API's service layer: what each request of the official ``tinker`` SDK does.

The API never holds a model. A request that needs one (forward_backward, optim_step, sample, save/load) becomes a
``session_requests`` row, a future whose id the SDK polls with ``retrieve_future``; the worker that holds the
session (``worker.sessions``) runs the rows in the SDK's order and writes their results. Requests that only touch
rows (creating a client session or a training session, listings, weights info) answer at once.

Ids are the SDK's: a client session ``sess-…``; its n-th training session ``<session>:train:<n>`` (the SDK derives
it itself when it creates one from a saved state); its samplers ``<session>:sample:<n>``; saved weights
``tinker://<training session>/<weights|sampler_weights|external_weights>/<name>``.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass
from typing import Any, BinaryIO, Literal

from sqlalchemy import Connection
from sqlalchemy.orm import Session

from api import ids
from api.auth import Caller
from api.errors import Conflict, InvalidRequest, NotFound
from api.orm import Sampler, SessionCheckpoint, SessionRequest, TinkerClientSession, TrainingSession
from api.repositories import tinker as repo
from api.schemas_tinker import (
    CHECKPOINT_TYPES,
    TINKER_SCHEME,
    CheckpointList,
    ClientSessionInfo,
    CreateModelBody,
    CreateSamplingSessionBody,
    CreateSessionBody,
    Empty,
    ExternalWeightsUrls,
    FinishBody,
    LoadWeightsBody,
    ModelFuture,
    ModelInfo,
    OffsetCursor,
    OptimStepBody,
    RequestFailed,
    SampleBody,
    SampleFuture,
    SamplerInfo,
    SamplingSessionCreated,
    SaveWeightsBody,
    ServerCapabilities,
    SessionCreated,
    SessionIds,
    SupportedModel,
    TinkerCheckpoint,
    TrainingRun,
    TrainingRunList,
    TtlBody,
    WeightsInfo,
    iso_time,
    tinker_path,
)
from api.settings import Settings
from api.storage import ArtifactStore
from api.tinker_wire import decode_forward_backward, decompress

CHECKPOINT_KINDS = tuple(CHECKPOINT_TYPES)
NAME_PATTERN = re.compile(r"[A-Za-z0-9_.\-]{1,128}")
PROTOBUF = "application/x-protobuf"
EXPORT_URLS_VALID_S = 7 * 86_400  # how long the download URLs of an export without an expiry are said to hold

# -- paths ----------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TinkerPath:
    run_id: str
    kind: str
    name: str

    def __str__(self) -> str:
        return tinker_path(self.run_id, self.kind, self.name)


def parse_path(path: str, *, param: str = "path") -> TinkerPath:
    parts = path.removeprefix(TINKER_SCHEME).split("/") if path.startswith(TINKER_SCHEME) else []
    if len(parts) != 3 or parts[1] not in CHECKPOINT_KINDS or not NAME_PATTERN.fullmatch(parts[2]):
        raise InvalidRequest(
            f"{param}: {path!r} is not a path of saved weights: tinker://<training run>/<kind>/<name>, kind one of "
            f"{', '.join(CHECKPOINT_KINDS)}",
            param=param,
        )
    return TinkerPath(parts[0], parts[1], parts[2])


def check_name(name: str | None, *, param: str = "path") -> str:
    if name is None or not NAME_PATTERN.fullmatch(name):
        raise InvalidRequest(
            f"{param}: a checkpoint name is 1–128 letters, digits, '_', '.' or '-' (got {name!r})", param=param
        )
    return name


def storage_prefix(tenant_id: str, run_id: str) -> str:
    return f"tinker/{tenant_id}/{run_id.replace(':', '-')}"


# -- client sessions ------------------------------------------------------------------------------------------------


def _client_session(session: Session, tenant: Caller, id: str, *, param: str = "session_id") -> TinkerClientSession:
    row = repo.client_session(session, tenant_id=tenant.id, id=id)
    if row is None:
        raise NotFound("session", id, param=param)
    return row


def create_session(session: Session, *, tenant: Caller, body: CreateSessionBody) -> SessionCreated:
    row = repo.create_client_session(
        session,
        id=ids.tinker_session_id(),
        tenant_id=tenant.id,
        tags=body.tags,
        user_metadata=body.user_metadata,
        sdk=body.sdk_version,
    )
    return SessionCreated(session_id=row.id)


def heartbeat(session: Session, *, tenant: Caller, session_id: str) -> bool:
    """Keep the client session alive; whether it still is (False: it has finished, which ends the SDK's loop)."""
    row = repo.heartbeat(session, tenant_id=tenant.id, id=session_id)
    if row is None:
        raise NotFound("session", session_id, param="session_id")
    return row.finished_at is None


def finish_session(session: Session, *, tenant: Caller, session_id: str, body: FinishBody) -> Empty:
    if not repo.finish_client_session(session, tenant_id=tenant.id, id=session_id, reason=body.reason.type):
        raise NotFound("session", session_id, param="session_id")
    return Empty()


def server_capabilities(settings: Settings) -> ServerCapabilities:
    return ServerCapabilities(supported_models=[SupportedModel(model_name=m) for m in settings.base_models])


def list_sessions(session: Session, *, tenant: Caller, limit: int, offset: int) -> SessionIds:
    ids_ = repo.list_client_sessions(session, tenant_id=tenant.id, limit=max(1, min(limit, 100)), offset=max(0, offset))
    return SessionIds(sessions=ids_)


def client_session_info(session: Session, *, tenant: Caller, session_id: str) -> ClientSessionInfo:
    row = _client_session(session, tenant, session_id)
    runs, samplers = repo.client_session_children(session, id=row.id)
    return ClientSessionInfo(training_run_ids=runs, sampler_ids=samplers, user_metadata=row.user_metadata)


# -- training runs --------------------------------------------------------------------------------------------------


def training_run(session: Session, tenant: Caller, model_id: str, *, param: str = "model_id") -> TrainingSession:
    row = repo.training_session(session, tenant_id=tenant.id, id=model_id)
    if row is None or row.kind != "training":
        raise NotFound("model", model_id, param=param)
    return row


def _check_base_model(settings: Settings, name: str, *, param: str = "base_model") -> None:
    if name not in settings.base_models:
        raise InvalidRequest(
            f"{param}: {name!r} is not offered; offered: {', '.join(settings.base_models)}", param=param
        )


def _done_request(
    session: Session, *, tenant: Caller, serving_id: str, kind: str, dedupe_key: str, result: dict[str, Any]
) -> str:
    """A future that is complete from the start (creating a row needs no worker)."""
    row = SessionRequest(
        id=ids.tinker_request_id(),
        tenant_id=tenant.id,
        session_id=serving_id,
        kind=kind,
        dedupe_key=dedupe_key,
        payload=b"",
        status=repo.DONE,
        result=json.dumps(result).encode(),
        result_format="json",
        created_at=time.time(),
        finished_at=time.time(),
    )
    return repo.enqueue(session, row).id


def create_model(session: Session, *, settings: Settings, tenant: Caller, body: CreateModelBody) -> ModelFuture:
    _client_session(session, tenant, body.session_id)
    _check_base_model(settings, body.base_model)
    if body.optimizer_config is not None and body.optimizer_config.type != "adamw":
        raise InvalidRequest(
            f"optimizer_config.type: {body.optimizer_config.type!r} is not offered; offered: adamw",
            param="optimizer_config.type",
        )
    return _new_training_run(
        session,
        tenant=tenant,
        client_session_id=body.session_id,
        model_seq_id=body.model_seq_id,
        request_kind="create_model",
        result={"type": "create_model"},
        base_model=body.base_model,
        lora=body.lora_config.model_dump(),
        user_metadata=body.user_metadata,
    )


def _new_training_run(
    session: Session,
    *,
    tenant: Caller,
    client_session_id: str,
    model_seq_id: int,
    request_kind: str,
    result: dict[str, Any],
    **row: Any,
) -> ModelFuture:
    """A training run ``<session>:train:<seq>`` of a client session (``row``: its base model, LoRA and any saved state
    it starts from), and the request that made it, answered at once with ``result`` and the model id."""
    model_id = f"{client_session_id}:train:{model_seq_id}"
    repo.add_training_session(
        session,
        TrainingSession(id=model_id, tenant_id=tenant.id, client_session_id=client_session_id, kind="training", **row),
    )
    request_id = _done_request(
        session,
        tenant=tenant,
        serving_id=model_id,
        kind=request_kind,
        dedupe_key=f"create_model:{model_id}",
        result=result | {"model_id": model_id},
    )
    return ModelFuture(request_id=request_id, model_id=model_id)


def get_info(session: Session, *, tenant: Caller, model_id: str) -> ModelInfo:
    return ModelInfo.from_row(training_run(session, tenant, model_id))


def weights_info(session: Session, *, tenant: Caller, path: str) -> WeightsInfo:
    parsed = parse_path(path, param="tinker_path")
    row = training_run(session, tenant, parsed.run_id, param="tinker_path")
    if repo.checkpoint(session, tenant_id=tenant.id, session_id=row.id, kind=parsed.kind, name=parsed.name) is None:
        raise NotFound("checkpoint", path, param="tinker_path")
    return WeightsInfo.from_row(row)


# -- queued requests ------------------------------------------------------------------------------------------------


def _enqueue(
    session: Session,
    *,
    tenant: Caller,
    serving_id: str,
    kind: str,
    seq_id: int | None,
    dedupe_key: str,
    payload: bytes,
    sampler_id: str | None = None,
) -> str:
    row = SessionRequest(
        id=ids.tinker_request_id(),
        tenant_id=tenant.id,
        session_id=serving_id,
        sampler_id=sampler_id,
        kind=kind,
        seq_id=seq_id,
        dedupe_key=dedupe_key,
        payload=payload,
        created_at=time.time(),
    )
    return repo.enqueue(session, row).id


def forward_backward(session: Session, *, tenant: Caller, body: bytes, content_encoding: str | None) -> ModelFuture:
    plain = decompress(body, content_encoding=content_encoding)
    request = decode_forward_backward(plain, content_encoding=None)
    run = training_run(session, tenant, request.model_id)
    kind = "forward" if request.forward_only else "forward_backward"
    return _train_request(session, tenant=tenant, run=run, kind=kind, seq_id=request.seq_id, payload=plain)


def optim_step(session: Session, *, tenant: Caller, body: OptimStepBody) -> ModelFuture:
    run = training_run(session, tenant, body.model_id)
    if body.adam_params is None:
        kind = (body.optimizer_params or {}).get("type")
        raise InvalidRequest(f"optimizer_params: {kind!r} is not offered; send adam_params", param="optimizer_params")
    payload = json.dumps({"adam_params": body.adam_params.model_dump()}).encode()
    return _train_request(session, tenant=tenant, run=run, kind="optim_step", seq_id=body.seq_id, payload=payload)


def _train_request(
    session: Session, *, tenant: Caller, run: TrainingSession, kind: str, seq_id: int, payload: bytes
) -> ModelFuture:
    request_id = _enqueue(
        session,
        tenant=tenant,
        serving_id=run.id,
        kind=kind,
        seq_id=seq_id,
        dedupe_key=f"train:{run.id}:{seq_id}",
        payload=payload,
    )
    return ModelFuture(request_id=request_id, model_id=run.id)


def save_weights(
    session: Session, *, tenant: Caller, body: SaveWeightsBody, kind: Literal["weights", "external_weights"]
) -> ModelFuture:
    run = training_run(session, tenant, body.model_id)
    name = check_name(body.path)
    payload = json.dumps({"name": name, "ttl_seconds": body.ttl_seconds}).encode()
    request_kind = "save_weights" if kind == "weights" else "save_weights_external"
    return _train_request(session, tenant=tenant, run=run, kind=request_kind, seq_id=body.seq_id, payload=payload)


def save_weights_for_sampler(session: Session, *, tenant: Caller, body: SaveWeightsBody) -> ModelFuture:
    """Named (``path``): a ``sampler_weights`` checkpoint. Without a name (``sampling_session_seq_id``): a sampler of
    these weights, whose id the result carries (``save_weights_and_get_sampling_client``)."""
    run = training_run(session, tenant, body.model_id)
    if body.path is not None:
        payload = {"name": check_name(body.path), "ttl_seconds": body.ttl_seconds}
    elif body.sampling_session_seq_id is not None:
        sampler_id = f"{run.client_session_id}:sample:{body.sampling_session_seq_id}"
        payload = {"name": f"sampler-{body.sampling_session_seq_id}", "sampler_id": sampler_id, "ttl_seconds": None}
    else:
        raise InvalidRequest("path: name the weights, or send sampling_session_seq_id", param="path")
    return _train_request(
        session,
        tenant=tenant,
        run=run,
        kind="save_weights_for_sampler",
        seq_id=body.seq_id,
        payload=json.dumps(payload).encode(),
    )


def _checkpoint(session: Session, tenant: Caller, path: TinkerPath, *, param: str = "path") -> SessionCheckpoint:
    row = repo.checkpoint(session, tenant_id=tenant.id, session_id=path.run_id, kind=path.kind, name=path.name)
    if row is None:
        raise NotFound("checkpoint", str(path), param=param)
    return row


def load_weights(session: Session, *, settings: Settings, tenant: Caller, body: LoadWeightsBody) -> ModelFuture:
    """Into a training session (``load_state``, in its order), or as a new one (``create_training_client_from_state``:
    no ``model_id``; the new session starts from the saved state)."""
    path = parse_path(body.path)
    if path.kind != "weights":
        raise InvalidRequest(f"path: only saved states (…/weights/…) can be loaded, not {path.kind}", param="path")
    ckpt = _checkpoint(session, tenant, path)
    if body.model_id is not None:
        run = training_run(session, tenant, body.model_id)
        if body.seq_id is None:
            raise InvalidRequest("seq_id: required with model_id", param="seq_id")
        payload = json.dumps({"storage_key": ckpt.storage_key, "optimizer": body.optimizer, "path": str(path)})
        return _train_request(
            session, tenant=tenant, run=run, kind="load_weights", seq_id=body.seq_id, payload=payload.encode()
        )
    if body.session_id is None or body.model_seq_id is None:
        raise InvalidRequest("session_id: required (with model_seq_id) without model_id", param="session_id")
    return _create_from_state(session, settings=settings, tenant=tenant, body=body, ckpt=ckpt, path=path)


def _create_from_state(
    session: Session,
    *,
    settings: Settings,
    tenant: Caller,
    body: LoadWeightsBody,
    ckpt: SessionCheckpoint,
    path: TinkerPath,
) -> ModelFuture:
    assert body.session_id is not None and body.model_seq_id is not None
    _client_session(session, tenant, body.session_id)
    source = training_run(session, tenant, path.run_id, param="path")
    steps = ckpt.optimizer_steps if body.optimizer else 0
    return _new_training_run(
        session,
        tenant=tenant,
        client_session_id=body.session_id,
        model_seq_id=body.model_seq_id,
        request_kind="load_weights",
        result={"path": str(path), "type": "load_weights"},
        base_model=source.base_model,
        lora=dict(source.lora),
        user_metadata=body.user_metadata,
        saved_state_key=ckpt.storage_key,
        saved_state_optimizer=body.optimizer,
        saved_steps=steps,
        optimizer_steps=steps,
    )


# -- sampling -------------------------------------------------------------------------------------------------------


def create_sampling_session(
    session: Session, *, settings: Settings, tenant: Caller, body: CreateSamplingSessionBody
) -> SamplingSessionCreated:
    """A sampler of saved sampler weights (served by their training session's worker) or of a base model (served by a
    session of its own)."""
    _client_session(session, tenant, body.session_id)
    sampler_id = f"{body.session_id}:sample:{body.sampling_session_seq_id}"
    if body.model_path is not None:
        path = parse_path(body.model_path, param="model_path")
        if path.kind != "sampler_weights":
            raise InvalidRequest("model_path: a sampler samples …/sampler_weights/… paths", param="model_path")
        ckpt = _checkpoint(session, tenant, path, param="model_path")
        run = training_run(session, tenant, path.run_id, param="model_path")
        row = Sampler(
            id=sampler_id,
            tenant_id=tenant.id,
            client_session_id=body.session_id,
            serving_id=run.id,
            base_model=run.base_model,
            model_path=str(path),
            weights_key=ckpt.storage_key,
        )
    elif body.base_model is not None:
        _check_base_model(settings, body.base_model)
        serving = repo.add_training_session(
            session,
            TrainingSession(
                id=sampler_id,
                tenant_id=tenant.id,
                client_session_id=body.session_id,
                kind="sampling",
                base_model=body.base_model,
                lora={"rank": 1},
            ),
        )
        row = Sampler(
            id=sampler_id,
            tenant_id=tenant.id,
            client_session_id=body.session_id,
            serving_id=serving.id,
            base_model=body.base_model,
        )
    else:
        raise InvalidRequest("model_path: name the weights to sample, or a base_model", param="model_path")
    repo.add_sampler(session, row)
    return SamplingSessionCreated(sampling_session_id=sampler_id)


def get_sampler(session: Session, *, tenant: Caller, sampler_id: str) -> SamplerInfo:
    row = repo.sampler(session, tenant_id=tenant.id, id=sampler_id)
    if row is None:
        raise NotFound("sampler", sampler_id, param="sampler_id")
    return SamplerInfo(sampler_id=row.id, base_model=row.base_model, model_path=row.model_path)


def sample(session: Session, *, tenant: Caller, body: SampleBody) -> SampleFuture:
    row = repo.sampler(session, tenant_id=tenant.id, id=body.sampling_session_id)
    if row is None:
        raise NotFound("sampler", body.sampling_session_id, param="sampling_session_id")
    unsupported = {
        "topk_prompt_logprobs": body.topk_prompt_logprobs,
        "topk_sample_logprobs": body.topk_sample_logprobs,
        "prompt_alt_tokens_k": body.prompt_alt_tokens_k,
    }
    for name, value in unsupported.items():
        if value:
            raise InvalidRequest(f"{name}: top-k log-probs are not offered by this server (send 0)", param=name)
    if body.target_prompt_logprobs is not None:
        raise InvalidRequest("target_prompt_logprobs: not offered by this server", param="target_prompt_logprobs")
    for i, chunk in enumerate(body.prompt.chunks):
        if chunk.type != "encoded_text":
            raise InvalidRequest(f"prompt.chunks.{i}: {chunk.type} chunks are not offered", param=f"prompt.chunks.{i}")
    if not any(chunk.tokens for chunk in body.prompt.chunks):
        raise InvalidRequest("prompt: no tokens", param="prompt")
    payload = body.model_dump(include={"num_samples", "prompt", "sampling_params", "prompt_logprobs"})
    payload["weights_key"] = row.weights_key
    request_id = _enqueue(
        session,
        tenant=tenant,
        serving_id=row.serving_id,
        kind="sample",
        seq_id=None,
        dedupe_key=f"sample:{row.id}:{body.seq_id}",
        payload=json.dumps(payload).encode(),
        sampler_id=row.id,
    )
    return SampleFuture(
        request_id=request_id, sample_sequence_ids=[f"{request_id}:{i}" for i in range(body.num_samples)]
    )


# -- futures --------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Outcome:
    """A finished request's answer to its polls: the error of a failed one, or the result's bytes as the worker
    wrote them (JSON or protobuf), sent as they are."""

    failed: RequestFailed | None
    body: bytes
    media_type: str


def outcome(conn: Connection, *, tenant: Caller, request_id: str) -> Outcome | None:
    """The request's outcome once it has one (None while it waits or runs); a 404 for another tenant's or an unknown
    id. One short read on a plain connection: a held poll repeats it."""
    row = repo.request_outcome(conn, tenant_id=tenant.id, id=request_id)
    if row is None:
        raise NotFound("request", request_id, param="request_id")
    status, result, result_format, error = row
    if status in (repo.PENDING, repo.RUNNING):
        return None
    if status == repo.FAILED:
        return Outcome(RequestFailed.from_error(error), b"", "application/json")
    if result_format == "proto":
        return Outcome(None, result or b"", PROTOBUF)
    return Outcome(None, result or b"{}", "application/json")


# -- the SDK's REST side: training runs, checkpoints, downloads -----------------------------------------------------


def training_runs(session: Session, *, tenant: Caller, limit: int, offset: int) -> TrainingRunList:
    """A page of the tenant's training runs with their latest checkpoints: three queries for any page size."""
    limit, offset = max(1, min(limit, 100)), max(0, offset)
    rows, total = repo.training_runs_page(session, tenant_id=tenant.id, limit=limit, offset=offset)
    latest = repo.latest_checkpoints(
        session, tenant_id=tenant.id, session_ids=[r.id for r in rows], kinds=("weights", "sampler_weights")
    )
    return TrainingRunList(
        training_runs=[TrainingRun.from_row(r, latest[r.id]) for r in rows],
        cursor=OffsetCursor(offset=offset, limit=limit, total_count=total),
    )


def training_run_info(session: Session, *, tenant: Caller, run_id: str) -> TrainingRun:
    row = training_run(session, tenant, run_id, param="run_id")
    latest = repo.latest_checkpoints(
        session, tenant_id=tenant.id, session_ids=[row.id], kinds=("weights", "sampler_weights")
    )
    return TrainingRun.from_row(row, latest[row.id])


def run_checkpoints(session: Session, *, tenant: Caller, run_id: str) -> CheckpointList:
    row = training_run(session, tenant, run_id, param="run_id")
    rows = repo.checkpoints_by_run(session, tenant_id=tenant.id, session_ids=[row.id])[row.id]
    return CheckpointList(checkpoints=[TinkerCheckpoint.from_row(c) for c in rows])


def user_checkpoints(session: Session, *, tenant: Caller, limit: int, offset: int) -> CheckpointList:
    """A page of all the tenant's checkpoints, newest first."""
    rows = repo.checkpoints_page(session, tenant_id=tenant.id, limit=max(1, min(limit, 1000)), offset=max(0, offset))
    return CheckpointList(checkpoints=[TinkerCheckpoint.from_row(c) for c in rows])


def _checkpoint_ref(run_id: str, kind: str, name: str) -> TinkerPath:
    """The checkpoint a REST path names (``/training_runs/<run>/checkpoints/<kind>/<name>``), checked as a path."""
    return parse_path(tinker_path(run_id, kind, name), param="checkpoint_id")


def delete_checkpoint(
    session: Session, *, store: ArtifactStore, tenant: Caller, run_id: str, kind: str, name: str
) -> Empty:
    """Forget the checkpoint and delete its bytes, unless a training session still starts from them."""
    path = _checkpoint_ref(run_id, kind, name)
    key = repo.delete_checkpoint(session, tenant_id=tenant.id, session_id=path.run_id, kind=path.kind, name=path.name)
    if key is None:
        raise NotFound("checkpoint", str(path), param="checkpoint_id")
    if not repo.state_in_use(session, storage_key=key):
        store.delete_prefix(key)
    return Empty()


def set_checkpoint_ttl(session: Session, *, tenant: Caller, run_id: str, kind: str, name: str, body: TtlBody) -> Empty:
    path = _checkpoint_ref(run_id, kind, name)
    found = repo.set_checkpoint_ttl(
        session,
        tenant_id=tenant.id,
        session_id=path.run_id,
        kind=path.kind,
        name=path.name,
        ttl_seconds=body.ttl_seconds,
    )
    if not found:
        raise NotFound("checkpoint", str(path), param="checkpoint_id")
    return Empty()


def external_weights_urls(
    session: Session, *, store: ArtifactStore, tenant: Caller, run_id: str, name: str, base_url: str
) -> ExternalWeightsUrls:
    """Unauthenticated download URLs of the exported adapter's files (the SDK fetches them with a plain GET). The
    token in them was made with the export (``repo.record_checkpoint``): listing them writes nothing."""
    path = _checkpoint_ref(run_id, "external_weights", name)
    row = _checkpoint(session, tenant, path, param="checkpoint_id")
    if row.download_token is None:
        raise Conflict(f"{path} was exported before its download links were made with the export: export it again")
    prefix = row.storage_key + "/"
    files = [key.removeprefix(prefix) for key in store.list(row.storage_key)]
    urls = {f: f"{base_url}/api/v1/weights/{row.download_token}/{f}" for f in files}
    expires = row.expires_at or int(time.time()) + EXPORT_URLS_VALID_S
    return ExternalWeightsUrls(urls=urls, expires=iso_time(expires))


def export_key(conn: Connection, *, token: str, filename: str) -> str:
    """The store key of one file of the exported weights that ``token`` downloads, while the export lasts; a 404
    otherwise (an unknown token, an expired export, a name that is not a file of the export's folder)."""
    found = repo.export_by_token(conn, token=token)
    if found is None or "/" in filename or filename.startswith("."):
        raise NotFound("weights", filename, param="filename")
    key, expires_at = found
    if expires_at is not None and expires_at < time.time():
        raise NotFound("weights", filename, param="filename")
    return f"{key}/{filename}"


def open_export(store: ArtifactStore, *, key: str, filename: str) -> BinaryIO:
    try:
        return store.open(key)
    except Exception:
        raise NotFound("weights", filename, param="filename") from None


# -- the dashboard's listing ----------------------------------------------------------------------------------------

MAX_LIST_LIMIT = 100


def page(
    session: Session, *, tenant: Caller, after: str | None, limit: int
) -> tuple[list[tuple[TrainingSession, list[SessionCheckpoint]]], bool]:
    """The tenant's training sessions, newest first, after the one named ``after``, with their checkpoints; and
    whether more follow. Two queries for any page size (three with ``after``)."""
    rows, more = repo.training_sessions_page(session, tenant_id=tenant.id, after=after, limit=limit)
    saved = repo.checkpoints_by_run(session, tenant_id=tenant.id, session_ids=[r.id for r in rows])
    return [(r, saved[r.id]) for r in rows], more


def detail(
    session: Session, *, tenant: Caller, session_id: str, recent: int
) -> tuple[TrainingSession, list[SessionCheckpoint], list[SessionRequest]]:
    row = training_run(session, tenant, session_id, param="session_id")
    checkpoints = repo.checkpoints_by_run(session, tenant_id=tenant.id, session_ids=[row.id])[row.id]
    return row, checkpoints, repo.recent_requests(session, session_id=row.id, limit=recent)

"""The Tinker-compatible API's service layer (issue 17): what each request of the official ``tinker`` SDK does.

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
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from sqlalchemy.orm import Session

from api import ids
from api.auth import Caller
from api.errors import ApiError, InvalidRequest, NotFound
from api.orm import Sampler, SessionCheckpoint, SessionRequest, TrainingSession
from api.repositories import tinker as repo
from api.settings import Settings
from api.tinker_wire import decode_forward_backward, decompress

CHECKPOINT_KINDS = ("weights", "sampler_weights", "external_weights")
NAME_PATTERN = re.compile(r"[A-Za-z0-9_.\-]{1,128}")
MAX_LORA_RANK = 256
TINKER_SCHEME = "tinker://"

# -- request bodies (the SDK adds fields over versions, and a literal `type`: unknown keys are ignored, not refused,
# so that a newer SDK keeps working) ----------------------------------------------------------------------------------


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class CreateSessionBody(_Body):
    tags: list[str] = Field(default_factory=list)
    user_metadata: dict[str, Any] | None = None
    sdk_version: str | None = None


class SessionRefBody(_Body):
    session_id: str


class FinishReason(_Body):
    type: Literal["success", "errored", "interrupted"] = "success"


class FinishBody(_Body):
    reason: FinishReason = Field(default_factory=FinishReason)
    detail: str | None = None


class ModelRefBody(_Body):
    model_id: str


class WeightsInfoBody(_Body):
    tinker_path: str


class FutureBody(_Body):
    request_id: str
    allow_metadata_only: bool = False


class TtlBody(_Body):
    ttl_seconds: int | None = Field(None, gt=0)


class LoraConfigBody(_Body):
    rank: int = Field(32, ge=1, le=MAX_LORA_RANK)
    seed: int | None = None
    train_unembed: bool = True
    train_mlp: bool = True
    train_attn: bool = True


class OptimizerConfigBody(_Body):
    type: str = "adamw"


class CreateModelBody(_Body):
    session_id: str
    model_seq_id: int = Field(ge=0)
    base_model: str
    lora_config: LoraConfigBody = Field(default_factory=LoraConfigBody)
    optimizer_config: OptimizerConfigBody | None = None
    user_metadata: dict[str, Any] | None = None


class AdamParamsBody(_Body):
    learning_rate: float = Field(1e-4, ge=0)
    beta1: float = Field(0.9, ge=0, lt=1)
    beta2: float = Field(0.95, ge=0, lt=1)
    eps: float = Field(1e-12, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    grad_clip_norm: float = Field(0.0, ge=0)


class OptimStepBody(_Body):
    model_id: str
    seq_id: int
    adam_params: AdamParamsBody | None = None
    optimizer_params: dict[str, Any] | None = None


class SaveWeightsBody(_Body):
    model_id: str
    seq_id: int
    path: str | None = None
    ttl_seconds: int | None = Field(None, gt=0)
    sampling_session_seq_id: int | None = Field(None, ge=0)
    kind: str | None = None


class LoadWeightsBody(_Body):
    path: str
    optimizer: bool = False
    model_id: str | None = None
    seq_id: int | None = None
    session_id: str | None = None
    model_seq_id: int | None = Field(None, ge=0)
    base_model: str | None = None
    user_metadata: dict[str, Any] | None = None


class CreateSamplingSessionBody(_Body):
    session_id: str
    sampling_session_seq_id: int = Field(ge=0)
    base_model: str | None = None
    model_path: str | None = None


class SamplingParamsBody(_Body):
    max_tokens: int | None = Field(None, ge=1)
    seed: int | None = None
    stop: str | list[str] | list[int] | None = None
    temperature: float = Field(1.0, ge=0)
    top_k: int = -1
    top_p: float = Field(1.0, gt=0, le=1)


class ChunkBody(_Body):
    type: str = "encoded_text"
    tokens: list[int] = Field(default_factory=list)


class PromptBody(_Body):
    chunks: list[ChunkBody]


class SampleBody(_Body):
    sampling_session_id: str
    seq_id: int
    num_samples: int = Field(1, ge=1, le=256)
    prompt: PromptBody
    sampling_params: SamplingParamsBody
    prompt_logprobs: bool = False
    topk_prompt_logprobs: int = 0
    topk_sample_logprobs: int = 0
    prompt_alt_tokens_k: int = 0
    target_prompt_logprobs: Any = None


def parse(model: type[_Body], raw: bytes) -> Any:
    """A request body as ``model``, or a 400 naming the field."""
    try:
        data = json.loads(raw or b"{}")
    except ValueError:
        raise InvalidRequest("the request body is not JSON") from None
    try:
        return model.model_validate(data)
    except ValidationError as err:
        first = err.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or None
        raise InvalidRequest(f"{where}: {first['msg']}", param=where) from None


# -- paths ----------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TinkerPath:
    run_id: str
    kind: str
    name: str

    def __str__(self) -> str:
        return f"{TINKER_SCHEME}{self.run_id}/{self.kind}/{self.name}"


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


# -- sessions and models --------------------------------------------------------------------------------------------


def _client_session(session: Session, tenant: Caller, id: str, *, param: str = "session_id") -> Any:
    row = repo.client_session(session, tenant_id=tenant.id, id=id)
    if row is None:
        raise NotFound("session", id, param=param)
    return row


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


def create_model(session: Session, *, settings: Settings, tenant: Caller, body: CreateModelBody) -> dict[str, Any]:
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
) -> dict[str, Any]:
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
    return {"request_id": request_id, "model_id": model_id}


def get_info(session: Session, *, tenant: Caller, model_id: str) -> dict[str, Any]:
    row = training_run(session, tenant, model_id)
    return {
        "type": "get_info",
        "model_id": row.id,
        "model_data": {"arch": "lora", "model_name": row.base_model, "tokenizer_id": row.base_model},
        "is_lora": True,
        "lora_rank": row.lora.get("rank"),
        "model_name": row.base_model,
        "optimizer_config": {"type": "adamw"},
    }


def weights_info(session: Session, *, tenant: Caller, tinker_path: str) -> dict[str, Any]:
    path = parse_path(tinker_path, param="tinker_path")
    row = training_run(session, tenant, path.run_id, param="tinker_path")
    if repo.checkpoint(session, tenant_id=tenant.id, session_id=row.id, kind=path.kind, name=path.name) is None:
        raise NotFound("checkpoint", tinker_path, param="tinker_path")
    lora = row.lora
    return {
        "base_model": row.base_model,
        "is_lora": True,
        "lora_rank": lora.get("rank"),
        "train_unembed": lora.get("train_unembed", True),
        "train_mlp": lora.get("train_mlp", True),
        "train_attn": lora.get("train_attn", True),
        "optimizer_config": {"type": "adamw"},
    }


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


def forward_backward(session: Session, *, tenant: Caller, body: bytes, content_encoding: str | None) -> dict[str, Any]:
    plain = decompress(body, content_encoding=content_encoding)
    request = decode_forward_backward(plain, content_encoding=None)
    run = training_run(session, tenant, request.model_id)
    kind = "forward" if request.forward_only else "forward_backward"
    request_id = _enqueue(
        session,
        tenant=tenant,
        serving_id=run.id,
        kind=kind,
        seq_id=request.seq_id,
        dedupe_key=f"train:{run.id}:{request.seq_id}",
        payload=plain,
    )
    return {"request_id": request_id, "model_id": run.id}


def optim_step(session: Session, *, tenant: Caller, body: OptimStepBody) -> dict[str, Any]:
    run = training_run(session, tenant, body.model_id)
    if body.adam_params is None:
        kind = (body.optimizer_params or {}).get("type")
        raise InvalidRequest(f"optimizer_params: {kind!r} is not offered; send adam_params", param="optimizer_params")
    payload = json.dumps({"adam_params": body.adam_params.model_dump()}).encode()
    return _train_request(session, tenant=tenant, run=run, kind="optim_step", seq_id=body.seq_id, payload=payload)


def _train_request(
    session: Session, *, tenant: Caller, run: TrainingSession, kind: str, seq_id: int, payload: bytes
) -> dict[str, Any]:
    request_id = _enqueue(
        session,
        tenant=tenant,
        serving_id=run.id,
        kind=kind,
        seq_id=seq_id,
        dedupe_key=f"train:{run.id}:{seq_id}",
        payload=payload,
    )
    return {"request_id": request_id, "model_id": run.id}


def save_weights(
    session: Session, *, tenant: Caller, body: SaveWeightsBody, kind: Literal["weights", "external_weights"]
) -> dict[str, Any]:
    run = training_run(session, tenant, body.model_id)
    name = check_name(body.path)
    payload = json.dumps({"name": name, "ttl_seconds": body.ttl_seconds}).encode()
    request_kind = "save_weights" if kind == "weights" else "save_weights_external"
    return _train_request(session, tenant=tenant, run=run, kind=request_kind, seq_id=body.seq_id, payload=payload)


def save_weights_for_sampler(session: Session, *, tenant: Caller, body: SaveWeightsBody) -> dict[str, Any]:
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


def load_weights(session: Session, *, settings: Settings, tenant: Caller, body: LoadWeightsBody) -> dict[str, Any]:
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
) -> dict[str, Any]:
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
) -> dict[str, Any]:
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
    return {"type": "create_sampling_session", "sampling_session_id": sampler_id}


def get_sampler(session: Session, *, tenant: Caller, sampler_id: str) -> dict[str, Any]:
    row = repo.sampler(session, tenant_id=tenant.id, id=sampler_id)
    if row is None:
        raise NotFound("sampler", sampler_id, param="sampler_id")
    return {"sampler_id": row.id, "base_model": row.base_model, "model_path": row.model_path}


def sample(session: Session, *, tenant: Caller, body: SampleBody) -> dict[str, Any]:
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
    return {"request_id": request_id, "sample_sequence_ids": [f"{request_id}:{i}" for i in range(body.num_samples)]}


# -- futures --------------------------------------------------------------------------------------------------------


class FutureGone(ApiError):
    status = 404


def future(session: Session, *, tenant: Caller, request_id: str) -> SessionRequest | None:
    """The request once finished (None while it waits or runs); a 404 for another tenant's or an unknown id."""
    row = repo.request(session, tenant_id=tenant.id, id=request_id)
    if row is None:
        raise NotFound("request", request_id, param="request_id")
    return row if row.status in (repo.DONE, repo.FAILED) else None


# -- the dashboard's listing ----------------------------------------------------------------------------------------

MAX_LIST_LIMIT = 100


def page(
    session: Session, *, tenant: Caller, after: str | None, limit: int
) -> tuple[list[tuple[TrainingSession, list[SessionCheckpoint]]], bool]:
    """The tenant's training sessions, newest first, after the one named ``after``; and whether more follow."""
    rows = repo.training_sessions_page(session, tenant_id=tenant.id, after=after, limit=limit + 1)
    more = len(rows) > limit
    rows = rows[:limit]
    return [(r, repo.checkpoints(session, tenant_id=tenant.id, session_id=r.id)) for r in rows], more


def detail(
    session: Session, *, tenant: Caller, session_id: str, recent: int
) -> tuple[TrainingSession, list[SessionCheckpoint], list[SessionRequest]]:
    row = training_run(session, tenant, session_id, param="session_id")
    checkpoints = repo.checkpoints(session, tenant_id=tenant.id, session_id=row.id)
    return row, checkpoints, repo.recent_requests(session, session_id=row.id, limit=recent)

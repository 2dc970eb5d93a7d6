"""The Tinker-compatible API's contract: the request bodies of the official ``tinker`` SDK, the answers
it reads, and the dashboard's view of training sessions (``GET /v1/training_sessions``, an extension of the
OpenAI-shaped API with its keys and envelope; the SDK's own protocol is under ``/api/v1``).

The SDK's answers are shaped as the SDK's own types (``tinker.types``) parse them: the field names, and timestamps as
ISO 8601 strings.
"""

from __future__ import annotations

import datetime as dt
import json
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from api.errors import InvalidRequest
from api.orm import SessionCheckpoint, SessionRequest, TrainingSession

TINKER_SCHEME = "tinker://"
MAX_LORA_RANK = 256
CheckpointKind = Literal["weights", "sampler_weights", "external_weights"]
# The SDK's name of each kind of checkpoint (``tinker.types.CheckpointType``).
CHECKPOINT_TYPES: dict[str, Literal["training", "sampler", "external"]] = {
    "weights": "training",
    "sampler_weights": "sampler",
    "external_weights": "external",
}


def tinker_path(run_id: str, kind: str, name: str) -> str:
    return f"{TINKER_SCHEME}{run_id}/{kind}/{name}"


def iso_time(ts: int | float | None) -> str | None:
    """A unix time as the SDK reads times: ISO 8601, UTC."""
    return None if ts is None else dt.datetime.fromtimestamp(ts, dt.UTC).isoformat()


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


B = TypeVar("B", bound=_Body)


def parse(model: type[B], raw: bytes) -> B:
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


# -- the SDK's answers ----------------------------------------------------------------------------------------------


class ClientConfig(BaseModel):
    """Plain HTTP/1.1 with httpx (not the SDK's pyqwest transport), keys only (no JWT exchange), uncompressed
    forward_backward bodies; the single-request poller."""

    pjwt_auth_enabled: bool = False
    use_pyqwest_transport: bool = False
    proto_compress_fwdbwd: bool = False
    sample_use_retrieve_futures: bool = False
    custom_loss_server_side: bool = False


class DynamicConfig(BaseModel):
    refresh_interval_sec: int = 300
    sample_cancel_enabled: bool = False


class Empty(BaseModel):
    """``{}``: done."""


class Accepted(BaseModel):
    status: Literal["accepted"] = "accepted"


class Healthy(BaseModel):
    status: Literal["ok"] = "ok"


class SupportedModel(BaseModel):
    model_name: str
    trainable: bool = True
    sampleable: bool = True


class ServerCapabilities(BaseModel):
    supported_models: list[SupportedModel]


class SessionCreated(BaseModel):
    type: Literal["create_session"] = "create_session"
    session_id: str


class HeartbeatAck(BaseModel):
    type: Literal["session_heartbeat"] = "session_heartbeat"


class SessionFinishedDetail(BaseModel):
    """The 410 of a heartbeat of a finished session: it ends the SDK's heartbeat loop."""

    detail: str


class ModelFuture(BaseModel):
    """A queued (or already answered) request of a training run: the future to poll."""

    request_id: str
    model_id: str


class SampleFuture(BaseModel):
    request_id: str
    sample_sequence_ids: list[str]


class ModelData(BaseModel):
    arch: Literal["lora"] = "lora"
    model_name: str
    tokenizer_id: str


class OptimizerConfig(BaseModel):
    type: Literal["adamw"] = "adamw"


class ModelInfo(BaseModel):
    type: Literal["get_info"] = "get_info"
    model_id: str
    model_data: ModelData
    is_lora: bool = True
    lora_rank: int | None
    model_name: str
    optimizer_config: OptimizerConfig = Field(default_factory=OptimizerConfig)

    @classmethod
    def from_row(cls, row: TrainingSession) -> ModelInfo:
        data = ModelData(model_name=row.base_model, tokenizer_id=row.base_model)
        return cls(model_id=row.id, model_data=data, lora_rank=row.lora.get("rank"), model_name=row.base_model)


class WeightsInfo(BaseModel):
    base_model: str
    is_lora: bool = True
    lora_rank: int | None
    train_unembed: bool
    train_mlp: bool
    train_attn: bool
    optimizer_config: OptimizerConfig = Field(default_factory=OptimizerConfig)

    @classmethod
    def from_row(cls, row: TrainingSession) -> WeightsInfo:
        lora = row.lora
        return cls(
            base_model=row.base_model,
            lora_rank=lora.get("rank"),
            train_unembed=lora.get("train_unembed", True),
            train_mlp=lora.get("train_mlp", True),
            train_attn=lora.get("train_attn", True),
        )


class SamplingSessionCreated(BaseModel):
    type: Literal["create_sampling_session"] = "create_sampling_session"
    sampling_session_id: str


class SamplerInfo(BaseModel):
    sampler_id: str
    base_model: str
    model_path: str | None


class TryAgain(BaseModel):
    """The 408 of a poll whose request has no result yet: the SDK polls again at once."""

    type: Literal["try_again"] = "try_again"
    request_id: str
    queue_state: Literal["active"] = "active"


class RequestFailed(BaseModel):
    """The answer of a poll whose request failed (``tinker.types.RequestFailedResponse``)."""

    error: str
    category: str

    @classmethod
    def from_error(cls, error: dict[str, Any] | str | None) -> RequestFailed:
        payload = error if isinstance(error, dict) else json.loads(error or "{}")
        return cls(error=payload.get("error", "failed"), category=payload.get("category", "unknown"))


class TinkerCheckpoint(BaseModel):
    """``tinker.types.Checkpoint``: a saved state, sampler weights or exported weights of a training run."""

    checkpoint_id: str
    checkpoint_type: Literal["training", "sampler", "external"]
    time: str | None
    tinker_path: str
    size_bytes: int
    public: bool = False
    expires_at: str | None

    @classmethod
    def from_row(cls, row: SessionCheckpoint) -> TinkerCheckpoint:
        return cls(
            checkpoint_id=f"{row.kind}/{row.name}",
            checkpoint_type=CHECKPOINT_TYPES[row.kind],
            time=iso_time(row.created_at),
            tinker_path=tinker_path(row.session_id, row.kind, row.name),
            size_bytes=row.size_bytes,
            expires_at=iso_time(row.expires_at),
        )


class TrainingRun(BaseModel):
    """``tinker.types.TrainingRun``: a training session with its latest saved state and sampler weights."""

    training_run_id: str
    base_model: str
    model_owner: str
    is_lora: bool = True
    corrupted: bool = False
    lora_rank: int | None
    last_request_time: str | None
    last_checkpoint: TinkerCheckpoint | None
    last_sampler_checkpoint: TinkerCheckpoint | None
    user_metadata: dict[str, Any] | None

    @classmethod
    def from_row(cls, row: TrainingSession, latest: dict[str, SessionCheckpoint]) -> TrainingRun:
        """``latest``: the run's newest checkpoint of each kind."""
        weights, sampler = latest.get("weights"), latest.get("sampler_weights")
        return cls(
            training_run_id=row.id,
            base_model=row.base_model,
            model_owner=row.tenant_id,
            lora_rank=row.lora.get("rank"),
            last_request_time=iso_time(row.last_request_at or row.created_at),
            last_checkpoint=None if weights is None else TinkerCheckpoint.from_row(weights),
            last_sampler_checkpoint=None if sampler is None else TinkerCheckpoint.from_row(sampler),
            user_metadata=row.user_metadata,
        )


class OffsetCursor(BaseModel):
    """The SDK pages its lists by offset (``tinker.types.Cursor``)."""

    offset: int
    limit: int
    total_count: int


class TrainingRunList(BaseModel):
    training_runs: list[TrainingRun]
    cursor: OffsetCursor


class CheckpointList(BaseModel):
    checkpoints: list[TinkerCheckpoint]


class ExternalWeightsUrls(BaseModel):
    urls: dict[str, str]  # file name -> its download URL
    expires: str | None


class SessionIds(BaseModel):
    sessions: list[str]


class ClientSessionInfo(BaseModel):
    training_run_ids: list[str]
    sampler_ids: list[str]
    user_metadata: dict[str, Any] | None


# -- the dashboard's view ---------------------------------------------------------------------------------------------


class SavedStateObject(BaseModel):
    """A saved state, sampler weights or exported weights: its ``tinker://`` path and when it was saved."""

    path: str
    kind: CheckpointKind
    name: str
    optimizer_steps: int
    size_bytes: int
    created_at: int
    expires_at: int | None

    @classmethod
    def from_row(cls, session_id: str, row: SessionCheckpoint) -> SavedStateObject:
        return cls(
            path=tinker_path(session_id, row.kind, row.name),
            kind=row.kind,  # type: ignore[arg-type]
            name=row.name,
            optimizer_steps=row.optimizer_steps,
            size_bytes=row.size_bytes,
            created_at=row.created_at,
            expires_at=row.expires_at,
        )


class SessionRequestObject(BaseModel):
    """One request of the session: its kind (forward_backward, optim_step, sample, ...), outcome and loss."""

    id: str
    kind: str
    status: Literal["pending", "running", "done", "failed"]
    loss: float | None
    error: str | None
    created_at: float
    finished_at: float | None

    @classmethod
    def from_row(cls, row: SessionRequest) -> SessionRequestObject:
        return cls(
            id=row.id,
            kind=row.kind,
            status=row.status,  # type: ignore[arg-type]
            loss=row.loss,
            error=(row.error or {}).get("error"),
            created_at=row.created_at,
            finished_at=row.finished_at,
        )


class TrainingSessionObject(BaseModel):
    object: Literal["training_session"] = "training_session"
    id: str
    client_session_id: str
    base_model: str
    lora_rank: int | None
    status: Literal["loaded", "unloaded", "closed"]
    worker: str | None  # the worker holding it in memory
    created_at: int
    last_request_at: int | None
    request_count: int
    optimizer_steps: int
    last_loss: float | None
    restores: int  # times it continued from its saved state after its worker was lost
    saved_steps: int  # optimiser steps in the state it would continue from
    saved_states: list[SavedStateObject]
    recent_requests: list[SessionRequestObject] | None = None

    @classmethod
    def from_row(
        cls,
        row: TrainingSession,
        checkpoints: list[SessionCheckpoint],
        requests: list[SessionRequest] | None = None,
    ) -> TrainingSessionObject:
        status: Literal["loaded", "unloaded", "closed"] = (
            "loaded" if row.loaded_on is not None else "closed" if row.closed_at is not None else "unloaded"
        )
        return cls(
            id=row.id,
            client_session_id=row.client_session_id,
            base_model=row.base_model,
            lora_rank=row.lora.get("rank"),
            status=status,
            worker=row.loaded_on,
            created_at=row.created_at,
            last_request_at=row.last_request_at,
            request_count=row.request_count,
            optimizer_steps=row.optimizer_steps,
            last_loss=row.last_loss,
            restores=row.restores,
            saved_steps=row.saved_steps,
            saved_states=[SavedStateObject.from_row(row.id, c) for c in checkpoints],
            recent_requests=None if requests is None else [SessionRequestObject.from_row(r) for r in requests],
        )

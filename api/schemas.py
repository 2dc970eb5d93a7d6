"""API schemas: the contract. Pydantic models shaped exactly like OpenAI's objects, strict on input.

ORM rows never leave the service layer; each resource has one conversion here (``from_row``) that gives the
prefixed ids and unix-second timestamps the rows already hold. Request bodies forbid unknown fields, so a typo is a
400 naming the field instead of a silently ignored option.
"""

from __future__ import annotations

from typing import Any, Generic, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_core import InitErrorDetails, PydanticCustomError
from sqlalchemy import Row

from api import ids
from api.openai_metrics import openai_names, validates_on_whole_file
from api.orm import Checkpoint, File, Job, JobEvent
from api.status import JobStatus
from trainer.spec import config, json_values

T = TypeVar("T")

FILE_PURPOSES = ("fine-tune", "evals")  # what a client may upload; the worker adds `fine-tune-results`
# OpenAI's range for `expires_after.seconds` on upload: an hour to thirty days.
FILE_EXPIRY_MIN_SECONDS, FILE_EXPIRY_MAX_SECONDS = 3600, 2_592_000


class _Request(BaseModel):
    """A request body: unknown fields refused, and every value in it, at any depth, one the service can store and
    send back (``trainer.spec.json_values.check``: no NUL, no lone surrogate, no NaN or infinity, bounded nesting), so
    that nothing is stored that PostgreSQL cannot read back and no answer fails to encode. The error names the value's
    path (``metadata.k``, ``method.grpo.grader.input``) and never echoes the value."""

    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _storable_values(cls, data: Any) -> Any:
        try:
            json_values.check(data)
        except json_values.JsonValueError as err:
            # A ValidationError raised here keeps its location, so the 400's ``param`` is the value's path.
            error = PydanticCustomError("invalid_value", err.detail)
            raise ValidationError.from_exception_data(
                cls.__name__, [InitErrorDetails(type=error, loc=err.path, input=None)]
            ) from None
        return data


# ---------------------------------------------------------------------------------------------------------------
# Lists


class ListObject(BaseModel, Generic[T]):
    """OpenAI's list envelope; the client pages with ``after=<last item's id>`` while ``has_more``."""

    object: Literal["list"] = "list"
    data: list[T]
    has_more: bool = False


class CursorListObject(ListObject[T], Generic[T]):
    """The envelope with ``first_id``/``last_id``, as OpenAI's file and checkpoint lists have it."""

    first_id: str | None = None
    last_id: str | None = None


def cursor_list(items: list[Any], *, has_more: bool) -> dict[str, Any]:
    """Fields of a :class:`CursorListObject` for items that carry an ``id``."""
    return {
        "data": items,
        "has_more": has_more,
        "first_id": items[0].id if items else None,
        "last_id": items[-1].id if items else None,
    }


# ---------------------------------------------------------------------------------------------------------------
# Files


class FileObject(BaseModel):
    id: str
    object: Literal["file"] = "file"
    bytes: int
    created_at: int
    filename: str
    purpose: str
    status: Literal["uploaded", "processed", "error"] = "processed"
    status_details: str | None = None
    expires_at: int | None = None
    lines: int = Field(description="extension: the number of JSONL records")

    @classmethod
    def from_row(cls, row: File) -> FileObject:
        return cls(
            id=row.id,
            bytes=row.bytes,
            created_at=row.created_at,
            filename=row.filename,
            purpose=row.purpose,
            expires_at=row.expires_at,
            lines=row.lines,
        )


class FileDeleted(BaseModel):
    id: str
    object: Literal["file"] = "file"
    deleted: bool


# ---------------------------------------------------------------------------------------------------------------
# Jobs


class JobCreate(_Request):
    """``POST /v1/fine_tuning/jobs``. ``method`` is validated by :func:`trainer.spec.config.parse_spec`, which names the
    offending field, and stored as its canonical JSON (``JobSpec.to_json``), ``integrations`` included
    (``trainer.spec.integrations``). OpenAI's deprecated top-level ``hyperparameters`` move under the method."""

    model: str
    training_file: str
    validation_file: str | None = None
    seed: int | None = Field(None, ge=0, le=2**31 - 1)
    suffix: str | None = None
    metadata: dict[str, str] | None = None
    method: dict[str, Any] | None = Field(
        None,
        description="`{type, <type>: {grader, hyperparameters, lora}}`. Every hyperparameter is "
        "optional, and every number finite and within its range, among others: batch_size 1 to "
        f"{config.MAX_BATCH}, group_size 1 to {config.MAX_GROUP} (batch_size × group_size at most "
        f"{config.MAX_ROLLOUT}), max_steps at most {config.MAX_STEPS} (and n_epochs over the data as many steps), "
        f"n_epochs 1 to 1000, token lengths at most {config.MAX_TOKENS}, learning_rate × learning_rate_multiplier "
        "at most 1, beta 0 to 10, weight_decay 0 to 1, lora.r 1 to 1024, lora.alpha at most 4096; a value out of "
        "range is a 400 naming it. `proxima train` takes the same spec with the same ranges.",
    )
    hyperparameters: dict[str, Any] | None = None
    resources: dict[str, Any] | None = Field(
        None,
        description='(extension) what the job runs on: `{"gpus": N}`, N devices training it data parallel (the '
        "deployment's `PROXIMA_MAX_JOB_GPUS` at most); `\"shard_base\": true` shards the frozen base's weights "
        "across them (FSDP2; grpo, reinforcement, dr_grpo, dapo, rloo, reinforce and ppo, single-turn), and "
        '`"gather_for_generation": true` gathers it whole for each generation. Default one device',
    )
    integrations: list[Any] | None = Field(
        None,
        description="experiment trackers the worker exports the metrics, rollouts and config to: OpenAI's "
        '`{"type": "wandb", "wandb": {"project", "entity", "name", "tags"}}` and `{"type": "mlflow", "mlflow": '
        '{"experiment_name", "run_name", "tags": {...}}}`, at most one of each; a tracker this deployment has not '
        "configured is a 400",
    )

    @field_validator("metadata")
    @classmethod
    def _metadata_sizes(cls, v: dict[str, str] | None) -> dict[str, str] | None:
        """OpenAI's limits: keys up to 64 characters, values up to 512 (the pair count is the spec's check)."""
        for key, value in (v or {}).items():
            if not key or len(key) > 64:
                raise ValueError(f"key {key[:70]!r}: keys are 1 to 64 characters")
            if len(value) > 512:
                raise ValueError(f"value of {key!r}: values are at most 512 characters")
        return v


class JobError(BaseModel):
    code: str
    message: str
    param: str | None = None


class JobHyperparameters(BaseModel):
    """OpenAI's summary of the method's hyperparameters."""

    n_epochs: int | Literal["auto"] | None = None
    batch_size: int | Literal["auto"] | None = None
    learning_rate_multiplier: float | Literal["auto"] | None = None


class FineTuningJob(BaseModel):
    id: str
    object: Literal["fine_tuning.job"] = "fine_tuning.job"
    model: str
    created_at: int
    finished_at: int | None
    estimated_finish: int | None
    fine_tuned_model: str | None
    organization_id: str
    status: JobStatus
    training_file: str
    validation_file: str | None
    result_files: list[str]
    trained_tokens: int | None
    hyperparameters: JobHyperparameters
    method: dict[str, Any]
    integrations: list[Any] = Field(default_factory=list)
    seed: int
    metadata: dict[str, str] | None
    error: JobError | None
    # Extensions
    suffix: str | None
    current_step: int
    total_steps: int | None
    resources: dict[str, Any] = Field(
        default_factory=lambda: {"gpus": 1},
        description='(extension) what the job runs on: `{"gpus": N}`, N devices training it data parallel, and '
        '`"shard_base": true` where the base is sharded across them',
    )

    @classmethod
    def from_row(cls, row: Job | Row[Any]) -> FineTuningJob:
        method = row.spec.get("method", {})
        hp = method.get(method.get("type", ""), {}).get("hyperparameters", {})
        return cls(
            id=row.id,
            model=row.model,
            created_at=row.created_at,
            finished_at=row.finished_at,
            estimated_finish=row.estimated_finish,
            fine_tuned_model=row.fine_tuned_model,
            organization_id=row.tenant_id,
            status=row.status,
            training_file=row.training_file,
            validation_file=row.validation_file,
            result_files=list(row.result_files or []),
            trained_tokens=row.trained_tokens,
            hyperparameters=JobHyperparameters(
                n_epochs=hp.get("n_epochs"),
                batch_size=hp.get("batch_size"),
                learning_rate_multiplier=hp.get("learning_rate_multiplier"),
            ),
            method=method,
            integrations=list(row.spec.get("integrations") or []),
            seed=row.seed,
            metadata=row.metadata_,
            error=JobError(**row.error) if row.error else None,
            suffix=row.suffix,
            current_step=row.current_step or 0,
            total_steps=row.total_steps,
            resources=row.spec.get("resources") or {"gpus": 1},
        )


class EstimateBasis(BaseModel):
    """What an estimate rests on: aggregates only, never another tenant's job."""

    jobs: int = Field(description="past jobs of this base model and method whose step times were measured (any tenant)")
    steps: int = Field(description="their training steps the figure rests on")
    scaled_by: str = Field(description="the size of a step the measured times are scaled by")
    reason: str | None = Field(None, description="why there is no duration, when there is none")


class JobEstimate(BaseModel):
    """``POST /v1/fine_tuning/estimates`` (extension): a job's size and duration before it is created."""

    object: Literal["fine_tuning.job.estimate"] = "fine_tuning.job.estimate"
    model: str
    method: str
    total_steps: int
    total_steps_from: Literal["max_steps", "training_file"] = Field(
        description="max_steps, or n_epochs over the training file's lines in batches of batch_size"
    )
    seconds_per_step: float | None
    estimated_duration_seconds: int | None
    basis: EstimateBasis
    hyperparameters: dict[str, Any] = Field(description="the method's hyperparameters as the job would be created")


class JobEventObject(BaseModel):
    id: str
    object: Literal["fine_tuning.job.event"] = "fine_tuning.job.event"
    created_at: int
    level: Literal["info", "warn", "error"]
    message: str
    type: Literal["message", "metrics"] = "message"
    data: dict[str, Any] | None = None

    @classmethod
    def from_row(cls, row: JobEvent) -> JobEventObject:
        data = row.data
        if row.type == "metrics" and data:  # a step's metrics: OpenAI's names beside ours (api.openai_metrics)
            data = {**data, **openai_names(data, full_validation=False)}
        return cls(
            id=row.id,
            created_at=row.created_at,
            level=row.level,  # type: ignore[arg-type]
            message=row.message,
            type=row.type,  # type: ignore[arg-type]
            data=data,
        )


class CheckpointObject(BaseModel):
    id: str
    object: Literal["fine_tuning.job.checkpoint"] = "fine_tuning.job.checkpoint"
    created_at: int
    fine_tuned_model_checkpoint: str
    fine_tuning_job_id: str
    step_number: int
    metrics: dict[str, float] = Field(
        description="the step's metrics under our names (trainer.spec.metrics) and, where one of ours measures the "
        "same thing, under OpenAI's (FineTuningJobCheckpoint.Metrics: train_loss, valid_loss, ...; RFT's "
        "train_reward_mean, valid_reward_mean); a name whose quantity is not measured is absent"
    )

    @classmethod
    def from_row(cls, row: Checkpoint, *, job: Job) -> CheckpointObject:
        ours = row.metrics or {}
        full = validates_on_whole_file(job.spec or {})
        return cls(
            id=row.id,
            created_at=row.created_at,
            fine_tuned_model_checkpoint=f"{fine_tuned_model_name(job)}:ckpt-step-{row.step_number}",
            fine_tuning_job_id=row.job_id,
            step_number=row.step_number,
            metrics={"step": float(row.step_number), **ours, **openai_names(ours, full_validation=full)},
        )


def fine_tuned_model_name(job: Job) -> str:
    return ids.fine_tuned_model_name(model=job.model, tenant_id=job.tenant_id, suffix=job.suffix, job_id=job.id)


class MetricsPoint(BaseModel):
    step: int
    metrics: dict[str, float]


class RolloutList(ListObject[dict[str, Any]]):
    """The rollouts of one step (``step`` null when none were written yet); ``steps`` lists the steps that have
    rollouts, oldest first, so a browser can page through them."""

    step: int | None = None
    steps: list[int] = Field(default_factory=list)


# ---------------------------------------------------------------------------------------------------------------
# Graders


class GraderRunRequest(_Request):
    grader: dict[str, Any]
    model_sample: str
    item: dict[str, Any] | None = None


class GraderValidateRequest(_Request):
    grader: dict[str, Any]


class GraderValidateResponse(BaseModel):
    grader: dict[str, Any]


class GraderRunErrors(BaseModel):
    """OpenAI's error flags of a grader run; ours map onto ``invalid_variable_error`` (an item field the templates
    name is missing), ``formula_parse_error`` (a multi grader's formula failed), ``unresponsive_reward_error`` (grading
    took longer than its limit, or an endpoint grader's service gave no answer), ``other_error`` (an endpoint's answer
    that is not a score, cosine without embeddings among others), a python grader's ``python_grader_runtime_error``
    (its code raised, returned no finite number or defines no usable ``grade``; the first one's message in
    ``…_details``) and ``python_grader_server_error`` (its sandbox stopped it; ``…_type``: timeout, cpu_limit,
    output_limit, crash), and a model grader's ``model_grader_parse_error`` (the judge's answer is not the result
    asked for), ``model_grader_refusal_error`` and ``model_grader_server_error`` (no answer; details in
    ``…_details``)."""

    formula_parse_error: bool = False
    invalid_variable_error: bool = False
    model_grader_parse_error: bool = False
    model_grader_refusal_error: bool = False
    model_grader_server_error: bool = False
    model_grader_server_error_details: str | None = None
    other_error: bool = False
    python_grader_runtime_error: bool = False
    python_grader_runtime_error_details: str | None = None
    python_grader_server_error: bool = False
    python_grader_server_error_type: str | None = None
    sample_parse_error: bool = False
    truncated_observation_error: bool = False
    unresponsive_reward_error: bool = False


class GraderRunMetadata(BaseModel):
    name: str
    type: str
    errors: GraderRunErrors
    execution_time: float
    scores: dict[str, float]
    token_usage: int | None = None
    sampled_model_name: str | None = None
    error_messages: list[str] = Field(default_factory=list, description="extension: what raised the flags")


class GraderRunResponse(BaseModel):
    reward: float
    metadata: GraderRunMetadata
    sub_rewards: dict[str, float]
    model_grader_token_usage_per_model: dict[str, Any] = Field(default_factory=dict)


# ---------------------------------------------------------------------------------------------------------------
# Models


class ModelObject(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str


class ModelDeleted(BaseModel):
    """OpenAI's answer to ``DELETE /v1/models/{model}``."""

    id: str
    object: Literal["model"] = "model"
    deleted: bool


# ---------------------------------------------------------------------------------------------------------------
# Health


class Health(BaseModel):
    status: Literal["ok"] = "ok"
    checks: dict[str, str] = Field(default_factory=dict)

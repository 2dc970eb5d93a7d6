"""A job's ``integrations``: the experiment trackers its worker exports to (``worker.trackers``), as the job spec holds
them.

OpenAI's Weights & Biases integration, ``{"type": "wandb", "wandb": {"project", "entity", "name", "tags"}}``, and
ours for MLflow in the same spirit, ``{"type": "mlflow", "mlflow": {"experiment_name", "run_name", "tags"}}``. A job
names where its run goes and what it is called; the tracker's address and credentials are the deployment's, never the
job's (whether a deployment configures a tracker is the API's check, ``api.services.integrations``). Validated
strictly, naming the field (``integrations.0.wandb.project``), and kept in their normalised form (every field present,
``null`` or ``[]``/``{}`` where not given) in the job's stored spec; the trainer's own run never sees them.
"""

from __future__ import annotations

import posixpath
import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from trainer.spec.errors import SpecError

TYPES = ("wandb", "mlflow")

# W&B's own limits: a project name may not hold these characters, nor be longer than 128; a tag is 1 to 64 characters.
_WANDB_PROJECT_FORBIDDEN = set("/\\#?%:")
_WANDB_NAME_MAX = 128
_WANDB_TAG_MAX = 64
MAX_TAGS = 64
# MLflow's: the characters of a tag key (as of a metric or a parameter name), its length and its value's.
_MLFLOW_KEY = re.compile(r"^[/\w.\- :]+$")
_MLFLOW_KEY_MAX = 250
_MLFLOW_VALUE_MAX = 8000
_MLFLOW_EXPERIMENT_MAX = 500
RESERVED_TAG_PREFIXES = ("mlflow.", "proxima.")
"""MLflow's own tags (``mlflow.runName``, ...) and ours (``proxima.job_id``, which finds the run on resume)."""


class _Block(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class WandbIntegration(_Block):
    """OpenAI's ``FineTuningJobWandbIntegration``: the run goes to ``entity/project`` and is called ``name`` (the job
    id when unset); ``tags`` are added to the default ones (``proxima/finetune``, ``proxima/<base model>``,
    ``proxima/<job id>``, as OpenAI adds ``openai/…``)."""

    project: str = Field(min_length=1, max_length=_WANDB_NAME_MAX)
    entity: str | None = Field(None, min_length=1, max_length=_WANDB_NAME_MAX)
    name: str | None = Field(None, min_length=1, max_length=_WANDB_NAME_MAX)
    tags: list[str] | None = Field(None, max_length=MAX_TAGS, validate_default=True)  # null or missing: []

    @field_validator("project")
    @classmethod
    def _project(cls, v: str) -> str:
        if bad := sorted(_WANDB_PROJECT_FORBIDDEN.intersection(v)):
            raise ValueError(f"a W&B project name may not contain {' '.join(bad)}")
        return v

    @field_validator("tags")
    @classmethod
    def _tags(cls, v: list[str] | None) -> list[str]:
        for tag in v or []:
            if not 1 <= len(tag) <= _WANDB_TAG_MAX:
                raise ValueError(f"tag {tag[:70]!r}: W&B tags are 1 to {_WANDB_TAG_MAX} characters")
        return list(v or [])


class MlflowIntegration(_Block):
    """Our MLflow integration: the run goes to the experiment ``experiment_name`` (created when missing) and is called
    ``run_name`` (the job id when unset), with ``tags`` set on it besides ours (``proxima.job_id``, ...)."""

    experiment_name: str = Field(min_length=1, max_length=_MLFLOW_EXPERIMENT_MAX)
    run_name: str | None = Field(None, min_length=1, max_length=_MLFLOW_KEY_MAX)
    tags: dict[str, str] | None = Field(None, max_length=MAX_TAGS, validate_default=True)  # null or missing: {}

    @field_validator("tags")
    @classmethod
    def _tags(cls, v: dict[str, str] | None) -> dict[str, str]:
        for key, value in (v or {}).items():
            if not _MLFLOW_KEY.match(key) or len(key) > _MLFLOW_KEY_MAX or not path_unique(key):
                raise ValueError(
                    f"tag key {key[:70]!r}: MLflow tag keys are 1 to {_MLFLOW_KEY_MAX} letters, digits, spaces and "
                    "_ - . / : (no empty, . or .. part between slashes)"
                )
            if key.startswith(RESERVED_TAG_PREFIXES):
                raise ValueError(f"tag key {key!r}: keys starting with mlflow. or proxima. are reserved")
            if len(value) > _MLFLOW_VALUE_MAX:
                raise ValueError(f"value of tag {key!r}: MLflow tag values are at most {_MLFLOW_VALUE_MAX} characters")
        return dict(v or {})


BLOCKS: dict[str, type[_Block]] = {"wandb": WandbIntegration, "mlflow": MlflowIntegration}


def path_unique(name: str) -> bool:
    """MLflow's rule for a name that may become a file path: it normalises to itself (no ``a//b``, ``./a``, ``..``)."""
    norm = posixpath.normpath(name)
    return norm == name and norm not in (".", "..") and not norm.startswith(("../", "/"))


class WandbEntry(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["wandb"] = "wandb"
    wandb: WandbIntegration


class MlflowEntry(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["mlflow"] = "mlflow"
    mlflow: MlflowIntegration


Integration = Annotated[WandbEntry | MlflowEntry, Field(discriminator="type")]
CODE = "invalid_integrations"


def block_of(entry: WandbEntry | MlflowEntry) -> WandbIntegration | MlflowIntegration:
    """The tracker's settings of one integration (``entry.wandb`` or ``entry.mlflow``)."""
    return entry.wandb if isinstance(entry, WandbEntry) else entry.mlflow


def _error(message: str, *, param: str) -> SpecError:
    return SpecError(message, param=param, code=CODE)


def _first_error(err: ValidationError, *, prefix: str) -> SpecError:
    e = err.errors()[0]
    param = ".".join([prefix, *(str(p) for p in e["loc"])])
    if e["type"] == "extra_forbidden":
        return _error("unknown field", param=param)
    if e["type"] == "missing":
        return _error("field required", param=param)
    return _error(e["msg"].removeprefix("Value error, "), param=param)


def parse(raw: Any) -> list[WandbEntry | MlflowEntry]:
    """The spec's ``integrations``, typed; :class:`SpecError` (code ``invalid_integrations``) naming the first bad
    field."""
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise _error("a list of integrations is expected", param="integrations")
    out: list[WandbEntry | MlflowEntry] = []
    for i, item in enumerate(raw):
        at = f"integrations.{i}"
        if not isinstance(item, dict):
            raise _error('an integration is an object: {"type": "wandb", "wandb": {...}}', param=at)
        kind = item.get("type")
        if kind not in TYPES:
            raise _error(f"unknown integration type {str(kind)[:40]!r}; supported: wandb, mlflow", param=f"{at}.type")
        if extra := sorted(set(item) - {"type", kind}):
            raise _error("unknown field", param=f"{at}.{extra[0]}")
        if kind not in item:
            raise _error("field required", param=f"{at}.{kind}")
        if any(o.type == kind for o in out):
            raise _error(f"a job has at most one {kind} integration", param=f"{at}.type")
        if not isinstance(item[kind], dict):
            raise _error("an object is expected", param=f"{at}.{kind}")
        try:
            block = BLOCKS[kind].model_validate(item[kind])
        except ValidationError as err:
            raise _first_error(err, prefix=f"{at}.{kind}") from None
        out.append(WandbEntry(wandb=block) if kind == "wandb" else MlflowEntry(mlflow=block))  # type: ignore[arg-type]
    return out

"""Where a worker's and the inference server's models and artifacts come from: the artifact store the settings name,
and a model name resolved to a folder of the model store (a built-in model installed there on first use)."""

from __future__ import annotations

from pathlib import Path

from api.settings import Settings
from api.storage import ArtifactStore, store_from_url
from trainer import builtin_models
from trainer.spec.names import BUILTIN_MODELS
from worker.errors import ErrorCode, JobError


def store_for(settings: Settings) -> ArtifactStore:
    return store_from_url(settings.artifacts_url, endpoint_url=settings.s3_endpoint_url)


def resolve_model(name: str, model_store: Path) -> str:
    """A name in the model store → its folder (a built-in model missing there is installed first, from the shipped
    build); a local path must hold a model; anything else (a hub id) is passed through, and the trainer reports a
    model it cannot load as ``model_not_available``."""
    local = model_store / name
    if (local / "config.json").is_file():
        return str(local)
    path = Path(name)
    if path.is_absolute() or name.startswith(("./", "../")):
        if not (path / "config.json").is_file():
            message = f"model {name!r} is not available on this worker: no model there"
            raise JobError(ErrorCode.MODEL_NOT_AVAILABLE, message)
        return name
    if name in BUILTIN_MODELS:  # shipped with the project: installed on first use
        try:
            return str(builtin_models.install(name, model_store).path)
        except (builtin_models.BuiltinModelError, OSError) as err:
            raise JobError(ErrorCode.MODEL_NOT_AVAILABLE, f"model {name!r} cannot be installed here: {err}") from None
    return name

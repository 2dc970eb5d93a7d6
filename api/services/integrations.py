"""Whether this deployment exports a job's ``integrations`` (the spec's experiment trackers, typed in
``trainer.spec.integrations``): a tracker's address and credentials are the deployment's (``PROXIMA_WANDB_*``,
``PROXIMA_MLFLOW_*``), never the job's, and a job asking for a tracker the deployment has not configured is refused at
creation."""

from __future__ import annotations

from api.errors import InvalidRequest
from api.settings import Settings
from trainer.spec.config import JobSpec


def configured(settings: Settings, kind: str) -> bool:
    """Whether the deployment can export to this tracker: W&B with an API key, or in offline mode (runs written
    under ``wandb_dir`` for a later ``wandb sync``); MLflow with a tracking URI."""
    if kind == "wandb":
        return settings.wandb_mode == "offline" or settings.wandb_api_key is not None
    return kind == "mlflow" and settings.mlflow_tracking_uri is not None


def check_configured(spec: JobSpec, *, settings: Settings) -> None:
    """A 400 naming the first integration whose tracker this deployment lacks."""
    for i, entry in enumerate(spec.integrations):
        if not configured(settings, entry.type):
            at = f"integrations.{i}"
            raise InvalidRequest(
                f"{at}: this deployment does not export to "
                f"{'Weights & Biases' if entry.type == 'wandb' else 'MLflow'}; "
                "its operator configures it (README, Experiment trackers)",
                param=at,
                code="integration_not_configured",
            )

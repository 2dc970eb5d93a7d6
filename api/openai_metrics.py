"""Our metrics under OpenAI's names, beside ours: a checkpoint's ``metrics`` (``FineTuningJobCheckpoint.Metrics``)
and a ``metrics`` event's ``data``, so that a client written for OpenAI reads the values it knows.

Each OpenAI name is filled only from the metric of ours (``trainer.spec.metrics``) that measures the same thing, and
only when that metric was recorded at the step: a name whose quantity we do not measure is absent, never estimated
(``train_reasoning_tokens_mean``: our completions have no separate reasoning tokens)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from trainer.spec import metrics as M

TRAINING: dict[str, str] = {
    "train_loss": M.LOSS_TOTAL,  # the loss the step minimised
    "train_mean_token_accuracy": M.TOKEN_ACCURACY,  # supervised: argmax accuracy on the trained tokens
    "train_reward_mean": M.REWARD_MEAN,  # RL: the grader's mean reward over the step's samples (RFT dashboard)
}
"""OpenAI's name → ours, for the training step's values."""

VALIDATION: dict[str, str] = {
    "valid_loss": M.VAL_LOSS,
    "valid_mean_token_accuracy": M.VAL_TOKEN_ACCURACY,
    "valid_reward_mean": M.VAL_REWARD_MEAN,  # RL (RFT dashboard)
}
"""OpenAI's name → ours, for a validation run's values (present at the steps that validated)."""

FULL_VALIDATION: dict[str, str] = {
    "full_valid_loss": M.VAL_LOSS,
    "full_valid_mean_token_accuracy": M.VAL_TOKEN_ACCURACY,
}
"""OpenAI's ``full_valid_*``: over the whole validation file, which ours are when no ``eval_samples`` cuts it (OpenAI's
``valid_*`` are over a sample of it, ours over what the job validates on)."""


def openai_names(values: Mapping[str, Any], *, full_validation: bool) -> dict[str, float]:
    """The OpenAI-named values that ``values`` (our names) hold; ``full_validation``: the job validates on its whole
    validation file, so its validation loss and accuracy are OpenAI's ``full_valid_*`` too."""
    names = TRAINING | VALIDATION | (FULL_VALIDATION if full_validation else {})
    out: dict[str, float] = {}
    for openai, ours in names.items():
        value = values.get(ours)
        if isinstance(value, int | float) and not isinstance(value, bool):
            out[openai] = float(value)
    return out


def validates_on_whole_file(spec: Mapping[str, Any]) -> bool:
    """Whether a stored spec's job validates on its whole validation file: no ``eval_samples`` (supervised, dpo,
    reward_model) or ``eval_prompts`` (online RL) takes only its first examples."""
    method = spec.get("method") or {}
    hp = (method.get(method.get("type", "")) or {}).get("hyperparameters") or {}
    cut = hp.get("eval_prompts") if "eval_prompts" in hp else hp.get("eval_samples")
    return cut is None

"""Length hyperparameters that fit the base model: a method's token lengths resolved against the
model's context, torch-free, in two stages.

1. **At creation** (the API, :func:`fit_spec`): the context is ``max_position_embeddings`` of the model's
   ``config.json`` read as JSON (:func:`context_length`). A length the user gave that cannot fit is a 400 naming the
   field; a length left at its default is clamped so that the spec fits: the online RL methods split the context
   between ``max_prompt_tokens`` and ``max_completion_tokens`` in their defaults' ratio (512 : 256) when both
   defaults do not fit, or give the one left at its default what the other leaves; ``max_length`` (reward_model,
   dpo, supervised) becomes at most the context.
2. **In ``validating_files``** (the worker, :func:`fit_data`), once the longest prompt is known: a default
   ``max_prompt_tokens`` grows to the longest prompt and a default ``max_completion_tokens`` shrinks to the context
   left after it; a prompt too long for a length the user gave, or for the context, fails the job naming the line.

Which lengths were left at their default is recorded with the job (the data of its creation event,
:data:`LENGTH_DEFAULTS`), since the stored spec holds every value resolved. A model whose ``config.json`` the API
cannot read (a hub id, or a model store only the workers have) has no known context at creation: its defaults stay
as they are and ``context_tokens`` is recorded as null, and the worker, which has the model, fits them in
``validating_files`` (stage 1 there, then stage 2).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Set
from pathlib import Path
from typing import Any

from trainer.spec.config import HYPERPARAMETERS

PROMPT, COMPLETION, MAX_LENGTH = "max_prompt_tokens", "max_completion_tokens", "max_length"
LENGTH_FIELDS = (PROMPT, COMPLETION, MAX_LENGTH)
LENGTH_DEFAULTS = "length_defaults"
"""Key, in the data of a job's creation event, of the length hyperparameters left at their default (their values)."""
CONTEXT_TOKENS = "context_tokens"
"""Key, in the same data, of the model's context at creation (null: unknown there)."""


class LengthError(ValueError):
    """A length that cannot fit the model's context; ``field`` is the hyperparameter to name."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field, self.message = field, message


def length_fields(method: str) -> tuple[str, ...]:
    """The token-length hyperparameters of a method, read from its hyperparameter model."""
    fields = HYPERPARAMETERS[method].model_fields
    return tuple(f for f in LENGTH_FIELDS if f in fields)


def model_dir(name: str, model_store: Path) -> Path | None:
    """The folder of an offered model on this machine, as the worker resolves it: ``<model store>/<name>``, or a
    local path holding a ``config.json``; None for a hub id or a model not built here."""
    local = model_store / name
    if (local / "config.json").is_file():
        return local
    path = Path(name)
    if path.is_absolute() and (path / "config.json").is_file():
        return path
    return None


def context_of_config(config: Mapping[str, Any]) -> int | None:
    """The context in tokens a model's ``config.json`` declares: ``max_position_embeddings`` (GPT-2's
    ``n_positions``; a multimodal model's ``text_config``), None when it declares none."""
    for key in ("max_position_embeddings", "n_positions"):
        value = config.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    text = config.get("text_config")
    return context_of_config(text) if isinstance(text, Mapping) else None


def context_length(name: str, model_store: Path) -> int | None:
    """The model's context from its ``config.json`` read as JSON (no torch, no transformers); None when the model
    is not on this machine or its config declares no context."""
    folder = model_dir(name, model_store)
    if folder is None:
        return None
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return context_of_config(config) if isinstance(config, dict) else None


def _completion_floor(values: Mapping[str, Any]) -> tuple[int, str | None]:
    """The fewest completion tokens the other hyperparameters need, and the one that needs them: EOS held off for
    ``min_completion_tokens``, DAPO's ``overlong_buffer`` within ``max_completion_tokens``."""
    floor, why = 1, None
    for name in ("min_completion_tokens", "overlong_buffer"):
        value = values.get(name)
        if isinstance(value, int) and value > floor:
            floor, why = value, name
    return floor, why


def fit_spec(method: str, values: Mapping[str, Any], *, explicit: Set[str], context: int) -> dict[str, int]:
    """Stage 1: the resolved value of every length of ``method`` not in ``explicit`` (given by the user), so that
    the spec fits a context of ``context`` tokens; :class:`LengthError` for a given length (or a given bound on the
    completion) that cannot fit. ``values``: the method's hyperparameters as parsed (defaults filled in)."""
    fields = length_fields(method)
    if MAX_LENGTH in fields:
        if MAX_LENGTH in explicit:
            if values[MAX_LENGTH] > context:
                raise LengthError(
                    MAX_LENGTH, f"max_length {values[MAX_LENGTH]} exceeds the model's context of {context} tokens"
                )
            return {}
        return {MAX_LENGTH: min(int(values[MAX_LENGTH]), context)}
    if PROMPT not in fields:
        return {}
    prompt, completion = int(values[PROMPT]), int(values[COMPLETION])
    given_p, given_c = PROMPT in explicit, COMPLETION in explicit
    for name, value, other in ((PROMPT, prompt, "a completion"), (COMPLETION, completion, "a prompt")):
        if name in explicit and value >= context:
            raise LengthError(
                name, f"{name} {value} leaves no room for {other} in the model's context of {context} tokens"
            )
    if given_p and given_c:
        if prompt + completion > context:
            raise LengthError(
                COMPLETION,
                f"max_prompt_tokens {prompt} + max_completion_tokens {completion} = {prompt + completion} tokens "
                f"exceed the model's context of {context} tokens: lower either",
            )
        return {}
    floor, why = _completion_floor(values)
    room = context - prompt if given_p else context - 1  # what a completion may take at most
    if not given_c and floor > room:
        assert why is not None  # room ≥ 1 = the floor when no other hyperparameter raises it
        where = f"max_prompt_tokens {prompt} leaves {room}" if given_p else f"it leaves at most {room}"
        raise LengthError(
            why, f"{why} {floor} does not fit the model's context of {context} tokens: {where} for a completion"
        )
    if given_c:
        return {PROMPT: min(prompt, context - completion)}
    if given_p:
        return {COMPLETION: max(min(completion, context - prompt), floor)}
    if prompt + completion <= context:
        return {PROMPT: prompt, COMPLETION: completion}
    # Neither fits as it is: the context split in the defaults' ratio, the completion at least its floor.
    completion = max(context * completion // (prompt + completion), floor)
    return {PROMPT: context - completion, COMPLETION: completion}


def fit_data(
    method: str, values: Mapping[str, Any], *, defaulted: Set[str], context: int | None, longest_prompt: int
) -> dict[str, int]:
    """Stage 2, for the online RL methods: the lengths in ``defaulted`` that change once the longest prompt
    (``longest_prompt`` tokens, chat template included) is known, as {field: new value}. A default
    ``max_prompt_tokens`` grows to the longest prompt; a default ``max_completion_tokens`` shrinks to the context
    left after it. :class:`LengthError` when the prompt cannot fit: longer than a ``max_prompt_tokens`` the user
    gave, or leaving less of the context than a completion needs (the message says what to change; the caller names
    the line)."""
    if PROMPT not in length_fields(method):
        return {}
    prompt, completion = int(values[PROMPT]), int(values[COMPLETION])
    longest = longest_prompt
    changed: dict[str, int] = {}
    if longest > prompt:
        if PROMPT not in defaulted:
            raise LengthError(
                PROMPT,
                f"the prompt is {longest} tokens, more than max_prompt_tokens = {prompt}: shorten it or raise "
                "max_prompt_tokens",
            )
        prompt = changed[PROMPT] = longest
    if context is None:
        return changed
    if longest + completion > context:
        floor, _ = _completion_floor(values)
        if COMPLETION not in defaulted:
            raise LengthError(
                COMPLETION,
                f"the prompt is {longest} tokens: with max_completion_tokens {completion} that exceeds the model's "
                f"context of {context} tokens; shorten the prompt or lower max_completion_tokens",
            )
        if context - longest < floor:
            raise LengthError(
                COMPLETION,
                f"the prompt is {longest} tokens: the model's context of {context} tokens leaves "
                f"{max(context - longest, 0)} for a completion, fewer than {floor}; shorten the prompt",
            )
        completion = changed[COMPLETION] = context - longest
    if PROMPT in defaulted and prompt + completion > context:
        changed[PROMPT] = context - completion  # ≥ longest: the prompt's guard stays within the context
    return changed

"""api.services.model_limits: length hyperparameters resolved against the model's context, hand-computed."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from api.services.model_limits import (
    COMPLETION,
    MAX_LENGTH,
    PROMPT,
    LengthError,
    context_length,
    fit_data,
    fit_spec,
    length_fields,
)
from trainer.spec.config import HYPERPARAMETERS, METHODS, RL_METHODS


def values(method: str, **given: Any) -> dict[str, Any]:
    """The method's hyperparameters as parsed: the defaults, and ``given``."""
    return HYPERPARAMETERS[method].model_validate(given).model_dump()


def fit(method: str, context: int, **given: Any) -> dict[str, int]:
    return fit_spec(method, values(method, **given), explicit=set(given), context=context)


def test_every_method_has_its_lengths_read_from_its_hyperparameter_model() -> None:
    for method in METHODS:
        expected = (PROMPT, COMPLETION) if method in RL_METHODS else (MAX_LENGTH,)
        assert length_fields(method) == expected, method


@pytest.mark.parametrize("method", RL_METHODS)
def test_rl_defaults_that_do_not_fit_split_the_context_in_their_ratio(method: str) -> None:
    # 512 + 256 > 64: the completion gets 64·256 // 768 = 21, the prompt the 43 left.
    assert fit(method, 64) == {PROMPT: 43, COMPLETION: 21}
    assert fit(method, 600) == {PROMPT: 400, COMPLETION: 200}
    assert fit(method, 2048) == {PROMPT: 512, COMPLETION: 256}  # they fit: unchanged


@pytest.mark.parametrize("method", ["reward_model", "dpo", "supervised"])
def test_max_length_defaults_to_at_most_the_context(method: str) -> None:
    assert fit(method, 64) == {MAX_LENGTH: 64}
    assert fit(method, 4096) == {MAX_LENGTH: 1024}
    assert fit(method, 64, max_length=50) == {}
    with pytest.raises(LengthError) as err:
        fit(method, 64, max_length=65)
    assert err.value.field == MAX_LENGTH and "context of 64 tokens" in err.value.message


def test_a_given_length_leaves_the_default_one_what_is_left() -> None:
    assert fit("grpo", 64, max_completion_tokens=16) == {PROMPT: 48}
    assert fit("grpo", 64, max_prompt_tokens=40) == {COMPLETION: 24}
    assert fit("grpo", 2048, max_prompt_tokens=40) == {COMPLETION: 256}
    assert fit("grpo", 64, max_completion_tokens=63) == {PROMPT: 1}
    assert fit("grpo", 64, max_prompt_tokens=30, max_completion_tokens=34) == {}


@pytest.mark.parametrize(
    ("given", "field"),
    [
        ({"max_completion_tokens": 64}, COMPLETION),
        ({"max_completion_tokens": 256}, COMPLETION),
        ({"max_prompt_tokens": 64}, PROMPT),
        ({"max_prompt_tokens": 40, "max_completion_tokens": 30}, COMPLETION),
        ({"max_prompt_tokens": 40, "min_completion_tokens": 30}, "min_completion_tokens"),
        ({"min_completion_tokens": 64}, "min_completion_tokens"),
    ],
)
def test_given_lengths_that_cannot_fit_name_the_field(given: dict[str, int], field: str) -> None:
    with pytest.raises(LengthError) as err:
        fit("grpo", 64, **given)
    assert err.value.field == field, err.value.message


def test_a_default_completion_keeps_room_for_what_other_hyperparameters_need() -> None:
    assert fit("dapo", 64, overlong_buffer=30) == {PROMPT: 34, COMPLETION: 30}
    assert fit("grpo", 64, min_completion_tokens=25) == {PROMPT: 39, COMPLETION: 25}
    with pytest.raises(LengthError) as err:
        fit("dapo", 64, max_prompt_tokens=40, overlong_buffer=30)
    assert err.value.field == "overlong_buffer"


def fitted(longest: int, *, defaulted: set[str], context: int | None = 64, **given: int) -> dict[str, int]:
    current = {PROMPT: 43, COMPLETION: 21, **given}
    return fit_data("grpo", values("grpo", **current), defaulted=defaulted, context=context, longest_prompt=longest)


def test_the_longest_prompt_grows_a_default_prompt_budget_and_shrinks_a_default_completion() -> None:
    both = {PROMPT, COMPLETION}
    assert fitted(20, defaulted=both) == {}
    # 50 > 43: the prompt budget becomes 50; 50 + 21 > 64: the completion gets the 14 left.
    assert fitted(50, defaulted=both) == {PROMPT: 50, COMPLETION: 14}
    assert fitted(30, defaulted={COMPLETION}, max_prompt_tokens=30, max_completion_tokens=40) == {COMPLETION: 34}
    assert fitted(600, defaulted=both, context=None, max_prompt_tokens=512, max_completion_tokens=256) == {PROMPT: 600}


@pytest.mark.parametrize(
    ("longest", "defaulted", "field"),
    [
        (45, {COMPLETION}, PROMPT),  # longer than the prompt budget the user gave
        (50, {PROMPT}, COMPLETION),  # with the completion the user gave it exceeds the context
        (64, {PROMPT, COMPLETION}, COMPLETION),  # no room left for any completion
    ],
)
def test_a_prompt_that_cannot_fit_is_an_error_naming_the_field_to_change(
    longest: int, defaulted: set[str], field: str
) -> None:
    with pytest.raises(LengthError) as err:
        fitted(longest, defaulted=defaulted)
    assert err.value.field == field
    assert f"the prompt is {longest} tokens" in err.value.message


def test_methods_without_prompts_are_not_fitted_to_the_data() -> None:
    assert fit_data("supervised", values("supervised"), defaulted={MAX_LENGTH}, context=64, longest_prompt=100) == {}


def test_the_context_is_read_from_the_config_as_json(tmp_path: Path) -> None:
    store = tmp_path / "models"
    for name, config in {
        "llama": {"max_position_embeddings": 4096},
        "gpt2": {"n_positions": 1024},
        "vlm": {"text_config": {"max_position_embeddings": 8192}},
        "none": {"hidden_size": 8},
    }.items():
        (store / name).mkdir(parents=True)
        (store / name / "config.json").write_text(json.dumps(config))
    assert context_length("llama", store) == 4096
    assert context_length("gpt2", store) == 1024
    assert context_length("vlm", store) == 8192
    assert context_length("none", store) is None
    assert context_length("org/hub-model", store) is None  # not on this machine
    assert context_length(str(store / "llama"), store) == 4096  # a local path

"""The job spec typed once: the stored JSON (``JobSpec.to_json``) parsed back by every reader, and what is resolved
after creation (lengths, reward models, integrations, local paths) set through the model, checked as a spec is."""

import json
from pathlib import Path
from typing import Any

import pytest

from trainer.spec.config import JobSpec, SpecError, load_spec, parse_spec

STRING_CHECK = {
    "type": "string_check",
    "name": "exact",
    "input": "{{sample.output_text}}",
    "reference": "{{item.answer}}",
    "operation": "eq",
}
GRADER = {
    "type": "multi",
    "name": "mix",
    "graders": {
        "rm": {"type": "reward_model", "name": "rm", "model": "ftjob-rm1"},
        "inner": {
            "type": "multi",
            "name": "inner",
            "graders": {"rm2": {"type": "reward_model", "name": "rm2", "model": "ftjob-rm2"}, "s": STRING_CHECK},
            "calculate_output": "rm2 + s",
        },
    },
    "calculate_output": "rm + inner",
}
WANDB = {"type": "wandb", "wandb": {"project": "arith", "tags": ["mine"]}}


def raw(grader: dict[str, Any] = GRADER, **top: Any) -> dict[str, Any]:
    block = {"grader": grader, "hyperparameters": {"group_size": 4, "max_completion_tokens": 64}}
    return {"model": "tiny", "training_file": "file-1", "method": {"type": "grpo", "grpo": block}, **top}


def test_the_stored_json_parses_back_to_the_same_spec_integrations_included() -> None:
    spec = parse_spec(raw(integrations=[WANDB]))
    stored = spec.to_json()
    assert stored["integrations"] == [
        {"type": "wandb", "wandb": {"project": "arith", "entity": None, "name": None, "tags": ["mine"]}}
    ]
    again = JobSpec.from_stored(stored)
    assert again == spec and again.to_json() == stored
    assert "integrations" not in parse_spec(raw()).to_json()  # none: stored as before they existed


def test_a_bad_integration_is_named_with_its_own_code() -> None:
    with pytest.raises(SpecError) as exc:
        parse_spec(raw(integrations=[WANDB, {"type": "wandb", "wandb": {"project": "b"}}]))
    assert (exc.value.param, exc.value.code) == ("integrations.1.type", "invalid_integrations")
    with pytest.raises(SpecError) as exc:
        parse_spec(raw(integrations=[{"type": "wandb", "wandb": {"project": "a/b"}}]))
    assert exc.value.param == "integrations.0.wandb.project" and "may not contain /" in str(exc.value)


def test_the_trainer_reads_no_integrations_and_its_command_line_refuses_them(tmp_path: Path) -> None:
    spec = parse_spec(raw(integrations=[WANDB]))
    assert spec.for_trainer().integrations == [] and spec.integrations  # a copy: the stored spec keeps them
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(raw(integrations=[WANDB])))
    with pytest.raises(SpecError) as exc:
        load_spec(path)
    assert exc.value.param == "integrations"


def test_reward_models_are_listed_with_their_params_and_replaced_in_the_tree() -> None:
    spec = parse_spec(raw())
    assert spec.reward_models() == [
        ("method.grpo.grader.graders.rm.model", "ftjob-rm1"),
        ("method.grpo.grader.graders.inner.graders.rm2.model", "ftjob-rm2"),
    ]
    local = spec.with_reward_models({"ftjob-rm2": "/runs/rm2"})
    assert [m for _, m in local.reward_models()] == ["ftjob-rm1", "/runs/rm2"]
    assert spec.reward_models()[1][1] == "ftjob-rm2"  # the original is left as it was
    inner = local.to_json()["method"]["grpo"]["grader"]["graders"]["inner"]
    assert inner["graders"]["s"] == STRING_CHECK and inner["calculate_output"] == "rm2 + s"
    assert parse_spec(raw(STRING_CHECK)).reward_models() == []


def test_hyperparameters_set_later_are_checked_as_the_spec_is() -> None:
    spec = parse_spec(raw())
    fitted = spec.with_hyperparameters({"max_completion_tokens": 32, "max_prompt_tokens": 100})
    hp = fitted.method.hyperparameters
    assert (hp.max_completion_tokens, hp.max_prompt_tokens, hp.group_size) == (32, 100, 4)
    assert JobSpec.from_stored(fitted.to_json()) == fitted
    assert spec.method.hyperparameters.max_completion_tokens == 64
    with pytest.raises(SpecError) as exc:
        spec.with_hyperparameters({"max_completion_tokens": 0})
    assert exc.value.param == "method.grpo.hyperparameters.max_completion_tokens"
    with pytest.raises(SpecError) as exc:  # the method's own rules too, not only each field's range
        spec.with_hyperparameters({"min_completion_tokens": 40, "max_completion_tokens": 32})
    assert exc.value.param == "method.grpo.hyperparameters.min_completion_tokens"

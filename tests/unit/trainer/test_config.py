"""trainer.spec.config.parse_spec: per-method defaults from the papers, OpenAI's spellings, SpecError naming fields."""

from typing import Any

import pytest

from trainer.spec.config import (
    DAPOHyperparameters,
    DrGRPOHyperparameters,
    GRPOHyperparameters,
    ReinforceHyperparameters,
    RLOOHyperparameters,
    SpecError,
    parse_spec,
)

GRADER = {
    "type": "string_check",
    "name": "acc",
    "input": "{{sample.output_text}}",
    "reference": "{{item.answer}}",
    "operation": "eq",
}
METHODS = ["grpo", "dr_grpo", "dapo", "rloo", "reinforce"]


def spec(method: str = "grpo", hyperparameters: dict[str, Any] | None = None, **block: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"grader": GRADER, **block}
    if hyperparameters is not None:
        body["hyperparameters"] = hyperparameters
    return {"model": "tiny", "training_file": "train.jsonl", "method": {"type": method, method: body}}


def spec_error(raw: Any) -> SpecError:
    with pytest.raises(SpecError) as exc:
        parse_spec(raw)
    return exc.value


# ---------------------------------------------------------------------------------------------------------------
# Defaults
# ---------------------------------------------------------------------------------------------------------------


def test_grpo_defaults() -> None:
    hp = parse_spec(spec("grpo")).method.hyperparameters
    assert isinstance(hp, GRPOHyperparameters)
    assert hp.beta == 0.04
    assert hp.loss_aggregation == "seq_mean_token_mean"
    assert hp.kl_estimator == "k3"
    assert (hp.epsilon_low, hp.epsilon_high) == (0.2, 0.2)
    assert hp.scale_rewards == "group"


def test_dapo_defaults() -> None:
    hp = parse_spec(spec("dapo")).method.hyperparameters
    assert isinstance(hp, DAPOHyperparameters)
    assert (hp.epsilon_low, hp.epsilon_high) == (0.2, 0.28)
    assert hp.beta == 0.0
    assert hp.loss_aggregation == "token_mean"
    assert hp.dynamic_sampling is True


def test_dr_grpo_defaults() -> None:
    hp = parse_spec(spec("dr_grpo")).method.hyperparameters
    assert isinstance(hp, DrGRPOHyperparameters)
    assert hp.loss_aggregation == "seq_mean_token_sum_norm"
    assert hp.beta == 0.0


def test_rloo_defaults() -> None:
    hp = parse_spec(spec("rloo")).method.hyperparameters
    assert isinstance(hp, RLOOHyperparameters)
    assert hp.beta == 0.05
    assert hp.kl_estimator == "k1"


def test_reinforce_defaults() -> None:
    hp = parse_spec(spec("reinforce")).method.hyperparameters
    assert isinstance(hp, ReinforceHyperparameters)
    assert hp.beta == 0.0
    assert hp.baseline == "batch_mean"
    assert (hp.iterations_per_batch, hp.mini_batches) == (1, 1)


def test_given_values_override_defaults() -> None:
    hp = parse_spec(spec("dapo", {"epsilon_high": 0.3, "beta": 0.01, "group_size": 4})).method.hyperparameters
    assert (hp.epsilon_high, hp.beta, hp.group_size) == (0.3, 0.01, 4)


# ---------------------------------------------------------------------------------------------------------------
# Method type and block
# ---------------------------------------------------------------------------------------------------------------


def test_openai_reinforcement_keeps_its_name_and_runs_grpo_s_recipe_and_defaults() -> None:
    job = parse_spec(spec("reinforcement", {"group_size": 4}))
    assert (job.method.type, job.method.recipe_name, job.method.data_format) == ("reinforcement", "grpo", "prompts")
    assert isinstance(job.method.hyperparameters, GRPOHyperparameters)
    assert job.method.hyperparameters.group_size == 4
    assert job.method.hyperparameters.beta == 0.04
    grpo = parse_spec(spec("grpo", {"group_size": 4})).method
    assert job.method.hyperparameters.model_dump() == grpo.hyperparameters.model_dump()
    stored = job.to_json()["method"]
    assert stored["type"] == "reinforcement" and "reinforcement" in stored and "grpo" not in stored
    assert parse_spec(job.to_json()).method.type == "reinforcement"


def test_unknown_method_lists_valid_ones() -> None:
    raw = spec("ppo_magic")
    err = spec_error(raw)
    assert err.param == "method.type"
    assert "ppo_magic" in str(err)
    for name in METHODS:
        assert name in str(err)


def test_method_block_key_must_equal_type() -> None:
    raw = spec("grpo")
    raw["method"] = {"type": "grpo", "dapo": raw["method"]["grpo"]}
    err = spec_error(raw)
    assert err.param == "method.dapo"


def test_missing_method_block_is_named() -> None:
    err = spec_error({"model": "tiny", "training_file": "t.jsonl", "method": {"type": "rloo"}})
    assert err.param == "method.rloo"


def test_missing_method_and_missing_type() -> None:
    assert spec_error({"model": "tiny", "training_file": "t.jsonl"}).param == "method"
    assert spec_error({"model": "tiny", "training_file": "t.jsonl", "method": {"grpo": {}}}).param == "method.type"
    assert spec_error({"model": "tiny", "training_file": "t.jsonl", "method": "grpo"}).param == "method"


def test_spec_must_be_an_object() -> None:
    err = spec_error(["not", "a", "dict"])
    assert err.param is None


# ---------------------------------------------------------------------------------------------------------------
# Hyperparameters
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["grpo", "reinforcement", "dapo"])
def test_unknown_hyperparameter_is_named(method: str) -> None:
    err = spec_error(spec(method, {"group_size": 4, "clip_ratio": 0.2}))
    assert err.param == f"method.{method}.hyperparameters.clip_ratio"
    assert err.detail == "unknown field"


def test_bad_hyperparameter_value_is_named() -> None:
    err = spec_error(spec("grpo", {"epsilon_low": 1.5}))
    assert err.param == "method.grpo.hyperparameters.epsilon_low"
    err = spec_error(spec("rloo", {"kl_estimator": "k9"}))
    assert err.param == "method.rloo.hyperparameters.kl_estimator"


@pytest.mark.parametrize("method", ["grpo", "rloo", "dapo", "dr_grpo"])
def test_group_size_one_rejected_for_group_methods(method: str) -> None:
    err = spec_error(spec(method, {"group_size": 1}))
    assert err.param == f"method.{method}.hyperparameters.group_size"


def test_group_size_one_accepted_for_reinforce() -> None:
    assert parse_spec(spec("reinforce", {"group_size": 1})).method.hyperparameters.group_size == 1


def test_auto_values_take_the_defaults() -> None:
    auto = {"batch_size": "auto", "learning_rate_multiplier": "auto", "n_epochs": "auto", "beta": "auto"}
    hp = parse_spec(spec("reinforcement", auto)).method.hyperparameters
    assert (hp.batch_size, hp.learning_rate_multiplier, hp.n_epochs, hp.beta) == (8, 1.0, 1, 0.04)
    # "auto" means each method's own default
    assert parse_spec(spec("dapo", {"beta": "auto"})).method.hyperparameters.beta == 0.0
    assert parse_spec(spec("rloo", {"beta": "auto"})).method.hyperparameters.beta == 0.05


def test_auto_is_not_accepted_for_fields_openai_does_not_choose() -> None:
    err = spec_error(spec("grpo", {"group_size": "auto"}))
    assert err.param == "method.grpo.hyperparameters.group_size"


def test_reinforce_rejects_more_than_one_iteration_per_batch() -> None:
    err = spec_error(spec("reinforce", {"iterations_per_batch": 2}))
    assert err.param is not None and err.param.startswith("method.reinforce.hyperparameters")
    assert "iterations_per_batch" in str(err)
    err = spec_error(spec("reinforce", {"mini_batches": 2}))
    assert err.param is not None and err.param.startswith("method.reinforce.hyperparameters")


def test_other_methods_accept_several_iterations_per_batch() -> None:
    hp = parse_spec(spec("grpo", {"iterations_per_batch": 2, "mini_batches": 4})).method.hyperparameters
    assert (hp.iterations_per_batch, hp.mini_batches) == (2, 4)


def test_mini_batches_must_divide_the_rollout() -> None:
    err = spec_error(spec("grpo", {"batch_size": 3, "group_size": 2, "mini_batches": 4}))
    assert err.param == "method.grpo.hyperparameters.mini_batches"
    assert "6" in str(err)


def test_min_completion_tokens_above_max_is_rejected() -> None:
    err = spec_error(spec("grpo", {"min_completion_tokens": 20, "max_completion_tokens": 10}))
    assert err.param is not None and err.param.startswith("method.grpo.hyperparameters")
    assert "min_completion_tokens" in str(err)


def test_dapo_overlong_buffer_must_fit_in_max_completion_tokens() -> None:
    err = spec_error(spec("dapo", {"overlong_buffer": 300, "max_completion_tokens": 256}))
    assert err.param == "method.dapo.hyperparameters.overlong_buffer"
    assert parse_spec(spec("dapo", {"overlong_buffer": 256})).method.hyperparameters.overlong_buffer == 256


# ---------------------------------------------------------------------------------------------------------------
# Grader, LoRA, top level
# ---------------------------------------------------------------------------------------------------------------


def test_bad_grader_is_named_under_the_method() -> None:
    raw = spec("dapo")
    raw["method"]["dapo"]["grader"] = {"type": "no_such_grader", "name": "x"}
    err = spec_error(raw)
    assert err.param == "method.dapo.grader"
    assert "no_such_grader" in str(err)


def test_missing_grader_is_named() -> None:
    raw = spec("grpo")
    del raw["method"]["grpo"]["grader"]
    assert spec_error(raw).param == "method.grpo.grader"


def test_unknown_field_in_method_block_and_lora() -> None:
    assert spec_error(spec("grpo", foo=1)).param == "method.grpo.foo"
    assert spec_error(spec("grpo", lora={"rank": 8})).param == "method.grpo.lora.rank"
    assert parse_spec(spec("grpo", lora={"r": 8})).method.lora.r == 8


def test_unknown_top_level_field_and_missing_model() -> None:
    raw = spec("grpo")
    raw["learning_rate"] = 1e-4
    assert spec_error(raw).param == "learning_rate"
    raw = spec("grpo")
    del raw["model"]
    assert spec_error(raw).param == "model"


def test_to_json_round_trips() -> None:
    job = parse_spec(spec("reinforcement", {"group_size": 4, "beta": 0.1}, lora={"r": 4}))
    again = parse_spec(job.to_json())
    assert again.method.type == "reinforcement"  # the name it was created with
    assert again.method.hyperparameters == job.method.hyperparameters
    assert again.method.lora == job.method.lora
    assert again.to_json() == job.to_json()

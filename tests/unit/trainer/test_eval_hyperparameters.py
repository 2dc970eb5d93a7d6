"""OpenAI's ``eval_interval`` and ``eval_samples``: "auto" validates about ten times over the run, and the online
methods' ``eval_samples`` is the completions generated per validation prompt (``eval_prompts`` bounds the prompts)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from trainer.loops.evaluate import per_prompt, validation_generator, validation_params
from trainer.loops.steps import validation_due
from trainer.spec.config import RLHyperparameters, SpecError, parse_spec

GRADER = {"type": "string_check", "name": "g", "input": "{{sample.output_text}}", "reference": "1", "operation": "eq"}


def spec(method: str = "reinforcement", **hp: Any) -> dict[str, Any]:
    block: dict[str, Any] = {"hyperparameters": hp}
    if method not in ("supervised", "dpo", "reward_model"):
        block["grader"] = GRADER
    return {"model": "m", "training_file": "t.jsonl", "method": {"type": method, method: block}}


def validated_steps(total_steps: int, every: int) -> list[int]:
    return [s for s in range(1, total_steps + 1) if validation_due(s, interval=every, total_steps=total_steps)]


@pytest.mark.parametrize(
    ("total_steps", "every", "steps"),
    [
        (95, 10, [10, 20, 30, 40, 50, 60, 70, 80, 90, 95]),  # ceil(95 / 10) = 10, and the last step
        (100, 10, [10, 20, 30, 40, 50, 60, 70, 80, 90, 100]),
        (7, 1, [1, 2, 3, 4, 5, 6, 7]),  # a short run validates at every step
        (21, 3, [3, 6, 9, 12, 15, 18, 21]),
    ],
)
def test_auto_eval_interval_validates_about_ten_times_over_the_run(
    total_steps: int, every: int, steps: list[int]
) -> None:
    for method in ("reinforcement", "supervised", "dpo", "reward_model"):
        hp = parse_spec(spec(method, eval_interval="auto")).method.hyperparameters
        assert hp.eval_interval == "auto"  # kept as given: the run's length picks the number
        assert hp.eval_every(total_steps) == every, method
    assert validated_steps(total_steps, every) == steps


def test_a_number_is_its_own_interval_and_auto_survives_the_stored_spec() -> None:
    hp = parse_spec(spec(eval_interval=4)).method.hyperparameters
    assert (hp.eval_every(95), hp.eval_every(3)) == (4, 4)
    stored = parse_spec(spec(eval_interval="auto")).to_json()
    assert stored["method"]["reinforcement"]["hyperparameters"]["eval_interval"] == "auto"
    assert parse_spec(stored).method.hyperparameters.eval_every(50) == 5


@pytest.mark.parametrize("bad", [-1, 1_000_001, "often", 2.5, True, None])
def test_a_bad_eval_interval_is_refused_naming_the_field(bad: Any) -> None:
    with pytest.raises(SpecError) as err:
        parse_spec(spec(eval_interval=bad))
    assert err.value.param == "method.reinforcement.hyperparameters.eval_interval"
    assert "or 'auto'" in str(err.value)


def test_online_eval_samples_is_completions_per_prompt_and_auto_is_one_greedy() -> None:
    auto = parse_spec(spec(eval_samples="auto")).method.hyperparameters
    assert isinstance(auto, RLHyperparameters)
    assert (auto.eval_samples, auto.eval_samples_per_prompt, auto.eval_prompts) == (None, 1, None)
    hp = parse_spec(spec("grpo", eval_samples=3, eval_prompts=2)).method.hyperparameters
    assert isinstance(hp, RLHyperparameters)
    assert (hp.eval_samples_per_prompt, hp.eval_prompts) == (3, 2)
    with pytest.raises(SpecError) as err:
        parse_spec(spec(eval_samples=257))
    assert err.value.param == "method.reinforcement.hyperparameters.eval_samples"
    with pytest.raises(SpecError) as err:  # eval_prompts is the online methods' own
        parse_spec(spec("supervised", eval_prompts=2))
    assert err.value.param == "method.supervised.hyperparameters.eval_prompts"


def test_validation_samples_greedy_once_else_k_at_the_jobs_temperature_from_its_own_seed() -> None:
    assert per_prompt(["a", "b"], 3) == ["a", "a", "a", "b", "b", "b"]
    greedy = validation_params(6, samples=1, temperature=0.7, top_p=0.9)
    assert (greedy.temperature, greedy.top_p, greedy.max_new_tokens) == (0.0, 1.0, 6)
    sampled = validation_params(6, samples=3, temperature=0.7, top_p=0.9)
    assert (sampled.temperature, sampled.top_p) == (0.7, 0.9)
    cpu = torch.device("cpu")
    assert validation_generator(cpu, seed=3, step=2, samples=1) is None
    a, b = (validation_generator(cpu, seed=3, step=2, samples=3) for _ in range(2))
    c = validation_generator(cpu, seed=3, step=4, samples=3)
    assert a is not None and b is not None and c is not None
    assert torch.equal(torch.rand(4, generator=a), torch.rand(4, generator=b))  # a resumed run validates alike
    assert not torch.equal(torch.rand(4, generator=b), torch.rand(4, generator=c))  # each validation its own draws

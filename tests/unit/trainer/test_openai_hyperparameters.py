"""OpenAI's reinforcement hyperparameters: `compute_multiplier` scales the samples per prompt, `reasoning_effort`
selects the chat template's thinking mode (trainer.generation.encoding.thinking_kwargs) where there is one."""

from typing import Any

import pytest

from tests.unit.trainer.test_config import GRADER
from trainer.builtin_models.tiny_arith import build_tokenizer
from trainer.generation.encoding import encode_prompts, prompt_text, thinking_kwargs
from trainer.spec.config import MAX_ROLLOUT, GRPOHyperparameters, PPOHyperparameters, SpecError, parse_spec
from trainer.spec.data import PromptItem


def spec(method: str = "reinforcement", **hp: Any) -> dict[str, Any]:
    return {
        "model": "tiny",
        "training_file": "train.jsonl",
        "method": {"type": method, method: {"grader": GRADER, "hyperparameters": hp}},
    }


def spec_error(raw: Any) -> SpecError:
    with pytest.raises(SpecError) as exc:
        parse_spec(raw)
    return exc.value


def test_an_openai_reinforcement_body_with_every_hyperparameter_is_accepted() -> None:
    # The hyperparameters of OpenAI's reinforcement method, as its SDK types list them, "auto" where it allows it.
    hp = parse_spec(
        spec(
            batch_size="auto",
            learning_rate_multiplier="auto",
            n_epochs="auto",
            compute_multiplier="auto",
            eval_interval="auto",
            eval_samples="auto",
            reasoning_effort="medium",
        )
    ).method.hyperparameters
    assert isinstance(hp, GRPOHyperparameters)
    assert (hp.compute_multiplier, hp.reasoning_effort, hp.samples_per_prompt) == (1.0, "medium", hp.group_size)


@pytest.mark.parametrize(
    ("group_size", "multiplier", "samples"), [(8, 1.0, 8), (8, 2.0, 16), (8, 0.5, 4), (4, 1.3, 5), (3, 1.5, 4)]
)
def test_compute_multiplier_scales_the_samples_per_prompt(group_size: int, multiplier: float, samples: int) -> None:
    hp = parse_spec(spec(group_size=group_size, compute_multiplier=multiplier)).method.hyperparameters
    assert isinstance(hp, GRPOHyperparameters)
    assert hp.group_size == group_size  # recorded as given: re-parsing the saved spec never scales twice
    assert hp.samples_per_prompt == samples
    again = parse_spec(parse_spec(spec(group_size=group_size, compute_multiplier=multiplier)).to_json())
    assert isinstance(again.method.hyperparameters, GRPOHyperparameters)
    assert again.method.hyperparameters.samples_per_prompt == samples


def test_ppo_without_groups_samples_more_per_prompt_with_a_multiplier() -> None:
    hp = parse_spec(spec("ppo", compute_multiplier=3)).method.hyperparameters
    assert isinstance(hp, PPOHyperparameters)
    assert (hp.group_size, hp.samples_per_prompt) == (1, 3)


def test_a_multiplier_that_leaves_a_group_method_one_sample_names_compute_multiplier() -> None:
    err = spec_error(spec(group_size=4, compute_multiplier=0.25))
    assert err.param == "method.reinforcement.hyperparameters.compute_multiplier"
    assert err.detail == (
        "grpo compares samples within a group: group_size must be at least 2 (group_size × compute_multiplier gives 1)"
    )


def test_a_multiplier_past_the_rollout_bound_names_compute_multiplier() -> None:
    err = spec_error(spec(batch_size=4096, group_size=16, compute_multiplier=2))
    assert err.param == "method.reinforcement.hyperparameters.compute_multiplier"
    assert (
        err.detail
        == f"batch_size × group_size × compute_multiplier = 131,072 sequences a step; at most {MAX_ROLLOUT:,}"
    )


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("compute_multiplier", 0, "Input should be greater than 0"),
        ("compute_multiplier", 65, "Input should be less than or equal to 64"),
        ("reasoning_effort", "extreme", "Input should be 'default', 'low', 'medium' or 'high'"),
    ],
)
def test_bad_openai_hyperparameters_are_refused_naming_them(field: str, value: Any, message: str) -> None:
    err = spec_error(spec(**{field: value}))
    assert (err.param, err.detail) == (f"method.reinforcement.hyperparameters.{field}", message)


def test_compute_multiplier_is_not_a_hyperparameter_of_the_offline_methods() -> None:
    raw = {"model": "tiny", "training_file": "t.jsonl", "method": {"type": "dpo", "dpo": {"hyperparameters": {}}}}
    raw["method"]["dpo"]["hyperparameters"]["compute_multiplier"] = 2
    assert spec_error(raw).param == "method.dpo.hyperparameters.compute_multiplier"


# Chat templates that have a thinking mode, reduced to the variable each reads (the real ones: gpt-oss's reads
# reasoning_effort, Qwen3's enable_thinking, DeepSeek-V3.1's thinking).
GPT_OSS = "{% for m in messages %}{{ m.content }}{% endfor %}|effort={{ reasoning_effort | default('medium') }}|"
QWEN3 = (
    "{% for m in messages %}{{ m.content }}{% endfor %}|"
    "{% if enable_thinking is defined and enable_thinking is false %}<think></think>{% endif %}"
)
DEEPSEEK = "{% for m in messages %}{{ m.content }}{% endfor %}|{% if thinking %}<think>{% else %}</think>{% endif %}"
PLAIN = "{% for m in messages %}{{ m.content }}{% endfor %}|"


@pytest.mark.parametrize(
    ("template", "effort", "kwargs"),
    [
        (GPT_OSS, "default", {}),
        (GPT_OSS, "high", {"reasoning_effort": "high"}),
        (QWEN3, "low", {"enable_thinking": False}),
        (QWEN3, "medium", {"enable_thinking": True}),
        (QWEN3, "default", {}),
        (DEEPSEEK, "high", {"thinking": True}),
        (DEEPSEEK, "low", {"thinking": False}),
        (PLAIN, "high", None),
        (None, "high", None),
    ],
)
def test_thinking_kwargs_follow_the_template_variable(
    template: str | None, effort: str, kwargs: dict[str, Any] | None
) -> None:
    tok = build_tokenizer()
    tok.chat_template = template
    assert thinking_kwargs(tok, effort) == kwargs


@pytest.mark.parametrize(
    ("template", "effort", "rendered"),
    [
        (GPT_OSS, "default", "2+3=|effort=medium|"),
        (GPT_OSS, "low", "2+3=|effort=low|"),
        (QWEN3, "low", "2+3=|<think></think>"),
        (QWEN3, "high", "2+3=|"),
        (DEEPSEEK, "high", "2+3=|<think>"),
    ],
)
def test_the_prompt_is_rendered_in_the_selected_thinking_mode(template: str, effort: str, rendered: str) -> None:
    tok = build_tokenizer()
    tok.chat_template = template
    messages = [{"role": "user", "content": "2+3="}]
    kwargs = thinking_kwargs(tok, effort)
    assert prompt_text(tok, messages, kwargs) == rendered
    item = PromptItem(messages=messages, item={}, line=1)
    [ids] = encode_prompts(tok, [item], max_prompt_tokens=64, template_kwargs=kwargs)
    assert ids == tok(rendered, add_special_tokens=False)["input_ids"]

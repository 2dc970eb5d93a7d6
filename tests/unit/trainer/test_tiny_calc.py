"""Tests for trainer/builtin_models/tiny_calc.py: the task, the tokenizer and chat template's tool-call round trip, the
datasets, the episode measurement (against a scripted model) and a tiny (few-step) build."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

from trainer.agents import calculator_server
from trainer.agents.calculator_server import FUNCTION, TOOL_NAME
from trainer.builtin_models import tiny_calc
from trainer.builtin_models.tiny_calc import (
    BUILD_INFO_FILE,
    TOOL,
    answer_text,
    build_tiny_calc,
    build_tokenizer,
    dropped_ones_carry_sum,
    expression_text,
    measure_episodes,
    prompt_messages,
    prompt_text,
    tool_call_text,
    tool_response_text,
    train_triples,
    validation_triples,
    write_calculator_datasets,
)
from trainer.spec.agent_spec import ToolSpec

EPISODE = (23, 58, 71)
CALL_JSON = '{"name": "calculator", "arguments": {"expression": "23+58+71"}}'


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def _triple_of(prompt: str) -> tuple[int, ...]:
    return tuple(int(n) for n in prompt.removeprefix("What is ").removesuffix("?").split(" + "))


def _assistant_call(arguments: Any) -> dict[str, Any]:
    return {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": TOOL_NAME, "arguments": arguments}}],
    }


def _ids(tokenizer: PreTrainedTokenizerFast, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _render(tokenizer: PreTrainedTokenizerFast, messages: list[dict[str, Any]], **kwargs: Any) -> str:
    text = tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)
    assert isinstance(text, str)
    return text


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    return build_tokenizer()


# --- the task -------------------------------------------------------------------------------------------------


def test_task_texts_have_the_trained_format() -> None:
    assert prompt_text(EPISODE) == "What is 23 + 58 + 71?"
    assert prompt_messages(EPISODE) == [{"role": "user", "content": "What is 23 + 58 + 71?"}]
    assert answer_text(EPISODE) == "152"
    assert expression_text(EPISODE) == "23+58+71"
    assert tool_call_text("23+58+71") == f"<tool_call>{CALL_JSON}</tool_call>"
    assert tool_response_text("152") == "<tool_response>152</tool_response>"


@pytest.mark.parametrize(
    ("numbers", "expected"),
    [((23, 58, 71), 142), ((19, 19, 19), 37), ((99, 99, 99), 277), ((11, 22, 33), 66), ((15, 25, 10), 40)],
)
def test_dropped_ones_carry_sum_loses_the_carry_out_of_the_ones_column(
    numbers: tuple[int, int, int], expected: int
) -> None:
    assert dropped_ones_carry_sum(numbers) == expected


def test_dropped_ones_carry_sum_is_right_exactly_when_the_ones_do_not_carry() -> None:
    for numbers in train_triples(2000, seed=5):
        ones_carry = sum(n % 10 for n in numbers) >= 10
        assert (dropped_ones_carry_sum(numbers) == sum(numbers)) == (not ones_carry), numbers
        assert str(dropped_ones_carry_sum(numbers))[0] == answer_text(numbers)[0] or ones_carry


def test_validation_triples_are_200_fixed_sorted_two_digit_triples() -> None:
    validation = validation_triples()
    assert len(validation) == 200 == len(set(validation))
    assert validation == sorted(validation) == validation_triples()
    assert all(len(t) == 3 and all(10 <= n <= 99 for n in t) for t in validation)


def test_train_triples_are_distinct_deterministic_and_never_validation() -> None:
    held_out = set(validation_triples())
    drawn = train_triples(5000, seed=1)
    assert len(drawn) == len(set(drawn)) == 5000
    assert held_out.isdisjoint(drawn)
    assert all(10 <= n <= 99 for t in drawn for n in t)
    assert train_triples(5000, seed=1) == drawn
    assert train_triples(5000, seed=2) != drawn
    with pytest.raises(ValueError, match="n must be"):
        train_triples(0)


# --- datasets -------------------------------------------------------------------------------------------------


def test_write_calculator_datasets_writes_rl_prompts_with_answers(tmp_path: Path) -> None:
    train_path, validation_path = write_calculator_datasets(tmp_path, seed=0, n_train=300)
    assert (train_path.name, validation_path.name) == ("train.jsonl", "validation.jsonl")
    train, validation = _read_jsonl(train_path), _read_jsonl(validation_path)
    assert len(train) == 300
    for row in train + validation:
        assert set(row) == {"messages", "answer"}
        (message,) = row["messages"]
        assert message["role"] == "user"
        assert row["answer"] == str(sum(_triple_of(message["content"])))
    assert [_triple_of(r["messages"][0]["content"]) for r in validation] == validation_triples()
    assert {_triple_of(r["messages"][0]["content"]) for r in train}.isdisjoint(validation_triples())


def test_write_calculator_datasets_is_deterministic_per_seed(tmp_path: Path) -> None:
    first = write_calculator_datasets(tmp_path / "a", seed=3, n_train=50)
    second = write_calculator_datasets(tmp_path / "b", seed=3, n_train=50)
    other = write_calculator_datasets(tmp_path / "c", seed=4, n_train=50)
    assert [p.read_bytes() for p in first] == [p.read_bytes() for p in second]
    assert first[0].read_bytes() != other[0].read_bytes()


# --- tokenizer and chat template ------------------------------------------------------------------------------


def test_tokenizer_makes_digits_and_tags_single_tokens(tokenizer: PreTrainedTokenizerFast) -> None:
    for piece in [*"0123456789", "<tools>", "</tools>", "<tool_call>", "</tool_call>", "<tool_response>"]:
        assert len(_ids(tokenizer, piece)) == 1, piece
    assert tokenizer.convert_ids_to_tokens(_ids(tokenizer, "152")) == ["1", "5", "2"]
    assert tokenizer.unk_token_id not in _ids(tokenizer, tool_call_text("23+58+71") + tool_response_text("152"))
    assert tokenizer.pad_token_id != tokenizer.eos_token_id
    assert tokenizer.padding_side == "left"
    assert len(tokenizer) < 64


def test_tokenizer_keeps_the_tags_when_skipping_special_tokens(tokenizer: PreTrainedTokenizerFast) -> None:
    ids = [*_ids(tokenizer, tool_call_text("23+58+71")), tokenizer.eos_token_id]
    assert tokenizer.decode(ids, skip_special_tokens=True) == f"<tool_call>{CALL_JSON}</tool_call>"
    assert tokenizer.decode(ids) == f"<tool_call>{CALL_JSON}</tool_call><eos>"


def test_template_shows_only_the_tool_names(tokenizer: PreTrainedTokenizerFast) -> None:
    messages = prompt_messages(EPISODE)
    assert _render(tokenizer, messages, add_generation_prompt=True) == "What is 23 + 58 + 71?"
    with_tool = _render(tokenizer, messages, tools=[TOOL], add_generation_prompt=True)
    assert with_tool == "<tools>calculator</tools>What is 23 + 58 + 71?"
    # The lead encodes prompts with each ToolSpec's .function(); a second tool is listed by name too.
    specs = [ToolSpec(name=TOOL_NAME, server_url="http://t/"), ToolSpec(name="search", server_url="http://s/")]
    listed = _render(tokenizer, messages, tools=[s.function() for s in specs], add_generation_prompt=True)
    assert listed == "<tools>calculator,search</tools>What is 23 + 58 + 71?"


def test_template_renders_a_tool_episode_as_the_model_generates_it(tokenizer: PreTrainedTokenizerFast) -> None:
    """Round trip: the rendered transcript tokenises to exactly prompt | call EOS | tool message | answer EOS, the
    layout the build trains on and the episode runner assembles."""
    eos = tokenizer.eos_token_id
    conversation = [
        *prompt_messages(EPISODE),
        _assistant_call('{"expression": "23+58+71"}'),
        {"role": "tool", "tool_call_id": "call_1", "content": "152"},
        {"role": "assistant", "content": "152"},
    ]
    rendered = _render(tokenizer, conversation, tools=[TOOL])
    assert rendered == (
        f"<tools>calculator</tools>What is 23 + 58 + 71?<tool_call>{CALL_JSON}</tool_call><eos>"
        "<tool_response>152</tool_response>152<eos>"
    )
    pieces = [
        _ids(tokenizer, _render(tokenizer, prompt_messages(EPISODE), tools=[TOOL], add_generation_prompt=True)),
        [*_ids(tokenizer, tool_call_text("23+58+71")), eos],
        _ids(tokenizer, tool_response_text("152")),
        [*_ids(tokenizer, "152"), eos],
    ]
    assert _ids(tokenizer, rendered) == [t for piece in pieces for t in piece]
    assert len(_ids(tokenizer, rendered)) == 35
    assert len(_ids(tokenizer, rendered)) * 2 < tiny_calc.RECIPE.max_position_embeddings


def test_template_delta_after_a_call_is_the_tool_message_alone(tokenizer: PreTrainedTokenizerFast) -> None:
    """What the episode runner inserts after a call turn: the rendering delta, tokenised alone, equals those tokens
    in the whole transcript."""
    before = [*prompt_messages(EPISODE), _assistant_call('{"expression": "23+58+71"}')]
    after = [*before, {"role": "tool", "tool_call_id": "call_1", "content": "152"}]
    head = _render(tokenizer, before, tools=[TOOL])
    whole = _render(tokenizer, after, tools=[TOOL], add_generation_prompt=True)
    assert whole.startswith(head)
    delta = whole[len(head) :]
    assert delta == tool_response_text("152")
    assert _ids(tokenizer, whole) == _ids(tokenizer, head) + _ids(tokenizer, delta)


def test_template_renders_arguments_given_as_an_object_like_json_text(tokenizer: PreTrainedTokenizerFast) -> None:
    as_text = _render(tokenizer, [_assistant_call('{"expression": "1+2"}')])
    as_object = _render(tokenizer, [_assistant_call({"expression": "1+2"})])
    assert (
        as_text == as_object == '<tool_call>{"name": "calculator", "arguments": {"expression": "1+2"}}</tool_call><eos>'
    )


def test_template_renders_plain_assistant_turns_with_eos(tokenizer: PreTrainedTokenizerFast) -> None:
    conversation = [*prompt_messages(EPISODE), {"role": "assistant", "content": "152"}]
    assert _render(tokenizer, conversation) == "What is 23 + 58 + 71?152<eos>"


def test_build_tokenizer_is_deterministic(tokenizer: PreTrainedTokenizerFast) -> None:
    assert build_tokenizer().get_vocab() == tokenizer.get_vocab()


# --- the measurement, against a scripted model ----------------------------------------------------------------


class _ScriptedModel:
    """Stands in for a causal LM in `measure_episodes`: `reply(episode_text, sample_index)` is each turn's text."""

    def __init__(self, tokenizer: PreTrainedTokenizerFast, reply: Callable[[str, int], str]) -> None:
        self.tokenizer, self.reply, self.training = tokenizer, reply, True
        self.calls = 0

    def eval(self) -> _ScriptedModel:
        self.training = False
        return self

    def train(self, mode: bool = True) -> _ScriptedModel:
        self.training = mode
        return self

    def generate(
        self,
        *,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        max_new_tokens: int,
        num_return_sequences: int,
        pad_token_id: int,
        eos_token_id: int,
        **_: Any,
    ) -> torch.Tensor:
        self.calls += 1
        rows = []
        for prompt, mask in zip(input_ids.tolist(), attention_mask.tolist(), strict=True):
            text = self.tokenizer.decode([t for t, m in zip(prompt, mask, strict=True) if m])
            for j in range(num_return_sequences):
                new = [*_ids(self.tokenizer, self.reply(text, j)), eos_token_id][:max_new_tokens]
                rows.append(prompt + new)
        width = max(len(r) for r in rows)
        return torch.tensor([r + [pad_token_id] * (width - len(r)) for r in rows])


def _measure(tokenizer: PreTrainedTokenizerFast, reply: Callable[[str, int], str], **kwargs: Any) -> Any:
    model = _ScriptedModel(tokenizer, reply)
    stats = measure_episodes(cast(Any, model), tokenizer, TRIPLES, batch_size=3, **kwargs)
    assert model.training  # restored
    return stats


TRIPLES = [(23, 58, 71), (11, 22, 33), (19, 19, 19), (40, 41, 12)]  # the ones carry in the 1st and 3rd


def _policy(text: str, j: int) -> str:
    """Sample 0 calls the calculator and copies its result; sample 1 answers with the ones carry dropped."""
    if text.endswith("</tool_response>"):
        return text.rsplit("<tool_response>", 1)[1].removesuffix("</tool_response>")
    numbers = _triple_of(text.removeprefix("<tools>calculator</tools>"))
    return tool_call_text(expression_text(numbers)) if j == 0 else str(dropped_ones_carry_sum(numbers))


def test_measure_episodes_counts_calls_and_scores_tool_and_direct_answers(tokenizer: PreTrainedTokenizerFast) -> None:
    stats = _measure(tokenizer, _policy, n_samples=2)
    assert stats.episodes == 8
    assert stats.call_rate == 0.5
    assert stats.exact_call_rate == 1.0
    assert stats.tool_accuracy == 1.0
    assert stats.direct_accuracy == 0.5  # (11, 22, 33) and (40, 41, 12) have no ones carry
    assert stats.accuracy == (4 + 2) / 8
    assert stats.format_error_rate == 0.0


def test_measure_episodes_runs_the_tool_on_the_expression_the_model_wrote(tokenizer: PreTrainedTokenizerFast) -> None:
    def off_by_one_operand(text: str, j: int) -> str:
        if text.endswith("</tool_response>"):
            return _policy(text, j)
        a, b, c = _triple_of(text.removeprefix("<tools>calculator</tools>"))
        return tool_call_text(f"{a}+{b}+{c + 1}")

    stats = _measure(tokenizer, off_by_one_operand, n_samples=1)
    assert (stats.call_rate, stats.exact_call_rate, stats.tool_accuracy, stats.accuracy) == (1.0, 0.0, 0.0, 0.0)
    assert stats.direct_accuracy is None


def test_measure_episodes_counts_malformed_calls_and_unfinished_turns_as_format_errors(
    tokenizer: PreTrainedTokenizerFast,
) -> None:
    def broken(text: str, j: int) -> str:
        return "<tool_call>{</tool_call>" if j == 0 else "1" * 30  # never reaches EOS within the turn budget

    stats = _measure(tokenizer, broken, n_samples=2)
    assert (stats.call_rate, stats.format_error_rate, stats.accuracy) == (0.5, 1.0, 0.0)
    assert stats.tool_accuracy == 0.0 and stats.direct_accuracy == 0.0


def test_measure_episodes_shows_the_model_the_servers_error_for_a_refused_call(
    tokenizer: PreTrainedTokenizerFast, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Every expression the model's vocabulary can write parses, so the refusal is the server's for another reason.
    answered: list[tuple[str, str]] = []

    def refuse(name: str, arguments: str) -> str:
        answered.append((name, arguments))
        raise calculator_server.CalculatorError("busy")

    monkeypatch.setattr(calculator_server, "answer_call", refuse)
    seen: list[str] = []

    def read_response(text: str, j: int) -> str:
        if text.endswith("</tool_response>"):
            seen.append(text.rsplit("<tool_response>", 1)[1])
            return "0"
        return _policy(text, 0)

    stats = _measure(tokenizer, read_response, n_samples=1)
    assert (stats.call_rate, stats.format_error_rate, stats.exact_call_rate, stats.tool_accuracy) == (1, 0, 1, 0)
    assert answered[0] == (TOOL_NAME, json.dumps({"expression": "23+58+71"}))
    # The error payload {"error": "busy"} is one run of non-digits outside the vocabulary: one <unk>.
    assert seen == ["<unk></tool_response>"] * len(TRIPLES)


def test_measure_episodes_without_tools_renders_no_tool_list(tokenizer: PreTrainedTokenizerFast) -> None:
    prompts: list[str] = []

    def record(text: str, j: int) -> str:
        prompts.append(text)
        return "0"

    stats = _measure(tokenizer, record, n_samples=1, tools=False)
    assert prompts == [prompt_text(t) for t in TRIPLES]
    assert (stats.call_rate, stats.exact_call_rate, stats.tool_accuracy, stats.direct_accuracy) == (0, None, None, 0)


# --- a tiny build ---------------------------------------------------------------------------------------------

_STEPS_A, _STEPS_B = 3, 2


@pytest.fixture(scope="module")
def tiny_builds(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, list[tuple[str, int, int]]]:
    root = tmp_path_factory.mktemp("tiny_calc")
    calls: list[tuple[str, int, int]] = []
    first = build_tiny_calc(
        root / "first",
        seed=0,
        progress=lambda stage, step, total, _loss: calls.append((stage, step, total)),
        steps_a=_STEPS_A,
        steps_b=_STEPS_B,
        eval_samples=1,
    )
    second = build_tiny_calc(root / "second", seed=0, steps_a=_STEPS_A, steps_b=_STEPS_B, eval_samples=1)
    return first, second, calls


def test_tiny_build_with_the_same_seed_gives_identical_weights(tiny_builds: tuple[Path, Path, list[Any]]) -> None:
    first, second, _ = tiny_builds
    a, b = load_file(first / "model.safetensors"), load_file(second / "model.safetensors")
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_tiny_build_with_another_seed_gives_different_weights(tmp_path: Path, tiny_builds: tuple[Any, ...]) -> None:
    other = build_tiny_calc(tmp_path / "other", seed=1, steps_a=1, steps_b=0, eval_samples=1)
    a, b = load_file(tiny_builds[0] / "model.safetensors"), load_file(other / "model.safetensors")
    assert any(not torch.equal(a[name], b[name]) for name in a)


def test_tiny_build_reports_progress_for_every_step_of_both_stages(tiny_builds: tuple[Any, ...]) -> None:
    expected = [("tool_use", s, _STEPS_A) for s in range(1, _STEPS_A + 1)]
    assert tiny_builds[2] == expected + [("calibration", s, _STEPS_B) for s in range(1, _STEPS_B + 1)]


def test_tiny_build_loads_with_auto_classes_and_keeps_the_template(tiny_builds: tuple[Any, ...]) -> None:
    path = tiny_builds[0]
    model = AutoModelForCausalLM.from_pretrained(path)
    loaded = AutoTokenizer.from_pretrained(path)
    assert isinstance(loaded, PreTrainedTokenizerFast)
    assert model.config.model_type == "llama"
    assert model.config.max_position_embeddings == 128
    assert 2_000_000 < sum(p.numel() for p in model.parameters()) < 5_000_000
    assert loaded.get_vocab() == build_tokenizer().get_vocab()
    assert loaded.padding_side == "left"
    conversation = [
        *prompt_messages(EPISODE),
        _assistant_call('{"expression": "23+58+71"}'),
        {"role": "tool", "tool_call_id": "call_1", "content": "152"},
    ]
    text = _render(loaded, conversation, tools=[FUNCTION], add_generation_prompt=True)
    assert text == _render(build_tokenizer(), conversation, tools=[FUNCTION], add_generation_prompt=True)
    ids = _ids(loaded, text)
    assert loaded.decode(ids) == text
    stats = measure_episodes(model, loaded, validation_triples()[:4], n_samples=2, seed=0)
    assert stats.episodes == 8 and 0.0 <= stats.accuracy <= 1.0


def test_tiny_build_records_recipe_and_measurements_in_build_info(tiny_builds: tuple[Any, ...]) -> None:
    info = json.loads((tiny_builds[0] / BUILD_INFO_FILE).read_text())
    assert info["model"] == tiny_calc.MODEL_NAME == "tiny-calc"
    assert info["seed"] == 0
    recipe = info["recipe"]
    assert (recipe["steps_a"], recipe["steps_b"], recipe["eval_samples"]) == (_STEPS_A, _STEPS_B, 1)
    assert recipe["lr_a"] == tiny_calc.RECIPE.lr_a
    validation = info["validation"]
    assert validation["n_triples"] == 200
    assert validation["sampled"]["episodes"] == validation["sampled_without_tools"]["episodes"] == 200
    assert validation["greedy"]["episodes"] == 200
    for stats in (validation["sampled"], validation["greedy"], validation["sampled_without_tools"]):
        for key in ("call_rate", "format_error_rate", "accuracy"):
            assert 0.0 <= stats[key] <= 1.0
    assert info["build_seconds"] >= info["train_seconds"] > 0


def test_tiny_build_leaves_no_temporary_siblings(tiny_builds: tuple[Any, ...]) -> None:
    assert sorted(p.name for p in tiny_builds[0].parent.iterdir()) == ["first", "second"]


def test_build_into_a_complete_build_is_a_no_op(tiny_builds: tuple[Any, ...]) -> None:
    path = tiny_builds[0]
    before = {p.name: p.stat().st_mtime_ns for p in path.iterdir()}

    def fail(*_args: object) -> None:
        raise AssertionError("a complete build must not train again")

    assert build_tiny_calc(path, progress=fail, steps_a=_STEPS_A, steps_b=_STEPS_B) == path
    assert {p.name: p.stat().st_mtime_ns for p in path.iterdir()} == before


def test_build_refuses_to_replace_a_foreign_non_empty_directory(tmp_path: Path) -> None:
    target = tmp_path / "not-a-build"
    target.mkdir()
    (target / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError):
        build_tiny_calc(target, steps_a=0, steps_b=0)
    assert (target / "keep.txt").read_text() == "mine"
    assert [p.name for p in tmp_path.iterdir()] == ["not-a-build"]


def test_build_rejects_negative_step_counts(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="steps_a"):
        build_tiny_calc(tmp_path / "m", steps_a=-1)
    assert not (tmp_path / "m").exists()

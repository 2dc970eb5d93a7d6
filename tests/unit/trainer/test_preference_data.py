"""trainer.spec.data: preference and supervised lines in every accepted format, their errors naming line and problem,
and their tokenisation (the reply as the policy samples it: its tokens and one EOS)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from transformers import PreTrainedTokenizerFast

from trainer.builtin_models.tiny_arith import build_tokenizer
from trainer.generation.encoding import (
    LengthGroupedSampler,
    encode_completion,
    encode_preferences,
    encode_supervised,
    pack_examples,
)
from trainer.spec.data import (
    DatasetError,
    PreferenceItem,
    load_preferences,
    load_supervised,
    parse_preference_line,
    parse_supervised_line,
)

USER = [{"role": "user", "content": "What is 2 + 3?"}]


def reply(text: str) -> list[dict[str, str]]:
    return [{"role": "assistant", "content": text}]


def write(tmp_path: Path, rows: list[Any]) -> Path:
    path = tmp_path / "data.jsonl"
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def tok() -> PreTrainedTokenizerFast:
    return build_tokenizer()


# --- preference lines ---------------------------------------------------------------------------------------


def test_openai_preference_line_parses_to_prompt_and_two_replies() -> None:
    line = {"input": {"messages": USER}, "preferred_output": reply("5"), "non_preferred_output": reply("6")}
    assert parse_preference_line(line, 3) == PreferenceItem(USER, "5", "6", 0.0, 3)


@pytest.mark.parametrize(
    "line",
    [
        {"prompt": "What is 2 + 3?", "chosen": "5", "rejected": "6"},
        {"prompt": USER, "chosen": reply("5"), "rejected": reply("6")},
        {"chosen": USER + reply("5"), "rejected": USER + reply("6")},  # TRL's implicit prompt
    ],
    ids=["trl-standard", "trl-conversational", "trl-implicit-prompt"],
)
def test_trl_preference_lines_parse_to_the_same_pair(line: dict[str, Any]) -> None:
    assert parse_preference_line(line) == PreferenceItem(USER, "5", "6")


def test_a_line_margin_is_kept() -> None:
    assert parse_preference_line({"prompt": "q", "chosen": "a", "rejected": "b", "margin": 2}).margin == 2.0


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("[1, 2]", "each line must be a JSON object"),
        ({"prompt": "q"}, "not a preference pair: expected OpenAI's"),
        ({"prompt": "q", "chosen": "a"}, "missing field 'rejected'"),
        ({"input": {"messages": USER}, "preferred_output": reply("5")}, "missing field 'non_preferred_output'"),
        ({"chosen": "a", "rejected": "b"}, "missing field 'prompt'"),
        ({"prompt": "q", "chosen": "5", "rejected": "5"}, "the chosen and rejected completions are identical"),
        (
            {"input": {"messages": USER}, "preferred_output": reply("5"), "non_preferred_output": reply("5")},
            "identical",
        ),
        ({"prompt": "q", "chosen": 5, "rejected": "6"}, "'chosen' must be a string or a non-empty list"),
        ({"prompt": "q", "chosen": "5", "rejected": []}, "'rejected' must be a string or a non-empty list"),
        ({"prompt": 3, "chosen": "5", "rejected": "6"}, "'prompt' must be a non-empty list of messages"),
        ({"prompt": "", "chosen": "5", "rejected": "6"}, "'prompt' must be a non-empty string"),
        ({"prompt": "q", "chosen": USER, "rejected": "6"}, "chosen[0].role must be 'assistant'"),
        ({"prompt": "q", "chosen": reply("5") + reply("6"), "rejected": "6"}, "exactly one assistant message"),
        ({"input": USER, "preferred_output": reply("5"), "non_preferred_output": reply("6")}, "'input' must be"),
        (
            {"input": {"messages": reply("x")}, "preferred_output": reply("5"), "non_preferred_output": reply("6")},
            "the last message of 'input.messages' is an assistant turn",
        ),
        ({"chosen": reply("5"), "rejected": reply("6")}, "share no prompt messages"),
        ({"prompt": "q", "chosen": "5", "rejected": "6", "margin": "big"}, "'margin' must be a number"),
        ({"prompt": [{"role": "robot", "content": "x"}], "chosen": "5", "rejected": "6"}, "prompt[0].role"),
    ],
)
def test_bad_preference_line_is_a_dataset_error_naming_the_line_and_problem(
    tmp_path: Path, line: Any, message: str
) -> None:
    good = {"prompt": "q", "chosen": "a", "rejected": "b"}
    path = write(tmp_path, [good, line])
    with pytest.raises(DatasetError) as err:
        load_preferences(path)
    assert err.value.line == 2
    assert str(err.value).startswith(f"{path}:2: ")
    assert message in str(err.value)


def test_preference_file_errors_not_found_empty_and_not_json(tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match="file not found"):
        load_preferences(tmp_path / "missing.jsonl")
    with pytest.raises(DatasetError, match="holds no examples"):
        load_preferences(write(tmp_path, []))
    with pytest.raises(DatasetError, match=r":1: not valid JSON"):
        load_preferences(write(tmp_path, ["{oops"]))


def test_tiny_arith_preference_files_load(arithmetic_data: Path) -> None:
    items = load_preferences(arithmetic_data / "preferences.jsonl")
    assert len(items) == 4000 and all(it.chosen != it.rejected for it in items)
    assert {it.kind for it in items} == {"units", "tens", "hundreds"}


# --- supervised lines ---------------------------------------------------------------------------------------


def test_supervised_line_trains_every_assistant_turn_unless_weight_is_zero() -> None:
    msgs = [*USER, {"role": "assistant", "content": "5", "weight": 0}, *USER, *reply("5")]
    item = parse_supervised_line({"messages": msgs}, 7)
    assert item.trained == (False, False, False, True) and item.line == 7
    assert item.messages[1] == {"role": "assistant", "content": "5"}


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ({"prompt": "q"}, "missing field 'messages'"),
        ({"messages": USER}, "the last message must be an assistant turn"),
        ({"messages": []}, "'messages' must be a non-empty list"),
        ({"messages": [*USER, {"role": "assistant", "content": 5}]}, "messages[1].content must be a string"),
        ({"messages": [*USER, {"role": "assistant", "content": "5", "weight": 2}]}, "weight must be 0 or 1"),
        ({"messages": [{**USER[0], "weight": 1}, *reply("5")]}, "only allowed on assistant messages"),
        ({"messages": [*USER, {"role": "assistant", "content": "5", "weight": 0}]}, "every one has weight 0"),
    ],
)
def test_bad_supervised_line_is_a_dataset_error_naming_the_line(tmp_path: Path, line: Any, message: str) -> None:
    path = write(tmp_path, [{"messages": USER + reply("5")}, line])
    with pytest.raises(DatasetError) as err:
        load_supervised(path)
    assert err.value.line == 2 and message in str(err.value)


# --- tokenisation -------------------------------------------------------------------------------------------


def test_a_reply_is_encoded_after_the_templated_prompt_with_one_eos(tok: PreTrainedTokenizerFast) -> None:
    prompt_ids, reply_ids = encode_completion(tok, USER, "15")
    assert tok.decode(prompt_ids) == "What is 2 + 3?"
    assert reply_ids == [*tok("15", add_special_tokens=False)["input_ids"], tok.eos_token_id]
    assert encode_completion(tok, USER, "")[1] == [tok.eos_token_id]


def test_a_pair_longer_than_max_length_is_refused_naming_its_line(tok: PreTrainedTokenizerFast) -> None:
    item = PreferenceItem(USER, "123", "4", line=5)  # prompt 10 tokens, longer reply 3 + EOS
    (pair,) = encode_preferences(tok, [item], max_length=14)
    assert len(pair.prompt_ids) == 10 and len(pair.chosen_ids) == 4 and pair.rejected_ids[-1] == tok.eos_token_id
    with pytest.raises(DatasetError, match=r"data.jsonl:5: the prompt and its longer reply are 14 tokens"):
        encode_preferences(tok, [item], max_length=13, path="data.jsonl")


def test_supervised_targets_are_the_final_reply_and_eos(tok: PreTrainedTokenizerFast) -> None:
    item = parse_supervised_line({"messages": USER + reply("5")})
    (ex,) = encode_supervised(tok, [item], max_length=64)
    prompt_ids, reply_ids = encode_completion(tok, USER, "5")
    assert ex.ids == prompt_ids + reply_ids
    assert ex.targets == [False] * len(prompt_ids) + [True] * len(reply_ids)


def test_supervised_earlier_assistant_turns_are_targets_unless_last_only(tok: PreTrainedTokenizerFast) -> None:
    msgs = [*USER, *reply("5"), {"role": "user", "content": "What is 1 + 1?"}, *reply("2")]
    item = parse_supervised_line({"messages": msgs})
    (ex,) = encode_supervised(tok, [item], max_length=64)
    trained = [i for i, t in zip(ex.ids, ex.targets, strict=True) if t]
    assert tok.decode(trained, skip_special_tokens=True) == "52" and trained[-1] == tok.eos_token_id
    (last,) = encode_supervised(tok, [item], max_length=64, last_turn_only=True)
    assert last.ids == ex.ids
    assert tok.decode([i for i, t in zip(last.ids, last.targets, strict=True) if t], skip_special_tokens=True) == "2"


def test_supervised_conversation_longer_than_max_length_is_refused(tok: PreTrainedTokenizerFast) -> None:
    item = parse_supervised_line({"messages": USER + reply("5")}, 4)
    with pytest.raises(DatasetError, match=r"f.jsonl:4: the conversation is 12 tokens, more than max_length = 11"):
        encode_supervised(tok, [item], max_length=11, path="f.jsonl")


# --- packing and length grouping ----------------------------------------------------------------------------


def test_pack_examples_fills_rows_first_fit_by_decreasing_length() -> None:
    rows = pack_examples([5, 3, 8, 2, 4], 8)
    assert rows == [[2], [0, 1], [4, 3]]
    assert sorted(i for r in rows for i in r) == list(range(5))


def test_length_grouped_sampler_sorts_each_group_and_resumes_exactly() -> None:
    lengths = [(7 * i) % 11 for i in range(40)]
    a = LengthGroupedSampler(lengths, seed=1, group=8)
    first = a.next(8)
    assert [lengths[i] for i in first] == sorted((lengths[i] for i in first), reverse=True)
    state = a.state_dict()
    rest = [a.next(8) for _ in range(7)]  # crosses an epoch
    b = LengthGroupedSampler(lengths, seed=1, group=8)
    b.load_state_dict(state)
    assert [b.next(8) for _ in range(7)] == rest
    assert sorted(first + [i for r in rest[:4] for i in r]) == list(range(40))  # one epoch is a permutation

"""Supervised and DPO lines with tools (OpenAI's chat format: ``tools``, ``parallel_tool_calls``, assistant
``tool_calls``, ``tool`` messages, content parts, ``name``): every field kept, every problem an error naming the line
and the field, and the rendering in the model's own tool-call syntax, the loss mask checked token by token on
tiny-calc's tokenizer against one built by hand from its template's pieces."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
from transformers import PreTrainedTokenizerFast

from tests.unit.trainer.test_tool_calls import chatml_tokenizer
from trainer.builtin_models import tiny_arith, tiny_calc
from trainer.generation.encoding import encode_preferences, encode_supervised, template_messages
from trainer.spec.data import (
    DatasetError,
    load_preferences,
    load_supervised,
    parse_preference_line,
    parse_prompt_line,
    parse_supervised_line,
)

NUMBERS = (23, 58, 71)
QUESTION = {"role": "user", "content": tiny_calc.prompt_text(NUMBERS)}  # "What is 23 + 58 + 71?"
TOOLS = [tiny_calc.TOOL]


def call(i: int = 1, expression: str = "23+58+71", *, arguments: Any = None) -> dict[str, Any]:
    args = json.dumps({"expression": expression}) if arguments is None else arguments
    return {"id": f"call_{i}", "type": "function", "function": {"name": "calculator", "arguments": args}}


def calls_turn(*calls: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"role": "assistant", "content": None, "tool_calls": list(calls), **extra}


def tool_message(i: int = 1, content: str = "152") -> dict[str, Any]:
    return {"role": "tool", "tool_call_id": f"call_{i}", "content": content}


def episode(**extra: Any) -> dict[str, Any]:
    """user asks, assistant calls the calculator, the tool answers, the assistant answers."""
    messages = [QUESTION, calls_turn(call()), tool_message(), {"role": "assistant", "content": "152"}]
    return {"messages": messages, "tools": TOOLS, **extra}


def pair(**input_extra: Any) -> dict[str, Any]:
    return {
        "input": {"messages": [QUESTION], "tools": TOOLS, **input_extra},
        "preferred_output": [calls_turn(call())],
        "non_preferred_output": [{"role": "assistant", "content": "142"}],
    }


def write(tmp_path: Path, rows: list[Any]) -> Path:
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def edited(line: dict[str, Any], path: tuple[Any, ...], value: Any) -> dict[str, Any]:
    """A copy of ``line`` with the value at ``path`` set (``...`` as the value deletes it)."""
    out = copy.deepcopy(line)
    node = out
    for key in path[:-1]:
        node = node[key]
    if value is ...:
        del node[path[-1]]
    else:
        node[path[-1]] = value
    return out


@pytest.fixture(scope="module")
def calc_tok() -> PreTrainedTokenizerFast:
    return tiny_calc.build_tokenizer()


# --- parsing: everything kept --------------------------------------------------------------------------------


def test_a_tool_episode_keeps_every_field_and_joins_text_parts() -> None:
    line = episode(parallel_tool_calls=False)
    line["messages"][0] = {
        **QUESTION,
        "name": "ann",
        "content": [{"type": "text", "text": "What is "}, {"type": "text", "text": "23 + 58 + 71?"}],
    }
    item = parse_supervised_line(line, 4)
    assert item.messages == [
        {"role": "user", "content": "What is 23 + 58 + 71?", "name": "ann"},
        {"role": "assistant", "content": None, "tool_calls": [call()]},
        {"role": "tool", "content": "152", "tool_call_id": "call_1"},
        {"role": "assistant", "content": "152"},
    ]
    assert item.tools == TOOLS and item.parallel_tool_calls is False
    assert item.trained == (False, True, False, True) and item.line == 4


def test_a_dpo_line_keeps_the_inputs_tools_and_the_replies_calls() -> None:
    item = parse_preference_line(pair(parallel_tool_calls=True), 2)
    assert item.prompt == [QUESTION] and item.tools == TOOLS and item.parallel_tool_calls is True
    assert (item.chosen, item.chosen_tool_calls) == ("", (call(),))
    assert (item.rejected, item.rejected_tool_calls) == ("142", ())
    assert item.chosen_message() == {"role": "assistant", "content": "", "tool_calls": [call()]}


# --- parsing: every problem names its field ------------------------------------------------------------------

M = "messages"
SUPERVISED_ERRORS = [
    (edited(episode(), (M, 2, "tool_call_id"), "call_9"), "messages[2].tool_call_id 'call_9' answers no earlier"),
    (edited(episode(), (M, 2, "tool_call_id"), ...), "messages[2].tool_call_id must be a non-empty string"),
    (
        edited(episode(), (M, 1, "tool_calls", 0, "function", "arguments"), "{oops"),
        "tool_calls[0].function.arguments is not JSON",
    ),
    (
        edited(episode(), (M, 1, "tool_calls", 0, "function", "arguments"), "[1]"),
        "arguments must be a JSON object, not list",
    ),
    (
        edited(episode(), (M, 1, "tool_calls", 0, "function", "arguments"), {"expression": "1"}),
        "arguments must be a string holding",
    ),
    (edited(episode(), (M, 1, "tool_calls", 0, "type"), "code"), "messages[1].tool_calls[0].type must be 'function'"),
    (
        edited(episode(), (M, 1, "tool_calls", 0, "function", "name"), "search"),
        "'search' is not one of the line's tools",
    ),
    (edited(episode(), (M, 1, "tool_calls", 0, "id"), ...), "messages[1].tool_calls[0].id must be a non-empty string"),
    (edited(episode(), (M, 1, "tool_calls"), []), "messages[1].tool_calls must be a non-empty list"),
    (
        edited(episode(), (M, 1, "tool_calls"), ...),
        "messages[1].content must be a string unless the message has tool_calls",
    ),
    (edited(episode(), (M, 1, "function_call"), {"name": "calculator"}), "messages[1].function_call is deprecated"),
    (edited(episode(), (M, 3, "refusal"), "no"), "messages[3].refusal is not supported"),
    (edited(episode(), (M, 0, "foo"), 1), "messages[0].foo is not a field of a user message"),
    (edited(episode(), (M, 2, "name"), "calculator"), "messages[2].name is not a field of a tool message"),
    (edited(episode(), (M, 0, "weight"), 1), "messages[0].weight is only allowed on assistant messages"),
    (edited(episode(), (M, 0, "role"), "function"), "messages[0].role must be one of system, developer, user"),
    (
        edited(episode(), (M, 0, "content"), [{"type": "text", "text": "hi"}, {"type": "image_url", "image_url": {}}]),
        "messages[0].content[1].type 'image_url' is not supported",
    ),
    (
        edited(episode(), (M, 0, "content"), [{"type": "text", "text": 3}]),
        "messages[0].content[0].text must be a string",
    ),
    (
        edited(episode(), (M, 0, "content"), []),
        "messages[0].content must be a string or a non-empty list of text parts",
    ),
    (edited(episode(), ("tools", 0, "type"), "code_interpreter"), "tools[0] must be a function tool"),
    (
        edited(episode(), ("tools", 0, "function", "examples"), []),
        "tools[0].function.examples is not a field of a function",
    ),
    (edited(episode(), ("tools", 0, "function", "name"), "a b"), "tools[0].function.name must be 1 to 64 letters"),
    (
        edited(episode(), ("tools", 0, "function", "parameters"), {"type": "array"}),
        "tools[0].function.parameters must be",
    ),
    (edited(episode(), ("tools",), TOOLS * 2), "tools[1].function.name 'calculator' is defined twice"),
    (edited(episode(), ("tools",), {"calculator": {}}), "'tools' must be a list of function tools"),
    (edited(episode(), ("parallel_tool_calls",), "no"), "'parallel_tool_calls' must be a boolean"),
    (edited(episode(), ("functions",), []), "'functions' is deprecated and not supported: use 'tools'"),
    (
        edited(episode(parallel_tool_calls=False), (M, 1, "tool_calls"), [call(1), call(2)]),
        "messages[1].tool_calls holds 2 calls but parallel_tool_calls is false",
    ),
    (
        edited(episode(), (M, 1, "tool_calls"), [call(1), call(2)]),
        "messages[3]: the tool calls of messages[1] (call_2) have no tool message answering them",
    ),
    (
        {"messages": [QUESTION, calls_turn(call()), tool_message(), calls_turn(call()), tool_message()]},
        "messages[3].tool_calls[0].id 'call_1' is used by an earlier call",
    ),
]


@pytest.mark.parametrize(("line", "message"), SUPERVISED_ERRORS)
def test_a_bad_tool_field_in_a_supervised_line_is_an_error_naming_line_and_field(
    tmp_path: Path, line: dict[str, Any], message: str
) -> None:
    path = write(tmp_path, [episode(), line])
    with pytest.raises(DatasetError) as err:
        load_supervised(path)
    assert err.value.line == 2 and str(err.value).startswith(f"{path}:2: ")
    assert message in err.value.detail


PREFERENCE_ERRORS = [
    (
        edited(pair(), ("input", "messages", 0, "content"), [{"type": "input_audio", "input_audio": {}}]),
        "input.messages[0].content[0].type 'input_audio' is not supported",
    ),
    (edited(pair(), ("preferred_output", 0, "weight"), 1), "preferred_output[0].weight is not a field of an assistant"),
    (edited(pair(), ("input", "functions"), []), "'input.functions' is deprecated"),
    (edited(pair(), ("input", "response_format"), {}), "input.response_format is not a field of a DPO input"),
    (
        edited(pair(parallel_tool_calls=False), ("preferred_output", 0, "tool_calls"), [call(1), call(2)]),
        "preferred_output[0].tool_calls holds 2 calls but input.parallel_tool_calls is false",
    ),
    (
        edited(pair(), ("preferred_output", 0, "tool_calls", 0, "function", "name"), "search"),
        "preferred_output[0].tool_calls[0].function.name 'search' is not one of the line's tools",
    ),
    (
        edited(pair(), ("preferred_output", 0, "tool_calls"), [call(1), call(1)]),
        "preferred_output[0].tool_calls[1].id 'call_1' is used by an earlier call",
    ),
    (edited(pair(), ("non_preferred_output", 0, "name"), "bot"), "non_preferred_output[0].name is not supported"),
    (
        edited(pair(), ("input", "messages"), [QUESTION, calls_turn(call(1), call(2)), tool_message(1)]),
        "the tool calls of the prompt's message 1 have no tool message answering them",
    ),
    (
        edited(pair(), ("non_preferred_output",), [calls_turn(call(7))]),
        "the chosen and rejected completions are identical",
    ),
    (
        {"prompt": [QUESTION], "chosen": [calls_turn(call())], "rejected": "142", "tools": [{"type": "function"}]},
        "tools[0].function must be an object",
    ),
]


@pytest.mark.parametrize(("line", "message"), PREFERENCE_ERRORS)
def test_a_bad_tool_field_in_a_preference_line_is_an_error_naming_line_and_field(
    tmp_path: Path, line: dict[str, Any], message: str
) -> None:
    path = write(tmp_path, [pair(), line])
    with pytest.raises(DatasetError) as err:
        load_preferences(path)
    assert err.value.line == 2 and message in err.value.detail


# --- rendering: the model's own syntax, the mask token by token -------------------------------------------------


def ids(tok: PreTrainedTokenizerFast, text: str) -> list[int]:
    return list(tok(text, add_special_tokens=False)["input_ids"])


def test_a_tool_episode_trains_the_call_and_the_answer_with_their_eos_and_nothing_else(
    calc_tok: PreTrainedTokenizerFast,
) -> None:
    # Arguments written compactly come out as the template writes them: as the model will write them.
    line = edited(episode(), (M, 1, "tool_calls", 0, "function", "arguments"), '{"expression":"23+58+71"}')
    (ex,) = encode_supervised(calc_tok, [parse_supervised_line(line)], max_length=128)
    eos = calc_tok.eos_token_id
    # By hand, from the pieces tiny-calc was built on (tiny_calc._encode's layout of a tool episode).
    segments = [
        (ids(calc_tok, "<tools>calculator</tools>What is 23 + 58 + 71?"), False),
        (
            [
                *ids(
                    calc_tok, '<tool_call>{"name": "calculator", "arguments": {"expression": "23+58+71"}}</tool_call>'
                ),
                eos,
            ],
            True,
        ),
        (ids(calc_tok, "<tool_response>152</tool_response>"), False),
        ([*ids(calc_tok, "152"), eos], True),
    ]
    assert ex.ids == [i for seg, _ in segments for i in seg]
    assert ex.targets == [t for seg, t in segments for _ in seg]
    assert segments[1][0][:-1] == ids(calc_tok, tiny_calc.tool_call_text("23+58+71"))
    trained = calc_tok.decode([i for i, t in zip(ex.ids, ex.targets, strict=True) if t])
    assert (
        trained == '<tool_call>{"name": "calculator", "arguments": {"expression": "23+58+71"}}</tool_call><eos>152<eos>'
    )


def test_a_call_turn_of_weight_zero_is_context_and_a_last_call_turn_is_the_reply(
    calc_tok: PreTrainedTokenizerFast,
) -> None:
    eos = calc_tok.eos_token_id
    call_ids = [*ids(calc_tok, tiny_calc.tool_call_text("23+58+71")), eos]
    weighted = edited(episode(), (M, 1, "weight"), 0)
    (ex,) = encode_supervised(calc_tok, [parse_supervised_line(weighted)], max_length=128)
    assert calc_tok.decode([i for i, t in zip(ex.ids, ex.targets, strict=True) if t]) == "152<eos>"
    only_call = {"messages": [QUESTION, calls_turn(call())], "tools": TOOLS}
    (ex,) = encode_supervised(calc_tok, [parse_supervised_line(only_call)], max_length=128)
    prompt = ids(calc_tok, "<tools>calculator</tools>What is 23 + 58 + 71?")
    assert ex.ids == prompt + call_ids and ex.targets == [False] * len(prompt) + [True] * len(call_ids)


def test_parallel_calls_render_in_order_in_one_turn(calc_tok: PreTrainedTokenizerFast) -> None:
    line = {"messages": [QUESTION, calls_turn(call(1, "23+58"), call(2, "81+71"), content="Two sums.")], "tools": TOOLS}
    (ex,) = encode_supervised(calc_tok, [parse_supervised_line(line)], max_length=128)
    reply = [i for i, t in zip(ex.ids, ex.targets, strict=True) if t]
    text = f"Two sums.{tiny_calc.tool_call_text('23+58')}{tiny_calc.tool_call_text('81+71')}"
    assert reply == [*ids(calc_tok, text), calc_tok.eos_token_id]


def test_a_dpo_pair_shows_the_tools_in_the_prompt_and_its_call_reply_in_the_models_syntax(
    calc_tok: PreTrainedTokenizerFast,
) -> None:
    (encoded,) = encode_preferences(calc_tok, [parse_preference_line(pair())], max_length=128)
    assert encoded.prompt_ids == ids(calc_tok, "<tools>calculator</tools>What is 23 + 58 + 71?")
    assert encoded.chosen_ids == [*ids(calc_tok, tiny_calc.tool_call_text("23+58+71")), calc_tok.eos_token_id]
    assert encoded.rejected_ids == [*ids(calc_tok, "142"), calc_tok.eos_token_id]


@pytest.mark.parametrize(
    ("which", "line", "message"),
    [
        (
            "calc",
            edited(episode(), (M, 0, "name"), "ann"),
            "messages[0].name: the model's chat template does not render names",
        ),
        ("arith", episode(), "tools: the model's chat template does not render tools"),
        (
            "arith",
            {"messages": [QUESTION, calls_turn(call())]},
            "messages[1].tool_calls: the model's chat template does not render tool calls",
        ),
    ],
)
def test_a_field_the_chat_template_would_drop_is_an_error_naming_line_and_field(
    calc_tok: PreTrainedTokenizerFast, which: str, line: dict[str, Any], message: str
) -> None:
    tok = calc_tok if which == "calc" else tiny_arith.build_tokenizer()
    with pytest.raises(DatasetError) as err:
        encode_supervised(tok, [parse_supervised_line(line, 3)], max_length=128, path="f.jsonl")
    assert err.value.line == 3 and str(err.value).startswith(f"f.jsonl:3: {message}")


def test_a_dpo_reply_with_calls_on_a_template_without_calls_is_an_error_naming_the_reply() -> None:
    line = edited(pair(), ("input", "tools"), ...)
    with pytest.raises(DatasetError) as err:
        encode_preferences(tiny_arith.build_tokenizer(), [parse_preference_line(line, 7)], max_length=128)
    assert err.value.line == 7
    assert err.value.detail == "preferred_output[0].tool_calls: the model's chat template does not render tool calls"


# --- a ChatML template as Qwen 2.5 and Qwen 3 write tool calls (test_tool_calls' tokenizer) -------------------


@pytest.mark.parametrize("think", [False, True], ids=["qwen2.5", "qwen3-empty-think-on-the-last-turn"])
def test_a_qwen_like_template_trains_the_call_through_im_end_and_not_the_tool_turn(think: bool) -> None:
    tok = chatml_tokenizer(think=think)
    messages = episode()["messages"]
    (ex,) = encode_supervised(tok, [parse_supervised_line(episode())], max_length=4096)
    trained = tok.decode([i for i, t in zip(ex.ids, ex.targets, strict=True) if t])
    call_text = '\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "23+58+71"}}\n</tool_call>'
    assert trained == f"{call_text}<|im_end|>152<|im_end|>"
    if not think:  # the whole conversation as the template writes it, less ChatML's newline after the last turn
        whole = tok.apply_chat_template(template_messages(messages), tools=TOOLS, tokenize=False)
        assert ex.ids == ids(tok, whole.removesuffix("\n"))
    (last,) = encode_supervised(
        tok, [parse_supervised_line({"messages": messages[:2], "tools": TOOLS})], max_length=4096
    )
    assert tok.decode([i for i, t in zip(last.ids, last.targets, strict=True) if t]) == f"{call_text}<|im_end|>"


def test_a_template_that_refuses_the_conversation_is_an_error_naming_the_line(
    calc_tok: PreTrainedTokenizerFast,
) -> None:
    tok = copy.deepcopy(calc_tok)
    tok.chat_template = "{%- if messages[1].tool_calls %}{{ raise_exception('no calls here') }}{% endif %}x"
    with pytest.raises(DatasetError) as err:
        encode_supervised(tok, [parse_supervised_line(episode(), 5)], max_length=128)
    assert err.value.line == 5
    assert err.value.detail == "the model's chat template refuses this conversation: no calls here"


@pytest.mark.parametrize(
    ("message", "field"),
    [({"name": "ann"}, "name"), ({"tool_calls": []}, "tool_calls"), ({"weight": 0}, "weight")],
)
def test_an_rl_prompt_message_field_the_prompt_would_lose_is_an_error_naming_it(
    message: dict[str, Any], field: str
) -> None:
    line = {"messages": [{"role": "user", "content": "What is 1 + 2?", **message}], "answer": "3"}
    with pytest.raises(ValueError, match=rf"^messages\[0\]\.{field} is not kept in an RL prompt"):
        parse_prompt_line(line)
    assert parse_prompt_line({"messages": [{"role": "user", "content": "What is 1 + 2?"}]}).messages

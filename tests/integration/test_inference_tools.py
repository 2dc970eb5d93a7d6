"""``proxima inference``'s tools and structured outputs, its app over HTTP in this process (the engine on its model
thread, as the server runs it), driven by the official ``openai`` client.

tiny-calc, offered the calculator, calls it on about 30% of its samples at temperature 1 (its build's measured rate):
the calls come back parsed, streamed as OpenAI streams them; ``required`` and a named function force a call on every
sample, ``none`` forbids it; a follow-up with the tool's result is answered. Under a JSON schema tiny-arith writes
a number and tiny-calc an object that validate on every sample at temperature 1, and an answer cut by max_tokens is
``length``; a ``strict`` schema breaking OpenAI's strict-mode rules is a 400.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest
import torch
from fastapi.testclient import TestClient
from openai import OpenAI

from api.settings import Settings
from trainer.agents.calculator_server import FUNCTION, PARAMETERS, TOOL_NAME
from trainer.builtin_models.tiny_calc import prompt_messages
from trainer.serving import inference
from worker.inference import create_app

QUESTION = [23, 58, 71]
ARGUMENTS = {"expression": "23+58+71"}  # what tiny-calc writes for the question (its training)
STRICT_FUNCTION = {"type": "function", "function": {**FUNCTION["function"], "strict": True}}
ANSWER_SCHEMA = {"type": "integer", "minimum": 0, "maximum": 198}  # tiny-arith's vocabulary writes numbers only
# tiny-calc's JSON objects: its one token with "{" opens the calculator call whole, and '"}}' closes it
CALL_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "enum": ["calculator"]},
        "arguments": {
            "type": "object",
            "properties": {"expression": {"type": "string", "maxLength": 12}},
            "required": ["expression"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "arguments"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def http(tiny_arith_dir: Path, tiny_calc_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestClient]:
    torch.set_num_threads(1)
    home = tmp_path_factory.mktemp("inference-tools")
    (home / "models").mkdir()
    (home / "models" / "tiny-arith").symlink_to(tiny_arith_dir)
    (home / "models" / "tiny-calc").symlink_to(tiny_calc_dir)
    settings = Settings(
        home=home,
        artifacts=str(home / "artifacts"),
        base_models=["tiny-arith", "tiny-calc"],
        inference_precision="fp32",
    )
    with TestClient(create_app(settings)) as http:
        yield http


@pytest.fixture(scope="module")
def client(http: TestClient) -> OpenAI:
    return OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=http, max_retries=0)


def ask_calc(client: OpenAI, n: int, **kw: Any) -> Any:
    return client.chat.completions.create(
        model="tiny-calc",
        messages=prompt_messages(QUESTION),  # type: ignore[arg-type]
        tools=[FUNCTION],  # type: ignore[list-item]
        temperature=1.0,
        seed=3,
        n=n,
        max_tokens=24,
        **kw,
    )


def test_tool_calls_come_back_parsed_on_the_samples_that_call(client: OpenAI) -> None:
    out = ask_calc(client, 48)
    calls = [c for c in out.choices if c.message.tool_calls]
    assert 0.1 <= len(calls) / 48 <= 0.6  # tiny-calc's measured rate is 0.30
    for c in calls:
        assert c.finish_reason == "tool_calls" and c.message.content is None
        [call] = c.message.tool_calls
        assert call.type == "function" and call.id.startswith("call_") and len(call.id) == 29
        assert call.function.name == TOOL_NAME and json.loads(call.function.arguments) == ARGUMENTS
    for c in out.choices:
        if not c.message.tool_calls:  # a direct answer: digits, as text
            assert c.finish_reason == "stop" and c.message.content and c.message.content.isdigit()


@pytest.mark.parametrize(
    "choice", ["required", {"type": "function", "function": {"name": TOOL_NAME}}], ids=["required", "named"]
)
def test_required_and_named_tool_choice_force_a_call_on_every_sample(client: OpenAI, choice: Any) -> None:
    out = ask_calc(client, 32, tool_choice=choice, parallel_tool_calls=False)
    # OpenAI's finish reason: "stop" when tool_choice names the function, "tool_calls" for any other call
    finish = "stop" if isinstance(choice, dict) else "tool_calls"
    assert [c.finish_reason for c in out.choices] == [finish] * 32
    arguments = []
    for c in out.choices:
        [call] = c.message.tool_calls
        assert call.function.name == TOOL_NAME and c.message.content is None
        arguments.append(json.loads(call.function.arguments))
        jsonschema.validate(arguments[-1], PARAMETERS)  # the grammar holds the arguments to the tool's schema
    # forced where it would have answered, at temperature 1 it miscopies an operand at times
    assert arguments.count(ARGUMENTS) >= 24


def test_tool_choice_none_calls_no_tool(client: OpenAI) -> None:
    out = ask_calc(client, 48, tool_choice="none")
    for c in out.choices:
        assert c.message.tool_calls is None and c.finish_reason == "stop"
        assert c.message.content and c.message.content.isdigit()  # never the call tag


def test_streamed_choices_carry_the_same_calls_and_answers_as_the_whole_answer(client: OpenAI) -> None:
    whole = ask_calc(client, 16)
    chunks = list(ask_calc(client, 16, stream=True))  # the same seed: the same tokens
    got: dict[int, dict[str, Any]] = {i: {"content": "", "calls": [], "finish": None} for i in range(16)}
    for chunk in chunks:
        for c in chunk.choices:
            g = got[c.index]
            g["content"] += c.delta.content or ""
            for d in c.delta.tool_calls or []:
                if d.id is not None:  # a call's first delta: its id, type and name, no arguments yet
                    assert d.type == "function" and d.function.name == TOOL_NAME and d.function.arguments == ""
                    g["calls"].append({"index": d.index, "id": d.id, "arguments": ""})
                else:
                    assert g["calls"][d.index]["index"] == d.index
                    g["calls"][d.index]["arguments"] += d.function.arguments
            g["finish"] = c.finish_reason or g["finish"]
    for i, c in enumerate(whole.choices):
        g = got[i]
        assert g["finish"] == c.finish_reason and g["content"] == (c.message.content or "")
        assert [json.loads(x["arguments"]) for x in g["calls"]] == [
            json.loads(t.function.arguments) for t in c.message.tool_calls or []
        ]
    assert any(g["calls"] for g in got.values()) and any(g["content"] for g in got.values())


def test_a_streamed_call_that_tool_choice_names_finishes_with_stop(client: OpenAI) -> None:
    named = {"type": "function", "function": {"name": TOOL_NAME}}
    chunks = list(ask_calc(client, 4, stream=True, tool_choice=named, parallel_tool_calls=False))
    finishes = {c.index: c.finish_reason for chunk in chunks for c in chunk.choices if c.finish_reason}
    calls = {c.index for chunk in chunks for c in chunk.choices if c.delta.tool_calls}
    assert finishes == dict.fromkeys(range(4), "stop") and calls == set(range(4))  # OpenAI's: a call, then "stop"


def test_a_streamed_tool_call_accumulates_in_the_official_clients_stream_helper(client: OpenAI) -> None:
    with client.chat.completions.stream(
        model="tiny-calc",
        messages=prompt_messages(QUESTION),  # type: ignore[arg-type]
        tools=[STRICT_FUNCTION],  # type: ignore[list-item]
        tool_choice="required",
        temperature=1.0,
        max_tokens=24,
    ) as stream:
        events = [e.type for e in stream]
        final = stream.get_final_completion()
    choice = final.choices[0]
    assert choice.finish_reason == "tool_calls"
    [call] = choice.message.tool_calls or []
    assert call.function.name == TOOL_NAME and call.function.parsed_arguments == ARGUMENTS
    assert call.id.startswith("call_")
    assert "tool_calls.function.arguments.done" in events


def test_a_follow_up_with_the_tools_result_is_answered(client: OpenAI) -> None:
    first = ask_calc(client, 1, tool_choice="required").choices[0].message
    [call] = first.tool_calls
    follow_up = [
        *prompt_messages(QUESTION),
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "152"},
    ]
    out = client.chat.completions.create(
        model="tiny-calc",
        messages=follow_up,
        tools=[FUNCTION],
        temperature=0,
        max_tokens=8,  # type: ignore[arg-type,list-item]
    )
    choice = out.choices[0]
    assert choice.message.content == "152" and choice.message.tool_calls is None  # it copies the tool's result
    assert choice.finish_reason == "stop"


def test_a_json_schema_answer_validates_on_every_sample(client: OpenAI) -> None:
    out = client.chat.completions.create(
        model="tiny-arith",
        messages=[{"role": "user", "content": "What is 23 + 58?"}],
        temperature=1.0,
        n=128,
        max_tokens=5,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "sum", "schema": ANSWER_SCHEMA, "strict": True},
        },
    )
    assert [c.finish_reason for c in out.choices] == ["stop"] * 128
    for c in out.choices:
        jsonschema.validate(json.loads(c.message.content or ""), ANSWER_SCHEMA)


def test_a_strict_object_schema_validates_on_all_200_samples_at_temperature_1(client: OpenAI) -> None:
    # the head, at most 12 one-character tokens of the expression, the close and EOS: max_tokens cuts none
    fmt = {"type": "json_schema", "json_schema": {"name": "call", "schema": CALL_SCHEMA, "strict": True}}
    choices = []
    for seed in (1, 2):
        out = client.chat.completions.create(
            model="tiny-calc",
            messages=prompt_messages(QUESTION),  # type: ignore[arg-type]
            temperature=1.0,
            seed=seed,
            n=100,
            max_tokens=15,
            response_format=fmt,  # type: ignore[arg-type]
        )
        choices += out.choices
    assert [c.finish_reason for c in choices] == ["stop"] * 200
    for c in choices:
        jsonschema.validate(json.loads(c.message.content or ""), CALL_SCHEMA)
        assert c.message.tool_calls is None
    assert len({c.message.content for c in choices}) > 20  # sampled, not one answer repeated


def test_max_tokens_cutting_the_json_short_is_length(client: OpenAI) -> None:
    out = client.chat.completions.create(
        model="tiny-arith",
        messages=[{"role": "user", "content": "What is 23 + 58?"}],
        temperature=0,
        max_tokens=2,  # the two digits: no room left for the end token
        response_format={"type": "json_schema", "json_schema": {"name": "sum", "schema": ANSWER_SCHEMA}},
    )
    assert out.choices[0].finish_reason == "length"


@pytest.mark.parametrize(
    ("kw", "param"),
    [
        ({"response_format": {"type": "json_object"}, "tools": [FUNCTION]}, "response_format"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"not": {}}}}},
            "response_format",
        ),
        ({"tool_choice": "required"}, "tool_choice"),
        # no token of tiny-calc's begins "true" or "false"
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "b", "schema": {"type": "boolean"}}}},
            "response_format",
        ),
        ({"tools": [FUNCTION], "tool_choice": {"type": "function", "function": {"name": "other"}}}, "tool_choice"),
        # strict: OpenAI's rules (every property required, additionalProperties false), as OpenAI refuses them
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "c", "schema": {**CALL_SCHEMA, "required": ["name"]}, "strict": True},
                }
            },
            "response_format.json_schema.schema",
        ),
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {**FUNCTION["function"], "strict": True, "parameters": {"type": "object"}},
                    }
                ]
            },
            "tools[0].function.parameters",
        ),
    ],
)
def test_constraints_that_cannot_be_honoured_are_400s_naming_them(
    client: OpenAI, kw: dict[str, Any], param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model="tiny-calc",
            messages=prompt_messages(QUESTION),
            max_tokens=4,
            **kw,  # type: ignore[arg-type]
        )
    assert err.value.param is not None and err.value.param.startswith(param)


def test_a_slow_grammar_set_up_does_not_hold_up_other_requests(
    http: TestClient, client: OpenAI, monkeypatch: pytest.MonkeyPatch
) -> None:
    entered, release, left = threading.Event(), threading.Event(), threading.Event()
    real = inference.constraints

    def slow(*args: Any, **kwargs: Any) -> Any:  # a grammar set-up that takes its time (a large vocabulary's)
        entered.set()
        release.wait(3)
        left.set()
        return real(*args, **kwargs)

    monkeypatch.setattr(inference, "constraints", slow)
    fmt = {"type": "json_schema", "json_schema": {"name": "sum", "schema": ANSWER_SCHEMA}}
    messages = [{"role": "user", "content": "What is 23 + 58?"}]
    with ThreadPoolExecutor(1) as pool:
        asked = pool.submit(
            client.chat.completions.create,
            model="tiny-arith",
            messages=messages,  # type: ignore[arg-type]
            max_tokens=5,
            temperature=0,
            response_format=fmt,  # type: ignore[arg-type]
        )
        assert entered.wait(10)
        try:
            assert http.get("/health").json() == {"status": "ok"}
            assert not left.is_set()  # answered while the set-up still ran: the event loop was free
        finally:
            release.set()
        assert asked.result(timeout=30).choices[0].finish_reason == "stop"

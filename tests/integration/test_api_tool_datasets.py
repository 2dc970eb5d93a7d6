"""Supervised and DPO files with tools through the real app and database: a file in OpenAI's chat format with
``tools``, ``tool_calls`` and tool messages is validated and queued. A line holding something the trainer would have
to drop:

- in a message (an image part, the deprecated ``function_call``, an unknown field, arguments that are not a JSON
  object) is a 400 of a ``fine-tune`` upload naming the line and the field (``trainer.spec.chat.check_line_messages``),
  whatever the method and wherever the purpose is in the form;
- anything else (two calls where ``parallel_tool_calls`` is false: the method's parser) fails the job's
  ``validating_files`` phase as ``invalid_file``, naming the line and the field (``worker.validation``)."""

from __future__ import annotations

import copy
import json
from typing import Any

import httpx
import pytest

from tests.integration.conftest import assert_error, job_body, jsonl, upload, validate
from tests.integration.test_api_files import form, post_form

TOOL = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
    },
}


def call(i: int) -> dict[str, Any]:
    arguments = json.dumps({"expression": f"{i}+{i}"})
    return {"id": f"call_{i}", "type": "function", "function": {"name": "calculator", "arguments": arguments}}


def episode(i: int) -> dict[str, Any]:
    return {
        "messages": [
            {"role": "system", "content": [{"type": "text", "text": "Use the calculator."}]},
            {"role": "user", "content": f"What is {i} + {i}?"},
            {"role": "assistant", "content": None, "tool_calls": [call(i)]},
            {"role": "tool", "tool_call_id": f"call_{i}", "content": str(2 * i)},
            {"role": "assistant", "content": str(2 * i)},
        ],
        "tools": [TOOL],
        "parallel_tool_calls": False,
    }


def pair(i: int) -> dict[str, Any]:
    return {
        "input": {"messages": [{"role": "user", "content": f"What is {i} + {i}?"}], "tools": [TOOL]},
        "preferred_output": [{"role": "assistant", "content": None, "tool_calls": [call(i)]}],
        "non_preferred_output": [{"role": "assistant", "content": str(2 * i + 1)}],
    }


def with_change(line: dict[str, Any], path: tuple[Any, ...], value: Any) -> dict[str, Any]:
    out = copy.deepcopy(line)
    node = out
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return out


def create(api: httpx.Client, rows: list[Any], method: str) -> tuple[str, str]:
    r = upload(api, jsonl(rows))
    assert r.status_code == 200, r.text
    file_id = r.json()["id"]
    r = api.post("/v1/fine_tuning/jobs", json=job_body(file_id, method={"type": method, method: {}}))
    assert r.status_code == 200 and r.json()["status"] == "validating_files", r.text
    return file_id, r.json()["id"]


@pytest.mark.parametrize(
    ("method", "rows"), [("supervised", [episode(i) for i in range(3)]), ("dpo", [pair(1), pair(2)])]
)
def test_a_tool_call_file_in_openais_format_is_validated_and_queued(
    api: httpx.Client, settings: Any, method: str, rows: list[Any]
) -> None:
    _, job_id = create(api, rows, method)
    assert validate(settings, job_id) == "queued"
    assert api.get(f"/v1/fine_tuning/jobs/{job_id}").json()["status"] == "queued"


IMAGE = [{"type": "text", "text": "What is this?"}, {"type": "image_url", "image_url": {"url": "https://x/y.png"}}]


IN_A_MESSAGE = [
    (
        "supervised",
        with_change(episode(2), ("messages", 1, "content"), IMAGE),
        "messages[1].content[1].type 'image_url' is not supported: only 'text' parts can be trained on",
    ),
    (
        "supervised",
        with_change(episode(2), ("messages", 2, "function_call"), {"name": "calculator", "arguments": "{}"}),
        "messages[2].function_call is deprecated and not supported: use 'tool_calls'",
    ),
    (
        "supervised",
        with_change(episode(2), ("messages", 3, "name"), "calculator"),
        "messages[3].name is not a field of a tool message (allowed: content, role, tool_call_id)",
    ),
    (
        "dpo",
        with_change(pair(2), ("preferred_output", 0, "tool_calls", 0, "function", "arguments"), '"2+2"'),
        "preferred_output[0].tool_calls[0].function.arguments must be a JSON object, not str",
    ),
]
TWO_CALLS = (
    "supervised",
    with_change(episode(2), ("messages", 2, "tool_calls"), [call(2), call(3)]),
    "messages[2].tool_calls holds 2 calls but parallel_tool_calls is false",
)


@pytest.mark.parametrize("purpose_last", [False, True])
@pytest.mark.parametrize(("method", "bad", "problem"), IN_A_MESSAGE)
def test_a_message_that_would_lose_a_field_is_a_400_of_the_upload_naming_the_line_and_field(
    api: httpx.Client, method: str, bad: dict[str, Any], problem: str, purpose_last: bool
) -> None:
    good = episode(1) if method == "supervised" else pair(1)
    stored = len(api.get("/v1/files", params={"limit": 10000}).json()["data"])
    content = jsonl([good, bad])
    if purpose_last:
        r = post_form(api, form(("file", "train.jsonl", content), ("purpose", None, b"fine-tune")))
    else:
        r = upload(api, content)
    assert_error(r, 400, param="file", code="invalid_file")
    assert r.json()["error"]["message"] == f"line 2: {problem}"
    assert len(api.get("/v1/files", params={"limit": 10000}).json()["data"]) == stored  # nothing stored


def test_an_evals_file_is_not_checked_as_a_dataset(api: httpx.Client) -> None:
    """An eval's rows are items of the eval's own schema, not training messages."""
    _, bad, _ = IN_A_MESSAGE[0]
    assert upload(api, jsonl([bad]), purpose="evals").status_code == 200


@pytest.mark.parametrize(("method", "bad", "problem"), [TWO_CALLS])
def test_a_line_that_would_lose_a_field_fails_validation_naming_the_line_and_field(
    api: httpx.Client, settings: Any, method: str, bad: dict[str, Any], problem: str
) -> None:
    good = episode(1) if method == "supervised" else pair(1)
    file_id, job_id = create(api, [good, bad], method)
    assert validate(settings, job_id) == "failed"
    job = api.get(f"/v1/fine_tuning/jobs/{job_id}").json()
    assert job["status"] == "failed", job
    assert job["error"] == {
        "code": "invalid_file",
        "message": f"training file {file_id}, line 2: {problem}",
        "param": "training_file",
    }

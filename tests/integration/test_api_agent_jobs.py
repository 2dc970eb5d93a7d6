"""Agent jobs through the API: OpenAI agent RFT's `tools` and `max_episode_steps`, or a sandboxed python
environment, in an online method's body; the stored spec shows them back; a tool server the deployment's URL policy
refuses, an environment whose source cannot work and malformed tools are 400s naming the field; a dataset line's
`tools` must name the job's tools (checked by the worker's validation, naming the line)."""

from __future__ import annotations

import json
from typing import Any
from unittest.mock import ANY

import httpx
import pytest

from tests.integration.conftest import assert_error, job_body, jsonl, upload, validate

TOOL = {
    "name": "calculator",
    "server_url": "https://1.1.1.1/tools/calc",  # an address literal (no DNS here), and a global one: allowed
    "headers": {"Authorization": "Bearer t"},
    "description": "adds",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}},
}
ENVIRONMENT = "def reset(item):\n    return None\n\ndef step(tool_call):\n    return '1', True\n"


def agent_body(training_file: str, **block: Any) -> dict[str, Any]:
    body = job_body(training_file)
    body["method"]["grpo"].update(block)
    return body


def test_a_job_with_tools_is_created_and_shows_them_back(api: httpx.Client, training_file: str) -> None:
    r = api.post("/v1/fine_tuning/jobs", json=agent_body(training_file, tools=[TOOL], max_episode_steps=4))
    assert r.status_code == 200, r.text
    block = r.json()["method"]["grpo"]
    assert block["tools"] == [TOOL] and block["max_episode_steps"] == 4
    again = api.get(f"/v1/fine_tuning/jobs/{r.json()['id']}").json()["method"]["grpo"]
    assert again["tools"] == [TOOL]


def test_openai_s_reinforcement_body_with_tools_is_taken_unchanged(api: httpx.Client, training_file: str) -> None:
    body = job_body(training_file)
    grader = body["method"]["grpo"]["grader"]
    tools = [{"name": "search", "server_url": "https://1.1.1.1/api/tools", "headers": {"X-Key": "k"}}]
    body["method"] = {
        "type": "reinforcement",
        "reinforcement": {"grader": grader, "tools": tools, "max_episode_steps": 10, "hyperparameters": {}},
    }
    r = api.post("/v1/fine_tuning/jobs", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["method"]["type"] == "reinforcement"  # the name it was created with, as OpenAI answers it
    assert r.json()["method"]["reinforcement"]["tools"] == tools


@pytest.mark.parametrize(
    ("block", "param", "code"),
    [
        (
            {"tools": [{**TOOL, "server_url": "https://127.0.0.1/"}]},
            "method.grpo.tools.0.server_url",
            "url_not_allowed",
        ),
        ({"tools": [{**TOOL, "server_url": "https://169.254.169.254/x"}]}, "method.grpo.tools.0.server_url", None),
        ({"tools": [{"name": "calculator"}]}, "method.grpo.tools.0.server_url", "invalid_spec"),
        ({"tools": [{**TOOL, "name": "two words"}]}, "method.grpo.tools.0.name", "invalid_spec"),
        ({"tools": [TOOL, TOOL]}, "method.grpo.tools", "invalid_spec"),
        ({"tools": [TOOL], "max_episode_steps": 0}, "method.grpo.max_episode_steps", "invalid_spec"),
        ({"max_episode_steps": 5}, "method.grpo.max_episode_steps", "invalid_spec"),
        ({"tools": [{**TOOL, "parameters": {"type": "string"}}]}, "method.grpo.tools.0.parameters", "invalid_spec"),
        (
            {"environment": {"type": "python", "source": "def reset(item):\n    return None\n"}},
            "method.grpo.environment.source",
            "invalid_environment",
        ),
        (
            {"environment": {"type": "python", "source": ENVIRONMENT}, "tools": [TOOL]},
            "method.grpo.tools.0.server_url",
            "invalid_spec",
        ),
    ],
)
def test_a_bad_agent_block_is_a_400_naming_the_field(
    api: httpx.Client, training_file: str, block: dict[str, Any], param: str, code: str | None
) -> None:

    assert_error(
        api.post("/v1/fine_tuning/jobs", json=agent_body(training_file, **block)), 400, param=param, code=code or ANY
    )


def test_an_environment_job_is_created(api: httpx.Client, training_file: str) -> None:
    env = {"type": "python", "source": ENVIRONMENT}
    r = api.post("/v1/fine_tuning/jobs", json=agent_body(training_file, environment=env, tools=[{"name": "calc"}]))
    assert r.status_code == 200, r.text
    assert r.json()["method"]["grpo"]["environment"] == {"type": "python", "name": "environment", "source": ENVIRONMENT}


def test_a_line_s_tools_must_be_the_job_s_and_the_validation_names_the_line(api: httpx.Client, settings: Any) -> None:
    lines = [
        {"messages": [{"role": "user", "content": "What is 1 + 2?"}], "answer": "3", "tools": [{"name": "calculator"}]},
        {
            "messages": [{"role": "user", "content": "What is 2 + 2?"}],
            "answer": "4",
            "tools": [{"type": "function", "function": {"name": "browser"}}],
        },
    ]
    file_id = upload(api, jsonl(lines)).json()["id"]
    r = api.post("/v1/fine_tuning/jobs", json=agent_body(file_id, tools=[TOOL]))
    assert r.status_code == 200, r.text
    job_id = r.json()["id"]
    assert validate(settings, job_id) == "failed"
    job = api.get(f"/v1/fine_tuning/jobs/{job_id}").json()
    assert job["error"]["code"] == "invalid_file" and job["error"]["param"] == "training_file"
    assert "line 2" in job["error"]["message"] and "'browser' is not one of the job's tools" in job["error"]["message"]
    assert json.dumps(job["error"]).count("calculator") >= 1


def test_the_official_client_creates_an_agent_job_unchanged(base_url: str, tenant_a: Any, training_file: str) -> None:
    """OpenAI's agent-RFT body through `client.fine_tuning.jobs.create`, as its users' code sends it."""
    import httpx2
    from openai import OpenAI

    grader = job_body(training_file)["method"]["grpo"]["grader"]
    tools = [{"name": "calculator", "server_url": "https://1.1.1.1/api/tools", "headers": {"X-Functions-Key": "k"}}]
    with (
        httpx2.Client(timeout=30) as http,
        OpenAI(base_url=f"{base_url}/v1", api_key=tenant_a.key, max_retries=0, http_client=http) as client,
    ):
        job = client.fine_tuning.jobs.create(
            model="tiny-arith",
            training_file=training_file,
            method={
                "type": "reinforcement",
                "reinforcement": {
                    "grader": grader,
                    "tools": tools,  # not in the SDK's typed dict yet: sent as given
                    "max_episode_steps": 10,
                    "hyperparameters": {"eval_interval": 3, "compute_multiplier": 1.0, "reasoning_effort": "medium"},
                },
            },
        )
        raw = client.fine_tuning.jobs.with_raw_response.retrieve(job.id)
        again = raw.parse()
    assert job.status in ("validating_files", "queued") and again.id == job.id
    block = raw.http_response.json()["method"]
    assert block["type"] == "reinforcement" and block["reinforcement"]["tools"] == tools
    assert block["reinforcement"]["max_episode_steps"] == 10
    assert again.method is not None and again.method.reinforcement is not None  # the SDK's typed block

"""An agent job through the service: `proxima serve` (API and a real worker) on PostgreSQL and Redis offers
tiny-calc; a tenant uploads the calculator task and creates OpenAI's reinforcement job with a tool at the built-in
calculator server (the deployment's policy allowing loopback); the worker trains with episodes; the metrics endpoint
has the episode and tool series, the rollouts endpoint each episode's transcript, and the dashboard's rollouts browser
shows an episode as a conversation with its tool call and the tool's result; the job page charts the episodes."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from openai import OpenAI
from playwright.sync_api import Page, expect

from trainer.agents import calculator_server
from trainer.builtin_models import tiny_calc
from trainer.spec import metrics as M

from .dashboard_support import DashboardServer, metrics, upload, wait_job

EXACT = {
    "type": "string_check",
    "name": "exact",
    "input": "{{sample.output_text}}",
    "reference": "{{item.answer}}",
    "operation": "eq",
}
STEPS = 4


@dataclass
class AgentDeployment:
    server: DashboardServer
    key: str
    api: httpx.Client
    job_id: str


@pytest.fixture(scope="module")
def deployment(
    tmp_path_factory: pytest.TempPathFactory, tiny_calc_dir: Path, calculator: str
) -> Iterator[AgentDeployment]:
    root = tmp_path_factory.mktemp("agent-service")
    policy = {"PROXIMA_GRADER_URL_SCHEMES": '["http", "https"]', "PROXIMA_GRADER_URL_ALLOW_NETWORKS": '["127.0.0.0/8"]'}
    server = DashboardServer(root, model_dir=tiny_calc_dir, model=tiny_calc.MODEL_NAME, env=policy)
    try:
        server.start()
        key = server.api_key("agents")
        api = server.client(key)
        train, val = tiny_calc.write_calculator_datasets(root / "data", n_train=200)
        body = {
            "model": tiny_calc.MODEL_NAME,
            "training_file": upload(api, train),
            "validation_file": upload(api, val),
            "seed": 3,
            "method": {
                "type": "reinforcement",
                "reinforcement": {
                    "grader": EXACT,
                    "tools": [calculator_server.calculator_tool(calculator)],
                    "max_episode_steps": 3,
                    "hyperparameters": {
                        "max_steps": STEPS,
                        "batch_size": 4,
                        "group_size": 4,
                        "max_completion_tokens": 40,
                        "eval_interval": STEPS,
                        "eval_prompts": 16,
                        "checkpoint_interval": STEPS,
                        "rollouts_logged": 16,
                        "learning_rate": 3e-4,
                    },
                },
            },
        }
        r = api.post("/fine_tuning/jobs", json=body)
        assert r.status_code == 200, r.text
        job = r.json()
        assert job["method"]["reinforcement"]["tools"][0]["server_url"] == calculator  # runs grpo's recipe
        yield AgentDeployment(server, key, api, job["id"])
        api.close()
    finally:
        server.close()


def test_the_worker_trains_with_episodes_and_the_api_shows_them(deployment: AgentDeployment) -> None:
    d = deployment
    job = wait_job(d.api, d.job_id, lambda j: j["status"] == "succeeded", what="success", server=d.server, timeout=300)
    assert job["fine_tuned_model"]
    points = metrics(d.api, d.job_id)
    steps = [p for p in points if M.EPISODE_TOOL_CALL_RATE in p["metrics"]]
    assert len(steps) == STEPS
    assert all(M.TOOL_CALLS_OF.name("calculator") in p["metrics"] for p in steps)
    assert sum(p["metrics"][M.EPISODE_TOOL_CALL_RATE] for p in steps) > 0  # the base calls on ~30% of samples
    page = d.api.get(f"/fine_tuning/jobs/{d.job_id}/rollouts").json()
    episodes = [r["episode"] for r in page["data"]]
    assert len(episodes) == 16
    called = [e for e in episodes if e["tool_calls"]]
    assert called, "no logged episode of the last step called the tool"
    call, result = called[0]["messages"][:2]
    assert call["tool_calls"][0]["function"]["name"] == "calculator"
    assert result["role"] == "tool" and result["tool_call_id"] == call["tool_calls"][0]["id"]
    assert json.loads(call["tool_calls"][0]["function"]["arguments"])["expression"]


def test_the_rollouts_browser_shows_an_episode_as_a_conversation(page: Page, deployment: AgentDeployment) -> None:
    d = deployment
    wait_job(d.api, d.job_id, lambda j: j["status"] == "succeeded", what="success", server=d.server, timeout=300)
    rows = d.api.get(f"/fine_tuning/jobs/{d.job_id}/rollouts").json()["data"]
    called = next(r for r in rows if r["episode"]["tool_calls"])
    args = called["episode"]["messages"][0]["tool_calls"][0]["function"]["arguments"]
    result = called["episode"]["messages"][1]["content"]

    page.goto(f"{d.server.base}/dashboard/")
    page.get_by_label("API key").fill(d.key)
    page.get_by_role("button", name="Sign in").click()
    expect(page.get_by_role("heading", name="Fine-tuning jobs")).to_be_visible()
    page.goto(f"{d.server.base}/dashboard/#/jobs/{d.job_id}/rollouts")
    episode = page.locator(".episode").filter(has_text=f"calculator({args})").first
    expect(episode).to_be_visible()
    expect(episode.locator(".msg-tool .msg-content")).to_have_text(result)
    expect(episode.locator(".msg-assistant").last).to_contain_text(called["completion"])
    expect(episode.locator(".episode-meta")).to_contain_text("2 turns · 1 tool calls")
    assert page.locator(".episode").count() == len(rows)

    page.goto(f"{d.server.base}/dashboard/#/jobs/{d.job_id}")
    expect(page.locator('figure[data-chart="episodes"]')).to_have_attribute("data-points", str(STEPS))
    calls = M.TOOL_CALLS_OF.name("calculator")
    expect(page.locator('figure[data-chart="tool-calls"]')).to_have_attribute("data-series", calls)


def test_the_agent_trained_model_answers_chat_completions_with_parsed_tool_calls(deployment: AgentDeployment) -> None:
    """The job's `ft:` model, offered the calculator through chat completions (the official client), calls it in the
    model's syntax and the answer carries OpenAI's parsed `tool_calls`; forced with `tool_choice`, every sample
    calls it; given the tool's result, it answers."""
    d = deployment
    job = wait_job(d.api, d.job_id, lambda j: j["status"] == "succeeded", what="success", server=d.server, timeout=300)
    client = OpenAI(base_url=f"{d.server.base}/v1", api_key=d.key, max_retries=0, timeout=120)
    tools: Any = [tiny_calc.TOOL]
    question = [{"role": "user", "content": "What is 23 + 58 + 71?"}]
    deadline = time.monotonic() + 120
    while True:
        try:
            forced = client.chat.completions.create(
                model=job["fine_tuned_model"],
                messages=question,  # type: ignore[arg-type]
                tools=tools,
                tool_choice="required",
                n=8,
                max_tokens=40,
                temperature=1,
                seed=1,
            )
            break
        except openai.InternalServerError:  # 503 while the inference server is still loading
            assert time.monotonic() < deadline
            time.sleep(1)
    for choice in forced.choices:
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        [call] = choice.message.tool_calls or []
        assert call.type == "function" and call.function.name == "calculator" and call.id.startswith("call_")
        assert isinstance(json.loads(call.function.arguments)["expression"], str)
    call = (forced.choices[0].message.tool_calls or [])[0]
    value = calculator_server.evaluate_expression(json.loads(call.function.arguments)["expression"])
    followed = client.chat.completions.create(
        model=job["fine_tuned_model"],
        messages=[  # type: ignore[list-item]
            *question,
            {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
            {
                "role": "tool",
                "tool_call_id": call.id,
                "content": str(value),
            },
        ],
        tools=tools,
        max_tokens=8,
        temperature=0,
    )
    assert followed.choices[0].finish_reason == "stop" and followed.choices[0].message.content

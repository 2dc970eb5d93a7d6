"""The dashboard's playground in Debian's headless Chromium (Playwright), on ``proxima serve`` with tiny-arith (API,
worker and the inference server serve starts) and a real GRPO job with checkpoints.

On the job's page the playground samples one validation prompt from the base and from a checkpoint side by side, N
samples each with the same seed: the page shows exactly the completions the official client gets for the same
request, each scored by the job's grader (1 for the right sum, else 0) and their mean; a prompt of one's own is
sampled but not scored; another tenant finds no such job.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from openai import OpenAI
from playwright.sync_api import Page, expect

from .dashboard_support import DashboardServer

REPO = Path(__file__).resolve().parents[2]
ARTIFACTS = Path(os.environ.get("PROXIMA_TEST_ARTIFACTS") or REPO / "test-artifacts") / "dashboard"
MODEL = "tiny-arith"
GRADER = {
    "type": "string_check",
    "name": "exact",
    "input": "{{sample.output_text}}",
    "reference": "{{item.answer}}",
    "operation": "eq",
}
MAX_TOKENS = 4
N = 6
SEED = 42


@dataclass
class Deployment:
    server: DashboardServer
    key_a: str
    key_b: str
    job: Any
    validation: list[dict[str, Any]]

    @property
    def dashboard(self) -> str:
        return f"{self.server.base}/dashboard/"


@pytest.fixture(scope="module")
def deployment(
    tmp_path_factory: pytest.TempPathFactory, tiny_arith_dir: Path, arithmetic_data: Path
) -> Iterator[Deployment]:
    root = tmp_path_factory.mktemp("playground")
    server = DashboardServer(root, model_dir=tiny_arith_dir)
    (root / "home" / "models" / MODEL).symlink_to(tiny_arith_dir)
    server.env["PROXIMA_BASE_MODELS"] = json.dumps([MODEL])
    server.env["PROXIMA_INFERENCE_PRECISION"] = "fp32"
    try:
        server.start(timeout=180)
        key_a, key_b = server.api_key("team-a"), server.api_key("team-b")
        client = OpenAI(base_url=f"{server.base}/v1", api_key=key_a, max_retries=0, timeout=120)
        lines = (arithmetic_data / "validation.jsonl").read_text().splitlines(True)[:20]
        (root / "validation.jsonl").write_text("".join(lines))
        with (arithmetic_data / "train.jsonl").open("rb") as fh:
            training = client.files.create(file=fh, purpose="fine-tune")
        with (root / "validation.jsonl").open("rb") as fh:
            validation = client.files.create(file=fh, purpose="fine-tune")
        hyperparameters = {
            "max_steps": 2,
            "batch_size": 4,
            "group_size": 4,
            "max_completion_tokens": MAX_TOKENS,
            "learning_rate": 1e-2,
            "checkpoint_interval": 1,
            "eval_interval": 1,
            "precision": "fp32",
        }
        method: Any = {"type": "grpo", "grpo": {"grader": GRADER, "hyperparameters": hyperparameters}}
        job = client.fine_tuning.jobs.create(
            model=MODEL, training_file=training.id, validation_file=validation.id, method=method, seed=3
        )
        deadline = time.monotonic() + 300
        while job.status not in ("succeeded", "failed", "cancelled"):
            assert time.monotonic() < deadline, server.logs()
            time.sleep(1)
            job = client.fine_tuning.jobs.retrieve(job.id)
        assert job.status == "succeeded", (job.error, server.logs())
        yield Deployment(server, key_a, key_b, job, [json.loads(line) for line in lines])
    finally:
        server.close()


def sign_in(page: Page, d: Deployment, key: str) -> None:
    page.goto(d.dashboard)
    page.get_by_label("API key").fill(key)
    page.get_by_role("button", name="Sign in").click()
    expect(page.get_by_role("heading", name="Fine-tuning jobs")).to_be_visible()


def expected(d: Deployment, model: str, messages: list[dict[str, Any]]) -> list[str]:
    """The completions the official client gets for the playground's request."""
    client = OpenAI(base_url=f"{d.server.base}/v1", api_key=d.key_a, max_retries=0, timeout=120)
    completion = client.chat.completions.create(
        model=model,
        messages=messages,  # type: ignore[arg-type]
        n=N,
        temperature=1.0,
        max_tokens=MAX_TOKENS,
        seed=SEED,
    )
    return [c.message.content or "" for c in completion.choices]


def carries(question: str) -> bool:
    a, b = (int(x) for x in question.removeprefix("What is ").removesuffix("?").split(" + "))
    return a % 10 + b % 10 >= 10


def side_texts(page: Page, side: str) -> list[str]:
    samples = page.locator(f'[data-side="{side}"] li.sample')
    expect(samples).to_have_count(N)
    return [samples.nth(i).locator(".sample-text").inner_text() for i in range(N)]


def test_playground_samples_base_and_checkpoint_side_by_side_with_grader_scores(
    page: Page, deployment: Deployment
) -> None:
    d = deployment
    page.set_default_timeout(60_000)  # 12 samples through the inference server on a 2-core machine
    sign_in(page, d, d.key_a)
    page.goto(f"{d.dashboard}#/jobs/{d.job.id}")
    page.get_by_role("link", name="Playground").click()
    expect(page.get_by_role("heading", name="Playground")).to_be_visible()
    assert page.url.endswith(f"#/jobs/{d.job.id}/playground")

    checkpoint = f"{d.job.fine_tuned_model}:ckpt-step-1"
    models = page.get_by_label("Compare the base with")
    expect(models.locator("option")).to_have_count(3)  # the final model and the checkpoints of steps 2 and 1
    expect(models.locator("option").first).to_have_attribute("value", d.job.fine_tuned_model)
    models.select_option(checkpoint)

    picker = page.get_by_label("Validation prompt")
    expect(picker.locator("option")).to_have_count(1 + len(d.validation))
    # A sum with a carry in the units, which tiny-arith's base tends to drop: its samples are right and wrong.
    index = next(i for i, it in enumerate(d.validation) if carries(it["messages"][-1]["content"]))
    item = d.validation[index]
    picker.select_option(str(index))
    expect(page.get_by_label("Prompt", exact=True)).to_have_value(item["messages"][-1]["content"])
    expect(page.locator("#playground-grading")).to_contain_text("scored with the job's grader (exact)")
    page.get_by_label("Samples each").fill(str(N))
    page.get_by_label("Temperature").fill("1")
    page.get_by_label("Seed").fill(str(SEED))
    expect(page.get_by_label("Max tokens")).to_have_value(str(MAX_TOKENS))  # the job's max_completion_tokens
    page.get_by_role("button", name="Sample").click()

    seen = set()
    for side, model in (("base", MODEL), ("tuned", checkpoint)):
        column = page.locator(f'[data-side="{side}"]')
        expect(column).to_have_attribute("data-model", model)
        texts = side_texts(page, side)
        seen |= {text == item["answer"] for text in texts}
        assert texts == expected(d, model, item["messages"]), side
        scores = column.locator(".sample-score")
        for i, text in enumerate(texts):
            expect(scores.nth(i)).to_have_attribute("data-score", "1" if text == item["answer"] else "0")
        mean = sum(text == item["answer"] for text in texts) / N
        expect(column.locator(".mean-score")).to_have_attribute("data-score", str(mean) if mean % 1 else str(int(mean)))
    assert seen == {True, False}, "both scores are shown: some samples right, some wrong"
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=ARTIFACTS / "playground.png", full_page=True)

    # A prompt of one's own: sampled (same seed, same answers as the client's), not scored.
    page.get_by_label("Prompt", exact=True).fill("What is 12 + 30?")
    expect(page.locator("#playground-grading")).to_contain_text("Pick a validation prompt")
    page.get_by_role("button", name="Sample").click()
    own = [{"role": "user", "content": "What is 12 + 30?"}]
    assert side_texts(page, "base") == expected(d, MODEL, own)
    expect(page.locator('[data-side="base"] .sample-score').first).to_have_text("")


def test_another_tenant_finds_no_playground(page: Page, deployment: Deployment) -> None:
    d = deployment
    sign_in(page, d, d.key_b)
    page.goto(f"{d.dashboard}#/jobs/{d.job.id}/playground")
    expect(page.get_by_role("heading", name="Job not found")).to_be_visible()

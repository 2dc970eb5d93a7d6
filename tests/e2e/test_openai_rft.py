"""OpenAI reinforcement fine-tuning job specs run unchanged through the official `openai` client: a
`python` grader, a `score_model` grader (the deployment's judge: a real chat-completions server on this machine,
tests/remote_grader_servers.py) and a `multi` of both, each a `reinforcement` job on `proxima serve` with its worker,
to `succeeded`, with each sub-grader's reward curve."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from openai import OpenAI

from tests.e2e.dashboard_support import MODEL, DashboardServer
from tests.remote_grader_servers import Servers, serve_remote_graders
from trainer.grading.sandbox import sandbox_available
from trainer.spec import metrics as M

# As OpenAI's RFT guide writes them (its grader and hyperparameter fields), on tiny-arith's prompts.
PYTHON = {
    "type": "python",
    "name": "python_grader",
    "image_tag": "2025-05-08",
    "source": (
        "def grade(sample, item) -> float:\n"
        "    output = sample['output_text'].strip()\n"
        "    return 1.0 if output == item['answer'] else 0.1 * len(output) / (1 + len(output))\n"
    ),
}
SCORE_MODEL = {
    "type": "score_model",
    "name": "score_grader",
    "model": "judge-mini",
    "input": [
        {"role": "system", "content": "Grade the answer to the addition from 0 to 1."},
        {"role": "user", "content": "Question: {{item.messages.0.content}}\nAnswer: {{sample.output_text}}"},
    ],
    "range": [0, 1],
    "sampling_params": {"temperature": 0, "seed": 42},
}
MULTI = {
    "type": "multi",
    "name": "combined",
    "graders": {"code": PYTHON, "judge": SCORE_MODEL},
    "calculate_output": "0.5 * code + 0.5 * judge",
}
HYPERPARAMETERS = {
    # OpenAI's reinforcement hyperparameters ...
    "batch_size": 2,
    "n_epochs": 1,
    "compute_multiplier": "auto",
    "eval_interval": "auto",
    "eval_samples": "auto",
    "reasoning_effort": "low",
    # ... and two of Proxima's, to keep the random model's completions short
    "group_size": 2,
    "max_completion_tokens": 6,
}


@pytest.fixture(scope="module")
def judge() -> Iterator[Servers]:
    with serve_remote_graders() as servers:
        yield servers


@pytest.fixture(scope="module")
def server(
    tmp_path_factory: pytest.TempPathFactory, random_model_dir: Path, judge: Servers
) -> Iterator[DashboardServer]:
    reason = sandbox_available()
    if reason is not None:
        pytest.fail(f"the python grader's sandbox is unavailable here: {reason}")
    server = DashboardServer(tmp_path_factory.mktemp("rft"), model_dir=random_model_dir)
    server.env |= {
        "PROXIMA_JUDGE_BASE_URL": judge.judge(),
        "PROXIMA_JUDGE_API_KEY": "sk-rft-judge",
        "PROXIMA_JUDGE_MODELS": json.dumps({"judge-mini": "upstream-mini"}),
    }
    try:
        server.start()
        yield server
    finally:
        server.close()


def test_openai_rft_jobs_with_python_score_model_and_multi_graders_succeed(
    server: DashboardServer, judge: Servers, arithmetic_data: Path, tmp_path: Path
) -> None:
    key = server.api_key("rft")
    client = OpenAI(base_url=f"{server.base}/v1", api_key=key, max_retries=0)
    rows = (arithmetic_data / "train.jsonl").read_text().splitlines()[:4]  # 2 steps of 2 prompts
    (tmp_path / "train.jsonl").write_text("\n".join(rows) + "\n")
    with (tmp_path / "train.jsonl").open("rb") as fh:
        training = client.files.create(file=fh, purpose="fine-tune")

    jobs = {}
    for name, grader in (("python", PYTHON), ("score_model", SCORE_MODEL), ("multi", MULTI)):
        method: Any = {"type": "reinforcement", "reinforcement": {"grader": grader, "hyperparameters": HYPERPARAMETERS}}
        job = client.fine_tuning.jobs.create(model=MODEL, training_file=training.id, method=method, seed=7)
        assert job.status in ("validating_files", "queued") and job.method is not None
        jobs[name] = job.id

    deadline = time.monotonic() + 600
    while True:
        states = {name: client.fine_tuning.jobs.retrieve(job_id) for name, job_id in jobs.items()}
        if all(j.status in ("succeeded", "failed", "cancelled") for j in states.values()):
            break
        assert time.monotonic() < deadline, f"{ {n: j.status for n, j in states.items()} }\n{server.logs()}"
        time.sleep(1)
    for name, job in states.items():
        assert job.status == "succeeded", (name, job.error, server.logs())
        assert job.fine_tuned_model is not None and job.trained_tokens

    with server.client(key) as api:
        curves = {name: api.get(f"/fine_tuning/jobs/{job_id}/metrics").json()["data"] for name, job_id in jobs.items()}
    expected = {"python": ["python_grader"], "score_model": ["score_grader"], "multi": ["code", "judge"]}
    for name, points in curves.items():
        trained = [p for p in points if p["step"] >= 1]
        assert [p["step"] for p in trained] == [1, 2], (name, points)
        for point in trained:
            values = point["metrics"]
            for sub in expected[name]:
                assert 0.0 <= values[M.reward_of(sub)] <= 1.0, (name, sub, values)
            assert values[M.GRADER_ERROR_RATE] == 0.0, (name, values)
        if name == "multi":
            for point in trained:
                values = point["metrics"]
                mixed = 0.5 * values[M.reward_of("code")] + 0.5 * values[M.reward_of("judge")]
                assert values[M.REWARD_MEAN] == pytest.approx(mixed, abs=1e-5)
    assert {r.body["model"] for r in judge.state.to("/judge/sum")} == {"upstream-mini"}

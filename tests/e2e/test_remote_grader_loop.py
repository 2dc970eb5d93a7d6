"""A GRPO job graded by a `multi` of OpenAI's `python` and `score_model` graders runs to `succeeded` on a real worker:
the worker hands the deployment's judge (URL, key, model names) to its trainer process without a command line, the
trainer calls a real chat-completions server on this machine (tests/remote_grader_servers.py, no
mocked HTTP), and each sub-grader's reward is a metric of every step."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from api.status import JobStatus
from tests.e2e.conftest import Service, grpo_spec
from tests.remote_grader_servers import serve_remote_graders
from trainer.grading.sandbox import sandbox_available
from trainer.spec import graders
from trainer.spec import metrics as M
from worker.runner import REMOTE_GRADERS_ENV

KEY = "sk-e2e-judge-7f3a9c"
STEPS = 2
SOURCE = "def grade(sample, item):\n    return len(sample['output_text']) / 10\n"
GRADER = {
    "type": "multi",
    "name": "both",
    "graders": {
        "py": {"type": "python", "name": "py", "source": SOURCE},
        "judge": {
            "type": "score_model",
            "name": "judge",
            "model": "judge-mini",
            "input": [
                {"role": "system", "content": "Grade the answer to the addition."},
                {"role": "user", "content": "Question: {{item.messages.0.content}}\nAnswer: {{sample.output_text}}"},
            ],
            "sampling_params": {"temperature": 0.0},
        },
    },
    "calculate_output": "py + judge",
}


def processes() -> list[tuple[int, str]]:
    """(pid, command line) of every process of this machine that can be read."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                out.append(
                    (int(entry.name), (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"))
                )
            except OSError:
                continue
    return out


def test_a_grpo_job_graded_by_python_and_a_judge_succeeds_with_each_graders_rewards(
    make_service: Callable[..., Service], random_model_dir: Path, arithmetic_data: Path
) -> None:
    reason = sandbox_available()
    if reason is not None:
        pytest.fail(f"the python grader's sandbox is unavailable here: {reason}")
    with serve_remote_graders() as servers:
        svc = make_service()
        svc.env |= {
            "PROXIMA_JUDGE_BASE_URL": servers.judge(),
            "PROXIMA_JUDGE_API_KEY": KEY,
            "PROXIMA_JUDGE_MODELS": json.dumps({"judge-mini": "upstream-mini"}),
        }
        spec = grpo_spec(str(random_model_dir), steps=STEPS, batch_size=2, eval_interval=STEPS)
        spec["method"]["grpo"]["grader"] = graders.parse_grader(GRADER).model_dump(mode="json", exclude_none=True)
        job_id = svc.create_job(spec, arithmetic_data)
        svc.start_worker("a")
        svc.send(job_id)

        seen_key_on_a_command_line: list[str] = []
        grading_env_leaks: list[int] = []

        def finished() -> Any:
            # While the job runs: the key is on no command line, and no grading process inherited the configuration.
            for pid, cmdline in processes():
                if KEY in cmdline:
                    seen_key_on_a_command_line.append(cmdline[:200])
                if "trainer.grading.pool" in cmdline:
                    try:
                        if REMOTE_GRADERS_ENV.encode() in Path(f"/proc/{pid}/environ").read_bytes():
                            grading_env_leaks.append(pid)
                    except OSError:
                        pass
            job = svc.job(job_id)
            return job if job.status in (JobStatus.SUCCEEDED, JobStatus.FAILED) else None

        job = svc.wait_for(f"{job_id} to finish", finished, timeout=300)
        assert job.status == JobStatus.SUCCEEDED, f"{job.error}\n{svc.worker_logs()}"
        assert seen_key_on_a_command_line == [] and grading_env_leaks == []

        requests = servers.state.to("/judge/sum")
        assert requests, "the judge was never called"
        assert {r.headers["authorization"] for r in requests} == {f"Bearer {KEY}"}
        assert {r.body["model"] for r in requests} == {"upstream-mini"}
        assert all(r.body["temperature"] == 0.0 for r in requests)
        assert all(r.body["messages"][1]["content"].startswith("Question: What is ") for r in requests)

        metrics = svc.metrics(job_id)
        assert sorted(metrics) == [0, *range(1, STEPS + 1)]  # step 0: validation before training
        for step in range(1, STEPS + 1):
            values = metrics[step]
            py, judge = values[M.reward_of("py")], values[M.reward_of("judge")]
            assert 0.0 <= judge <= 1.0 and py >= 0.0, values
            assert values[M.REWARD_MEAN] == pytest.approx(py + judge, abs=1e-5), (step, values)
            assert values[M.GRADER_ERROR_RATE] == 0.0
        for step in (0, STEPS):
            assert M.reward_of("judge", validation=True) in metrics[step], metrics[step]

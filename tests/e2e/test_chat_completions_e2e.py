"""Chat completions of a job's model, end to end: through the official ``openai`` client a GRPO job trains on
tiny-arith on ``proxima serve`` (API, worker and the inference server it starts: PROXIMA_INFERENCE_URL unset), and
the trained model answers at once through ``chat.completions.create``, streamed and not.

On the job's 100 validation prompts at temperature 0, graded with the job's grader, the fine-tuned model scores
exactly the job's last validation reward (``val/reward/mean`` of the last step) and the base model exactly the
step-0 one, measured by the trainer before any update: the inference server applies the adapter the worker trained,
and nothing else. A checkpoint model answers too, and another tenant gets 404 for both.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from openai import OpenAI

from trainer.spec import metrics as M

from .dashboard_support import DashboardServer, free_port

MODEL = "tiny-arith"
GRADER = {
    "type": "string_check",
    "name": "exact",
    "input": "{{sample.output_text}}",
    "reference": "{{item.answer}}",
    "operation": "eq",
}
N_VALIDATION = 100
MAX_TOKENS = 4
STEPS = 4
HYPERPARAMETERS = {
    "max_steps": STEPS,
    "batch_size": 8,
    "group_size": 4,
    "max_completion_tokens": MAX_TOKENS,
    "learning_rate": 1e-2,
    "beta": 0.0,
    "checkpoint_interval": 2,
    "eval_interval": STEPS,  # validation at step 0 and at the end only
    "precision": "fp32",
}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, tiny_arith_dir: Path) -> Iterator[DashboardServer]:
    """``proxima serve`` offering tiny-arith; no PROXIMA_INFERENCE_URL, so serve starts ``proxima inference``."""
    server = DashboardServer(tmp_path_factory.mktemp("chat-e2e"), model_dir=tiny_arith_dir)
    (server.root / "home" / "models" / MODEL).symlink_to(tiny_arith_dir)
    server.env["PROXIMA_BASE_MODELS"] = json.dumps([MODEL])
    server.env["PROXIMA_INFERENCE_PRECISION"] = "fp32"  # as the job trains and validates (its precision: fp32)
    try:
        server.start(timeout=180)
        yield server
    finally:
        server.close()


def answer(client: OpenAI, model: str, content: str | list[dict[str, str]]) -> tuple[str, str]:
    """(text, finish_reason) of the greedy answer to a question or a conversation."""
    messages = [{"role": "user", "content": content}] if isinstance(content, str) else content
    choice = client.chat.completions.create(
        model=model,
        messages=messages,  # type: ignore[arg-type]
        temperature=0,
        max_tokens=MAX_TOKENS,
    ).choices[0]
    return choice.message.content or "", choice.finish_reason


def accuracy(client: OpenAI, model: str, validation: Path) -> float:
    """The job's grader's mean reward over the validation prompts, answered at temperature 0 through the API."""
    from trainer.loops.evaluate import grade_batch
    from trainer.spec import graders
    from trainer.spec.data import load_prompts

    grader = graders.parse_grader(GRADER)
    items = load_prompts(validation, grader=grader)
    with ThreadPoolExecutor(8) as pool:  # concurrent clients: the inference server batches them
        answers = list(pool.map(lambda it: answer(client, model, it.messages), items))
    scores = grade_batch(grader, [a for a, _ in answers], items, [r for _, r in answers])  # type: ignore[misc]
    return float(scores.rewards.mean())


def test_a_trained_model_answers_chat_completions_with_its_validation_accuracy(
    server: DashboardServer, arithmetic_data: Path, tmp_path: Path
) -> None:
    key = server.api_key("team-a")
    client = OpenAI(base_url=f"{server.base}/v1", api_key=key, max_retries=0, timeout=120)
    other = OpenAI(base_url=f"{server.base}/v1", api_key=server.api_key("team-b"), max_retries=0, timeout=120)
    validation = tmp_path / "validation.jsonl"
    validation.write_text("".join((arithmetic_data / "validation.jsonl").read_text().splitlines(True)[:N_VALIDATION]))
    with (arithmetic_data / "train.jsonl").open("rb") as fh:
        training_file = client.files.create(file=fh, purpose="fine-tune")
    with validation.open("rb") as fh:
        validation_file = client.files.create(file=fh, purpose="fine-tune")

    # Before any job, the base model answers (the inference server that serve started is up).
    deadline = time.monotonic() + 120
    while True:
        try:
            text, _ = answer(client, MODEL, "What is 4 + 5?")
            break
        except openai.InternalServerError:  # 503 while the inference server is still loading
            assert time.monotonic() < deadline, server.logs()
            time.sleep(1)
    assert text.isdigit()

    method: Any = {"type": "grpo", "grpo": {"grader": GRADER, "hyperparameters": HYPERPARAMETERS}}
    job = client.fine_tuning.jobs.create(
        model=MODEL,
        training_file=training_file.id,
        validation_file=validation_file.id,
        method=method,
        seed=5,
        suffix="chat",
    )
    deadline = time.monotonic() + 300
    while job.status not in ("succeeded", "failed", "cancelled"):
        assert time.monotonic() < deadline, f"{job.status}\n{server.logs()}"
        time.sleep(1)
        job = client.fine_tuning.jobs.retrieve(job.id)
    assert job.status == "succeeded", (job.error, server.logs())
    tuned = job.fine_tuned_model
    assert tuned is not None

    # The fine-tuned model answers, streamed and not, under its own name.
    completion = client.chat.completions.create(
        model=tuned, messages=[{"role": "user", "content": "What is 23 + 58?"}], temperature=0, max_tokens=MAX_TOKENS
    )
    assert completion.model == tuned and completion.choices[0].message.content is not None
    chunks = list(
        client.chat.completions.create(
            model=tuned,
            messages=[{"role": "user", "content": "What is 23 + 58?"}],
            temperature=0,
            max_tokens=MAX_TOKENS,
            stream=True,
        )
    )
    assert {c.model for c in chunks} == {tuned}
    assert (
        "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == completion.choices[0].message.content
    )

    # Its accuracy is the job's last validation reward; the base's is the step-0 one.
    with server.client(key) as api:
        points = {p["step"]: p["metrics"] for p in api.get(f"/fine_tuning/jobs/{job.id}/metrics").json()["data"]}
    assert min(points) == 0 and max(points) == STEPS, sorted(points)
    base_reward, tuned_reward = points[0][M.VAL_REWARD_MEAN], points[STEPS][M.VAL_REWARD_MEAN]
    assert tuned_reward != base_reward, "training must change the validation reward for this test to tell them apart"
    assert accuracy(client, tuned, validation) == pytest.approx(tuned_reward, abs=1e-9)
    assert accuracy(client, MODEL, validation) == pytest.approx(base_reward, abs=1e-9)

    # A checkpoint answers under its name; the last one is the final adapter, so it answers as the model does.
    checkpoints = {
        c.step_number: c.fine_tuned_model_checkpoint for c in client.fine_tuning.jobs.checkpoints.list(job.id)
    }
    assert sorted(checkpoints) == [2, 4]
    for step, name in checkpoints.items():
        assert name == f"{tuned}:ckpt-step-{step}"
        ckpt = client.chat.completions.create(
            model=name, messages=[{"role": "user", "content": "What is 23 + 58?"}], temperature=0, max_tokens=MAX_TOKENS
        )
        assert ckpt.model == name
    assert answer(client, checkpoints[STEPS], "What is 57 + 68?") == answer(client, tuned, "What is 57 + 68?")

    # Another tenant: 404 for the model and its checkpoints.
    for name in (tuned, *checkpoints.values()):
        with pytest.raises(openai.NotFoundError) as err:
            answer(other, name, "What is 23 + 58?")
        assert err.value.code == "model_not_found"


def _group_commands(pgid: int) -> list[str]:
    """The command lines of the processes in a process group (serve's: it is started as a session leader)."""
    commands = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[2]) == pgid:
                commands.append((stat.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode())
        except (OSError, IndexError, ValueError):
            continue  # gone meanwhile
    return commands


@pytest.mark.parametrize("how", ["--no-inference", "PROXIMA_INFERENCE_URL"])
def test_serve_starts_no_inference_server_when_told_or_pointed_at_one(
    tmp_path_factory: pytest.TempPathFactory, random_model_dir: Path, how: str
) -> None:
    server = DashboardServer(tmp_path_factory.mktemp("no-inference"), model_dir=random_model_dir)
    args = ["--no-worker"]
    if how == "--no-inference":
        args.append("--no-inference")
        expected = "no inference server is configured"
    else:
        server.env["PROXIMA_INFERENCE_URL"] = f"http://127.0.0.1:{free_port()}"  # nothing listens there
        expected = "the inference server is unavailable"
    try:
        with server.log_path.open("wb") as log:
            server.proc = subprocess.Popen(
                [sys.executable, "-m", "proxima.cli", "serve", *args],
                env=server.env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        deadline = time.monotonic() + 120
        while not _ready(server.base):
            assert server.proc.poll() is None and time.monotonic() < deadline, server.logs()
            time.sleep(0.3)
        commands = _group_commands(server.proc.pid)
        assert any(" serve" in c for c in commands) and not any(" inference" in c for c in commands), commands
        client = OpenAI(base_url=f"{server.base}/v1", api_key=server.api_key("team-a"), max_retries=0)
        with pytest.raises(openai.InternalServerError) as err:
            answer(client, "tiny-random", "What is 1 + 2?")
        assert err.value.status_code == 503 and expected in str(err.value.message), err.value.message
    finally:
        server.close()


def _ready(base: str) -> bool:
    try:
        return httpx.get(f"{base}/readyz", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False

"""OpenAI's Evals API end to end: ``proxima serve`` (the API, a real worker and the inference server it starts) on
PostgreSQL + Redis, driven by the official client.

- a ``jsonl`` run of an uploaded file, graded by a string_check and a python criterion that imports numpy (the sandbox
  with the deployment's packages) in the worker: its counts and output items are the hand-computed ones;
- a ``completions`` run of base tiny-arith: each item's question rendered from the template, sampled greedily through
  the inference server and graded; its counts, items and token usage are exactly what the same questions answered
  through ``chat.completions.create`` give;
- the same run of an ``ft:`` model a GRPO job trained on the same server: its pass rate is above the base's;
- each run's end is an ``eval.run.succeeded`` webhook, verified by the official client's ``webhooks.unwrap``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from openai import OpenAI

from .dashboard_support import DashboardServer
from .test_webhooks_e2e import WEBHOOK_ENV, free_port, receiving

MODEL = "tiny-arith"
ITEM_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"question": {"type": "string"}, "answer": {"type": "string"}},
    "required": ["answer"],
}
EXACT = {
    "type": "string_check",
    "name": "exact",
    "input": "{{sample.output_text}}",
    "reference": "{{item.answer}}",
    "operation": "eq",
}
DIGITS = {  # numpy: from the deployment's packages folder (make sandbox-packages), as OpenAI's grader image has it
    "type": "python",
    "name": "digits",
    "source": "import numpy as np\n\n\ndef grade(sample, item):\n"
    "    return float(np.char.isdigit(np.array(list(sample['output_text']))).sum()) / 4\n",
    "pass_threshold": 0.5,
}
# (answer, the row's own output): exact passes when equal; digits scores a quarter per digit, passing from 2 digits.
ROWS = [
    {"item": {"answer": "12"}, "sample": {"output_text": "12"}},  # exact pass, 0.5 pass -> pass
    {"item": {"answer": "7"}, "sample": {"output_text": "7"}},  # pass, 0.25 fail -> fail
    {"item": {"answer": "30"}, "sample": {"output_text": "31"}},  # fail, 0.5 pass -> fail
    {"item": {"answer": "100"}, "sample": {"output_text": "100"}},  # pass, 0.75 pass -> pass
]
QUESTIONS = 60  # the first validation prompts of tiny-arith's task
SAMPLING = {"temperature": 0, "max_completion_tokens": 4, "seed": 7}
# GRPO as the learning tests run it: held-out accuracy 0.375 → 0.81–0.85 in 15 steps, 0.89–0.94 in 40 (BENCHMARKS.md)
TRAINING = {"max_steps": 30, "batch_size": 8, "group_size": 8, "learning_rate": 3e-4, "max_completion_tokens": 6}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, tiny_arith_dir: Path) -> Iterator[DashboardServer]:
    """``proxima serve`` offering tiny-arith, with its inference server, a worker and fast webhook retries."""
    server = DashboardServer(tmp_path_factory.mktemp("evals-e2e"), model_dir=tiny_arith_dir)
    (server.root / "home" / "models" / MODEL).symlink_to(tiny_arith_dir)
    server.env["PROXIMA_BASE_MODELS"] = json.dumps([MODEL])
    server.env["PROXIMA_INFERENCE_PRECISION"] = "fp32"
    server.env.update(WEBHOOK_ENV)
    try:
        server.start(timeout=180)
        yield server
    finally:
        server.close()


def wait_run(client: OpenAI, eval_id: str, run_id: str, timeout: float = 60) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        run = client.evals.runs.retrieve(run_id, eval_id=eval_id)
        if run.status in ("completed", "failed", "canceled"):
            return run
        assert time.monotonic() < deadline, f"run still {run.status}"
        time.sleep(0.2)


def greedy(client: OpenAI, question: str) -> tuple[str, Any]:
    """(text, usage) of the answer ``chat.completions.create`` gives with the run's sampling parameters."""
    deadline = time.monotonic() + 120
    while True:
        try:
            answer = client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": question}], temperature=0, max_tokens=4, seed=7
            )
            return answer.choices[0].message.content or "", answer.usage
        except openai.InternalServerError:  # 503 while the inference server is still loading
            assert time.monotonic() < deadline
            time.sleep(1)


def train(client: OpenAI, arithmetic_data: Path) -> str:
    """A GRPO job on tiny-arith's task; its fine-tuned model's name."""
    with (arithmetic_data / "train.jsonl").open("rb") as fh:
        training_file = client.files.create(file=fh, purpose="fine-tune")
    method: Any = {"type": "grpo", "grpo": {"grader": EXACT, "hyperparameters": TRAINING}}
    job = client.fine_tuning.jobs.create(model=MODEL, training_file=training_file.id, method=method, seed=3)
    deadline = time.monotonic() + 300
    while job.status not in ("succeeded", "failed", "cancelled"):
        assert time.monotonic() < deadline, job.status
        time.sleep(0.5)
        job = client.fine_tuning.jobs.retrieve(job.id)
    assert job.status == "succeeded" and job.fine_tuned_model is not None, job.error
    return job.fine_tuned_model


def test_jsonl_and_completions_runs_are_graded_by_a_real_worker_and_announced(
    server: DashboardServer, arithmetic_data: Path
) -> None:
    client = OpenAI(base_url=f"{server.base}/v1", api_key=server.api_key("evals-team"), max_retries=0, timeout=60)
    port = free_port()
    endpoint = client.webhooks.create(
        name="ci", url=f"http://127.0.0.1:{port}/hooks", event_types=["eval.run.succeeded"]
    )
    ev = client.evals.create(
        name="arith",
        data_source_config={"type": "custom", "item_schema": ITEM_SCHEMA},
        testing_criteria=[EXACT, DIGITS],  # type: ignore[list-item]
    )
    lines = (arithmetic_data / "validation.jsonl").read_text().splitlines()[:QUESTIONS]
    questions = [(row["messages"][0]["content"], row["answer"]) for row in map(json.loads, lines)]
    with receiving(port, endpoint.signing_secret, [200]) as receiver:
        runs = [jsonl_run_is_hand_computed(client, ev.id)]
        base_run, base_passed = completions_run_is_chat_completions(client, ev.id, questions)
        tuned = train(client, arithmetic_data)
        tuned_run = client.evals.runs.create(ev.id, data_source=completions_source(questions, tuned))
        done = wait_run(client, ev.id, tuned_run.id)
        assert done.status == "completed", done.error
        assert done.result_counts.total == QUESTIONS and done.result_counts.errored == 0
        # The trained model passes more of the held-out questions than the base. Measured: base 34 of 60, after 30
        # steps 54 (after 20, 45: under this bar, which the test was checked to fail with).
        assert done.result_counts.passed >= base_passed + 0.2 * QUESTIONS, (done.result_counts, base_passed)
        runs += [base_run, tuned_run.id]
        deadline = time.monotonic() + 30
        while len(receiver.verified) < 3:
            assert time.monotonic() < deadline, server.logs()
            time.sleep(0.2)
    assert sorted((e.type, e.data.id) for e in receiver.verified) == sorted(("eval.run.succeeded", r) for r in runs)


def jsonl_run_is_hand_computed(client: OpenAI, eval_id: str) -> str:
    """A jsonl run of an uploaded file: the counts and scores computed by hand (ROWS); its id."""
    rows = "".join(json.dumps(r) + "\n" for r in ROWS).encode()
    uploaded = client.files.create(file=("rows.jsonl", rows), purpose="evals")
    jsonl: Any = {"type": "jsonl", "source": {"type": "file_id", "id": uploaded.id}}
    run = client.evals.runs.create(eval_id, data_source=jsonl)
    done = wait_run(client, eval_id, run.id)
    assert done.status == "completed", done.error
    assert done.result_counts.to_dict() == {"total": 4, "errored": 0, "failed": 2, "passed": 2}
    assert [r.to_dict() for r in done.per_testing_criteria_results] == [
        {"testing_criteria": "exact", "passed": 3, "failed": 1},
        {"testing_criteria": "digits", "passed": 3, "failed": 1},
    ]
    items = client.evals.runs.output_items.list(run.id, eval_id=eval_id).data
    assert [[(r.name, r.score) for r in i.results] for i in items] == [
        [("exact", 1.0), ("digits", 0.5)],
        [("exact", 1.0), ("digits", 0.25)],
        [("exact", 0.0), ("digits", 0.5)],
        [("exact", 1.0), ("digits", 0.75)],
    ]
    return run.id


def completions_source(questions: list[tuple[str, str]], model: str) -> Any:
    return {
        "type": "completions",
        "source": {"type": "file_content", "content": [{"item": {"question": q, "answer": a}} for q, a in questions]},
        "input_messages": {"type": "template", "template": [{"role": "user", "content": "{{item.question}}"}]},
        "model": model,
        "sampling_params": SAMPLING,
    }


def completions_run_is_chat_completions(
    client: OpenAI, eval_id: str, questions: list[tuple[str, str]]
) -> tuple[str, int]:
    """A completions run of base tiny-arith: counts, samples and usage as the same questions answered through
    ``chat.completions.create`` with the same parameters give them; its id and the items it passed."""
    expected = [greedy(client, q) for q, _ in questions]  # also waits for the inference server
    run = client.evals.runs.create(eval_id, data_source=completions_source(questions, MODEL))
    done = wait_run(client, eval_id, run.id)
    assert done.status == "completed", done.error
    exact = [text == answer for (text, _), (_, answer) in zip(expected, questions, strict=True)]
    digits = [sum(c.isdigit() for c in text) / 4 >= 0.5 for text, _ in expected]
    passed = sum(e and d for e, d in zip(exact, digits, strict=True))
    total = len(questions)
    assert done.result_counts.to_dict() == {"total": total, "errored": 0, "failed": total - passed, "passed": passed}
    [usage] = done.per_model_usage
    assert (usage.model_name, usage.invocation_count) == (MODEL, total)
    assert usage.prompt_tokens == sum(u.prompt_tokens for _, u in expected)
    assert usage.completion_tokens == sum(u.completion_tokens for _, u in expected)
    items = client.evals.runs.output_items.list(run.id, eval_id=eval_id, limit=QUESTIONS).data
    for item, (text, _), (question, _) in zip(items, expected, questions, strict=True):
        sample = item.sample
        assert [m.to_dict() for m in sample.input] == [{"role": "user", "content": question}]
        assert sample.output[0].content == text and sample.model == MODEL
        assert (sample.temperature, sample.max_completion_tokens, sample.seed) == (0, 4, 7)
    return run.id, passed

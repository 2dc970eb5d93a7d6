"""A checkpoint's ``metrics`` and a ``metrics`` event's ``data`` through the official ``openai`` client: ours, and
beside them OpenAI's names (``FineTuningJobCheckpoint.Metrics``, RFT's reward means) for what ours measure; a name
we do not measure is absent."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import httpx2
import pytest
from openai import OpenAI

from api import ids
from api.orm import Checkpoint, JobEvent
from tests.integration.conftest import Tenant, job_body, jsonl, upload

CONVERSATIONS = [
    {"messages": [{"role": "user", "content": f"What is {i} + {i}?"}, {"role": "assistant", "content": str(2 * i)}]}
    for i in range(4)
]
SUPERVISED = {"loss/total": 1.5, "token_accuracy": 0.25, "val/loss": 2.0, "val/token_accuracy": 0.5, "lr": 1e-4}


@pytest.fixture
def client(base_url: str, tenant_a: Tenant) -> Iterator[OpenAI]:
    with (
        httpx2.Client(timeout=30) as http,
        OpenAI(base_url=f"{base_url}/v1", api_key=tenant_a.key, max_retries=0, http_client=http) as c,
    ):
        yield c


def checkpoint(db: Callable[[], Any], job_id: str, step: int, metrics: dict[str, float]) -> None:
    with db() as s:
        s.add(
            Checkpoint(
                id=ids.checkpoint_id(),
                job_id=job_id,
                step_number=step,
                metrics=metrics,
                storage_key=f"jobs/{job_id}/checkpoints/step-{step:06d}",
                created_at=int(time.time()),
            )
        )


def supervised_job(api: httpx.Client, **hp: Any) -> str:
    conversations = upload(api, jsonl(CONVERSATIONS)).json()["id"]
    method = {"type": "supervised", "supervised": {"hyperparameters": hp}}
    body = job_body(conversations, validation_file=conversations, method=method)
    r = api.post("/v1/fine_tuning/jobs", json=body)
    assert r.status_code == 200, r.text
    return str(r.json()["id"])


def test_supervised_checkpoint_metrics_carry_openais_names_full_when_the_whole_file_validates(
    client: OpenAI, api: httpx.Client, db: Callable[[], Any]
) -> None:
    whole, cut = supervised_job(api), supervised_job(api, eval_samples=2)
    for job_id in (whole, cut):
        checkpoint(db, job_id, 4, SUPERVISED)
    [full] = client.fine_tuning.jobs.checkpoints.list(whole)
    m = full.metrics
    assert (m.step, m.train_loss, m.train_mean_token_accuracy) == (4.0, 1.5, 0.25)
    assert (m.valid_loss, m.valid_mean_token_accuracy) == (2.0, 0.5)
    assert (m.full_valid_loss, m.full_valid_mean_token_accuracy) == (2.0, 0.5)
    assert m.model_extra is not None and m.model_extra["val/loss"] == 2.0 and m.model_extra["lr"] == 1e-4  # ours too
    [sampled] = client.fine_tuning.jobs.checkpoints.list(cut)
    assert sampled.metrics.valid_loss == 2.0  # validated on the file's first 2 examples: not the full file
    assert sampled.metrics.full_valid_loss is None and sampled.metrics.full_valid_mean_token_accuracy is None


def test_rl_checkpoint_and_metrics_event_carry_the_reward_means_and_nothing_unmeasured(
    client: OpenAI, api: httpx.Client, db: Callable[[], Any], training_file: str
) -> None:
    job_id = api.post("/v1/fine_tuning/jobs", json=job_body(training_file)).json()["id"]
    checkpoint(db, job_id, 2, {"reward/mean": 0.75, "val/reward/mean": 0.5, "kl/mean": 0.01})
    checkpoint(db, job_id, 3, {"reward/mean": 0.25})  # a step that did not validate
    latest, earlier = client.fine_tuning.jobs.checkpoints.list(job_id)
    assert latest.metrics.model_dump(exclude_none=True) == {"step": 3.0, "reward/mean": 0.25, "train_reward_mean": 0.25}
    extra = earlier.metrics.model_extra or {}
    assert (extra["train_reward_mean"], extra["valid_reward_mean"], extra["kl/mean"]) == (0.75, 0.5, 0.01)
    assert earlier.metrics.train_loss is None and earlier.metrics.valid_loss is None  # RL records no loss/total here
    assert "train_reasoning_tokens_mean" not in extra  # not measured: absent, never made up

    data = {"step": 2, "total_steps": 4, "reward/mean": 0.75, "loss/total": -0.1, "val/reward/mean": 0.5}
    with db() as s:
        s.add(JobEvent(id=ids.event_id(), job_id=job_id, level="info", message="Step 2/4", type="metrics", data=data))
    [event] = [e for e in client.fine_tuning.jobs.list_events(job_id) if e.type == "metrics"]
    assert event.data == {**data, "train_loss": -0.1, "train_reward_mean": 0.75, "valid_reward_mean": 0.5}

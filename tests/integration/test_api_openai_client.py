"""The official ``openai`` client, unchanged, against the service over a real socket."""

from __future__ import annotations

import io
from collections.abc import Callable, Iterator
from typing import Any

import httpx2
import openai
import pytest
from openai import OpenAI

from tests.integration.conftest import GRADER, _record_5xx, add_checkpoint, jsonl, prompts


@pytest.fixture
def client(base_url: str, tenant_a: Any) -> Iterator[OpenAI]:
    http = httpx2.Client(event_hooks={"response": [_record_5xx]}, timeout=30)  # the client openai is built on
    with OpenAI(base_url=f"{base_url}/v1", api_key=tenant_a.key, max_retries=0, http_client=http) as c:
        yield c


def method(**hyperparameters: Any) -> Any:
    return {
        "type": "reinforcement",
        "reinforcement": {"grader": GRADER, "hyperparameters": {"batch_size": 2, **hyperparameters}},
    }


class TestFiles:
    def test_create_list_retrieve_content_delete(self, client: OpenAI) -> None:
        content = jsonl(prompts(3))
        created = client.files.create(file=("train.jsonl", io.BytesIO(content)), purpose="fine-tune")
        assert created.id.startswith("file-") and created.bytes == len(content)
        assert created.purpose == "fine-tune" and created.filename == "train.jsonl"

        assert client.files.retrieve(created.id).id == created.id
        assert created.id in [f.id for f in client.files.list(purpose="fine-tune")]
        assert client.files.content(created.id).read() == content

        deleted = client.files.delete(created.id)
        assert deleted.deleted is True and deleted.id == created.id
        with pytest.raises(openai.NotFoundError):
            client.files.retrieve(created.id)

    def test_bad_line_raises_bad_request_naming_the_line(self, client: OpenAI) -> None:
        with pytest.raises(openai.BadRequestError) as err:
            client.files.create(file=("t.jsonl", io.BytesIO(b'{"a": 1}\nnope\n')), purpose="fine-tune")
        assert err.value.param == "file" and "line 2" in err.value.message  # type: ignore[attr-defined]

    def test_auto_pagination_walks_every_page(self, client: OpenAI) -> None:
        made = {
            client.files.create(file=(f"{i}.jsonl", io.BytesIO(jsonl(prompts(1)))), purpose="fine-tune").id
            for i in range(3)
        }
        seen = [f.id for f in client.files.list(limit=1)]
        assert made <= set(seen) and len(seen) == len(set(seen))


class TestJobs:
    def test_job_lifecycle(self, client: OpenAI, db: Callable[[], Any], artifact_store: Any) -> None:
        train = client.files.create(file=("train.jsonl", io.BytesIO(jsonl(prompts(4)))), purpose="fine-tune")
        job = client.fine_tuning.jobs.create(
            model="tiny-arith",
            training_file=train.id,
            method=method(),
            suffix="oa",
            metadata={"via": "openai"},
            seed=3,
        )
        assert job.status == "validating_files" and job.id.startswith("ftjob-") and job.seed == 3
        assert job.metadata == {"via": "openai"} and job.hyperparameters.batch_size == 2
        assert job.method is not None and job.method.type == "reinforcement"
        assert job.method.reinforcement is not None and job.method.reinforcement.hyperparameters is not None
        assert job.method.reinforcement.hyperparameters.batch_size == 2

        assert client.fine_tuning.jobs.retrieve(job.id).id == job.id
        listed = client.fine_tuning.jobs.list(metadata={"via": "openai"})
        assert job.id in [j.id for j in listed]

        events = list(client.fine_tuning.jobs.list_events(job.id))
        assert [e.message for e in events] == ["Created fine-tuning job"]
        assert [e.id for e in client.fine_tuning.jobs.list_events(job.id, limit=1)] == [e.id for e in events]

        ckpts = [add_checkpoint(db, artifact_store, job.id, step) for step in (4, 8)]
        listed_ckpts = list(client.fine_tuning.jobs.checkpoints.list(job.id))
        assert [c.id for c in listed_ckpts] == ckpts[::-1]
        assert listed_ckpts[0].step_number == 8 and listed_ckpts[0].fine_tuning_job_id == job.id
        assert listed_ckpts[0].fine_tuned_model_checkpoint.endswith(":ckpt-step-8")
        assert [c.id for c in client.fine_tuning.jobs.checkpoints.list(job.id, limit=1)] == ckpts[::-1]

        cancelled = client.fine_tuning.jobs.cancel(job.id)
        assert cancelled.status == "cancelled" and cancelled.finished_at is not None
        with pytest.raises(openai.ConflictError):
            client.fine_tuning.jobs.cancel(job.id)

        paused_job = client.fine_tuning.jobs.create(model="tiny-arith", training_file=train.id, method=method())
        assert client.fine_tuning.jobs.pause(paused_job.id).status == "paused"  # type: ignore[comparison-overlap]
        assert client.fine_tuning.jobs.resume(paused_job.id).status == "queued"

    def test_auto_eval_interval_is_stored_as_the_interval_it_picked_from_the_runs_length(self, client: OpenAI) -> None:
        train = client.files.create(file=("t.jsonl", io.BytesIO(jsonl(prompts(40)))), purpose="fine-tune")
        auto = {"eval_interval": "auto", "eval_samples": "auto"}
        by_epochs = client.fine_tuning.jobs.create(
            model="tiny-arith", training_file=train.id, method=method(n_epochs=3, **auto)
        )  # 3 epochs of 40 prompts in batches of 2: 60 steps, validated every ceil(60 / 10) = 6
        by_steps = client.fine_tuning.jobs.create(
            model="tiny-arith", training_file=train.id, method=method(max_steps=25, **auto)
        )
        for job, every in ((by_epochs, 6), (by_steps, 3)):
            assert job.method is not None and job.method.reinforcement is not None
            hp = job.method.reinforcement.hyperparameters
            assert hp is not None and (hp.eval_interval, hp.eval_samples) == (every, None)

    def test_spec_errors_surface_as_bad_request_with_param(self, client: OpenAI) -> None:
        train = client.files.create(file=("t.jsonl", io.BytesIO(jsonl(prompts(2)))), purpose="fine-tune")
        with pytest.raises(openai.BadRequestError) as err:
            client.fine_tuning.jobs.create(model="tiny-arith", training_file=train.id, method=method(bogus=1))
        assert err.value.param == "method.reinforcement.hyperparameters.bogus"  # type: ignore[attr-defined]
        with pytest.raises(openai.BadRequestError) as err:
            client.fine_tuning.jobs.create(model="gpt-4o-mini", training_file=train.id, method=method())
        assert err.value.code == "model_not_available"  # type: ignore[attr-defined]

    def test_wrong_key_is_an_authentication_error(self, base_url: str) -> None:
        with (
            OpenAI(base_url=f"{base_url}/v1", api_key="sk-wrong", max_retries=0) as c,
            pytest.raises(openai.AuthenticationError),
        ):
            c.files.list()

    def test_request_id_is_exposed(self, client: OpenAI) -> None:
        raw = client.files.with_raw_response.list()
        assert raw.headers["x-request-id"].startswith("req_")
        assert raw.request_id == raw.headers["x-request-id"]

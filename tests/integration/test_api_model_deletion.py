"""``DELETE /v1/models/{model}`` and ``GET /v1/models/{checkpoint}`` through the official ``openai`` client: a
tenant's fine-tuned model, once deleted, is 404 for retrieval, chat completions (model resolution) and a new job's
grader, while its job still names it; a base model or a checkpoint cannot be deleted (403), another tenant's model
is not found (404). A checkpoint's name is retrieved as a model while chat completions would serve it."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import httpx2
import openai
import pytest
from openai import OpenAI

from api import ids
from api.auth import Caller
from api.db import read
from api.errors import ModelNotFound
from api.orm import File, Job
from api.services import inference
from tests.integration.conftest import Tenant, add_checkpoint, assert_error, job_body, jsonl, set_job, upload

PAIRS = [
    {
        "input": {"messages": [{"role": "user", "content": f"What is {i} + {i}?"}]},
        "preferred_output": [{"role": "assistant", "content": str(2 * i)}],
        "non_preferred_output": [{"role": "assistant", "content": str(2 * i + 1)}],
    }
    for i in range(4)
]


def sdk(base_url: str, tenant: Tenant) -> OpenAI:
    return OpenAI(base_url=f"{base_url}/v1", api_key=tenant.key, max_retries=0, http_client=httpx2.Client(timeout=30))


@pytest.fixture
def client(base_url: str, tenant_a: Tenant) -> Iterator[OpenAI]:
    with sdk(base_url, tenant_a) as c:
        yield c


@pytest.fixture
def client_b(base_url: str, tenant_b: Tenant) -> Iterator[OpenAI]:
    with sdk(base_url, tenant_b) as c:
        yield c


def succeeded(db: Callable[[], Any], job_id: str, tenant: Tenant) -> str:
    """Finish the job as a worker would: its fine-tuned model named, its final adapter among its result files."""
    name = ids.fine_tuned_model_name(model="tiny-arith", tenant_id=tenant.id, suffix=None, job_id=job_id)
    adapter = ids.file_id()
    with db() as s:
        s.add(
            File(
                id=adapter,
                tenant_id=tenant.id,
                filename=f"{job_id}-adapter.tar.gz",
                purpose="fine-tune-results",
                bytes=3,
                lines=0,
                storage_key=f"files/{tenant.id}/{adapter}.tar.gz",
                created_at=int(time.time()),
                deleted=False,
            )
        )
    set_job(db, job_id, status="succeeded", fine_tuned_model=name, result_files=[adapter], finished_at=1234)
    return name


def resolves(settings: Any, tenant: Tenant, model: str) -> bool:
    """Whether chat completions would serve ``model`` for the tenant (the resolution their route runs first)."""
    caller = Caller(id=tenant.id, name="t", created_at=0)
    try:
        read(settings.db_url, inference.resolve, settings=settings, tenant=caller, model=model)
    except ModelNotFound:
        return False
    return True


class TestDeleteModel:
    def test_a_deleted_model_is_gone_everywhere_but_its_job_which_still_names_it(
        self,
        client: OpenAI,
        queued_job: dict[str, Any],
        db: Callable[[], Any],
        artifact_store: Any,
        settings: Any,
        tenant_a: Tenant,
    ) -> None:
        name = succeeded(db, queued_job["id"], tenant_a)
        add_checkpoint(db, artifact_store, queued_job["id"], 4)
        assert client.models.retrieve(name).id == name and resolves(settings, tenant_a, name)

        deleted = client.models.delete(name)
        assert (deleted.id, deleted.object, deleted.deleted) == (name, "model", True)

        with pytest.raises(openai.NotFoundError):
            client.models.retrieve(name)
        assert name not in [m.id for m in client.models.list()]
        assert not resolves(settings, tenant_a, name)
        with pytest.raises(openai.NotFoundError) as err:
            client.chat.completions.create(model=name, messages=[{"role": "user", "content": "What is 1 + 1?"}])
        assert err.value.code == "model_not_found"
        job = client.fine_tuning.jobs.retrieve(queued_job["id"])
        assert job.fine_tuned_model == name and job.status == "succeeded"  # as OpenAI: the job keeps the name
        with db() as s:
            row = s.get(Job, queued_job["id"])
            assert row.model_deleted_at is not None and abs(row.model_deleted_at - time.time()) < 60
        with pytest.raises(openai.NotFoundError):  # deleted once: a second delete finds nothing
            client.models.delete(name)
        ckpt = f"{name}:ckpt-step-4"  # the job's checkpoints are models of their own, still served
        assert client.models.retrieve(ckpt).id == ckpt and resolves(settings, tenant_a, ckpt)

    def test_a_base_model_a_checkpoint_and_another_tenants_model_cannot_be_deleted(
        self,
        client: OpenAI,
        client_b: OpenAI,
        queued_job: dict[str, Any],
        db: Callable[[], Any],
        artifact_store: Any,
        tenant_a: Tenant,
    ) -> None:
        name = succeeded(db, queued_job["id"], tenant_a)
        add_checkpoint(db, artifact_store, queued_job["id"], 2)
        with pytest.raises(openai.PermissionDeniedError) as err:
            client.models.delete("tiny-arith")
        assert (err.value.code, err.value.param) == ("model_not_deletable", "model")  # type: ignore[attr-defined]
        with pytest.raises(openai.PermissionDeniedError):
            client.models.delete(f"{name}:ckpt-step-2")
        for model in (name, "ft:tiny-arith:nobody::nothing"):
            with pytest.raises(openai.NotFoundError):
                client_b.models.delete(model)
        assert client.models.retrieve(name).id == name  # still there
        assert client.models.retrieve("tiny-arith").owned_by == "proxima"

    def test_a_new_job_cannot_grade_with_a_deleted_reward_model(
        self, api: httpx.Client, client: OpenAI, training_file: str, db: Callable[[], Any], tenant_a: Tenant
    ) -> None:
        pairs = upload(api, jsonl(PAIRS)).json()["id"]
        rm = api.post(
            "/v1/fine_tuning/jobs", json=job_body(pairs, method={"type": "reward_model", "reward_model": {}})
        ).json()
        name = succeeded(db, rm["id"], tenant_a)
        ppo = {
            "type": "ppo",
            "ppo": {
                "grader": {"type": "reward_model", "name": "rm", "model": name},
                "hyperparameters": {"batch_size": 2},
            },
        }
        assert api.post("/v1/fine_tuning/jobs", json=job_body(training_file, method=ppo)).status_code == 200
        client.models.delete(name)
        for ref in (name, rm["id"]):  # by its name or its job's id
            ppo["ppo"]["grader"]["model"] = ref
            r = api.post("/v1/fine_tuning/jobs", json=job_body(training_file, method=ppo))
            error = assert_error(r, 400, param="method.ppo.grader.model", code="invalid_reward_model")
            assert error["message"] == f"reward model {ref!r}: its fine-tuned model was deleted"


class TestRetrieveCheckpoint:
    def test_a_checkpoint_is_a_model_while_chat_completions_serve_it(
        self,
        client: OpenAI,
        client_b: OpenAI,
        queued_job: dict[str, Any],
        db: Callable[[], Any],
        artifact_store: Any,
        settings: Any,
        tenant_a: Tenant,
    ) -> None:
        # a running job's checkpoint: served (and so retrieved) before the job has a fine-tuned model
        set_job(db, queued_job["id"], status="running")
        name = ids.fine_tuned_model_name(
            model="tiny-arith", tenant_id=tenant_a.id, suffix=None, job_id=queued_job["id"]
        )
        add_checkpoint(db, artifact_store, queued_job["id"], 6)
        ckpt = f"{name}:ckpt-step-6"
        assert resolves(settings, tenant_a, ckpt)
        model = client.models.retrieve(ckpt)
        assert (model.id, model.object, model.owned_by) == (ckpt, "model", tenant_a.id)
        assert abs(model.created - time.time()) < 60  # the checkpoint's creation
        assert ckpt not in [m.id for m in client.models.list()]  # as OpenAI: checkpoints are not listed
        for missing in (f"{name}:ckpt-step-7", f"{name}x:ckpt-step-6"):
            assert not resolves(settings, tenant_a, missing)
            with pytest.raises(openai.NotFoundError):
                client.models.retrieve(missing)
        with pytest.raises(openai.NotFoundError):  # another tenant's checkpoint does not exist for B
            client_b.models.retrieve(ckpt)

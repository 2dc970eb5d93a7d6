"""``resources: {"gpus": N}`` (extension): a job asks for N devices; the deployment's limit, what data parallel
training supports, the job's queue by size, and the sweeper re-sending a lost message of a large job into its queue.
Real HTTP, PostgreSQL and Redis; no worker runs here (tests/e2e/test_data_parallel.py runs the ranks)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
import redis

from api.tasks import queue_for, queues_of
from tests.integration.conftest import CELERY_QUEUE, GRADER, assert_error, http_client, job_body, serve, set_job
from worker.broker import job_id_of


@pytest.fixture(scope="module")
def large_settings(settings: Any) -> Any:
    return settings.model_copy(update={"max_job_gpus": 4})


@pytest.fixture(scope="module")
def large_url(large_settings: Any) -> Iterator[str]:
    from api.app import create_app

    with serve(create_app(large_settings)) as url:
        yield url


@pytest.fixture
def large_api(large_url: str, tenant_a: Any) -> Iterator[httpx.Client]:
    with http_client(large_url, tenant_a.key) as client:
        yield client


def queued_ids(redis_url: str, queue: str) -> list[str | None]:
    client = redis.Redis.from_url(redis_url)
    try:
        return [job_id_of(raw) for raw in client.lrange(queue, 0, -1)]
    finally:
        client.close()


def test_the_queues_by_size() -> None:
    assert queue_for(1) == CELERY_QUEUE and queue_for(3) == "proxima.gpus.3"
    assert queues_of(1) == [CELERY_QUEUE] and queues_of(3) == [CELERY_QUEUE, "proxima.gpus.2", "proxima.gpus.3"]


def test_a_job_asks_for_one_device_unless_it_says_more(api: httpx.Client, training_file: str) -> None:
    r = api.post("/v1/fine_tuning/jobs", json=job_body(training_file))
    assert r.status_code == 200, r.text
    assert r.json()["resources"] == {"gpus": 1}
    r = api.post("/v1/fine_tuning/jobs", json=job_body(training_file, resources={"gpus": 1}))
    assert r.status_code == 200 and r.json()["resources"] == {"gpus": 1}, r.text


@pytest.mark.parametrize(
    ("resources", "param", "words"),
    [
        ({"gpus": 2}, "resources.gpus", "at most 1 device (PROXIMA_MAX_JOB_GPUS); asked for 2"),
        ({"gpus": 0}, "resources.gpus", "greater than or equal to 1"),
        ({"gpus": "two"}, "resources.gpus", "integer"),
        ({"tpus": 1}, "resources.tpus", "unknown field"),
    ],
)
def test_resources_beyond_the_deployment_or_malformed_are_a_400_naming_the_field(
    api: httpx.Client, training_file: str, resources: dict[str, Any], param: str, words: str
) -> None:
    r = api.post("/v1/fine_tuning/jobs", json=job_body(training_file, resources=resources))
    assert_error(r, 400, param=param, message_contains=words)


def test_a_job_on_several_devices_waits_in_the_queue_of_its_size(
    large_api: httpx.Client, training_file: str, redis_url: str, queue_length: Callable[[], int]
) -> None:
    before = queue_length()
    r = large_api.post("/v1/fine_tuning/jobs", json=job_body(training_file, resources={"gpus": 2}))
    assert r.status_code == 200, r.text
    job = r.json()
    assert job["resources"] == {"gpus": 2}
    assert job["id"] in queued_ids(redis_url, "proxima.gpus.2")
    assert queue_length() == before  # not in the queue every worker takes
    assert large_api.get(f"/v1/fine_tuning/jobs/{job['id']}").json()["resources"] == {"gpus": 2}


@pytest.mark.parametrize(("method", "hp"), [("dpo", {"batch_size": 8}), ("supervised", {"batch_size": 4})])
def test_every_method_may_ask_for_several_devices(
    large_api: httpx.Client, training_file: str, method: str, hp: dict[str, Any]
) -> None:
    body = job_body(training_file, method={"type": method, method: {"hyperparameters": hp}}, resources={"gpus": 4})
    r = large_api.post("/v1/fine_tuning/jobs", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["resources"] == {"gpus": 4}


def test_an_agent_job_may_ask_for_several_devices_and_waits_in_the_queue_of_its_size(
    large_api: httpx.Client, training_file: str, redis_url: str
) -> None:
    """Multi-turn episodes run data parallel too (each rank a block of whole groups: tests/e2e/test_data_parallel)."""
    body = job_body(training_file, resources={"gpus": 2})
    tool = {"name": "calculator", "server_url": "https://1.1.1.1/tools/calc", "headers": {}}
    body["method"]["grpo"].update(tools=[tool], max_episode_steps=3)
    r = large_api.post("/v1/fine_tuning/jobs", json=body)
    assert r.status_code == 200, r.text
    job = r.json()
    assert job["resources"] == {"gpus": 2} and job["method"]["grpo"]["tools"] == [tool]
    assert job["id"] in queued_ids(redis_url, "proxima.gpus.2")


def test_a_job_may_shard_its_base_across_its_devices(
    large_api: httpx.Client, training_file: str, redis_url: str
) -> None:
    """``shard_base``: the frozen base's weights split across the devices (FSDP2: tests/e2e/test_data_parallel)."""
    r = large_api.post("/v1/fine_tuning/jobs", json=job_body(training_file, resources={"gpus": 2, "shard_base": True}))
    assert r.status_code == 200, r.text
    job = r.json()
    assert job["resources"] == {"gpus": 2, "shard_base": True}
    asked = {"gpus": 2, "shard_base": True, "gather_for_generation": True}
    r = large_api.post("/v1/fine_tuning/jobs", json=job_body(training_file, resources=asked))
    assert r.status_code == 200 and r.json()["resources"] == asked, r.text
    assert job["id"] in queued_ids(redis_url, "proxima.gpus.2")
    assert large_api.get(f"/v1/fine_tuning/jobs/{job['id']}").json()["resources"] == {"gpus": 2, "shard_base": True}


SHARDED = {"gpus": 2, "shard_base": True}


@pytest.mark.parametrize(
    ("method", "resources", "words"),
    [
        ({}, {"gpus": 1, "shard_base": True}, "shard_base needs gpus of 2 or more"),
        ({"type": "ppo", "ppo": {"grader": GRADER, "hyperparameters": {"batch_size": 2, "value_model": "m"}}},
         SHARDED, "not a separate value_model"),
        ({"type": "supervised", "supervised": {"hyperparameters": {"batch_size": 2}}}, SHARDED,
         "shard_base supports grpo, reinforcement, dr_grpo, dapo, rloo, reinforce, ppo; not supervised"),
        ({"type": "dpo", "dpo": {"hyperparameters": {"batch_size": 2}}}, SHARDED, "not dpo"),
        ({"tools": True}, SHARDED, "does not run agent (multi-turn) jobs"),
        ({}, {"gpus": 2, "shard_base": "yes please"}, "valid boolean"),
        ({}, {"gpus": 2, "gather_for_generation": True}, "it needs shard_base"),
    ],
)  # fmt: skip
def test_a_sharded_base_the_job_cannot_use_is_a_400_naming_it(
    large_api: httpx.Client, training_file: str, method: dict[str, Any], resources: dict[str, Any], words: str
) -> None:
    body = job_body(training_file, resources=resources)
    if method.get("tools"):
        tool = {"name": "calculator", "server_url": "https://1.1.1.1/tools/calc", "headers": {}}
        body["method"]["grpo"].update(tools=[tool], max_episode_steps=3)
    elif method:
        body["method"] = method
    r = large_api.post("/v1/fine_tuning/jobs", json=body)
    param = "resources.gather_for_generation" if "gather_for_generation" in resources else "resources.shard_base"
    assert_error(r, 400, param=param, message_contains=words)


def test_a_batch_smaller_than_the_devices_is_a_400_naming_resources(
    large_api: httpx.Client, training_file: str
) -> None:
    r = large_api.post("/v1/fine_tuning/jobs", json=job_body(training_file, resources={"gpus": 4}))  # batch_size 2
    assert_error(r, 400, param="resources.gpus", message_contains="batch_size (2) must be at least resources.gpus (4)")


def test_the_sweeper_reads_a_large_jobs_queue_and_sends_its_lost_message_back_into_it(
    large_api: httpx.Client, training_file: str, large_settings: Any, redis_url: str, db: Callable[[], Any]
) -> None:
    from celery import Celery

    from worker.sweeper import sweep_once

    body = job_body(training_file, resources={"gpus": 3})
    body["method"]["grpo"]["hyperparameters"]["batch_size"] = 3
    r = large_api.post("/v1/fine_tuning/jobs", json=body)
    assert r.status_code == 200, r.text
    job_id = r.json()["id"]
    set_job(db, job_id, enqueued_at=time.time() - 120)  # waiting long enough for the sweeper to look
    app = Celery("sweeper-test", broker=redis_url, set_as_current=False)
    try:
        assert job_id not in sweep_once(app, large_settings)  # its message waits in proxima.gpus.3: held
        client = redis.Redis.from_url(redis_url)
        client.delete("proxima.gpus.3")  # lost (a broker restart without persistence)
        client.close()
        set_job(db, job_id, enqueued_at=time.time() - 120)
        assert job_id in sweep_once(app, large_settings)
        assert queued_ids(redis_url, "proxima.gpus.3") == [job_id]
    finally:
        app.close()

"""``POST /v1/fine_tuning/estimates`` over the real app and PostgreSQL: steps from max_steps or the training
file's lines, a duration from past jobs' measured step times (of every tenant, answered only as an aggregate), none
without history, and the creation's 400s.

The past jobs are rows inserted here, on a model offered only by this module's app, so that no other test's jobs
count; the expectations are computed by hand from their metric rows.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from api import ids
from api.orm import Job, JobMetric
from api.status import JobStatus
from tests.integration.conftest import (
    GRADER,
    MAX_UPLOAD_BYTES,
    Tenant,
    assert_error,
    http_client,
    jsonl,
    make_tenant,
    prompts,
    serve,
    upload,
)
from trainer.spec.config import parse_spec

MODEL = f"est-{secrets.token_hex(3)}"
OTHER_MODEL = f"est-other-{secrets.token_hex(3)}"
EMPTY_MODEL = f"est-empty-{secrets.token_hex(3)}"


@pytest.fixture(scope="module")
def est_settings(pg_url: str, redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Any:
    from api.settings import Settings

    home = tmp_path_factory.mktemp("estimate-home")
    return Settings(
        home=home,
        database_url=pg_url,
        broker_url=redis_url,
        artifacts=str(home / "artifacts"),
        base_models=[MODEL, OTHER_MODEL, EMPTY_MODEL],
        max_upload_bytes=MAX_UPLOAD_BYTES,
    )


@pytest.fixture(scope="module")
def est_url(est_settings: Any) -> Iterator[str]:
    from api.app import create_app

    with serve(create_app(est_settings)) as url:
        yield url


@pytest.fixture(scope="module")
def owner(est_settings: Any, est_url: str) -> Tenant:
    return make_tenant(est_settings, f"est-owner-{secrets.token_hex(3)}")


@pytest.fixture(scope="module")
def other(est_settings: Any, est_url: str) -> Tenant:
    return make_tenant(est_settings, f"est-other-{secrets.token_hex(3)}")


@pytest.fixture
def api(est_url: str, owner: Tenant) -> Iterator[httpx.Client]:
    with http_client(est_url, owner.key) as client:
        yield client


@pytest.fixture(scope="module")
def training_file(est_url: str, owner: Tenant) -> str:
    with http_client(est_url, owner.key) as client:
        response = upload(client, jsonl(prompts(20)))
    assert response.status_code == 200, response.text
    assert response.json()["lines"] == 20
    return str(response.json()["id"])


def spec(model: str, method: str, **hp: Any) -> dict[str, Any]:
    block: dict[str, Any] = {"hyperparameters": hp}
    if method == "grpo":
        block["grader"] = GRADER
    return parse_spec({"model": model, "training_file": "file-x", "method": {"type": method, method: block}}).to_json()


def past_job(
    settings: Any, tenant: Tenant, job_spec: dict[str, Any], steps: list[dict[str, float]], *, started: bool = True
) -> str:
    """A job row as a worker leaves it, with one metrics row per step (step 0: validation only)."""
    from api.db import session_scope

    job_id = ids.job_id()
    with session_scope(settings.db_url) as s:
        s.add(
            Job(
                id=job_id,
                tenant_id=tenant.id,
                model=job_spec["model"],
                training_file="file-x",
                status=JobStatus.SUCCEEDED if started else JobStatus.QUEUED,
                spec=job_spec,
                seed=0,
                result_files=[],
                created_at=int(time.time()),
                started_at=int(time.time()) if started else None,
                current_step=len(steps),
            )
        )
        s.flush()
        for step, values in enumerate(steps):
            s.add(JobMetric(job_id=job_id, step=step, values=values, created_at=int(time.time())))
    return job_id


@pytest.fixture(scope="module")
def history(est_settings: Any, owner: Tenant, other: Tenant) -> None:
    """Two measured grpo jobs on MODEL (one of another tenant), and jobs that must not count."""
    val = {"val/reward/mean": 0.5}
    # Step size 4·4·8 = 128; training steps 2.0, 1.6, 2.2 (step 2 ran a validation): median 2.0 → 2/128 s per unit.
    past_job(
        est_settings,
        other,
        spec(MODEL, "grpo", batch_size=4, group_size=4, max_completion_tokens=8),
        [val, {"time/step_s": 2.0}, {"time/step_s": 2.4, **val}, {"time/step_s": 1.6}, {"time/step_s": 2.2}],
    )
    # Step size 2·2·8 = 32; steps 1.0, 0.6, 0.5: median 0.6 → 0.6/32 s per unit.
    past_job(
        est_settings,
        owner,
        spec(MODEL, "grpo", batch_size=2, group_size=2, max_completion_tokens=8),
        [{}, {"time/step_s": 1.0}, {"time/step_s": 0.6}, {"time/step_s": 0.5}],
    )
    slow = [{}, {"time/step_s": 100.0}]
    past_job(est_settings, other, spec(MODEL, "dpo"), slow)  # another method
    past_job(est_settings, other, spec(OTHER_MODEL, "grpo", group_size=2), slow)  # another model
    past_job(est_settings, other, spec(MODEL, "grpo", group_size=2), slow, started=False)  # never started


RATE = (2.0 / 128 + 0.6 / 32) / 2  # the median of the two jobs' seconds per unit


def body(
    training_file: str, hp: dict[str, Any] | None = None, *, model: str = MODEL, method: str = "grpo"
) -> dict[str, Any]:
    return {
        "model": model,
        "training_file": training_file,
        "method": {"type": method, method: {"grader": GRADER, "hyperparameters": hp or {}}},
    }


@pytest.mark.usefixtures("history")
class TestEstimate:
    def test_max_steps_and_measured_throughput_give_the_duration(self, api: httpx.Client, training_file: str) -> None:
        hp = {"batch_size": 8, "group_size": 8, "max_completion_tokens": 16, "max_steps": 10}
        response = api.post("/v1/fine_tuning/estimates", json=body(training_file, hp))
        assert response.status_code == 200, response.text
        estimate = response.json()
        # Step size 8·8·16 = 1024: 1024 · RATE = 17.6 s a step, 176 s for 10 steps.
        assert estimate["seconds_per_step"] == pytest.approx(1024 * RATE)
        assert estimate["seconds_per_step"] == pytest.approx(17.6)
        assert estimate["estimated_duration_seconds"] == 176
        assert estimate["object"] == "fine_tuning.job.estimate"
        assert (estimate["model"], estimate["method"]) == (MODEL, "grpo")
        assert (estimate["total_steps"], estimate["total_steps_from"]) == (10, "max_steps")
        # Only aggregates: two jobs, six training steps; no job id, tenant or spec of another tenant.
        assert estimate["basis"] == {
            "jobs": 2,
            "steps": 6,
            "scaled_by": "batch_size × samples_per_prompt × max_completion_tokens",
            "reason": None,
        }
        assert "ftjob-" not in response.text
        assert estimate["hyperparameters"]["max_completion_tokens"] == 16
        assert estimate["hyperparameters"]["learning_rate"] == 3e-4  # resolved, defaults included

    def test_reinforcement_is_measured_by_the_grpo_jobs_whose_recipe_it_runs(
        self, api: httpx.Client, training_file: str
    ) -> None:
        hp = {"batch_size": 8, "group_size": 8, "max_completion_tokens": 16, "max_steps": 10}
        estimate = api.post("/v1/fine_tuning/estimates", json=body(training_file, hp, method="reinforcement")).json()
        assert estimate["method"] == "reinforcement"
        assert estimate["seconds_per_step"] == pytest.approx(17.6)  # the two grpo jobs' rate, as above
        assert (estimate["basis"]["jobs"], estimate["basis"]["steps"]) == (2, 6)

    def test_without_max_steps_the_steps_come_from_the_training_files_lines(
        self, api: httpx.Client, training_file: str
    ) -> None:
        hp = {"batch_size": 8, "group_size": 8, "max_completion_tokens": 16, "n_epochs": 3}
        estimate = api.post("/v1/fine_tuning/estimates", json=body(training_file, hp)).json()
        # 3 epochs of 20 lines in batches of 8: 3 · ceil(20 / 8) = 9 steps; 9 · 17.6 = 158.4 s.
        assert (estimate["total_steps"], estimate["total_steps_from"]) == (9, "training_file")
        assert estimate["estimated_duration_seconds"] == 158

    def test_with_no_measured_job_there_is_no_duration_and_the_basis_says_why(
        self, api: httpx.Client, training_file: str
    ) -> None:
        response = api.post("/v1/fine_tuning/estimates", json=body(training_file, {"max_steps": 5}, model=EMPTY_MODEL))
        assert response.status_code == 200, response.text
        estimate = response.json()
        assert estimate["total_steps"] == 5
        assert estimate["seconds_per_step"] is None and estimate["estimated_duration_seconds"] is None
        assert estimate["basis"]["jobs"] == 0 and estimate["basis"]["steps"] == 0
        assert estimate["basis"]["reason"] == (
            f"no grpo job on {EMPTY_MODEL} has recorded a timed training step on this deployment yet"
        )

    def test_an_estimate_creates_no_job(self, api: httpx.Client, training_file: str) -> None:
        before = api.get("/v1/fine_tuning/jobs").json()["data"]
        assert api.post("/v1/fine_tuning/estimates", json=body(training_file, {"max_steps": 2})).status_code == 200
        assert api.get("/v1/fine_tuning/jobs").json()["data"] == before


class TestEstimateErrors:
    def test_without_a_key_401(self, est_url: str, training_file: str) -> None:
        with http_client(est_url) as anon:
            assert_error(anon.post("/v1/fine_tuning/estimates", json=body(training_file)), 401)

    def test_a_bad_spec_is_the_400_creation_gives(self, api: httpx.Client, training_file: str) -> None:
        response = api.post("/v1/fine_tuning/estimates", json=body(training_file, {"batch_size": 0}))
        assert_error(response, 400, param="method.grpo.hyperparameters.batch_size", code="invalid_spec")
        response = api.post("/v1/fine_tuning/estimates", json=body(training_file, model="no-such-model"))
        assert_error(response, 400, param="model", code="model_not_available")
        response = api.post("/v1/fine_tuning/estimates", json={**body(training_file), "surprise": 1})
        assert_error(response, 400)

    def test_another_tenants_file_does_not_exist(self, est_url: str, other: Tenant, training_file: str) -> None:
        with http_client(est_url, other.key) as client:
            response = client.post("/v1/fine_tuning/estimates", json=body(training_file, {"max_steps": 2}))
        assert_error(response, 400, param="training_file", code="file_not_found")

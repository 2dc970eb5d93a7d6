"""A job's ``integrations`` at creation: OpenAI's W&B integration and our MLflow one accepted when the
deployment exports to the tracker, stored with the job and shown back in its object (over HTTP and through the
official client), refused with a 400 naming the field when malformed, and refused naming the integration when the
deployment does not export to that tracker. (What the worker exports: tests/unit/worker/test_trackers.py and
tests/e2e/test_trackers_e2e.py.)"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import httpx2
import pytest
from openai import OpenAI

from api.services.integrations import configured
from api.settings import Settings
from tests.integration.conftest import Tenant, _record_5xx, assert_error, http_client, job_body, serve, validate

WANDB = {"type": "wandb", "wandb": {"project": "arith", "entity": "acme", "name": "try 1", "tags": ["rl", "small"]}}
MLFLOW = {"type": "mlflow", "mlflow": {"experiment_name": "arith", "run_name": "try 1", "tags": {"team": "rl"}}}


@pytest.fixture(scope="module")
def tracked(settings: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Settings, str]]:
    """The same deployment (database, files) with both trackers configured: W&B offline, MLflow on a file store."""
    from api.app import create_app

    root = tmp_path_factory.mktemp("trackers")
    tracked = settings.model_copy(
        update={"wandb_mode": "offline", "wandb_dir": root / "wandb", "mlflow_tracking_uri": (root / "ml").as_uri()}
    )
    with serve(create_app(tracked)) as url:
        yield tracked, url


@pytest.fixture
def tapi(tracked: tuple[Settings, str], tenant_a: Tenant) -> Iterator[httpx.Client]:
    with http_client(tracked[1], tenant_a.key) as client:
        yield client


def job_count(client: httpx.Client) -> int:
    return len(client.get("/v1/fine_tuning/jobs", params={"limit": 100}).json()["data"])


class TestAccepted:
    def test_wandb_and_mlflow_integrations_are_stored_and_shown_back_in_the_job_object(
        self, tapi: httpx.Client, training_file: str, db: Any
    ) -> None:
        from api.orm import Job

        response = tapi.post("/v1/fine_tuning/jobs", json=job_body(training_file, integrations=[WANDB, MLFLOW]))
        assert response.status_code == 200, response.text
        job = response.json()
        assert job["integrations"] == [WANDB, MLFLOW]
        assert tapi.get(f"/v1/fine_tuning/jobs/{job['id']}").json()["integrations"] == [WANDB, MLFLOW]
        listed = tapi.get("/v1/fine_tuning/jobs", params={"limit": 100}).json()["data"]
        assert next(j for j in listed if j["id"] == job["id"])["integrations"] == [WANDB, MLFLOW]
        with db() as s:
            assert s.get(Job, job["id"]).spec["integrations"] == [WANDB, MLFLOW]

    def test_omitted_fields_are_shown_back_as_null_or_empty(self, tapi: httpx.Client, training_file: str) -> None:
        body = job_body(
            training_file,
            integrations=[
                {"type": "wandb", "wandb": {"project": "p"}},
                {"type": "mlflow", "mlflow": {"experiment_name": "e"}},
            ],
        )
        response = tapi.post("/v1/fine_tuning/jobs", json=body)
        assert response.status_code == 200, response.text
        assert response.json()["integrations"] == [
            {"type": "wandb", "wandb": {"project": "p", "entity": None, "name": None, "tags": []}},
            {"type": "mlflow", "mlflow": {"experiment_name": "e", "run_name": None, "tags": {}}},
        ]

    def test_a_job_without_integrations_shows_an_empty_list(self, tapi: httpx.Client, training_file: str) -> None:
        for integrations in (None, []):
            body = job_body(training_file, **({} if integrations is None else {"integrations": integrations}))
            response = tapi.post("/v1/fine_tuning/jobs", json=body)
            assert response.status_code == 200, response.text
            assert response.json()["integrations"] == []

    def test_the_official_client_creates_a_job_with_a_wandb_integration_and_reads_it_back(
        self, tracked: tuple[Settings, str], tenant_a: Tenant, training_file: str
    ) -> None:
        http = httpx2.Client(event_hooks={"response": [_record_5xx]}, timeout=30)
        with OpenAI(base_url=f"{tracked[1]}/v1", api_key=tenant_a.key, max_retries=0, http_client=http) as client:
            job = client.fine_tuning.jobs.create(
                model="tiny-arith",
                training_file=training_file,
                method=job_body(training_file)["method"],
                integrations=[{"type": "wandb", "wandb": {"project": "arith", "tags": ["rl"]}}],
            )
            again = client.fine_tuning.jobs.retrieve(job.id)
        for j in (job, again):
            assert j.integrations is not None and len(j.integrations) == 1
            (integration,) = j.integrations
            assert integration.type == "wandb"
            assert (integration.wandb.project, integration.wandb.entity, integration.wandb.name) == (
                "arith",
                None,
                None,
            )
            assert integration.wandb.tags == ["rl"]

    def test_a_job_with_integrations_passes_the_workers_file_validation(
        self, tapi: httpx.Client, training_file: str, tracked: tuple[Settings, str]
    ) -> None:
        """The trainer's spec parser never sees the integrations (they are the worker's, not the trainer's)."""
        response = tapi.post("/v1/fine_tuning/jobs", json=job_body(training_file, integrations=[WANDB, MLFLOW]))
        assert response.status_code == 200, response.text
        assert validate(tracked[0], response.json()["id"]) == "queued"


class TestRefused:
    @pytest.mark.parametrize(
        ("integrations", "param"),
        [
            ([{"type": "wandb"}], "integrations.0.wandb"),
            ([{"type": "wandb", "wandb": {}}], "integrations.0.wandb.project"),
            ([{"type": "wandb", "wandb": {"project": 5}}], "integrations.0.wandb.project"),
            ([{"type": "wandb", "wandb": {"project": ""}}], "integrations.0.wandb.project"),
            ([{"type": "wandb", "wandb": {"project": "a/b"}}], "integrations.0.wandb.project"),
            ([{"type": "wandb", "wandb": {"project": "p" * 129}}], "integrations.0.wandb.project"),
            ([{"type": "wandb", "wandb": {"project": "p", "entity": ""}}], "integrations.0.wandb.entity"),
            ([{"type": "wandb", "wandb": {"project": "p", "tags": "rl"}}], "integrations.0.wandb.tags"),
            ([{"type": "wandb", "wandb": {"project": "p", "tags": ["t" * 65]}}], "integrations.0.wandb.tags"),
            ([{"type": "wandb", "wandb": {"project": "p", "tags": [1]}}], "integrations.0.wandb.tags.0"),
            # credentials are the deployment's: a key in the body is an unknown field, never used
            ([{"type": "wandb", "wandb": {"project": "p", "api_key": "k"}}], "integrations.0.wandb.api_key"),
            ([{"type": "wandb", "wandb": {"project": "p"}, "mlflow": {}}], "integrations.0.mlflow"),
            ([{"type": "comet", "comet": {"project": "p"}}], "integrations.0.type"),
            ([{"wandb": {"project": "p"}}], "integrations.0.type"),
            (["wandb"], "integrations.0"),
            ([{"type": "wandb", "wandb": "p"}], "integrations.0.wandb"),
            ([WANDB, {"type": "wandb", "wandb": {"project": "q"}}], "integrations.1.type"),
            ([{"type": "mlflow", "mlflow": {}}], "integrations.0.mlflow.experiment_name"),
            (
                [{"type": "mlflow", "mlflow": {"experiment_name": "e", "tags": {"a": 1}}}],
                "integrations.0.mlflow.tags.a",
            ),
            (
                [{"type": "mlflow", "mlflow": {"experiment_name": "e", "tags": {"mlflow.user": "x"}}}],
                "integrations.0.mlflow.tags",
            ),
            (
                [{"type": "mlflow", "mlflow": {"experiment_name": "e", "tags": {"a+b": "x"}}}],
                "integrations.0.mlflow.tags",
            ),
            (
                [{"type": "mlflow", "mlflow": {"experiment_name": "e", "tags": {"a//b": "x"}}}],
                "integrations.0.mlflow.tags",
            ),
            (
                [{"type": "mlflow", "mlflow": {"experiment_name": "e", "tracking_uri": "http://x"}}],
                "integrations.0.mlflow.tracking_uri",
            ),
            (
                [WANDB, {"type": "mlflow", "mlflow": {"experiment_name": "e", "run_name": ""}}],
                "integrations.1.mlflow.run_name",
            ),
            ({"type": "wandb"}, "integrations"),
        ],
    )
    def test_a_malformed_integration_is_a_400_naming_the_field_and_nothing_is_stored(
        self, tapi: httpx.Client, training_file: str, integrations: Any, param: str
    ) -> None:
        before = job_count(tapi)
        response = tapi.post("/v1/fine_tuning/jobs", json=job_body(training_file, integrations=integrations))
        error = assert_error(response, 400, param=param)
        assert error["message"].startswith(f"{param}: ")
        assert error["code"] in ("invalid_integrations", None)  # None: the body's own shape (a list expected)
        assert job_count(tapi) == before

    @pytest.mark.parametrize(
        ("integrations", "param", "tracker"),
        [
            ([WANDB], "integrations.0", "Weights & Biases"),
            ([MLFLOW], "integrations.0", "MLflow"),
        ],
    )
    def test_a_tracker_the_deployment_does_not_export_to_is_a_400_naming_the_integration(
        self, api: httpx.Client, training_file: str, integrations: Any, param: str, tracker: str
    ) -> None:
        before = job_count(api)
        response = api.post("/v1/fine_tuning/jobs", json=job_body(training_file, integrations=integrations))
        assert_error(
            response,
            400,
            param=param,
            code="integration_not_configured",
            message_contains=f"this deployment does not export to {tracker}",
        )
        assert job_count(api) == before


def test_wandb_counts_as_configured_with_a_key_or_in_offline_mode_and_mlflow_with_a_uri(tmp_path: Path) -> None:
    assert not configured(Settings(home=tmp_path), "wandb") and not configured(Settings(home=tmp_path), "mlflow")
    assert configured(Settings(home=tmp_path, wandb_api_key="k"), "wandb")
    assert not configured(Settings(home=tmp_path, wandb_api_key="", mlflow_tracking_uri=""), "wandb")  # `VAR=`
    assert not configured(Settings(home=tmp_path, wandb_api_key="", mlflow_tracking_uri=""), "mlflow")
    assert configured(Settings(home=tmp_path, wandb_mode="offline"), "wandb")
    assert configured(Settings(home=tmp_path, mlflow_tracking_uri="http://mlflow:5000"), "mlflow")
    assert not configured(Settings(home=tmp_path, mlflow_tracking_uri="http://mlflow:5000"), "wandb")

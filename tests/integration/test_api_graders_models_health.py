"""Grader dry-run and validation, ``/v1/models``, ``/healthz``, ``/readyz``, request ids and the docs."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient

from tests.integration.conftest import GRADER, assert_error, set_job

ERROR_FLAGS = {
    "formula_parse_error",
    "invalid_variable_error",
    "model_grader_parse_error",
    "model_grader_refusal_error",
    "model_grader_server_error",
    "model_grader_server_error_details",
    "other_error",
    "python_grader_runtime_error",
    "python_grader_runtime_error_details",
    "python_grader_server_error",
    "python_grader_server_error_type",
    "sample_parse_error",
    "truncated_observation_error",
    "unresponsive_reward_error",
}

MULTI = {
    "type": "multi",
    "name": "combo",
    "graders": {
        "exact": GRADER,
        "digits": {"type": "regex", "name": "digits", "input": "{{sample.output_text}}", "pattern": "^[0-9]+$"},
    },
    "calculate_output": "0.5 * exact + 0.5 * digits",
}


class TestGraderRun:
    def test_run_scores_a_sample_in_openai_shape(self, api: httpx.Client) -> None:
        r = api.post(
            "/v1/fine_tuning/alpha/graders/run", json={"grader": GRADER, "model_sample": "4", "item": {"answer": "4"}}
        )
        assert r.status_code == 200, r.text
        body = r.json()
        assert set(body) == {"reward", "metadata", "sub_rewards", "model_grader_token_usage_per_model"}
        assert body["reward"] == 1.0 and body["model_grader_token_usage_per_model"] == {}
        meta = body["metadata"]
        assert meta["name"] == "exact" and meta["type"] == "string_check"
        assert meta["token_usage"] is None and meta["sampled_model_name"] is None
        assert isinstance(meta["execution_time"], float) and meta["scores"] == {"exact": 1.0}
        assert set(meta["errors"]) == ERROR_FLAGS and not any(meta["errors"].values())

    def test_multi_grader_gives_sub_rewards(self, api: httpx.Client) -> None:
        body = api.post(
            "/v1/fine_tuning/alpha/graders/run", json={"grader": MULTI, "model_sample": "5", "item": {"answer": "4"}}
        ).json()
        assert body["reward"] == 0.5 and body["sub_rewards"] == {"exact": 0.0, "digits": 1.0}

    def test_missing_item_field_raises_the_invalid_variable_flag(self, api: httpx.Client) -> None:
        body = api.post("/v1/fine_tuning/alpha/graders/run", json={"grader": GRADER, "model_sample": "4"}).json()
        assert body["reward"] == 0.0 and body["metadata"]["errors"]["invalid_variable_error"] is True
        assert "answer" in body["metadata"]["error_messages"][0]

    @pytest.mark.parametrize(
        ("grader", "item", "flag"),
        [
            (GRADER, {}, "invalid_variable_error"),
            ({**MULTI, "calculate_output": "exact / digits"}, {"answer": "4"}, "formula_parse_error"),
            (
                {"type": "numeric_match", "name": "num", "input": "{{sample.output_text}}", "reference": "three"},
                {},
                "other_error",
            ),
        ],
    )
    def test_each_kind_of_grading_problem_raises_its_own_flag_only(
        self, api: httpx.Client, grader: dict[str, Any], item: dict[str, Any], flag: str
    ) -> None:
        body = api.post(
            "/v1/fine_tuning/alpha/graders/run", json={"grader": grader, "model_sample": "x", "item": item}
        ).json()
        raised = {name for name, value in body["metadata"]["errors"].items() if value}
        assert raised == {flag} and len(body["metadata"]["error_messages"]) == 1

    def test_a_flag_follows_the_problems_kind_not_its_wording(self, api: httpx.Client) -> None:
        # A formula failure whose message, through the grader's name, reads like a missing item field.
        grader = {**MULTI, "name": "a references {{item.b", "calculate_output": "exact / 0"}
        body = api.post(
            "/v1/fine_tuning/alpha/graders/run", json={"grader": grader, "model_sample": "4", "item": {"answer": "4"}}
        ).json()
        assert body["metadata"]["error_messages"] == [
            "grader 'a references {{item.b': calculate_output 'exact / 0' failed (float division by zero); scored 0.0"
        ]
        raised = {name for name, value in body["metadata"]["errors"].items() if value}
        assert raised == {"formula_parse_error"}

    def test_the_400_names_the_first_bad_field_of_a_nested_grader(self, api: httpx.Client) -> None:
        bad = {**MULTI, "graders": {"exact": {**GRADER, "operation": "equals"}, "digits": {"type": "regex"}}}
        r = api.post("/v1/fine_tuning/alpha/graders/validate", json={"grader": bad})
        assert_error(r, 400, param="grader.graders.exact.operation", code="invalid_grader")

    def test_invalid_grader_is_a_400_naming_the_field(self, api: httpx.Client) -> None:
        r = api.post(
            "/v1/fine_tuning/alpha/graders/run", json={"grader": {**GRADER, "operation": "equals"}, "model_sample": "4"}
        )
        assert_error(r, 400, param="grader.operation", code="invalid_grader")

    def test_unknown_body_field_or_missing_sample_is_a_400(self, api: httpx.Client) -> None:
        r = api.post("/v1/fine_tuning/alpha/graders/run", json={"grader": GRADER, "model_sample": "4", "x": 1})
        assert_error(r, 400, param="x")
        assert_error(api.post("/v1/fine_tuning/alpha/graders/run", json={"grader": GRADER}), 400, param="model_sample")


class TestGraderValidate:
    def test_valid_grader_is_returned(self, api: httpx.Client) -> None:
        r = api.post("/v1/fine_tuning/alpha/graders/validate", json={"grader": MULTI})
        assert r.status_code == 200 and r.json()["grader"]["graders"]["exact"] == GRADER

    def test_invalid_grader_is_a_400(self, api: httpx.Client) -> None:
        r = api.post("/v1/fine_tuning/alpha/graders/validate", json={"grader": {"type": "lua", "name": "p"}})
        assert_error(r, 400, param="grader.type", code="invalid_grader")


class TestModels:
    def test_base_models_and_the_tenants_fine_tuned_models(
        self, api: httpx.Client, api_b: httpx.Client, queued_job: dict[str, Any], db: Callable[[], Any]
    ) -> None:
        body = api.get("/v1/models").json()
        assert body["object"] == "list"
        assert {"id": "tiny-arith", "object": "model", "created": 0, "owned_by": "proxima"} in body["data"]
        name = f"ft:tiny-arith:x::{queued_job['id'].removeprefix('ftjob-')}"
        set_job(db, queued_job["id"], status="succeeded", fine_tuned_model=name, finished_at=1234)
        ids = [m["id"] for m in api.get("/v1/models").json()["data"]]
        assert ids[0] == "tiny-arith" and name in ids
        assert api.get(f"/v1/models/{name}").json()["owned_by"] == queued_job["organization_id"]
        assert name not in [m["id"] for m in api_b.get("/v1/models").json()["data"]]
        assert_error(api_b.get(f"/v1/models/{name}"), 404)


class TestHealth:
    def test_healthz_and_readyz_are_ok(self, anon: httpx.Client) -> None:
        assert anon.get("/healthz").json() == {"status": "ok", "checks": {}}
        ready = anon.get("/readyz")
        assert ready.status_code == 200 and ready.json()["checks"] == {"database": "ok", "broker": "ok", "store": "ok"}

    @pytest.mark.parametrize("broken", ["database", "broker"])
    def test_readyz_is_503_with_the_envelope_when_a_backend_is_down(self, settings: Any, broken: str) -> None:
        from api.app import create_app

        if broken == "database":
            bad = settings.model_copy(update={"database_url": "postgresql+psycopg2://postgres@127.0.0.1:1/nope"})
        else:
            bad = settings.model_copy(update={"broker_url": "redis://127.0.0.1:1/0"})
        with TestClient(create_app(bad), raise_server_exceptions=False) as client:
            error = assert_error(client.get("/readyz"), 503, code="not_ready")
            assert error["message"].startswith(f"not ready: {broken}:")
            assert client.get("/healthz").status_code == 200

    def test_request_id_is_echoed_or_generated(self, anon: httpx.Client) -> None:
        assert anon.get("/healthz", headers={"x-request-id": "abc-123"}).headers["x-request-id"] == "abc-123"
        made = anon.get("/healthz").headers["x-request-id"]
        assert made.startswith("req_") and made != anon.get("/healthz").headers["x-request-id"]

    def test_request_id_is_in_log_records(self, settings: Any, caplog: pytest.LogCaptureFixture) -> None:
        from api.app import create_app

        with TestClient(create_app(settings)) as client, caplog.at_level("INFO", logger="proxima.api.access"):
            client.get("/healthz", headers={"x-request-id": "trace-me"})
        assert any(
            getattr(r, "request_id", None) == "trace-me" and "/healthz" in r.getMessage() for r in caplog.records
        )

    def test_a_request_slower_than_the_threshold_is_a_warning_naming_its_request_id(
        self, settings: Any, caplog: pytest.LogCaptureFixture
    ) -> None:
        from api.app import create_app

        def warnings() -> list[str]:
            # this test's two requests only: other apps of this process (servers of other test modules, whose
            # clients may still poll) log to the same logger
            return [
                m
                for r in caplog.records
                if r.levelname == "WARNING"
                and (m := r.getMessage()).startswith(("slow request quick", "slow request slow-one"))
            ]

        with caplog.at_level("WARNING", logger="proxima.api.access"):
            with TestClient(create_app(settings)) as client:  # the default threshold: 1 s
                client.get("/healthz", headers={"x-request-id": "quick"})
            assert warnings() == []
            with TestClient(create_app(settings.model_copy(update={"slow_request_ms": 1e-6}))) as client:
                client.get("/healthz", headers={"x-request-id": "slow-one"})
        [message] = warnings()
        assert message.startswith("slow request slow-one: GET /healthz 200 "), message

    def test_openapi_docs_are_served(self, anon: httpx.Client) -> None:
        assert anon.get("/docs").status_code == 200
        paths = anon.get("/openapi.json").json()["paths"]
        assert "/v1/fine_tuning/jobs/{fine_tuning_job_id}/checkpoints/{checkpoint_id}/adapter" in paths


def test_broker_down_leaves_the_job_waiting_for_the_sweeper(settings: Any, tenant_a: Any, training_file: str) -> None:
    from api.app import create_app

    bad = settings.model_copy(update={"broker_url": "redis://127.0.0.1:1/0"})
    with TestClient(create_app(bad), raise_server_exceptions=False) as client:
        r = client.post(
            "/v1/fine_tuning/jobs",
            json={
                "model": "tiny-arith",
                "training_file": training_file,
                "method": {"type": "grpo", "grpo": {"grader": GRADER}},
            },
            headers={"authorization": f"Bearer {tenant_a.key}"},
        )
    assert r.status_code == 200, r.text
    assert r.json()["status"] == "validating_files"

"""``/v1/fine_tuning/jobs`` over HTTP without a worker: create, enqueue, list, control, read outputs; the files'
validation that a worker runs (``worker.validation``) is called here as the task would call it."""

from __future__ import annotations

import secrets
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from tests.integration.conftest import (
    GRADER,
    add_checkpoint,
    assert_error,
    job_body,
    jsonl,
    prompts,
    set_job,
    upload,
    validate,
)

JOB_FIELDS = {
    "id",
    "object",
    "model",
    "created_at",
    "finished_at",
    "estimated_finish",
    "fine_tuned_model",
    "organization_id",
    "status",
    "training_file",
    "validation_file",
    "result_files",
    "trained_tokens",
    "hyperparameters",
    "method",
    "integrations",
    "seed",
    "metadata",
    "error",
    "suffix",
    "current_step",
    "total_steps",
    "resources",
}


def events(api: httpx.Client, job_id: str, **params: Any) -> dict[str, Any]:
    r = api.get(f"/v1/fine_tuning/jobs/{job_id}/events", params=params)
    assert r.status_code == 200, r.text
    return r.json()  # type: ignore[no-any-return]


class TestCreate:
    def test_valid_job_answers_validating_files_at_once_enqueued_and_shaped_like_openai(
        self,
        api: httpx.Client,
        training_file: str,
        tenant_a: Any,
        queue_length: Callable[[], int],
        db: Callable[[], Any],
    ) -> None:
        before = queue_length()
        val = upload(api, jsonl(prompts(2)), filename="val.jsonl").json()["id"]
        body = job_body(training_file, validation_file=val, suffix="arith", seed=7, metadata={"team": "a"})
        r = api.post("/v1/fine_tuning/jobs", json=body)
        assert r.status_code == 200, r.text
        job = r.json()
        assert set(job) == JOB_FIELDS
        assert job["object"] == "fine_tuning.job" and job["id"].startswith("ftjob-")
        assert job["status"] == "validating_files" and job["error"] is None and job["finished_at"] is None
        assert job["model"] == "tiny-arith" and job["organization_id"] == tenant_a.id
        assert job["training_file"] == training_file and job["validation_file"] == val
        assert job["seed"] == 7 and job["suffix"] == "arith" and job["metadata"] == {"team": "a"}
        assert job["result_files"] == [] and job["integrations"] == [] and job["fine_tuned_model"] is None
        assert job["hyperparameters"] == {"n_epochs": 1, "batch_size": 2, "learning_rate_multiplier": 1.0}
        assert job["method"]["type"] == "grpo"
        assert job["method"]["grpo"]["grader"] == GRADER
        assert job["method"]["grpo"]["hyperparameters"]["group_size"] == 2
        assert job["current_step"] == 0
        assert queue_length() == before + 1
        from api.orm import Job

        with db() as s:
            assert s.get(Job, job["id"]).enqueued_at is not None
        assert [e["message"] for e in events(api, job["id"])["data"]] == ["Created fine-tuning job"]

    def test_valid_files_validated_by_the_worker_queue_the_job(
        self, api: httpx.Client, training_file: str, settings: Any, db: Callable[[], Any]
    ) -> None:
        val = upload(api, jsonl(prompts(2)), filename="val.jsonl").json()["id"]
        job = api.post("/v1/fine_tuning/jobs", json=job_body(training_file, validation_file=val)).json()
        assert validate(settings, job["id"]) == "queued"
        got = api.get(f"/v1/fine_tuning/jobs/{job['id']}").json()
        assert got["status"] == "queued" and got["error"] is None and got["finished_at"] is None
        assert [e["message"] for e in events(api, job["id"])["data"]] == [
            "Validated files; job queued",
            "Created fine-tuning job",
        ]
        from api.orm import Job

        with db() as s:
            row = s.get(Job, job["id"])
            assert row.lease_owner is None and row.lease_expires_at is None and row.attempts == 0
        assert validate(settings, job["id"]) == "skipped"  # validated once: a redelivered message does nothing

    def test_openai_reinforcement_method_and_top_level_hyperparameters_are_accepted(
        self, api: httpx.Client, training_file: str
    ) -> None:
        body = {
            "model": "tiny-arith",
            "training_file": training_file,
            "hyperparameters": {"n_epochs": 2, "batch_size": "auto"},
            "integrations": [],
            "method": {"type": "reinforcement", "reinforcement": {"grader": GRADER}},
        }
        r = api.post("/v1/fine_tuning/jobs", json=body)
        assert r.status_code == 200, r.text
        job = r.json()
        assert job["method"]["type"] == "reinforcement" and job["hyperparameters"]["n_epochs"] == 2
        assert job["method"]["reinforcement"]["hyperparameters"]["beta"] == 0.04  # grpo's defaults
        assert isinstance(job["seed"], int)

    def test_dataset_not_fitting_the_method_is_accepted_then_fails_validation_naming_file_and_line(
        self, api: httpx.Client, queue_length: Callable[[], int], settings: Any
    ) -> None:
        rows = [*prompts(2), {"text": "no prompt here"}, *prompts(1)]
        file_id = upload(api, jsonl(rows)).json()["id"]
        before = queue_length()
        r = api.post("/v1/fine_tuning/jobs", json=job_body(file_id))
        assert r.status_code == 200, r.text
        assert r.json()["status"] == "validating_files" and r.json()["error"] is None
        assert queue_length() == before + 1  # the request read no line of the file: a worker will
        assert validate(settings, r.json()["id"]) == "failed"
        job = api.get(f"/v1/fine_tuning/jobs/{r.json()['id']}").json()
        message = f"training file {file_id}, line 3: no prompt: expected a 'messages' list or a 'prompt' string"
        assert job["status"] == "failed" and job["finished_at"] is not None
        assert job["error"] == {"code": "invalid_file", "message": message, "param": "training_file"}
        newest = events(api, job["id"])["data"][0]
        assert newest["level"] == "error" and newest["message"] == f"The job failed: {message}"

    def test_item_missing_a_grader_field_fails_validation_naming_the_line(
        self, api: httpx.Client, settings: Any
    ) -> None:
        rows = [*prompts(1), {"prompt": "What is 1 + 1?"}]  # no `answer` for {{item.answer}}
        file_id = upload(api, jsonl(rows)).json()["id"]
        job_id = api.post("/v1/fine_tuning/jobs", json=job_body(file_id)).json()["id"]
        assert validate(settings, job_id) == "failed"
        job = api.get(f"/v1/fine_tuning/jobs/{job_id}").json()
        assert job["status"] == "failed"
        assert job["error"]["message"] == (
            f"training file {file_id}, line 2: grader 'exact' references {{{{item.answer}}}} but the item has no "
            "field 'answer'"
        )

    def test_bad_validation_file_fails_validation_naming_the_validation_file(
        self, api: httpx.Client, training_file: str, settings: Any
    ) -> None:
        val = upload(api, jsonl([{"messages": []}])).json()["id"]
        job_id = api.post("/v1/fine_tuning/jobs", json=job_body(training_file, validation_file=val)).json()["id"]
        assert validate(settings, job_id) == "failed"
        job = api.get(f"/v1/fine_tuning/jobs/{job_id}").json()
        assert job["status"] == "failed"
        assert job["error"] == {
            "code": "invalid_file",
            "message": f"validation file {val}, line 1: 'messages' must be a non-empty list of messages",
            "param": "validation_file",
        }

    @pytest.mark.parametrize(
        ("change", "param", "code"),
        [
            ({"model": "gpt-4o"}, "model", "model_not_available"),
            ({"training_file": "file-missing"}, "training_file", "file_not_found"),
            ({"validation_file": "file-missing"}, "validation_file", "file_not_found"),
            ({"colour": "blue"}, "colour", None),
            ({"integrations": [{"type": "wandb"}]}, "integrations.0.wandb", "invalid_integrations"),
            ({"seed": "seven"}, "seed", None),
            ({"metadata": {str(i): "v" for i in range(17)}}, "metadata", "invalid_spec"),
        ],
    )
    def test_bad_request_fields_are_400s_naming_the_field(
        self, api: httpx.Client, training_file: str, change: dict[str, Any], param: str, code: str | None
    ) -> None:
        r = api.post("/v1/fine_tuning/jobs", json={**job_body(training_file), **change})
        assert_error(r, 400, param=param, **({"code": code} if code else {}))

    @pytest.mark.parametrize(
        ("method", "param"),
        [
            (
                {"type": "grpo", "grpo": {"grader": GRADER, "hyperparameters": {"lr_typo": 1}}},
                "method.grpo.hyperparameters.lr_typo",
            ),
            ({"type": "grpo", "dpo": {"grader": GRADER}}, "method.dpo"),
            ({"type": "grpo"}, "method.grpo"),
            ({"type": "sft", "sft": {}}, "method.type"),
            ({"type": "grpo", "grpo": {"grader": {**GRADER, "operation": "equals"}}}, "method.grpo.grader"),
            (
                {"type": "grpo", "grpo": {"grader": GRADER, "hyperparameters": {"group_size": 1}}},
                "method.grpo.hyperparameters.group_size",
            ),
            (
                {"type": "grpo", "grpo": {"grader": GRADER, "hyperparameters": {"learning_rate": -1}}},
                "method.grpo.hyperparameters.learning_rate",
            ),
            ({"type": "dpo", "dpo": {"grader": GRADER}}, "method.dpo.grader"),  # preference methods have no grader
            ({"type": "ppo", "ppo": {"hyperparameters": {}}}, "method.ppo.grader"),
            (
                {"type": "ppo", "ppo": {"grader": GRADER, "hyperparameters": {"lam": 1.5}}},
                "method.ppo.hyperparameters.lam",
            ),
            (
                {"type": "ppo", "ppo": {"grader": GRADER, "hyperparameters": {"value_model": "gpt-17"}}},
                "method.ppo.hyperparameters.value_model",
            ),
            (
                {"type": "dpo", "dpo": {"hyperparameters": {"label_smoothing": 0.5}}},
                "method.dpo.hyperparameters.label_smoothing",
            ),
        ],
    )
    def test_bad_method_is_a_400_naming_the_field(
        self, api: httpx.Client, training_file: str, method: dict[str, Any], param: str
    ) -> None:
        r = api.post("/v1/fine_tuning/jobs", json=job_body(training_file, method=method))
        assert_error(r, 400, param=param)

    def test_missing_method_is_a_400(self, api: httpx.Client, training_file: str) -> None:
        r = api.post("/v1/fine_tuning/jobs", json={"model": "tiny-arith", "training_file": training_file})
        assert_error(r, 400, param="method")

    def test_file_of_the_wrong_purpose_is_a_400(
        self, api: httpx.Client, db: Callable[[], Any], training_file: str
    ) -> None:
        from api.orm import File

        with db() as s:
            s.query(File).filter(File.id == training_file).update({"purpose": "fine-tune-results"})
        r = api.post("/v1/fine_tuning/jobs", json=job_body(training_file))
        assert_error(r, 400, param="training_file", code="invalid_file_purpose")

    def test_an_evals_file_is_not_a_dataset_a_400(self, api: httpx.Client) -> None:
        evals_file = upload(api, jsonl(prompts(2)), purpose="evals")
        assert evals_file.status_code == 200, evals_file.text  # an eval run's rows: uploaded as OpenAI takes them
        r = api.post("/v1/fine_tuning/jobs", json=job_body(evals_file.json()["id"]))
        assert_error(r, 400, param="training_file", code="invalid_file_purpose")

    def test_deleted_file_is_a_400(self, api: httpx.Client, training_file: str) -> None:
        api.delete(f"/v1/files/{training_file}")
        assert_error(api.post("/v1/fine_tuning/jobs", json=job_body(training_file)), 400, param="training_file")

    def test_body_that_is_not_json_is_a_400(self, api: httpx.Client) -> None:
        r = api.post("/v1/fine_tuning/jobs", content=b"{oops", headers={"content-type": "application/json"})
        assert_error(r, 400)


class TestListAndRetrieve:
    def test_list_is_newest_first_paginated_and_filters_by_metadata(
        self, api: httpx.Client, training_file: str
    ) -> None:
        tag = secrets.token_hex(4)
        made = [
            api.post("/v1/fine_tuning/jobs", json=job_body(training_file, metadata={"run": tag, "i": str(i)})).json()[
                "id"
            ]
            for i in range(3)
        ]
        bare = api.post("/v1/fine_tuning/jobs", json=job_body(training_file)).json()["id"]

        tagged = api.get("/v1/fine_tuning/jobs", params={"metadata[run]": tag}).json()
        assert tagged["object"] == "list" and tagged["has_more"] is False
        assert {j["id"] for j in tagged["data"]} == set(made)
        created = [j["created_at"] for j in tagged["data"]]
        assert created == sorted(created, reverse=True)

        one = api.get("/v1/fine_tuning/jobs", params={"metadata[run]": tag, "metadata[i]": "1"}).json()
        assert [j["id"] for j in one["data"]] == [made[1]]
        assert api.get("/v1/fine_tuning/jobs", params={"metadata[run]": "nope"}).json()["data"] == []

        nulls = api.get("/v1/fine_tuning/jobs", params={"metadata": "null", "limit": 1000}).json()["data"]
        assert bare in {j["id"] for j in nulls} and not set(made) & {j["id"] for j in nulls}

        page1 = api.get("/v1/fine_tuning/jobs", params={"metadata[run]": tag, "limit": 2}).json()
        assert len(page1["data"]) == 2 and page1["has_more"] is True
        page2 = api.get(
            "/v1/fine_tuning/jobs", params={"metadata[run]": tag, "limit": 2, "after": page1["data"][-1]["id"]}
        ).json()
        assert page2["has_more"] is False
        assert [j["id"] for j in page1["data"] + page2["data"]] == [j["id"] for j in tagged["data"]]

    def test_bad_list_parameters_are_400s(self, api: httpx.Client) -> None:
        assert_error(api.get("/v1/fine_tuning/jobs", params={"limit": 0}), 400, param="limit")
        assert_error(api.get("/v1/fine_tuning/jobs", params={"after": "ftjob-nope"}), 400, param="after")
        assert_error(api.get("/v1/fine_tuning/jobs", params={"metadata": "x"}), 400, param="metadata")

    def test_retrieve_returns_the_job_and_unknown_is_404(self, api: httpx.Client, queued_job: dict[str, Any]) -> None:
        got = api.get(f"/v1/fine_tuning/jobs/{queued_job['id']}").json()
        assert got == queued_job
        assert_error(api.get("/v1/fine_tuning/jobs/ftjob-nope"), 404, code="not_found")


class TestEvents:
    def test_events_are_newest_first_with_pagination(self, api: httpx.Client, queued_job: dict[str, Any]) -> None:
        job_id = queued_job["id"]
        api.post(f"/v1/fine_tuning/jobs/{job_id}/pause")
        api.post(f"/v1/fine_tuning/jobs/{job_id}/resume")
        listed = events(api, job_id)
        messages = [e["message"] for e in listed["data"]]
        assert messages[-2:] == ["Validated files; job queued", "Created fine-tuning job"]
        assert messages[0].startswith("Fine-tuning job resumed")
        first = listed["data"][0]
        assert set(first) == {"id", "object", "created_at", "level", "message", "type", "data"}
        assert first["object"] == "fine_tuning.job.event" and first["id"].startswith("ftevent-")
        assert first["level"] == "info" and first["type"] == "message"

        page1 = events(api, job_id, limit=2)
        assert page1["has_more"] is True and len(page1["data"]) == 2
        rest = events(api, job_id, after=page1["data"][-1]["id"], limit=100)
        assert rest["has_more"] is False
        assert [e["id"] for e in page1["data"] + rest["data"]] == [e["id"] for e in listed["data"]]

    def test_unknown_event_cursor_is_a_400(self, api: httpx.Client, queued_job: dict[str, Any]) -> None:
        r = api.get(f"/v1/fine_tuning/jobs/{queued_job['id']}/events", params={"after": "ftevent-nope"})
        assert_error(r, 400, param="after")


class TestControl:
    def test_cancel_a_queued_job_cancels_it_now(self, api: httpx.Client, queued_job: dict[str, Any]) -> None:
        r = api.post(f"/v1/fine_tuning/jobs/{queued_job['id']}/cancel")
        assert r.status_code == 200, r.text
        job = r.json()
        assert job["status"] == "cancelled" and job["finished_at"] is not None
        assert events(api, job["id"])["data"][0]["message"] == "Fine-tuning job cancelled"
        again = api.post(f"/v1/fine_tuning/jobs/{queued_job['id']}/cancel")
        assert_error(again, 409, code="job_not_cancellable")
        assert again.headers["x-should-retry"] == "false"

    def test_cancel_a_running_job_asks_the_worker(
        self, api: httpx.Client, queued_job: dict[str, Any], db: Callable[[], Any]
    ) -> None:
        from api.orm import Job

        set_job(db, queued_job["id"], status="running")
        job = api.post(f"/v1/fine_tuning/jobs/{queued_job['id']}/cancel").json()
        assert job["status"] == "running"
        with db() as s:
            assert s.get(Job, queued_job["id"]).cancel_requested is True
        assert events(api, job["id"])["data"][0]["message"].startswith("Cancellation requested")

    @pytest.mark.parametrize("status", ["succeeded", "failed", "cancelled"])
    def test_control_of_a_finished_job_is_a_409(
        self, api: httpx.Client, queued_job: dict[str, Any], db: Callable[[], Any], status: str
    ) -> None:
        set_job(db, queued_job["id"], status=status)
        for action, code in (
            ("cancel", "job_not_cancellable"),
            ("pause", "job_not_pausable"),
            ("resume", "job_not_paused"),
        ):
            assert_error(api.post(f"/v1/fine_tuning/jobs/{queued_job['id']}/{action}"), 409, code=code)

    def test_pause_and_resume_a_queued_job(
        self, api: httpx.Client, queued_job: dict[str, Any], queue_length: Callable[[], int]
    ) -> None:
        job_id = queued_job["id"]
        paused = api.post(f"/v1/fine_tuning/jobs/{job_id}/pause").json()
        assert paused["status"] == "paused"
        assert api.post(f"/v1/fine_tuning/jobs/{job_id}/pause").json()["status"] == "paused"  # idempotent
        before = queue_length()
        resumed = api.post(f"/v1/fine_tuning/jobs/{job_id}/resume").json()
        assert resumed["status"] == "queued"
        assert queue_length() == before + 1
        assert_error(api.post(f"/v1/fine_tuning/jobs/{job_id}/resume"), 409, code="job_not_paused")

    def test_pause_a_running_job_asks_the_worker_and_resume_withdraws_it(
        self, api: httpx.Client, queued_job: dict[str, Any], db: Callable[[], Any]
    ) -> None:
        from api.orm import Job

        job_id = queued_job["id"]
        set_job(db, job_id, status="running")
        assert api.post(f"/v1/fine_tuning/jobs/{job_id}/pause").json()["status"] == "running"
        with db() as s:
            assert s.get(Job, job_id).pause_requested is True
        assert api.post(f"/v1/fine_tuning/jobs/{job_id}/resume").json()["status"] == "running"
        with db() as s:
            assert s.get(Job, job_id).pause_requested is False

    def test_cancel_a_paused_job_cancels_it_now(self, api: httpx.Client, queued_job: dict[str, Any]) -> None:
        api.post(f"/v1/fine_tuning/jobs/{queued_job['id']}/pause")
        assert api.post(f"/v1/fine_tuning/jobs/{queued_job['id']}/cancel").json()["status"] == "cancelled"


class TestOutputs:
    def test_checkpoints_newest_first_shaped_like_openai(
        self,
        api: httpx.Client,
        queued_job: dict[str, Any],
        db: Callable[[], Any],
        artifact_store: Any,
        tenant_a: Any,
    ) -> None:
        job_id = queued_job["id"]
        ids = [add_checkpoint(db, artifact_store, job_id, step) for step in (10, 20, 30)]
        listed = api.get(f"/v1/fine_tuning/jobs/{job_id}/checkpoints").json()
        assert listed["object"] == "list" and listed["has_more"] is False
        assert [c["id"] for c in listed["data"]] == ids[::-1]
        assert listed["first_id"] == ids[2] and listed["last_id"] == ids[0]
        top = listed["data"][0]
        assert set(top) == {
            "id",
            "object",
            "created_at",
            "fine_tuned_model_checkpoint",
            "fine_tuning_job_id",
            "step_number",
            "metrics",
        }
        assert top["object"] == "fine_tuning.job.checkpoint" and top["step_number"] == 30
        assert top["fine_tuning_job_id"] == job_id
        assert top["metrics"] == {"step": 30.0, "reward/mean": 3.0, "train_reward_mean": 3.0}  # OpenAI's RFT name too
        short = job_id.removeprefix("ftjob-")
        assert top["fine_tuned_model_checkpoint"] == f"ft:tiny-arith:{tenant_a.id}::{short}:ckpt-step-30"

        page = api.get(f"/v1/fine_tuning/jobs/{job_id}/checkpoints", params={"limit": 1, "after": ids[2]}).json()
        assert [c["id"] for c in page["data"]] == [ids[1]] and page["has_more"] is True

    def test_adapter_download_streams_the_archive(
        self, api: httpx.Client, queued_job: dict[str, Any], db: Callable[[], Any], artifact_store: Any
    ) -> None:
        payload = secrets.token_bytes(3 * 1024 * 1024 + 17)  # over one streaming chunk
        ckpt = add_checkpoint(db, artifact_store, queued_job["id"], 5, archive=payload)
        r = api.get(f"/v1/fine_tuning/jobs/{queued_job['id']}/checkpoints/{ckpt}/adapter")
        assert r.status_code == 200 and r.content == payload
        assert r.headers["content-type"] == "application/gzip"
        assert "step-5-adapter.tar.gz" in r.headers["content-disposition"]

    def test_adapter_of_unknown_or_missing_checkpoint_is_a_404(
        self, api: httpx.Client, queued_job: dict[str, Any], db: Callable[[], Any], artifact_store: Any
    ) -> None:
        job_id = queued_job["id"]
        assert_error(api.get(f"/v1/fine_tuning/jobs/{job_id}/checkpoints/ftckpt_nope/adapter"), 404)
        bare = add_checkpoint(db, artifact_store, job_id, 1, archive=None)
        assert_error(api.get(f"/v1/fine_tuning/jobs/{job_id}/checkpoints/{bare}/adapter"), 404)

    def test_metrics_series_by_step_with_after_step(
        self, api: httpx.Client, queued_job: dict[str, Any], db: Callable[[], Any]
    ) -> None:
        from api.orm import JobMetric

        job_id = queued_job["id"]
        with db() as s:
            for step in (3, 1, 2):
                s.add(JobMetric(job_id=job_id, step=step, values={"reward/mean": step / 4, "kl/mean": 0.01}))
        series = api.get(f"/v1/fine_tuning/jobs/{job_id}/metrics").json()
        assert series["object"] == "list" and series["has_more"] is False
        assert [p["step"] for p in series["data"]] == [1, 2, 3]
        assert series["data"][0]["metrics"] == {"reward/mean": 0.25, "kl/mean": 0.01}
        later = api.get(f"/v1/fine_tuning/jobs/{job_id}/metrics", params={"after_step": 1}).json()
        assert [p["step"] for p in later["data"]] == [2, 3]
        first = api.get(f"/v1/fine_tuning/jobs/{job_id}/metrics", params={"limit": 1}).json()
        assert [p["step"] for p in first["data"]] == [1] and first["has_more"] is True

    def test_rollouts_latest_step_by_default_or_the_step_asked(
        self, api: httpx.Client, queued_job: dict[str, Any], db: Callable[[], Any]
    ) -> None:
        from api.orm import Rollout

        job_id = queued_job["id"]
        empty = api.get(f"/v1/fine_tuning/jobs/{job_id}/rollouts").json()
        assert empty == {"object": "list", "data": [], "has_more": False, "step": None, "steps": []}
        with db() as s:
            for step in (1, 2):
                for k in range(2):
                    s.add(
                        Rollout(
                            job_id=job_id, step=step, data={"prompt": f"p{k}", "completion": "4", "reward": float(k)}
                        )
                    )
        latest = api.get(f"/v1/fine_tuning/jobs/{job_id}/rollouts").json()
        assert latest["step"] == 2 and latest["steps"] == [1, 2]
        assert latest["data"][0] == {
            "object": "fine_tuning.job.rollout",
            "step": 2,
            "prompt": "p0",
            "completion": "4",
            "reward": 0.0,
        }
        assert api.get(f"/v1/fine_tuning/jobs/{job_id}/rollouts", params={"step": 1}).json()["step"] == 1
        assert_error(api.get(f"/v1/fine_tuning/jobs/{job_id}/rollouts", params={"step": 9}), 404)


class TestNoServerErrors:
    """Odd input of every kind is a 4xx with the envelope (the autouse fixture fails the test on any 5xx)."""

    @pytest.mark.parametrize(
        "change",
        [
            {"seed": 2**40},
            {"seed": -1},
            {"suffix": "s" * 65},
            {"metadata": {"k" * 65: "v"}},
            {"metadata": {"k": "v" * 513}},
            {"metadata": {"k": 1}},
            {"method": "grpo"},
            {"method": {"type": 3}},
            {"method": {"type": "grpo", "grpo": []}},
            {"method": {"type": "grpo", "grpo": {"grader": []}}},
            {"method": {"type": "grpo", "grpo": {"grader": GRADER, "hyperparameters": []}}},
            {"method": {"type": "grpo", "grpo": {"grader": GRADER, "lora": {"r": 0}}}},
            {
                "hyperparameters": {"n_epochs": 2},
                "method": {"type": "grpo", "grpo": {"grader": GRADER, "hyperparameters": {"x": 1}}},
            },
            {"hyperparameters": {"n_epochs": 2}, "method": None},
            {"model": ""},
            {"model": "m" * 300},
            {"training_file": "f" * 200},
        ],
    )
    def test_odd_job_bodies_are_400s(self, api: httpx.Client, training_file: str, change: dict[str, Any]) -> None:
        assert_error(api.post("/v1/fine_tuning/jobs", json={**job_body(training_file), **change}), 400)

    def test_non_object_body_is_a_400(self, api: httpx.Client) -> None:
        assert_error(api.post("/v1/fine_tuning/jobs", json=[1, 2]), 400)

    def test_overlong_file_name_is_a_400(self, api: httpx.Client) -> None:
        assert_error(upload(api, jsonl(prompts(1)), filename="n" * 600 + ".jsonl"), 400, param="file")

    @pytest.mark.parametrize("params", [{"after_step": 10**30}, {"limit": 10**30}, {"after_step": "x"}, {"limit": -1}])
    def test_odd_metrics_queries_are_400s(
        self, api: httpx.Client, queued_job: dict[str, Any], params: dict[str, Any]
    ) -> None:
        assert_error(api.get(f"/v1/fine_tuning/jobs/{queued_job['id']}/metrics", params=params), 400)

    def test_odd_rollout_step_is_a_400(self, api: httpx.Client, queued_job: dict[str, Any]) -> None:
        assert_error(api.get(f"/v1/fine_tuning/jobs/{queued_job['id']}/rollouts", params={"step": 10**30}), 400)

    def test_very_long_ids_are_404s(self, api: httpx.Client) -> None:
        assert_error(api.get("/v1/files/" + "f" * 5000), 404)
        assert_error(api.get("/v1/fine_tuning/jobs/" + "j" * 5000 + "/events"), 404)

"""Values a request or a dataset may hold, over HTTP against the real app and
PostgreSQL: a NUL, a lone surrogate, NaN, infinity, a number out of its range, a huge integer or deep nesting is a
400 naming where it is, and nothing reaches the database, the queue or the trainer."""

from __future__ import annotations

import json
import secrets
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from tests.integration.conftest import GRADER, Tenant, assert_error, job_body, jsonl, prompts, upload, validate

JOBS = "/v1/fine_tuning/jobs"


def post_json(client: httpx.Client, path: str, body: Any) -> httpx.Response:
    """POST ``body`` as Python's JSON encoder writes it: lone surrogates escaped (``"\\ud800"``), NaN and Infinity
    as the bare words Python's parser reads back (httpx's own encoder would refuse both)."""
    return client.post(path, content=json.dumps(body).encode(), headers={"content-type": "application/json"})


def tenant_jobs(db: Callable[[], Any], tenant: Tenant) -> int:
    from api.orm import Job

    with db() as s:
        return int(s.query(Job).filter(Job.tenant_id == tenant.id).count())


def grpo(hyperparameters: dict[str, Any] | None = None, **block: Any) -> dict[str, Any]:
    hp = {"batch_size": 2, "group_size": 2, **(hyperparameters or {})}
    return {"type": "grpo", "grpo": {"grader": GRADER, "hyperparameters": hp, **block}}


@pytest.fixture
def nothing_stored(db: Callable[[], Any], tenant_a: Tenant, queue_length: Callable[[], int]) -> Callable[[], None]:
    """Call at the end of a test: no job row and no queue message appeared since the fixture was set up."""
    jobs, queued = tenant_jobs(db, tenant_a), queue_length()

    def check() -> None:
        assert tenant_jobs(db, tenant_a) == jobs
        assert queue_length() == queued

    return check


# ---------------------------------------------------------------------------------------------------------------
# Strings the database cannot hold or the answer cannot encode


class TestStrings:
    def test_nul_in_metadata_is_a_400_and_the_tenants_metadata_filter_still_works(
        self, api: httpx.Client, training_file: str, nothing_stored: Callable[[], None]
    ) -> None:
        key = f"k{secrets.token_hex(3)}"
        r = post_json(api, JOBS, job_body(training_file, metadata={key: "a\x00b"}))
        assert_error(r, 400, param=f"metadata.{key}", message_contains="NUL")
        nothing_stored()
        # Once such a value was stored, PostgreSQL could not extract it again: this filter answered 500 for good.
        r = api.get(JOBS, params={f"metadata[{key}]": "a"})
        assert r.status_code == 200 and r.json()["data"] == [], r.text
        made = api.post(JOBS, json=job_body(training_file, metadata={key: "a"}))
        assert made.status_code == 200, made.text
        assert [j["id"] for j in api.get(JOBS, params={f"metadata[{key}]": "a"}).json()["data"]] == [made.json()["id"]]

    @pytest.mark.parametrize("key", ["body", "query"])
    def test_a_metadata_key_named_like_a_request_part_stays_in_the_param(
        self, api: httpx.Client, training_file: str, key: str
    ) -> None:
        r = post_json(api, JOBS, job_body(training_file, metadata={key: "a\x00b"}))
        assert_error(r, 400, param=f"metadata.{key}", message_contains="NUL")

    def test_lone_surrogate_in_metadata_is_a_400_with_nothing_committed_and_the_list_still_works(
        self, api: httpx.Client, training_file: str, nothing_stored: Callable[[], None]
    ) -> None:
        r = post_json(api, JOBS, job_body(training_file, metadata={"k": "\ud800"}))
        assert_error(r, 400, param="metadata.k", message_contains="surrogate")
        nothing_stored()
        assert api.get(JOBS).status_code == 200  # a stored surrogate made every later list a 500

    @pytest.mark.parametrize(
        ("change", "param"),
        [
            ({"training_file": "file-a\x00b"}, "training_file"),
            ({"validation_file": "file-\ud800"}, "validation_file"),
            ({"suffix": "run\x00"}, "suffix"),
            ({"model": "tiny\ud83d"}, "model"),
            ({"metadata": {"k\x00": "v"}}, "metadata"),  # a bad key is never echoed in the answer
            (
                {"method": grpo({"beta": 0.1}, grader={**GRADER, "input": "{{sample.output_text}}\x00"})},
                "method.grpo.grader.input",
            ),
            ({"method": grpo(grader={**GRADER, "reference": "\udfff"})}, "method.grpo.grader.reference"),
            ({"method": grpo({"lr_sch\x00eduler": "cosine"})}, "method.grpo.hyperparameters"),
            ({"method": grpo(lora={"target_modules": ["q_proj", "\ud800"]})}, "method.grpo.lora.target_modules.1"),
            ({"integrations": [{"type": "wandb\x00"}]}, "integrations.0.type"),
            ({"\ud800": 1}, None),  # an unknown field whose own name cannot be sent back
        ],
    )
    def test_nul_or_lone_surrogate_anywhere_in_a_job_body_is_a_400_naming_the_field(
        self,
        api: httpx.Client,
        training_file: str,
        nothing_stored: Callable[[], None],
        change: dict[str, Any],
        param: str | None,
    ) -> None:
        assert_error(post_json(api, JOBS, {**job_body(training_file), **change}), 400, param=param)
        nothing_stored()

    @pytest.mark.parametrize(
        ("body", "param"),
        [
            ({"grader": GRADER, "model_sample": "4\x00", "item": {"answer": "4"}}, "model_sample"),
            ({"grader": GRADER, "model_sample": "4", "item": {"answer": "\ud800"}}, "item.answer"),
            ({"grader": GRADER, "model_sample": "4", "item": {"x": [1, {"y": float("nan")}]}}, "item.x.1.y"),
        ],
    )
    def test_grader_run_refuses_the_same_values(self, api: httpx.Client, body: dict[str, Any], param: str) -> None:
        assert_error(post_json(api, "/v1/fine_tuning/alpha/graders/run", body), 400, param=param)

    def test_nul_in_an_uploaded_file_name_is_a_400(self, api: httpx.Client) -> None:
        multipart = (
            b'--XX\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nfine-tune\r\n'
            b'--XX\r\nContent-Disposition: form-data; name="file"; filename="a\x00b.jsonl"\r\n'
            b"Content-Type: application/jsonl\r\n\r\n" + jsonl(prompts(1)) + b"\r\n--XX--\r\n"
        )
        r = api.post("/v1/files", content=multipart, headers={"content-type": "multipart/form-data; boundary=XX"})
        assert_error(r, 400, param="file", message_contains="NUL")
        assert api.get("/v1/files").status_code == 200


class TestResponseBuiltBeforeCommit:
    @pytest.mark.expected_5xx(500)
    def test_a_job_whose_answer_cannot_be_built_is_not_committed_nor_queued(
        self,
        api: httpx.Client,
        training_file: str,
        nothing_stored: Callable[[], None],
        monkeypatch: pytest.MonkeyPatch,
    ) -> None:
        # A bug in building the answer (the server runs in this process): the client sees a 500 and will retry, so
        # the job must not exist, or it would train twice.
        from api.schemas import FineTuningJob

        def broken(cls: type[FineTuningJob], row: Any) -> FineTuningJob:
            raise RuntimeError("the answer cannot be built")

        monkeypatch.setattr(FineTuningJob, "from_row", classmethod(broken))
        r = api.post(JOBS, json=job_body(training_file))
        assert r.status_code == 500, r.text
        nothing_stored()


# ---------------------------------------------------------------------------------------------------------------
# Every hyperparameter finite and bounded


class TestHyperparameters:
    @pytest.mark.parametrize(
        ("method", "param"),
        [
            (grpo({"weight_decay": float("nan")}), "method.grpo.hyperparameters.weight_decay"),
            (grpo({"beta": float("inf")}), "method.grpo.hyperparameters.beta"),
            (grpo({"learning_rate_multiplier": float("-inf")}), "method.grpo.hyperparameters.learning_rate_multiplier"),
            (grpo({"learning_rate_multiplier": 1e308}), "method.grpo.hyperparameters.learning_rate_multiplier"),
            (
                grpo({"learning_rate_multiplier": 2.0, "learning_rate": 0.9}),
                "method.grpo.hyperparameters.learning_rate_multiplier",
            ),
            (grpo({"max_steps": 2**40}), "method.grpo.hyperparameters.max_steps"),
            (grpo({"n_epochs": 2**40}), "method.grpo.hyperparameters.n_epochs"),
            (grpo({"batch_size": 10**12}), "method.grpo.hyperparameters.batch_size"),
            (grpo({"group_size": 10**9}), "method.grpo.hyperparameters.group_size"),
            (grpo({"batch_size": 4096, "group_size": 256}), "method.grpo.hyperparameters.group_size"),
            (grpo({"max_completion_tokens": 2**31}), "method.grpo.hyperparameters.max_completion_tokens"),
            (grpo(lora={"alpha": float("nan")}), "method.grpo.lora.alpha"),
            (grpo(lora={"r": 2**40}), "method.grpo.lora.r"),
            (
                {"type": "reward_model", "reward_model": {"hyperparameters": {"margin": float("inf")}}},
                "method.reward_model.hyperparameters.margin",
            ),
            ({"type": "dpo", "dpo": {"hyperparameters": {"beta": 1e308}}}, "method.dpo.hyperparameters.beta"),
        ],
    )
    def test_non_finite_or_out_of_range_hyperparameter_is_a_400_naming_it(
        self,
        api: httpx.Client,
        training_file: str,
        nothing_stored: Callable[[], None],
        method: dict[str, Any],
        param: str,
    ) -> None:
        assert_error(post_json(api, JOBS, job_body(training_file, method=method)), 400, param=param)
        nothing_stored()

    def test_a_number_that_overflows_to_infinity_is_a_400(self, api: httpx.Client, training_file: str) -> None:
        body = json.dumps(job_body(training_file, method=grpo({"beta": 0.5}))).replace("0.5", "1e400")
        r = api.post(JOBS, content=body.encode(), headers={"content-type": "application/json"})
        assert_error(r, 400, param="method.grpo.hyperparameters.beta", message_contains="finite")

    def test_the_largest_values_a_real_job_could_need_are_accepted(self, api: httpx.Client, training_file: str) -> None:
        hp = {"batch_size": 256, "group_size": 256, "max_steps": 1_000_000, "max_completion_tokens": 131_072}
        r = api.post(JOBS, json=job_body(training_file, method=grpo(hp, lora={"r": 1024, "alpha": 2048})))
        assert r.status_code == 200, r.text
        assert r.json()["method"]["grpo"]["hyperparameters"]["max_steps"] == 1_000_000

    def test_epochs_that_plan_more_steps_than_allowed_fail_at_validation_naming_n_epochs(
        self, api: httpx.Client, settings: Any
    ) -> None:
        # 1001 prompts × 1000 epochs in batches of 1: 1,001,000 steps, over the limit; the request cannot know the
        # number of lines, the worker's validation does.
        lines = jsonl([{"prompt": "1+1", "answer": "2"} for _ in range(1001)])
        file_id = upload(api, lines).json()["id"]
        hp = {"batch_size": 1, "group_size": 2, "n_epochs": 1000}
        job = api.post(JOBS, json=job_body(file_id, method=grpo(hp))).json()
        assert validate(settings, job["id"]) == "failed"
        error = api.get(f"{JOBS}/{job['id']}").json()["error"]
        assert error["code"] == "invalid_hyperparameters", error
        assert error["param"] == "method.grpo.hyperparameters.n_epochs", error
        assert "1,001,000 steps" in error["message"], error


# ---------------------------------------------------------------------------------------------------------------
# Dataset lines Python's parser refuses with something other than a JSONDecodeError


HUGE_INT = b'{"prompt": "1+1", "answer": ' + b"1" * 4301 + b"}\n"
DEEP = b'{"prompt": "1+1", "answer": ' + b"[" * 2000 + b"]" * 2000 + b"}\n"
BAD_LINES = [
    pytest.param(HUGE_INT, "a number has more than 4300 digits", id="4301-digit-integer"),
    pytest.param(DEEP, "not valid JSON: nested more than 64 levels", id="2000-deep"),
    pytest.param(
        b'{"prompt": "1+1", "answer": ' + b"[" * 65 + b"]" * 65 + b"}\n",
        "answer: nested more than 64 levels",
        id="65-deep",
    ),
    pytest.param(b'{"prompt": "\\ud800"}\n', "prompt: contains an unpaired", id="lone-surrogate"),
    pytest.param(b'{"prompt": "a\\u0000"}\n', "prompt: contains a NUL", id="nul"),
    pytest.param(b'{"prompt": "1+1", "margin": NaN}\n', "NaN: must be a finite number", id="nan"),
    pytest.param(b'{"prompt": "1+1", "w": 1e999}\n', "1e999: must be a finite number", id="overflow"),
]


class TestDatasetLines:
    @pytest.mark.parametrize(("line", "problem"), BAD_LINES)
    def test_upload_of_a_line_the_service_cannot_take_is_a_400_naming_the_line(
        self, api: httpx.Client, artifact_store: Any, tenant_a: Tenant, line: bytes, problem: str
    ) -> None:
        before = list(artifact_store.list(f"files/{tenant_a.id}"))
        r = upload(api, jsonl(prompts(2)) + line)
        assert_error(r, 400, param="file", code="invalid_file", message_contains=f"line 3: {problem}")
        assert list(artifact_store.list(f"files/{tenant_a.id}")) == before

    @pytest.mark.parametrize(("line", "problem"), BAD_LINES)
    def test_the_workers_validation_fails_the_job_naming_the_line(
        self,
        api: httpx.Client,
        artifact_store: Any,
        tenant_a: Tenant,
        training_file: str,
        settings: Any,
        line: bytes,
        problem: str,
    ) -> None:
        # A file stored before uploads were checked this way (or written to the store by other means).
        artifact_store.put_bytes(f"files/{tenant_a.id}/{training_file}.jsonl", jsonl(prompts(2)) + line)
        job = api.post(JOBS, json=job_body(training_file)).json()
        assert validate(settings, job["id"]) == "failed"
        error = api.get(f"{JOBS}/{job['id']}").json()["error"]
        assert error["code"] == "invalid_file" and error["param"] == "training_file", error
        assert error["message"].startswith(f"training file {training_file}, line 3: "), error
        assert problem in error["message"], error

"""Job creation for the methods beyond online RL: preference and supervised files validated against their format
(by the worker's ``validating_files`` phase), and reward_model graders that must name a succeeded reward_model job of
the same tenant."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx
import pytest

from tests.integration.conftest import GRADER, assert_error, job_body, jsonl, set_job, upload, validate

PAIRS = [
    {
        "input": {"messages": [{"role": "user", "content": f"What is {i} + {i}?"}]},
        "preferred_output": [{"role": "assistant", "content": str(2 * i)}],
        "non_preferred_output": [{"role": "assistant", "content": str(2 * i + 1)}],
    }
    for i in range(4)
]
TRL_PAIRS = [{"prompt": f"What is {i} + 1?", "chosen": str(i + 1), "rejected": str(i + 2)} for i in range(4)]
NOT_A_PAIR = (
    "not a preference pair: expected OpenAI's {'input': {'messages': [...]}, 'preferred_output': [...], "
    "'non_preferred_output': [...]} or TRL's {'prompt', 'chosen', 'rejected'}"
)
CONVERSATIONS = [
    {"messages": [{"role": "user", "content": f"What is {i} + {i}?"}, {"role": "assistant", "content": str(2 * i)}]}
    for i in range(4)
]


def file_id(api: httpx.Client, rows: list[Any]) -> str:
    r = upload(api, jsonl(rows))
    assert r.status_code == 200, r.text
    return str(r.json()["id"])


def create(api: httpx.Client, training_file: str, method: dict[str, Any]) -> dict[str, Any]:
    r = api.post("/v1/fine_tuning/jobs", json=job_body(training_file, method=method))
    assert r.status_code == 200, r.text
    return r.json()  # type: ignore[no-any-return]


class TestDatasetFormats:
    @pytest.mark.parametrize(
        ("method", "rows"),
        [
            ({"type": "reward_model", "reward_model": {}}, PAIRS),
            ({"type": "dpo", "dpo": {"hyperparameters": {"beta": 0.2}}}, TRL_PAIRS),
            ({"type": "supervised", "supervised": {"hyperparameters": {"n_epochs": 2}}}, CONVERSATIONS),
        ],
    )
    def test_a_file_in_the_methods_format_is_validated_and_queued(
        self, api: httpx.Client, settings: Any, method: dict[str, Any], rows: list[Any]
    ) -> None:
        job = create(api, file_id(api, rows), method)
        assert job["status"] == "validating_files", job
        assert job["method"]["type"] == method["type"]
        assert validate(settings, job["id"]) == "queued"
        assert api.get(f"/v1/fine_tuning/jobs/{job['id']}").json()["status"] == "queued"

    @pytest.mark.parametrize(
        ("method", "rows", "line", "problem"),
        [
            (
                {"type": "dpo", "dpo": {}},
                [*TRL_PAIRS[:2], {**TRL_PAIRS[2], "rejected": TRL_PAIRS[2]["chosen"]}],
                3,
                "the chosen and rejected completions are identical",
            ),
            (
                {"type": "reward_model", "reward_model": {}},
                [PAIRS[0], {"input": PAIRS[1]["input"]}],
                2,
                "missing field 'preferred_output'",
            ),
            ({"type": "dpo", "dpo": {}}, CONVERSATIONS, 1, NOT_A_PAIR),  # a supervised file given to DPO
            (
                {"type": "supervised", "supervised": {}},
                [CONVERSATIONS[0], {"messages": [{"role": "user", "content": "hi"}]}],
                2,
                "the last message must be an assistant turn (the reply to learn)",
            ),
        ],
    )
    def test_a_file_that_does_not_fit_the_method_fails_validation_naming_the_line(
        self, api: httpx.Client, settings: Any, method: dict[str, Any], rows: list[Any], line: int, problem: str
    ) -> None:
        training_file = file_id(api, rows)
        job_id = create(api, training_file, method)["id"]
        assert validate(settings, job_id) == "failed"
        job = api.get(f"/v1/fine_tuning/jobs/{job_id}").json()
        assert job["status"] == "failed", job
        assert job["error"] == {
            "code": "invalid_file",
            "message": f"training file {training_file}, line {line}: {problem}",
            "param": "training_file",
        }

    def test_a_prompt_file_is_not_a_preference_file(self, api: httpx.Client, settings: Any, training_file: str) -> None:
        job_id = create(api, training_file, {"type": "reward_model", "reward_model": {}})["id"]
        assert validate(settings, job_id) == "failed"
        job = api.get(f"/v1/fine_tuning/jobs/{job_id}").json()
        assert job["status"] == "failed"
        assert job["error"]["message"] == f"training file {training_file}, line 1: {NOT_A_PAIR}"


class TestRewardModelGrader:
    @staticmethod
    def rm_grader(model: str) -> dict[str, Any]:
        return {"type": "reward_model", "name": "rm", "model": model}

    def ppo(self, grader: dict[str, Any]) -> dict[str, Any]:
        return {"type": "ppo", "ppo": {"grader": grader, "hyperparameters": {"batch_size": 2}}}

    def test_unknown_job_is_a_400_naming_the_grader_field(self, api: httpx.Client, training_file: str) -> None:
        r = api.post(
            "/v1/fine_tuning/jobs", json=job_body(training_file, method=self.ppo(self.rm_grader("ftjob-nope")))
        )
        assert_error(r, 400, param="method.ppo.grader.model", code="invalid_reward_model")

    def test_a_job_of_another_method_or_unfinished_is_a_400(
        self, api: httpx.Client, training_file: str, db: Callable[[], Any]
    ) -> None:
        grpo_job = create(api, training_file, job_body(training_file)["method"])
        multi = {
            "type": "multi",
            "name": "total",
            "graders": {"exact": GRADER, "rm": self.rm_grader(grpo_job["id"])},
            "calculate_output": "exact + rm",
        }
        r = api.post("/v1/fine_tuning/jobs", json=job_body(training_file, method=self.ppo(multi)))
        assert_error(r, 400, param="method.ppo.grader.graders.rm.model", code="invalid_reward_model")
        assert "grpo job" in r.json()["error"]["message"]

        rm_job = create(api, file_id(api, PAIRS), {"type": "reward_model", "reward_model": {}})
        r = api.post(
            "/v1/fine_tuning/jobs", json=job_body(training_file, method=self.ppo(self.rm_grader(rm_job["id"])))
        )
        assert_error(r, 400, param="method.ppo.grader.model", code="invalid_reward_model")
        assert r.json()["error"]["message"] == (
            f"reward model job {rm_job['id']} is validating_files: it can grade once it has succeeded"
        )

    def test_a_succeeded_reward_model_is_named_by_job_id_in_the_stored_spec(
        self, api: httpx.Client, api_b: httpx.Client, training_file: str, db: Callable[[], Any]
    ) -> None:
        rm_job = create(api, file_id(api, PAIRS), {"type": "reward_model", "reward_model": {}})
        name = f"ft:tiny-arith:acme:rm:{rm_job['id']}"
        set_job(db, rm_job["id"], status="succeeded", fine_tuned_model=name)
        job = create(api, training_file, self.ppo(self.rm_grader(name)))
        assert job["status"] == "validating_files"
        assert job["method"]["ppo"]["grader"]["model"] == rm_job["id"]
        # another tenant cannot grade with it
        b_file = file_id(api_b, [{"prompt": "What is 1 + 1?", "answer": "2"}])
        r = api_b.post("/v1/fine_tuning/jobs", json=job_body(b_file, method=self.ppo(self.rm_grader(rm_job["id"]))))
        assert_error(r, 400, param="method.ppo.grader.model", code="invalid_reward_model")


def test_a_reward_model_grader_cannot_be_dry_run_and_says_so(api: httpx.Client) -> None:
    grader = {"type": "reward_model", "name": "rm", "model": "ftjob-abc"}
    r = api.post("/v1/fine_tuning/alpha/graders/run", json={"grader": grader, "model_sample": "42"})
    assert_error(r, 400, param="grader", code="invalid_grader")

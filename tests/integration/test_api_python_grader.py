"""OpenAI's `python` grader through the real API: dry-runs score in a sandbox with OpenAI's
`sample` object, validate and job creation check the source in a sandbox, and a grader that outlives its time limit
answers with OpenAI's server-error flag while the API goes on serving others."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from api.services import graders as graders_service
from tests.integration.conftest import assert_error, http_client, job_body
from trainer.grading.sandbox import SandboxConfig, sandbox_available

RUN = "/v1/fine_tuning/alpha/graders/run"
VALIDATE = "/v1/fine_tuning/alpha/graders/validate"
EXACT = {
    "type": "python",
    "name": "exact",
    "source": 'def grade(sample, item):\n    return float(sample["output_text"].strip() == item["answer"])\n',
}


@pytest.fixture(autouse=True)
def sandbox_here() -> None:
    """Every test here needs the sandbox: where it cannot start, they fail saying why (never skipped)."""
    reason = sandbox_available(graders_service.SANDBOX)
    if reason is not None:
        pytest.fail(f"the python grader's sandbox is unavailable here: {reason}")


@pytest.fixture
def one_second(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Dry-runs' sandboxes with a 1 s limit per sample."""
    monkeypatch.setattr(graders_service, "SANDBOX", SandboxConfig(sample_timeout_s=1.0, startup_timeout_s=5.0))
    yield


class TestRun:
    @pytest.mark.parametrize(("sample", "reward"), [(" 42\n", 1.0), ("41", 0.0)])
    def test_a_python_grader_scores_exactly(self, api: httpx.Client, sample: str, reward: float) -> None:
        r = api.post(RUN, json={"grader": EXACT, "model_sample": sample, "item": {"answer": "42"}})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["reward"] == reward and body["sub_rewards"] == {"exact": reward}
        assert body["metadata"]["name"] == "exact" and body["metadata"]["type"] == "python"
        assert not any(body["metadata"]["errors"].values())

    def test_grade_sees_openais_sample_object_and_the_item(self, api: httpx.Client) -> None:
        source = (
            "def grade(sample, item):\n"
            '    assert sample["output_json"] == {"x": 2} and sample["output_tools"] == []\n'
            '    assert sample["output_audio"] is None\n'
            '    [choice] = sample["choices"]\n'
            '    message = {"role": "assistant", "content": sample["output_text"], "tool_calls": []}\n'
            '    assert choice == {"index": 0, "message": message, "finish_reason": "stop"}\n'
            '    return sample["output_json"]["x"] * item["k"]\n'
        )
        grader = {"type": "python", "source": source, "image_tag": "2025-05-08"}  # name optional, as in OpenAI's guide
        body = api.post(RUN, json={"grader": grader, "model_sample": '{"x": 2}', "item": {"k": 1.5}}).json()
        assert body["reward"] == 3.0, body
        assert body["metadata"]["name"] == "python"

    def test_an_exception_is_a_runtime_error_with_its_details(self, api: httpx.Client) -> None:
        grader = {"type": "python", "name": "p", "source": "def grade(sample, item):\n    return item['missing']\n"}
        body = api.post(RUN, json={"grader": grader, "model_sample": "x", "item": {}}).json()
        errors = body["metadata"]["errors"]
        assert body["reward"] == 0.0
        assert {name for name, value in errors.items() if value is True} == {"python_grader_runtime_error"}
        assert "KeyError: 'missing'" in errors["python_grader_runtime_error_details"]

    def test_a_numpy_grader_scores_as_on_openai(self, api: httpx.Client) -> None:
        source = "import numpy as np\n\ndef grade(sample, item):\n    return np.mean(item['values'])\n"
        grader = {"type": "python", "name": "mean", "source": source, "image_tag": "2025-05-08"}
        r = api.post(RUN, json={"grader": grader, "model_sample": "x", "item": {"values": [1, 2, 4]}})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["reward"] == 7 / 3 and body["sub_rewards"] == {"mean": 7 / 3}
        assert not any(body["metadata"]["errors"].values())

    def test_importing_a_package_that_is_not_there_is_a_runtime_error_with_the_import_error(
        self, api: httpx.Client
    ) -> None:
        source = "import tensorflow\n\ndef grade(sample, item):\n    return 1.0\n"
        r = api.post(RUN, json={"grader": {"type": "python", "name": "tf", "source": source}, "model_sample": "x"})
        assert r.status_code == 200, r.text
        body = r.json()
        errors = body["metadata"]["errors"]
        assert body["reward"] == 0.0
        assert {name for name, value in errors.items() if value is True} == {"python_grader_runtime_error"}
        assert "ModuleNotFoundError: No module named 'tensorflow'" in errors["python_grader_runtime_error_details"]

    def test_python_leaves_of_a_multi_grader_are_scored_in_the_sandbox(self, api: httpx.Client) -> None:
        multi = {
            "type": "multi",
            "name": "m",
            "graders": {
                "py": EXACT,
                "len": {
                    "type": "python",
                    "name": "len",
                    "source": "def grade(s, i):\n    return len(s['output_text'])",
                },
                "same": {
                    "type": "string_check",
                    "name": "same",
                    "input": "{{sample.output_text}}",
                    "reference": "{{item.answer}}",
                    "operation": "eq",
                },
            },
            "calculate_output": "py + len / 10 + same",
        }
        body = api.post(RUN, json={"grader": multi, "model_sample": "42", "item": {"answer": "42"}}).json()
        assert body["sub_rewards"] == {"py": 1.0, "len": 2.0, "same": 1.0}
        assert body["reward"] == pytest.approx(2.2)

    @pytest.mark.alone
    @pytest.mark.usefixtures("one_second")
    def test_a_grader_past_its_time_limit_is_a_server_error_and_stalls_nobody(
        self, api: httpx.Client, base_url: str
    ) -> None:
        grader = {
            "type": "python",
            "name": "slow",
            "source": "def grade(sample, item):\n    while True:\n        pass\n",
        }
        latencies: list[float] = []
        stop = threading.Event()

        def poll() -> None:
            with http_client(base_url) as anon:
                while not stop.is_set():
                    start = time.monotonic()
                    assert anon.get("/healthz").status_code == 200
                    latencies.append(time.monotonic() - start)
                    stop.wait(0.02)

        poller = threading.Thread(target=poll)
        poller.start()
        try:
            start = time.monotonic()
            r = api.post(RUN, json={"grader": grader, "model_sample": "x", "item": {}})
            elapsed = time.monotonic() - start
        finally:
            stop.set()
            poller.join(timeout=10)
        assert r.status_code == 200, r.text
        errors = r.json()["metadata"]["errors"]
        assert r.json()["reward"] == 0.0
        assert {name for name, value in errors.items() if value is True} == {"python_grader_server_error"}
        assert errors["python_grader_server_error_type"] == "timeout"
        assert 1.0 <= elapsed < 8.0
        assert len(latencies) >= 10 and max(latencies) < 1.0, latencies


class TestValidate:
    def test_a_python_grader_is_returned_as_it_will_run(self, api: httpx.Client) -> None:
        r = api.post(VALIDATE, json={"grader": {"type": "python", "source": EXACT["source"]}})
        assert r.status_code == 200, r.text
        assert r.json()["grader"] == {"type": "python", "name": "python", "source": EXACT["source"]}

    @pytest.mark.parametrize(
        ("source", "says"),
        [
            ("def score(sample, item):\n    return 1.0\n", "does not define a top-level function grade"),
            ("def grade(sample, item)\n    return 1.0\n", "does not parse"),
            ("def grade(sample):\n    return 1.0\n", "two positional arguments"),
        ],
    )
    def test_a_source_without_a_usable_grade_is_a_400_naming_source(
        self, api: httpx.Client, source: str, says: str
    ) -> None:
        r = api.post(VALIDATE, json={"grader": {"type": "python", "name": "p", "source": source}})
        assert_error(r, 400, param="grader.source", code="invalid_grader", message_contains=says)

    def test_inside_a_multi_grader_the_400_names_the_leafs_source(self, api: httpx.Client) -> None:
        bad = {"type": "python", "name": "p", "source": "x = 1\n"}
        multi = {"type": "multi", "name": "m", "graders": {"p": bad}, "calculate_output": "p"}
        assert_error(api.post(VALIDATE, json={"grader": multi}), 400, param="grader.graders.p.source")

    def test_an_unknown_image_tag_is_a_400_listing_the_valid_ones(self, api: httpx.Client) -> None:
        r = api.post(VALIDATE, json={"grader": {**EXACT, "image_tag": "2024-01-01"}})
        assert_error(r, 400, param="grader.image_tag", code="invalid_grader", message_contains="valid: 2025-05-08")

    def test_a_source_over_256_kb_is_a_400(self, api: httpx.Client) -> None:
        source = EXACT["source"] + "#" * (256 * 1024)
        r = api.post(VALIDATE, json={"grader": {**EXACT, "source": source}})
        assert_error(r, 400, param="grader.source", code="invalid_grader", message_contains="at most 262144 bytes")

    def test_no_sandbox_here_is_a_400_saying_why(self, api: httpx.Client, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setattr(graders_service, "SANDBOX", SandboxConfig(python="/usr/bin/no-such-python"))
        r = api.post(VALIDATE, json={"grader": EXACT})
        assert_error(r, 400, param="grader", code="sandbox_unavailable", message_contains="/usr/bin/no-such-python")


class TestJobCreate:
    def grpo(self, training_file: str, grader: dict[str, Any]) -> dict[str, Any]:
        body = job_body(training_file)
        body["method"]["grpo"]["grader"] = grader
        return body

    def test_a_job_with_a_python_grader_is_created(self, api: httpx.Client, training_file: str) -> None:
        r = api.post("/v1/fine_tuning/jobs", json=self.grpo(training_file, EXACT))
        assert r.status_code == 200, r.text
        assert r.json()["method"]["grpo"]["grader"] == EXACT

    def test_a_source_without_grade_is_refused_naming_it(self, api: httpx.Client, training_file: str) -> None:
        bad = {"type": "python", "name": "p", "source": "def score(sample, item):\n    return 1.0\n"}
        r = api.post("/v1/fine_tuning/jobs", json=self.grpo(training_file, bad))
        assert_error(r, 400, param="method.grpo.grader.source", message_contains="grade")
        multi = {"type": "multi", "name": "m", "graders": {"p": bad}, "calculate_output": "p"}
        r = api.post("/v1/fine_tuning/jobs", json=self.grpo(training_file, multi))
        assert_error(r, 400, param="method.grpo.grader.graders.p.source")

"""Graders sent to stall the API, each sent while other
clients poll: ``/healthz`` without a key and tenant A's job list. Before the fixes each of these froze every request
of the process for seconds to hours (a pure-Python loop or a regex holding the GIL on a request thread).

Latency bounds are generous (a shared 2-core machine): a frozen API took 20 s and more where these allow 1 s.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

from api.services import graders as graders_service
from tests.grading_children import misbehaving_command
from tests.integration.conftest import GRADER, Tenant, assert_error, http_client, job_body
from trainer.grading.pool import GradingPool
from trainer.spec.graders import MAX_GRADER_DEPTH, MAX_SIMILARITY_CHARS, MAX_TEMPLATE_CHARS

pytestmark = pytest.mark.alone  # time limits and latencies: under pytest-xdist, no other test beside them

RUN = "/v1/fine_tuning/alpha/graders/run"
VALIDATE = "/v1/fine_tuning/alpha/graders/validate"
OUTPUT = "{{sample.output_text}}"
MAX_POLL_S = 1.0


@dataclass
class Polls:
    latencies: list[float] = field(default_factory=list)
    statuses: list[int] = field(default_factory=list)

    def check(self) -> None:
        assert self.latencies, "the pollers never ran"
        assert set(self.statuses) == {200}, self.statuses
        assert max(self.latencies) < MAX_POLL_S, f"a poll waited {max(self.latencies):.2f} s"


@contextmanager
def polled(base_url: str, tenant: Tenant) -> Iterator[Polls]:
    """While the body runs, poll ``/healthz`` (no key) and tenant's job list from another thread, every 20 ms; a few
    rounds of polls before the body starts and after it ends."""
    polls, stop = Polls(), threading.Event()

    def poll(anon: httpx.Client, client: httpx.Client) -> None:
        while not stop.is_set():
            for c, path in ((anon, "/healthz"), (client, "/v1/fine_tuning/jobs?limit=1")):
                start = time.monotonic()
                polls.statuses.append(c.get(path).status_code)
                polls.latencies.append(time.monotonic() - start)
            stop.wait(0.02)

    def rounds(n: int) -> None:
        target, deadline = len(polls.latencies) + 2 * n, time.monotonic() + 30
        while len(polls.latencies) < target and time.monotonic() < deadline:
            time.sleep(0.01)

    with http_client(base_url) as anon, http_client(base_url, tenant.key) as client:
        thread = threading.Thread(target=poll, args=(anon, client), name="poller")
        thread.start()
        try:
            rounds(3)
            yield polls
            rounds(3)
        finally:
            stop.set()
            thread.join(timeout=30)


def nested(depth: int) -> dict[str, Any]:
    obj: dict[str, Any] = GRADER
    for level in range(depth):
        obj = {"type": "multi", "name": f"m{level}", "graders": {"a": obj}, "calculate_output": "a"}
    return obj


def newest_job(api: httpx.Client) -> str | None:
    data = api.get("/v1/fine_tuning/jobs", params={"limit": 1}).json()["data"]
    return data[0]["id"] if data else None


@pytest.fixture
def warm(api: httpx.Client) -> None:
    """The API's grading processes started (the first dry-run of a process starts them), so that timings are the
    grading's own."""
    assert api.post(RUN, json={"grader": GRADER, "model_sample": "4", "item": {"answer": "4"}}).status_code == 200


@pytest.fixture
def misbehaving_grading(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The API's dry-runs on grading processes that hang (inside a C call holding the GIL) on a sample starting with
    "hang", with a 1 s time limit."""
    grading = graders_service._Grading(GradingPool(2, sample_timeout_s=1.0, command=misbehaving_command()))
    monkeypatch.setattr(graders_service, "_grading", grading)
    yield
    grading.close()


class TestTemplates:
    def test_an_80kb_template_in_a_job_is_a_400_naming_the_field_and_stalls_nobody(
        self, api: httpx.Client, base_url: str, tenant_a: Tenant, training_file: str
    ) -> None:
        grader = {**GRADER, "input": "{{" * 40_000}
        before = newest_job(api)
        body = job_body(training_file, method={"type": "grpo", "grpo": {"grader": grader}})
        with polled(base_url, tenant_a) as polls:
            start = time.monotonic()
            r = api.post("/v1/fine_tuning/jobs", json=body)
            elapsed = time.monotonic() - start
        assert_error(
            r,
            400,
            param="method.grpo.grader",
            message_contains=f"grader.input: String should have at most {MAX_TEMPLATE_CHARS} characters",
        )
        assert elapsed < 2.0
        polls.check()
        assert newest_job(api) == before

    def test_an_80kb_template_in_a_dry_run_is_a_400_naming_the_field(self, api: httpx.Client) -> None:
        r = api.post(RUN, json={"grader": {**GRADER, "reference": "{{" * 40_000}, "model_sample": "4"})
        assert_error(r, 400, param="grader.reference", code="invalid_grader")


class TestRegex:
    @pytest.mark.parametrize(("pattern", "sample"), [(r"^(a|aa)*c", "a" * 9_000), (r"(.*a){8}$", "a" * 9_000 + "b")])
    @pytest.mark.usefixtures("warm")
    def test_a_catastrophic_pattern_grades_in_milliseconds_and_stalls_nobody(
        self, api: httpx.Client, base_url: str, tenant_a: Tenant, pattern: str, sample: str
    ) -> None:
        grader = {"type": "regex", "name": "r", "input": OUTPUT, "pattern": pattern}
        with polled(base_url, tenant_a) as polls:
            start = time.monotonic()
            r = api.post(RUN, json={"grader": grader, "model_sample": sample})
            elapsed = time.monotonic() - start
        assert r.status_code == 200, r.text
        assert r.json()["reward"] == 0.0 and not any(r.json()["metadata"]["errors"].values())
        assert elapsed < 2.0
        polls.check()

    @pytest.mark.parametrize("pattern", [r"(a)\1", r"x(?=y)", r"(?<=a)b"])
    def test_a_pattern_re2_refuses_is_a_400_that_says_re2(self, api: httpx.Client, pattern: str) -> None:
        grader = {"type": "regex", "name": "r", "input": OUTPUT, "pattern": pattern}
        error = assert_error(api.post(VALIDATE, json={"grader": grader}), 400, param="grader.pattern")
        assert "RE2 syntax" in error["message"]


class TestTextSimilarity:
    @pytest.mark.usefixtures("warm")
    def test_100k_characters_answer_at_once_with_an_error_flag_and_stall_nobody(
        self, api: httpx.Client, base_url: str, tenant_a: Tenant
    ) -> None:
        grader = {
            "type": "text_similarity",
            "name": "sim",
            "input": OUTPUT,
            "reference": "{{item.answer}}",
            "evaluation_metric": "fuzzy_match",
        }
        text = "ab " * 33_334  # 100,002 characters; difflib took over 5 minutes on 3,000 of these
        with polled(base_url, tenant_a) as polls:
            start = time.monotonic()
            r = api.post(RUN, json={"grader": grader, "model_sample": text, "item": {"answer": text[::-1]}})
            elapsed = time.monotonic() - start
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["reward"] == 0.0 and body["metadata"]["errors"]["other_error"] is True
        assert f"at most {MAX_SIMILARITY_CHARS}" in body["metadata"]["error_messages"][0]
        assert elapsed < 2.0
        polls.check()


class TestNesting:
    def test_a_200_deep_multi_grader_is_a_400_and_nothing_is_stored(
        self, api: httpx.Client, training_file: str
    ) -> None:
        # Before: the job was committed and queued, then its response failed (a 500), and the tenant's job list
        # answered 500 from then on.
        before = newest_job(api)
        body = job_body(training_file, method={"type": "grpo", "grpo": {"grader": nested(200)}})
        assert_error(api.post("/v1/fine_tuning/jobs", json=body), 400)
        assert newest_job(api) == before
        assert api.get("/v1/fine_tuning/jobs").status_code == 200

    @pytest.mark.parametrize("depth", [MAX_GRADER_DEPTH + 1, 20])
    def test_multi_graders_nested_past_the_bound_are_a_400_naming_the_path(
        self, api: httpx.Client, training_file: str, depth: int
    ) -> None:
        before = newest_job(api)
        path = "grader" + ".graders.a" * MAX_GRADER_DEPTH
        message = f"{path}: multi graders nest at most {MAX_GRADER_DEPTH} levels deep"
        body = job_body(training_file, method={"type": "grpo", "grpo": {"grader": nested(depth)}})
        assert_error(
            api.post("/v1/fine_tuning/jobs", json=body), 400, param="method.grpo.grader", message_contains=message
        )
        assert newest_job(api) == before
        assert_error(api.post(VALIDATE, json={"grader": nested(depth)}), 400, param=path, code="invalid_grader")
        assert api.post(VALIDATE, json={"grader": nested(MAX_GRADER_DEPTH)}).status_code == 200


class TestHardTimeLimit:
    @pytest.mark.usefixtures("misbehaving_grading")
    def test_a_sample_past_the_limit_is_flagged_unresponsive_and_stalls_nobody(
        self, api_b: httpx.Client, base_url: str, tenant_a: Tenant
    ) -> None:
        assert api_b.post(RUN, json={"grader": GRADER, "model_sample": "4", "item": {"answer": "4"}}).status_code == 200
        with polled(base_url, tenant_a) as polls:
            start = time.monotonic()
            r = api_b.post(RUN, json={"grader": GRADER, "model_sample": "hang", "item": {"answer": "4"}})
            elapsed = time.monotonic() - start
        assert r.status_code == 200, r.text
        meta = r.json()["metadata"]
        assert r.json()["reward"] == 0.0
        assert {name for name, value in meta["errors"].items() if value} == {"unresponsive_reward_error"}
        assert meta["error_messages"] == ["grading this sample took longer than 1 s; scored 0.0"]
        assert 1.0 <= meta["execution_time"] < 10.0 and elapsed < 15.0
        polls.check()
        # the killed process was replaced: the next dry-run grades
        again = api_b.post(RUN, json={"grader": GRADER, "model_sample": "4", "item": {"answer": "4"}})
        assert again.json()["reward"] == 1.0

    @pytest.mark.usefixtures("misbehaving_grading")
    def test_dry_runs_beyond_the_in_flight_bound_are_a_429(
        self, api: httpx.Client, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        monkeypatch.setattr(graders_service, "MAX_IN_FLIGHT", 1)
        hang = {"grader": GRADER, "model_sample": "hang", "item": {"answer": "4"}}
        with ThreadPoolExecutor(1) as other:
            first = other.submit(api.post, RUN, json=hang)
            time.sleep(0.5)  # the first is grading (its process starts, then 1 s of limit)
            assert_error(api.post(RUN, json=hang), 429, code="rate_limit_exceeded")
            assert first.result().status_code == 200

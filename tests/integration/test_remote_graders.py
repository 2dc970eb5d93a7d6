"""The remote graders against real HTTP services on this machine (tests/remote_grader_servers.py): a judge that
grades additions by a fixed rule, one that is slow, one that fails with 5xx then recovers, ones that answer garbage;
an endpoint grader likewise; an embeddings endpoint. No HTTP layer is mocked: requests go over TCP to uvicorn."""

from __future__ import annotations

import re
import time
from collections.abc import Sequence
from typing import Any, ClassVar

import pytest

from tests.remote_grader_servers import FLAKY_FAILURES, SLOW_S, Servers, letter_cosine, sum_score
from trainer.grading.graders import sample_object
from trainer.grading.remote_graders import (
    BudgetSpent,
    EmbeddingsConfig,
    JudgeBudget,
    JudgeConfig,
    RemoteConfig,
    RemoteScores,
    grade_remote_leaves,
)
from trainer.grading.remote_process import configure_remote, remote_budget
from trainer.loops import evaluate
from trainer.spec.data import PromptItem
from trainer.spec.graders import GraderFailed, parse_grader

pytestmark = pytest.mark.usefixtures("fresh_remote_graders")  # conftest: each test sees only its requests

KEY = "sk-judge-secret"
QUESTION = "What is 23 + 58?"
ITEM = {"question": QUESTION, "answer": "81"}
PROMPT = [
    {"role": "system", "content": "Grade the answer to the addition."},
    {"role": "user", "content": "Question: {{item.question}}\nAnswer: {{sample.output_text}}"},
]
SCORE_MODEL = {"type": "score_model", "name": "judge", "model": "judge-mini", "input": PROMPT}
LABEL_MODEL = {
    "type": "label_model",
    "name": "verdict",
    "model": "judge-mini",
    "input": PROMPT,
    "labels": ["correct", "wrong"],
    "passing_labels": ["correct"],
}


def config(servers: Servers, judge: str = "sum", **overrides: Any) -> RemoteConfig:
    values: dict[str, Any] = {
        "judge": JudgeConfig(base_url=servers.judge(judge), api_key=KEY, models={"judge-mini": "upstream-mini"}),
        "embeddings": EmbeddingsConfig(
            base_url=servers.embeddings(), api_key="sk-emb", model="letters-1", batch_size=3
        ),
        "url_schemes": ("http", "https"),
        "allow_networks": ("127.0.0.0/8",),
        "timeout_s": 10.0,
        "max_retries": 2,
        "backoff_s": 0.01,
        **overrides,
    }
    return RemoteConfig(**values)


def grade(
    grader: dict[str, Any], texts: Sequence[str], cfg: RemoteConfig, budget: int | None = 1000, **kw: Any
) -> RemoteScores:
    return grade_remote_leaves(
        parse_grader(grader), texts, [ITEM] * len(texts), config=cfg, budget=JudgeBudget(budget), **kw
    )


def kinds(scores: RemoteScores) -> list[list[tuple[str, str | None]]]:
    return [[(e.kind, e.cause) for e in errors] for errors in scores.errors]


class TestScoreModel:
    def test_each_sample_scores_what_the_judge_answers(self, servers: Servers) -> None:
        texts = ["81", "71", "no idea", "81"]
        scores = grade(SCORE_MODEL, texts, config(servers))
        assert scores.scores == {"judge": [1.0, 0.5, 0.0, 1.0]}
        assert [sum_score(QUESTION, t) for t in texts] == [1.0, 0.5, 0.0, 1.0]
        assert scores.errors == [[], [], [], []]
        requests = servers.state.to("/judge/sum")
        assert len(requests) == 3  # the two identical prompts are asked once
        first = requests[0]
        assert first.headers["authorization"] == f"Bearer {KEY}"
        assert first.body["model"] == "upstream-mini"  # the deployment's name for the tenant's "judge-mini"
        assert first.body["messages"][0] == {"role": "system", "content": "Grade the answer to the addition."}
        assert first.body["response_format"]["type"] == "json_schema"
        assert first.body["response_format"]["json_schema"]["strict"] is True
        contents = sorted(r.body["messages"][1]["content"] for r in requests)
        assert contents == [f"Question: {QUESTION}\nAnswer: {t}" for t in sorted(set(texts))]
        assert scores.token_usage == {"judge-mini": {"prompt_tokens": 30, "completion_tokens": 15, "total_tokens": 45}}

    def test_sampling_params_reach_the_judge(self, servers: Servers) -> None:
        params = {"temperature": 0.0, "max_completions_tokens": 100, "seed": 5}
        grade({**SCORE_MODEL, "sampling_params": params}, ["81"], config(servers))
        [request] = servers.state.to("/judge/sum")
        assert {k: request.body.get(k) for k in ("temperature", "max_completion_tokens", "seed")} == {
            "temperature": 0.0,
            "max_completion_tokens": 100,
            "seed": 5,
        }

    def test_a_label_model_scores_one_for_a_passing_label(self, servers: Servers) -> None:
        scores = grade(LABEL_MODEL, ["81", "71", "81"], config(servers))
        assert scores.scores == {"verdict": [1.0, 0.0, 1.0]} and scores.errors == [[], [], []]

    def test_a_judge_that_ignores_response_format_and_fences_its_json_is_read(self, servers: Servers) -> None:
        scores = grade(SCORE_MODEL, ["81", "71"], config(servers, "fenced"))
        assert scores.scores == {"judge": [1.0, 0.5]} and scores.errors == [[], []]

    def test_a_judge_failing_with_5xx_is_retried_until_it_answers(self, servers: Servers) -> None:
        budget = JudgeBudget(100)
        scores = grade_remote_leaves(
            parse_grader(SCORE_MODEL), ["81", "7"], [ITEM, ITEM], config=config(servers, "flaky"), budget=budget
        )
        assert scores.scores == {"judge": [1.0, 0.0]} and scores.errors == [[], []]
        assert len(servers.state.to("/judge/flaky")) == 2 * (FLAKY_FAILURES + 1)
        assert budget.used == 2 * (FLAKY_FAILURES + 1)  # every request counts, retries included

    def test_a_judge_that_keeps_failing_scores_zero_after_the_retries(self, servers: Servers) -> None:
        scores = grade(SCORE_MODEL, ["81"], config(servers, "down", max_retries=2))
        assert scores.scores == {"judge": [0.0]}
        [[error]] = scores.errors
        assert (error.kind, error.cause) == ("model_grader_server", "http_502")
        assert error.startswith("score_model grader 'judge': the judge did not answer (after 3 tries: HTTP 502: {")
        assert error.endswith("}); scored 0.0")
        assert len(servers.state.to("/judge/down")) == 3

    @pytest.mark.parametrize(
        ("mode", "kind", "cause", "says"),
        [
            ("prose", "model_grader_parse", "invalid_answer", "not a JSON object: I would say about 1.0."),
            ("outside", "model_grader_parse", "invalid_answer", "'result' 7 is outside the grader's range [0, 1]"),
            ("html", "model_grader_server", "not_json", "the answer is not JSON: <html>gateway</html>"),
            ("refuse", "model_grader_refusal", "refusal", "the judge refused (I can't grade this.)"),
        ],
    )
    def test_a_judge_answering_garbage_scores_zero_with_its_kind(
        self, servers: Servers, mode: str, kind: str, cause: str, says: str
    ) -> None:
        scores = grade(SCORE_MODEL, ["81"], config(servers, mode))
        assert scores.scores == {"judge": [0.0]}
        [[error]] = scores.errors
        assert (error.kind, error.cause) == (kind, cause) and says in error
        assert len(servers.state.to(f"/judge/{mode}")) == 1  # an answer, even a bad one, is not retried

    @pytest.mark.alone
    def test_a_slow_judge_times_out_and_requests_run_concurrently(self, servers: Servers) -> None:
        texts = ["1", "2", "3", "4"]
        start = time.monotonic()
        scores = grade(SCORE_MODEL, texts, config(servers, "slow", timeout_s=0.5, max_retries=1))
        elapsed = time.monotonic() - start
        assert scores.scores == {"judge": [0.0] * 4}
        assert kinds(scores) == [[("model_grader_server", "timeout")]] * 4
        assert "the judge did not answer (after 2 tries: no answer within 0.5 s); scored 0.0" in scores.errors[0][0]
        assert elapsed < 2 * 0.5 + 1.0  # 4 samples × 2 tries of 0.5 s each, side by side, not one after another

    def test_at_most_concurrency_requests_are_in_flight(self, servers: Servers) -> None:
        texts = ["2", "3", "4", "5"]  # no digit of 81: each scores 0.0
        start = time.monotonic()
        scores = grade(SCORE_MODEL, texts, config(servers, "slow", concurrency=4))
        wide = time.monotonic() - start
        assert scores.scores == {"judge": [0.0] * 4} and scores.errors == [[]] * 4  # answered: wrong sums score 0
        start = time.monotonic()
        grade(SCORE_MODEL, texts, config(servers, "slow", concurrency=2))
        narrow = time.monotonic() - start
        assert SLOW_S <= wide < 2 * SLOW_S <= narrow  # 4 at once take one wait; 2 at a time take two

    def test_a_spent_budget_stops_the_batch_and_fails_the_job(self, servers: Servers) -> None:
        with pytest.raises(BudgetSpent, match="its budget of 2 judge calls"):
            grade(SCORE_MODEL, ["1", "2", "3"], config(servers), budget=2)
        configure_remote(config(servers, max_judge_calls=2))
        try:
            items = [PromptItem(messages=[{"role": "user", "content": QUESTION}], item=ITEM)] * 3
            with pytest.raises(GraderFailed, match="this job has made its budget of 2 judge calls"):
                evaluate.grade_batch(parse_grader(SCORE_MODEL), ["1", "2", "3"], items)
            assert remote_budget().used == 2
        finally:
            configure_remote(RemoteConfig())


class TestEndpoint:
    def grader(self, servers: Servers, mode: str = "sum", **extra: Any) -> dict[str, Any]:
        return {"type": "endpoint", "name": "mine", "url": servers.grader(mode), **extra}

    def test_each_sample_is_posted_with_openais_sample_the_item_and_a_trace_id(self, servers: Servers) -> None:
        texts = ["81", "80", "81"]
        grader = self.grader(servers, headers={"Authorization": "Bearer tenant-token", "X-Run": "7"})
        scores = grade(grader, texts, config(servers))
        assert scores.scores == {"mine": [1.0, 0.0, 1.0]} and scores.errors == [[], [], []]
        requests = servers.state.to("/grade/sum")
        assert len(requests) == 3  # no de-duplication: each sample is a rollout of its own
        bodies = sorted((r.body for r in requests), key=lambda b: b["sample"]["output_text"])
        assert [b["sample"] for b in bodies] == [sample_object(t) for t in sorted(texts)]
        assert all(b["item"] == ITEM for b in bodies)
        traces = [b["trace_id"] for b in bodies]
        assert all(re.fullmatch(r"trace_[0-9a-f]{32}", t) for t in traces) and len(set(traces)) == 3
        headers = requests[0].headers
        assert headers["authorization"] == "Bearer tenant-token" and headers["x-run"] == "7"
        assert headers["host"] == f"127.0.0.1:{servers.port}" and headers["content-type"] == "application/json"

    def test_each_sample_carries_its_finish_reason(self, servers: Servers) -> None:
        scores = grade(self.grader(servers), ["81", "8"], config(servers), finish_reasons=["stop", "length"])
        assert scores.errors == [[], []]
        sent = {r.body["sample"]["output_text"]: r.body["sample"] for r in servers.state.to("/grade/sum")}
        assert sent == {"81": sample_object("81"), "8": sample_object("8", finish_reason="length")}
        assert sent["8"]["choices"][0]["finish_reason"] == "length"

    def test_requests_start_no_faster_than_the_rate_limit(self, servers: Servers) -> None:
        scores = grade(self.grader(servers, rate_limit=5), [str(i) for i in range(6)], config(servers))
        assert scores.errors == [[]] * 6
        arrivals = sorted(r.at for r in servers.state.to("/grade/sum"))
        # Starts are 0.2 s apart; arrivals jitter by a new connection's set-up, so spans are checked, not each gap.
        # Unlimited, all six arrive within a few milliseconds.
        assert arrivals[-1] - arrivals[0] >= 5 * 0.2 - 0.1, arrivals
        assert all(arrivals[i + 2] - arrivals[i] >= 2 * 0.2 - 0.15 for i in range(len(arrivals) - 2)), arrivals

    def test_a_failing_endpoint_is_retried_with_the_same_trace_id(self, servers: Servers) -> None:
        scores = grade(self.grader(servers, "flaky"), ["81", "1"], config(servers))
        assert scores.scores == {"mine": [1.0, 0.0]} and scores.errors == [[], []]
        requests = servers.state.to("/grade/flaky")
        assert len(requests) == 2 * (FLAKY_FAILURES + 1)
        assert len({r.body["trace_id"] for r in requests}) == 2

    def test_a_slow_endpoint_is_discarded_after_the_retries(self, servers: Servers) -> None:
        scores = grade(self.grader(servers, "slow"), ["81"], config(servers, timeout_s=0.3, max_retries=2))
        assert scores.scores == {"mine": [0.0]}
        [[error]] = scores.errors
        assert (error.kind, error.cause) == ("endpoint_server", "timeout")
        assert (
            error
            == "endpoint grader 'mine': the sample was discarded (after 3 tries: no answer within 0.3 s); scored 0.0"
        )
        assert len(servers.state.to("/grade/slow")) == 3

    @pytest.mark.parametrize(
        ("mode", "kind", "cause", "tries"),
        [
            ("garbage", "endpoint_parse", "invalid_answer", 1),
            ("html", "endpoint_server", "not_json", 1),
            ("forbidden", "endpoint_server", "http_403", 1),  # a 4xx other than 429 is not retried
        ],
    )
    def test_an_endpoint_answering_garbage_scores_zero_with_its_kind(
        self, servers: Servers, mode: str, kind: str, cause: str, tries: int
    ) -> None:
        scores = grade(self.grader(servers, mode), ["81"], config(servers))
        assert scores.scores == {"mine": [0.0]} and kinds(scores) == [[(kind, cause)]]
        assert len(servers.state.to(f"/grade/{mode}")) == tries

    def test_the_default_policy_refuses_loopback_without_sending_anything(self, servers: Servers) -> None:
        scores = grade(self.grader(servers), ["81", "1"], config(servers, url_schemes=("http",), allow_networks=()))
        assert scores.scores == {"mine": [0.0, 0.0]}
        assert kinds(scores) == [[("endpoint_server", "url_not_allowed")]] * 2
        assert "127.0.0.1 is a loopback address, which this deployment does not allow" in scores.errors[0][0]
        assert servers.state.to("/grade") == []

    def test_the_request_goes_to_the_checked_address_not_to_a_second_lookup(self, servers: Servers) -> None:
        # `grader.test` exists in no DNS: it reaches the server only because the request is pinned to the address the
        # policy checked. The resolver answers loopback once, then would answer a denied address (a rebinding).
        answers = [["127.0.0.1"], ["10.9.9.9"]]
        asked: list[str] = []

        async def rebinding(host: str, port: int) -> Sequence[str]:
            asked.append(host)
            return answers.pop(0)

        grader = self.grader(servers)
        grader["url"] = f"http://grader.test:{servers.port}/grade/sum"
        scores = grade(grader, ["81", "7", "81"], config(servers), resolver=rebinding)
        assert scores.scores == {"mine": [1.0, 0.0, 1.0]} and scores.errors == [[], [], []]
        assert asked == ["grader.test"]  # one lookup for the batch, checked, then used for every request
        assert {r.headers["host"] for r in servers.state.to("/grade/sum")} == {f"grader.test:{servers.port}"}


class TestCosine:
    COSINE: ClassVar[dict[str, Any]] = {
        "type": "text_similarity",
        "name": "close",
        "input": "{{sample.output_text}}",
        "reference": "{{item.answer}} apples",
        "evaluation_metric": "cosine",
    }

    def test_cosine_is_the_cosine_of_the_endpoints_embeddings(self, servers: Servers) -> None:
        texts = ["81 apples", "81 pears", "banana", "81 apples", "zzz"]
        scores = grade(self.COSINE, texts, config(servers))
        expected = [letter_cosine(t, "81 apples") for t in texts]
        assert scores.scores["close"] == pytest.approx(expected, abs=1e-12)
        assert scores.scores["close"][0] == pytest.approx(1.0) and scores.scores["close"][4] == 0.0
        requests = servers.state.to("/emb/letters")
        # 4 distinct texts (the reference is the first and the fourth sample's text) in batches of 3
        assert sorted(len(r.body["input"]) for r in requests) == [1, 3]
        assert {t for r in requests for t in r.body["input"]} == {"81 apples", "81 pears", "banana", "zzz"}
        assert all(r.body["model"] == "letters-1" and r.headers["authorization"] == "Bearer sk-emb" for r in requests)

    def test_empty_texts_are_not_embedded(self, servers: Servers) -> None:
        grader = {**self.COSINE, "reference": "{{item.missing}}"}
        scores = grade(grader, ["", "x"], config(servers))
        assert scores.scores["close"] == [1.0, 0.0]  # both empty: identical; one empty: unrelated
        assert [[e.kind for e in errs] for errs in scores.errors] == [["invalid_variable"], ["invalid_variable"]]
        assert servers.state.to("/emb") == []

    def test_an_embeddings_endpoint_that_fails_fails_its_samples(self, servers: Servers) -> None:
        cfg = config(servers, max_retries=1)
        cfg = cfg.model_copy(update={"embeddings": EmbeddingsConfig(base_url=servers.embeddings("down"), model="m")})
        scores = grade(self.COSINE, ["81 apples"], cfg)
        assert scores.scores["close"] == [0.0] and kinds(scores) == [[("embeddings", "http_503")]]
        assert len(servers.state.to("/emb/down")) == 2


def test_grade_batch_combines_remote_and_pure_leaves_and_counts_failures(servers: Servers) -> None:
    grader = parse_grader(
        {
            "type": "multi",
            "name": "all",
            "graders": {
                "judge": SCORE_MODEL,
                "exact": {
                    "type": "string_check",
                    "name": "exact",
                    "input": "{{sample.output_text}}",
                    "reference": "{{item.answer}}",
                    "operation": "eq",
                },
            },
            "calculate_output": "judge + 2 * exact",
        }
    )
    items = [PromptItem(messages=[{"role": "user", "content": QUESTION}], item=ITEM)] * 3
    try:
        configure_remote(config(servers))
        scores = evaluate.grade_batch(grader, ["81", "71", "x"], items)
        assert scores.rewards.tolist() == [3.0, 0.5, 0.0]
        assert scores.sub["judge"].tolist() == [1.0, 0.5, 0.0] and scores.sub["exact"].tolist() == [1.0, 0.0, 0.0]
        assert scores.failures == [None, None, None]
        configure_remote(config(servers, "down", max_retries=0))
        scores = evaluate.grade_batch(grader, ["81", "71", "x"], items)
        assert scores.rewards.tolist() == [2.0, 0.0, 0.0]  # the judge's part is 0; the string check still counts
        assert [f.kind if f else None for f in scores.failures] == ["model_grader_server"] * 3
        lone = evaluate.grade_batch(parse_grader(SCORE_MODEL), ["81"], items[:1])
        assert lone.rewards.tolist() == [0.0] and lone.failures[0] is not None
    finally:
        configure_remote(RemoteConfig())

"""trainer.grading.pool: grading in processes of their own, with a hard time limit per sample."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from tests.grading_children import misbehaving_command
from trainer.grading.graders import grade
from trainer.grading.pool import GradingPool, GradingTimeout, GradingUnavailable, Sample, _result
from trainer.spec.graders import GraderError, GradeResult, parse_grader

OUTPUT = "{{sample.output_text}}"
EXACT = {"type": "string_check", "name": "exact", "input": OUTPUT, "reference": "{{item.answer}}", "operation": "eq"}
MULTI = {
    "type": "multi",
    "name": "combo",
    "graders": {
        "exact": EXACT,
        "digits": {"type": "regex", "name": "digits", "input": OUTPUT, "pattern": r"^\d+$"},
        "close": {
            "type": "text_similarity",
            "name": "close",
            "input": OUTPUT,
            "reference": "{{item.answer}}",
            "evaluation_metric": "fuzzy_match",
        },
        "short": {"type": "length_penalty", "name": "short", "input": OUTPUT, "max_chars": 3, "min_score": None},
        "num": {"type": "numeric_match", "name": "num", "input": OUTPUT, "reference": "{{item.answer}}"},
    },
    "calculate_output": "exact + digits + close + short + num / (digits - 1)",
}
SAMPLES = [
    Sample("42", {"answer": "42"}),
    Sample("x41 and more", {"answer": "42"}),
    Sample("7", {}),  # a missing item field, no reference number, a division by zero: three kinds of error flag
]


@pytest.fixture(scope="module")
def pool() -> Iterator[GradingPool]:
    p = GradingPool(size=1)
    yield p
    p.close()


@pytest.fixture
def misbehaving() -> Iterator[GradingPool]:
    p = GradingPool(size=1, sample_timeout_s=1.0, command=misbehaving_command())
    yield p
    p.close()


def in_process(obj: dict[str, Any], samples: list[Sample]) -> list[GradeResult]:
    grader = parse_grader(obj)
    return [grade(grader, output_text=s.output_text, item=s.item) for s in samples]


class TestGrading:
    def test_results_are_those_of_grading_in_this_process(self, pool: GradingPool) -> None:
        batch = pool.run(MULTI, SAMPLES)
        assert batch.results == in_process(MULTI, SAMPLES)
        assert batch.grader == parse_grader(MULTI).model_dump(mode="json", exclude_none=True)
        assert len(batch.seconds) == len(SAMPLES) and all(s >= 0 for s in batch.seconds)

    def test_error_kinds_survive_the_trip(self, pool: GradingPool) -> None:
        [result] = pool.run(MULTI, SAMPLES[2:]).results
        assert [e.kind for e in result.errors] == [e.kind for e in in_process(MULTI, SAMPLES[2:])[0].errors]
        assert {e.kind for e in result.errors} == {"invalid_variable", "formula", "other"}

    def test_an_invalid_grader_is_a_grader_error_naming_the_field(self, pool: GradingPool) -> None:
        with pytest.raises(GraderError, match=r"grader\.operation: Input should be") as err:
            pool.run({**EXACT, "operation": "equals"}, SAMPLES)
        assert err.value.param == "grader.operation"

    def test_a_reward_model_leaf_without_its_scores_is_a_grader_error(self, pool: GradingPool) -> None:
        rm = {"type": "reward_model", "name": "rm", "model": "/nowhere"}
        with pytest.raises(GraderError, match="reward_model graders run a model over batches"):
            pool.run(rm, SAMPLES[:1])
        assert pool.run(rm, [Sample("4", {}, {"rm": 0.25})]).results[0].score == 0.25

    def test_no_samples_validates_only(self, pool: GradingPool) -> None:
        batch = pool.run(EXACT, [])
        assert batch.grader == EXACT and batch.results == []

    @pytest.mark.parametrize("obj", [MULTI, EXACT, {"type": "regex", "name": "r", "input": OUTPUT, "pattern": "a"}])
    def test_a_parsed_grader_survives_the_dump_the_trainer_sends(self, obj: dict[str, Any]) -> None:
        parsed = parse_grader(obj)
        assert parse_grader(parsed.model_dump(mode="json")) == parsed  # min_score None stays None: no clip


class TestHardTimeLimit:
    @pytest.mark.alone
    def test_a_sample_stuck_in_a_c_call_holding_the_gil_times_out_and_the_batch_goes_on(
        self, misbehaving: GradingPool
    ) -> None:
        samples = [Sample("4", {"answer": "4"}), Sample("hang", {"answer": "4"}), Sample("4", {"answer": "4"})]
        start = time.monotonic()
        batch = misbehaving.run(EXACT, samples)
        elapsed = time.monotonic() - start
        assert [r.score for r in batch.results] == [1.0, 0.0, 1.0]
        [error] = batch.results[1].errors
        assert error.kind == "timeout" and error == "grading this sample took longer than 1 s; scored 0.0"
        assert 1.0 <= batch.seconds[1] < 10.0
        assert elapsed < 60.0  # two process starts and one limit; the hung sample alone would never end

    def test_a_process_that_dies_is_replaced_and_the_sample_flagged(self, misbehaving: GradingPool) -> None:
        batch = misbehaving.run(EXACT, [Sample("crash", {"answer": "4"}), Sample("4", {"answer": "4"})])
        assert [r.score for r in batch.results] == [0.0, 1.0]
        [error] = batch.results[0].errors
        assert error.kind == "other" and "exited with code 3" in error

    def test_after_max_timeouts_the_rest_of_the_batch_is_not_graded(self) -> None:
        p = GradingPool(size=1, sample_timeout_s=0.5, max_timeouts=2, command=misbehaving_command())
        try:
            batch = p.run(EXACT, [Sample("hang", {"answer": "4"})] * 5)
        finally:
            p.close()
        kinds = [r.errors[0].kind for r in batch.results]
        assert kinds == ["timeout"] * 5
        assert [str(r.errors[0]).startswith("not graded: 2 samples") for r in batch.results] == [False] * 2 + [True] * 3

    def test_close_lets_the_batch_in_flight_finish_and_refuses_new_ones(self, misbehaving: GradingPool) -> None:
        with ThreadPoolExecutor(1) as other:
            running = other.submit(
                misbehaving.run, EXACT, [Sample("hang", {"answer": "4"}), Sample("4", {"answer": "4"})]
            )
            time.sleep(0.5)
            misbehaving.close()
            assert [r.score for r in running.result().results] == [0.0, 1.0]
        with pytest.raises(GradingUnavailable, match="the grading pool is closed"):
            misbehaving.run(EXACT, SAMPLES)

    def test_a_grader_that_takes_too_long_to_validate_is_a_grading_timeout(self) -> None:
        silent = [sys.executable, "-c", "import time; print('{\"ready\": true}', flush=True); time.sleep(60)"]
        p = GradingPool(size=1, sample_timeout_s=0.5, command=silent)
        try:
            with pytest.raises(GradingTimeout, match=r"validating the grader took longer than 0\.5 s"):
                p.run(EXACT, SAMPLES)
        finally:
            p.close()

    def test_a_process_that_cannot_start_is_grading_unavailable(self) -> None:
        p = GradingPool(size=1, command=[sys.executable, "-c", "raise SystemExit(2)"])
        with pytest.raises(GradingUnavailable, match="exited with code 2 as it started"):
            p.run(EXACT, SAMPLES)
        p.close()
        with pytest.raises(GradingUnavailable, match="closed"):
            p.run(EXACT, SAMPLES)


@pytest.mark.parametrize(
    "reply",
    [
        {"score": "1", "sub_scores": {}, "errors": []},
        {"score": True, "sub_scores": {}, "errors": []},
        {"score": 1.0, "sub_scores": {"a": None}, "errors": []},
        {"score": 1.0, "sub_scores": {}, "errors": [["message", "no-such-kind"]]},
        {"score": 1.0, "sub_scores": {}, "errors": "x"},
        {"score": 1.0},
    ],
)
def test_a_reply_that_is_not_a_result_is_refused(reply: dict[str, Any]) -> None:
    assert _result(reply) is None


def test_a_fresh_process_loads_meteors_wordnet_before_the_first_sample_is_timed() -> None:
    # WordNet takes seconds to load, once per process: more than this pool's sample limit. Loaded while the grader
    # is validated (trainer.grading.pool.PREPARE_TIMEOUT_S), the first sample's own limit never pays for it.
    meteor = {
        "type": "text_similarity",
        "name": "meteor",
        "input": OUTPUT,
        "reference": "{{item.answer}}",
        "evaluation_metric": "meteor",
    }
    p = GradingPool(size=1, sample_timeout_s=0.5)
    try:
        run = p.run(
            {"type": "multi", "name": "m", "graders": {"m": meteor}, "calculate_output": "m"},
            [Sample("the car is red", {"answer": "the auto is red"})],
        )
    finally:
        p.close()
    [result] = run.results
    assert result.errors == () and result.score == pytest.approx(0.9921875)

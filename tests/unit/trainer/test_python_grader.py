"""OpenAI's `python` grader: its model, the `sample` object, the error flags of its failures, the
batch grading of training (one sandbox per python leaf and batch) and the rule that fails a job whose grader fails
on most samples."""

from __future__ import annotations

from typing import Any

import pytest

from trainer.grading.graders import grade, python_grade_error, sample_object
from trainer.grading.sandbox import sandbox_available
from trainer.loops import evaluate
from trainer.spec import graders
from trainer.spec import metrics as M
from trainer.spec.callbacks import BaseCallback
from trainer.spec.data import PromptItem

EXACT = 'def grade(sample, item):\n    return float(sample["output_text"].strip() == item["answer"])\n'


def python(source: str = EXACT, **fields: Any) -> dict[str, Any]:
    return {"type": "python", "name": "py", "source": source, **fields}


class TestModel:
    def test_openais_shape_parses_with_name_and_image_tag_optional(self) -> None:
        grader = graders.parse_grader({"type": "python", "source": EXACT})
        assert isinstance(grader, graders.PythonGrader)
        assert (grader.name, grader.image_tag) == ("python", None)
        assert graders.parse_grader(python(image_tag="2025-05-08")).model_dump(exclude_none=True) == python(
            image_tag="2025-05-08"
        )

    @pytest.mark.parametrize(
        ("obj", "param", "says"),
        [
            (python(image_tag="2024-01-01"), "grader.image_tag", "valid: 2025-05-08"),
            (python(source="#" * (256 * 1024 + 1)), "grader.source", "at most 262144 bytes"),
            ({"type": "python", "name": "py"}, "grader.source", "field required"),
            (python(timeout=3), "grader.timeout", "unknown field"),
        ],
    )
    def test_bad_fields_are_named(self, obj: dict[str, Any], param: str, says: str) -> None:
        with pytest.raises(graders.GraderError, match=says) as caught:
            graders.parse_grader(obj)
        assert caught.value.param == param

    def test_allowed_inside_multi_and_its_sources_are_found_by_path(self) -> None:
        inner = {"type": "multi", "name": "in", "graders": {"b": python("b")}, "calculate_output": "b"}
        obj = {"type": "multi", "name": "m", "graders": {"a": python("a"), "n": inner}, "calculate_output": "a + n"}
        grader = graders.parse_grader(obj)
        assert [(key, leaf.source) for key, leaf in graders.python_graders(grader)] == [("a", "a"), ("n.b", "b")]
        assert graders.python_grader_params(obj, "method.grpo.grader") == [
            ("method.grpo.grader.graders.a.source", "a"),
            ("method.grpo.grader.graders.n.graders.b.source", "b"),
        ]

    def test_grade_without_the_sandboxs_scores_is_an_error_and_with_them_uses_them(self) -> None:
        grader = graders.parse_grader(
            {"type": "multi", "name": "m", "graders": {"p": python()}, "calculate_output": "p * 2"}
        )
        with pytest.raises(graders.GraderError, match="sandbox"):
            grade(grader, output_text="x", item={})
        assert grade(grader, output_text="x", item={}, model_scores={"p": 0.25}).score == 0.5


class TestSampleObject:
    def test_openais_fields_for_a_chat_completion(self) -> None:
        assert sample_object('{"a": [1, 2]}') == {
            "output_text": '{"a": [1, 2]}',
            "output_json": {"a": [1, 2]},
            "output_tools": [],
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": '{"a": [1, 2]}', "tool_calls": []},
                    "finish_reason": "stop",
                }
            ],
            "output_audio": None,
        }

    @pytest.mark.parametrize("text", ["not json", "", "NaN", "[1, Infinity]", "[" * 100_000])
    def test_output_json_is_null_when_the_text_is_not_json(self, text: str) -> None:
        assert sample_object(text)["output_json"] is None


class TestErrorKinds:
    @pytest.mark.parametrize(
        ("cause", "kind"),
        [
            ("exception", "python_runtime"),
            ("not_a_number", "python_runtime"),
            ("non_finite", "python_runtime"),
            ("invalid_source", "python_runtime"),
            ("timeout", "python_server"),
            ("cpu_limit", "python_server"),
            ("output_limit", "python_server"),
            ("crash", "python_server"),
        ],
    )
    def test_each_sandbox_result_kind_is_a_runtime_or_server_error(self, cause: str, kind: str) -> None:
        error = python_grade_error("py", cause, "what happened")
        assert (error.kind, error.cause) == (kind, cause) and "what happened" in error
        assert error.kind in graders.FAILURE_KINDS


def items(answers: list[str]) -> list[PromptItem]:
    return [PromptItem(messages=[{"role": "user", "content": "?"}], item={"answer": a}) for a in answers]


@pytest.fixture
def sandbox_here() -> None:
    reason = sandbox_available()
    if reason is not None:
        pytest.fail(f"the python grader's sandbox is unavailable here: {reason}")


@pytest.mark.usefixtures("sandbox_here")
class TestGradeBatch:
    def test_64_samples_score_exactly_in_one_sandbox(self) -> None:
        answers = [str(i) for i in range(64)]
        texts = [f" {i}\n" if i % 3 else "wrong" for i in range(64)]
        starts = evaluate.python_sandbox().starts
        scores = evaluate.grade_batch(graders.parse_grader(python()), texts, items(answers))
        assert evaluate.python_sandbox().starts == starts + 1
        assert scores.rewards.tolist() == [1.0 if i % 3 else 0.0 for i in range(64)]
        assert scores.sub["py"].tolist() == scores.rewards.tolist()
        assert scores.failures == [None] * 64

    def test_each_sample_gets_its_finish_reason(self) -> None:
        # A completion cut at the token limit is `length` in OpenAI's sample, one that ended itself `stop`.
        source = (
            "def grade(sample, item):\n    return 1.0 if sample['choices'][0]['finish_reason'] == 'length' else 0.5\n"
        )
        grader = graders.parse_grader(python(source))
        scores = evaluate.grade_batch(grader, ["a", "b", "c"], items(["1", "2", "3"]), ["length", "stop", "length"])
        assert scores.rewards.tolist() == [1.0, 0.5, 1.0]
        assert evaluate.grade_batch(grader, ["a"], items(["1"])).rewards.tolist() == [0.5]  # none given: stop

    def test_python_leaves_of_a_multi_share_a_sandbox_per_source_and_failures_are_kept(self) -> None:
        failing = "def grade(sample, item):\n    return 1 / int(sample['output_text'])\n"
        obj = {
            "type": "multi",
            "name": "m",
            "graders": {"a": python(), "b": python(), "c": python(failing, name="c")},
            "calculate_output": "a + b + c",
        }
        starts = evaluate.python_sandbox().starts
        scores = evaluate.grade_batch(graders.parse_grader(obj), ["1", "0"], items(["1", "0"]))
        assert evaluate.python_sandbox().starts == starts + 2  # a and b: one sandbox; c: another
        assert scores.rewards.tolist() == [3.0, 2.0]
        assert {k: v.tolist() for k, v in scores.sub.items()} == {"a": [1.0, 1.0], "b": [1.0, 1.0], "c": [1.0, 0.0]}
        first, second = scores.failures
        assert first is None and second is not None
        assert (second.kind, second.cause) == ("python_runtime", "exception") and "ZeroDivisionError" in second

    def test_no_sandbox_fails_the_job_saying_why(self, monkeypatch: pytest.MonkeyPatch) -> None:
        from trainer.grading.sandbox import PythonSandbox, SandboxConfig

        monkeypatch.setattr(evaluate, "_sandbox", PythonSandbox(SandboxConfig(bwrap="no-such-bwrap")))
        with pytest.raises(graders.GraderFailed, match="no-such-bwrap is not installed"):
            evaluate.grade_batch(graders.parse_grader(python()), ["1"], items(["1"]))


class Recorder(BaseCallback):
    def __init__(self) -> None:
        self.events: list[tuple[str, str, dict[str, Any] | None]] = []

    def on_event(self, level: Any, message: str, data: dict[str, Any] | None = None) -> None:
        self.events.append((level, message, data))


def scores(n: int, failed: int, cause: str = "timeout") -> evaluate.Scores:
    import torch

    error = python_grade_error("py", cause, "grade took longer than 10 s")
    errors = [(error,) if i < failed else () for i in range(n)]
    return evaluate.Scores(torch.zeros(n), {}, ["x"] * n, errors)


class TestGraderMonitor:
    def monitor(self) -> tuple[evaluate.GraderMonitor, Recorder]:
        cb = Recorder()
        return evaluate.GraderMonitor(cb, graders.parse_grader(python())), cb

    def test_the_error_rate_is_the_steps_and_each_kind_is_an_event_once(self) -> None:
        monitor, cb = self.monitor()
        monitor.observe(scores(16, 2))
        monitor.observe(scores(16, 1, "crash"))
        assert monitor.metrics() == {M.GRADER_ERROR_RATE: 3 / 32}
        monitor.end_step(1)
        assert [(level, data) for level, _, data in cb.events] == [
            ("warn", {"step": 1, "kind": "python_server", "cause": "timeout", "count": 2, "samples": 32}),
            ("warn", {"step": 1, "kind": "python_server", "cause": "crash", "count": 1, "samples": 32}),
        ]
        assert "grade took longer than 10 s" in cb.events[0][1]
        monitor.observe(scores(32, 1))
        assert monitor.metrics() == {M.GRADER_ERROR_RATE: 1 / 32}
        monitor.end_step(2)
        assert len(cb.events) == 2  # a kind already reported is counted, not reported again

    def test_a_single_failed_step_or_failures_below_half_never_fail_the_job(self) -> None:
        monitor, _ = self.monitor()
        for step, failed in enumerate([16, 16, 0, 32, 16, 32], start=1):  # 16 of 32 is not more than half
            monitor.observe(scores(32, failed))
            monitor.end_step(step)

    def test_most_samples_failing_on_two_consecutive_steps_fails_the_job(self) -> None:
        monitor, _ = self.monitor()
        monitor.observe(scores(16, 9, "exception"))
        monitor.end_step(1)
        monitor.observe(scores(16, 16, "exception"))
        with pytest.raises(graders.GraderFailed, match=r"'py' produced no score .* 2 consecutive steps .*exception"):
            monitor.end_step(2)

    def test_small_steps_fail_once_the_failed_steps_hold_16_samples(self) -> None:
        monitor, _ = self.monitor()
        for step in range(1, 4):
            monitor.observe(scores(4, 4))
            monitor.end_step(step)
        monitor.observe(scores(4, 4))
        with pytest.raises(graders.GraderFailed, match="4 consecutive steps"):
            monitor.end_step(4)

    def test_the_metric_is_in_the_vocabulary(self) -> None:
        assert M.is_known(M.GRADER_ERROR_RATE)

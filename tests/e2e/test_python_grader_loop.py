"""The online RL loop with OpenAI's `python` grader: two GRPO steps on a small random model whose
rewards come from a grader's code run in the sandbox, one sandbox per graded batch."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.e2e.test_rl_loop import make_spec, read_metrics
from trainer.grading.sandbox import sandbox_available
from trainer.loops import evaluate
from trainer.spec import metrics as M
from trainer.spec.callbacks import JsonlFiles
from trainer.spec.config import parse_spec
from trainer.spec.graders import GraderFailed
from trainer.train import train

# The item is the dataset row: the grader reads its answer and the sample's text, as OpenAI's guide shows.
SOURCE = """
def grade(sample, item):
    text = sample["output_text"]
    assert sample["choices"][0]["message"]["content"] == text and item["answer"].isdigit()
    return len(text) / 10
"""


def test_grpo_trains_on_a_python_graders_rewards(random_model_dir: Path, arithmetic_data: Path, tmp_path: Path) -> None:
    reason = sandbox_available()
    if reason is not None:
        pytest.fail(f"the python grader's sandbox is unavailable here: {reason}")
    raw = make_spec(random_model_dir, arithmetic_data, max_steps=2, batch_size=2, group_size=4, eval_prompts=4)
    raw["method"]["grpo"]["grader"] = {
        "type": "multi",
        "name": "m",
        "graders": {"py": {"type": "python", "name": "py", "source": SOURCE}},
        "calculate_output": "py",
    }
    starts = evaluate.python_sandbox().starts
    res = train(parse_spec(raw), output_dir=tmp_path, callback=JsonlFiles(tmp_path))
    assert res.adapter_dir is not None
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert rows[-1][M.reward_of("py")] == pytest.approx(rows[-1][M.REWARD_MEAN]) and rows[-1][M.REWARD_MEAN] > 0
    assert [r.get(M.GRADER_ERROR_RATE) for r in rows[1:]] == [0.0, 0.0]
    rollouts = [json.loads(ln) for ln in (tmp_path / "rollouts.jsonl").read_text().splitlines()]
    assert rollouts, "no rollouts were logged"
    for r in rollouts:  # each logged reward is exactly what the grader's code makes of the completion
        assert r["reward"] == pytest.approx(len(r["completion"]) / 10, abs=1e-6)
    # one sandbox per graded batch: two training steps and validation at steps 0 and 2 (eval_interval 2)
    assert evaluate.python_sandbox().starts == starts + 4


def test_a_grader_failing_on_most_samples_fails_the_run_after_two_steps_with_its_metric_and_event(
    random_model_dir: Path, arithmetic_data: Path, tmp_path: Path
) -> None:
    raw = make_spec(random_model_dir, arithmetic_data, max_steps=4, batch_size=2, group_size=4, eval_interval=0)
    source = "def grade(sample, item):\n    return {}[sample['output_text']]\n"  # KeyError on every sample
    raw["method"]["grpo"]["grader"] = {"type": "python", "name": "broken", "source": source}
    with pytest.raises(GraderFailed, match=r"'broken' produced no score for most samples of 2 consecutive steps"):
        train(parse_spec(raw), output_dir=tmp_path, callback=JsonlFiles(tmp_path))
    rows = read_metrics(tmp_path)
    assert [(r["step"], r[M.GRADER_ERROR_RATE], r[M.REWARD_MEAN]) for r in rows] == [(1, 1.0, 0.0), (2, 1.0, 0.0)]
    events = [json.loads(ln) for ln in (tmp_path / "events.jsonl").read_text().splitlines()]
    failures = [e for e in events if e["data"].get("kind") == "python_runtime"]
    assert len(failures) == 1 and "KeyError" in failures[0]["message"]  # one event per kind, not one per step
    assert failures[0]["data"] == {"step": 1, "kind": "python_runtime", "cause": "exception", "count": 8, "samples": 8}

"""An online RL job with OpenAI's RFT ``response_format`` on the real tiny-calc: every rollout, training and
validation, is JSON the schema admits, and the python grader reads it parsed as ``sample["output_json"]``.

tiny-calc's one token with ``{`` opens its calculator call whole (``{"name": "calculator", "arguments":
{"expression": "``) and ``"}}`` closes it, so the schema is that object with the expression a short string: offered
no tools, the model writes it only because the format makes it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import torch

from trainer.builtin_models.tiny_calc import write_calculator_datasets
from trainer.spec import metrics as M
from trainer.spec.callbacks import JsonlFiles
from trainer.spec.config import SpecError, parse_spec
from trainer.train import train

MAX_EXPRESSION = 12
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"const": "calculator"},
        "arguments": {
            "type": "object",
            "properties": {"expression": {"type": "string", "maxLength": MAX_EXPRESSION}},
            "required": ["expression"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "arguments"],
    "additionalProperties": False,
}
# 1.0 for an expression that sums to the answer, 0.25 for any other: 0.0 only where output_json is not the object
GRADER_SOURCE = """
def grade(sample, item):
    out = sample["output_json"]
    if not isinstance(out, dict) or out.get("name") != "calculator":
        return 0.0
    parts = out["arguments"]["expression"].split("+")
    total = sum(int(p) for p in parts) if all(p.isdigit() for p in parts) else None
    return 1.0 if total == int(item["answer"]) else 0.25
"""


def expected_reward(completion: str, answer: str) -> float:
    """The grader's score, computed here from the completion's text."""
    parts = json.loads(completion)["arguments"]["expression"].split("+")
    total = sum(int(p) for p in parts) if all(p.isdigit() for p in parts) else None
    return 1.0 if total == int(answer) else 0.25


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


def job(model: Path, data: Path, schema: dict[str, Any], **hp: Any) -> dict[str, Any]:
    train_file, val_file = write_calculator_datasets(data, n_train=8)
    return {
        "model": str(model),
        "training_file": str(train_file),
        "validation_file": str(val_file),
        "seed": 0,
        "method": {
            "type": "reinforcement",
            "reinforcement": {
                "grader": {"type": "python", "name": "sum", "source": GRADER_SOURCE},
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "call", "schema": schema, "strict": True},
                },
                "hyperparameters": {"max_steps": 1, "eval_prompts": 4, "precision": "fp32", **hp},
            },
        },
    }


def test_every_rollout_validates_and_the_grader_reads_it_as_output_json(tiny_calc_dir: Path, tmp_path: Path) -> None:
    batch, group = 2, 4
    # the head, at most 12 one-character tokens, the close and EOS: nothing is cut
    hp = {"batch_size": batch, "group_size": group, "max_completion_tokens": MAX_EXPRESSION + 3}
    raw = job(tiny_calc_dir, tmp_path / "data", SCHEMA, rollouts_logged=batch * group, **hp)
    train_file = Path(raw["training_file"])
    out = tmp_path / "run"
    train(parse_spec(raw), output_dir=out, callback=JsonlFiles(out))

    rows = [json.loads(ln) for ln in (out / "rollouts.jsonl").read_text().splitlines()]
    assert len(rows) == batch * group
    answers = {json.dumps(json.loads(ln)["messages"]): json.loads(ln)["answer"] for ln in train_file.open()}
    for r in rows:
        jsonschema.validate(json.loads(r["completion"]), SCHEMA)
        assert r["reward"] == expected_reward(r["completion"], answers[json.dumps(r["prompt"])])
    [metrics] = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    assert metrics[M.TRUNCATED_FRAC] == 0.0
    # validation's greedy answers are constrained too: a reward of 0.0 would be one that is not the object
    assert metrics[M.VAL_REWARD_MEAN] >= 0.25


def test_a_format_the_vocabulary_cannot_begin_fails_the_run_naming_it_before_training(
    tiny_calc_dir: Path, tmp_path: Path
) -> None:
    out = tmp_path / "run"
    # no token of tiny-calc's begins true or false
    raw = job(tiny_calc_dir, tmp_path / "data", {"type": "boolean"}, max_completion_tokens=4)
    with pytest.raises(SpecError) as err:
        train(parse_spec(raw), output_dir=out, callback=JsonlFiles(out))
    assert err.value.param == "method.reinforcement.response_format"
    assert "cannot write an answer in this format" in str(err.value)
    assert not (out / "metrics.jsonl").exists() or not (out / "metrics.jsonl").read_text()  # no step ran

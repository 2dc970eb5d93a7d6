"""worker.messages: every runner message survives the line protocol unchanged; a line that is not a known message of
the right shape is refused where it is read."""

from __future__ import annotations

import json
import math
from typing import get_args

import pytest
from pydantic import ValidationError

from worker import messages as msg
from worker.errors import ErrorCode

EXAMPLES: list[msg.RunnerMessage] = [
    msg.Started(total_steps=12),
    msg.Event(level="warn", message="Skipped 2 groups", data={"step": 3, "groups": [1, 4]}),
    msg.Metrics(step=4, metrics={"reward/mean": 0.25, "kl/mean": None}),
    msg.Rollouts(step=4, rollouts=[{"prompt": "What is 1 + 1?", "completion": "2", "rewards": {"exact": 1.0}}]),
    msg.Checkpoint(step=5, path="/runs/job/checkpoints/step-000005", metrics={"reward/mean": 0.5}),
    msg.Stopping(completed_step=6),
    msg.Done(stopped=True, last_step=7, total_steps=12, adapter_dir=None),
    msg.Error(
        code=ErrorCode.INVALID_FILE,
        message="/runs/job/data/train.jsonl:3: no prompt",
        path="/runs/job/data/train.jsonl",
        line=3,
        detail="no prompt",
    ),
]


def test_the_examples_cover_every_message_kind() -> None:
    (union, _) = get_args(msg.RunnerMessage)
    assert {type(m) for m in EXAMPLES} == set(get_args(union))


@pytest.mark.parametrize("message", EXAMPLES, ids=lambda m: m.kind)
def test_every_message_round_trips_through_one_line(message: msg.RunnerMessage) -> None:
    line = msg.encode(message)
    assert "\n" not in line
    assert json.loads(line)["kind"] == message.kind
    decoded = msg.decode(line)
    assert type(decoded) is type(message) and decoded == message


def test_values_json_cannot_hold_are_sent_as_null() -> None:
    line = msg.encode(msg.Metrics(step=1, metrics={"a": math.nan, "b": math.inf, "c": 1.5}))
    assert json.loads(line)["metrics"] == {"a": None, "b": None, "c": 1.5}


@pytest.mark.parametrize(
    "line",
    [
        '{"kind": "progress", "step": 1}',  # an unknown kind
        '{"step": 1, "metrics": {}}',  # no kind
        '{"kind": "metrics", "step": 1}',  # a field missing
        '{"kind": "started", "total_steps": 3, "eta": 4}',  # a field the message does not have
        '{"kind": "error", "code": "disk_full", "message": "no space"}',  # not an error code
        '{"kind": "started", "total_steps": "many"}',  # the wrong type
        "not json",
    ],
)
def test_a_line_that_is_not_a_known_message_is_refused(line: str) -> None:
    with pytest.raises(ValidationError):
        msg.decode(line)

"""An eval run's final statuses are the keys of its events: the enum's members, every terminal one."""

from __future__ import annotations

from api.status import EVAL_RUN_TERMINAL, EvalRunStatus
from api.webhook_events import EVAL_RUN_EVENTS


def test_the_events_are_keyed_by_the_runs_terminal_statuses() -> None:
    assert all(type(status) is EvalRunStatus for status in EVAL_RUN_EVENTS)
    assert set(EVAL_RUN_EVENTS) == EVAL_RUN_TERMINAL
    assert EVAL_RUN_EVENTS[EvalRunStatus.COMPLETED] == "eval.run.succeeded"

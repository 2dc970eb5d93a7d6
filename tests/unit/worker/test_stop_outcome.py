"""How a run that stopped early ends: the worker's decision after its child process has stopped."""

from __future__ import annotations

import pytest

from worker.job_finish import stopped_as


@pytest.mark.parametrize(
    ("stop_reason", "cancel_now", "ends_as"),
    [
        ("pause", False, "pause"),
        ("cancel", True, "cancel"),
        # The race the dashboard's pause-then-cancel test met: the worker had read the pause and told the run to
        # stop; the cancel came while it was stopping. It ended paused, the cancel ignored.
        ("pause", True, "cancel"),
        (None, True, "cancel"),
    ],
)
def test_a_cancel_set_by_the_time_the_run_has_stopped_wins_over_the_pause_it_stopped_for(
    stop_reason: str | None, cancel_now: bool, ends_as: str
) -> None:
    assert stopped_as(stop_reason, cancel_now=cancel_now) == ends_as

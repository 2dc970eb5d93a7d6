"""worker.estimate: a running job's time left, with hand-computed values."""

from __future__ import annotations

import pytest

from trainer.loops.steps import validation_due
from worker.estimate import (
    Cadence,
    StepTime,
    due_between,
    estimated_finish,
    eval_seconds,
    ran_validation,
    remaining_seconds,
    step_seconds,
)


def plain(*seconds: float) -> list[StepTime]:
    return [StepTime(step=i + 1, seconds=s, evaluated=False) for i, s in enumerate(seconds)]


def test_the_remaining_time_adds_steps_validations_and_checkpoints_each_at_its_measured_cost() -> None:
    times = [
        StepTime(step=1, seconds=2.0, evaluated=False),
        StepTime(step=2, seconds=3.0, evaluated=True),
        StepTime(step=3, seconds=2.2, evaluated=False),
        StepTime(step=4, seconds=1.8, evaluated=False),
    ]
    cadence = Cadence(total_steps=10, eval_interval=2, checkpoint_interval=5, validates=True)
    # t_step = median(2.0, 2.2, 1.8) = 2.0; t_eval = 3.0 − 2.0 = 1.0; t_checkpoint = 0.5.
    # After step 4: 6 steps, validations at 6, 8, 10, checkpoints at 5 and 10: 6·2.0 + 3·1.0 + 2·0.5 = 16.0.
    assert remaining_seconds(times, [0.5], done=4, cadence=cadence) == pytest.approx(16.0)
    assert estimated_finish(times, [0.5], done=4, cadence=cadence, now=1000.2) == 1017  # 1016.2, rounded up


def test_the_step_time_is_the_median_of_the_latest_window_so_one_slow_step_does_not_move_it() -> None:
    assert step_seconds(plain(1.0, 1.0, 50.0, 1.0)) == 1.0  # the mean would say 13.25
    # 12 steps of 1 … 12 s: the latest 10 are 3 … 12, median 7.5.
    times = plain(*[float(s) for s in range(1, 13)])
    assert step_seconds(times, window=10) == 7.5
    cadence = Cadence(total_steps=20, eval_interval=0, checkpoint_interval=10, validates=False)
    assert remaining_seconds(times, [], done=12, cadence=cadence, window=10) == pytest.approx(8 * 7.5)


def test_a_job_without_validation_data_counts_no_validation_and_checkpoints_fall_on_the_interval_and_the_end() -> None:
    times = [*plain(1.0, 1.0), StepTime(step=3, seconds=4.0, evaluated=True)]
    checkpoints = [0.2, 0.4, 0.3]  # median 0.3
    # Checkpoints after step 3 of 7 every 3 steps: at 6 and at the last step 7.
    with_val = Cadence(total_steps=7, eval_interval=0, checkpoint_interval=3, validates=True)
    without = Cadence(total_steps=7, eval_interval=0, checkpoint_interval=3, validates=False)
    # t_step = 1.0, t_eval = 3.0; with validation data one validation (the last step) is left.
    assert remaining_seconds(times, checkpoints, done=3, cadence=with_val) == pytest.approx(4 * 1.0 + 3.0 + 2 * 0.3)
    assert remaining_seconds(times, checkpoints, done=3, cadence=without) == pytest.approx(4 * 1.0 + 2 * 0.3)


def test_when_every_step_validates_the_step_time_already_holds_the_validation() -> None:
    times = [StepTime(step=1, seconds=3.0, evaluated=True), StepTime(step=2, seconds=5.0, evaluated=True)]
    assert step_seconds(times) == 4.0
    assert eval_seconds(times, 4.0) == 0.0
    cadence = Cadence(total_steps=4, eval_interval=1, checkpoint_interval=10, validates=True)
    assert remaining_seconds(times, [], done=2, cadence=cadence) == pytest.approx(8.0)


def test_a_validation_faster_than_the_median_step_adds_nothing_rather_than_a_negative_time() -> None:
    times = [*plain(2.0, 2.0), StepTime(step=3, seconds=1.5, evaluated=True)]
    assert eval_seconds(times, 2.0) == 0.0


def test_no_measured_step_gives_no_estimate_and_the_last_step_leaves_nothing() -> None:
    cadence = Cadence(total_steps=5, eval_interval=1, checkpoint_interval=1, validates=True)
    assert remaining_seconds([], [1.0], done=0, cadence=cadence) is None
    assert estimated_finish([], [], done=0, cadence=cadence, now=50.0) is None
    assert remaining_seconds(plain(2.0), [1.0], done=5, cadence=cadence) == 0.0
    assert estimated_finish(plain(2.0), [1.0], done=5, cadence=cadence, now=50.0) == 50


@pytest.mark.parametrize("interval", [0, 1, 2, 3, 5])
def test_due_between_counts_the_validations_the_trainer_runs(interval: int) -> None:
    for total in range(1, 13):
        for done in range(total + 1):
            expected = sum(validation_due(s, interval=interval, total_steps=total) for s in range(done + 1, total + 1))
            assert due_between(done, total, interval) == expected, (done, total, interval)


def test_a_step_ran_a_validation_when_its_metrics_hold_a_validation_series() -> None:
    assert ran_validation({"reward/mean": 0.5, "val/reward/mean": 0.25})
    assert ran_validation({"val/loss": 1.0})
    assert not ran_validation({"reward/mean": 0.5, "time/step_s": 1.0})

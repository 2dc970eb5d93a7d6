"""A running job's ``estimated_finish``: the time left, from the steps measured so far.

Pure functions of what the worker has seen (no clock, no torch), refined at every step:

    remaining = (T − done) · t_step + evals_left · t_eval + checkpoints_left · t_checkpoint

- ``t_step``: the median of the latest :data:`WINDOW` training steps' ``time/step_s`` without a validation run (a
  median, so that one slow step, a page fault or a grader timeout, does not move the estimate, and the latest ones,
  so that it follows a run whose steps get faster or slower);
- ``t_eval``: what a validation run adds to its step, the median over the latest steps that ran one of
  (``time/step_s`` − ``t_step``), 0 until one has run;
- ``t_checkpoint``: the median of the latest checkpoints' measured times, 0 until one has been written;
- the validation and checkpoint cadence as the trainer follows it (``trainer.loops.steps``): a validation every
  ``eval_interval`` steps and at the last step (when the job has validation data), a checkpoint every
  ``checkpoint_interval`` steps and at the last step.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

WINDOW = 10
"""How many of the latest measurements each median takes."""
VALIDATION_PREFIX = "val/"


@dataclass(frozen=True)
class StepTime:
    """One training step as measured: ``seconds`` is its ``time/step_s``, a validation run included when it ran one
    (``evaluated``)."""

    step: int
    seconds: float
    evaluated: bool


@dataclass(frozen=True)
class Cadence:
    """The run's length and what it does besides training steps."""

    total_steps: int
    eval_interval: int  # 0: validation only at the last step
    checkpoint_interval: int
    validates: bool  # the job has validation data


def ran_validation(metrics: Mapping[str, object]) -> bool:
    """Whether a step ran a validation: its metrics hold a validation series (``val/…``, as
    ``trainer.spec.metrics.validation`` names them)."""
    return any(name.startswith(VALIDATION_PREFIX) for name in metrics)


def due_between(done: int, total: int, interval: int) -> int:
    """Steps s in (done, total] at which something runs every ``interval`` steps (0: never in between) and at the
    last step: ``trainer.loops.steps.validation_due``'s and the checkpoint cadence's count."""
    if done >= total:
        return 0
    every = total // interval - done // interval if interval else 0
    return every + (0 if interval and total % interval == 0 else 1)


def _median_latest(values: Sequence[float], window: int) -> float | None:
    return statistics.median(values[-window:]) if values else None


def step_seconds(times: Sequence[StepTime], *, window: int = WINDOW) -> float | None:
    """``t_step``: the median of the latest ``window`` training steps without validation (of all steps when every
    step so far ran one); None before any step."""
    plain = [t.seconds for t in times if not t.evaluated]
    return _median_latest(plain or [t.seconds for t in times], window)


def eval_seconds(times: Sequence[StepTime], t_step: float, *, window: int = WINDOW) -> float:
    """``t_eval``: the median over the latest ``window`` steps that ran a validation of what it added to the step
    (never below 0); 0 when none has run, or when every step ran one (``t_step`` already holds it)."""
    if all(t.evaluated for t in times):
        return 0.0
    extra = [max(t.seconds - t_step, 0.0) for t in times if t.evaluated]
    return _median_latest(extra, window) or 0.0


def remaining_seconds(
    times: Sequence[StepTime],
    checkpoint_seconds: Sequence[float],
    *,
    done: int,
    cadence: Cadence,
    window: int = WINDOW,
) -> float | None:
    """Seconds left after step ``done``; None before any step has been measured."""
    t_step = step_seconds(times, window=window)
    if t_step is None:
        return None
    steps_left = max(cadence.total_steps - done, 0)
    evals = due_between(done, cadence.total_steps, cadence.eval_interval) if cadence.validates else 0
    checkpoints = due_between(done, cadence.total_steps, cadence.checkpoint_interval)
    t_eval = eval_seconds(times, t_step, window=window)
    t_checkpoint = _median_latest(checkpoint_seconds, window) or 0.0
    return steps_left * t_step + evals * t_eval + checkpoints * t_checkpoint


def estimated_finish(
    times: Sequence[StepTime],
    checkpoint_seconds: Sequence[float],
    *,
    done: int,
    cadence: Cadence,
    now: float,
    window: int = WINDOW,
) -> int | None:
    """``estimated_finish`` as OpenAI's job object holds it: a unix time in whole seconds (rounded up), or None."""
    left = remaining_seconds(times, checkpoint_seconds, done=done, cadence=cadence, window=window)
    if left is None:
        return None
    return int(-(-(now + left) // 1))

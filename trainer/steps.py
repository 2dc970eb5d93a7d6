"""The step loop every method shares (:func:`run_steps`) and what it drives (:class:`StepLoop`).

A loop (online RL, preference, supervised) is a :class:`StepLoop`: one training step, validation, checkpoint save
and restore. :func:`run_steps` resumes from the latest checkpoint, validates at step 0, checkpoints every
``checkpoint_interval`` steps and at the end, stops between steps when the callback asks (saving first) and copies
the final adapter. The dispatcher (``trainer.train``) imports the loops; the loops import this module; nothing
imports the dispatcher but its callers (the CLI, the worker's runner).
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from trainer import checkpoint as ckpt
from trainer.callbacks import Callback
from trainer.config import Hyperparameters, JobSpec
from trainer.engine import Engine


@dataclass(frozen=True)
class RunResult:
    last_step: int
    total_steps: int
    stopped: bool  # True when should_stop() ended the run early
    adapter_dir: Path | None  # the final adapter (None when stopped early)
    final_metrics: dict[str, float]


class StepLoop(Protocol):
    """What :func:`run_steps` drives: a loop's step, checkpoint save/restore and validation."""

    out: Path
    cb: Callback
    spec: JobSpec
    total_steps: int

    @property
    def precision(self) -> str: ...

    def load_state(self, state: dict[str, Any]) -> int:
        """Restore a checkpoint's trainer state; returns its step."""
        ...

    def save(self, step: int, metrics: dict[str, float]) -> ckpt.Checkpoint:
        """Write a checkpoint of ``step`` (and tell the callback)."""
        ...

    def step(self, step: int) -> dict[str, float]:
        """One training step; reports and returns its metrics."""
        ...

    def validation_metrics(self) -> dict[str, float]: ...


class Trainer(Protocol):
    """A loop ready to run: what ``trainer.train.build_trainer`` returns."""

    total_steps: int
    cb: Callback

    def run(self, *, resume: bool = False) -> RunResult: ...


class EngineLoop:
    """What the three loops share around their :class:`~trainer.engine.Engine`: :meth:`run` through
    :func:`run_steps`, and checkpoints saved and restored by the engine. A loop adds ``step`` and
    ``validation_metrics``, says whether it has validation data, and may write more into a checkpoint
    (:meth:`on_saved`)."""

    spec: JobSpec
    out: Path
    cb: Callback
    hp: Hyperparameters
    engine: Engine
    total_steps: int

    def has_validation_data(self) -> bool:
        raise NotImplementedError

    def run(self, *, resume: bool = False) -> RunResult:
        return run_steps(
            self,  # type: ignore[arg-type]  # the subclass completes the protocol (step, validation_metrics)
            resume=resume,
            validate_first=self.has_validation_data() and bool(self.hp.eval_interval),
            checkpoint_interval=self.hp.checkpoint_interval,
        )

    def load_state(self, state: dict[str, Any]) -> int:
        return self.engine.load_state(state)

    def save(self, step: int, metrics: dict[str, float]) -> ckpt.Checkpoint:
        c = self.engine.save_checkpoint(self.out, step=step, spec=self.spec.to_json(), metrics=metrics)
        self.on_saved(step, c)
        self.cb.on_checkpoint(step, c.path, metrics)
        return c

    def on_saved(self, step: int, checkpoint: ckpt.Checkpoint) -> None:
        """Called after a checkpoint is written, before the callback hears of it."""


def run_steps(loop: StepLoop, *, resume: bool, validate_first: bool, checkpoint_interval: int) -> RunResult:
    """Resume from the latest checkpoint, validation at step 0, a checkpoint every ``checkpoint_interval`` steps and
    at the end, a stop between steps (saved first), the final adapter."""
    cb = loop.cb
    start = 0
    latest = ckpt.latest_checkpoint(loop.out) if resume else None
    if latest is not None:
        start = loop.load_state(ckpt.load_state(latest))
        cb.on_event("info", f"resumed from checkpoint at step {start}", {"step": start})
    else:
        cb.on_event(
            "info",
            f"training {loop.spec.method.type} on {loop.spec.model} for {loop.total_steps} steps",
            {"total_steps": loop.total_steps, "precision": loop.precision},
        )
    last_metrics: dict[str, float] = {}
    if start == 0 and validate_first:
        cb.on_metrics(0, loop.validation_metrics())  # the starting point of the validation curve
    last_saved = start
    step = start
    for step in range(start + 1, loop.total_steps + 1):
        if cb.should_stop():
            step -= 1
            if last_saved != step:
                loop.save(step, last_metrics)
            cb.on_event("info", f"stopped at step {step}", {"step": step})
            return RunResult(step, loop.total_steps, True, None, last_metrics)
        last_metrics = loop.step(step)
        if step % checkpoint_interval == 0 or step == loop.total_steps:
            loop.save(step, last_metrics)
            last_saved = step
    adapter = loop.out / "adapter"
    shutil.rmtree(adapter, ignore_errors=True)
    final = ckpt.latest_checkpoint(loop.out)
    assert final is not None and final.step == loop.total_steps
    shutil.copytree(final.adapter_dir, adapter)
    cb.on_event("info", "training finished", {"step": step})
    return RunResult(loop.total_steps, loop.total_steps, False, adapter, last_metrics)


def validation_due(step: int, *, interval: int, total_steps: int) -> bool:
    """Validation runs every ``interval`` steps (0: never in between) and at the last step."""
    return bool(interval and step % interval == 0) or step == total_steps

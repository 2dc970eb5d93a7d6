"""The step loop every method shares (:func:`run_steps`) and what it drives (:class:`StepLoop`).

A loop (online RL, preference, supervised) is a :class:`StepLoop`: one training step, validation, checkpoint save
and restore. :func:`run_steps` resumes from the latest checkpoint, validates at step 0, checkpoints every
``checkpoint_interval`` steps and at the end, stops between steps when the callback asks (saving first) and copies
the final adapter. The dispatcher (``trainer.train``) imports the loops; the loops import this module; nothing
imports the dispatcher but its callers (the CLI, the worker's runner).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from peft import PeftModel

from trainer.generation.distributed import World
from trainer.loops import checkpoint as ckpt
from trainer.loops.engine import Engine
from trainer.spec.callbacks import Callback
from trainer.spec.config import Hyperparameters, JobSpec

INITIAL_ADAPTER = "initial_adapter"  # the adapter before any step, kept when keep_best may choose the base model


@dataclass(frozen=True)
class RunResult:
    last_step: int
    total_steps: int
    stopped: bool  # True when should_stop() ended the run early
    adapter_dir: Path | None  # the final adapter (None when stopped early)
    final_metrics: dict[str, float]
    best_step: int | None = None  # with keep_best: the step whose adapter is the result (0: the base model)


class StepLoop(Protocol):
    """What :func:`run_steps` drives: a loop's step, checkpoint save/restore and validation."""

    out: Path
    cb: Callback
    spec: JobSpec
    total_steps: int
    world: World  # data parallel: rank 0 alone writes (checkpoints, the final adapter, best.json)

    @property
    def precision(self) -> str: ...

    def load_state(self, state: dict[str, Any]) -> int:
        """Restore a checkpoint's trainer state; returns its step."""
        ...

    def save(self, step: int, metrics: dict[str, float]) -> ckpt.Checkpoint | None:
        """Write a checkpoint of ``step`` (and tell the callback); None on a rank that does not write."""
        ...

    def step(self, step: int) -> dict[str, float]:
        """One training step; reports and returns its metrics."""
        ...

    def validation_metrics(self) -> dict[str, float]: ...

    def save_adapter(self, path: Path) -> None:
        """Write the adapter as it is now to ``path`` (no checkpoint, nothing told)."""
        ...


class Trainer(Protocol):
    """A loop ready to run: what ``trainer.train.build_trainer`` returns."""

    total_steps: int
    cb: Callback

    def run(self, *, resume: bool = False) -> RunResult: ...


class EngineLoop:
    """What the three loops share around their :class:`~trainer.loops.engine.Engine`: :meth:`run` through
    :func:`run_steps`, and checkpoints saved and restored by the engine. A loop adds ``step`` and
    ``validation_metrics``, says whether it has validation data, and may write more into a checkpoint
    (:meth:`on_saved`)."""

    spec: JobSpec
    out: Path
    cb: Callback
    hp: Hyperparameters
    engine: Engine
    total_steps: int
    world: World = World()

    def has_validation_data(self) -> bool:
        raise NotImplementedError

    # -- several ranks (trainer.generation.distributed): each a share of the batch, rank 0's validation and report
    # -----------

    def sync_gradients(self) -> None:
        """Sum every rank's gradients (of every group: the critic's and a reward head's too) before the step."""
        self.world.sum_gradients([p for group in self.engine.groups for p in group.params])

    def from_rank0(self, compute: Callable[[], dict[str, float]]) -> dict[str, float]:
        """``compute()`` on rank 0 and its result on every rank (validation: one rank's work, every rank's
        decisions: the best checkpoint, early stopping)."""
        if self.world.size == 1:
            return compute()
        return self.world.broadcast(compute() if self.world.main else {})

    def report(self, step: int, metrics: dict[str, float]) -> dict[str, float]:
        """Rank 0's metrics of ``step``, told to the callback (rank 0's) and returned on every rank."""
        metrics = self.world.broadcast(metrics)
        self.cb.on_metrics(step, metrics)
        return metrics

    def run(self, *, resume: bool = False) -> RunResult:
        return run_steps(
            self,  # type: ignore[arg-type]  # the subclass completes the protocol (step, validation_metrics)
            resume=resume,
            validate_first=self.has_validation_data() and bool(self.hp.eval_interval),
            checkpoint_interval=self.hp.checkpoint_interval,
            best=BestCheckpoint(self.hp.keep_best, self.hp.early_stopping_patience) if self.hp.keep_best else None,
        )

    def save_adapter(self, path: Path) -> None:
        if not self.world.main:
            return
        assert isinstance(self.engine.model, PeftModel)
        ckpt.save_adapter(self.engine.model, path)
        self.on_saved(0, path)

    def load_state(self, state: dict[str, Any]) -> int:
        return self.engine.load_state(state)

    def save(self, step: int, metrics: dict[str, float]) -> ckpt.Checkpoint | None:
        if not self.world.main:  # the ranks' states are equal: rank 0's checkpoint is every rank's
            return None
        c = self.engine.save_checkpoint(self.out, step=step, spec=self.spec.to_json(), metrics=metrics)
        self.on_saved(step, c.adapter_dir)
        self.cb.on_checkpoint(step, c.path, metrics)
        return c

    def on_saved(self, step: int, adapter_dir: Path) -> None:
        """Called after an adapter is written (a checkpoint's, before the callback hears of it, or the initial one)."""


@dataclass
class BestCheckpoint:
    """``keep_best``: the validation metric to keep the best checkpoint of, and where it stands. Stored as
    ``best.json`` in the run folder, so a resumed run keeps the best of the steps before it. Step 0 is the base
    model (the adapter as initialised, saved to ``initial_adapter/``): a run that only made things worse ends with it.
    """

    metric: str
    patience: int | None  # validations without a new best before the run stops; None: never
    step: int | None = None
    value: float | None = None
    stale: int = 0  # validations since the best

    FILE = "best.json"

    @property
    def minimise(self) -> bool:
        return self.metric.endswith("loss")

    def better(self, value: float) -> bool:
        if self.value is None:
            return True
        return value < self.value if self.minimise else value > self.value

    def observe(self, step: int, metrics: dict[str, float]) -> bool:
        """Take a step's metrics; True when they hold a new best (whose adapter must then be kept)."""
        if self.metric not in metrics:
            return False
        if self.better(metrics[self.metric]):
            self.step, self.value, self.stale = step, metrics[self.metric], 0
            return True
        self.stale += 1
        return False

    def exhausted(self, step: int, total_steps: int) -> bool:
        """Whether the patience ran out before the last step."""
        return self.patience is not None and self.stale >= self.patience and step < total_steps

    def load(self, out: Path) -> None:
        path = out / self.FILE
        if path.exists():
            raw = json.loads(path.read_text())
            if raw.get("metric") == self.metric:
                self.step, self.value, self.stale = raw["step"], raw["value"], raw["stale"]

    def write(self, out: Path) -> None:
        data = {"metric": self.metric, "step": self.step, "value": self.value, "stale": self.stale}
        (out / self.FILE).write_text(json.dumps(data) + "\n")


def run_steps(
    loop: StepLoop,
    *,
    resume: bool,
    validate_first: bool,
    checkpoint_interval: int,
    best: BestCheckpoint | None = None,
) -> RunResult:
    """Resume from the latest checkpoint, validation at step 0, a checkpoint every ``checkpoint_interval`` steps and
    at the end, a stop between steps (saved first), the final adapter: the last step's, or with ``best`` the one
    where the validation metric was best (and the run ends early after ``best.patience`` validations without a new
    best)."""
    cb = loop.cb
    start = _start(loop, resume=resume, best=best)
    last_metrics: dict[str, float] = {}
    if start == 0 and validate_first:
        _validate_first(loop, best)
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
        new_best = best is not None and best.observe(step, last_metrics)  # its adapter must exist
        if new_best or step % checkpoint_interval == 0 or step == loop.total_steps:
            loop.save(step, last_metrics)
            last_saved = step
        if best is not None and loop.world.main:
            best.write(loop.out)  # after the checkpoint it may name
            if best.exhausted(step, loop.total_steps):
                cb.on_event(
                    "info",
                    f"early stopping at step {step}: {best.metric} has not improved on {best.value:.4g} (step "
                    f"{best.step}) in {best.stale} validations",
                    {"step": step, "metric": best.metric, "best_step": best.step, "best_value": best.value},
                )
                if last_saved != step:
                    loop.save(step, last_metrics)
                break
    if not loop.world.main:  # rank 0 writes the result
        return RunResult(step, loop.total_steps, False, None, last_metrics)
    adapter = loop.out / "adapter"
    shutil.rmtree(adapter, ignore_errors=True)
    kept, kept_step = _result_adapter(loop, best, step, last_metrics)
    shutil.copytree(kept, adapter)
    cb.on_event("info", "training finished", {"step": step})
    return RunResult(step, loop.total_steps, False, adapter, last_metrics, best_step=kept_step)


def _start(loop: StepLoop, *, resume: bool, best: BestCheckpoint | None) -> int:
    """The step to continue from (0, or the latest checkpoint's when resuming), said in an event."""
    latest = ckpt.latest_checkpoint(loop.out) if resume else None
    if latest is None:
        loop.cb.on_event(
            "info",
            f"training {loop.spec.method.type} on {loop.spec.model} for {loop.total_steps} steps",
            {"total_steps": loop.total_steps, "precision": loop.precision},
        )
        return 0
    start = loop.load_state(ckpt.load_state(latest))
    loop.cb.on_event("info", f"resumed from checkpoint at step {start}", {"step": start})
    if best is not None:
        best.load(loop.out)
    return start


def _validate_first(loop: StepLoop, best: BestCheckpoint | None) -> None:
    """The starting point of the validation curve; with ``best``, the base model as the first candidate."""
    first = loop.validation_metrics()
    loop.cb.on_metrics(0, first)
    if best is not None and best.observe(0, first) and loop.world.main:
        loop.save_adapter(loop.out / INITIAL_ADAPTER)
        best.write(loop.out)


def _result_adapter(
    loop: StepLoop, best: BestCheckpoint | None, step: int, last: dict[str, float]
) -> tuple[Path, int | None]:
    """(the adapter the run ends with, the step it is of when keep_best chose it): the last checkpoint's, or the best
    one's (an event says which and why)."""
    final = ckpt.latest_checkpoint(loop.out)
    assert final is not None and final.step == step
    chosen = (
        next((c.adapter_dir for c in ckpt.list_checkpoints(loop.out) if c.step == best.step), None) if best else None
    )
    if best is not None and best.step == 0:
        chosen = loop.out / INITIAL_ADAPTER
    if best is None or best.step is None or best.step == step or chosen is None or not chosen.exists():
        # (a run resumed on another machine has only the checkpoints it brought and those it wrote since)
        return final.adapter_dir, (step if best is not None and best.step is not None else None)
    assert best.value is not None
    where = "the base model (no step improved on it)" if best.step == 0 else f"step {best.step}"
    loop.cb.on_event(
        "info",
        f"the job's adapter is the best checkpoint by {best.metric}: {where}, {best.value:.4g} against "
        f"{last.get(best.metric, float('nan')):.4g} at the last validation",
        {"metric": best.metric, "best_step": best.step, "best_value": best.value, "last_step": step},
    )
    return chosen, best.step


def validation_due(step: int, *, interval: int, total_steps: int) -> bool:
    """Validation runs every ``interval`` steps (0: never in between) and at the last step."""
    return bool(interval and step % interval == 0) or step == total_steps

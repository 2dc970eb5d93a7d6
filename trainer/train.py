"""One entry point for every method: :func:`build_trainer` picks the loop the method's data format needs.

- prompts (grpo, dr_grpo, dapo, rloo, reinforce, ppo): the online RL loop, ``trainer.rl``;
- preferences (reward_model, dpo): the pairwise loop, ``trainer.preference``;
- supervised: ``trainer.supervised``.

Every loop takes the same spec, output folder and callback, validates its input before loading weights, and
returns a :class:`RunResult`; the CLI and the worker call only this module.
"""

from __future__ import annotations

import random
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from trainer import checkpoint as ckpt
from trainer.callbacks import Callback
from trainer.config import JobSpec


@dataclass(frozen=True)
class RunResult:
    last_step: int
    total_steps: int
    stopped: bool  # True when should_stop() ended the run early
    adapter_dir: Path | None  # the final adapter (None when stopped early)
    final_metrics: dict[str, float]


class Trainer(Protocol):
    total_steps: int
    cb: Callback

    def run(self, *, resume: bool = False) -> RunResult: ...


class _Steps(Protocol):
    """What :func:`run_steps` drives: a loop's step, checkpoint save/restore and validation."""

    out: Path
    cb: Callback
    spec: JobSpec
    total_steps: int

    @property
    def precision(self) -> str: ...

    def _load_state(self, state: dict[str, Any]) -> int: ...
    def _save(self, step: int, metrics: dict[str, float]) -> Any: ...
    def _step(self, step: int) -> dict[str, float]: ...
    def _validation_metrics(self) -> dict[str, float]: ...


def run_steps(loop: _Steps, *, resume: bool, validate_first: bool, checkpoint_interval: int) -> RunResult:
    """The step loop every method shares: resume from the latest checkpoint, validation at step 0, a checkpoint
    every ``checkpoint_interval`` steps and at the end, a stop between steps (saved first), the final adapter."""
    cb = loop.cb
    start = 0
    latest = ckpt.latest_checkpoint(loop.out) if resume else None
    if latest is not None:
        start = loop._load_state(ckpt.load_state(latest))
        cb.on_event("info", f"resumed from checkpoint at step {start}", {"step": start})
    else:
        cb.on_event(
            "info",
            f"training {loop.spec.method.type} on {loop.spec.model} for {loop.total_steps} steps",
            {"total_steps": loop.total_steps, "precision": loop.precision},
        )
    last_metrics: dict[str, float] = {}
    if start == 0 and validate_first:
        cb.on_metrics(0, loop._validation_metrics())  # the starting point of the validation curve
    last_saved = start
    step = start
    for step in range(start + 1, loop.total_steps + 1):
        if cb.should_stop():
            step -= 1
            if last_saved != step:
                loop._save(step, last_metrics)
            cb.on_event("info", f"stopped at step {step}", {"step": step})
            return RunResult(step, loop.total_steps, True, None, last_metrics)
        last_metrics = loop._step(step)
        if step % checkpoint_interval == 0 or step == loop.total_steps:
            loop._save(step, last_metrics)
            last_saved = step
    adapter = loop.out / "adapter"
    shutil.rmtree(adapter, ignore_errors=True)
    final = ckpt.latest_checkpoint(loop.out)
    assert final is not None and final.step == loop.total_steps
    shutil.copytree(final.adapter_dir, adapter)
    cb.on_event("info", "training finished", {"step": step})
    return RunResult(loop.total_steps, loop.total_steps, False, adapter, last_metrics)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def build_trainer(
    spec: JobSpec, *, output_dir: Path, callback: Callback, device: torch.device | None = None
) -> Trainer:
    """The loop for ``spec.method.type``, with its data validated and its model loaded."""
    fmt = spec.method.data_format
    if spec.method.grader is not None:
        from trainer.reward_model import check_reward_models

        check_reward_models(spec.method.grader)  # a reward_model grader's folder is checked before weights load
    if fmt == "prompts":
        from trainer.rl import RLTrainer

        return RLTrainer(spec, output_dir=output_dir, callback=callback, device=device)
    if fmt == "preferences":
        from trainer.preference import PreferenceTrainer

        return PreferenceTrainer(spec, output_dir=output_dir, callback=callback, device=device)
    from trainer.supervised import SupervisedTrainer

    return SupervisedTrainer(spec, output_dir=output_dir, callback=callback, device=device)


def train(
    spec: JobSpec,
    *,
    output_dir: Path,
    callback: Callback,
    resume: bool = False,
    device: torch.device | None = None,
) -> RunResult:
    """Run a spec to the end (or until ``callback.should_stop()``)."""
    return build_trainer(spec, output_dir=output_dir, callback=callback, device=device).run(resume=resume)

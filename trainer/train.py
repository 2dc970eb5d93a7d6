"""One entry point for every method: :func:`build_trainer` picks the loop the method's data format needs.

- prompts (grpo, dr_grpo, dapo, rloo, reinforce, ppo): the online RL loop, ``trainer.loops.rl``;
- preferences (reward_model, dpo): the pairwise loop, ``trainer.loops.preference``;
- supervised: ``trainer.loops.supervised``.

Every loop takes the same spec, output folder and callback, validates its input before loading weights, and
returns a :class:`~trainer.loops.steps.RunResult`; the CLI and the worker call only this module. This module imports the
loops; they import ``trainer.loops.steps`` and ``trainer.loops.engine``, never this module.
"""

from __future__ import annotations

from pathlib import Path

import torch

from trainer.generation.distributed import World
from trainer.loops.preference import PreferenceTrainer
from trainer.loops.reward_model import check_reward_models
from trainer.loops.rl import RLTrainer
from trainer.loops.steps import RunResult, Trainer
from trainer.loops.supervised import SupervisedTrainer
from trainer.spec.callbacks import Callback
from trainer.spec.config import JobSpec

__all__ = ["RunResult", "Trainer", "build_trainer", "train"]


def build_trainer(
    spec: JobSpec,
    *,
    output_dir: Path,
    callback: Callback,
    device: torch.device | None = None,
    world: World | None = None,
) -> Trainer:
    """The loop for ``spec.method.type``, with its data validated and its model loaded; ``world``: this process's
    rank when the launcher started several (``trainer.generation.distributed``)."""
    world = world or World()
    if spec.method.grader is not None:
        check_reward_models(spec.method.grader)  # a reward_model grader's folder is checked before weights load
    fmt = spec.method.data_format
    if fmt == "prompts":
        return RLTrainer(spec, output_dir=output_dir, callback=callback, device=device, world=world)
    if fmt == "preferences":
        return PreferenceTrainer(spec, output_dir=output_dir, callback=callback, device=device, world=world)
    return SupervisedTrainer(spec, output_dir=output_dir, callback=callback, device=device, world=world)


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

"""One entry point for every method: :func:`build_trainer` picks the loop the method's data format needs.

- prompts (grpo, dr_grpo, dapo, rloo, reinforce, ppo): the online RL loop, ``trainer.rl``;
- preferences (reward_model, dpo): the pairwise loop, ``trainer.preference``;
- supervised: ``trainer.supervised``.

Every loop takes the same spec, output folder and callback, validates its input before loading weights, and
returns a :class:`RunResult`; the CLI and the worker call only this module.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

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

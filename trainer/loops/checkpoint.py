"""Checkpoints: the PEFT adapter plus everything needed to resume exactly.

Layout of ``<dir>/checkpoints/step-000010/``: ``adapter/`` (``adapter_config.json``, ``adapter_model.safetensors``),
``trainer_state.pt`` (optimiser, scheduler, RNG states, step, data position, KL controller), ``spec.json`` (the
job spec with its resolved hyperparameters), ``metrics.json`` (that step's metrics). A checkpoint is written to a
temporary folder and renamed into place, so a crash mid-write never leaves a half checkpoint that looks complete.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from peft import PeftModel

CHECKPOINTS = "checkpoints"
STATE_FILE = "trainer_state.pt"


@dataclass(frozen=True)
class Checkpoint:
    step: int
    path: Path

    @property
    def adapter_dir(self) -> Path:
        return self.path / "adapter"


def rng_state(sampling: torch.Generator, *, process: bool = True) -> dict[str, Any]:
    """The sampling generator's state and, with ``process``, the process-wide RNGs' (Python, NumPy, torch, CUDA): a
    job owns its process, a Tinker session shares its host's."""
    state: dict[str, Any] = {"sampling": sampling.get_state()}
    if process:
        state |= {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
        if torch.cuda.is_available():
            state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any], sampling: torch.Generator) -> None:
    """Restore what :func:`rng_state` saved (the process-wide RNGs only where it saved them)."""
    sampling.set_state(state["sampling"])
    if "python" in state:
        random.setstate(state["python"])
        np.random.set_state(state["numpy"])
        torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def training_state(
    step: int,
    *,
    model: torch.nn.Module,
    optimizer: Any,
    scheduler: Any,
    sampler: Any,
    generator: torch.Generator,
    process_rng: bool = True,
) -> dict[str, Any]:
    """What every loop saves to resume exactly: step, trainable weights, optimiser, scheduler, data position (None
    without a data order), RNG."""
    return {
        "step": step,
        "trainable": {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad},
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "sampler": sampler.state_dict() if sampler is not None else None,
        "rng": rng_state(generator, process=process_rng),
    }


def restore_training_state(
    state: dict[str, Any],
    *,
    model: torch.nn.Module,
    optimizer: Any,
    scheduler: Any,
    sampler: Any,
    generator: torch.Generator,
) -> int:
    """Load what :func:`training_state` saved; returns its step."""
    named = dict(model.named_parameters())
    with torch.no_grad():
        for n, t in state["trainable"].items():
            named[n].copy_(t)
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    if sampler is not None:
        sampler.load_state_dict(state["sampler"])
    set_rng_state(state["rng"], generator)
    return int(state["step"])


def save_adapter(model: PeftModel, out: Path) -> Path:
    """The policy's adapter only: PPO's critic adapter on the same base is trainer state, not part of the result."""
    out.mkdir(parents=True, exist_ok=True)
    names = list(model.peft_config)
    selected = ["default"] if len(names) > 1 and "default" in names else None
    model.save_pretrained(str(out), safe_serialization=True, selected_adapters=selected)
    return out


def save_checkpoint(
    run_dir: Path,
    *,
    step: int,
    model: PeftModel,
    state: dict[str, Any],
    spec: dict[str, Any],
    metrics: dict[str, float],
) -> Checkpoint:
    root = run_dir / CHECKPOINTS
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step-{step:06d}"
    tmp = root / f".tmp-step-{step:06d}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    save_adapter(model, tmp / "adapter")
    torch.save(state, tmp / STATE_FILE)
    (tmp / "spec.json").write_text(json.dumps(spec, indent=2))
    (tmp / "metrics.json").write_text(json.dumps(metrics, indent=2))
    if final.exists():
        shutil.rmtree(final)
    tmp.rename(final)
    return Checkpoint(step, final)


def list_checkpoints(run_dir: Path) -> list[Checkpoint]:
    root = run_dir / CHECKPOINTS
    if not root.is_dir():
        return []
    out = []
    for p in root.iterdir():
        if p.name.startswith("step-") and (p / STATE_FILE).is_file():
            out.append(Checkpoint(int(p.name.removeprefix("step-")), p))
    return sorted(out, key=lambda c: c.step)


def latest_checkpoint(run_dir: Path) -> Checkpoint | None:
    cks = list_checkpoints(run_dir)
    return cks[-1] if cks else None


def load_state(ckpt: Checkpoint) -> dict[str, Any]:
    # Our own file: optimiser and RNG states hold numpy/python objects, so weights_only cannot be used.
    state: dict[str, Any] = torch.load(ckpt.path / STATE_FILE, map_location="cpu", weights_only=False)
    return state


def archive_adapter(adapter_dir: Path, out: Path) -> Path:
    """The adapter folder as ``.tar.gz``, its files at the archive's top level."""
    with tarfile.open(out, "w:gz") as tar:
        for f in sorted(adapter_dir.iterdir()):
            tar.add(f, arcname=f.name)
    return out

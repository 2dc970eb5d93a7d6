"""Learning on tiny-arith: DPO raises the held-out preference accuracy and margin of its implicit reward, supervised
fine-tuning on correct sums lowers validation loss (the reward model's learning test is test_rlhf_learning's).

Slow (a few seconds each on 2 cores) but run in CI. The held-out sets are the
200 validation problems no training file contains; an accuracy over 200 pairs has a standard error of about 0.03.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from trainer.spec import metrics as M
from trainer.spec.callbacks import JsonlFiles
from trainer.spec.config import parse_spec
from trainer.train import train

FILES = {
    "dpo": ("preferences.jsonl", "validation_preferences.jsonl"),
    "supervised": ("supervised.jsonl", "validation_supervised.jsonl"),
}


def run(
    method: str, model: Path, data: Path, out: Path, lora: dict[str, Any] | None = None, **hp: Any
) -> tuple[dict[str, float], dict[str, float]]:
    """(the step-0 validation metrics, the final ones)."""
    train_file, val_file = FILES[method]
    # fp32 everywhere: the same trajectory on machines with and without fast bf16.
    hyper = {"eval_interval": 1000, "checkpoint_interval": 1000, "precision": "fp32", **hp}
    spec = parse_spec(
        {
            "model": str(model),
            "training_file": str(data / train_file),
            "validation_file": str(data / val_file),
            "seed": 0,
            "method": {"type": method, method: {"hyperparameters": hyper, "lora": lora or {}}},
        }
    )
    result = train(spec, output_dir=out, callback=JsonlFiles(out))
    first = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
    assert first["step"] == 0
    return first, result.final_metrics


@pytest.mark.slow
def test_dpo_raises_heldout_preference_accuracy_and_margin(
    tiny_arith_dir: Path, arithmetic_data: Path, tmp_path: Path
) -> None:
    base, final = run("dpo", tiny_arith_dir, arithmetic_data, tmp_path, batch_size=32, max_steps=20, learning_rate=1e-3)
    acc, margin = M.validation(M.PREFERENCE_ACCURACY), M.validation(M.PREFERENCE_MARGIN)
    print(
        f"dpo: held-out implicit-reward accuracy {base[acc]:.3f} → {final[acc]:.3f}, "
        f"margin {base[margin]:.3f} → {final[margin]:.3f}"
    )
    assert base[acc] == 0.0 and base[margin] == 0.0  # the policy starts as the reference
    # Measured 0.775 and 0.357 on the built-in pairs, half of whose rejected sums are off by a few units or tens (0.835
    # and 0.90 on the earlier pairs, whose rejected sums were almost all dropped carries: always smaller, easy to tell).
    assert final[acc] >= 0.7 and final[margin] >= 0.25


@pytest.mark.slow
def test_supervised_lowers_validation_loss(tiny_arith_dir: Path, arithmetic_data: Path, tmp_path: Path) -> None:
    base, final = run(
        "supervised", tiny_arith_dir, arithmetic_data, tmp_path, batch_size=32, max_steps=10, learning_rate=1e-3
    )
    print(f"supervised: validation loss {base[M.VAL_LOSS]:.3f} → {final[M.VAL_LOSS]:.3f}")
    assert final[M.VAL_LOSS] <= 0.5 * base[M.VAL_LOSS]  # measured 0.289 → 0.083

"""Learning on tiny-arith: every online RL method lifts held-out greedy accuracy by 0.3 within 15 steps.

Slow (a few seconds per method, PPO's about ten) but run in CI: this is the test that the math, taken together,
climbs a real reward. 200 validation problems give a standard error of about 0.035 on an accuracy, so a lift of 0.3
is far outside noise. Measured on the shipped tiny-arith (held-out accuracy 0.375 in these runs' bf16 sampling, 0.37
in fp32): at step 15 GRPO 0.81, Dr. GRPO 0.845, DAPO 0.85, RLOO 0.85, REINFORCE 0.84, PPO 0.915 (at step 10 they were
0.685-0.73, PPO 0.885); with a zero learning rate every one stays at its base.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trainer.spec import metrics as M
from trainer.spec.callbacks import JsonlFiles
from trainer.spec.config import parse_spec
from trainer.train import train

ACCURACY = {
    "type": "string_check",
    "name": "accuracy",
    "input": "{{sample.output_text}}",
    "reference": "{{item.answer}}",
    "operation": "eq",
}


@pytest.mark.slow
@pytest.mark.parametrize("method", ["grpo", "dr_grpo", "dapo", "rloo", "reinforce"])
def test_method_raises_heldout_greedy_accuracy_by_at_least_03_in_15_steps(
    method: str, tiny_arith_dir: Path, arithmetic_data: Path, tmp_path: Path
) -> None:
    spec = parse_spec(
        {
            "model": str(tiny_arith_dir),
            "training_file": str(arithmetic_data / "train.jsonl"),
            "validation_file": str(arithmetic_data / "validation.jsonl"),
            "seed": 0,
            "method": {
                "type": method,
                method: {
                    "grader": ACCURACY,
                    "hyperparameters": {
                        "max_steps": 15,
                        "batch_size": 8,
                        "group_size": 8,
                        "learning_rate": 3e-4,
                        "max_completion_tokens": 6,
                        "eval_interval": 15,
                        "checkpoint_interval": 15,
                        "rollouts_logged": 0,
                    },
                    "lora": {"r": 16, "alpha": 32, "target_modules": "all-linear"},
                },
            },
        }
    )
    result = train(spec, output_dir=tmp_path, callback=JsonlFiles(tmp_path))
    rows = [json.loads(ln) for ln in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    base, final = rows[0][M.VAL_REWARD_MEAN], result.final_metrics[M.VAL_REWARD_MEAN]
    print(f"{method}: validation greedy accuracy {base:.3f} → {final:.3f}")
    assert rows[0]["step"] == 0 and len(rows) == 16
    assert final - base >= 0.3, f"{method}: {base:.3f} → {final:.3f}"


@pytest.mark.slow
def test_ppo_with_a_value_model_raises_heldout_greedy_accuracy(
    tiny_arith_dir: Path, arithmetic_data: Path, tmp_path: Path
) -> None:
    """PPO with its critic on the shared base: 64 samples a step (16 prompts × 4), two PPO epochs, GAE(1, 0.95),
    k1 KL at β = 0.05 in the per-token reward; the score comes from the string_check grader alone."""
    spec = parse_spec(
        {
            "model": str(tiny_arith_dir),
            "training_file": str(arithmetic_data / "train.jsonl"),
            "validation_file": str(arithmetic_data / "validation.jsonl"),
            "seed": 0,
            "method": {
                "type": "ppo",
                "ppo": {
                    "grader": ACCURACY,
                    "hyperparameters": {
                        "max_steps": 15,
                        "batch_size": 16,
                        "group_size": 4,
                        "iterations_per_batch": 2,
                        "learning_rate": 3e-4,
                        "value_learning_rate": 1e-3,
                        "max_completion_tokens": 6,
                        "eval_interval": 15,
                        "checkpoint_interval": 15,
                        "rollouts_logged": 0,
                    },
                    "lora": {"r": 16, "alpha": 32, "target_modules": "all-linear"},
                },
            },
        }
    )
    result = train(spec, output_dir=tmp_path, callback=JsonlFiles(tmp_path))
    rows = [json.loads(ln) for ln in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    base, final = rows[0][M.VAL_REWARD_MEAN], result.final_metrics[M.VAL_REWARD_MEAN]
    ev = [r[M.EXPLAINED_VARIANCE] for r in rows[1:]]
    print(f"ppo: validation greedy accuracy {base:.3f} → {final:.3f}; explained variance {ev[0]:.2f} → {ev[-1]:.2f}")
    assert final - base >= 0.3, f"ppo: {base:.3f} → {final:.3f}"
    value_loss = [r[M.LOSS_VALUE] for r in rows[1:]]
    assert sum(value_loss[-10:]) / 10 < sum(value_loss[:3]) / 3  # the critic fits the returns better than at V ≡ 0

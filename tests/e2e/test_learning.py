"""Learning on tiny-arith: every online RL method lifts held-out greedy accuracy within 40 steps.

Slow (tens of seconds per method, plus the one-off tiny-arith build) but run in CI: this is the test that the
math, taken together, climbs a real reward. 200 validation problems give a standard error of about 0.035 on an
accuracy, so a lift of 0.15 is far outside noise.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trainer import metrics as M
from trainer.callbacks import JsonlFiles
from trainer.config import parse_spec
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
def test_method_raises_heldout_greedy_accuracy_by_at_least_015_in_40_steps(
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
                        "max_steps": 40,
                        "batch_size": 8,
                        "group_size": 8,
                        "learning_rate": 3e-4,
                        "max_completion_tokens": 6,
                        "eval_interval": 40,
                        "checkpoint_interval": 40,
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
    assert rows[0]["step"] == 0 and len(rows) == 41
    assert final - base >= 0.15, f"{method}: {base:.3f} → {final:.3f}"


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
                        "max_steps": 40,
                        "batch_size": 16,
                        "group_size": 4,
                        "iterations_per_batch": 2,
                        "learning_rate": 3e-4,
                        "value_learning_rate": 1e-3,
                        "max_completion_tokens": 6,
                        "eval_interval": 40,
                        "checkpoint_interval": 40,
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
    assert final - base >= 0.15, f"ppo: {base:.3f} → {final:.3f}"
    value_loss = [r[M.LOSS_VALUE] for r in rows[1:]]
    assert sum(value_loss[-10:]) / 10 < sum(value_loss[:3]) / 3  # the critic fits the returns better than at V ≡ 0


def _greedy_accuracy(model_dir: Path, adapter: Path | None, validation: Path) -> float:
    from trainer.data import load_prompts
    from trainer.encoding import encode_prompts
    from trainer.evaluate import evaluate
    from trainer.graders import parse_grader
    from trainer.models import default_device, load_adapter, load_base_model, load_tokenizer

    grader = parse_grader(ACCURACY)
    items = load_prompts(validation, grader=grader)
    tok = load_tokenizer(str(model_dir))
    net = load_base_model(str(model_dir), default_device())
    if adapter is not None:
        net = load_adapter(net, adapter)
    prompts = encode_prompts(tok, items, max_prompt_tokens=64)
    return evaluate(net, tok, prompts, items, grader, max_new_tokens=6, precision="fp32").mean_reward


@pytest.mark.slow
def test_ppo_against_a_reward_model_trained_on_preferences_raises_accuracy(
    tiny_arith_dir: Path, arithmetic_data: Path, tmp_path: Path
) -> None:
    """RLHF end to end: preference pairs → a Bradley–Terry reward model → PPO whose only reward is that model's
    normalised score. The grader never sees the answers; held-out accuracy is measured afterwards."""
    rm_dir = tmp_path / "rm"
    rm_spec = parse_spec(
        {
            "model": str(tiny_arith_dir),
            "training_file": str(arithmetic_data / "preferences.jsonl"),
            "validation_file": str(arithmetic_data / "validation_preferences.jsonl"),
            "seed": 0,
            "method": {
                "type": "reward_model",
                "reward_model": {
                    "hyperparameters": {
                        "batch_size": 32,
                        "n_epochs": 4,
                        "learning_rate": 1e-3,
                        "lr_scheduler": "cosine",
                        "warmup_steps": 10,
                        "checkpoint_interval": 1000,
                    }
                },
            },
        }
    )
    rm = train(rm_spec, output_dir=rm_dir, callback=JsonlFiles(rm_dir))
    rm_accuracy = rm.final_metrics[M.validation(M.PREFERENCE_ACCURACY)]

    ppo_dir = tmp_path / "ppo"
    grader = {"type": "reward_model", "name": "rm", "model": str(rm_dir), "normalize": True}
    spec = parse_spec(
        {
            "model": str(tiny_arith_dir),
            "training_file": str(arithmetic_data / "train.jsonl"),
            "seed": 0,
            "method": {
                "type": "ppo",
                "ppo": {
                    "grader": grader,
                    "hyperparameters": {
                        "max_steps": 60,
                        "batch_size": 16,
                        "group_size": 4,
                        "iterations_per_batch": 2,
                        "learning_rate": 3e-4,
                        "value_learning_rate": 1e-3,
                        "max_completion_tokens": 6,
                        "checkpoint_interval": 60,
                        "rollouts_logged": 0,
                    },
                    "lora": {"r": 16, "alpha": 32, "target_modules": "all-linear"},
                },
            },
        }
    )
    result = train(spec, output_dir=ppo_dir, callback=JsonlFiles(ppo_dir))
    assert result.adapter_dir is not None
    validation = arithmetic_data / "validation.jsonl"
    base = _greedy_accuracy(tiny_arith_dir, None, validation)
    final = _greedy_accuracy(tiny_arith_dir, result.adapter_dir, validation)
    rows = [json.loads(ln) for ln in (ppo_dir / "metrics.jsonl").read_text().splitlines()]
    rm_reward = [r[M.REWARD_MEAN] for r in rows]
    print(
        f"rlhf: reward model held-out pairwise accuracy {rm_accuracy:.3f}; PPO reward-model score "
        f"{sum(rm_reward[:5]) / 5:.2f} → {sum(rm_reward[-5:]) / 5:.2f}; "
        f"held-out greedy accuracy {base:.3f} → {final:.3f}"
    )
    # The reward model is right on ~0.8-0.9 of held-out pairs, so PPO climbs an imperfect proxy: measured 0.390 → 0.515
    # in 40 steps on the AMX Xeon's bf16 tiny-arith build. The fp32 build of an AVX2-only CPU learns slower: 40 steps
    # gave 0.370 → 0.440, 60 steps 0.370 → 0.480 (seed 1: 0.370 → 0.560). 200 problems give a standard error of
    # ~0.035 per accuracy; 0.08 is well outside noise.
    assert final - base >= 0.08, f"rlhf: {base:.3f} → {final:.3f}"

"""RLHF on tiny-arith, end to end (docs/rlhf.md): a reward model trained with default hyperparameters on the built-in
preference data ranks held-out pairs like the truth, and PPO graded only by it lifts held-out accuracy.

Slow (about 15 s for the reward model and 10 s each for the PPO runs on 2 cores) but run in CI. The held-out pairs
are the built-in `validation_preferences.jsonl`: 200 problems no training file holds (the reward model's own
validation, which picks its best checkpoint, is the default 10% split of its training pairs). The three-seed figures
against PPO on the true grader are bench/rlhf.py's, in BENCHMARKS.md.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from trainer.loops.reward_model import RewardModel
from trainer.loops.steps import RunResult
from trainer.spec import metrics as M
from trainer.spec.callbacks import JsonlFiles
from trainer.spec.config import parse_spec
from trainer.spec.data import load_preferences
from trainer.train import train

TRUTH = {
    "type": "string_check",
    "name": "truth",
    "input": "{{sample.output_text}}",
    "reference": "{{item.answer}}",
    "operation": "eq",
}
KINDS = ("hundreds", "tens", "units")


def rows_of(run: Path) -> list[dict[str, float]]:
    return [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def reward_model(tiny_arith_dir: Path, arithmetic_data: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A reward_model job with no hyperparameters and no validation file."""
    out = tmp_path_factory.mktemp("rm")
    spec = {
        "model": str(tiny_arith_dir),
        "training_file": str(arithmetic_data / "preferences.jsonl"),
        "seed": 0,
        "method": {"type": "reward_model", "reward_model": {}},
    }
    train(parse_spec(spec), output_dir=out, callback=JsonlFiles(out))
    return out


@pytest.mark.slow
def test_a_reward_model_with_default_hyperparameters_ranks_heldout_pairs_like_the_truth(
    reward_model: Path, arithmetic_data: Path
) -> None:
    items = load_preferences(arithmetic_data / "validation_preferences.jsonl")
    rm = RewardModel(reward_model, torch.device("cpu"), precision="fp32")
    prompts = [it.prompt for it in items]
    right = (
        rm.score(prompts, [it.chosen for it in items], batch_size=64)
        > rm.score(prompts, [it.rejected for it in items], batch_size=64)
    ).tolist()
    by_kind = {k: [ok for it, ok in zip(items, right, strict=True) if it.kind == k] for k in KINDS}
    accuracy = sum(right) / len(right)
    print(f"reward model: held-out pairwise accuracy {accuracy:.3f}; " + ", ".join(
        f"{k} {sum(v) / len(v):.3f} ({len(v)})" for k, v in by_kind.items()
    ))  # fmt: skip
    assert accuracy >= 0.95  # measured 0.995 (seeds 0, 1, 2: BENCHMARKS.md)
    assert all(sum(v) / len(v) >= 0.9 for v in by_kind.values()), by_kind

    # Its validation (the 10% split) reports accuracy by kind, and the job's adapter is the best validation's.
    validations = [r for r in rows_of(reward_model) if M.VAL_PREFERENCE_ACCURACY in r]
    assert [r["step"] for r in validations][:3] == [0, 25, 50]
    for r in validations:
        assert {M.VAL_PREFERENCE_ACCURACY_OF_KIND.name(k) for k in KINDS} <= set(r)
    best = json.loads((reward_model / "best.json").read_text())
    assert best["value"] == max(r[M.VAL_PREFERENCE_ACCURACY] for r in validations)
    assert best["step"] == next(r["step"] for r in validations if r[M.VAL_PREFERENCE_ACCURACY] == best["value"])
    info = json.loads((reward_model / "adapter" / "reward_model.json").read_text())
    assert info["head"] == "likelihood" and info["scored_on"] == "validation" and info["score_std"] > 0


def ppo(model: Path, data: Path, out: Path, grader: dict[str, object], **hp: object) -> RunResult:
    """PPO with its default hyperparameters but for the length, the validation cadence and completions that fit
    tiny-arith's 64-token context (the default of 256 does not)."""
    body = {"max_steps": 20, "max_completion_tokens": 6, "eval_interval": 10, "rollouts_logged": 0, **hp}
    spec = {
        "model": str(model),
        "training_file": str(data / "train.jsonl"),
        "validation_file": str(data / "validation.jsonl"),
        "seed": 0,
        "method": {"type": "ppo", "ppo": {"grader": grader, "hyperparameters": body}},
    }
    return train(parse_spec(spec), output_dir=out, callback=JsonlFiles(out))


@pytest.mark.slow
def test_ppo_graded_only_by_the_reward_model_lifts_heldout_accuracy_with_the_truth_beside_it_for_validation(
    reward_model: Path, tiny_arith_dir: Path, arithmetic_data: Path, tmp_path: Path
) -> None:
    """The grader is a multi whose formula reads only the reward model; the true answer beside it is scored for
    validation and keep_best, never trained on."""
    rm = {"type": "reward_model", "name": "rm", "model": str(reward_model), "normalize": True}
    grader = {"type": "multi", "name": "rlhf", "graders": {"rm": rm, "truth": TRUTH}, "calculate_output": "rm"}
    truth = M.reward_of("truth", validation=True)
    result = ppo(tiny_arith_dir, arithmetic_data, tmp_path, grader, keep_best=truth)
    rows = rows_of(tmp_path)
    curve = {r["step"]: r[truth] for r in rows if truth in r}
    assert sorted(curve) == [0, 10, 20]
    base, last = curve[0], curve[20]
    kept = curve[result.best_step] if result.best_step is not None else last
    print(f"rlhf: held-out greedy accuracy {base:.3f} → {last:.3f} at step 20; the job's adapter (step "
          f"{result.best_step}) {kept:.3f}; curve {curve}")  # fmt: skip
    # Trained on the reward model alone: its own reward rose, and so did the truth it never saw.
    assert all(r[M.reward_of("rm")] == r[M.REWARD_MEAN] for r in rows if M.REWARD_MEAN in r)
    assert kept == max(curve.values()) and kept >= base
    # measured on the shipped tiny-arith: 0.375 → 0.785 at step 10, 0.860 at 20 (0.900 at 50, 0.870 at 60, where
    # this test ran to before); 20 steps keep a margin of 0.18 over the bar, and a zero learning rate stays at 0.375
    assert last - base >= 0.3
    # The over-optimisation signature is measured at every validation (0 while the truth rises with the reward).
    assert all(M.VAL_OVEROPTIMISATION in r for r in rows if truth in r)


@pytest.mark.slow
def test_a_flawed_reward_is_caught_over_optimised_and_the_job_keeps_the_checkpoint_before_the_fall(
    tiny_arith_dir: Path, arithmetic_data: Path, tmp_path: Path
) -> None:
    """A proxy with a flaw, as a learned reward has (the old built-in reward models' "prefer the larger sum"): a right
    answer scores 0.5 and any larger number 1. PPO on it first learns to add, then to overshoot. Measured here (fp32,
    seeds 0, 1, 2): the truth rose 0.39 → 0.82, 0.71, 0.69 at step 5 and fell to 0.06, 0.14, 0.21 by step 30 while
    the proxy's validation rose 0.47–0.52 → 0.88–0.96; on the shipped tiny-arith the truth rose 0.37 → 0.735 at step
    5 and fell to 0.55 at step 10 (the warning) and 0.36 at 15, where the run ends. (A proxy that only ties the
    truth, right or any answer from 100 to 199 scoring 1, did not do it reliably: on some machines PPO learned to add
    and stayed right.)"""
    larger = """
def grade(sample, item):
    text, answer = sample["output_text"].strip(), int(item["answer"])
    if not text.isdigit():
        return 0.0
    return 1.0 if int(text) > answer else 0.5 if int(text) == answer else 0.0
"""
    graders = {"larger": {"type": "python", "name": "larger", "source": larger}, "truth": TRUTH}
    grader = {"type": "multi", "name": "flawed", "graders": graders, "calculate_output": "larger"}
    truth = M.reward_of("truth", validation=True)
    result = ppo(
        tiny_arith_dir,
        arithmetic_data,
        tmp_path,
        grader,
        max_steps=15,
        eval_interval=5,
        keep_best=truth,
        precision="fp32",
    )
    rows = [r for r in rows_of(tmp_path) if truth in r]
    fall = max(r[M.VAL_OVEROPTIMISATION] for r in rows)
    print("flawed reward: " + "; ".join(
        f"step {r['step']} proxy {r[M.VAL_REWARD_MEAN]:.3f} truth {r[truth]:.3f} fall {r[M.VAL_OVEROPTIMISATION]:.3f}"
        for r in rows
    ))  # fmt: skip
    assert fall >= 0.05
    events = [json.loads(ln) for ln in (tmp_path / "events.jsonl").read_text().splitlines()]
    warnings = [e for e in events if e["level"] == "warn" and "over-optimisation" in e["message"]]
    assert len(warnings) >= 1 and "'truth' fell" in warnings[0]["message"]
    # The signature at its first warning: the truth below its best by DROP or more, the proxy above its value then.
    first = next(r for r in rows if r[M.VAL_OVEROPTIMISATION] >= 0.05)
    best_before = max((r for r in rows if r["step"] < first["step"]), key=lambda r: r[truth])
    assert first[truth] <= best_before[truth] - 0.05 and first[M.VAL_REWARD_MEAN] > best_before[M.VAL_REWARD_MEAN]
    assert result.best_step == max(rows, key=lambda r: r[truth])["step"] != 15
    assert result.best_step is not None and result.best_step < first["step"]

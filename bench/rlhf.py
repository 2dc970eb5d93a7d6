"""RLHF on tiny-arith (docs/rlhf.md): the reward model's held-out pairwise accuracy with its default hyperparameters,
and PPO graded only by that reward model against PPO graded by the true answer, per seed.

For each seed: a ``reward_model`` job with no hyperparameters on the built-in ``preferences.jsonl`` (its validation
is the default 10% split of those pairs, which picks the best checkpoint) → its pairwise accuracy on
``validation_preferences.jsonl``, the 200 held-out problems no training file holds, overall and by error kind. Then
two PPO jobs of ``--steps`` steps with default PPO hyperparameters (only the step count, validation and checkpoint
cadence set): one graded by ``string_check`` against the answer, one by the reward model alone (``normalize``),
with the true grader beside it for validation only (a ``multi`` whose formula reads only the reward model). Held-out
greedy accuracy of each: the base, the last step, and the job's adapter (``keep_best`` on the true validation when
``--keep-best``). The result as JSON on the ``RESULT`` line.

    .venv/bin/python bench/rlhf.py --seeds 0 1 2 --steps 60
    .venv/bin/python bench/rlhf.py --seeds 0 --steps 10 --quick      # a smoke run, not a measurement
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trainer.builtin_models import shipped
from trainer.builtin_models.tiny_arith import write_arithmetic_datasets
from trainer.loops.reward_model import RewardModel
from trainer.spec import metrics as M
from trainer.spec.callbacks import JsonlFiles
from trainer.spec.config import parse_spec
from trainer.spec.data import load_preferences
from trainer.train import train

ACCURACY = {
    "type": "string_check",
    "name": "truth",
    "input": "{{sample.output_text}}",
    "reference": "{{item.answer}}",
    "operation": "eq",
}


def reward_model_job(
    model: Path, data: Path, out: Path, seed: int, hp: dict[str, Any], lora: dict[str, Any] | None = None
) -> dict[str, Any]:
    body: dict[str, Any] = {"hyperparameters": hp, **({"lora": lora} if lora else {})}
    spec = parse_spec(
        {
            "model": str(model),
            "training_file": str(data / "preferences.jsonl"),
            "seed": seed,
            "method": {"type": "reward_model", "reward_model": body},
        }
    )
    t0 = time.perf_counter()
    result = train(spec, output_dir=out, callback=JsonlFiles(out))
    seconds = time.perf_counter() - t0
    held = heldout_pairwise(out / "adapter", data / "validation_preferences.jsonl")
    return {"seconds": round(seconds, 1), "best_step": result.best_step, "steps": result.last_step, **held}


def heldout_pairwise(adapter: Path, path: Path) -> dict[str, Any]:
    rm = RewardModel(adapter, device=__import__("torch").device("cpu"), precision="fp32")
    items = load_preferences(path)
    prompts = [it.prompt for it in items]
    chosen = rm.score(prompts, [it.chosen for it in items], batch_size=64)
    rejected = rm.score(prompts, [it.rejected for it in items], batch_size=64)
    right = (chosen > rejected).tolist()
    by_kind: dict[str, list[bool]] = {}
    for it, ok in zip(items, right, strict=True):
        by_kind.setdefault(it.kind or "-", []).append(ok)
    return {
        "heldout_accuracy": round(sum(right) / len(right), 4),
        "by_kind": {k: round(sum(v) / len(v), 4) for k, v in sorted(by_kind.items())},
    }


def ppo_job(
    model: Path, data: Path, out: Path, seed: int, grader: dict[str, Any], steps: int, extra: dict[str, Any]
) -> dict[str, Any]:
    # Default PPO hyperparameters but for the run's length and cadence, and completions that fit tiny-arith's context
    # of 64 tokens (the default of 256 does not; an answer is at most 4 tokens with its EOS).
    hp = {
        "max_steps": steps,
        "max_completion_tokens": 6,
        "eval_interval": 10,
        "checkpoint_interval": 10,
        "rollouts_logged": 0,
        **extra,
    }
    spec = parse_spec(
        {
            "model": str(model),
            "training_file": str(data / "train.jsonl"),
            "validation_file": str(data / "validation.jsonl"),
            "seed": seed,
            "method": {"type": "ppo", "ppo": {"grader": grader, "hyperparameters": hp}},
        }
    )
    t0 = time.perf_counter()
    result = train(spec, output_dir=out, callback=JsonlFiles(out))
    rows = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    truth = M.reward_of("truth", validation=True) if grader["type"] == "multi" else M.VAL_REWARD_MEAN
    curve = {r["step"]: round(r[truth], 3) for r in rows if truth in r}
    events = [json.loads(ln) for ln in (out / "events.jsonl").read_text().splitlines()]
    return {
        "seconds": round(time.perf_counter() - t0, 1),
        "base": curve[0],
        "last": curve[max(curve)],
        "result": curve[result.best_step] if result.best_step is not None else curve[max(curve)],
        "best_step": result.best_step,
        "curve": curve,
        "events": [e["message"] for e in events if "over-optimis" in e["message"] or "best checkpoint" in e["message"]],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--model-dir", type=Path, default=None)
    ap.add_argument("--keep-best", action="store_true", help="PPO on the reward model keeps the best true validation")
    ap.add_argument("--raw", action="store_true", help="the reward model's raw score (no normalize)")
    ap.add_argument("--skip-truth", action="store_true", help="no PPO on the true grader")
    ap.add_argument("--skip-ppo", action="store_true", help="reward models only")
    ap.add_argument("--rm-hp", type=json.loads, default={}, help="reward-model hyperparameters (JSON), default none")
    ap.add_argument("--rm-lora", type=json.loads, default=None, help="reward-model LoRA (JSON), default none")
    ap.add_argument("--n-preferences", type=int, default=None, help="preference pairs written (default the writer's)")
    ap.add_argument("--ppo-hp", type=json.loads, default={}, help="extra PPO hyperparameters (JSON), both sides")
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    model = args.model_dir or shipped("tiny-arith")
    results: dict[str, Any] = {"steps": args.steps, "seeds": {}}
    with tempfile.TemporaryDirectory(prefix="proxima-rlhf-") as tmp:
        data = Path(tmp) / "data"
        write_arithmetic_datasets(data, **({"n_preferences": args.n_preferences} if args.n_preferences else {}))
        for seed in args.seeds:
            row: dict[str, Any] = {}
            rm_hp = {"max_steps": 10, **args.rm_hp} if args.quick else args.rm_hp
            rm_dir = Path(tmp) / f"rm-{seed}"
            row["reward_model"] = reward_model_job(model, data, rm_dir, seed, rm_hp, args.rm_lora)
            print(f"seed {seed} reward model: {json.dumps(row['reward_model'])}", flush=True)
            if not args.skip_ppo:
                if not args.skip_truth:
                    row["ppo_truth"] = ppo_job(
                        model, data, Path(tmp) / f"t-{seed}", seed, ACCURACY, args.steps, args.ppo_hp
                    )
                    print(f"seed {seed} PPO on the answer: {json.dumps(row['ppo_truth'])}", flush=True)
                rm = {"type": "reward_model", "name": "rm", "model": str(rm_dir), "normalize": not args.raw}
                grader = {
                    "type": "multi",
                    "name": "rlhf",
                    "graders": {"rm": rm, "truth": ACCURACY},
                    "calculate_output": "rm",
                }
                extra = {
                    **args.ppo_hp,
                    **({"keep_best": M.reward_of("truth", validation=True)} if args.keep_best else {}),
                }
                row["ppo_rm"] = ppo_job(model, data, Path(tmp) / f"r-{seed}", seed, grader, args.steps, extra)
                print(f"seed {seed} PPO on the reward model: {json.dumps(row['ppo_rm'])}", flush=True)
            results["seeds"][seed] = row
    print("RESULT " + json.dumps(results), flush=True)


if __name__ == "__main__":
    main()

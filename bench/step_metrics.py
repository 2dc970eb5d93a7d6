"""Per-step metrics of GRPO, PPO and DPO on tiny-arith for a fixed seed: recorded before a change to the trainer and
compared after it (the redesign's "same learning" check).

    git worktree add /tmp/base <commit-before>
    python bench/step_metrics.py record --base /tmp/base --out before.json    # the old trainer, from the worktree
    python bench/step_metrics.py record --out after.json
    python bench/step_metrics.py compare before.json after.json

Timing metrics are left out (they differ from run to run); every other value is compared with a relative tolerance.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

STEPS = 5
SEED = 11


def _specs(model: str, data: Path) -> dict[str, dict[str, Any]]:
    grader = {
        "type": "string_check",
        "name": "accuracy",
        "input": "{{sample.output_text}}",
        "reference": "{{item.answer}}",
        "operation": "eq",
    }
    common = {"max_steps": STEPS, "checkpoint_interval": STEPS, "precision": "auto"}
    # 16 validation examples each: the online methods' eval_samples is OpenAI's (completions per prompt).
    rl = {
        **common,
        "eval_prompts": 16,
        "batch_size": 4,
        "group_size": 4,
        "max_completion_tokens": 8,
        "learning_rate": 3e-4,
    }
    return {
        "grpo": {"grader": grader, "hyperparameters": {**rl, "eval_interval": 2}},
        "ppo": {
            "grader": grader,
            "hyperparameters": {**rl, "group_size": 1, "batch_size": 8, "mini_batches": 2, "iterations_per_batch": 2},
        },
        "dpo": {"hyperparameters": {**common, "eval_samples": 16, "batch_size": 8, "eval_interval": 2}},
    } | {"_files": {"model": model, "data": str(data)}}  # type: ignore[dict-item]


def record(out: Path) -> None:
    from trainer.builtin_models.tiny_arith import write_arithmetic_datasets
    from trainer.cli import resolve_model
    from trainer.spec import metrics as M
    from trainer.spec.callbacks import JsonlFiles
    from trainer.spec.config import parse_spec
    from trainer.train import train

    results: dict[str, list[dict[str, float]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "data"
        write_arithmetic_datasets(data)
        model = resolve_model("tiny-arith")
        specs = _specs(model, data)
        specs.pop("_files")
        for method, body in specs.items():
            files = (
                ("preferences.jsonl", "validation_preferences.jsonl")
                if method == "dpo"
                else ("train.jsonl", "validation.jsonl")
            )
            spec = parse_spec(
                {
                    "model": model,
                    "training_file": str(data / files[0]),
                    "validation_file": str(data / files[1]),
                    "seed": SEED,
                    "method": {"type": method, method: body},
                }
            )
            run = Path(tmp) / method
            train(spec, output_dir=run, callback=JsonlFiles(run))
            rows = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()]
            results[method] = [{k: v for k, v in r.items() if k not in M.TIMING_METRICS} for r in rows]
            print(f"{method}: {len(rows)} rows", file=sys.stderr)
    out.write_text(json.dumps(results, indent=1, sort_keys=True))


def compare(a: Path, b: Path, rtol: float) -> int:
    before, after = json.loads(a.read_text()), json.loads(b.read_text())
    worst = 0
    for method in before:
        for i, (ra, rb) in enumerate(zip(before[method], after.get(method, []), strict=False)):
            for k in sorted(set(ra) | set(rb)):
                va, vb = ra.get(k), rb.get(k)
                if va is None or vb is None:
                    print(f"{method} row {i}: {k} only in {'after' if va is None else 'before'}")
                    worst = 1
                elif not math.isclose(va, vb, rel_tol=rtol, abs_tol=1e-6):
                    print(f"{method} row {i} step {ra.get('step')}: {k} {va!r} → {vb!r}")
                    worst = 1
        if len(before[method]) != len(after.get(method, [])):
            print(f"{method}: {len(before[method])} rows before, {len(after.get(method, []))} after")
            worst = 1
    print("same" if not worst else "differ")
    return worst


def main() -> None:
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("record")
    r.add_argument("--out", type=Path, required=True)
    r.add_argument("--base", type=Path, help="record with the trainer of this checkout (a worktree of an older commit)")
    c = sub.add_parser("compare")
    c.add_argument("before", type=Path)
    c.add_argument("after", type=Path)
    c.add_argument("--rtol", type=float, default=1e-4)
    args = p.parse_args()
    if args.cmd == "record" and args.base is not None:
        from before_after import BOOT  # the same swap of checkouts as the speed comparison

        cmd = [sys.executable, "-c", BOOT, str(args.base.resolve()), __file__, "record", "--out", str(args.out)]
        sys.exit(subprocess.run(cmd).returncode)
    if args.cmd == "record":
        record(args.out)
    else:
        sys.exit(compare(args.before, args.after, args.rtol))


if __name__ == "__main__":
    main()

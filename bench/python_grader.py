"""The python grader's cost and learning against string_check: GRPO on tiny-arith, the same seed and steps,
graded once by `string_check` (exact match with the item's answer) and once by a `python` grader computing the same
score in the sandbox (trainer.grading.sandbox: one bubblewrap sandbox per batch).

Both graders give every sample the same score, so both runs sample the same completions and take the same updates:
their held-out accuracies must agree, and the difference of their step times is the python grader's cost. Each side
runs in its own subprocess (the script re-run with ``--worker``), alternating which goes first from round to round;
the grading time is measured directly too (the wall time of `trainer.loops.rl_collect.grade_batch`, wrapped). Each run
waits for the 1-minute load average to fall below 1 (at most 5 minutes), and ``/proc/loadavg`` is read before and
after it.

    .venv/bin/python bench/python_grader.py --rounds 3 --steps 40

Target: the python grader adds less than 20 % to the step time; the accuracies agree.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent

STRING_CHECK = {
    "type": "string_check",
    "name": "accuracy",
    "input": "{{sample.output_text}}",
    "reference": "{{item.answer}}",
    "operation": "eq",
}
PYTHON = {
    "type": "python",
    "name": "accuracy",
    "source": "def grade(sample, item):\n    return 1.0 if sample['output_text'] == item['answer'] else 0.0\n",
}
SIDES = {"string_check": STRING_CHECK, "python": PYTHON}


def _loadavg() -> float:
    return float(Path("/proc/loadavg").read_text().split()[0])


def worker(side: str, steps: int, seed: int) -> None:
    """One training run; prints one RESULT line of JSON."""
    import torch

    from trainer.builtin_models import shipped
    from trainer.builtin_models.tiny_arith import write_arithmetic_datasets
    from trainer.loops import rl_collect
    from trainer.spec.callbacks import JsonlFiles
    from trainer.spec.config import parse_spec
    from trainer.train import train

    torch.set_num_threads(max(1, os.cpu_count() or 1))
    model = shipped("tiny-arith")
    work = Path(tempfile.mkdtemp(prefix=f"python-grader-bench-{side}-"))
    write_arithmetic_datasets(work / "data")
    grading: list[float] = []
    original = rl_collect.grade_batch

    def timed(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            grading.append(time.perf_counter() - start)

    rl_collect.grade_batch = timed  # type: ignore[assignment]
    spec = parse_spec(
        {
            "model": str(model),
            "training_file": str(work / "data" / "train.jsonl"),
            "validation_file": str(work / "data" / "validation.jsonl"),
            "seed": seed,
            "method": {
                "type": "grpo",
                "grpo": {
                    "grader": SIDES[side],
                    "hyperparameters": {
                        "max_steps": steps,
                        "batch_size": 8,
                        "group_size": 8,
                        "learning_rate": 3e-4,
                        "max_completion_tokens": 6,
                        "eval_interval": steps,
                        "checkpoint_interval": steps,
                        "rollouts_logged": 0,
                    },
                    "lora": {"r": 16, "alpha": 32, "target_modules": "all-linear"},
                },
            },
        }
    )
    result = train(spec, output_dir=work / "run", callback=JsonlFiles(work / "run"))
    rows = [json.loads(line) for line in (work / "run" / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in rows if r["step"] >= 1]
    # The validation steps (the last) grade 200 held-out prompts on top: the step time of the others is the training
    # step's. `grading` holds the training batches' grading (validation grades through trainer.loops.evaluate directly).
    plain = [r["time/step_s"] for r in trained if "val/reward/mean" not in r]
    print(
        "RESULT "
        + json.dumps(
            {
                "side": side,
                "step_s_median": statistics.median(plain),
                "step_s": plain,
                "grading_s_train_median": statistics.median(grading),
                "accuracy_before": rows[0]["val/reward/mean"],
                "accuracy_after": result.final_metrics["val/reward/mean"],
            }
        ),
        flush=True,
    )


IDLE_LOAD = 1.0
"""A run starts once the 1-minute load average is below this (the previous run's own load decays first)."""


def _wait_for_idle(limit_s: float = 300.0) -> None:
    deadline = time.monotonic() + limit_s
    while _loadavg() >= IDLE_LOAD and time.monotonic() < deadline:
        time.sleep(5)


def run_side(side: str, steps: int, seed: int) -> dict[str, Any]:
    _wait_for_idle()
    before = _loadavg()
    out = subprocess.run(
        [sys.executable, __file__, "--worker", side, "--steps", str(steps), "--seed", str(seed)],
        capture_output=True,
        text=True,
        check=False,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    after = _loadavg()
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")]
    if out.returncode != 0 or not lines:
        raise SystemExit(f"{side} failed ({out.returncode}):\n{out.stderr[-3000:]}")
    return {**json.loads(lines[-1][len("RESULT ") :]), "load_before": before, "load_after": after}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--worker", choices=sorted(SIDES))
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if args.worker:
        worker(args.worker, args.steps, args.seed)
        return
    rounds = []
    for r in range(args.rounds):
        order = ["string_check", "python"] if r % 2 == 0 else ["python", "string_check"]
        results = {side: run_side(side, args.steps, args.seed) for side in order}
        rounds.append(results)
        s, p = results["string_check"], results["python"]
        print(
            f"round {r + 1} ({' then '.join(order)}): step {s['step_s_median']:.3f} s vs {p['step_s_median']:.3f} s "
            f"(+{100 * (p['step_s_median'] / s['step_s_median'] - 1):.1f} %); grading "
            f"{s['grading_s_train_median']:.4f} s vs {p['grading_s_train_median']:.4f} s a step; accuracy "
            f"{s['accuracy_before']:.3f} → {s['accuracy_after']:.3f} vs {p['accuracy_before']:.3f} → "
            f"{p['accuracy_after']:.3f}; load {min(x['load_before'] for x in results.values()):.2f}–"
            f"{max(x['load_after'] for x in results.values()):.2f}",
            flush=True,
        )
    overhead = [100 * (r["python"]["step_s_median"] / r["string_check"]["step_s_median"] - 1) for r in rounds]
    share = [100 * r["python"]["grading_s_train_median"] / r["python"]["step_s_median"] for r in rounds]
    print(
        f"python grader: step time +{statistics.median(overhead):.1f} % (median; {min(overhead):.1f}–"
        f"{max(overhead):.1f}); its grading {statistics.median(share):.1f} % of the step "
        f"({min(share):.1f}–{max(share):.1f})"
    )
    if args.json:
        args.json.write_text(json.dumps(rounds, indent=1))


if __name__ == "__main__":
    main()

"""Our trainer before and after a change, side by side: one benchmark's ``ours`` worker run from another checkout
(the commit before, as a ``git worktree``) and from this one, alternating, each run in its own process.

    git worktree add /tmp/base <commit-before>
    python bench/before_after.py --base /tmp/base --rounds 4 grpo_vs_trl.py -- \
        --model-dir /tmp/proxima-grpo-bench/qwen2-h256-l4 --prompts /tmp/proxima-grpo-bench/prompts.jsonl \
        --precision fp32 --steps 3 --warmup 1 --threads 1

Everything after ``--`` goes to the benchmark's ``--worker ours`` (the model and prompts a normal run of that
benchmark builds in its work folder). The base checkout is imported in place of this one: the editable install's
finder is taken off ``sys.meta_path`` and the checkout put first on ``sys.path``. Prints every run with the load
average before and after it, then the median over rounds of each run's median seconds per step, with the range.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from common import idle_runs, run_worker

HERE = Path(__file__).resolve().parent

# Run in the worker's interpreter: import the base checkout's trainer, then run its copy of the benchmark.
BOOT = """
import os, runpy, sys
base = sys.argv[1]
sys.meta_path = [f for f in sys.meta_path if "editable" not in repr(f).lower()]
sys.path[:0] = [base, os.path.join(base, "bench")]
import trainer
assert trainer.__file__.startswith(base), trainer.__file__
sys.argv = sys.argv[2:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def run(side: str, base: Path, script: str, argv: list[str]) -> dict[str, Any]:
    """One ``ours`` worker run, from the base checkout (``before``) or this one, through ``common.run_worker``."""
    if side == "before":
        # in the base checkout: the processes it starts with ``python -c`` (the grading pool's) have the working
        # folder first on their path, and would import this checkout's trainer from here
        boot = [sys.executable, "-c", BOOT, str(base)]
        return run_worker(str(base / "bench" / script), "ours", argv, python=boot, cwd=base)
    return run_worker(str(HERE / script), "ours", argv)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", type=Path, required=True, help="checkout of the commit before the change")
    p.add_argument("--rounds", type=int, default=4, help="before/after alternations (the order flips each round)")
    p.add_argument("--json", type=Path, help="also write every run here")
    p.add_argument("script", help="grpo_vs_trl.py or ppo_vs_trl.py")
    p.add_argument("worker_args", nargs=argparse.REMAINDER, help="-- then the worker's arguments")
    a = p.parse_args()
    argv = a.worker_args[1:] if a.worker_args[:1] == ["--"] else a.worker_args
    runs: dict[str, list[dict[str, Any]]] = {"before": [], "after": []}
    for r in range(a.rounds):
        for side in ("before", "after") if r % 2 == 0 else ("after", "before"):
            res = run(side, a.base.resolve(), a.script, argv)
            l0, l1 = res["load_start"], res["load_end"]
            med = statistics.median(res["step_s"])
            runs[side].append({"median_s": med, **res})
            steps = " ".join(f"{s:.3f}" for s in res["step_s"])
            print(
                f"round {r + 1} {side:6s} median {med:.3f} s/step ({steps}), peak RSS {res['peak_rss_mib']:.0f} MiB, "
                f"load {l0} → {l1}" + (" UNDER LOAD: left out" if res.get("loaded") else ""),
                flush=True,
            )
    for side, every in runs.items():
        rs = idle_runs(every)
        meds = [x["median_s"] for x in rs]
        rss = [x["peak_rss_mib"] for x in rs]
        print(
            f"{side:6s} {statistics.median(meds):.3f} s/step (rounds {min(meds):.3f}–{max(meds):.3f}), "
            f"peak RSS {statistics.median(rss):.0f} MiB ({min(rss):.0f}–{max(rss):.0f}); "
            f"{len(every) - len(rs)} of {len(every)} rounds left out (started under load)"
        )
    if a.json:
        a.json.write_text(json.dumps(runs, indent=1))


if __name__ == "__main__":
    main()

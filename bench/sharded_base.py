"""What sharding the base costs and saves (``resources.shard_base``, FSDP2): one GRPO job on two ranks over gloo,
its base replicated on both (``ddp``), sharded across them (``fsdp``), or sharded and gathered whole for each
generation (``gather``: ``gather_for_generation``), side by side.

Each side is ``torch.distributed.run`` with two ranks of this script; every rank reports its peak RSS (``VmHWM``)
over the whole run (the load included: each rank loads the whole base on the host before keeping its shard) and over
the measured steps (reset after the warm-up), and rank 0 the step times. fp32 on both sides: neither samples from a
merged copy (a sharded base has none), so the two differ only in where the base's weights live and the lockstep
passes. The model is the benchmarks' ``xl`` by default (hidden 1024, 16 layers: about 1 GB of fp32 weights),
with a smaller batch than ``grpo_vs_trl.py``'s (2 prompts × 4 samples, 16 new tokens) to keep a step short on 2 cores.

    python bench/sharded_base.py [--model xl] [--steps 2] [--warmup 1] [--rounds 2]
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

from common import (
    DEFAULT_WORKDIR,
    build_assets,
    emit_result,
    idle_runs,
    peak_rss_mib,
    reset_peak_rss,
    run_rounds,
    run_worker,
)
from grpo_vs_trl import our_spec

PROMPTS, GROUP, COMPLETION = 2, 4, 16


def spec(model_dir: Path, prompts: Path, *, side: str, max_steps: int) -> Any:
    """``grpo_vs_trl.py``'s job in fp32 on this benchmark's smaller batch, on two ranks as ``side`` places the base."""
    from trainer.spec.config import Resources

    job = our_spec(model_dir, prompts, "fp32", max_steps=max_steps)
    smaller = {"batch_size": PROMPTS, "group_size": GROUP, "min_completion_tokens": COMPLETION,
               "max_completion_tokens": COMPLETION, "eval_interval": 0}  # fmt: skip
    hp = job.method.hyperparameters.model_copy(update=smaller)
    where = Resources(gpus=2, shard_base=side != "ddp", gather_for_generation=side == "gather")
    return job.model_copy(update={"method": job.method.model_copy(update={"hyperparameters": hp}), "resources": where})


def rank(side: str, model_dir: Path, prompts: Path, steps: int, warmup: int, out: Path) -> None:
    """One rank of a side's run (under torch's launcher): its figures to ``out/rank<N>.json``."""
    import torch

    from trainer.generation import distributed
    from trainer.loops.rl import RLTrainer
    from trainer.spec.callbacks import BaseCallback

    world = distributed.from_environment()
    distributed.initialise(world)
    times: list[float] = []
    clock = {"last": 0.0, "done": 0, "steps_peak": 0.0}

    class Clock(BaseCallback):
        def on_metrics(self, step: int, metrics: dict[str, float]) -> None:
            now = time.perf_counter()
            clock["done"] += 1
            if clock["done"] > warmup:
                times.append(now - clock["last"])
            clock["last"] = now

    whole_peak = 0.0
    with tempfile.TemporaryDirectory() as run:
        t = RLTrainer(
            spec(model_dir, prompts, side=side, max_steps=warmup + steps),
            output_dir=Path(run),
            callback=Clock(),
            device=torch.device("cpu"),
            world=world,
        )
        loaded_peak = peak_rss_mib()
        original = t.step

        def step(n: int) -> dict[str, float]:  # the steps' own peak: reset after the warm-up
            m = original(n)
            if n == warmup:
                reset_peak_rss()
            return m

        t.step = step  # type: ignore[method-assign]
        clock["last"] = time.perf_counter()
        t.run()
        whole_peak = max(loaded_peak, peak_rss_mib())
        steps_peak = peak_rss_mib()
    from torch.distributed.tensor import DTensor

    frozen = [p for p in t.models.model.parameters() if not p.requires_grad]
    held = sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in frozen)  # this rank's
    (out / f"rank{world.rank}.json").write_text(
        json.dumps({"step_s": times, "peak_rss_mib": steps_peak, "run_peak_rss_mib": whole_peak, "numel": held})
    )
    distributed.shut_down()


def worker(side: str, model: str, steps: int, warmup: int, workdir: Path) -> dict[str, Any]:
    """A side's run: two ranks under torch's launcher; rank 0's step times, each rank's peaks."""
    build_assets(workdir, model)
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", __file__,
               "--rank", side, "--model", model, "--steps", str(steps), "--warmup", str(warmup),
               "--workdir", str(workdir), "--out", out]  # fmt: skip
        proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        if proc.returncode != 0:
            sys.stderr.write(proc.stderr[-6000:])
            raise SystemExit(f"{side}: the ranks failed (exit {proc.returncode})")
        ranks = [json.loads((Path(out) / f"rank{r}.json").read_text()) for r in (0, 1)]
    return {
        "step_s": ranks[0]["step_s"],
        "peak_rss_mib": max(r["peak_rss_mib"] for r in ranks),
        "run_peak_rss_mib": max(r["run_peak_rss_mib"] for r in ranks),
        "base_numel_per_rank": [r["numel"] for r in ranks],
        "phases": {},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="xl")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--workdir", type=Path, default=DEFAULT_WORKDIR)
    ap.add_argument("--worker")
    ap.add_argument("--rank")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    if a.rank:
        model_dir, prompts = build_assets(a.workdir, a.model)
        rank(a.rank, model_dir, prompts, a.steps, a.warmup, a.out)
        return
    if a.worker:
        emit_result(worker(a.worker, a.model, a.steps, a.warmup, a.workdir))
        return
    build_assets(a.workdir, a.model)
    argv = ["--model", a.model, "--steps", str(a.steps), "--warmup", str(a.warmup), "--workdir", str(a.workdir)]
    runs = run_rounds(["ddp", "fsdp", "gather"], a.rounds, lambda side: run_worker(__file__, side, argv))
    for side, every in runs.items():
        rs = idle_runs(every)
        times = [t for r in rs for t in r["step_s"]]
        print(
            f"{side}: {statistics.median(times):.2f} s/step median ({min(times):.2f}–{max(times):.2f}, "
            f"{len(times)} steps of {len(rs)} idle rounds); peak RSS a rank, steps "
            f"{max(r['peak_rss_mib'] for r in rs):.0f} MiB, whole run {max(r['run_peak_rss_mib'] for r in rs):.0f} "
            f"MiB; base elements a rank {rs[0]['base_numel_per_rank']}"
        )


if __name__ == "__main__":
    main()

"""What loading a sharded base costs each rank's host memory (``resources.shard_base``): two ranks over gloo load a
LoRA policy and shard its frozen base (``trainer.generation.distributed.shard_frozen_base``), with every rank reading
the weights (``all``, as before 0e90a56) or rank 0 alone, the other on the meta device receiving its shard (``rank0``,
what the trainer does). Each rank reports its peak RSS (``VmHWM``) before the load and after the sharding; then,
outside the measurement, the sharded policy's logits on a fixed batch against a whole copy's (the benchmarks'
models tie the LM head to the embeddings: the meta load handles the tie). The sides alternate, one launch each.

    python bench/sharded_load.py [--model large] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from common import DEFAULT_WORKDIR, build_assets, loadavg, peak_rss_mib


def rank(model_dir: str, side: str) -> None:
    import torch

    from trainer.generation import distributed
    from trainer.loops.engine import load_policy
    from trainer.spec.lora import LoraSpec

    world = distributed.from_environment()
    distributed.initialise(world)
    cpu = torch.device("cpu")
    before = peak_rss_mib()
    weights = side == "all" or world.main
    policy = load_policy(model_dir, LoraSpec(), device=cpu, precision="fp32", seed=0, weights=weights).model
    sharding = distributed.shard_frozen_base(policy, world, cpu)
    after = peak_rss_mib()
    whole = load_policy(model_dir, LoraSpec(), device=cpu, precision="fp32", seed=0).model
    ids = torch.arange(1, 17).reshape(2, 8)
    with torch.no_grad():
        a = whole(input_ids=ids).logits
        b = policy(input_ids=ids).logits
    result = {"rank": world.rank, "side": side, "before_mib": before, "after_mib": after, "held": sharding.held,
              "total": sharding.total, "from_rank0": sharding.from_rank0,
              "logits_max_diff": float((a - b).abs().max()), "logits_scale": float(a.abs().max())}  # fmt: skip
    print("RESULT " + json.dumps(result), flush=True)
    distributed.shut_down()


def launch(side: str, model_dir: Path) -> list[dict]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", __file__,
           "--rank", side, "--model-dir", str(model_dir)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr[-6000:])
        raise SystemExit(f"{side}: the ranks failed (exit {proc.returncode})")
    lines = [ln.removeprefix("RESULT ") for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    return sorted((json.loads(ln) for ln in lines), key=lambda r: r["rank"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="large")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--workdir", type=Path, default=DEFAULT_WORKDIR)
    ap.add_argument("--rank", help=argparse.SUPPRESS)
    ap.add_argument("--model-dir", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.rank:
        rank(a.model_dir, a.rank)
        return
    model_dir, _ = build_assets(a.workdir, a.model)
    for n in range(1, a.rounds + 1):
        for side in ("all", "rank0") if n % 2 else ("rank0", "all"):
            load_start = loadavg()
            ranks = launch(side, model_dir)
            rises = [r["after_mib"] - r["before_mib"] for r in ranks]
            print(
                f"round {n} {side:5}: rise in peak RSS by rank {', '.join(f'{x:.0f}' for x in rises)} MiB "
                f"(sum {sum(rises):.0f}); base elements held {ranks[0]['held']:,} of {ranks[0]['total']:,}; "
                f"from rank 0 {ranks[0]['from_rank0']}; logits max |Δ| "
                f"{max(r['logits_max_diff'] for r in ranks):.1e} of {ranks[0]['logits_scale']:.2f} "
                f"(load {load_start} → {loadavg()})",
                flush=True,
            )


if __name__ == "__main__":
    main()

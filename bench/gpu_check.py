"""A GPU check of the trainer: every loop for a few steps on CUDA, on the benchmarks' small model (``common.py``).

Run on a machine with a GPU (CI has none; the suite runs on the CPU; without the variable it is a CPU dry run):

    PROXIMA_BENCH_DEVICE=cuda python bench/gpu_check.py

Each method trains 3 steps on ``cuda`` in bf16 (the ``auto`` precision there): GRPO (sampling from the merged bf16
copy; again with the compiled decode step, ``compile_decode: on``), Dr. GRPO, DAPO, RLOO, REINFORCE, PPO with the
critic adapter (its passes joined to the policy's, the default on CUDA), PPO with the trunk head, PPO graded by a
reward model, the reward model itself, DPO and supervised. It checks that every metric is finite, that the step's
tensors lived on the GPU (peak memory allocated > 0) and that the adapter saved at the end loads with
``PeftModel.from_pretrained`` on the GPU and gives the trained policy's log-probs. Then the critic's joined passes
against the passes apart on one rollout (the same log-probs and values; the milliseconds of each, for the choice of
default). Then GRPO once more as the worker runs a job asking for ``resources.gpus``: through its launcher
(``worker.launch``: torch's elastic launcher, NCCL on the GPU), world size 1 on a one-GPU machine
(``GPU_CHECK_RANKS=N`` for N ranks where N GPUs are). Prints one line per method and exits non-zero on the first
failure.
"""

from __future__ import annotations

import json
import math
import os
import random
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

from common import DEFAULT_WORKDIR, DEVICE, GRADER, LORA_ALPHA, LORA_R, SEED, build_assets


def data_files(work: Path, prompts: Path) -> dict[str, Path]:
    rng = random.Random(SEED)
    texts = [json.loads(ln)["prompt"] for ln in prompts.read_text().splitlines() if ln.strip()][:96]
    words = " ".join(texts).split()
    prefs, sft = work / "gpu-prefs.jsonl", work / "gpu-sft.jsonl"
    with prefs.open("w") as f:
        for t in texts:
            f.write(json.dumps({"prompt": t, "chosen": " ".join(rng.sample(words, 3)), "rejected": "x " + t}) + "\n")
    with sft.open("w") as f:
        for t in texts:
            reply = " ".join(rng.sample(words, 5))
            f.write(json.dumps({"messages": [{"role": "user", "content": t}, {"role": "assistant", "content": reply}]}))
            f.write("\n")
    return {"prompts": prompts, "preferences": prefs, "supervised": sft}


def spec_for(model: Path, files: dict[str, Path], method: str, grader: Any = None, **hp: Any) -> dict[str, Any]:
    rl = method in {"grpo", "dr_grpo", "dapo", "rloo", "reinforce", "ppo"}
    hyper = {"max_steps": 3, "batch_size": 8, "checkpoint_interval": 2, "precision": "auto", **hp}
    if rl:
        hyper |= {"max_completion_tokens": 24, "max_prompt_tokens": 40}
        hyper.setdefault("group_size", 4)
    body: dict[str, Any] = {
        "hyperparameters": hyper,
        "lora": {"r": LORA_R, "alpha": LORA_ALPHA, "dropout": 0.0, "target_modules": "all-linear"},
    }
    if rl:
        body["grader"] = grader or GRADER
    fmt = "prompts" if rl else ("supervised" if method == "supervised" else "preferences")
    return {
        "model": str(model),
        "training_file": str(files[fmt]),
        "seed": SEED,
        "method": {"type": method, method: body},
    }


def check(name: str, raw: dict[str, Any], out: Path) -> Path:
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from trainer.generation.models import autocast
    from trainer.spec.callbacks import BaseCallback
    from trainer.spec.config import parse_spec
    from trainer.train import build_trainer

    rows: list[dict[str, float]] = []

    class Keep(BaseCallback):
        def on_metrics(self, step: int, metrics: dict[str, float]) -> None:
            rows.append(metrics)

    cuda = DEVICE == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    trainer = build_trainer(parse_spec(raw), output_dir=out, callback=Keep(), device=torch.device(DEVICE))
    res = trainer.run()
    secs = time.perf_counter() - t0
    assert len(rows) >= 3, f"{name}: {len(rows)} metric rows"
    # explained variance is NaN by definition when the returns do not vary (the worker stores it as null)
    bad = {k: v for r in rows for k, v in r.items() if not math.isfinite(v) and k != "value/explained_variance"}
    assert not bad, f"{name}: non-finite metrics {bad}"
    peak = torch.cuda.max_memory_allocated() / 2**20 if cuda else 0.0
    assert peak > 0 or not cuda, f"{name}: nothing was allocated on the GPU"
    assert res.adapter_dir is not None and (res.adapter_dir / "adapter_config.json").exists(), name
    extra = ""
    if raw["method"]["type"] not in {"reward_model"}:
        policy = getattr(trainer, "model", None)
        base = AutoModelForCausalLM.from_pretrained(raw["model"], dtype=torch.float32).to(DEVICE)
        loaded = PeftModel.from_pretrained(base, str(res.adapter_dir)).eval()
        ids = torch.randint(2, 1000, (2, 12), device=DEVICE)
        with torch.no_grad():
            a = loaded(input_ids=ids).logits.float()
            if policy is not None:
                policy.eval()
                with autocast(trainer.precision, torch.device(DEVICE)):  # its frozen weights may be bf16
                    b = policy(input_ids=ids).logits.float()
                diff = float((a.log_softmax(-1) - b.log_softmax(-1)).abs().max())
                assert diff < 0.1, f"{name}: the reloaded adapter's log-probs differ by {diff}"
                extra = f", reloaded adapter max |Δ log p| {diff:.1e}"
    last = rows[-1]
    shown = {k: round(v, 4) for k, v in last.items() if k.split("/")[0] in {"reward", "loss", "kl", "value"}}
    print(f"OK {name}: {len(rows)} steps in {secs:.1f} s, peak GPU {peak:.0f} MiB{extra}; last {shown}", flush=True)
    return res.adapter_dir


def check_joined_passes(raw: dict[str, Any], out: Path, reps: int = 5) -> None:
    """PPO's adapter critic: its passes joined to the policy's (one pass over the copies of the rows, the default on
    CUDA) against the passes apart, on one rollout: the same log-probs and values, and the seconds of each, median
    of ``reps`` alternating runs (synchronised), for the rollout's scores and for the update's forward + backward."""
    import statistics

    import torch

    from trainer.loops.rl import RLTrainer
    from trainer.spec.callbacks import BaseCallback
    from trainer.spec.config import parse_spec

    t = RLTrainer(parse_spec(raw), output_dir=out, callback=BaseCallback(), device=torch.device(DEVICE))
    critic = t.models.critic
    assert critic is not None and critic.can_fuse, "the adapter critic can join the policy's passes"
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # distinct adapters: zero B's would make both the identity
        for n, p in t.models.model.named_parameters():
            if "lora_B" in n:
                p.copy_((torch.randn(p.shape, generator=g) * 0.1).to(p.device))
        critic.head.weight.copy_(torch.randn(critic.head.weight.shape, generator=g).to(critic.head.weight.device))
    ro = t.collect().rollout
    m = ro.completion_mask.bool()
    kw = {"temperature": 1.0, "micro_batch_size": None}

    def sync() -> None:
        if DEVICE == "cuda":
            torch.cuda.synchronize()

    def apart() -> tuple[torch.Tensor, ...]:
        with torch.no_grad():
            return (
                t.engine.logprobs(ro, **kw),
                t.engine.logprobs(ro, **kw, reference=True),
                critic.rollout_values(ro, precision=t.precision, micro_batch_size=None),
            )

    def joined() -> tuple[torch.Tensor, ...]:
        return critic.rollout_scores(ro, policy=True, reference=True, precision=t.precision, **kw)

    def update_apart() -> None:
        logp, _, _ = t.engine.forward(ro, temperature=1.0)
        logp.sum().backward()
        critic.values(ro, precision=t.precision).sum().backward()

    def update_joined() -> None:
        logp, _, v = t.engine.run_forward(critic.forward_with_policy, ro, temperature=1.0, precision=t.precision)
        (logp.sum() + v.sum()).backward()

    diffs = [float((a[m].float() - b[m].float()).abs().max()) for a, b in zip(apart(), joined(), strict=True)]
    assert max(diffs) < 0.05, f"joined passes differ from the separate ones by {diffs}"
    times: dict[str, list[float]] = {}
    for r in range(reps + 1):
        for name, fn in (("scores apart", apart), ("scores joined", joined))[:: 1 if r % 2 else -1]:
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            times.setdefault(name, []).append(time.perf_counter() - t0)
        for name, fn in (("update apart", update_apart), ("update joined", update_joined))[:: 1 if r % 2 else -1]:
            t.engine.zero_grad()
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            times.setdefault(name, []).append(time.perf_counter() - t0)
    shown = ", ".join(f"{k} {1000 * statistics.median(v[1:]):.1f} ms" for k, v in times.items())
    print(f"OK the critic's joined passes: max |Δ| old, ref, V {', '.join(f'{d:.1e}' for d in diffs)}; {shown}")


def check_launched(raw: dict[str, Any], run_dir: Path, ranks: int) -> None:
    """The job as a worker runs it on ``ranks`` devices: ``python -m worker.launch RANKS RUN_DIR``, its messages read
    as the worker reads them."""
    from worker import messages as msg
    from worker.trainer_process import Ended, TrainerProcess

    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "spec.json").write_text(json.dumps(raw | {"resources": {"gpus": ranks}}))
    t0 = time.perf_counter()
    trainer = TrainerProcess(run_dir, stop_grace_s=30, ranks=ranks)
    got: list[Any] = []
    try:
        while time.perf_counter() - t0 < 600:
            try:
                if (m := trainer.get(timeout=0.5)) is not None:
                    got.append(m)
            except Ended:
                break
        rc = trainer.close()
    finally:
        trainer.kill()
    errors = [m for m in got if isinstance(m, msg.Error)]
    assert rc == 0 and not errors, f"exit {rc}, {errors}; stderr:\n{trainer.stderr_tail(30)}"
    rows = [m.metrics for m in got if isinstance(m, msg.Metrics)]
    bad = {k: v for r in rows for k, v in r.items() if not math.isfinite(v)}
    assert len(rows) >= 3 and not bad, f"{len(rows)} metric rows, non-finite {bad}"
    assert any(isinstance(m, msg.Done) for m in got) and (run_dir / "adapter" / "adapter_config.json").exists()
    print(f"OK grpo through the launcher, {ranks} rank(s): {len(rows)} steps in {time.perf_counter() - t0:.1f} s")


def main() -> None:
    import torch

    if DEVICE == "cuda":
        assert torch.cuda.is_available(), "no GPU: this check runs where CUDA is"
        print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}", flush=True)
    else:
        print(f"torch {torch.__version__} on the CPU (a dry run: PROXIMA_BENCH_DEVICE=cuda for the GPU)", flush=True)
    model_dir, prompts = build_assets(DEFAULT_WORKDIR, "small")
    files = data_files(DEFAULT_WORKDIR, prompts)
    failures = 0
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        cases: list[tuple[str, dict[str, Any]]] = [
            ("reward_model", spec_for(model_dir, files, "reward_model", max_length=128)),
            ("dpo", spec_for(model_dir, files, "dpo", max_length=128)),
            ("supervised", spec_for(model_dir, files, "supervised", max_length=128)),
            ("grpo bf16 (merged sampler)", spec_for(model_dir, files, "grpo")),
            (
                "grpo fp32 (sampler log-probs)",
                spec_for(model_dir, files, "grpo", precision="fp32", iterations_per_batch=2),
            ),
            (
                "grpo bf16 compiled decode",
                spec_for(model_dir, files, "grpo", compile_decode="on", max_steps=4),
            ),
            ("dr_grpo", spec_for(model_dir, files, "dr_grpo")),
            ("dapo", spec_for(model_dir, files, "dapo")),
            ("rloo", spec_for(model_dir, files, "rloo")),
            ("reinforce", spec_for(model_dir, files, "reinforce")),
            ("ppo adapter critic (passes joined on CUDA)", spec_for(model_dir, files, "ppo", group_size=1)),
            ("ppo policy_trunk", spec_for(model_dir, files, "ppo", group_size=1, critic="policy_trunk")),
        ]
        rm_dir: Path | None = None
        only = [w for w in os.environ.get("GPU_CHECK_ONLY", "").split(",") if w]
        for name, raw in cases:
            if only and name.split()[0] not in only:
                continue
            try:
                adapter = check(name, raw, root / name.split()[0] / str(len(name)))
                if name == "reward_model":
                    rm_dir = adapter
            except Exception as err:  # report every case, then fail
                failures += 1
                print(f"FAIL {name}: {type(err).__name__}: {err}", flush=True)
                print("".join(traceback.format_exc().splitlines(keepends=True)[-24:]), flush=True)
        if rm_dir is not None:
            grader = {"type": "reward_model", "name": "rm", "model": str(rm_dir)}
            try:
                check(
                    "ppo + reward_model grader", spec_for(model_dir, files, "ppo", grader, group_size=1), root / "rlhf"
                )
            except Exception as err:
                failures += 1
                print(f"FAIL ppo + reward_model grader: {type(err).__name__}: {err}", flush=True)
        if not only or "joined" in only:
            try:
                check_joined_passes(spec_for(model_dir, files, "ppo", group_size=1, max_steps=1), root / "joined")
            except Exception as err:
                failures += 1
                print(f"FAIL the critic's joined passes: {type(err).__name__}: {err}", flush=True)
        if not only or "launched" in only:
            try:
                ranks = int(os.environ.get("GPU_CHECK_RANKS", "1"))
                check_launched(spec_for(model_dir, files, "grpo"), root / "launched", ranks)
            except Exception as err:
                failures += 1
                print(f"FAIL grpo through the launcher: {type(err).__name__}: {err}", flush=True)
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()

"""Side-by-side GRPO benchmark: this trainer against TRL's ``GRPOTrainer`` (results in BENCHMARKS.md).

The same run on both sides: LoRA r=16 (all-linear, alpha 32, dropout 0), 8 prompts × 8 samples per step, prompts of
16–32 tokens, exactly 32 new tokens per sample (EOS held off: ours ``min_completion_tokens = max_completion_tokens =
32``, TRL ``generation_kwargs={"min_new_tokens": 32}``; both checked every step), β = 0.04 with the k3 KL in the loss,
temperature 1, top-p 1, one optimiser step per rollout batch (μ = 1, one mini-batch, no accumulation), GRPO's
per-sequence token mean (TRL ``loss_type="grpo"``), AdamW at lr 3e-4, grad-norm clip 1.0, the same reward (our
``length_penalty`` grader, called by both), fp32 or bf16 autocast with fp32 master weights on both sides. TRL runs
without gradient checkpointing by default so that both sides do the same work (``--trl-gradient-checkpointing``
turns on TRL's default).

Each side runs in its own subprocess (``--worker``) so that its peak memory is its own: peak RSS (``VmHWM``) is
reset after the warm-up steps and read after the last measured step. Sides alternate: ours, TRL, ours, TRL, ...
(``--rounds``). Step time is the wall time between consecutive step ends, warm-up steps excluded. The
configuration, the models and this harness are shared with ``ppo_vs_trl.py`` (``common.py``).

Models: Qwen2 architecture, randomly initialised (seed 0) and saved with a locally built byte-level BPE of 1024
tokens into ``--workdir``: ``small`` = hidden 256, 4 layers; ``large`` = hidden 512, 8 layers (FFN 4×hidden,
head dim 64, 2 query heads per KV head, tied embeddings).

Model FLOPs per step (MFU's numerator; padding excluded, attention-score FLOPs left out: < 4% at context ≤ 64):
    B = 64 rows, C = 32 completion tokens, p = mean prompt tokens, T = B·(p + C)
    N = matmul weights of the transformer body (q, k, v, o, gate, up, down), N_L = LoRA weights (A and B),
    H = V·h (the LM head: a matmul even when tied to the embedding)
    generation    2·(N + N_L)·B·(p + C − 1) + 2·H·B·C       (prefill + C − 1 decode steps, logits for C tokens)
    reference     2·N·T + 2·H·B·C                            (adapter disabled)
    policy fwd    2·(N + N_L)·T + 2·H·B·C
    backward      2·N·T + 2·H·B·C + 4·N_L·T                  (frozen weights need only input gradients; LoRA both)
MFU = the FLOPs a side runs per step / (seconds per step × the machine's measured matmul rate at that precision), the
rate measured at startup with a 2048³ matmul (fp32 tensors for fp32, bf16 tensors for bf16). TRL runs the formulas
above; ours runs each group's prompt once (in the prefill and the three passes: ``trainer.generation.rollout``'s shared
prompt forward), i.e. the same formulas with p / GROUP in place of p.

Run:  .venv/bin/python bench/grpo_vs_trl.py --model small --precision bf16
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from common import (
    BATCH_PROMPTS,
    COMPLETION,
    DEFAULT_WORKDIR,
    DEVICE,
    GRADER,
    GROUP,
    LORA_ALPHA,
    LORA_R,
    LR,
    MODELS,
    PROMPT_MAX,
    ROWS,
    SEED,
    VOCAB,
    ModelShape,
    PhaseTimer,
    StepClock,
    build_assets,
    emit_result,
    flop_terms,
    format_phases,
    idle_runs,
    patch_backward,
    prompt_lengths,
    run_rounds,
    run_worker,
    summarise,
)

BETA = 0.04


# -- FLOPs and the machine's matmul rate --------------------------------------------------------------------------


def model_flops_per_step(shape: ModelShape, mean_prompt: float, *, prompts_shared: bool = False) -> dict[str, float]:
    """Model FLOPs of one step by phase (the formula in the module docstring); ``prompts_shared``: a group's prompt
    run once (p / GROUP tokens a row)."""
    p = mean_prompt / GROUP if prompts_shared else mean_prompt
    f = flop_terms(shape, p)
    return {
        "generation": f.generation(p),
        "reference": f.forward(adapter=False),
        "policy_fwd": f.forward(adapter=True),
        "backward": f.backward(),
    }


def matmul_gflops(dtype_name: str, size: int = 2048, seconds: float = 1.5) -> float:
    import torch

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype_name]
    a, b = torch.randn(size, size, dtype=dtype), torch.randn(size, size, dtype=dtype)
    for _ in range(3):
        a @ b
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        a @ b
        n += 1
    return 2 * size**3 * n / (time.perf_counter() - t0) / 1e9


# -- workers: one side's run in its own process -----------------------------------------------------------------


def our_spec(model_dir: Path, prompts: Path, precision: str, *, max_steps: int, compile_decode: str = "auto") -> Any:
    """The benchmark run as our job spec (a :class:`trainer.spec.config.JobSpec`)."""
    from trainer.spec.config import parse_spec

    return parse_spec(
        {
            "model": str(model_dir),
            "training_file": str(prompts),
            "seed": SEED,
            "method": {
                "type": "grpo",
                "grpo": {
                    "grader": GRADER,
                    "hyperparameters": {
                        "batch_size": BATCH_PROMPTS,
                        "group_size": GROUP,
                        "max_steps": max_steps,
                        "learning_rate": LR,
                        "beta": BETA,
                        "kl_estimator": "k3",
                        "loss_aggregation": "seq_mean_token_mean",
                        "temperature": 1.0,
                        "top_p": 1.0,
                        "max_prompt_tokens": PROMPT_MAX,
                        "min_completion_tokens": COMPLETION,
                        "max_completion_tokens": COMPLETION,
                        "checkpoint_interval": 10**6,
                        "rollouts_logged": 0,
                        "precision": precision,
                        "compile_decode": compile_decode,
                    },
                    "lora": {"r": LORA_R, "alpha": LORA_ALPHA, "dropout": 0.0, "target_modules": "all-linear"},
                },
            },
        }
    )


def run_ours(
    model_dir: Path, prompts: Path, precision: str, steps: int, warmup: int, compile_decode: str = "auto"
) -> dict[str, Any]:
    import torch

    import trainer.generation.rollout_engine as generation_mod
    import trainer.loops.critic as critic_mod
    import trainer.loops.engine as engine_mod
    import trainer.loops.rl as rl
    import trainer.loops.rl_collect as rl_collect
    from trainer.spec.callbacks import BaseCallback

    phases = PhaseTimer()
    clock = StepClock(warmup, phases)
    lengths: list[tuple[float, float]] = []
    compile_s = [0.0]  # the decode step's compile (in the warm-up's generation), from the loop's event

    class Clock(BaseCallback):
        def on_metrics(self, step: int, metrics: dict[str, float]) -> None:
            clock.step_end()
            lengths.append((metrics["completion_len/mean"], metrics["completion_len/max"]))

        def on_event(self, level: Any, message: str, data: dict[str, Any] | None = None) -> None:
            compile_s[0] += float((data or {}).get("compile_s", 0.0))

    def logp_phase(*_: Any, **__: Any) -> str:
        return "policy_fwd" if torch.is_grad_enabled() else "reference"

    # The names each module calls: generation in the HF rollout engine, log-prob passes in the engine (and the trunk
    # critic's rollout pass), grading in the loop.
    generation_mod.generate = phases.wrap(generation_mod.generate, "generation")  # type: ignore[assignment]
    engine_mod.completion_logprobs = phases.wrap(engine_mod.completion_logprobs, logp_phase)  # type: ignore[assignment]
    critic_mod.completion_logprobs = phases.wrap(critic_mod.completion_logprobs, logp_phase)  # type: ignore[assignment]
    rl_collect.grade_batch = phases.wrap(rl_collect.grade_batch, "reward")  # type: ignore[assignment]
    rl_collect.decode_completions = phases.wrap(rl_collect.decode_completions, "reward")  # type: ignore[assignment]
    patch_backward(phases)
    spec = our_spec(model_dir, prompts, precision, max_steps=warmup + steps, compile_decode=compile_decode)
    with tempfile.TemporaryDirectory() as out:
        t = rl.RLTrainer(spec, output_dir=Path(out), callback=Clock(), device=torch.device(DEVICE))
        # Wraps the scheduler's own step-tracking wrapper, so the scheduler still sees every optimiser step.
        t.engine.optimizer.step = phases.wrap(t.engine.optimizer.step, "optimizer")  # type: ignore[method-assign]
        clock.last = time.perf_counter()
        t.run()
    assert all(mean == COMPLETION and mx == COMPLETION for mean, mx in lengths), f"ours: lengths {lengths}"
    return {
        "step_s": clock.times,
        "compile_s": compile_s[0],
        "peak_rss_mib": clock.peak_rss_mib,
        "peak_gpu_mib": clock.peak_gpu_mib,
        "phases": phases.sums,
    }


def run_trl(
    model_dir: Path, prompts: Path, precision: str, steps: int, warmup: int, gradient_checkpointing: bool
) -> dict[str, Any]:
    import torch
    from datasets import Dataset  # type: ignore[import-untyped]
    from peft import LoraConfig
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from trainer.grading.graders import grade
    from trainer.spec import graders

    phases = PhaseTimer()
    clock = StepClock(warmup, phases)
    grader = graders.parse_grader(GRADER)
    seen_lengths: list[int] = []

    def reward(completions: list[str], completion_ids: list[list[int]], **_: Any) -> list[float]:
        seen_lengths.extend(len(c) for c in completion_ids)
        return [grade(grader, output_text=c, item={}).score for c in completions]

    class Clock(TrainerCallback):  # type: ignore[misc]
        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            clock.step_end()

        def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            self.t0 = time.perf_counter()

        def on_optimizer_step(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            if phases.on:
                phases.sums["optimizer"] = phases.sums.get("optimizer", 0.0) + time.perf_counter() - self.t0

    def logp_phase(*_: Any, **__: Any) -> str:
        return "policy_fwd" if torch.is_grad_enabled() else "reference"

    for method, phase in (("_generate_single_turn", "generation"), ("_get_per_token_logps_and_entropies", logp_phase)):
        setattr(GRPOTrainer, method, phases.wrap(getattr(GRPOTrainer, method), phase))
    patch_backward(phases)
    reward_fn = phases.wrap(reward, "reward")
    reward_fn.__name__ = "len"
    rows = [json.loads(ln) for ln in prompts.read_text().splitlines() if ln.strip()]
    with tempfile.TemporaryDirectory() as out:
        args = GRPOConfig(
            output_dir=out,
            use_cpu=DEVICE == "cpu",
            bf16=precision == "bf16",
            fp16=False,
            gradient_checkpointing=gradient_checkpointing,
            per_device_train_batch_size=ROWS,
            gradient_accumulation_steps=1,
            num_generations=GROUP,
            max_completion_length=COMPLETION,
            generation_kwargs={"min_new_tokens": COMPLETION},
            temperature=1.0,
            top_p=1.0,
            beta=BETA,
            loss_type="grpo",
            scale_rewards="group",
            num_iterations=1,
            epsilon=0.2,
            learning_rate=LR,
            lr_scheduler_type="constant",
            max_grad_norm=1.0,
            weight_decay=0.0,
            max_steps=warmup + steps,
            logging_steps=10**6,
            report_to="none",
            save_strategy="no",
            disable_tqdm=True,
            log_completions=False,
            use_vllm=False,
            seed=SEED,
            dataloader_num_workers=0,
        )
        tok = AutoTokenizer.from_pretrained(model_dir)
        trainer = GRPOTrainer(
            model=str(model_dir),
            reward_funcs=reward_fn,
            args=args,
            train_dataset=Dataset.from_list(rows),
            processing_class=tok,
            peft_config=LoraConfig(
                r=LORA_R, lora_alpha=LORA_ALPHA, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM"
            ),
            callbacks=[Clock()],
        )
        clock.last = time.perf_counter()
        trainer.train()
    assert seen_lengths and all(n == COMPLETION for n in seen_lengths), f"TRL: completion lengths {set(seen_lengths)}"
    return {
        "step_s": clock.times,
        "peak_rss_mib": clock.peak_rss_mib,
        "peak_gpu_mib": clock.peak_gpu_mib,
        "phases": phases.sums,
    }


def worker_main(a: argparse.Namespace) -> None:
    import torch

    if a.threads:
        torch.set_num_threads(a.threads)
    torch.manual_seed(SEED)
    model_dir, prompts = Path(a.model_dir), Path(a.prompts)
    if a.worker == "ours":
        res = run_ours(model_dir, prompts, a.precision, a.steps, a.warmup, a.compile_decode)
    else:
        res = run_trl(model_dir, prompts, a.precision, a.steps, a.warmup, a.trl_gradient_checkpointing)
    res["threads"] = torch.get_num_threads()
    emit_result(res)


# -- driver ---------------------------------------------------------------------------------------------------


def run_side(side: str, model_dir: Path, prompts: Path, a: argparse.Namespace) -> dict[str, Any]:
    argv = ["--model-dir", str(model_dir), "--prompts", str(prompts), "--precision", a.precision]
    argv += ["--steps", str(a.steps), "--warmup", str(a.warmup), "--compile-decode", a.compile_decode]
    if a.trl_gradient_checkpointing:
        argv.append("--trl-gradient-checkpointing")
    if a.threads:
        argv += ["--threads", str(a.threads)]
    return run_worker(__file__, side, argv)


PHASES = ["generation", "reference", "policy_fwd", "backward", "optimizer", "reward"]
AMORTISED_STEPS = 200  # the job length the one-time compile is spread over


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=sorted(MODELS), default="small")
    p.add_argument("--precision", choices=["bf16", "fp32"], default="bf16")
    p.add_argument("--steps", type=int, default=3, help="measured steps per side per round")
    p.add_argument("--warmup", type=int, default=1, help="unmeasured steps at the start of every run")
    p.add_argument("--rounds", type=int, default=2, help="ours, TRL alternations")
    p.add_argument("--sides", default="ours,trl", help="comma-separated subset of ours,trl")
    p.add_argument("--workdir", type=Path, default=DEFAULT_WORKDIR)
    p.add_argument("--trl-gradient-checkpointing", action="store_true", help="TRL's default; off: the same work")
    p.add_argument("--threads", type=int, help="torch threads on both sides (default: torch's, one per core)")
    p.add_argument("--json", type=Path, help="also write the results here")
    p.add_argument(
        "--compile-decode",
        choices=["auto", "on", "off"],
        default="auto",
        help="ours: the job's compile_decode (auto, what a job this short gets: off); on: its compile, in the "
        "warm-up, is reported apart and amortised over a 200-step job",
    )
    p.add_argument("--worker", choices=["ours", "trl"], help=argparse.SUPPRESS)
    p.add_argument("--model-dir", help=argparse.SUPPRESS)
    p.add_argument("--prompts", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        worker_main(a)
        return

    import torch

    if a.threads:
        torch.set_num_threads(a.threads)
    shape = MODELS[a.model]
    model_dir, prompts = build_assets(a.workdir, a.model)
    mean_prompt = statistics.fmean(prompt_lengths(prompts))
    flops = model_flops_per_step(shape, mean_prompt)
    total_flops = sum(flops.values())
    run_flops = {
        "ours": sum(model_flops_per_step(shape, mean_prompt, prompts_shared=True).values()),
        "trl": total_flops,
    }
    rate = {d: matmul_gflops(d) for d in ("fp32", "bf16")}
    print(
        f"machine: {torch.get_num_threads()} threads, 2048³ matmul fp32 {rate['fp32']:.0f} GFLOP/s, "
        f"bf16 {rate['bf16']:.0f} GFLOP/s"
    )
    print(
        f"model {a.model}: Qwen2 hidden {shape.hidden}, {shape.layers} layers, vocab {VOCAB}; precision {a.precision};"
        f" {ROWS} rows × {COMPLETION} new tokens, mean prompt {mean_prompt:.1f} tokens; "
        f"model FLOPs/step {total_flops / 1e9:.1f} G ("
        + ", ".join(f"{k} {v / 1e9:.1f}" for k, v in flops.items())
        + f"); ours runs {run_flops['ours'] / 1e9:.1f} G of it (each group's prompt once)"
    )
    load = os.getloadavg()[0]
    if load > 0.5:
        print(f"warning: load average {load:.1f} before the start: other processes share these cores", flush=True)
    runs = run_rounds(a.sides.split(","), a.rounds, lambda side: run_side(side, model_dir, prompts, a))
    summary = summarise(runs)
    for side, s in summary.items():
        s["mfu"] = run_flops[side] / (s["s_per_step"] * rate[a.precision] * 1e9)
    print()
    print(f"{'side':6s} {'s/step':>8s} {'(min–max)':>15s} {'gen tok/s':>10s} {'peak RSS':>10s} {'MFU':>6s}")
    for side, s in summary.items():
        print(
            f"{side:6s} {s['s_per_step']:8.3f} {s['s_min']:7.3f}–{s['s_max']:<7.3f} {s['gen_tok_s']:10.0f} "
            f"{s['peak_rss_mib']:7.0f} MiB {100 * s['mfu']:5.1f}%"
        )
    if "ours" in summary and "trl" in summary:
        o, t = summary["ours"], summary["trl"]
        by_round = [tr / ov for ov, tr in zip(o["round_medians"], t["round_medians"], strict=False)]
        print(
            f"ours/TRL: throughput {t['s_per_step'] / o['s_per_step']:.2f}× "
            f"(medians {t['s_median'] / o['s_median']:.2f}×; by round "
            + ", ".join(f"{r:.2f}×" for r in by_round)
            + "), "
            f"peak RSS {o['peak_rss_mib'] / t['peak_rss_mib']:.2f}×"
            + (f", peak GPU memory {o['peak_gpu_mib'] / t['peak_gpu_mib']:.2f}×" if t["peak_gpu_mib"] else "")
            + f"; rounds left out (started under load): ours {o['rounds_under_load']}, TRL {t['rounds_under_load']}"
        )
        compiles = [r.get("compile_s", 0.0) for r in idle_runs(runs["ours"])]
        if any(compiles):
            c = statistics.median(compiles)
            amortised = (c + AMORTISED_STEPS * o["s_median"]) / AMORTISED_STEPS
            print(
                f"the decode step's compile: {c:.1f} s (runs: {', '.join(f'{x:.1f}' for x in compiles)}); over a "
                f"{AMORTISED_STEPS}-step job ours {amortised:.3f} s/step: {t['s_median'] / amortised:.2f}× TRL"
            )
    print("\nseconds per step by phase (the rest: data, advantages, loss arithmetic, metrics):")
    for side, s in summary.items():
        print(f"  {side:4s}: {format_phases(s['phases_per_step'], PHASES)}")
    if a.json:
        a.json.write_text(
            json.dumps(
                {
                    "args": {k: str(v) for k, v in vars(a).items() if v is not None},
                    "matmul_gflops": rate,
                    "model_flops_per_step": flops,
                    "summary": summary,
                    "runs": runs,
                },
                indent=2,
            )
        )


if __name__ == "__main__":
    main()

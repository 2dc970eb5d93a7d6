"""Side-by-side PPO benchmark: this trainer's PPO against TRL's ``RLOOTrainer``.

TRL 1.16.0 ships no PPO trainer (no ``PPOTrainer`` in ``trl``, none under ``trl.experimental``), so TRL's side is
the closest method it has: RLOO, REINFORCE with a leave-one-out baseline and, like PPO's reward shaping, the k1 KL
to the reference summed into the reward. Both sides get the same sample budget and the same settings where the
methods have the same knob: the benchmark configuration of the trainer core (``common.py``: the models, prompts,
LoRA r 16 all-linear, 8 prompts × 8 samples = 64 samples a step, exactly 32 new tokens per sample with EOS held off,
checked every step, the ``length_penalty`` grader as the reward), β = 0.05 with k1 in the reward, μ = 1 (ours
``iterations_per_batch``, TRL ``num_iterations``), one mini-batch of all 64 samples and one optimiser step per
rollout batch, clip ε 0.2, AdamW at lr 3e-4 (constant), grad-norm clip 1.0, temperature 1, top-p 1, fp32 or bf16
(autocast, fp32 master weights) on both sides, no gradient checkpointing (TRL's default is on:
``--trl-gradient-checkpointing``).

Ours is 8 prompts × 8 samples (``batch_size`` 8, ``group_size`` 8) rather than PPO's usual 64 × 1: the same rows as
TRL's (RLOO needs ``num_generations`` ≥ 2), so both sides pad the same prompts to the same shapes. PPO's own knobs
keep their defaults (γ 1, λ 0.95, ``vf_coef`` 0.1, value clip 0.2, whitened advantages, token-mean loss).

The work is not the same. Per step, both sample 64 × 32 tokens, run a no-grad pass of the policy (the log-probs
the k1 KL needs) and one of the reference (adapter disabled), and a policy forward + backward. Ours also runs the
value model, a second LoRA adapter on the shared base: a no-grad forward at rollout time (V for GAE) and a
forward + backward in the update. The model FLOPs of each side are printed (``common.FlopTerms``): on both models
ours does 1.6× TRL's. Results and where the time goes: ``BENCHMARKS.md``, ``bench/README.md``.

``--critic policy_trunk`` runs ours with the value head on the policy's own last hidden state (``critic:
policy_trunk``, TRL ≤ 0.11's ``AutoModelForCausalLMWithValueHead``): V comes from the no-grad policy pass and the
policy's training forward, the value loss joins the policy's loss, and the model FLOPs are TRL's (plus a
hidden → 1 head).

Measured per side, each in its own subprocess, sides alternating (``common.py``): seconds per step, generated tokens
per second of step time (64 × 32 / seconds per step), peak RSS after the warm-up, seconds per step by phase.

Run:  .venv/bin/python bench/ppo_vs_trl.py --model small --precision bf16 --threads 1
"""

from __future__ import annotations

import argparse
import json
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
    adapters_disabled,
    build_assets,
    emit_result,
    flop_terms,
    format_phases,
    loadavg,
    patch_backward,
    prompt_lengths,
    run_rounds,
    run_worker,
    summarise,
)

BETA = 0.05  # TRL's RLOO default and our PPO default: k1 in the reward
MU = 1  # passes over each rollout batch (ours iterations_per_batch, TRL num_iterations)
PHASES = [
    "generation",
    "scores",  # ours, the adapter critic: old log-probs, reference and values in one pass
    "old_logp",
    "reference",
    "values",
    "policy_fwd",
    "backward",
    "critic_fwd",
    "critic_bwd",
    "advantages",
    "optimizer",
    "reward",
]


def model_flops_per_step(
    shape: ModelShape, mean_prompt: float, critic: str, trl: str = "rloo"
) -> dict[str, dict[str, float]]:
    """Model FLOPs of one step by phase, per side (``common.FlopTerms``). The critic and the reward model read the
    last hidden state: their passes have no LM head. On the policy's trunk our critic has no passes (its hidden → 1
    head is not counted). TRL's PPO takes its old log-probs from the sampling logits (no pass), scores with a full
    reward model and trains a full value model: its backward also computes the body's weight gradients (2·N·T)."""
    f = flop_terms(shape, mean_prompt)
    value = {
        "values": f.forward(adapter=True, lm_head=False),
        "critic_fwd": f.forward(adapter=True, lm_head=False),
        "critic_bwd": f.backward(lm_head=False),
    }
    if critic == "policy_trunk":
        value = dict.fromkeys(value, 0.0)
    ours = {
        "generation": f.generation(mean_prompt),
        "old_logp": f.forward(adapter=True),
        "reference": f.forward(adapter=False),
        "policy_fwd": f.forward(adapter=True),
        "backward": f.backward(),
    } | value
    if trl == "rloo":
        return {
            "ours": ours,
            "trl": {k: ours[k] for k in ("generation", "old_logp", "reference", "policy_fwd", "backward")},
        }
    ours["reward"] = f.forward(adapter=True, lm_head=False)  # our reward model: its LoRA adapter on its own base
    full_value_bwd = f.backward(lm_head=False) + 2 * f.n * f.tokens
    trl_ppo = {
        "generation": f.generation(mean_prompt),
        "reference": f.forward(adapter=False),
        "values": f.forward(adapter=False, lm_head=False),
        "reward": f.forward(adapter=False, lm_head=False),
        "policy_fwd": f.forward(adapter=True) + f.forward(adapter=False, lm_head=False),  # policy + value model
        "backward": f.backward() + full_value_bwd,
    }
    return {"ours": ours, "trl": trl_ppo}


# -- the reward model of the PPO-vs-PPO comparison (``--trl ppo``) ---------------------------------------------

TRL_PPO_VERSION = "1.12.0"  # the last TRL release with a PPO trainer (``trl.experimental.ppo``; gone in 1.14)


def trl_ppo_path(workdir: Path) -> Path:
    """Where ``--trl ppo`` finds TRL 1.12.0: installed on its own (``pip install --no-deps --target``), so the rest of
    the environment (transformers, peft, accelerate, torch) is the one both sides share."""
    return workdir / f"trl-{TRL_PPO_VERSION}"


def ensure_trl_ppo(workdir: Path) -> Path:
    import subprocess
    import sys

    target = trl_ppo_path(workdir)
    if not (target / "trl" / "experimental" / "ppo" / "ppo_trainer.py").exists():
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "install",
                "-q",
                "--no-deps",
                "--target",
                str(target),
                f"trl=={TRL_PPO_VERSION}",
            ],
            check=True,
        )
    return target


def build_reward_model(workdir: Path, model_dir: Path, prompts: Path) -> Path:
    """A reward model of the benchmark's base, trained by our ``reward_model`` method for one step on synthetic
    pairs: a real reward-model folder (LoRA adapter + score head, ``reward_model.json``), which our ``reward_model``
    grader scores with and which TRL's side loads merged (``PeftModel.from_pretrained(
    AutoModelForSequenceClassification…).merge_and_unload()``): the same function on both sides. Its head is
    ``last`` (a score head on the last token's state, TRL's): the default ``likelihood`` head is the LM's own, which
    a sequence classifier cannot load. Built once."""
    import random

    out = workdir / f"rm-last-{model_dir.name}"
    if (out / "adapter" / "reward_model.json").exists():
        return out / "adapter"
    from trainer.spec.callbacks import BaseCallback
    from trainer.spec.config import parse_spec
    from trainer.train import build_trainer

    rng = random.Random(SEED)
    rows = [json.loads(ln)["prompt"] for ln in prompts.read_text().splitlines() if ln.strip()][:64]
    pairs = workdir / "rm-pairs.jsonl"
    words = " ".join(rows).split()
    lines = []
    for text in rows:
        chosen, rejected = " ".join(rng.sample(words, 4)), " ".join(rng.sample(words, 8))
        if chosen != rejected:
            lines.append(json.dumps({"prompt": text, "chosen": chosen, "rejected": rejected}) + "\n")
    pairs.write_text("".join(lines))
    spec = parse_spec(
        {
            "model": str(model_dir),
            "training_file": str(pairs),
            "seed": SEED,
            "method": {
                "type": "reward_model",
                "reward_model": {
                    "hyperparameters": {
                        "batch_size": 8,
                        "max_steps": 1,
                        "max_length": 128,
                        "precision": "fp32",
                        "head": "last",
                    },
                    "lora": {"r": LORA_R, "alpha": LORA_ALPHA, "dropout": 0.0, "target_modules": "all-linear"},
                },
            },
        }
    )
    build_trainer(spec, output_dir=out, callback=BaseCallback()).run()
    assert (out / "adapter" / "reward_model.json").exists(), f"no reward model in {out}"
    return out / "adapter"


# -- workers: one side's run in its own process -----------------------------------------------------------------


def our_spec(
    model_dir: Path, prompts: Path, precision: str, *, max_steps: int, critic: str, reward_model: Path | None = None
) -> Any:
    """The benchmark run as our job spec (a :class:`trainer.spec.config.JobSpec`). With ``reward_model`` (``--trl ppo``)
    the reward is that model's score and a step is PPO's usual 64 prompts × 1 sample (TRL's PPO has no groups)."""
    from trainer.spec.config import parse_spec

    grader: dict[str, Any] = GRADER
    batch, group = BATCH_PROMPTS, GROUP
    if reward_model is not None:
        grader = {"type": "reward_model", "name": "rm", "model": str(reward_model), "batch_size": ROWS}
        batch, group = ROWS, 1

    return parse_spec(
        {
            "model": str(model_dir),
            "training_file": str(prompts),
            "seed": SEED,
            "method": {
                "type": "ppo",
                "ppo": {
                    "grader": grader,
                    "hyperparameters": {
                        "batch_size": batch,
                        "group_size": group,
                        "iterations_per_batch": MU,
                        "mini_batches": 1,
                        "max_steps": max_steps,
                        "learning_rate": LR,
                        "max_grad_norm": 1.0,
                        "beta": BETA,
                        "kl_estimator": "k1",
                        "epsilon_low": 0.2,
                        "epsilon_high": 0.2,
                        "temperature": 1.0,
                        "top_p": 1.0,
                        "max_prompt_tokens": PROMPT_MAX,
                        "min_completion_tokens": COMPLETION,
                        "max_completion_tokens": COMPLETION,
                        "checkpoint_interval": 10**6,
                        "rollouts_logged": 0,
                        "precision": precision,
                        "critic": critic,
                    },
                    "lora": {"r": LORA_R, "alpha": LORA_ALPHA, "dropout": 0.0, "target_modules": "all-linear"},
                },
            },
        }
    )


def run_ours(
    model_dir: Path,
    prompts: Path,
    precision: str,
    steps: int,
    warmup: int,
    critic: str,
    reward_model: Path | None = None,
) -> dict[str, Any]:
    import torch

    import trainer.generation.rollout_engine as generation_mod
    import trainer.loops.critic as critic_mod
    import trainer.loops.engine as engine_mod
    import trainer.loops.rl as rl
    import trainer.loops.rl_collect as rl_collect
    from trainer.loops.critic import Critic
    from trainer.spec.callbacks import BaseCallback

    phases = PhaseTimer()
    clock = StepClock(warmup, phases)
    lengths: list[tuple[float, float]] = []
    last_grad_forward = ["policy"]  # which graph the next backward runs through: the policy's or the critic's

    class Clock(BaseCallback):
        def on_metrics(self, step: int, metrics: dict[str, float]) -> None:
            clock.step_end()
            lengths.append((metrics["completion_len/mean"], metrics["completion_len/max"]))

    def logp_phase(model: Any, *_: Any, **__: Any) -> str:
        if torch.is_grad_enabled():
            last_grad_forward[0] = "policy"
            return "policy_fwd"
        return "reference" if adapters_disabled(model) else "old_logp"

    def critic_phase(*_: Any, **__: Any) -> str:
        if torch.is_grad_enabled():
            last_grad_forward[0] = "critic"
            return "critic_fwd"
        return "values"

    def backward_phase(*_: Any, **__: Any) -> str:
        return "critic_bwd" if last_grad_forward[0] == "critic" else "backward"

    # The names each module calls: generation in the HF rollout engine, log-prob passes in the engine (and the trunk
    # critic's rollout pass), grading in the loop.
    generation_mod.generate = phases.wrap(generation_mod.generate, "generation")  # type: ignore[assignment]
    engine_mod.completion_logprobs = phases.wrap(engine_mod.completion_logprobs, logp_phase)  # type: ignore[assignment]
    critic_mod.completion_logprobs = phases.wrap(critic_mod.completion_logprobs, logp_phase)  # type: ignore[assignment]
    rl_collect.grade_batch = phases.wrap(rl_collect.grade_batch, "reward")  # type: ignore[assignment]
    rl_collect.decode_completions = phases.wrap(rl_collect.decode_completions, "reward")  # type: ignore[assignment]
    Critic.values = phases.wrap(Critic.values, critic_phase)  # type: ignore[method-assign]
    # the adapter critic's passes joined to the policy's: the rollout's three as one, the update's two as one
    Critic.rollout_scores = phases.wrap(Critic.rollout_scores, "scores")  # type: ignore[method-assign]
    Critic.forward_with_policy = phases.wrap(Critic.forward_with_policy, "policy_fwd")  # type: ignore[method-assign]
    rl.RLTrainer.advantages = phases.wrap(rl.RLTrainer.advantages, "advantages")  # type: ignore[method-assign]
    patch_backward(phases, backward_phase)
    spec = our_spec(model_dir, prompts, precision, max_steps=warmup + steps, critic=critic, reward_model=reward_model)
    with tempfile.TemporaryDirectory() as out:
        t = rl.RLTrainer(spec, output_dir=Path(out), callback=Clock(), device=torch.device(DEVICE))
        value_model = t.models.critic
        assert value_model is not None and value_model.shared and value_model.trunk == (critic == "policy_trunk"), (
            "the benchmark's critic is a second adapter on the policy's base or a head on its trunk"
        )
        # Wraps the scheduler's own step-tracking wrapper, so the scheduler still sees every optimiser step.
        t.engine.optimizer.step = phases.wrap(t.engine.optimizer.step, "optimizer")  # type: ignore[method-assign]
        clock.last = time.perf_counter()
        t.run()
    assert len(lengths) == warmup + steps, f"ours: {len(lengths)} steps"
    assert all(mean == COMPLETION and mx == COMPLETION for mean, mx in lengths), f"ours: lengths {lengths}"
    return {
        "step_s": clock.times,
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
    from trl import RLOOConfig, RLOOTrainer

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

    def logp_phase(_self: Any, model: Any, *_: Any, **__: Any) -> str:
        if torch.is_grad_enabled():
            return "policy_fwd"
        return "reference" if adapters_disabled(model) else "old_logp"

    for method, phase in (("_generate_single_turn", "generation"), ("_get_per_token_logps_and_entropies", logp_phase)):
        setattr(RLOOTrainer, method, phases.wrap(getattr(RLOOTrainer, method), phase))
    patch_backward(phases)
    reward_fn = phases.wrap(reward, "reward")
    reward_fn.__name__ = "len"
    rows = [json.loads(ln) for ln in prompts.read_text().splitlines() if ln.strip()]
    with tempfile.TemporaryDirectory() as out:
        args = RLOOConfig(
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
            num_iterations=MU,
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
        trainer = RLOOTrainer(
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
    assert len(seen_lengths) == ROWS * (warmup + steps), f"TRL: {len(seen_lengths)} completions graded"
    assert all(n == COMPLETION for n in seen_lengths), f"TRL: completion lengths {set(seen_lengths)}"
    return {
        "step_s": clock.times,
        "peak_rss_mib": clock.peak_rss_mib,
        "peak_gpu_mib": clock.peak_gpu_mib,
        "phases": phases.sums,
    }


def run_trl_ppo(
    model_dir: Path, prompts: Path, precision: str, steps: int, warmup: int, reward_model: Path, trl_path: Path
) -> dict[str, Any]:
    """TRL 1.12.0's ``trl.experimental.ppo.PPOTrainer`` as its own example script sets it up: LoRA on the policy
    (``peft_config``; the reference is the adapter disabled), the value model and the reward model full sequence-
    classification models loaded from the reward model (the value model fully trained), 64 prompts a step, one
    mini-batch, one PPO epoch, no stop token (so exactly 32 new tokens), the same β, clip ranges, ``vf_coef``, γ, λ."""
    import sys

    sys.path.insert(0, str(trl_path))
    import torch
    import trl
    import trl.experimental.ppo.ppo_trainer as ppo_mod
    from datasets import Dataset  # type: ignore[import-untyped]
    from peft import LoraConfig, PeftModel
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer, TrainerCallback
    from trl.experimental.ppo import PPOConfig, PPOTrainer

    assert trl.__version__ == TRL_PPO_VERSION, trl.__version__
    phases = PhaseTimer()
    clock = StepClock(warmup, phases)
    widths: list[int] = []

    class Clock(TrainerCallback):  # type: ignore[misc]
        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            clock.step_end()

    def generation(model: Any, queries: Any, *a: Any, **k: Any) -> Any:
        out = gen(model, queries, *a, **k)
        widths.append(out[0].shape[1] - queries.shape[1])
        return out

    def forward_phase(*_: Any, **__: Any) -> str:
        return "policy_fwd" if torch.is_grad_enabled() else "reference"  # TRL's old log-probs: generation's logits

    def reward_phase(model: Any, *_: Any, **__: Any) -> str:
        return "reward" if model is reward else "values"

    gen = ppo_mod.batch_generation
    ppo_mod.batch_generation = phases.wrap(generation, "generation")
    ppo_mod.forward = phases.wrap(ppo_mod.forward, forward_phase)
    ppo_mod.get_reward = phases.wrap(ppo_mod.get_reward, reward_phase)
    patch_backward(phases)

    tok = AutoTokenizer.from_pretrained(model_dir)
    rows = [json.loads(ln)["prompt"] for ln in prompts.read_text().splitlines() if ln.strip()]
    data = Dataset.from_list([{"input_ids": tok(t)["input_ids"]} for t in rows])

    def rm_model() -> Any:
        base = AutoModelForSequenceClassification.from_pretrained(model_dir, num_labels=1)
        return PeftModel.from_pretrained(base, reward_model).merge_and_unload()

    reward, value = rm_model(), rm_model()
    with tempfile.TemporaryDirectory() as out:
        args = PPOConfig(
            output_dir=out,
            use_cpu=DEVICE == "cpu",
            bf16=precision == "bf16",
            fp16=False,
            per_device_train_batch_size=ROWS,
            gradient_accumulation_steps=1,
            num_mini_batches=1,
            num_ppo_epochs=MU,
            local_rollout_forward_batch_size=ROWS,
            total_episodes=ROWS * (warmup + steps),
            response_length=COMPLETION,
            stop_token=None,
            temperature=1.0,
            kl_coef=BETA,
            kl_estimator="k1",
            cliprange=0.2,
            cliprange_value=0.2,
            vf_coef=0.1,
            gamma=1.0,
            lam=0.95,
            whiten_rewards=False,
            missing_eos_penalty=None,
            num_sample_generations=0,
            learning_rate=LR,
            lr_scheduler_type="constant",
            weight_decay=0.0,
            logging_steps=10**6,
            report_to="none",
            save_strategy="no",
            disable_tqdm=True,
            seed=SEED,
            dataloader_num_workers=0,
        )
        trainer = PPOTrainer(
            args=args,
            processing_class=tok,
            model=AutoModelForCausalLM.from_pretrained(model_dir),
            ref_model=None,
            reward_model=reward,
            train_dataset=data,
            value_model=value,
            eval_dataset=data.select(range(ROWS)),
            peft_config=LoraConfig(
                r=LORA_R, lora_alpha=LORA_ALPHA, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM"
            ),
            callbacks=[Clock()],
        )
        clock.last = time.perf_counter()
        trainer.train()
    assert len(widths) == warmup + steps, f"TRL PPO: {len(widths)} generation batches"
    assert all(w == COMPLETION for w in widths), f"TRL PPO: completion widths {widths}"
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
    rm = Path(a.reward_model) if a.reward_model else None
    if a.worker == "ours":
        res = run_ours(model_dir, prompts, a.precision, a.steps, a.warmup, a.critic, rm)
    elif a.trl == "ppo":
        assert rm is not None
        res = run_trl_ppo(model_dir, prompts, a.precision, a.steps, a.warmup, rm, trl_ppo_path(a.workdir))
    else:
        res = run_trl(model_dir, prompts, a.precision, a.steps, a.warmup, a.trl_gradient_checkpointing)
    res["threads"] = torch.get_num_threads()
    emit_result(res)


# -- driver ---------------------------------------------------------------------------------------------------


def run_side(side: str, model_dir: Path, prompts: Path, a: argparse.Namespace) -> dict[str, Any]:
    argv = ["--model-dir", str(model_dir), "--prompts", str(prompts), "--precision", a.precision]
    argv += ["--steps", str(a.steps), "--warmup", str(a.warmup), "--critic", a.critic, "--trl", a.trl]
    argv += ["--workdir", str(a.workdir)]
    if a.reward_model:
        argv += ["--reward-model", str(a.reward_model)]
    if a.trl_gradient_checkpointing:
        argv.append("--trl-gradient-checkpointing")
    if a.threads:
        argv += ["--threads", str(a.threads)]
    return run_worker(__file__, side, argv)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=sorted(MODELS), default="small")
    p.add_argument("--precision", choices=["bf16", "fp32"], default="bf16")
    p.add_argument("--steps", type=int, default=3, help="measured steps per side per round")
    p.add_argument("--warmup", type=int, default=1, help="unmeasured steps at the start of every run")
    p.add_argument("--rounds", type=int, default=2, help="ours, TRL alternations")
    p.add_argument("--sides", default="ours,trl", help="comma-separated subset of ours,trl")
    p.add_argument(
        "--critic",
        choices=["adapter", "policy_trunk"],
        default="adapter",
        help="ours: the value model a second adapter (default) or a head on the policy's trunk",
    )
    p.add_argument(
        "--trl",
        choices=["rloo", "ppo"],
        default="rloo",
        help="TRL's side: RLOOTrainer of the installed TRL (reward: length_penalty), or PPOTrainer of TRL "
        f"{TRL_PPO_VERSION} (installed under the workdir; reward: a reward model on both sides)",
    )
    p.add_argument("--reward-model", help=argparse.SUPPRESS)
    p.add_argument("--workdir", type=Path, default=DEFAULT_WORKDIR, help="models and prompts (shared with GRPO's)")
    p.add_argument("--trl-gradient-checkpointing", action="store_true", help="TRL's default; off: no recomputation")
    p.add_argument("--threads", type=int, help="torch threads on both sides (default: torch's, one per core)")
    p.add_argument("--json", type=Path, help="also write the results here")
    p.add_argument("--worker", choices=["ours", "trl"], help=argparse.SUPPRESS)
    p.add_argument("--model-dir", help=argparse.SUPPRESS)
    p.add_argument("--prompts", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        worker_main(a)
        return

    import torch
    import trl

    shape = MODELS[a.model]
    model_dir, prompts = build_assets(a.workdir, a.model)
    if a.trl == "ppo":
        ensure_trl_ppo(a.workdir)
        a.reward_model = build_reward_model(a.workdir, model_dir, prompts)
    mean_prompt = statistics.fmean(prompt_lengths(prompts))
    flops = model_flops_per_step(shape, mean_prompt, a.critic, a.trl)
    trl_label = "TRL (PPO)" if a.trl == "ppo" else "TRL (RLOO)"
    trl_name = f"TRL {TRL_PPO_VERSION} PPOTrainer" if a.trl == "ppo" else f"TRL {trl.__version__} RLOOTrainer"
    total = {side: sum(f.values()) for side, f in flops.items()}
    print(
        f"model {a.model}: Qwen2 hidden {shape.hidden}, {shape.layers} layers, vocab {VOCAB}; precision {a.precision};"
        f" {ROWS} rows × {COMPLETION} new tokens, mean prompt {mean_prompt:.1f} tokens; threads "
        f"{a.threads or torch.get_num_threads()}; {trl_name}; our critic {a.critic}"
    )
    print(
        f"model FLOPs/step: ours (PPO) {total['ours'] / 1e9:.1f} G, {trl_label} {total['trl'] / 1e9:.1f} G "
        f"(ours {total['ours'] / total['trl']:.2f}×: the critic's passes "
        + ", ".join(f"{k} {flops['ours'][k] / 1e9:.1f}" for k in ("values", "critic_fwd", "critic_bwd"))
        + ")"
    )
    load_start = loadavg()
    print(f"load average at the start: {load_start}", flush=True)
    runs = run_rounds(a.sides.split(","), a.rounds, lambda side: run_side(side, model_dir, prompts, a))
    load_end = loadavg()
    summary = summarise(runs)
    for side, s in summary.items():
        s["model_gflop_s"] = total[side] / s["s_per_step"] / 1e9
    print(f"load average at the end: {load_end}")
    print()
    print(
        f"{'side':11s} {'s/step':>8s} {'median':>7s} {'(min–max)':>15s} {'gen tok/s':>10s} {'peak RSS':>10s} "
        f"{'model GFLOP/s':>14s}"
    )
    for side, s in summary.items():
        label = "ours (PPO)" if side == "ours" else trl_label
        print(
            f"{label:11s} {s['s_per_step']:8.3f} {s['s_median']:7.3f} {s['s_min']:7.3f}–{s['s_max']:<7.3f} "
            f"{s['gen_tok_s']:10.0f} "
            f"{s['peak_rss_mib']:7.0f} MiB {s['model_gflop_s']:14.1f}"
        )
    if "ours" in summary and "trl" in summary:
        o, t = summary["ours"], summary["trl"]
        per_round = [tr / ov for ov, tr in zip(o["round_means"], t["round_means"], strict=False)]
        print(
            f"ours/TRL: throughput {t['s_per_step'] / o['s_per_step']:.2f}× (median "
            f"{t['s_median'] / o['s_median']:.2f}×; by round "
            + ", ".join(f"{r:.2f}×" for r in per_round)
            + f"), peak RSS {o['peak_rss_mib'] / t['peak_rss_mib']:.2f}×"
            + f"; rounds left out (started under load): ours {o['rounds_under_load']}, TRL {t['rounds_under_load']}"
            + (f", peak GPU memory {o['peak_gpu_mib'] / t['peak_gpu_mib']:.2f}×" if t["peak_gpu_mib"] else "")
        )
    print("\nseconds per step by phase (the rest: data, GAE/advantages arithmetic, loss arithmetic, metrics):")
    for side, s in summary.items():
        print(f"  {side:4s}: {format_phases(s['phases_per_step'], PHASES)}")
    if a.json:
        a.json.write_text(
            json.dumps(
                {
                    "args": {k: str(v) for k, v in vars(a).items() if v is not None},
                    "load_start": load_start,
                    "load_end": load_end,
                    "model_flops_per_step": flops,
                    "summary": summary,
                    "runs": runs,
                },
                indent=2,
            )
        )


if __name__ == "__main__":
    main()

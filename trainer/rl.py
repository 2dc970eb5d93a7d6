"""The online RL loop (GRPO, Dr. GRPO, DAPO, RLOO, REINFORCE, PPO), readable top to bottom.

One training step: sample ``batch_size`` prompts → ``group_size`` completions each → grade → (DAPO) drop all-equal
groups and sample more → advantages → μ passes of mini-batch updates, each mini-batch accumulated over micro-batches
against the mini-batch's totals → metrics, rollouts, checkpoint. The recipe row (``trainer.recipes``) names the
method's parts; the math lives in ``trainer.core_algos``.

PPO (a recipe with a critic) differs in three places only: the value model's V is computed with the rollout, the
advantages are GAE's over per-token rewards (score on the last token, −β·KL on every token, β fixed or adaptive),
and each micro-batch adds the clipped value loss (``trainer.critic``). With ``critic: policy_trunk`` the value head
reads the policy's own hidden states: V comes with the policy's log-prob passes and the value loss joins its loss.
"""

from __future__ import annotations

import copy
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig

from trainer import checkpoint as ckpt
from trainer import metrics as M
from trainer.callbacks import Callback
from trainer.config import (
    DAPOHyperparameters,
    JobSpec,
    PPOHyperparameters,
    ReinforceHyperparameters,
    RLHyperparameters,
    SpecError,
)
from trainer.core_algos import (
    ADVANTAGE_ESTIMATORS,
    AGGREGATIONS,
    KL_ESTIMATORS,
    POLICY_LOSSES,
    ZERO_STD,
    AdvantageOptions,
    ClipOptions,
    LossScale,
    adaptive_kl_update,
    cosine_or_constant_lr,
    explained_variance,
    gae,
    masked_mean,
    masked_sum,
    masked_whiten,
    overlong_penalty,
    ppo_token_rewards,
    value_loss_clipped,
)
from trainer.critic import Critic
from trainer.data import DatasetError, PromptItem, load_prompts
from trainer.encoding import PromptSampler, PromptTooLongError, encode_prompts
from trainer.evaluate import decode_completions, evaluate, grade_batch
from trainer.models import (
    MergedSampler,
    ModelError,
    Precision,
    add_lora,
    default_device,
    load_base_model,
    load_tokenizer,
    reference_policy,
    resolve_precision,
    store_frozen_linears_in,
    trainable_parameters,
    trim_freed_memory,
)
from trainer.recipes import RECIPES, Recipe
from trainer.rollout import (
    Rollout,
    completion_logprobs,
    generate,
    left_pad,
    micro_slices,
)
from trainer.train import RunResult, run_steps, seed_everything


def total_steps(hp: RLHyperparameters, n_prompts: int) -> int:
    return hp.max_steps or hp.n_epochs * math.ceil(n_prompts / hp.batch_size)


def _encode(tokenizer: Any, items: list[PromptItem], hp: RLHyperparameters, path: str) -> list[list[int]]:
    try:
        return encode_prompts(tokenizer, items, max_prompt_tokens=hp.max_prompt_tokens)
    except PromptTooLongError as err:
        raise DatasetError(str(err), line=err.item.line, path=path) from None


@dataclass
class _Batch:
    """One step's rollout batch, ``N = P·G`` rows, rows of a group adjacent."""

    rollout: Rollout
    items: list[PromptItem]  # [N]
    rewards: torch.Tensor  # [N] the reward the advantages are computed from (shaped, KL-penalised if so)
    grader_rewards: torch.Tensor  # [N] the grader's reward alone
    sub: dict[str, torch.Tensor]  # named sub-grader → [N]
    texts: list[str]
    old_logp: torch.Tensor | None  # [N, C] behaviour log-probs (computed when needed)
    ref_logp: torch.Tensor | None  # [N, C]
    values: torch.Tensor | None  # [N, C] the critic's V at sampling time (PPO)
    returns: torch.Tensor | None  # [N, C] GAE returns A + V (PPO)
    groups_sampled: int
    groups_zero_std: int
    sampling_batches: int
    generation_s: float


class RLTrainer:
    """Holds what the loop needs; :meth:`run` is the loop."""

    def __init__(self, spec: JobSpec, *, output_dir: Path, callback: Callback, device: torch.device | None = None):
        self.spec, self.out, self.cb = spec, output_dir, callback
        assert isinstance(spec.method.hyperparameters, RLHyperparameters)
        self.hp: RLHyperparameters = spec.method.hyperparameters
        self.recipe: Recipe = RECIPES[spec.method.type]
        assert spec.method.grader is not None, "RL methods have a grader (config._parse_method)"
        self.grader = spec.method.grader
        hp = self.hp

        # Everything that can be wrong with the input is checked before the model's weights are loaded.
        self.train_items = load_prompts(Path(spec.training_file), grader=self.grader)
        self.val_items = load_prompts(Path(spec.validation_file), grader=self.grader) if spec.validation_file else []
        self.tokenizer = load_tokenizer(spec.model)
        self.train_ids = _encode(self.tokenizer, self.train_items, hp, spec.training_file)
        self.val_ids = _encode(self.tokenizer, self.val_items, hp, spec.validation_file or "")
        try:
            model_cfg = AutoConfig.from_pretrained(spec.model)
        except (OSError, ValueError) as err:
            raise ModelError(f"cannot load model {spec.model!r}: {err}") from None
        max_pos = getattr(model_cfg, "max_position_embeddings", None)
        longest = max(len(p) for p in self.train_ids + self.val_ids)
        if max_pos is not None and longest + hp.max_completion_tokens > max_pos:
            raise SpecError(
                f"the longest prompt ({longest} tokens) plus max_completion_tokens ({hp.max_completion_tokens}) "
                f"exceeds the model's context of {max_pos} tokens",
                param=f"method.{spec.method.type}.hyperparameters.max_completion_tokens",
            )
        if hp.eval_samples:
            self.val_ids, self.val_items = self.val_ids[: hp.eval_samples], self.val_items[: hp.eval_samples]
        self.total_steps = total_steps(hp, len(self.train_items))

        self.device = device or default_device()
        self.precision: Precision = resolve_precision(hp.precision, self.device)
        seed_everything(spec.seed)
        base = load_base_model(spec.model, self.device)
        # bf16: sample from a merged bf16 copy (half the weights' memory again, about half the generation time);
        # fp32: the copy would double the weights for a small gain, so the policy samples itself.
        base_copy = copy.deepcopy(base) if self.precision == "bf16" else None
        if self.precision == "bf16":
            store_frozen_linears_in(base, torch.bfloat16)
        self.model = add_lora(base, spec.method.lora, seed=spec.seed)
        self.merged = (
            MergedSampler(base_copy, self.model, torch.bfloat16)
            if base_copy is not None and MergedSampler.supported(self.model)
            else None
        )
        if self.precision == "bf16" and self.device.type == "cpu":
            # The CPU's SDPA backward in bf16 is slower than eager attention (bench/README.md); decoding keeps SDPA.
            self.model.get_base_model().set_attn_implementation("eager")
        self.params = trainable_parameters(self.model)  # the policy's LoRA weights
        self.critic = self._make_critic() if self.recipe.critic else None
        self.trunk = self.critic is not None and self.critic.trunk  # V from the policy's own forwards
        self.critic_params = self.critic.parameters() if self.critic is not None else []
        groups: list[dict[str, Any]] = [{"params": self.params, "lr": hp.effective_learning_rate}]
        if self.critic is not None:
            assert isinstance(hp, PPOHyperparameters)
            value_lr = hp.value_learning_rate or hp.learning_rate
            groups.append({"params": self.critic_params, "lr": value_lr * hp.learning_rate_multiplier})
        self.optimizer = torch.optim.AdamW(
            groups,
            lr=hp.effective_learning_rate,
            betas=(hp.adam_beta1, hp.adam_beta2),
            weight_decay=hp.weight_decay,
        )
        self.kl_coef = hp.beta  # PPO's adaptive controller moves it; saved with every checkpoint
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer,
            lambda s: cosine_or_constant_lr(
                s, warmup=hp.warmup_steps, total=self.total_steps, schedule=hp.lr_scheduler
            ),
        )
        self.sampler = PromptSampler(len(self.train_items), seed=spec.seed)
        self.generator = torch.Generator(self.device).manual_seed(spec.seed)

        # PPO's advantages are GAE's over per-token rewards (_gae_advantages), the others' come from the registry.
        self.advantage = None if self.recipe.critic else ADVANTAGE_ESTIMATORS.get(self.recipe.advantage)
        self.policy_loss = POLICY_LOSSES.get(self.recipe.policy_loss)
        self.aggregate = AGGREGATIONS.get(hp.loss_aggregation)
        self.kl = KL_ESTIMATORS.get(hp.kl_estimator)
        self.adv_opts = AdvantageOptions(
            scale=getattr(hp, "scale_rewards", "group"),
            std_eps=getattr(hp, "std_eps", 1e-4),
            baseline=hp.baseline if isinstance(hp, ReinforceHyperparameters) else "batch_mean",
        )
        self.clip = ClipOptions(hp.epsilon_low, hp.epsilon_high, hp.dual_clip)
        # With one pass over one mini-batch the policy that sampled is the policy being updated: old = logp.detach()
        # makes ρ ≡ 1 exactly (as TRL does) instead of relying on two forward passes agreeing bit for bit.
        self.on_policy = hp.iterations_per_batch == 1 and hp.mini_batches == 1

    def _make_critic(self) -> Critic:
        hp = self.hp
        assert isinstance(hp, PPOHyperparameters)
        where = f"method.{self.spec.method.type}.hyperparameters.value_model"
        if hp.critic == "policy_trunk":  # config refuses it with value_model
            where = f"method.{self.spec.method.type}.hyperparameters.critic"
        separate = None
        if hp.value_model is not None:
            try:
                separate = load_base_model(hp.value_model, self.device)
            except ModelError as err:
                raise SpecError(str(err), param=where) from None
            emb = separate.get_input_embeddings()
            if emb is None or emb.num_embeddings < len(self.tokenizer):
                raise SpecError(
                    f"value model {hp.value_model!r} does not share the policy's vocabulary "
                    f"({len(self.tokenizer)} tokens): the critic reads the policy's token ids",
                    param=where,
                )
            if self.precision == "bf16":
                store_frozen_linears_in(separate, torch.bfloat16)
                if self.device.type == "cpu":
                    separate.set_attn_implementation("eager")
        try:
            return Critic(
                self.model,
                lora=self.spec.method.lora,
                seed=self.spec.seed,
                separate_base=separate,
                trunk=hp.critic == "policy_trunk",
            )
        except ModelError as err:
            raise SpecError(str(err), param=where) from None

    # -- state -------------------------------------------------------------------------------------------------

    def _parts(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "optimizer": self.optimizer,
            "scheduler": self.scheduler,
            "sampler": self.sampler,
            "generator": self.generator,
        }

    def _state(self, step: int) -> dict[str, Any]:
        return {
            **ckpt.training_state(step, **self._parts()),
            "kl_coef": self.kl_coef,
            "critic": self.critic.state_dict() if self.critic is not None else None,
        }

    def _load_state(self, state: dict[str, Any]) -> int:
        step = ckpt.restore_training_state(state, **self._parts())
        if self.merged is not None:
            self.merged.stale = True
        self.kl_coef = float(state.get("kl_coef", self.hp.beta))
        if self.critic is not None:
            self.critic.load_state_dict(state["critic"])
        return step

    def _save(self, step: int, metrics: dict[str, float]) -> ckpt.Checkpoint:
        c = ckpt.save_checkpoint(
            self.out,
            step=step,
            model=self.model,
            state=self._state(step),
            spec=self.spec.to_json(),
            metrics=metrics,
        )
        self.cb.on_checkpoint(step, c.path, metrics)
        return c

    def _sampling_model(self) -> tuple[torch.nn.Module, Precision]:
        """The model to sample from and the autocast to run it under (the merged copy is already bf16)."""
        if self.merged is not None:
            return self.merged.sync(), "fp32"
        return self.model, self.precision

    # -- rollout -----------------------------------------------------------------------------------------------

    @property
    def _sampling_logprobs_exact(self) -> bool:
        """Whether the sampler's own log-probs are the policy's (up to float rounding): the policy samples itself in
        fp32. Then they are the rollout's old log-probs and the no-grad policy pass is skipped; a bf16 sampler copy
        or bf16 autocast would differ by bf16 rounding, and the pass is run."""
        return self.merged is None and self.precision == "fp32"

    def _sample_groups(self) -> tuple[Rollout, list[PromptItem], float, torch.Tensor | None]:
        hp = self.hp
        idx = self.sampler.next(hp.batch_size)
        prompts = [self.train_ids[i] for i in idx for _ in range(hp.group_size)]  # rows of a group adjacent
        items = [self.train_items[i] for i in idx for _ in range(hp.group_size)]
        ids, mask = left_pad(prompts, self.tokenizer.pad_token_id)
        t0 = time.perf_counter()
        sampling_model, precision = self._sampling_model()
        out = generate(
            sampling_model,
            ids.to(self.device),
            mask.to(self.device),
            max_new_tokens=hp.max_completion_tokens,
            eos_id=self.tokenizer.eos_token_id,
            pad_id=self.tokenizer.pad_token_id,
            temperature=hp.temperature,
            top_p=hp.top_p,
            min_new_tokens=hp.min_completion_tokens,
            generator=self.generator,
            precision=precision,
            with_logprobs=self._sampling_logprobs_exact,
        )
        ro, logp = out if isinstance(out, tuple) else (out, None)
        return ro, items, time.perf_counter() - t0, logp

    @torch.no_grad()
    def _logprobs(self, ro: Rollout, *, reference: bool) -> torch.Tensor:
        """Log-probs of the whole rollout under the current policy or the reference, micro-batch by micro-batch."""
        out = []
        for sl in micro_slices(len(ro), self.hp.micro_batch_size):
            part = ro.select(torch.arange(sl.start, sl.stop))
            if reference:
                with reference_policy(self.model):
                    lp, _ = completion_logprobs(
                        self.model, part, temperature=self.hp.temperature, precision=self.precision
                    )
            else:
                lp, _ = completion_logprobs(self.model, part, temperature=self.hp.temperature, precision=self.precision)
            out.append(lp)
        return _cat_padded(out, ro.completion_ids.shape[1])

    @torch.no_grad()
    def _logprobs_and_values(self, ro: Rollout) -> tuple[torch.Tensor, torch.Tensor]:
        """A trunk critic's rollout pass: the policy's log-probs and the head's V from the same forward, [N, C] each."""
        assert self.critic is not None and self.trunk
        logps, values = [], []
        for sl in micro_slices(len(ro), self.hp.micro_batch_size):
            part = ro.select(torch.arange(sl.start, sl.stop))
            lp, _, hidden = completion_logprobs(
                self.model, part, temperature=self.hp.temperature, precision=self.precision, with_hidden=True
            )
            logps.append(lp)
            values.append(self.critic.head_values(hidden))
        width = ro.completion_ids.shape[1]
        return _cat_padded(logps, width), _cat_padded(values, width)

    def _collect(self) -> _Batch:
        """Sample, grade and shape rewards; DAPO's dynamic sampling keeps drawing until the batch is full."""
        hp, g = self.hp, self.hp.group_size
        dynamic = self.recipe.dynamic_sampling and isinstance(hp, DAPOHyperparameters) and hp.dynamic_sampling
        max_batches = hp.max_sampling_batches if isinstance(hp, DAPOHyperparameters) and dynamic else 1
        kept: list[
            tuple[
                Rollout,
                list[PromptItem],
                torch.Tensor,
                torch.Tensor,
                dict[str, torch.Tensor],
                list[str],
                torch.Tensor | None,
            ]
        ]
        kept = []
        n_kept = sampled = zero_std = batches = 0
        gen_s = 0.0
        while batches < max_batches and n_kept < hp.batch_size:
            ro, items, secs, sample_logp = self._sample_groups()
            batches, gen_s = batches + 1, gen_s + secs
            ro = ro.to("cpu")
            texts = decode_completions(self.tokenizer, ro)
            scores = grade_batch(self.grader, texts, items)
            shaped = scores.rewards.clone()
            if self.recipe.overlong_shaping and isinstance(hp, DAPOHyperparameters) and hp.overlong_penalty > 0:
                buffer = hp.overlong_buffer or max(hp.max_completion_tokens // 4, 1)
                shaped += overlong_penalty(
                    ro.lengths, max_tokens=hp.max_completion_tokens, buffer=buffer, factor=hp.overlong_penalty
                )
            std = shaped.view(-1, g).std(dim=1) if g > 1 else torch.ones(len(shaped) // g)
            flat = (std < ZERO_STD).tolist()
            sampled += len(flat)
            zero_std += sum(flat)
            keep = [i for i, z in enumerate(flat) if not (dynamic and z)][: hp.batch_size - n_kept]
            if not keep:
                continue
            rows = torch.tensor([i * g + j for i in keep for j in range(g)])
            kept.append(
                (
                    ro.select(rows),
                    [items[r] for r in rows.tolist()],
                    shaped[rows],
                    scores.rewards[rows],
                    {k: v[rows] for k, v in scores.sub.items()},
                    [texts[r] for r in rows.tolist()],
                    sample_logp[rows.to(sample_logp.device)] if sample_logp is not None else None,
                )
            )
            n_kept += len(keep)
        if dynamic and n_kept < hp.batch_size:
            self.cb.on_event(
                "warn",
                f"dynamic sampling filled {n_kept} of {hp.batch_size} groups after "
                f"{batches} rollout batches (max_sampling_batches)",
            )
        if not kept:
            empty = torch.zeros(0)
            return _Batch(
                Rollout(*(t[:0] for t in ro.tensors())),
                [],
                empty,
                empty,
                {},
                [],
                None,
                None,
                None,
                None,
                sampled,
                zero_std,
                batches,
                gen_s,
            )
        rollout = Rollout.concat([k[0] for k in kept], self.tokenizer.pad_token_id).to(self.device)
        batch = _Batch(
            rollout=rollout,
            items=[it for k in kept for it in k[1]],
            rewards=torch.cat([k[2] for k in kept]),
            grader_rewards=torch.cat([k[3] for k in kept]),
            sub={name: torch.cat([k[4][name] for k in kept]) for name in kept[0][4]},
            texts=[t for k in kept for t in k[5]],
            old_logp=None,
            ref_logp=None,
            values=None,
            returns=None,
            groups_sampled=sampled,
            groups_zero_std=zero_std,
            sampling_batches=batches,
            generation_s=gen_s,
        )
        kl_in_reward = self.recipe.kl_placement == "reward" and hp.beta > 0
        sampled_logp = [k[6] for k in kept]
        if self.trunk:  # the policy's pass yields V_old too: no critic pass
            batch.old_logp, batch.values = self._logprobs_and_values(rollout)
        elif not self.on_policy or kl_in_reward:
            if all(lp is not None for lp in sampled_logp):  # the sampler is the fp32 policy: its log-probs are exact
                width = rollout.completion_ids.shape[1]
                batch.old_logp = _cat_padded([lp for lp in sampled_logp if lp is not None], width).to(self.device)
                batch.old_logp = batch.old_logp * rollout.completion_mask
            else:
                batch.old_logp = self._logprobs(rollout, reference=False)
        if hp.beta > 0:
            batch.ref_logp = self._logprobs(rollout, reference=True)
        if self.critic is not None:  # PPO: the KL enters the per-token rewards (_gae_advantages)
            if not self.trunk:
                batch.values = self._values(rollout)
        elif kl_in_reward:  # RLOO, REINFORCE: −β·Σ_t KL_t joins the sequence's reward
            assert batch.old_logp is not None and batch.ref_logp is not None
            seq_kl = masked_sum(self.kl(batch.old_logp, batch.ref_logp), rollout.completion_mask, dim=-1)
            batch.rewards = batch.rewards - hp.beta * seq_kl.cpu()
        return batch

    @torch.no_grad()
    def _values(self, ro: Rollout) -> torch.Tensor:
        """The critic's V of the whole rollout, micro-batch by micro-batch: [N, C]."""
        assert self.critic is not None
        out = []
        for sl in micro_slices(len(ro), self.hp.micro_batch_size):
            out.append(self.critic.values(ro.select(torch.arange(sl.start, sl.stop)), precision=self.precision))
        return _cat_padded(out, ro.completion_ids.shape[1])

    def _gae_advantages(self, batch: _Batch) -> tuple[torch.Tensor, dict[str, float]]:
        """PPO: per-token rewards (score on the last token, −β·KL on each) → GAE → advantages [N, C] and returns."""
        hp = self.hp
        assert isinstance(hp, PPOHyperparameters) and batch.values is not None
        ro = batch.rollout
        cmask = ro.completion_mask.to(torch.float32)
        if batch.ref_logp is not None:
            assert batch.old_logp is not None
            kl_tok = self.kl(batch.old_logp, batch.ref_logp) * cmask
        else:
            kl_tok = torch.zeros_like(cmask)
        rewards = ppo_token_rewards(batch.rewards.to(cmask.device), kl_tok, cmask, beta=self.kl_coef)
        if hp.whiten_rewards:
            rewards = masked_whiten(rewards, cmask, shift_mean=False) * cmask
        adv, returns = gae(rewards, batch.values, cmask, gamma=hp.gamma, lam=hp.lam)
        if hp.whiten_advantages:
            adv = masked_whiten(adv, cmask) * cmask
        batch.returns = returns
        seq_kl = masked_sum(kl_tok, cmask, dim=-1)  # [N] the sequence-level KL the controller tracks
        m = {
            M.VALUE_MEAN: float(masked_mean(batch.values, cmask)),
            M.RETURNS_MEAN: float(masked_mean(returns, cmask)),
            M.EXPLAINED_VARIANCE: explained_variance(batch.values, returns, cmask),
            M.NON_SCORE_REWARD: float((-self.kl_coef * seq_kl).mean()),
        }
        if hp.target_kl is not None and batch.ref_logp is not None:
            # Ziegler et al. 2019: the error is measured on the sequence KL, one update per sample of the batch
            self.kl_coef = adaptive_kl_update(
                self.kl_coef,
                observed_kl=float(seq_kl.mean()),
                target=hp.target_kl,
                horizon=hp.kl_horizon,
                n_steps=len(ro),
            )
        return adv, m

    # -- the loop ----------------------------------------------------------------------------------------------

    def run(self, *, resume: bool = False) -> RunResult:
        return run_steps(
            self,
            resume=resume,
            validate_first=bool(self.val_items and self.hp.eval_interval),
            checkpoint_interval=self.hp.checkpoint_interval,
        )

    def _step(self, step: int) -> dict[str, float]:
        hp, g = self.hp, self.hp.group_size
        t_step = time.perf_counter()
        lr = self.scheduler.get_last_lr()[0]
        batch = self._collect()
        ro = batch.rollout
        n = len(ro)
        m: dict[str, float] = {}
        adv = torch.zeros(0)
        kl_coef = self.kl_coef  # the coefficient this step's rewards use (PPO's controller updates it below)
        if n:
            if self.critic is not None:
                adv, ppo_metrics = self._gae_advantages(batch)
                m |= ppo_metrics
            else:
                assert self.advantage is not None
                adv = self.advantage(batch.rewards.view(-1, g), self.adv_opts).reshape(-1).to(self.device)
            mask = ro.completion_mask.to(torch.float32)
            if hp.mask_truncated_completions:
                mask = mask * (~ro.truncated).unsqueeze(-1).float()
            m |= self._optimise(step, ro, mask, adv, batch)
        self.scheduler.step()

        lengths = ro.lengths.float()
        m |= {
            M.REWARD_MEAN: _mean(batch.grader_rewards),
            M.REWARD_STD: _std(batch.grader_rewards),
            M.COMPLETION_LEN_MEAN: _mean(lengths),
            M.COMPLETION_LEN_MAX: float(lengths.max()) if n else 0.0,
            M.TRUNCATED_FRAC: _mean(ro.truncated.float()),
            M.GROUPS_ZERO_STD_FRAC: batch.groups_zero_std / max(batch.groups_sampled, 1),
            M.LEARNING_RATE: lr,
            M.GENERATION_SECONDS: batch.generation_s,
        }
        for name, v in batch.sub.items():
            m[M.reward_of(name)] = _mean(v)
        if self.recipe.dynamic_sampling:
            m[M.GROUPS_DROPPED] = float(batch.groups_sampled - n // g)
            m[M.SAMPLING_BATCHES] = float(batch.sampling_batches)
        if hp.beta > 0:
            m[M.KL_COEF] = kl_coef
        m[M.TOKENS_PER_S_GENERATION] = float(lengths.sum()) / max(batch.generation_s, 1e-9) if n else 0.0

        if self.val_items and ((hp.eval_interval and step % hp.eval_interval == 0) or step == self.total_steps):
            m |= self._validation_metrics()
        m[M.STEP_SECONDS] = time.perf_counter() - t_step
        self.cb.on_metrics(step, m)
        if hp.rollouts_logged and n:
            seq_adv = masked_mean(adv, ro.completion_mask.float(), dim=-1) if adv.dim() == 2 else adv
            self.cb.on_rollouts(step, self._rollout_records(batch, seq_adv.cpu(), hp.rollouts_logged))
        return m

    def _optimise(
        self, step: int, ro: Rollout, mask: torch.Tensor, adv: torch.Tensor, batch: _Batch
    ) -> dict[str, float]:
        """μ passes over the rollout batch in mini-batches; each mini-batch is one optimiser step, accumulated over
        micro-batches whose losses are normalised by the mini-batch's totals (exactly the full-batch loss)."""
        hp = self.hp
        n = len(ro)
        kl_in_loss = self.recipe.kl_placement == "loss" and hp.beta > 0
        order_gen = torch.Generator().manual_seed(self.spec.seed * 1_000_003 + step)  # derived: nothing to save
        sums = {
            "tok": 0.0,
            "low": 0.0,
            "high": 0.0,
            "dual": 0.0,
            "approx_kl": 0.0,
            "ent": 0.0,
            "ent_tok": 0.0,
            "kl": 0.0,
            "kl_tok": 0.0,
            "pg": 0.0,
            "kl_loss": 0.0,
            "grad": 0.0,
            "opt_steps": 0.0,
            "vf": 0.0,
            "vf_clip": 0.0,
        }
        train_tokens = 0
        t0 = time.perf_counter()
        mb_size = n // hp.mini_batches
        for it in range(hp.iterations_per_batch):
            perm = torch.randperm(n, generator=order_gen) if hp.mini_batches > 1 else torch.arange(n)
            for mb_start in range(0, n, mb_size):
                mb = perm[mb_start : mb_start + mb_size]
                scale = LossScale(float(mask[mb].sum()), len(mb), hp.max_completion_tokens)
                self.optimizer.zero_grad(set_to_none=True)
                for sl in micro_slices(len(mb), hp.micro_batch_size):
                    idx = mb[sl]
                    part = ro.select(idx.to(ro.prompt_ids.device))
                    pmask = mask[idx]
                    self.model.train(self.spec.method.lora.dropout > 0)
                    hidden = None
                    if self.trunk:
                        logp, ent, hidden = completion_logprobs(
                            self.model,
                            part,
                            temperature=hp.temperature,
                            precision=self.precision,
                            with_entropy=it == 0,
                            with_hidden=True,
                        )
                    else:
                        logp, ent = completion_logprobs(
                            self.model,
                            part,
                            temperature=hp.temperature,
                            precision=self.precision,
                            with_entropy=it == 0,
                        )
                    self.model.eval()
                    old = logp.detach() if self.on_policy else batch.old_logp[idx]  # type: ignore[index]
                    out = self.policy_loss(logp, old, adv[idx], pmask, self.clip)
                    pg_loss = self.aggregate(out.per_token, pmask, scale)
                    loss = pg_loss
                    if batch.ref_logp is not None:
                        kl_tok = self.kl(logp, batch.ref_logp[idx])
                        if kl_in_loss:
                            kl_loss = hp.beta * self.aggregate(kl_tok, pmask, scale)
                            loss = loss + kl_loss
                            sums["kl_loss"] += float(kl_loss.detach())
                        if it == 0:
                            sums["kl"] += float(masked_sum(kl_tok.detach(), pmask))
                            sums["kl_tok"] += float(pmask.sum())
                    if self.critic is None:
                        loss.backward()
                        trim_freed_memory(self.device)
                    else:
                        assert isinstance(hp, PPOHyperparameters)
                        assert batch.values is not None and batch.returns is not None
                        if hidden is not None:  # the policy's trunk: its V joins this loss (TRL's shared model)
                            v = self.critic.head_values(hidden)
                        else:  # the critic's own graph: the policy's is backpropagated (and freed) first
                            loss.backward()
                            trim_freed_memory(self.device)
                            loss = loss.detach()
                            v = self.critic.values(part, precision=self.precision)
                        vl = value_loss_clipped(
                            v, batch.values[idx], batch.returns[idx], pmask, clip=hp.cliprange_value
                        )
                        vf_loss = self.aggregate(vl.per_token, pmask, scale)
                        (loss + hp.vf_coef * vf_loss).backward()
                        trim_freed_memory(self.device)
                        sums["vf"] += float(vf_loss.detach())
                        sums["vf_clip"] += float(vl.clipped.sum())
                    sums["pg"] += float(pg_loss.detach())
                    tok = float(pmask.sum())
                    sums["tok"] += tok
                    sums["low"] += float(out.clipped_low.sum())
                    sums["high"] += float(out.clipped_high.sum())
                    sums["dual"] += float(out.clipped_dual.sum())
                    sums["approx_kl"] += float(masked_sum(0.5 * (logp.detach() - old) ** 2, pmask))
                    if ent is not None:
                        sums["ent"] += float(masked_sum(ent, pmask))
                        sums["ent_tok"] += tok
                    train_tokens += int(part.prompt_mask.sum() + part.completion_mask.sum())
                max_norm = hp.max_grad_norm if hp.max_grad_norm is not None else float("inf")
                sums["grad"] += float(torch.nn.utils.clip_grad_norm_(self.params, max_norm))
                if self.critic_params:  # the critic's gradient scale is its own: clipped separately
                    torch.nn.utils.clip_grad_norm_(self.critic_params, max_norm)
                sums["opt_steps"] += 1
                self.optimizer.step()
                if self.merged is not None:
                    self.merged.stale = True
        train_s = time.perf_counter() - t0
        steps = max(sums["opt_steps"], 1.0)
        tok = max(sums["tok"], 1.0)
        tok_adv = adv[mask.bool()] if adv.dim() == 2 else adv  # per-token advantages: their completion tokens
        vf_coef = float(getattr(hp, "vf_coef", 0.0))
        out_m = {
            M.ADVANTAGE_MEAN: _mean(tok_adv),
            M.ADVANTAGE_STD: _std(tok_adv),
            M.LOSS_POLICY: sums["pg"] / steps,
            M.LOSS_KL: sums["kl_loss"] / steps,
            M.LOSS_TOTAL: (sums["pg"] + sums["kl_loss"] + vf_coef * sums["vf"]) / steps,
            M.CLIP_FRAC_LOW: sums["low"] / tok,
            M.CLIP_FRAC_HIGH: sums["high"] / tok,
            M.APPROX_KL: sums["approx_kl"] / tok,
            M.GRAD_NORM: sums["grad"] / steps,
            M.ENTROPY_MEAN: sums["ent"] / max(sums["ent_tok"], 1.0),
            M.TOKENS_PER_S_TRAINING: train_tokens / max(train_s, 1e-9),
        }
        if hp.dual_clip is not None:
            out_m[M.CLIP_FRAC_DUAL] = sums["dual"] / tok
        if self.critic is not None:
            out_m[M.LOSS_VALUE] = sums["vf"] / steps
            out_m[M.VALUE_CLIP_FRAC] = sums["vf_clip"] / tok
        if batch.ref_logp is not None:
            if self.recipe.kl_placement == "reward":
                assert batch.old_logp is not None
                out_m[M.KL_MEAN] = float(masked_mean(self.kl(batch.old_logp, batch.ref_logp), mask))
            else:
                out_m[M.KL_MEAN] = sums["kl"] / max(sums["kl_tok"], 1.0)
        return out_m

    def _rollout_records(self, batch: _Batch, adv: torch.Tensor, k: int) -> list[dict[str, Any]]:
        out = []
        for i in range(min(k, len(batch.texts))):
            out.append(
                {
                    "prompt": batch.items[i].messages,
                    "completion": batch.texts[i],
                    "reward": float(batch.grader_rewards[i]),
                    "rewards": {name: float(v[i]) for name, v in batch.sub.items()},
                    "advantage": float(adv[i]),
                    "length": int(batch.rollout.lengths[i]),
                }
            )
        return out

    def _validation_metrics(self) -> dict[str, float]:
        """Greedy mean reward on the validation prompts (and per named sub-grader)."""
        sampling_model, precision = self._sampling_model()
        res = evaluate(
            sampling_model,
            self.tokenizer,
            self.val_ids,
            self.val_items,
            self.grader,
            max_new_tokens=self.hp.max_completion_tokens,
            precision=precision,
        )
        out = {M.VAL_REWARD_MEAN: res.mean_reward}
        for name, v in res.sub_means.items():
            out[M.reward_of(name, validation=True)] = v
        return out


def _cat_padded(parts: list[torch.Tensor], width: int) -> torch.Tensor:
    """Micro-batch results [b_i, c_i] right-padded with 0 to ``width`` and stacked: [Σ b_i, width]."""
    return torch.cat([torch.nn.functional.pad(t, (0, width - t.shape[1])) for t in parts])


def _mean(x: torch.Tensor) -> float:
    return float(x.float().mean()) if x.numel() else 0.0


def _std(x: torch.Tensor) -> float:
    return float(x.float().std()) if x.numel() > 1 else 0.0

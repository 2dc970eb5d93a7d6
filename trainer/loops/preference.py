"""The pairwise loop: Bradley–Terry reward models and DPO, readable top to bottom.

One training step: ``batch_size`` preference pairs → for each micro-batch of pairs, the chosen and rejected replies in
one forward pass → the pairwise loss (``core_algos.PAIRWISE_LOSSES``) → one optimiser step on the mean over the
step's pairs (the micro-batch losses are normalised by the step's pair count, so accumulation gives exactly the
full-batch gradient).

- ``reward_model``: r = a score head on the base's backbone at the last token (``trainer.loops.reward_model``); the
  inputs of ``bradley_terry`` are r_c, r_r. The finished adapter carries ``reward_model.json`` with the score
  statistics a ``reward_model`` grader's ``normalize`` uses.
- ``dpo``: the inputs are the log-ratios Δ = log π(y|x) − log π_ref(y|x), each a sum over the reply's tokens, the
  reference being the same base with the adapter disabled, under no_grad and in eval mode (rl-algorithms §2.8);
  the reported rewards are the implicit rewards β·Δ.

``micro_batch_size`` counts pairs (two sequences each) per forward pass.
"""

from __future__ import annotations

import random
import time
from pathlib import Path

import torch
from torch import Tensor

from trainer.algorithms.core_algos import PAIRWISE_LOSSES, PairwiseOptions, masked_sum
from trainer.generation.distributed import World
from trainer.generation.encoding import EncodedPair, PromptSampler, completion_batch, encode_preferences
from trainer.generation.models import (
    Precision,
    default_device,
    load_tokenizer,
    reference_policy,
    resolve_precision,
    trainable_parameters,
)
from trainer.generation.rollout import Rollout, completion_logprobs, micro_slices
from trainer.loops.engine import Engine, ParamGroup, check_context, cpu_bf16_attention, load_policy, seed_everything
from trainer.loops.reward_model import (
    SCALE,
    RewardModelInfo,
    add_scale,
    build_reward_model,
    reward_scores,
    score_statistics,
)
from trainer.loops.steps import EngineLoop, validation_due
from trainer.spec import metrics as M
from trainer.spec.callbacks import Callback
from trainer.spec.config import DPOHyperparameters, JobSpec, RewardModelHyperparameters, held_out_count
from trainer.spec.data import DatasetError, load_preferences

STATS_PAIRS = 2048  # pairs scored at the end for a reward model's score statistics
MAX_KINDS = 32  # distinct 'kind' values of the validation pairs, each a val/preference/accuracy/{kind} series


def held_out(pairs: list[EncodedPair], share: float, *, seed: int) -> tuple[list[EncodedPair], list[EncodedPair]]:
    """(training, validation): ``held_out_count`` of the pairs drawn by ``seed``; each list keeps the file's order."""
    chosen = set(random.Random(seed).sample(range(len(pairs)), held_out_count(len(pairs), share)))
    return [p for i, p in enumerate(pairs) if i not in chosen], [p for i, p in enumerate(pairs) if i in chosen]


class PreferenceTrainer(EngineLoop):
    """Holds what the loop needs; :meth:`run` is the loop."""

    def __init__(
        self,
        spec: JobSpec,
        *,
        output_dir: Path,
        callback: Callback,
        device: torch.device | None = None,
        world: World | None = None,
    ):
        self.spec, self.out, self.cb = spec, output_dir, callback
        self.world = world or World()  # data parallel: this rank's place (trainer.generation.distributed)
        hp = spec.method.hyperparameters
        assert isinstance(hp, RewardModelHyperparameters | DPOHyperparameters)
        self.hp: RewardModelHyperparameters | DPOHyperparameters = hp
        self.reward_model = isinstance(hp, RewardModelHyperparameters)
        self._load_data()  # everything that can be wrong with the input is checked before any weight is loaded
        self.device = device or self.world.device() or default_device()
        self.precision: Precision = resolve_precision(hp.precision, self.device)
        seed_everything(spec.seed)
        if isinstance(hp, RewardModelHyperparameters) and hp.head == "likelihood":
            self.model = load_policy(
                spec.model, spec.method.lora, device=self.device, precision=self.precision, seed=spec.seed
            ).model
            add_scale(self.model, self.device)
        elif self.reward_model:
            self.model = build_reward_model(
                spec.model,
                spec.method.lora,
                pad_token_id=self.tokenizer.pad_token_id,
                seed=spec.seed,
                device=self.device,
                frozen_dtype=torch.bfloat16 if self.precision == "bf16" else None,
            )
            cpu_bf16_attention(self.model, precision=self.precision, device=self.device)
        else:
            self.model = load_policy(
                spec.model, spec.method.lora, device=self.device, precision=self.precision, seed=spec.seed
            ).model
        self.params = trainable_parameters(self.model)
        self.engine = Engine(
            self.model,
            groups=[ParamGroup(self.params, hp.effective_learning_rate)],
            hp=hp,
            total_steps=self.total_steps,
            device=self.device,
            precision=self.precision,
            data_order=PromptSampler(len(self.train_pairs), seed=spec.seed),
            seed=spec.seed,  # nothing here samples; the generator makes a restore set every RNG, as the RL loop's
            dropout=spec.method.lora.dropout > 0,
        )
        if isinstance(hp, DPOHyperparameters):
            self.loss = PAIRWISE_LOSSES.get(f"dpo_{hp.loss_type}")
        else:
            self.loss = PAIRWISE_LOSSES.get("bradley_terry")

    def _load_data(self) -> None:
        """The pairs, tokenised and checked against the model's context: the input's errors, before any weight."""
        spec, hp = self.spec, self.hp
        train_items = load_preferences(Path(spec.training_file))
        val_items = load_preferences(Path(spec.validation_file)) if spec.validation_file else []
        self.tokenizer = load_tokenizer(spec.model)
        self.train_pairs = encode_preferences(
            self.tokenizer, train_items, max_length=hp.max_length, path=spec.training_file
        )
        self.val_pairs = encode_preferences(
            self.tokenizer, val_items, max_length=hp.max_length, path=spec.validation_file or ""
        )
        if isinstance(hp, RewardModelHyperparameters) and not val_items and hp.validation_split > 0:
            self.train_pairs, self.val_pairs = held_out(self.train_pairs, hp.validation_split, seed=spec.seed)
        kinds = {p.kind for p in self.val_pairs if p.kind is not None}
        if len(kinds) > MAX_KINDS:
            raise DatasetError(
                f"{spec.validation_file or spec.training_file}: the validation pairs have {len(kinds)} distinct "
                f"'kind' values; at most {MAX_KINDS} (each is a metric series)"
            )
        longest = max(
            len(p.prompt_ids) + max(len(p.chosen_ids), len(p.rejected_ids)) for p in self.train_pairs + self.val_pairs
        )
        check_context(
            spec.model,
            needed=longest,
            what=f"the longest pair ({longest} tokens)",
            param=f"method.{spec.method.type}.hyperparameters.max_length",
        )
        if hp.eval_samples:
            self.val_pairs = self.val_pairs[: hp.eval_samples]
        self.total_steps = hp.total_steps(len(self.train_pairs))

    # -- state -------------------------------------------------------------------------------------------------

    def has_validation_data(self) -> bool:
        return bool(self.val_pairs)

    def on_saved(self, step: int, adapter_dir: Path) -> None:
        if self.reward_model:
            # Every adapter written is a usable reward model. Its score statistics are measured on the validation
            # pairs at every checkpoint (cheap, and keep_best may make any of them the result), else at the last one.
            final = step == self.total_steps or bool(self.val_pairs)
            self._reward_model_info(final=final).write(adapter_dir)

    # -- the loop ----------------------------------------------------------------------------------------------

    def step(self, step: int) -> dict[str, float]:
        hp = self.hp
        t0 = time.perf_counter()
        lr = self.engine.learning_rate
        idx = self.engine.next_indices(hp.batch_size)
        n = len(idx)
        sums = {"loss": 0.0, "acc": 0.0, "margin": 0.0, "chosen": 0.0, "rejected": 0.0}
        tokens = 0
        self.engine.zero_grad()
        lo, hi = self.world.block(n)  # this rank's pairs, against the whole batch's count
        mine = idx[lo:hi]
        for sl in micro_slices(len(mine), hp.micro_batch_size):
            pairs = [self.train_pairs[i] for i in mine[sl]]
            chosen, rejected, r_c, r_r = self._pair_forward(pairs, train=True)
            per_pair = self.loss(chosen, rejected, self._options(pairs))  # [b]
            self.engine.backward(per_pair.sum() / n)  # this micro-batch's share of the step's mean
            _accumulate(sums, per_pair.detach(), r_c, r_r)
            tokens += sum(len(p.prompt_ids) * 2 + len(p.chosen_ids) + len(p.rejected_ids) for p in pairs)
        self.sync_gradients()
        grad_norm = self.engine.optim_step()[0]
        self.engine.lr_step()
        train_s = time.perf_counter() - t0
        names = list(sums)
        *totals, all_tokens = self.world.sum_floats([sums[k] for k in names] + [float(tokens)])
        sums = dict(zip(names, totals, strict=True))

        m = {
            M.LOSS_TOTAL: sums["loss"] / n,
            M.PREFERENCE_ACCURACY: sums["acc"] / n,
            M.PREFERENCE_MARGIN: sums["margin"] / n,
            M.REWARDS_CHOSEN: sums["chosen"] / n,
            M.REWARDS_REJECTED: sums["rejected"] / n,
            M.GRAD_NORM: grad_norm,
            M.LEARNING_RATE: lr,
            M.TOKENS_PER_S_TRAINING: all_tokens / max(train_s, 1e-9),
        }
        every = hp.eval_every(self.total_steps)  # eval_interval, or the one 'auto' picks from the run's length
        if self.val_pairs and validation_due(step, interval=every, total_steps=self.total_steps):
            m |= self.validation_metrics()
        m[M.STEP_SECONDS] = time.perf_counter() - t0
        return self.report(step, m)

    # -- the forward -------------------------------------------------------------------------------------------

    def _batch(self, pairs: list[EncodedPair]) -> Rollout:
        """2b rows: the chosen replies, then the rejected ones, each after its prompt."""
        prompts = [p.prompt_ids for p in pairs] * 2
        replies = [p.chosen_ids for p in pairs] + [p.rejected_ids for p in pairs]
        return completion_batch(prompts, replies, self.tokenizer.pad_token_id).to(self.device)

    def _pair_forward(self, pairs: list[EncodedPair], *, train: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """(chosen, rejected): the loss's inputs [b] (r for a reward model, Δ for DPO), and the rewards to report
        [b] each (r, or the implicit β·Δ), detached."""
        b = len(pairs)
        batch = self._batch(pairs)
        if self.reward_model:
            self.model.train(train and self.spec.method.lora.dropout > 0)
            assert isinstance(self.hp, RewardModelHyperparameters)
            scores = reward_scores(self.model, batch, precision=self.precision, head=self.hp.head)  # [2b]
            self.model.eval()
            return scores[:b], scores[b:], scores[:b].detach(), scores[b:].detach()
        assert isinstance(self.hp, DPOHyperparameters)
        with torch.no_grad(), reference_policy(self.model):  # eval mode: no dropout in the reference
            ref = self._sequence_logps(batch)
        self.model.train(train and self.spec.method.lora.dropout > 0)
        logp = self._sequence_logps(batch)  # [2b]
        self.model.eval()
        delta = logp - ref
        rewards = self.hp.beta * delta.detach()
        return delta[:b], delta[b:], rewards[:b], rewards[b:]

    def _sequence_logps(self, batch: Rollout) -> Tensor:
        """log π(y|x) = Σ_t log π(y_t | x, y_<t) over the reply's tokens (EOS included), no length normalisation:
        [B]."""
        logp, _ = completion_logprobs(self.model, batch, temperature=1.0, precision=self.precision, share_prompts=True)
        return masked_sum(logp, batch.completion_mask, dim=-1)

    def _options(self, pairs: list[EncodedPair]) -> PairwiseOptions:
        hp = self.hp
        if isinstance(hp, RewardModelHyperparameters):
            margin = torch.tensor([hp.margin + p.margin for p in pairs], device=self.device)
            return PairwiseOptions(margin=margin, center_coefficient=hp.center_rewards_coefficient or 0.0)
        return PairwiseOptions(
            beta=hp.beta,
            label_smoothing=hp.label_smoothing,
            chosen_tokens=torch.tensor([float(len(p.chosen_ids)) for p in pairs], device=self.device),
            rejected_tokens=torch.tensor([float(len(p.rejected_ids)) for p in pairs], device=self.device),
        )

    # -- validation and the reward model's statistics ----------------------------------------------------------

    def validation_metrics(self) -> dict[str, float]:
        """Loss, accuracy, margin and rewards over the validation pairs (eval mode, the training batch layout), and
        the accuracy of each kind of pair where the lines name one (rank 0's, on every rank)."""
        return self.from_rank0(self._validation_metrics)

    @torch.no_grad()
    def _validation_metrics(self) -> dict[str, float]:
        sums = {"loss": 0.0, "acc": 0.0, "margin": 0.0, "chosen": 0.0, "rejected": 0.0}
        right: dict[str, list[float]] = {}
        n = len(self.val_pairs)
        for sl in micro_slices(n, self.hp.micro_batch_size or self.hp.batch_size):
            pairs = self.val_pairs[sl]
            chosen, rejected, r_c, r_r = self._pair_forward(pairs, train=False)
            _accumulate(sums, self.loss(chosen, rejected, self._options(pairs)), r_c, r_r)
            for pair, ok in zip(pairs, (r_c > r_r).tolist(), strict=True):
                if pair.kind is not None:
                    right.setdefault(pair.kind, []).append(float(ok))
        return {
            M.VAL_LOSS: sums["loss"] / n,
            M.validation(M.PREFERENCE_ACCURACY): sums["acc"] / n,
            M.validation(M.PREFERENCE_MARGIN): sums["margin"] / n,
            M.validation(M.REWARDS_CHOSEN): sums["chosen"] / n,
            M.validation(M.REWARDS_REJECTED): sums["rejected"] / n,
            **{M.VAL_PREFERENCE_ACCURACY_OF_KIND.name(k): sum(v) / len(v) for k, v in sorted(right.items())},
        }

    @torch.no_grad()
    def _reward_model_info(self, *, final: bool) -> RewardModelInfo:
        """``reward_model.json``; at the end with the mean and std of the scores of the validation pairs (else of up
        to STATS_PAIRS training pairs), chosen and rejected together: what ``normalize`` standardises with."""
        assert isinstance(self.hp, RewardModelHyperparameters)
        head = self.hp.head
        scale = float(getattr(self.model, SCALE)) if head == "likelihood" else None
        info = RewardModelInfo(base_model=self.spec.model, max_length=self.hp.max_length, head=head, scale=scale)
        if not final:
            return info
        source, pairs = ("validation", self.val_pairs) if self.val_pairs else ("training", self.train_pairs)
        pairs = pairs[:STATS_PAIRS]
        scores = []
        for sl in micro_slices(len(pairs), self.hp.micro_batch_size or self.hp.batch_size):
            _, _, r_c, r_r = self._pair_forward(pairs[sl], train=False)
            scores += [r_c.cpu(), r_r.cpu()]
        mean, std = score_statistics(torch.cat(scores))
        return RewardModelInfo(
            base_model=self.spec.model,
            max_length=self.hp.max_length,
            score_mean=mean,
            score_std=std,
            scored_on=source,
            n_scores=2 * len(pairs),
            head=head,
            scale=scale,
        )


def _accumulate(sums: dict[str, float], per_pair: Tensor, r_c: Tensor, r_r: Tensor) -> None:
    """Add a micro-batch's sums: loss, accuracy (r_c > r_r, ties count as wrong), margin and rewards."""
    sums["loss"] += float(per_pair.sum())
    sums["acc"] += float((r_c > r_r).float().sum())
    sums["margin"] += float((r_c - r_r).sum())
    sums["chosen"] += float(r_c.sum())
    sums["rejected"] += float(r_r.sum())

"""The online RL step's optimise phase (``trainer.loops.rl``): μ passes over the batch in a fixed number of
mini-batches, each one optimiser step accumulated over micro-batches against the mini-batch's totals (exactly the
full mini-batch's loss); the policy's loss, the KL in the loss where the recipe puts it, and a critic's value loss;
and the update's metrics from its sums.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Protocol

import torch
from torch import Tensor

from trainer.algorithms.core_algos import LossScale, masked_mean, masked_sum, value_loss_clipped
from trainer.generation.models import Precision
from trainer.generation.rollout import Rollout, micro_slices
from trainer.loops.rl_batch import Advantages, Algorithm, Batch, Sums, UpdateForward
from trainer.loops.rl_run import Models, Shares
from trainer.spec import metrics as M
from trainer.spec.config import PPOHyperparameters, RLHyperparameters
from trainer.spec.recipes import Recipe


class PolicyForward(Protocol):
    """The update's forward of some rows (``trainer.loops.rl_score.Scorer.policy_forward``)."""

    def __call__(self, part: Rollout, *, with_entropy: bool) -> UpdateForward: ...


class Updater:
    """The policy's (and the critic's) update from a scored batch (:meth:`optimise`)."""

    def __init__(
        self,
        hp: RLHyperparameters,
        *,
        seed: int,
        recipe: Recipe,
        algo: Algorithm,
        models: Models,
        shares: Shares,
        precision: Precision,
        policy_forward: PolicyForward,
        sync_gradients: Callable[[], None],
    ) -> None:
        self.hp, self.seed, self.recipe, self.algo, self.models, self.shares = hp, seed, recipe, algo, models, shares
        self.precision, self.policy_forward, self.sync_gradients = precision, policy_forward, sync_gradients

    def optimise(
        self, step: int, batch: Batch, adv: Advantages, *, first: UpdateForward | None = None
    ) -> dict[str, float]:
        """μ passes over the batch, each in ``mini_batches`` mini-batches (a fixed count: a short batch after dynamic
        sampling gives smaller mini-batches, and a batch of fewer rows than mini-batches one row each); each
        mini-batch is one optimiser step over micro-batches normalised by the mini-batch's totals. ``first``: the
        first pass's forward of the whole batch (one mini-batch, one micro-batch), already run by the scoring."""
        hp, n, engine = self.hp, len(batch), self.models.engine
        order = torch.Generator().manual_seed(self.seed * 1_000_003 + step)  # derived: nothing to save
        sums = Sums()
        t0 = time.perf_counter()
        for it in range(hp.iterations_per_batch):
            perm = torch.randperm(n, generator=order) if hp.mini_batches > 1 else torch.arange(n)
            for mb in torch.tensor_split(perm, min(hp.mini_batches, n)):
                scale = LossScale(float(batch.loss_mask[mb].sum()), len(mb), hp.max_completion_tokens)
                engine.zero_grad()
                mine = self.shares.rows(mb)  # this rank's share, against the whole mini-batch's totals
                for sl in micro_slices(len(mine), hp.micro_batch_size):
                    passes = first if it == 0 else None
                    sums.add(self.micro_batch(batch, adv, mine[sl], scale, first_pass=it == 0, passes=passes))
                self.sync_gradients()
                norms = engine.optim_step()
                sums.grad_norm += norms[0]
                sums.optimizer_steps += 1
        self.shares.sum_across(sums)
        return self._metrics(batch, adv, sums, train_s=time.perf_counter() - t0)

    def micro_batch(
        self,
        batch: Batch,
        adv: Advantages,
        idx: Tensor,
        scale: LossScale,
        *,
        first_pass: bool,
        passes: UpdateForward | None = None,
    ) -> Sums:
        """One micro-batch's loss (policy, KL in the loss, value), backpropagated; its sums for the metrics.
        ``passes``: the forward of these rows, already run (the scoring's of the whole batch)."""
        hp, algo, engine = self.hp, self.algo, self.models.engine
        live = idx >= 0  # a sharded run's padding rows are -1 (their mask is 0: no loss, no metrics)
        idx = idx.clamp(min=0)
        part = batch.rollout.select(idx.to(self.shares.device))
        mask = batch.loss_mask[idx] * live.unsqueeze(-1).to(batch.loss_mask.device)
        if passes is not None:
            assert passes.logp.shape[0] == len(idx), "the forward already run is of these rows"
        logp, ent, v = passes if passes is not None else self.policy_forward(part, with_entropy=first_pass)
        assert algo.on_policy or batch.old_logp is not None
        old = logp.detach() if algo.on_policy else batch.old_logp[idx]  # type: ignore[index]
        out = algo.policy_loss(logp, old, adv.per_row[idx], mask, algo.clip)
        pg_loss = algo.aggregate(out.per_token, mask, scale)
        loss, s = pg_loss, Sums(loss_policy=float(pg_loss.detach()))
        if batch.ref_logp is not None:
            kl_tok = algo.kl(logp, batch.ref_logp[idx])
            if self.recipe.kl_placement == "loss" and hp.beta > 0:
                kl_loss = hp.beta * algo.aggregate(kl_tok, mask, scale)
                loss = loss + kl_loss
                s.loss_kl = float(kl_loss.detach())
            if first_pass:
                s.kl, s.kl_tokens = float(masked_sum(kl_tok.detach(), mask)), float(mask.sum())
        if self.models.critic is None:
            engine.backward(loss)
        else:
            self._value_backward(batch, adv, idx, part, mask, scale, loss=loss, v=v, s=s)
        s.tokens = float(mask.sum())
        s.clip_low, s.clip_high = float(out.clipped_low.sum()), float(out.clipped_high.sum())
        s.clip_dual = float(out.clipped_dual.sum())
        s.approx_kl = float(masked_sum(0.5 * (logp.detach() - old) ** 2, mask))
        if ent is not None:
            s.entropy, s.entropy_tokens = float(masked_sum(ent, mask)), s.tokens
        rows = live.to(part.prompt_mask.device)
        s.train_tokens = int(part.prompt_mask[rows].sum() + part.completion_mask[rows].sum())
        return s

    def _value_backward(
        self,
        batch: Batch,
        adv: Advantages,
        idx: Tensor,
        part: Rollout,
        mask: Tensor,
        scale: LossScale,
        *,
        loss: Tensor,
        v: Tensor | None,
        s: Sums,
    ) -> None:
        """The critic's value loss joined to the policy's ``loss``, backpropagated; its sums into ``s``. A critic
        whose V did not come with the policy's forward runs its own pass after the policy's graph is freed."""
        hp, critic, engine = self.hp, self.models.critic, self.models.engine
        assert isinstance(hp, PPOHyperparameters) and critic is not None
        assert batch.values is not None and adv.returns is not None
        if v is None:  # the critic's own graph: the policy's is backpropagated (and freed) first
            engine.backward(loss)
            loss = loss.detach()
            v = critic.values(part, precision=self.precision)
        vl = value_loss_clipped(v, batch.values[idx], adv.returns[idx], mask, clip=hp.cliprange_value)
        vf_loss = self.algo.aggregate(vl.per_token, mask, scale)
        engine.backward(loss + hp.vf_coef * vf_loss)
        s.loss_value, s.value_clipped = float(vf_loss.detach()), float(vl.clipped.sum())

    def _metrics(self, batch: Batch, adv: Advantages, s: Sums, *, train_s: float) -> dict[str, float]:
        """The update's metrics: means of its sums per optimiser step or per trained token."""
        steps, tok = max(s.optimizer_steps, 1.0), max(s.tokens, 1.0)
        a = adv.per_row
        tok_adv = a[batch.loss_mask.bool()] if a.dim() == 2 else a  # per-token advantages: their trained tokens
        vf_coef = float(getattr(self.hp, "vf_coef", 0.0))
        m = {
            M.ADVANTAGE_MEAN: float(tok_adv.float().mean()) if tok_adv.numel() else 0.0,
            M.ADVANTAGE_STD: float(tok_adv.float().std()) if tok_adv.numel() > 1 else 0.0,
            M.LOSS_POLICY: s.loss_policy / steps,
            M.LOSS_KL: s.loss_kl / steps,
            M.LOSS_TOTAL: (s.loss_policy + s.loss_kl + vf_coef * s.loss_value) / steps,
            M.CLIP_FRAC_LOW: s.clip_low / tok,
            M.CLIP_FRAC_HIGH: s.clip_high / tok,
            M.APPROX_KL: s.approx_kl / tok,
            M.GRAD_NORM: s.grad_norm / steps,
            M.ENTROPY_MEAN: s.entropy / max(s.entropy_tokens, 1.0),
            M.TOKENS_PER_S_TRAINING: s.train_tokens / max(train_s, 1e-9),
        }
        if self.hp.dual_clip is not None:
            m[M.CLIP_FRAC_DUAL] = s.clip_dual / tok
        if self.models.critic is not None:
            m[M.LOSS_VALUE] = s.loss_value / steps
            m[M.VALUE_CLIP_FRAC] = s.value_clipped / tok
        if batch.ref_logp is not None:
            if self.recipe.kl_placement == "reward":
                assert batch.old_logp is not None
                m[M.KL_MEAN] = float(masked_mean(self.algo.kl(batch.old_logp, batch.ref_logp), batch.loss_mask))
            else:
                m[M.KL_MEAN] = s.kl / max(s.kl_tokens, 1.0)
        return m

"""The online RL step's second phase (``trainer.loops.rl``): score the batch. The behaviour and reference log-probs and
the critic's V that the update needs, from the cheapest source that gives them exactly (the rollout engine's own
log-probs, the update's first forward, one fused pass of an adapter critic), and the KL into the reward where the
recipe puts it. Also the update's forward of some rows (:meth:`Scorer.policy_forward`), which scoring may run first.
"""

from __future__ import annotations

import torch
from torch import Tensor

from trainer.algorithms.core_algos import masked_sum, masked_whiten, ppo_token_rewards
from trainer.generation.models import Precision
from trainer.generation.rollout import Rollout
from trainer.loops.rl_batch import Algorithm, Batch, UpdateForward
from trainer.loops.rl_run import Models, Shares
from trainer.spec.config import PPOHyperparameters, RLHyperparameters
from trainer.spec.recipes import Recipe


class Scorer:
    """Fills in a batch's old and reference log-probs, V and per-token rewards (:meth:`score`)."""

    def __init__(
        self,
        hp: RLHyperparameters,
        *,
        recipe: Recipe,
        algo: Algorithm,
        models: Models,
        shares: Shares,
        precision: Precision,
    ) -> None:
        self.hp, self.recipe, self.algo, self.models, self.shares = hp, recipe, algo, models, shares
        self.precision = precision
        # The update's first forward gives the old log-probs where it can (:meth:`_old_from_update`); off: the
        # policy's scoring pass runs apart, before the update (what tests compare against)
        self.old_from_update = True

    @property
    def trunk(self) -> bool:
        """Whether V comes from the policy's own forwards (a head on the policy's trunk)."""
        critic = self.models.critic
        return critic is not None and critic.trunk

    def score(self, batch: Batch) -> UpdateForward | None:
        """The log-probs and values the update needs; the KL into the reward where the recipe puts it. Where the
        update's first forward can score the rollout (:meth:`_old_from_update`) that forward runs here, with its
        graph, and is returned for the update: the old log-probs (and a trunk's V_old) are its, detached."""
        hp, pmask, critic = self.hp, batch.rollout.policy_mask, self.models.critic
        kl_in_reward = self.recipe.kl_placement == "reward" and hp.beta > 0
        needs_old = not self.algo.on_policy or kl_in_reward
        sampling_logp = batch.samples.sampling_logp if self.models.rollout_engine.exact_logprobs else None
        if needs_old and sampling_logp is not None and not self.trunk:
            batch.old_logp = sampling_logp.to(self.shares.device) * pmask  # exact: no policy pass
        deferred = needs_old and batch.old_logp is None and self._old_from_update(batch)
        if critic is not None and critic.fuses:  # policy, reference and critic in one pass over the shared base
            self._score_fused(
                batch, policy=needs_old and batch.old_logp is None and not deferred, reference=hp.beta > 0
            )
            first = self._first_forward(batch) if deferred else None
        else:
            first = self._score_apart(batch, needs_old=needs_old, deferred=deferred)
        if critic is not None:
            batch.token_rewards = self._token_rewards(batch)
        elif kl_in_reward:  # RLOO, REINFORCE: −β·Σ_t KL_t joins the sequence's reward
            assert batch.old_logp is not None and batch.ref_logp is not None
            seq_kl = masked_sum(self.algo.kl(batch.old_logp, batch.ref_logp), pmask, dim=-1)
            batch.samples.rewards = batch.samples.rewards - hp.beta * seq_kl.cpu()
        return first

    def _score_apart(self, batch: Batch, *, needs_old: bool, deferred: bool) -> UpdateForward | None:
        """Each scoring pass on its own: the reference's and an adapter critic's first (where the update's first
        forward follows, their activations are gone when its graph is built), then the policy's."""
        hp, ro, critic, mbs = self.hp, batch.rollout, self.models.critic, self.hp.micro_batch_size
        engine, by_rank = self.models.engine, self.shares.by_rank
        if hp.beta > 0:
            (batch.ref_logp,) = by_rank(
                ro,
                lambda part: (engine.logprobs(part, temperature=hp.temperature, micro_batch_size=mbs, reference=True),),
            )
        if critic is not None and not self.trunk:
            (batch.values,) = by_rank(
                ro, lambda part: (critic.rollout_values(part, precision=self.precision, micro_batch_size=mbs),)
            )
        if deferred:
            first = self._first_forward(batch)
            if critic is not None and self.trunk:
                assert first.values is not None
                batch.values = first.values.detach()
            return first
        if critic is not None and self.trunk:  # the policy's pass yields V_old too: no critic pass
            batch.old_logp, batch.values = by_rank(
                ro,
                lambda part: critic.rollout_logprobs_and_values(
                    part, temperature=hp.temperature, precision=self.precision, micro_batch_size=mbs
                ),
            )
        elif needs_old and batch.old_logp is None:
            (batch.old_logp,) = by_rank(
                ro, lambda part: (engine.logprobs(part, temperature=hp.temperature, micro_batch_size=mbs),)
            )
        return None

    def _old_from_update(self, batch: Batch) -> bool:
        """Whether the update's first forward can give the old log-probs: its first mini-batch is the whole batch
        (``mini_batches`` 1), in one micro-batch on one rank, and LoRA has no dropout. That forward runs the policy
        that sampled, unchanged (no optimiser step precedes it), on the scoring pass's computation, so its log-probs,
        detached, are the old ones: the policy's no-grad scoring pass need not run. Its graph is held from the
        scoring to the first backward, while the rewards and advantages are computed; the other scoring passes (the
        reference, a critic's V_old) run before it, so the peak is the update's own."""
        mbs = self.hp.micro_batch_size
        return (
            self.old_from_update
            and self.hp.mini_batches == 1
            and self.shares.whole_batch_here
            and (mbs is None or mbs >= len(batch))
            and not self.models.engine.dropout
        )

    def _first_forward(self, batch: Batch) -> UpdateForward:
        """The update's first forward over the whole batch, with its graph; the old log-probs are its, detached."""
        first = self.policy_forward(batch.rollout, with_entropy=True)
        batch.old_logp = first.logp.detach()
        return first

    def policy_forward(self, part: Rollout, *, with_entropy: bool) -> UpdateForward:
        """The update's forward of ``part``: the policy's log-probs with the graph, the entropy when asked, and V
        with the graph where it comes with the policy's forward (a fused critic's pass, a trunk's head)."""
        hp, critic, engine = self.hp, self.models.critic, self.models.engine
        if critic is not None and critic.fuses:  # the policy's and the critic's forward as one
            logp, ent, v = engine.run_forward(
                critic.forward_with_policy,
                part,
                temperature=hp.temperature,
                precision=self.precision,
                with_entropy=with_entropy,
            )
            return UpdateForward(logp, ent, v)
        logp, ent, hidden = engine.forward(
            part, temperature=hp.temperature, with_entropy=with_entropy, with_hidden=self.trunk
        )
        if hidden is not None:  # the policy's trunk: its V joins the policy's loss (TRL's shared model)
            assert critic is not None
            return UpdateForward(logp, ent, critic.head_values(hidden))
        return UpdateForward(logp, ent, None)

    def _score_fused(self, batch: Batch, *, policy: bool, reference: bool) -> None:
        """The old (``policy``) and reference (``reference``) log-probs and V_old of an adapter critic: one pass."""
        critic, hp = self.models.critic, self.hp
        assert critic is not None
        scores = list(
            self.shares.by_rank(
                batch.rollout,
                lambda part: critic.rollout_scores(
                    part,
                    policy=policy,
                    reference=reference,
                    temperature=hp.temperature,
                    precision=self.precision,
                    micro_batch_size=hp.micro_batch_size,
                ),
            )
        )
        if policy:
            batch.old_logp = scores.pop(0)
        if reference:
            batch.ref_logp = scores.pop(0)
        (batch.values,) = scores

    def _token_rewards(self, batch: Batch) -> Tensor:
        """PPO's per-token rewards: the score on the last policy token, −β·KL on each (optionally whitened)."""
        assert isinstance(self.hp, PPOHyperparameters)
        pmask = batch.rollout.policy_mask.to(torch.float32)
        kl_tok = torch.zeros_like(pmask)
        if batch.ref_logp is not None:
            assert batch.old_logp is not None
            kl_tok = self.algo.kl(batch.old_logp, batch.ref_logp) * pmask
        rewards = ppo_token_rewards(batch.samples.rewards.to(pmask.device), kl_tok, pmask, beta=self.models.kl_ctl.coef)
        if self.hp.whiten_rewards:
            rewards = masked_whiten(rewards, pmask, shift_mean=False) * pmask
        batch.seq_kl = masked_sum(kl_tok, pmask, dim=-1)
        return rewards

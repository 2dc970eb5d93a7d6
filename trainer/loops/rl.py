"""The online RL loop (GRPO, Dr. GRPO, DAPO, RLOO, REINFORCE, PPO), read top to bottom in :meth:`RLTrainer.step`:

    collect     sample ``batch_size`` prompts × ``samples_per_prompt`` completions (``group_size`` scaled by OpenAI's
                ``compute_multiplier``) from the rollout engine, grade them,
                (dynamic sampling) drop all-equal groups and draw again until the batch is full
    score       behaviour and reference log-probs, the critic's V; the KL into the reward where the recipe puts it
    advantages  the recipe's estimator from the advantage registry (GAE over per-token rewards for a critic)
    optimise    μ passes over the batch in a fixed number of mini-batches, each one optimiser step accumulated over
                micro-batches against the mini-batch's totals (exactly the full mini-batch's loss)
    log         metrics, sampled rollouts; checkpoints come from ``trainer.loops.steps.run_steps``

The recipe row (``trainer.spec.recipes``) alone turns a method's parts on (dynamic sampling, overlong shaping, a
critic); the math lives in ``trainer.algorithms.core_algos``; the training state and the step's parts in
``trainer.loops.engine``; generation behind ``trainer.generation.rollout_engine.RolloutEngine``. What builds the run
(prompts, models, critic, sharding, engines) is ``trainer.loops.rl_run``; the phases collect, score and optimise are
``trainer.loops.rl_collect``, ``trainer.loops.rl_score`` and ``trainer.loops.rl_update``, and what they pass each other
``trainer.loops.rl_batch``. Whether the run is on one rank, several or a sharded base is ``rl_run.Shares``' business:
no phase branches on it. Masks:
``Rollout.completion_mask`` says which tokens exist (attention), ``Rollout.policy_mask`` which the policy produced: the
losses, KL, advantages and PPO's score read only those.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
from torch import Tensor

from trainer.algorithms.core_algos import AdvantageInputs, adaptive_kl_update, explained_variance, masked_mean
from trainer.generation.distributed import World
from trainer.generation.models import Precision, default_device, resolve_precision
from trainer.loops.agent import episode_metrics
from trainer.loops.engine import seed_everything
from trainer.loops.evaluate import (
    GraderMonitor,
    evaluate_engine,
    per_prompt,
    validation_generator,
    validation_params,
)
from trainer.loops.rl_batch import Advantages, Algorithm, Batch, Parts, UpdateForward, batch_metrics, rollout_records
from trainer.loops.rl_collect import Collector
from trainer.loops.rl_run import ModelBuilder, RolloutEngineFactory, Shares, check_world, prepare_prompts
from trainer.loops.rl_score import Scorer
from trainer.loops.rl_update import Updater
from trainer.loops.steps import EngineLoop, validation_due
from trainer.spec import graders
from trainer.spec import metrics as M
from trainer.spec.callbacks import Callback
from trainer.spec.config import JobSpec, PPOHyperparameters, RLHyperparameters
from trainer.spec.overoptimisation import OveroptimisationWatch
from trainer.spec.recipes import RECIPES, Recipe

__all__ = ["RLTrainer", "RolloutEngineFactory"]


class RLTrainer(EngineLoop):
    """The online RL loop: :meth:`step` is one training step, :meth:`run` the whole run."""

    def __init__(
        self,
        spec: JobSpec,
        *,
        output_dir: Path,
        callback: Callback,
        device: torch.device | None = None,
        recipe: Recipe | None = None,
        rollout_engine: RolloutEngineFactory | None = None,
        world: World | None = None,
    ):
        self.spec, self.out, self.cb = spec, output_dir, callback
        self.world = world or World()  # data parallel: this rank's place (trainer.generation.distributed)
        assert isinstance(spec.method.hyperparameters, RLHyperparameters)
        assert spec.method.grader is not None, "RL methods have a grader (config._parse_method)"
        self.hp: RLHyperparameters = spec.method.hyperparameters
        self.recipe = recipe or RECIPES[spec.method.recipe_name]  # reinforcement runs grpo's
        self.parts = Parts.of(self.recipe, self.hp)
        self.algo = Algorithm.of(self.recipe, self.hp)
        self.grader = spec.method.grader
        self.grader_monitor = GraderMonitor(callback, self.grader)  # grader/error_rate; fails a broken grader
        held_out = graders.held_out_keys(self.grader)
        self.overoptimisation = OveroptimisationWatch(held_out) if held_out else None
        self.last_step = 0  # the step validation_metrics reports for (0 before the first)
        # everything that can be wrong with the input is checked before any weight is loaded
        self.prompts = prepare_prompts(spec, self.hp, self.grader, callback)
        self.total_steps = self.hp.total_steps(len(self.prompts.train_items))
        check_world(self.world, self.hp, rollout_engine)
        device = device or self.world.device() or default_device()
        # the frozen base sharded across the ranks (FSDP2): every rank runs the model's passes in lockstep
        self.shares = Shares(self.world, lockstep=spec.shard_base and self.world.size > 1, device=device)
        self.precision: Precision = resolve_precision(self.hp.precision, device)
        seed_everything(spec.seed)
        self.models = ModelBuilder(
            spec,
            parts=self.parts,
            prompts=self.prompts,
            shares=self.shares,
            precision=self.precision,
            total_steps=self.total_steps,
            callback=callback,
        ).build(rollout_engine)
        self.engine = self.models.engine
        self._phases()

    def _phases(self) -> None:
        """The step's phases over the built run."""
        hp, models, shares = self.hp, self.models, self.shares
        self.collector = Collector(
            hp,
            parts=self.parts,
            prompts=self.prompts,
            models=models,
            shares=shares,
            grader=self.grader,
            grader_monitor=self.grader_monitor,
            callback=self.cb,
        )
        self.scorer = Scorer(
            hp, recipe=self.recipe, algo=self.algo, models=models, shares=shares, precision=self.precision
        )
        self.updater = Updater(
            hp,
            seed=self.spec.seed,
            recipe=self.recipe,
            algo=self.algo,
            models=models,
            shares=shares,
            precision=self.precision,
            policy_forward=self.scorer.policy_forward,
            sync_gradients=self.sync_gradients,
        )

    def has_validation_data(self) -> bool:
        return bool(self.prompts.val_items)

    # -- one step, top to bottom -----------------------------------------------------------------------------------

    def step(self, step: int) -> dict[str, float]:
        t0 = time.perf_counter()
        self.last_step = step
        lr, kl_coef = self.engine.learning_rate, self.models.kl_ctl.coef  # what this step trains with
        batch = self.collect()
        m: dict[str, float] = {}
        adv = Advantages(torch.zeros(0), None)
        if len(batch):
            first = self.score(batch)
            adv = self.advantages(batch)
            m |= adv.metrics | self.optimise(step, batch, adv, first=first)
        self.engine.lr_step()
        return self.log(step, batch, adv, m | self.batch_metrics(batch, lr=lr, kl_coef=kl_coef), started=t0)

    # -- collect ---------------------------------------------------------------------------------------------------

    def collect(self) -> Batch:
        """The step's batch: ``batch_size`` groups of graded completions (``trainer.loops.rl_collect``)."""
        return self.collector.collect()

    # -- score -----------------------------------------------------------------------------------------------------

    def score(self, batch: Batch) -> UpdateForward | None:
        """The log-probs and values the update needs (``trainer.loops.rl_score``); the update's first forward when
        it scored the batch."""
        return self.scorer.score(batch)

    # -- advantages ------------------------------------------------------------------------------------------------

    def advantages(self, batch: Batch) -> Advantages:
        """The recipe's estimator: per sequence from the (group's) rewards, or GAE per token for a critic."""
        out = self.algo.advantage(
            AdvantageInputs(
                rewards=batch.samples.rewards,
                group_size=self.hp.samples_per_prompt,
                mask=batch.rollout.policy_mask,
                token_rewards=batch.token_rewards,
                values=batch.values,
            ),
            self.algo.adv_opts,
        )
        if self.models.critic is None:
            return Advantages(out.advantages.to(self.shares.device), None)
        assert batch.values is not None and out.returns is not None
        return Advantages(out.advantages, out.returns, self._critic_metrics(batch, out.returns))

    def _critic_metrics(self, batch: Batch, returns: Tensor) -> dict[str, float]:
        """V, returns and explained variance; then the adaptive KL controller's update."""
        assert isinstance(self.hp, PPOHyperparameters) and batch.values is not None and batch.seq_kl is not None
        pmask = batch.rollout.policy_mask.to(torch.float32)
        seq_kl = batch.seq_kl
        m = {
            M.VALUE_MEAN: float(masked_mean(batch.values, pmask)),
            M.RETURNS_MEAN: float(masked_mean(returns, pmask)),
            M.EXPLAINED_VARIANCE: explained_variance(batch.values, returns, pmask),
            M.NON_SCORE_REWARD: float((-self.models.kl_ctl.coef * seq_kl).mean()),
        }
        if self.hp.target_kl is not None and batch.ref_logp is not None:
            # Ziegler et al. 2019: the error is measured on the sequence KL, one update per sample of the batch
            self.models.kl_ctl.coef = adaptive_kl_update(
                self.models.kl_ctl.coef,
                observed_kl=float(seq_kl.mean()),
                target=self.hp.target_kl,
                horizon=self.hp.kl_horizon,
                n_steps=len(batch),
            )
        return m

    # -- optimise --------------------------------------------------------------------------------------------------

    def optimise(
        self, step: int, batch: Batch, adv: Advantages, *, first: UpdateForward | None = None
    ) -> dict[str, float]:
        """μ passes over the batch in mini-batches, each one optimiser step (``trainer.loops.rl_update``)."""
        return self.updater.optimise(step, batch, adv, first=first)

    # -- log -------------------------------------------------------------------------------------------------------

    def batch_metrics(self, batch: Batch, *, lr: float, kl_coef: float) -> dict[str, float]:
        """Rewards, lengths and sampling statistics of the step's batch, with what it trained with."""
        return batch_metrics(
            batch,
            group_size=self.hp.samples_per_prompt,
            dynamic_sampling=self.recipe.dynamic_sampling,
            beta=self.hp.beta,
            lr=lr,
            kl_coef=kl_coef,
            reward_clip=self.hp.reward_clip,
        )

    def log(self, step: int, batch: Batch, adv: Advantages, m: dict[str, float], *, started: float) -> dict[str, float]:
        """The step's metrics (with validation when due) reported, its sampled rollouts logged; returns the metrics
        as reported (rank 0's, on every rank)."""
        if self.prompts.val_items and validation_due(
            step, interval=self.hp.eval_every(self.total_steps), total_steps=self.total_steps
        ):
            m |= self.validation_metrics()
        m |= self.grader_monitor.metrics()
        m[M.STEP_SECONDS] = time.perf_counter() - started
        m = self.report(step, m)  # rank 0's (its validation): every rank decides alike (best, early stopping)
        if self.hp.rollouts_logged and len(batch):
            self.cb.on_rollouts(step, rollout_records(batch, adv.per_row, self.hp.rollouts_logged))
        self.grader_monitor.end_step(step)  # after the step is recorded: GraderFailed when the grader is broken
        return m

    def validation_metrics(self) -> dict[str, float]:
        """Mean reward of ``eval_samples`` completions per validation prompt (default one, greedy), and per named
        sub-grader; rank 0's, on every rank (a sharded base's: every rank's block of the prompts, in lockstep)."""
        return self.shares.validation(self._validation_metrics)

    def _validation_metrics(self) -> dict[str, float]:
        models, hp = self.models, self.hp
        models.rollout_engine.push_weights(models.model, self.engine.weights_version)
        k = hp.eval_samples_per_prompt
        params = validation_params(hp.max_completion_tokens, samples=k, temperature=hp.temperature, top_p=hp.top_p)
        ids, items = per_prompt(self.prompts.val_ids, k), per_prompt(self.prompts.val_items, k)  # [P·k]
        out: dict[str, float] = {}
        generator = validation_generator(
            self.engine.generator.device, seed=self.spec.seed, step=self.last_step, samples=k
        )
        if models.agent is not None:
            res, episodes = models.agent.evaluate(ids, items, self.grader, params, generator=generator)
            out[M.VAL_EPISODE_TOOL_CALL_RATE] = episode_metrics(episodes).get(M.EPISODE_TOOL_CALL_RATE, 0.0)
        else:  # a sharded base's ranks each evaluate their block of the prompts, in lockstep
            res = evaluate_engine(
                models.rollout_engine,
                self.prompts.tokenizer,
                ids,
                items,
                self.grader,
                params,
                generator=generator,
                world=self.shares.evaluating_world,
            )
        out[M.VAL_REWARD_MEAN] = res.mean_reward
        for name, v in res.sub_means.items():
            out[M.reward_of(name, validation=True)] = v
        if self.overoptimisation is not None:
            out[M.VAL_OVEROPTIMISATION], warning = self.overoptimisation.observe(self.last_step, out)
            if warning is not None:
                self.cb.on_event("warn", warning, {"step": self.last_step, "metric": M.VAL_OVEROPTIMISATION})
        return out

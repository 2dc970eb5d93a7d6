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
``trainer.loops.engine``; generation behind ``trainer.generation.rollout_engine.RolloutEngine``. Masks:
``Rollout.completion_mask`` says which tokens exist (attention), ``Rollout.policy_mask`` which the policy produced: the
losses, KL, advantages and PPO's score read only those.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import torch
from peft import PeftModel
from torch import Tensor
from transformers import PreTrainedTokenizerBase

from trainer.agents.episodes import Episode
from trainer.algorithms.core_algos import (
    ADVANTAGE_ESTIMATORS,
    AGGREGATIONS,
    KL_ESTIMATORS,
    POLICY_LOSSES,
    ZERO_STD,
    AdvantageInputs,
    AdvantageOptions,
    ClipOptions,
    LossScale,
    adaptive_kl_update,
    explained_variance,
    masked_mean,
    masked_sum,
    masked_whiten,
    overlong_penalty,
    ppo_token_rewards,
    value_loss_clipped,
)
from trainer.generation.distributed import World, gathered, shard_frozen_base
from trainer.generation.encoding import PromptSampler, PromptTooLongError, encode_prompts, thinking_kwargs
from trainer.generation.models import Precision, default_device, load_tokenizer, resolve_precision, trainable_parameters
from trainer.generation.rollout import Rollout, micro_slices
from trainer.generation.rollout_engine import (
    Generation,
    HFRolloutEngine,
    RolloutEngine,
    SamplingParams,
    decode_mode,
    use_compile_cache,
)
from trainer.grading import graders
from trainer.grading.url_policy import UrlRefused
from trainer.loops.agent import AgentRollouts, episode_metrics
from trainer.loops.critic import build_critic
from trainer.loops.engine import Engine, ParamGroup, check_context, load_policy, seed_everything
from trainer.loops.evaluate import (
    GraderMonitor,
    Scores,
    decode_completions,
    evaluate_engine,
    finish_reasons,
    grade_batch,
    remote_config,
)
from trainer.loops.rl_batch import (
    SUMMED_ACROSS_RANKS,
    Advantages,
    Batch,
    DrawStats,
    KLController,
    Parts,
    Samples,
    Sums,
    UpdateForward,
    batch_metrics,
    rollout_records,
)
from trainer.loops.steps import EngineLoop, validation_due
from trainer.spec import metrics as M
from trainer.spec.callbacks import Callback
from trainer.spec.config import JobSpec, PPOHyperparameters, RLHyperparameters, SpecError
from trainer.spec.data import DatasetError, PromptItem, load_prompts, offered_functions
from trainer.spec.overoptimisation import OveroptimisationWatch
from trainer.spec.recipes import RECIPES, Recipe

RolloutEngineFactory = Callable[[PeftModel, PreTrainedTokenizerBase], RolloutEngine]


# -- the loop --------------------------------------------------------------------------------------------------------


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
        self.recipe = recipe or RECIPES[spec.method.type]
        self.parts = Parts.of(self.recipe, self.hp)
        self.grader = spec.method.grader
        self.grader_monitor = GraderMonitor(callback, self.grader)  # grader/error_rate; fails a broken grader
        held_out = graders.held_out_keys(self.grader)
        self.overoptimisation = OveroptimisationWatch(held_out) if held_out else None
        self.last_step = 0  # the step validation_metrics reports for (0 before the first)
        self._load_data()  # everything that can be wrong with the input is checked before any weight is loaded
        self._check_world(rollout_engine)
        # the frozen base sharded across the ranks (FSDP2): every rank runs the model's passes in lockstep
        self.sharded = spec.shard_base and self.world.size > 1
        self.device = device or self.world.device() or default_device()
        self.precision: Precision = resolve_precision(self.hp.precision, self.device)
        seed_everything(spec.seed)
        self._load_models(rollout_engine)
        hp = self.hp
        self.advantage = ADVANTAGE_ESTIMATORS.get(self.recipe.advantage)
        self.policy_loss = POLICY_LOSSES.get(self.recipe.policy_loss)
        self.aggregate = AGGREGATIONS.get(hp.loss_aggregation)
        self.kl = KL_ESTIMATORS.get(hp.kl_estimator)
        self.adv_opts = AdvantageOptions(
            scale=getattr(hp, "scale_rewards", "group"),
            std_eps=getattr(hp, "std_eps", 1e-4),
            baseline=getattr(hp, "baseline", "batch_mean"),
            gamma=getattr(hp, "gamma", 1.0),
            lam=getattr(hp, "lam", 1.0),
            whiten=getattr(hp, "whiten_advantages", False),
        )
        self.clip = ClipOptions(hp.epsilon_low, hp.epsilon_high, hp.dual_clip)
        # With one pass over one mini-batch the policy that sampled is the policy being updated: old = logp.detach()
        # makes ρ ≡ 1 exactly (as TRL does) instead of relying on two forward passes agreeing bit for bit.
        self.on_policy = hp.iterations_per_batch == 1 and hp.mini_batches == 1
        # The update's first forward gives the old log-probs where it can (:meth:`_old_from_update`); off: the
        # policy's scoring pass runs apart, before the update (what tests compare against)
        self.old_from_update = True
        self.sampling = SamplingParams(hp.max_completion_tokens, hp.temperature, hp.top_p, hp.min_completion_tokens)

    def _load_data(self) -> None:
        """The prompts, tokenised and checked against the model's context: the input's errors, before any weight."""
        spec, hp = self.spec, self.hp
        self.train_items = load_prompts(Path(spec.training_file), grader=self.grader, agent=spec.method.agent)
        self.val_items = (
            load_prompts(Path(spec.validation_file), grader=self.grader, agent=spec.method.agent)
            if spec.validation_file
            else []
        )
        self._check_tool_urls()
        self.tokenizer = load_tokenizer(spec.model)
        thinking = thinking_kwargs(self.tokenizer, hp.reasoning_effort)
        if thinking is None and hp.reasoning_effort != "default":
            self.cb.on_event(
                "info",
                f"reasoning_effort {hp.reasoning_effort!r} has no effect: the chat template of {spec.model} has no "
                "thinking mode",
            )
        self.template_kwargs = thinking or {}
        self.train_ids = self._encode(self.train_items, spec.training_file)
        self.val_ids = self._encode(self.val_items, spec.validation_file or "")
        longest = max(len(p) for p in self.train_ids + self.val_ids)
        check_context(
            spec.model,
            needed=longest + hp.max_completion_tokens,
            what=f"the longest prompt ({longest} tokens) plus max_completion_tokens ({hp.max_completion_tokens})",
            param=f"method.{spec.method.type}.hyperparameters.max_completion_tokens",
        )
        if hp.eval_samples:
            self.val_ids, self.val_items = self.val_ids[: hp.eval_samples], self.val_items[: hp.eval_samples]
        self.total_steps = hp.total_steps(len(self.train_items))

    def _load_models(self, rollout_engine: RolloutEngineFactory | None) -> None:
        """Policy (base + LoRA), rollout engine, critic and the training engine, in this order (the RNG's)."""
        spec, hp = self.spec, self.hp
        # bf16: sample from a merged bf16 copy (half the weights' memory again, about half the generation time);
        # fp32: the copy would double the weights for a small gain, so the policy samples itself.
        # A sharded base is loaded on the host and each rank moves its shard to its device; it has no sampler copy
        # (a whole base per rank is what sharding avoids) and decodes uncompiled (FSDP's hooks run in every forward).
        policy = load_policy(
            spec.model,
            spec.method.lora,
            device=torch.device("cpu") if self.sharded else self.device,
            precision=self.precision,
            seed=spec.seed,
            sampler_copy=self.precision == "bf16" and rollout_engine is None and not self.sharded,
            weights=not self.sharded or self.world.main,  # sharded: rank 0 reads the weights, the others get shards
        )
        self.model = policy.model
        self.params = trainable_parameters(self.model)  # the policy's LoRA weights (before a critic's adapter joins)
        if self.sharded:  # the critic's adapter first: FSDP leaves the weights trainable at sharding time whole
            self._build_critic()
            self._shard()
        decode = (
            "dynamic"
            if self.sharded
            else decode_mode(
                hp.compile_decode,
                device=self.device,
                bf16_sampler=policy.base_copy is not None,
                decode_steps=self.total_steps * hp.max_completion_tokens,
            )
        )
        if decode == "compiled":
            use_compile_cache()
        self.rollout_engine: RolloutEngine = (
            rollout_engine(self.model, self.tokenizer)
            if rollout_engine is not None
            else HFRolloutEngine(
                self.model,
                eos_id=self.tokenizer.eos_token_id,
                pad_id=self.tokenizer.pad_token_id,
                device=self.device,
                precision=self.precision,
                base_copy=policy.base_copy,
                decode=decode,
                lockstep=self.world.any if self.sharded else None,
                whole_weights=(lambda: gathered(self.model)) if self.sharded and spec.gather_for_generation else None,
            )
        )
        self.compile_s_reported, self.compile_failure_reported = 0.0, False
        agent = spec.method.agent
        self.agent = (
            AgentRollouts(
                agent,
                self.rollout_engine,
                self.tokenizer,
                max_tokens=hp.max_completion_tokens,
                template_kwargs=self.template_kwargs,
                remote=remote_config(),
                ranks_on_host=self.world.size,  # the launcher's ranks share this machine (and its sandbox uids)
            )
            if agent is not None
            else None
        )
        if not self.sharded:
            self._build_critic()
        self._build_engine()

    def _shard(self) -> None:
        """Shard the frozen base across the ranks (``trainer.generation.distributed.shard_frozen_base``), said in an
        event. The LoRA weights (the policy's and a critic adapter's) stay whole (a critic's head is on the device
        already)."""
        policy = {id(p) for p in self.params}
        names = [n for n, p in self.model.named_parameters() if id(p) in policy]
        sharding = shard_frozen_base(self.model, self.world, self.device)
        # a rank that loaded no weights has new parameter objects now (allocated off the meta device)
        named = dict(self.model.named_parameters())
        self.params = [named[n] for n in names]
        if self.critic is not None:
            self.critic.fuses = False  # the joined passes (CUDA) are untried on a sharded base: they stay apart
            self.critic_params = self.critic.parameters()
        # The ranks that loaded no weights drew no random numbers for LoRA's initial weights: rank 0's generator state
        # on every rank, as if each had loaded the whole base
        torch.set_rng_state(self.world.broadcast(torch.get_rng_state()))
        self.cb.on_event(
            "info",
            f"the base's frozen weights are sharded across {self.world.size} devices: {sharding.held:,} of "
            f"{sharding.total:,} on each, {sharding.layers} decoder layers gathered one at a time",
            {
                "ranks": self.world.size,
                "held": sharding.held,
                "total": sharding.total,
                "layers": sharding.layers,
                "loaded_by_rank0_only": sharding.from_rank0,
            },
        )

    def _build_critic(self) -> None:
        """PPO's critic where the recipe has one."""
        spec, hp = self.spec, self.hp
        self.critic = (
            build_critic(
                self.model,
                hp,
                lora=spec.method.lora,
                vocabulary=len(self.tokenizer),
                seed=spec.seed,
                device=self.device,
                precision=self.precision,
                where=f"method.{spec.method.type}.hyperparameters",
            )
            if self.parts.critic and isinstance(hp, PPOHyperparameters)
            else None
        )
        self.trunk = self.critic is not None and self.critic.trunk  # V from the policy's own forwards
        self.critic_params = self.critic.parameters() if self.critic is not None else []

    def _build_engine(self) -> None:
        """The training engine over the policy's (and the critic's) weights."""
        spec, hp = self.spec, self.hp
        groups = [ParamGroup(self.params, hp.effective_learning_rate)]
        if self.critic is not None:
            assert isinstance(hp, PPOHyperparameters)
            value_lr = hp.value_learning_rate or hp.learning_rate
            groups.append(ParamGroup(self.critic_params, value_lr * hp.learning_rate_multiplier))
        self.engine = Engine(
            self.model,
            groups=groups,
            hp=hp,
            total_steps=self.total_steps,
            device=self.device,
            precision=self.precision,
            data_order=PromptSampler(len(self.train_items), seed=spec.seed),
            seed=spec.seed,
            dropout=spec.method.lora.dropout > 0,
            trim_memory=True,
        )
        self.engine.share_prompts = not self.sharded
        self.kl_ctl = KLController(hp.beta)  # PPO's adaptive controller moves it; saved with every checkpoint
        self.engine.extra["kl_coef"] = self.kl_ctl
        if self.critic is not None:
            self.engine.extra["critic"] = self.critic

    def _check_world(self, rollout_engine: RolloutEngineFactory | None) -> None:
        """What data parallel training over several ranks supports, refused before any weight is loaded."""
        if self.world.size == 1:
            return
        if rollout_engine is not None:
            raise SpecError("data parallel training samples with the built-in engine only", param="resources.gpus")
        if self.hp.batch_size < self.world.size:
            raise SpecError(
                f"batch_size ({self.hp.batch_size}) must be at least resources.gpus ({self.world.size}): each device "
                "samples whole groups",
                param="resources.gpus",
            )

    def _check_tool_urls(self) -> None:
        """Each tool server's URL against this process's policy (scheme, and an address given as the host): a
        ``SpecError`` naming the tool before any weight is loaded, rather than every call of the run refused. Names
        are resolved (and checked again) at every call: DNS may answer differently later."""
        agent = self.spec.method.agent
        if agent is None:
            return
        policy = remote_config().url_policy
        for i, tool in enumerate(agent.tools):
            if tool.server_url is None:
                continue
            try:
                policy.check_url(tool.server_url)
            except UrlRefused as err:
                raise SpecError(str(err), param=f"method.{self.spec.method.type}.tools.{i}.server_url") from None

    def _encode(self, items: list[PromptItem], path: str) -> list[list[int]]:
        try:
            return encode_prompts(
                self.tokenizer,
                items,
                max_prompt_tokens=self.hp.max_prompt_tokens,
                template_kwargs=self.template_kwargs,
                tools=offered_functions(items, self.spec.method.agent),
            )
        except PromptTooLongError as err:
            raise DatasetError(str(err), line=err.item.line, path=path) from None

    def has_validation_data(self) -> bool:
        return bool(self.val_items)

    # -- one step, top to bottom -----------------------------------------------------------------------------------

    def step(self, step: int) -> dict[str, float]:
        t0 = time.perf_counter()
        self.last_step = step
        lr, kl_coef = self.engine.learning_rate, self.kl_ctl.coef  # what this step trains with
        batch = self.collect()
        m: dict[str, float] = {}
        adv = Advantages(torch.zeros(0), None)
        if len(batch):
            first = self.score(batch)
            adv = self.advantages(batch)
            m |= adv.metrics | self.optimise(step, batch, adv, first=first)
        self.engine.lr_step()
        m |= batch_metrics(
            batch,
            group_size=self.hp.samples_per_prompt,
            dynamic_sampling=self.recipe.dynamic_sampling,
            beta=self.hp.beta,
            lr=lr,
            kl_coef=kl_coef,
            reward_clip=self.hp.reward_clip,
        )
        if self.val_items and validation_due(step, interval=self.hp.eval_interval, total_steps=self.total_steps):
            m |= self.validation_metrics()
        m |= self.grader_monitor.metrics()
        m[M.STEP_SECONDS] = time.perf_counter() - t0
        m = self.report(step, m)  # rank 0's (its validation): every rank decides alike (best, early stopping)
        if self.hp.rollouts_logged and len(batch):
            self.cb.on_rollouts(step, rollout_records(batch, adv.per_row, self.hp.rollouts_logged))
        self.grader_monitor.end_step(step)  # after the step is recorded: GraderFailed when the grader is broken
        return m

    # -- collect ---------------------------------------------------------------------------------------------------

    def draw(self) -> tuple[Samples, float]:
        """``batch_size`` prompts × ``samples_per_prompt`` completions from the rollout engine, graded (and shaped),
        and the generation's seconds."""
        hp = self.hp
        idx = self.engine.next_indices(hp.batch_size)
        g = hp.samples_per_prompt
        prompts = [self.train_ids[i] for i in idx for _ in range(g)]  # rows of a group adjacent
        items = [self.train_items[i] for i in idx for _ in range(g)]
        self.rollout_engine.push_weights(self.model, self.engine.weights_version)
        if self.world.launched:  # this rank's block of whole groups, each row from its own seed
            return self._draw_block(prompts, items)
        gen, rollout, texts, scores, episodes = self._sample(prompts, items, generator=self.engine.generator)
        self.grader_monitor.observe(scores)
        return self._shape(rollout, items, texts, scores, gen.logprobs, episodes), gen.seconds

    def _draw_block(self, prompts: list[list[int]], items: list[PromptItem]) -> tuple[Samples, float]:
        """A launched run's draw: this rank samples and grades its block of whole groups, row i from the seed
        ``base + i`` (``base`` drawn alike on every rank; an agent job's episodes too, each turn from the row's own
        seed), and every rank gathers every block, in rank order: the same batch as one rank alone would sample, on
        every rank (``trainer.generation.distributed``)."""
        g = self.hp.samples_per_prompt
        gen_device = self.engine.generator.device
        base = int(torch.randint(0, 2**62, (1,), generator=self.engine.generator, device=gen_device))
        lo, hi = (g * x for x in self.world.block(len(prompts) // g))
        seeds = [base + i for i in range(lo, hi)]
        gen, rollout, texts, scores, episodes = self._sample(prompts[lo:hi], items[lo:hi], row_seeds=seeds)
        logp = gen.logprobs.cpu() if gen.logprobs is not None else None
        blocks = self.world.gather((self._shape(rollout, items[lo:hi], texts, scores, logp, episodes), scores))
        for _, block_scores in blocks:
            self.grader_monitor.observe(block_scores)
        samples = Samples.concat([b for b, _ in blocks], self.tokenizer.pad_token_id)
        if samples.sampling_logp is not None:
            samples.sampling_logp = samples.sampling_logp.to(self.device)
        return samples, gen.seconds

    def _sample(
        self,
        prompts: list[list[int]],
        items: list[PromptItem],
        *,
        generator: torch.Generator | None = None,
        row_seeds: list[int] | None = None,
    ) -> tuple[Generation, Rollout, list[str], Scores, list[Episode] | None]:
        """One completion per prompt (an agent job: one multi-turn episode, tool output in the rows outside the
        policy mask), graded: the generation, its rows on the CPU, their texts, scores and episodes. From
        ``generator``, or with ``row_seeds`` each row from its own seed (the built-in engine)."""
        if self.agent is not None:
            batch = self.agent.run(prompts, items, self.sampling, generator=generator, row_seeds=row_seeds)
            rollout = batch.generation.rollout.to("cpu")
            return batch.generation, rollout, batch.texts, batch.grade(self.grader, items), batch.episodes
        if row_seeds is None:
            gen = self.rollout_engine.generate(prompts, self.sampling, generator=generator)
        else:
            assert isinstance(self.rollout_engine, HFRolloutEngine)
            gen = self.rollout_engine.generate(prompts, self.sampling, generator=None, row_seeds=row_seeds)
        rollout = gen.rollout.to("cpu")
        texts = decode_completions(self.tokenizer, rollout)
        return gen, rollout, texts, grade_batch(self.grader, texts, items, finish_reasons(rollout)), None

    def _shape(
        self,
        rollout: Rollout,
        items: list[PromptItem],
        texts: list[str],
        scores: Scores,
        sampling_logp: Tensor | None,
        episodes: list[Episode] | None,
    ) -> Samples:
        """The graded rows with their shaped reward (clipped; the overlong penalty where the recipe has it)."""
        hp = self.hp
        shaped = scores.rewards.clone()
        if hp.reward_clip is not None:
            shaped = shaped.clamp(-hp.reward_clip, hp.reward_clip)
        if self.parts.overlong is not None:
            buffer, factor = self.parts.overlong
            shaped += overlong_penalty(
                rollout.lengths, max_tokens=hp.max_completion_tokens, buffer=buffer, factor=factor
            )
        return Samples(rollout, items, texts, shaped, scores.rewards, scores.sub, sampling_logp, episodes)

    def collect(self) -> Batch:
        """Draw until the batch holds ``batch_size`` groups; with dynamic sampling, groups whose rewards are all equal
        (no signal) are dropped and drawn again, at most ``max_sampling_batches`` times."""
        hp, g = self.hp, self.hp.samples_per_prompt
        max_draws = self.parts.dynamic_sampling_batches or 1
        dynamic = self.parts.dynamic_sampling_batches is not None
        kept: list[Samples] = []
        n_kept = 0
        draws = DrawStats()
        while draws.sampling_batches < max_draws and n_kept < hp.batch_size:
            s, seconds = self.draw()
            draws.sampling_batches += 1
            draws.generation_s += seconds
            std = s.rewards.view(-1, g).std(dim=1) if g > 1 else torch.ones(len(s.rewards) // g)
            flat = (std < ZERO_STD).tolist()
            draws.groups_sampled += len(flat)
            draws.groups_zero_std += sum(flat)
            keep = [i for i, z in enumerate(flat) if not (dynamic and z)][: hp.batch_size - n_kept]
            if keep:
                kept.append(s.select([i * g + j for i in keep for j in range(g)]))
                n_kept += len(keep)
        if dynamic and n_kept < hp.batch_size:
            self.cb.on_event(
                "warn",
                f"dynamic sampling filled {n_kept} of {hp.batch_size} groups after "
                f"{draws.sampling_batches} rollout batches (max_sampling_batches)",
            )
        self._report_compile()
        samples = Samples.concat(kept or [s.select([])], self.tokenizer.pad_token_id)
        samples.rollout = samples.rollout.to(self.device)
        mask = samples.rollout.policy_mask.to(torch.float32)
        if hp.mask_truncated_completions:
            mask = mask * (~samples.rollout.truncated).unsqueeze(-1).float()
        return Batch(samples, draws, loss_mask=mask)

    def _report_compile(self) -> None:
        """An event when the engine compiled its decode step (once per process and shape: the step's time has it),
        and a warning, once, when it could not (the job goes on decoding uncompiled)."""
        error = getattr(self.rollout_engine, "compile_error", None)
        if error is not None and not self.compile_failure_reported:
            self.cb.on_event("warn", f"the decode step could not be compiled; decoding uncompiled: {error}")
            self.compile_failure_reported = True
        total = float(getattr(self.rollout_engine, "compile_s", 0.0))
        if total > self.compile_s_reported:
            self.cb.on_event(
                "info",
                f"compiled the decode step in {total - self.compile_s_reported:.1f} s (once per process and shape; "
                "later steps reuse it)",
                {"compile_s": round(total - self.compile_s_reported, 3)},
            )
            self.compile_s_reported = total

    # -- score -----------------------------------------------------------------------------------------------------

    def score(self, batch: Batch) -> UpdateForward | None:
        """The log-probs and values the update needs; the KL into the reward where the recipe puts it. Where the
        update's first forward can score the rollout (:meth:`_old_from_update`) that forward runs here, with its
        graph, and is returned for :meth:`optimise`: the old log-probs (and a trunk's V_old) are its, detached."""
        hp, ro = self.hp, batch.rollout
        pmask = ro.policy_mask
        kl_in_reward = self.recipe.kl_placement == "reward" and hp.beta > 0
        critic, mbs = self.critic, hp.micro_batch_size
        needs_old = not self.on_policy or kl_in_reward
        sampling_logp = batch.samples.sampling_logp if self.rollout_engine.exact_logprobs else None
        if needs_old and sampling_logp is not None and not self.trunk:
            batch.old_logp = sampling_logp.to(self.device) * pmask  # exact: no policy pass
        deferred = needs_old and batch.old_logp is None and self._old_from_update(batch)
        first = None
        if critic is not None and critic.fuses:  # policy, reference and critic in one pass over the shared base
            policy_pass = needs_old and batch.old_logp is None and not deferred
            self._score_fused(batch, policy=policy_pass, reference=hp.beta > 0)
            if deferred:
                first = self._first_forward(batch)
            batch.token_rewards = self._token_rewards(batch)
            return first
        # The reference's and an adapter critic's passes first: where the update's first forward follows, their
        # activations are gone when its graph is built.
        if hp.beta > 0:
            (batch.ref_logp,) = self._by_rank(
                ro,
                lambda part: (
                    self.engine.logprobs(part, temperature=hp.temperature, micro_batch_size=mbs, reference=True),
                ),
            )
        if critic is not None and not self.trunk:
            (batch.values,) = self._by_rank(
                ro, lambda part: (critic.rollout_values(part, precision=self.precision, micro_batch_size=mbs),)
            )
        if deferred:
            first = self._first_forward(batch)
            if critic is not None and self.trunk:
                assert first.values is not None
                batch.values = first.values.detach()
        elif critic is not None and self.trunk:  # the policy's pass yields V_old too: no critic pass
            batch.old_logp, batch.values = self._by_rank(
                ro,
                lambda part: critic.rollout_logprobs_and_values(
                    part, temperature=hp.temperature, precision=self.precision, micro_batch_size=mbs
                ),
            )
        elif needs_old and batch.old_logp is None:
            (batch.old_logp,) = self._by_rank(
                ro, lambda part: (self.engine.logprobs(part, temperature=hp.temperature, micro_batch_size=mbs),)
            )
        if critic is not None:
            batch.token_rewards = self._token_rewards(batch)
        elif kl_in_reward:  # RLOO, REINFORCE: −β·Σ_t KL_t joins the sequence's reward
            assert batch.old_logp is not None and batch.ref_logp is not None
            seq_kl = masked_sum(self.kl(batch.old_logp, batch.ref_logp), pmask, dim=-1)
            batch.samples.rewards = batch.samples.rewards - hp.beta * seq_kl.cpu()
        return first

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
            and self.world.size == 1
            and (mbs is None or mbs >= len(batch))
            and not self.engine.dropout
        )

    def _first_forward(self, batch: Batch) -> UpdateForward:
        """The update's first forward over the whole batch, with its graph; the old log-probs are its, detached."""
        first = self._policy_forward(batch.rollout, with_entropy=True)
        batch.old_logp = first.logp.detach()
        return first

    def _policy_forward(self, part: Rollout, *, with_entropy: bool) -> UpdateForward:
        """The update's forward of ``part``: the policy's log-probs with the graph, the entropy when asked, and V
        with the graph where it comes with the policy's forward (a fused critic's pass, a trunk's head)."""
        hp, critic = self.hp, self.critic
        if critic is not None and critic.fuses:  # the policy's and the critic's forward as one
            logp, ent, v = self.engine.run_forward(
                critic.forward_with_policy,
                part,
                temperature=hp.temperature,
                precision=self.precision,
                with_entropy=with_entropy,
            )
            return UpdateForward(logp, ent, v)
        logp, ent, hidden = self.engine.forward(
            part, temperature=hp.temperature, with_entropy=with_entropy, with_hidden=self.trunk
        )
        if hidden is not None:  # the policy's trunk: its V joins the policy's loss (TRL's shared model)
            assert critic is not None
            return UpdateForward(logp, ent, critic.head_values(hidden))
        return UpdateForward(logp, ent, None)

    def _score_fused(self, batch: Batch, *, policy: bool, reference: bool) -> None:
        """The old (``policy``) and reference (``reference``) log-probs and V_old of an adapter critic: one pass."""
        assert self.critic is not None
        critic, hp = self.critic, self.hp
        scores = list(
            self._by_rank(
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

    def _by_rank(self, ro: Rollout, fn: Callable[[Rollout], tuple[Tensor, ...]]) -> tuple[Tensor, ...]:
        """``fn``'s per-row results [N, …] over the batch: on several ranks each computes its block of rows and
        the blocks are gathered (every rank gets them all)."""
        if self.world.size == 1:
            return fn(ro)
        lo, hi = self.world.block(len(ro))
        idx = torch.arange(lo, hi)
        if self.sharded:  # lockstep: every rank runs the largest share's passes (padded with copies of row 0)
            idx = torch.cat([idx, idx.new_zeros(self._largest_share(len(ro)) - (hi - lo))])
        mine = tuple(t[: hi - lo] for t in fn(ro.select(idx.to(ro.prompt_ids.device))))
        blocks = self.world.gather(tuple(t.cpu() for t in mine))
        return tuple(torch.cat([b[i] for b in blocks]).to(self.device) for i in range(len(mine)))

    def _largest_share(self, n: int) -> int:
        """The rows of the largest rank's share of ``n`` (at least one: a rank with none runs a padding row)."""
        return max(1, -(-n // self.world.size))

    def _token_rewards(self, batch: Batch) -> Tensor:
        """PPO's per-token rewards: the score on the last policy token, −β·KL on each (optionally whitened)."""
        assert isinstance(self.hp, PPOHyperparameters)
        pmask = batch.rollout.policy_mask.to(torch.float32)
        kl_tok = torch.zeros_like(pmask)
        if batch.ref_logp is not None:
            assert batch.old_logp is not None
            kl_tok = self.kl(batch.old_logp, batch.ref_logp) * pmask
        rewards = ppo_token_rewards(batch.samples.rewards.to(pmask.device), kl_tok, pmask, beta=self.kl_ctl.coef)
        if self.hp.whiten_rewards:
            rewards = masked_whiten(rewards, pmask, shift_mean=False) * pmask
        batch.seq_kl = masked_sum(kl_tok, pmask, dim=-1)
        return rewards

    # -- advantages ------------------------------------------------------------------------------------------------

    def advantages(self, batch: Batch) -> Advantages:
        """The recipe's estimator: per sequence from the (group's) rewards, or GAE per token for a critic."""
        out = self.advantage(
            AdvantageInputs(
                rewards=batch.samples.rewards,
                group_size=self.hp.samples_per_prompt,
                mask=batch.rollout.policy_mask,
                token_rewards=batch.token_rewards,
                values=batch.values,
            ),
            self.adv_opts,
        )
        if self.critic is None:
            return Advantages(out.advantages.to(self.device), None)
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
            M.NON_SCORE_REWARD: float((-self.kl_ctl.coef * seq_kl).mean()),
        }
        if self.hp.target_kl is not None and batch.ref_logp is not None:
            # Ziegler et al. 2019: the error is measured on the sequence KL, one update per sample of the batch
            self.kl_ctl.coef = adaptive_kl_update(
                self.kl_ctl.coef,
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
        """μ passes over the batch, each in ``mini_batches`` mini-batches (a fixed count: a short batch after dynamic
        sampling gives smaller mini-batches, and a batch of fewer rows than mini-batches one row each); each
        mini-batch is one optimiser step over micro-batches normalised by the mini-batch's totals. ``first``: the
        first pass's forward of the whole batch (one mini-batch, one micro-batch), already run by :meth:`score`."""
        hp, n = self.hp, len(batch)
        order = torch.Generator().manual_seed(self.spec.seed * 1_000_003 + step)  # derived: nothing to save
        sums = Sums()
        t0 = time.perf_counter()
        for it in range(hp.iterations_per_batch):
            perm = torch.randperm(n, generator=order) if hp.mini_batches > 1 else torch.arange(n)
            for mb in torch.tensor_split(perm, min(hp.mini_batches, n)):
                scale = LossScale(float(batch.loss_mask[mb].sum()), len(mb), hp.max_completion_tokens)
                self.engine.zero_grad()
                lo, hi = self.world.block(len(mb))  # this rank's share, against the whole mini-batch's totals
                mine = mb[lo:hi]
                if self.sharded:  # lockstep: padding rows (index -1) train nothing but run the passes
                    mine = torch.cat([mine, mine.new_full((self._largest_share(len(mb)) - len(mine),), -1)])
                for sl in micro_slices(len(mine), hp.micro_batch_size):
                    passes = first if it == 0 else None
                    sums.add(self._micro_batch(batch, adv, mine[sl], scale, first_pass=it == 0, passes=passes))
                self.sync_gradients()
                norms = self.engine.optim_step()
                sums.grad_norm += norms[0]
                sums.optimizer_steps += 1
        if self.world.size > 1:  # each rank summed its share: the step's sums are the ranks' sums
            totals = self.world.sum_floats([float(getattr(sums, f)) for f in SUMMED_ACROSS_RANKS])
            for f, v in zip(SUMMED_ACROSS_RANKS, totals, strict=True):
                setattr(sums, f, v)
        return self._update_metrics(batch, adv, sums, train_s=time.perf_counter() - t0)

    def _micro_batch(
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
        ``passes``: the forward of these rows, already run (:meth:`score`'s of the whole batch)."""
        hp = self.hp
        live = idx >= 0  # a sharded run's padding rows are -1 (their mask is 0: no loss, no metrics)
        idx = idx.clamp(min=0)
        part = batch.rollout.select(idx.to(self.device))
        mask = batch.loss_mask[idx] * live.unsqueeze(-1).to(batch.loss_mask.device)
        if passes is not None:
            assert passes.logp.shape[0] == len(idx), "the forward already run is of these rows"
        logp, ent, v = passes if passes is not None else self._policy_forward(part, with_entropy=first_pass)
        assert self.on_policy or batch.old_logp is not None
        old = logp.detach() if self.on_policy else batch.old_logp[idx]  # type: ignore[index]
        out = self.policy_loss(logp, old, adv.per_row[idx], mask, self.clip)
        pg_loss = self.aggregate(out.per_token, mask, scale)
        loss, s = pg_loss, Sums(loss_policy=float(pg_loss.detach()))
        if batch.ref_logp is not None:
            kl_tok = self.kl(logp, batch.ref_logp[idx])
            if self.recipe.kl_placement == "loss" and hp.beta > 0:
                kl_loss = hp.beta * self.aggregate(kl_tok, mask, scale)
                loss = loss + kl_loss
                s.loss_kl = float(kl_loss.detach())
            if first_pass:
                s.kl, s.kl_tokens = float(masked_sum(kl_tok.detach(), mask)), float(mask.sum())
        if self.critic is None:
            self.engine.backward(loss)
        else:
            assert isinstance(hp, PPOHyperparameters)
            assert batch.values is not None and adv.returns is not None
            if v is None:  # the critic's own graph: the policy's is backpropagated (and freed) first
                self.engine.backward(loss)
                loss = loss.detach()
                v = self.critic.values(part, precision=self.precision)
            vl = value_loss_clipped(v, batch.values[idx], adv.returns[idx], mask, clip=hp.cliprange_value)
            vf_loss = self.aggregate(vl.per_token, mask, scale)
            self.engine.backward(loss + hp.vf_coef * vf_loss)
            s.loss_value, s.value_clipped = float(vf_loss.detach()), float(vl.clipped.sum())
        s.tokens = float(mask.sum())
        s.clip_low, s.clip_high = float(out.clipped_low.sum()), float(out.clipped_high.sum())
        s.clip_dual = float(out.clipped_dual.sum())
        s.approx_kl = float(masked_sum(0.5 * (logp.detach() - old) ** 2, mask))
        if ent is not None:
            s.entropy, s.entropy_tokens = float(masked_sum(ent, mask)), s.tokens
        rows = live.to(part.prompt_mask.device)
        s.train_tokens = int(part.prompt_mask[rows].sum() + part.completion_mask[rows].sum())
        return s

    def _update_metrics(self, batch: Batch, adv: Advantages, s: Sums, *, train_s: float) -> dict[str, float]:
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
        if self.critic is not None:
            m[M.LOSS_VALUE] = s.loss_value / steps
            m[M.VALUE_CLIP_FRAC] = s.value_clipped / tok
        if batch.ref_logp is not None:
            if self.recipe.kl_placement == "reward":
                assert batch.old_logp is not None
                m[M.KL_MEAN] = float(masked_mean(self.kl(batch.old_logp, batch.ref_logp), batch.loss_mask))
            else:
                m[M.KL_MEAN] = s.kl / max(s.kl_tokens, 1.0)
        return m

    # -- log -------------------------------------------------------------------------------------------------------

    def validation_metrics(self) -> dict[str, float]:
        """Greedy mean reward on the validation prompts (and per named sub-grader); rank 0's, on every rank (a
        sharded base's: every rank's block of the prompts, in lockstep)."""
        if self.sharded:
            return self._validation_metrics()
        return self.from_rank0(self._validation_metrics)

    def _validation_metrics(self) -> dict[str, float]:
        self.rollout_engine.push_weights(self.model, self.engine.weights_version)
        greedy = SamplingParams(self.hp.max_completion_tokens, temperature=0.0)
        out: dict[str, float] = {}
        if self.agent is not None:
            res, episodes = self.agent.evaluate(self.val_ids, self.val_items, self.grader, greedy)
            out[M.VAL_EPISODE_TOOL_CALL_RATE] = episode_metrics(episodes).get(M.EPISODE_TOOL_CALL_RATE, 0.0)
        else:  # a sharded base's ranks each evaluate their block of the prompts, in lockstep
            res = evaluate_engine(
                self.rollout_engine,
                self.tokenizer,
                self.val_ids,
                self.val_items,
                self.grader,
                greedy,
                world=self.world if self.sharded else None,
            )
        out[M.VAL_REWARD_MEAN] = res.mean_reward
        for name, v in res.sub_means.items():
            out[M.reward_of(name, validation=True)] = v
        if self.overoptimisation is not None:
            out[M.VAL_OVEROPTIMISATION], warning = self.overoptimisation.observe(self.last_step, out)
            if warning is not None:
                self.cb.on_event("warn", warning, {"step": self.last_step, "metric": M.VAL_OVEROPTIMISATION})
        return out

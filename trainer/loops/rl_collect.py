"""The online RL step's first phase (``trainer.loops.rl``): collect a batch. Draw ``batch_size`` prompts ×
``samples_per_prompt`` completions from the rollout engine (or an agent job's episodes), grade and shape them, and
with dynamic sampling drop the groups whose rewards are all equal and draw again until the batch is full.

A launched run's ranks each sample and grade a block of whole groups, each row from its own seed, and gather the
blocks (``trainer.generation.distributed``); which draw a run makes is chosen once, when the collector is built.
"""

from __future__ import annotations

import torch
from torch import Tensor

from trainer.algorithms.core_algos import ZERO_STD, overlong_penalty
from trainer.generation.rollout_engine import HFRolloutEngine, SamplingParams
from trainer.loops.evaluate import GraderMonitor, decode_completions, finish_reasons, grade_batch
from trainer.loops.rl_batch import Batch, Draw, DrawStats, Graded, Parts, Samples
from trainer.loops.rl_run import Models, Prompts, Shares
from trainer.spec import graders
from trainer.spec.callbacks import Callback
from trainer.spec.config import RLHyperparameters
from trainer.spec.data import PromptItem


class Collector:
    """Draws, grades and shapes the step's batch (:meth:`collect`)."""

    def __init__(
        self,
        hp: RLHyperparameters,
        *,
        parts: Parts,
        prompts: Prompts,
        models: Models,
        shares: Shares,
        grader: graders.Grader,
        grader_monitor: GraderMonitor,
        callback: Callback,
    ) -> None:
        self.hp, self.parts, self.prompts, self.models, self.shares = hp, parts, prompts, models, shares
        self.grader, self.grader_monitor, self.cb = grader, grader_monitor, callback
        self.sampling = SamplingParams(hp.max_completion_tokens, hp.temperature, hp.top_p, hp.min_completion_tokens)
        # a launched run: this rank's block of whole groups, each row from its own seed
        self._draw_rows = self._draw_block if shares.world.launched else self._draw_alone
        self.compile_s_reported, self.compile_failure_reported = 0.0, False

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
            drawn = self.draw()
            s = drawn.samples
            draws.sampling_batches += 1
            draws.generation_s += drawn.seconds
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
        samples = Samples.concat(kept or [s.select([])], self.prompts.tokenizer.pad_token_id)
        samples.rollout = samples.rollout.to(self.shares.device)
        mask = samples.rollout.policy_mask.to(torch.float32)
        if hp.mask_truncated_completions:
            mask = mask * (~samples.rollout.truncated).unsqueeze(-1).float()
        return Batch(samples, draws, loss_mask=mask)

    def draw(self) -> Draw:
        """``batch_size`` prompts × ``samples_per_prompt`` completions from the rollout engine, graded (and shaped)."""
        engine = self.models.engine
        idx = engine.next_indices(self.hp.batch_size)
        g = self.hp.samples_per_prompt
        prompts = [self.prompts.train_ids[i] for i in idx for _ in range(g)]  # rows of a group adjacent
        items = [self.prompts.train_items[i] for i in idx for _ in range(g)]
        self.models.rollout_engine.push_weights(self.models.model, engine.weights_version)
        return self._draw_rows(prompts, items)

    def _draw_alone(self, prompts: list[list[int]], items: list[PromptItem]) -> Draw:
        """The rows from the engine's sampling generator."""
        graded = self._sample(prompts, items, generator=self.models.engine.generator)
        self.grader_monitor.observe(graded.scores)
        return Draw(self._shape(graded, items, graded.generation.logprobs), graded.generation.seconds)

    def _draw_block(self, prompts: list[list[int]], items: list[PromptItem]) -> Draw:
        """A launched run's draw: this rank samples and grades its block of whole groups, row i from the seed
        ``base + i`` (``base`` drawn alike on every rank; an agent job's episodes too, each turn from the row's own
        seed), and every rank gathers every block, in rank order: the same batch as one rank alone would sample, on
        every rank (``trainer.generation.distributed``)."""
        g, world, generator = self.hp.samples_per_prompt, self.shares.world, self.models.engine.generator
        base = int(torch.randint(0, 2**62, (1,), generator=generator, device=generator.device))
        lo, hi = (g * x for x in world.block(len(prompts) // g))
        seeds = [base + i for i in range(lo, hi)]
        graded = self._sample(prompts[lo:hi], items[lo:hi], row_seeds=seeds)
        logp = graded.generation.logprobs
        shaped = self._shape(graded, items[lo:hi], logp.cpu() if logp is not None else None)
        blocks = world.gather((shaped, graded.scores))
        for _, block_scores in blocks:
            self.grader_monitor.observe(block_scores)
        samples = Samples.concat([b for b, _ in blocks], self.prompts.tokenizer.pad_token_id)
        if samples.sampling_logp is not None:
            samples.sampling_logp = samples.sampling_logp.to(self.shares.device)
        return Draw(samples, graded.generation.seconds)

    def _sample(
        self,
        prompts: list[list[int]],
        items: list[PromptItem],
        *,
        generator: torch.Generator | None = None,
        row_seeds: list[int] | None = None,
    ) -> Graded:
        """One completion per prompt (an agent job: one multi-turn episode, tool output in the rows outside the
        policy mask), graded. From ``generator``, or with ``row_seeds`` each row from its own seed (the built-in
        engine)."""
        agent, engine = self.models.agent, self.models.rollout_engine
        if agent is not None:
            batch = agent.run(prompts, items, self.sampling, generator=generator, row_seeds=row_seeds)
            rollout = batch.generation.rollout.to("cpu")
            return Graded(batch.generation, rollout, batch.texts, batch.grade(self.grader, items), batch.episodes)
        if row_seeds is None:
            gen = engine.generate(prompts, self.sampling, generator=generator)
        else:
            assert isinstance(engine, HFRolloutEngine)
            gen = engine.generate(prompts, self.sampling, generator=None, row_seeds=row_seeds)
        rollout = gen.rollout.to("cpu")
        texts = decode_completions(self.prompts.tokenizer, rollout)
        return Graded(gen, rollout, texts, grade_batch(self.grader, texts, items, finish_reasons(rollout)), None)

    def _shape(self, graded: Graded, items: list[PromptItem], sampling_logp: Tensor | None) -> Samples:
        """The graded rows with their shaped reward (clipped; the overlong penalty where the recipe has it)."""
        hp, scores, rollout = self.hp, graded.scores, graded.rollout
        shaped = scores.rewards.clone()
        if hp.reward_clip is not None:
            shaped = shaped.clamp(-hp.reward_clip, hp.reward_clip)
        if self.parts.overlong is not None:
            buffer, factor = self.parts.overlong
            shaped += overlong_penalty(
                rollout.lengths, max_tokens=hp.max_completion_tokens, buffer=buffer, factor=factor
            )
        return Samples(rollout, items, graded.texts, shaped, scores.rewards, scores.sub, sampling_logp, graded.episodes)

    def _report_compile(self) -> None:
        """An event when the engine compiled its decode step (once per process and shape: the step's time has it),
        and a warning, once, when it could not (the job goes on decoding uncompiled)."""
        engine = self.models.rollout_engine
        error = getattr(engine, "compile_error", None)
        if error is not None and not self.compile_failure_reported:
            self.cb.on_event("warn", f"the decode step could not be compiled; decoding uncompiled: {error}")
            self.compile_failure_reported = True
        total = float(getattr(engine, "compile_s", 0.0))
        if total > self.compile_s_reported:
            self.cb.on_event(
                "info",
                f"compiled the decode step in {total - self.compile_s_reported:.1f} s (once per process and shape; "
                "later steps reuse it)",
                {"compile_s": round(total - self.compile_s_reported, 3)},
            )
            self.compile_s_reported = total

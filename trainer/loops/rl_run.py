"""What builds an online RL run (``trainer.loops.rl``): the prompts, checked before any weight is loaded; then the
policy, the critic, the sharding of the base, the rollout engine and the training engine, in the order the random
number generator has always been drawn in (a changed order would change every run's weights); and :class:`Shares`,
this rank's share of the step's passes.

Whether the run is on one rank, on several (data parallel) or on a sharded base is decided here and in
``trainer.generation.distributed``: the step asks :class:`Shares` for its rows and gets them, and never branches on
it itself.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from peft import PeftModel
from torch import Tensor
from transformers import PreTrainedTokenizerBase

from trainer.generation.constrained import Grammar, GrammarError, constraints, response_grammar
from trainer.generation.distributed import World, gathered, shard_frozen_base
from trainer.generation.encoding import PromptSampler, PromptTooLongError, encode_prompts, thinking_kwargs
from trainer.generation.models import Precision, load_tokenizer, trainable_parameters
from trainer.generation.rollout import Rollout
from trainer.generation.rollout_engine import HFRolloutEngine, RolloutEngine, decode_mode, use_compile_cache
from trainer.grading.remote_process import remote_config
from trainer.loops.agent import AgentRollouts
from trainer.loops.critic import Critic, build_critic
from trainer.loops.engine import Engine, ParamGroup, Policy, check_context, load_policy
from trainer.loops.rl_batch import SUMMED_ACROSS_RANKS, KLController, Parts, Sums
from trainer.spec import graders
from trainer.spec.callbacks import Callback
from trainer.spec.config import JobSpec, PPOHyperparameters, RLHyperparameters, SpecError
from trainer.spec.data import DatasetError, PromptItem, load_prompts, offered_functions
from trainer.spec.urls import UrlRefused

RolloutEngineFactory = Callable[[PeftModel, PreTrainedTokenizerBase], RolloutEngine]


# -- the prompts -----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Prompts:
    """The training and validation prompts, tokenised with the chat template's arguments."""

    tokenizer: PreTrainedTokenizerBase
    template_kwargs: dict[str, Any]  # the thinking mode's arguments for reasoning_effort (empty: none)
    train_items: list[PromptItem]
    train_ids: list[list[int]]
    val_items: list[PromptItem]  # the first eval_prompts (default all)
    val_ids: list[list[int]]
    grammar: Grammar | None = None  # the response_format's, checked against the tokenizer (None: plain text)


def prepare_prompts(spec: JobSpec, hp: RLHyperparameters, grader: graders.Grader, callback: Callback) -> Prompts:
    """The prompts, tokenised and checked against the model's context: the input's errors, before any weight."""
    train_items = load_prompts(Path(spec.training_file), grader=grader, agent=spec.method.agent)
    val_items = (
        load_prompts(Path(spec.validation_file), grader=grader, agent=spec.method.agent) if spec.validation_file else []
    )
    _check_tool_urls(spec)
    tokenizer = load_tokenizer(spec.model)
    thinking = thinking_kwargs(tokenizer, hp.reasoning_effort)
    if thinking is None and hp.reasoning_effort != "default":
        callback.on_event(
            "info",
            f"reasoning_effort {hp.reasoning_effort!r} has no effect: the chat template of {spec.model} has no "
            "thinking mode",
        )
    template_kwargs = thinking or {}

    def encode(items: list[PromptItem], path: str) -> list[list[int]]:
        try:
            return encode_prompts(
                tokenizer,
                items,
                max_prompt_tokens=hp.max_prompt_tokens,
                template_kwargs=template_kwargs,
                tools=offered_functions(items, spec.method.agent),
            )
        except PromptTooLongError as err:
            raise DatasetError(str(err), line=err.item.line, path=path) from None

    train_ids, val_ids = encode(train_items, spec.training_file), encode(val_items, spec.validation_file or "")
    longest = max(len(p) for p in train_ids + val_ids)
    check_context(
        spec.model,
        needed=longest + hp.max_completion_tokens,
        what=f"the longest prompt ({longest} tokens) plus max_completion_tokens ({hp.max_completion_tokens})",
        param=f"method.{spec.method.type}.hyperparameters.max_completion_tokens",
    )
    if hp.eval_prompts:
        val_ids, val_items = val_ids[: hp.eval_prompts], val_items[: hp.eval_prompts]
    grammar = _response_grammar(spec, tokenizer)
    return Prompts(tokenizer, template_kwargs, train_items, train_ids, val_items, val_ids, grammar)


def _response_grammar(spec: JobSpec, tokenizer: PreTrainedTokenizerBase) -> Grammar | None:
    """The grammar of the job's ``response_format`` (None: plain text), built once for the run: a ``SpecError``
    naming the field, before any weight is loaded, when it does not compile for the tokenizer or the vocabulary
    cannot begin to write it (a run whose every answer would be cut)."""
    param = f"method.{spec.method.type}.response_format"
    try:
        grammar = response_grammar(spec.method.response_format)
        if grammar is None:
            return None
        [first] = constraints(grammar, tokenizer, 1)
    except GrammarError as err:
        raise SpecError(f"response_format: {err}", param=param) from None
    if not first.writable(len(tokenizer)):
        raise SpecError(f"the vocabulary of {spec.model} cannot write an answer in this format", param=param)
    return grammar


def _check_tool_urls(spec: JobSpec) -> None:
    """Each tool server's URL against this process's policy (scheme, and an address given as the host): a
    ``SpecError`` naming the tool before any weight is loaded, rather than every call of the run refused. Names
    are resolved (and checked again) at every call: DNS may answer differently later."""
    agent = spec.method.agent
    if agent is None:
        return
    policy = remote_config().url_policy
    for i, tool in enumerate(agent.tools):
        if tool.server_url is None:
            continue
        try:
            policy.check_url(tool.server_url)
        except UrlRefused as err:
            raise SpecError(str(err), param=f"method.{spec.method.type}.tools.{i}.server_url") from None


def check_world(world: World, hp: RLHyperparameters, rollout_engine: RolloutEngineFactory | None) -> None:
    """What data parallel training over several ranks supports, refused before any weight is loaded."""
    if world.size == 1:
        return
    if rollout_engine is not None:
        raise SpecError("data parallel training samples with the built-in engine only", param="resources.gpus")
    if hp.batch_size < world.size:
        raise SpecError(
            f"batch_size ({hp.batch_size}) must be at least resources.gpus ({world.size}): each device "
            "samples whole groups",
            param="resources.gpus",
        )


# -- this rank's share of the step -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Shares:
    """This rank's share of the step's passes. ``lockstep``: the frozen base is sharded across the ranks (FSDP2), so
    every rank runs the model's passes in lockstep, each padded to the largest rank's share."""

    world: World
    lockstep: bool
    device: torch.device

    @property
    def whole_batch_here(self) -> bool:
        """Whether this rank computes the whole batch itself (a run on one rank)."""
        return self.world.size == 1

    @property
    def evaluating_world(self) -> World | None:
        """The world whose ranks evaluate their blocks of the prompts in lockstep; None: rank 0 evaluates alone."""
        return self.world if self.lockstep else None

    def validation(self, compute: Callable[[], dict[str, float]]) -> dict[str, float]:
        """``compute()``'s metrics on every rank: rank 0's, sent to the others (every rank's decisions alike: the best
        checkpoint, early stopping), or in lockstep every rank's own (each evaluates its block of the prompts)."""
        if self.lockstep or self.world.size == 1:
            return compute()
        return self.world.broadcast(compute() if self.world.main else {})

    def rows(self, idx: Tensor) -> Tensor:
        """This rank's share of the rows ``idx`` (a mini-batch), against the whole mini-batch's totals; in lockstep
        padded to the largest share with index -1 (rows that train nothing but run the passes)."""
        lo, hi = self.world.block(len(idx))
        mine = idx[lo:hi]
        if self.lockstep:
            mine = torch.cat([mine, mine.new_full((self._largest_share(len(idx)) - len(mine),), -1)])
        return mine

    def by_rank(self, ro: Rollout, fn: Callable[[Rollout], tuple[Tensor, ...]]) -> tuple[Tensor, ...]:
        """``fn``'s per-row results [N, …] over the batch: on several ranks each computes its block of rows and
        the blocks are gathered (every rank gets them all)."""
        if self.world.size == 1:
            return fn(ro)
        lo, hi = self.world.block(len(ro))
        idx = torch.arange(lo, hi)
        if self.lockstep:  # every rank runs the largest share's passes (padded with copies of row 0)
            idx = torch.cat([idx, idx.new_zeros(self._largest_share(len(ro)) - (hi - lo))])
        mine = tuple(t[: hi - lo] for t in fn(ro.select(idx.to(ro.prompt_ids.device))))
        blocks = self.world.gather(tuple(t.cpu() for t in mine))
        return tuple(torch.cat([b[i] for b in blocks]).to(self.device) for i in range(len(mine)))

    def sum_across(self, sums: Sums) -> None:
        """Each rank summed its share of the step: the step's sums are the ranks' sums (in place)."""
        if self.world.size == 1:
            return
        totals = self.world.sum_floats([float(getattr(sums, f)) for f in SUMMED_ACROSS_RANKS])
        for f, v in zip(SUMMED_ACROSS_RANKS, totals, strict=True):
            setattr(sums, f, v)

    def _largest_share(self, n: int) -> int:
        """The rows of the largest rank's share of ``n`` (at least one: a rank with none runs a padding row)."""
        return max(1, -(-n // self.world.size))


# -- the models ------------------------------------------------------------------------------------------------------


@dataclass
class Models:
    """What trains and samples: the policy (base + LoRA) and its trainable weights, the critic, the rollout engine,
    an agent job's episode runner, the training engine and the KL coefficient it saves."""

    model: PeftModel
    params: list[torch.nn.Parameter]  # the policy's LoRA weights
    critic: Critic | None
    critic_params: list[torch.nn.Parameter]
    rollout_engine: RolloutEngine
    agent: AgentRollouts | None
    engine: Engine
    kl_ctl: KLController  # PPO's adaptive controller moves it; saved with every checkpoint


class ModelBuilder:
    """Builds a run's :class:`Models`: policy, rollout engine, critic and the training engine, in this order (the
    RNG's); with a sharded base the critic comes before the sharding, which needs the trainable weights whole."""

    def __init__(
        self,
        spec: JobSpec,
        *,
        parts: Parts,
        prompts: Prompts,
        shares: Shares,
        precision: Precision,
        total_steps: int,
        callback: Callback,
    ) -> None:
        assert isinstance(spec.method.hyperparameters, RLHyperparameters)
        self.spec, self.hp = spec, spec.method.hyperparameters
        self.parts, self.prompts, self.shares = parts, prompts, shares
        self.precision, self.total_steps, self.cb = precision, total_steps, callback

    def build(self, rollout_engine: RolloutEngineFactory | None) -> Models:
        sharded, device = self.shares.lockstep, self.shares.device
        # bf16: sample from a merged bf16 copy (half the weights' memory again, about half the generation time);
        # fp32: the copy would double the weights for a small gain, so the policy samples itself.
        # A sharded base is loaded on the host and each rank moves its shard to its device; it has no sampler copy
        # (a whole base per rank is what sharding avoids) and decodes uncompiled (FSDP's hooks run in every forward).
        policy = load_policy(
            self.spec.model,
            self.spec.method.lora,
            device=torch.device("cpu") if sharded else device,
            precision=self.precision,
            seed=self.spec.seed,
            sampler_copy=self.precision == "bf16" and rollout_engine is None and not sharded,
            weights=not sharded or self.shares.world.main,  # sharded: rank 0 reads the weights, the others shards
        )
        model = policy.model
        params = trainable_parameters(model)  # the policy's LoRA weights (before a critic's adapter joins)
        critic = None
        if sharded:  # the critic's adapter first: FSDP leaves the weights trainable at sharding time whole
            critic = self._critic(model)
            params = self._shard(model, params, critic)
        engine = self._rollout_engine(policy, rollout_engine)
        agent = self._agent(engine)
        if not sharded:
            critic = self._critic(model)
        critic_params = critic.parameters() if critic is not None else []
        kl_ctl = KLController(self.hp.beta)
        training = self._engine(model, params, critic, critic_params, kl_ctl)
        return Models(model, params, critic, critic_params, engine, agent, training, kl_ctl)

    def _critic(self, model: PeftModel) -> Critic | None:
        """PPO's critic where the recipe has one."""
        spec, hp = self.spec, self.hp
        if not (self.parts.critic and isinstance(hp, PPOHyperparameters)):
            return None
        return build_critic(
            model,
            hp,
            lora=spec.method.lora,
            vocabulary=len(self.prompts.tokenizer),
            seed=spec.seed,
            device=self.shares.device,
            precision=self.precision,
            where=f"method.{spec.method.type}.hyperparameters",
        )

    def _shard(
        self, model: PeftModel, params: list[torch.nn.Parameter], critic: Critic | None
    ) -> list[torch.nn.Parameter]:
        """Shard the frozen base across the ranks (``trainer.generation.distributed.shard_frozen_base``), said in an
        event; the policy's LoRA weights as they are after it. The LoRA weights (the policy's and a critic
        adapter's) stay whole (a critic's head is on the device already)."""
        world = self.shares.world
        policy = {id(p) for p in params}
        names = [n for n, p in model.named_parameters() if id(p) in policy]
        sharding = shard_frozen_base(model, world, self.shares.device)
        # a rank that loaded no weights has new parameter objects now (allocated off the meta device)
        named = dict(model.named_parameters())
        if critic is not None:
            critic.fuses = False  # the joined passes (CUDA) are untried on a sharded base: they stay apart
        # The ranks that loaded no weights drew no random numbers for LoRA's initial weights: rank 0's generator state
        # on every rank, as if each had loaded the whole base
        torch.set_rng_state(world.broadcast(torch.get_rng_state()))
        self.cb.on_event(
            "info",
            f"the base's frozen weights are sharded across {world.size} devices: {sharding.held:,} of "
            f"{sharding.total:,} on each, {sharding.layers} decoder layers gathered one at a time",
            {
                "ranks": world.size,
                "held": sharding.held,
                "total": sharding.total,
                "layers": sharding.layers,
                "loaded_by_rank0_only": sharding.from_rank0,
            },
        )
        return [named[n] for n in names]

    def _rollout_engine(self, policy: Policy, factory: RolloutEngineFactory | None) -> RolloutEngine:
        """The user's rollout engine, or the built-in one (compiled decoding where it pays)."""
        model, tokenizer, sharded = policy.model, self.prompts.tokenizer, self.shares.lockstep
        decode = (
            "dynamic"
            if sharded
            else decode_mode(
                self.hp.compile_decode,
                device=self.shares.device,
                bf16_sampler=policy.base_copy is not None,
                decode_steps=self.total_steps * self.hp.max_completion_tokens,
            )
        )
        if decode == "compiled":
            use_compile_cache()
        grammar = self.prompts.grammar
        if factory is not None:
            if grammar is not None:  # the factory's engine is handed no grammar: it would sample unconstrained
                param = f"method.{self.spec.method.type}.response_format"
                raise SpecError("response_format needs the built-in rollout engine", param=param)
            return factory(model, tokenizer)
        assert grammar is None or self.spec.method.agent is None  # refused by the spec: episodes call tools
        return HFRolloutEngine(
            model,
            eos_id=tokenizer.eos_token_id,
            pad_id=tokenizer.pad_token_id,
            device=self.shares.device,
            precision=self.precision,
            base_copy=policy.base_copy,
            decode=decode,
            lockstep=self.shares.world.any if sharded else None,
            whole_weights=(lambda: gathered(model)) if sharded and self.spec.gather_for_generation else None,
            tokenizer=tokenizer,
            grammar=grammar,
        )

    def _agent(self, rollout_engine: RolloutEngine) -> AgentRollouts | None:
        """An agent job's episode runner over the rollout engine."""
        agent = self.spec.method.agent
        if agent is None:
            return None
        return AgentRollouts(
            agent,
            rollout_engine,
            self.prompts.tokenizer,
            max_tokens=self.hp.max_completion_tokens,
            template_kwargs=self.prompts.template_kwargs,
            remote=remote_config(),
            ranks_on_host=self.shares.world.size,  # the launcher's ranks share this machine (and its sandbox uids)
        )

    def _engine(
        self,
        model: PeftModel,
        params: list[torch.nn.Parameter],
        critic: Critic | None,
        critic_params: list[torch.nn.Parameter],
        kl_ctl: KLController,
    ) -> Engine:
        """The training engine over the policy's (and the critic's) weights."""
        spec, hp = self.spec, self.hp
        groups = [ParamGroup(params, hp.effective_learning_rate)]
        if critic is not None:
            assert isinstance(hp, PPOHyperparameters)
            value_lr = hp.value_learning_rate or hp.learning_rate
            groups.append(ParamGroup(critic_params, value_lr * hp.learning_rate_multiplier))
        engine = Engine(
            model,
            groups=groups,
            hp=hp,
            total_steps=self.total_steps,
            device=self.shares.device,
            precision=self.precision,
            data_order=PromptSampler(len(self.prompts.train_items), seed=spec.seed),
            seed=spec.seed,
            dropout=spec.method.lora.dropout > 0,
            trim_memory=True,
        )
        engine.share_prompts = not self.shares.lockstep
        engine.extra["kl_coef"] = kl_ctl
        if critic is not None:
            engine.extra["critic"] = critic
        return engine

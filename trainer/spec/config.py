"""The job spec: one pydantic model per method's hyperparameters, defaults from the papers, strict on input.

The same spec is the body of ``POST /v1/fine_tuning/jobs`` and, with local paths instead of file ids, the input of
``proxima train``. Errors are raised as :class:`SpecError` naming the field path (``method.grpo.hyperparameters.foo``)
before any model is loaded.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

from trainer.spec import graders, metrics
from trainer.spec import integrations as tracking
from trainer.spec.agent_spec import AgentSpec
from trainer.spec.errors import SpecError
from trainer.spec.lora import LoraSpec
from trainer.spec.names import AggregationName, DPOLossType, KLEstimatorName
from trainer.spec.recipes import RECIPES
from trainer.spec.response_format import Format, ResponseFormat, json_schema_of

# Bounds: generous enough for any real job, and tight enough that no value overflows what stores or
# uses it (the database's 32-bit step columns, a float's range, a GPU's memory before the first step).
MAX_STEPS = 1_000_000
"""Most training steps a job may plan (``max_steps``, or ``n_epochs`` passes over the data): far below int4."""
MAX_TOKENS = 262_144
"""Most tokens of any length hyperparameter: a 256k context, the longest of today's open models' common ones."""
MAX_BATCH = 4096
"""Most examples (RL: prompts) per step, sequences per forward pass or mini-batches per rollout batch."""
MAX_GROUP = 256
"""Most samples per prompt (G)."""
MAX_ROLLOUT = 65_536
"""Most sequences one RL step samples (batch_size × group_size × compute_multiplier)."""
MAX_COMPUTE_MULTIPLIER = 64.0
"""Largest ``compute_multiplier`` (OpenAI gives no range; the rollout's own bound applies as well)."""
ReasoningEffort = Literal["default", "low", "medium", "high"]
"""OpenAI's ``reasoning_effort`` values."""
AUTO_EVALUATIONS = 10
"""``eval_interval: "auto"``: validation about this many times over the run, every ceil(total_steps / 10) steps (and
at the last step, as always)."""


class _Strict(BaseModel):
    # allow_inf_nan=False: NaN and ±Infinity are refused in every float (YAML spells them .nan and .inf, and
    # Python's JSON parser takes NaN and Infinity), so every number of a spec is finite.
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)


Auto = Literal["auto"]


def _auto_to_default(data: Any, fields: tuple[str, ...]) -> Any:
    """OpenAI sends ``"auto"`` for hyperparameters it should choose: we drop them so that the default applies."""
    if isinstance(data, dict):
        return {k: v for k, v in data.items() if not (k in fields and v == "auto")}
    return data


class Hyperparameters(_Strict):
    """Optimisation hyperparameters every method shares. Defaults suit LoRA: the papers' learning rates
    of ~1e-6 are for full fine-tuning."""

    learning_rate: float = Field(3e-4, gt=0, le=1.0, description="0 < lr ≤ 1")
    learning_rate_multiplier: float = Field(
        1.0, gt=0, le=100, description="OpenAI's: scales learning_rate (0 < m ≤ 100, learning_rate × m ≤ 1)"
    )
    lr_scheduler: Literal["constant", "cosine"] = "constant"
    warmup_steps: int = Field(0, ge=0, le=MAX_STEPS)
    weight_decay: float = Field(0.0, ge=0, le=1.0, description="AdamW's decoupled weight decay, 0 to 1")
    batch_size: int = Field(
        8, ge=1, le=MAX_BATCH, description=f"examples (RL: prompts) per training step, 1 to {MAX_BATCH}"
    )
    max_steps: int | None = Field(
        None,
        ge=1,
        le=MAX_STEPS,
        description=f"training steps, at most {MAX_STEPS:,}; default: n_epochs over the data (which must also plan at "
        f"most {MAX_STEPS:,} steps)",
    )
    n_epochs: int = Field(1, ge=1, le=1000, description="passes over the data, 1 to 1000")
    micro_batch_size: int | None = Field(
        None, ge=1, le=MAX_BATCH, description="sequences per forward pass (accumulation)"
    )
    max_grad_norm: float | None = Field(1.0, gt=0, le=1e6, description="gradient clipping norm; None: no clipping")
    adam_beta1: float = Field(0.9, ge=0, lt=1)
    adam_beta2: float = Field(0.999, ge=0, lt=1)
    checkpoint_interval: int = Field(10, ge=1, le=MAX_STEPS)
    eval_interval: int | Auto = Field(
        0,
        description="training steps between validation runs (and at the last step); 0: only at the end; auto "
        f"(OpenAI's): about {AUTO_EVALUATIONS} over the run, every ceil(total_steps / {AUTO_EVALUATIONS}) steps, the "
        "service storing the number it picked when it creates the job",
    )
    eval_samples: int | None = Field(
        None,
        ge=1,
        le=1_000_000,
        description="the first validation examples each evaluation uses; default all (OpenAI has no eval_samples "
        "for this method; the online RL methods' eval_samples is OpenAI's: completions per validation prompt)",
    )
    keep_best: str | None = Field(
        None,
        description="a validation metric (val/reward/mean, val/reward/{grader}/mean, val/preference/accuracy, "
        "val/loss …; one ending in 'loss' is minimised): the job's adapter is the checkpoint where it was best, the "
        "base model's value at step 0 included, not the last step's",
    )
    early_stopping_patience: int | None = Field(
        None, ge=1, le=MAX_STEPS, description="with keep_best: validations without a new best before training stops"
    )
    precision: Literal["auto", "fp32", "bf16"] = Field("auto", description="auto: bf16 where matmuls run fast in it")

    @model_validator(mode="before")
    @classmethod
    def _openai_auto(cls, data: Any) -> Any:
        return _auto_to_default(
            data,
            ("batch_size", "learning_rate_multiplier", "n_epochs", "eval_samples", "beta"),
        )

    @field_validator("eval_interval", mode="before")
    @classmethod
    def _steps_or_auto(cls, v: Any) -> Any:
        # checked before the union's own validation, whose errors would name its members rather than the field
        if isinstance(v, float) and v.is_integer():
            v = int(v)  # 5.0 is 5, as an int field takes it
        if v == "auto" or (isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= MAX_STEPS):
            return v
        raise ValueError(f"must be a whole number of steps from 0 to {MAX_STEPS:,}, or 'auto'")

    @field_validator("keep_best")
    @classmethod
    def _a_validation_metric(cls, v: str | None) -> str | None:
        if v is not None and not (v.startswith("val/") and metrics.is_known(v)):
            known = ", ".join(n for n in metrics.METRICS if n.startswith("val/"))
            raise ValueError(f"must name a validation metric: one of {known}, or val/reward/{{grader}}/mean")
        return v

    @model_validator(mode="after")
    def _patience_needs_keep_best(self) -> Hyperparameters:
        if self.early_stopping_patience is not None and self.keep_best is None:
            raise ValueError("early_stopping_patience needs keep_best: the metric whose improvement it waits for")
        return self

    @field_validator("learning_rate_multiplier")
    @classmethod
    def _effective_learning_rate_at_most_1(cls, v: float, info: ValidationInfo) -> float:
        lr = info.data.get("learning_rate")  # absent when learning_rate itself failed
        if lr is not None and lr * v > 1.0:
            raise ValueError(f"learning_rate × learning_rate_multiplier = {lr * v:g}: at most 1")
        return v

    @property
    def effective_learning_rate(self) -> float:
        return self.learning_rate * self.learning_rate_multiplier

    def total_steps(self, n_examples: int) -> int:
        """Training steps of a run over ``n_examples`` examples: ``max_steps``, else ``n_epochs`` passes of
        ``batch_size`` examples (the last batch of an epoch may be short)."""
        return self.max_steps or self.n_epochs * math.ceil(n_examples / self.batch_size)

    def eval_every(self, total_steps: int) -> int:
        """Steps between validation runs in a run of ``total_steps``: ``eval_interval``, or for ``"auto"``
        ceil(total_steps / AUTO_EVALUATIONS) (at least 1)."""
        if self.eval_interval == "auto":
            return max(1, math.ceil(total_steps / AUTO_EVALUATIONS))
        return self.eval_interval


class RLHyperparameters(Hyperparameters):
    """Hyperparameters shared by the online RL methods."""

    group_size: int = Field(
        8,
        ge=1,
        le=MAX_GROUP,
        description=f"samples per prompt (G), 1 to {MAX_GROUP}; batch_size × group_size at most {MAX_ROLLOUT:,}",
    )
    max_prompt_tokens: int = Field(512, ge=1, le=MAX_TOKENS, description=f"1 to {MAX_TOKENS:,}")
    max_completion_tokens: int = Field(256, ge=1, le=MAX_TOKENS, description=f"1 to {MAX_TOKENS:,}")
    min_completion_tokens: int = Field(
        0, ge=0, le=MAX_TOKENS, description="EOS is held off before this many tokens (benchmarks)"
    )
    temperature: float = Field(1.0, gt=0, le=10)
    top_p: float = Field(1.0, gt=0, le=1)
    iterations_per_batch: int = Field(
        1, ge=1, le=100, description="μ: optimisation passes over each rollout batch, 1 to 100"
    )
    mini_batches: int = Field(1, ge=1, le=MAX_BATCH, description="optimiser steps per pass over a rollout batch")
    epsilon_low: float = Field(0.2, gt=0, lt=1)
    epsilon_high: float = Field(0.2, gt=0, le=10)
    dual_clip: float | None = Field(
        None, gt=1, le=100, description="dual-clip constant c (Ye et al. 2019), 1 < c ≤ 100; off by default"
    )
    beta: float = Field(0.04, ge=0, le=10, description="KL coefficient, 0 to 10; 0 skips the reference pass")
    reward_clip: float | None = Field(
        None, gt=0, le=1e6, description="the grader's reward clipped to ±reward_clip before training on it; None: off"
    )
    kl_estimator: KLEstimatorName = "k3"
    loss_aggregation: AggregationName = "seq_mean_token_mean"
    mask_truncated_completions: bool = False
    rollouts_logged: int = Field(4, ge=0, le=256, description="sampled rollouts written per step, up to 256")
    compile_decode: Literal["auto", "on", "off"] = Field(
        "auto",
        description="the HF engine's decode step on a static KV cache, compiled by torch.compile once per process "
        "and shape (its compile cache kept on disk): on, off, or auto: on where it was measured to pay (a bf16 "
        "sampler on a CPU with fast bf16) when the job decodes enough tokens to amortise the compile",
    )
    # OpenAI's reinforcement hyperparameters (a job body copied from OpenAI runs unchanged; README "Hyperparameters").
    compute_multiplier: float = Field(
        1.0,
        gt=0,
        le=MAX_COMPUTE_MULTIPLIER,
        description="OpenAI's: scales the exploration, here the samples per prompt: "
        "samples_per_prompt = max(1, round(group_size × compute_multiplier))",
    )
    reasoning_effort: ReasoningEffort = Field(
        "default",
        description="OpenAI's: the chat template's thinking mode where the base model has one "
        "(trainer.generation.encoding.thinking_kwargs); otherwise it has no effect and the job says so in an event",
    )
    eval_samples: int | None = Field(
        None,
        ge=1,
        le=MAX_GROUP,
        description=f"OpenAI's: completions generated per validation prompt at each evaluation, 1 to {MAX_GROUP}; "
        "default (auto) 1, the greedy completion; more are sampled at temperature and top_p, and the validation "
        "rewards are their mean",
    )
    eval_prompts: int | None = Field(
        None,
        ge=1,
        le=1_000_000,
        description="the first validation prompts each evaluation uses; default all (OpenAI's evaluations use them "
        "all: this bounds an evaluation's cost)",
    )

    @model_validator(mode="before")
    @classmethod
    def _openai_auto_rl(cls, data: Any) -> Any:
        return _auto_to_default(data, ("compute_multiplier",))

    @property
    def eval_samples_per_prompt(self) -> int:
        """Completions each validation prompt gets at an evaluation (1: the greedy one)."""
        return self.eval_samples or 1

    @property
    def samples_per_prompt(self) -> int:
        """Completions sampled per prompt each step: ``group_size`` scaled by ``compute_multiplier``."""
        return max(1, round(self.group_size * self.compute_multiplier))


class GRPOHyperparameters(RLHyperparameters):
    """GRPO (DeepSeekMath, arXiv 2402.03300): A = (r − mean_g)/(std_g + eps), per-sequence token mean, k3 KL in the
    loss with β = 0.04."""

    scale_rewards: Literal["group", "batch", "none"] = "group"
    std_eps: float = Field(1e-4, gt=0, le=1)


class DrGRPOHyperparameters(RLHyperparameters):
    """Dr. GRPO (arXiv 2503.20783): A = r − mean_g, token sum over the constant B·L_max, no KL."""

    beta: float = Field(0.0, ge=0, le=10)
    loss_aggregation: AggregationName = "seq_mean_token_sum_norm"


class DAPOHyperparameters(RLHyperparameters):
    """DAPO (arXiv 2503.14476): clip-higher (ε_low 0.2, ε_high 0.28), dynamic sampling, token-level loss, overlong
    reward shaping, no KL."""

    epsilon_high: float = Field(0.28, gt=0, le=10)
    beta: float = Field(0.0, ge=0, le=10)
    loss_aggregation: AggregationName = "token_mean"
    std_eps: float = Field(1e-4, gt=0, le=1)
    dynamic_sampling: bool = True
    max_sampling_batches: int = Field(
        4, ge=1, le=64, description="rollout batches drawn at most to fill one step, 1 to 64"
    )
    overlong_buffer: int | None = Field(
        None, ge=1, le=MAX_TOKENS, description="L_cache in tokens; default a quarter of L_max"
    )
    overlong_penalty: float = Field(1.0, ge=0, le=100, description="factor of the overlong penalty; 0 disables it")


class RLOOHyperparameters(RLHyperparameters):
    """RLOO (Ahmadian et al. 2024, arXiv 2402.14740): leave-one-out baseline, the completion as one action
    (sequence-level ratio), KL as k1 summed into the reward with β = 0.05 (TRL's default)."""

    beta: float = Field(0.05, ge=0, le=10)
    kl_estimator: KLEstimatorName = "k1"


class ReinforceHyperparameters(RLHyperparameters):
    """REINFORCE (Williams 1992): A = r − b with b the batch mean (or none), on-policy (μ = 1, one mini-batch),
    KL as k1 in the reward, off by default."""

    beta: float = Field(0.0, ge=0, le=10)
    kl_estimator: KLEstimatorName = "k1"
    loss_aggregation: AggregationName = "seq_mean_token_sum_norm"
    baseline: Literal["none", "batch_mean"] = "batch_mean"


class PPOHyperparameters(RLHyperparameters):
    """PPO for LLMs (Ouyang et al. 2022; Ziegler et al. 2019, arXiv 1909.08593; TRL's PPOConfig defaults): a value
    model, the score on the last completion token, a per-token k1 KL penalty to the reference in the reward (β fixed,
    or adaptive toward ``target_kl``), GAE(γ, λ), whitened advantages, a clipped value loss with ``vf_coef`` and
    ``iterations_per_batch`` PPO epochs. One sample per prompt by default: the critic is the baseline."""

    group_size: int = Field(1, ge=1, le=MAX_GROUP, description="samples per prompt; the value model is the baseline")
    iterations_per_batch: int = Field(4, ge=1, le=100, description="PPO epochs over each rollout batch (TRL: 4)")
    beta: float = Field(0.05, ge=0, le=10, description="KL coefficient (TRL's kl_coef); the initial one when adaptive")
    kl_estimator: KLEstimatorName = "k1"
    loss_aggregation: AggregationName = "token_mean"
    target_kl: float | None = Field(None, gt=0, le=100, description="adaptive KL controller's target; None: β is fixed")
    kl_horizon: int = Field(10000, ge=1, le=10**9, description="adaptive KL controller's horizon in samples")
    gamma: float = Field(1.0, ge=0, le=1)
    lam: float = Field(0.95, ge=0, le=1, description="GAE λ")
    vf_coef: float = Field(0.1, ge=0, le=100, description="weight of the value loss, 0 to 100")
    cliprange_value: float | None = Field(
        0.2, gt=0, le=100, description="value clipping around the old values; None: off"
    )
    whiten_advantages: bool = True
    whiten_rewards: bool = False
    value_model: str | None = Field(
        None, description="base model of a separate critic; None: a second adapter on the policy's base"
    )
    value_learning_rate: float | None = Field(None, gt=0, le=1.0, description="critic's lr; None: learning_rate")
    critic: Literal["adapter", "policy_trunk"] = Field(
        "adapter",
        description="adapter: the value model is its own LoRA adapter (or value_model); policy_trunk: a value head "
        "on the policy's last hidden state (TRL ≤ 0.11's shared model), the value loss training the policy's LoRA too",
    )


class RewardModelHyperparameters(Hyperparameters):
    """Bradley–Terry reward model (Ouyang et al. 2022; TRL's RewardConfig): loss −log σ(r_chosen − r_rejected − m)
    on r from ``head`` (``trainer.loops.reward_model``). The defaults are what reached
    the best held-out pairwise accuracy on the built-in preference data (BENCHMARKS.md): the likelihood head, validation
    every 25 steps with the best checkpoint by validation accuracy kept, 10% of the pairs held out when there is no
    validation file."""

    learning_rate: float = Field(3e-4, gt=0, le=1.0)
    batch_size: int = Field(32, ge=1, le=MAX_BATCH, description=f"pairs per training step, 1 to {MAX_BATCH}")
    eval_interval: int | Auto = Field(
        25, description="training steps between validation runs; 0: only at the end; auto: as for every method"
    )
    keep_best: str | None = Field(
        "val/preference/accuracy", description="the validation metric whose best checkpoint is the result; None: last"
    )
    head: Literal["likelihood", "mean", "last"] = Field(
        "likelihood",
        description="likelihood: the tuned LM's mean log-probability of the reply times a learned scale; mean or last: "
        "a linear score head on the mean of the reply's final hidden states or on the last token's",
    )
    validation_split: float = Field(
        0.1, ge=0, lt=1, description="share of the training pairs held out for validation when no validation file"
    )
    max_length: int = Field(
        1024, ge=2, le=MAX_TOKENS, description="tokens of prompt plus completion; longer pairs are refused"
    )
    margin: float = Field(
        0.0, ge=-100, le=100, description="constant margin m, -100 to 100; a line's own 'margin' field is added to it"
    )
    center_rewards_coefficient: float | None = Field(
        None, ge=0, le=100, description="adds c·mean((r_c + r_r)²) (Eisenstein et al. 2023, arXiv 2312.09244)"
    )


class DPOHyperparameters(Hyperparameters):
    """DPO (Rafailov et al. 2023, arXiv 2305.18290): −log σ(β·((log π_c − log π_ref,c) − (log π_r − log π_ref,r))),
    the reference being the base with the adapter disabled; ``label_smoothing`` ε gives cDPO's conservative loss."""

    learning_rate: float = Field(5e-5, gt=0, le=1.0)
    beta: float = Field(0.1, gt=0, le=10, description="0 < β ≤ 10")
    label_smoothing: float = Field(0.0, ge=0, lt=0.5)
    loss_type: DPOLossType = "sigmoid"
    max_length: int = Field(
        1024, ge=2, le=MAX_TOKENS, description="tokens of prompt plus completion; longer pairs are refused"
    )


class SupervisedHyperparameters(Hyperparameters):
    """Supervised fine-tuning: next-token cross-entropy on the assistant tokens only, a token mean over the whole
    step's batch (the accumulated micro-batches give exactly the full batch's loss)."""

    learning_rate: float = Field(2e-4, gt=0, le=1.0)
    max_length: int = Field(1024, ge=2, le=MAX_TOKENS, description="tokens per example (per packed row with packing)")
    packing: bool = Field(False, description="pack examples into rows of max_length (attention kept per example)")
    group_by_length: bool = Field(True, description="batch examples of similar length (less padding)")
    assistant_turns: Literal["all", "last"] = Field(
        "all", description="train on every assistant turn (OpenAI's weight 0 excepted) or on the final one only"
    )


HYPERPARAMETERS: dict[str, type[Hyperparameters]] = {
    "grpo": GRPOHyperparameters,
    # OpenAI's name: GRPO's hyperparameters and recipe (OPENAI_ALIASES), the job keeping the name it was created with
    "reinforcement": GRPOHyperparameters,
    "dr_grpo": DrGRPOHyperparameters,
    "dapo": DAPOHyperparameters,
    "rloo": RLOOHyperparameters,
    "reinforce": ReinforceHyperparameters,
    "ppo": PPOHyperparameters,
    "reward_model": RewardModelHyperparameters,
    "dpo": DPOHyperparameters,
    "supervised": SupervisedHyperparameters,
}
METHODS: tuple[str, ...] = tuple(HYPERPARAMETERS)
RL_METHODS: tuple[str, ...] = tuple(m for m, hp in HYPERPARAMETERS.items() if issubclass(hp, RLHyperparameters))
DATA_FORMATS: dict[str, Literal["prompts", "preferences", "supervised"]] = {
    **{m: "prompts" for m in RL_METHODS},
    "reward_model": "preferences",
    "dpo": "preferences",
    "supervised": "supervised",
}
"""The dataset format (``trainer.spec.data``) each method trains on."""
OPENAI_ALIASES = {"reinforcement": "grpo"}
"""OpenAI's method names and the recipe (``trainer.spec.recipes``) each runs: a job created as ``reinforcement`` is
answered and stored as ``reinforcement`` while it trains exactly as ``grpo`` does."""


def recipe_name(method: str) -> str:
    """The recipe a method runs: its own, or for OpenAI's name the one it aliases."""
    return OPENAI_ALIASES.get(method, method)


class RLMethod(_Strict):
    """The body under ``method.<type>`` for an online RL method. ``tools`` and ``max_episode_steps`` (OpenAI's agent
    RFT), or ``environment`` (a sandboxed Python environment), make its rollouts multi-turn episodes
    (``trainer.spec.agent_spec``). ``response_format`` (OpenAI's RFT structured output) constrains every sampled
    answer, training and validation, to what the format admits."""

    grader: dict[str, Any]
    hyperparameters: dict[str, Any] = Field(default_factory=dict)
    lora: LoraSpec = Field(default_factory=LoraSpec)
    tools: list[dict[str, Any]] | None = None
    environment: dict[str, Any] | None = None
    max_episode_steps: int | None = None
    response_format: ResponseFormat = None


class TrainingMethod(_Strict):
    """The body under ``method.<type>`` for reward_model, dpo and supervised: no grader."""

    hyperparameters: dict[str, Any] = Field(default_factory=dict)
    lora: LoraSpec = Field(default_factory=LoraSpec)


class MethodSpec(BaseModel):
    """``method``: the type and its block, parsed into typed hyperparameters and (RL methods) a grader."""

    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=True)

    type: str
    hyperparameters: Hyperparameters
    grader: graders.Grader | None
    lora: LoraSpec
    agent: AgentSpec | None = None  # tools / environment: episodes instead of single replies
    response_format: ResponseFormat = None  # online RL: the format every sampled answer is constrained to

    @property
    def data_format(self) -> Literal["prompts", "preferences", "supervised"]:
        return DATA_FORMATS[self.type]

    @property
    def recipe_name(self) -> str:
        """The online RL recipe this method runs (``reinforcement`` runs ``grpo``'s)."""
        return recipe_name(self.type)

    def to_json(self) -> dict[str, Any]:
        block: dict[str, Any] = {}
        if self.grader is not None:
            block["grader"] = self.grader.model_dump(mode="json", exclude_none=True)
        block["hyperparameters"] = self.hyperparameters.model_dump(mode="json")
        block["lora"] = self.lora.model_dump(mode="json")
        if self.agent is not None:
            block |= self.agent.to_json()
        if self.response_format is not None:  # by its alias: json_schema's `schema`
            block["response_format"] = self.response_format.model_dump(mode="json", by_alias=True, exclude_none=True)
        return {"type": self.type, self.type: block}


MAX_GPUS = 64


# What a sharded base supports (``resources.shard_base``): the online RL methods, single-turn, PPO with its critic on
# the sharded base (its adapter or the policy's trunk). Every rank must run the same forward passes of the sharded
# model in the same order (each gathers its layers' weights from all ranks); an agent's episodes run a different
# number of turns on each rank.
SHARDED_METHODS = ("grpo", "reinforcement", "dr_grpo", "dapo", "rloo", "reinforce", "ppo")


class Resources(BaseModel):
    """What a job runs on: ``gpus`` devices (one rank each, data parallel: ``trainer.generation.distributed``); with
    ``shard_base`` the frozen base's weights are sharded across them (FSDP2) instead of copied to each."""

    model_config = ConfigDict(extra="forbid")

    gpus: int = Field(1, ge=1, le=MAX_GPUS)
    shard_base: bool = False
    # with shard_base: the whole base gathered on every device for each generation (one gather, not one per decode
    # step and layer); for a base that fits one device beside the generation's cache
    gather_for_generation: bool = False


class JobSpec(BaseModel):
    """A training job."""

    model_config = ConfigDict(extra="forbid")

    model: Annotated[str, Field(min_length=1)]
    training_file: Annotated[str, Field(min_length=1)]
    validation_file: str | None = None
    seed: int = Field(0, ge=0, le=2**31 - 1)
    suffix: str | None = Field(None, max_length=64)
    metadata: dict[str, str] | None = None
    method: MethodSpec
    resources: Resources | None = None  # None: one device
    # the experiment trackers the service's worker exports the run to; the trainer's own run never reads them
    integrations: list[tracking.Integration] = Field(default_factory=list)

    @field_validator("metadata")
    @classmethod
    def _metadata(cls, v: dict[str, str] | None) -> dict[str, str] | None:
        if v is not None and len(v) > 16:
            raise ValueError("at most 16 metadata pairs")
        return v

    @property
    def gpus(self) -> int:
        """How many devices (ranks) the job asked for."""
        return self.resources.gpus if self.resources is not None else 1

    @property
    def gather_for_generation(self) -> bool:
        """Whether a sharded base is gathered whole for each generation."""
        return self.resources is not None and self.resources.gather_for_generation

    @property
    def shard_base(self) -> bool:
        """Whether the base's weights are sharded across the job's devices (FSDP2) rather than copied to each."""
        return self.resources is not None and self.resources.shard_base

    @property
    def value_model(self) -> str | None:
        """PPO's separate value model, when it has one."""
        return getattr(self.method.hyperparameters, "value_model", None)

    @property
    def hyperparameters_param(self) -> str:
        """The path of the method's hyperparameters, as an error's ``param`` names them."""
        return f"method.{self.method.type}.hyperparameters"

    def to_json(self) -> dict[str, Any]:
        """The canonical JSON: what the service stores and every later reader parses back (:meth:`from_stored`)."""
        out = self.model_dump(mode="json", exclude={"method", "integrations"}, exclude_none=True)
        for flag in ("shard_base", "gather_for_generation"):  # said only when asked for: {"gpus": N} as before
            if "resources" in out and not out["resources"][flag]:
                del out["resources"][flag]
        out["method"] = self.method.to_json()
        if self.integrations:
            out["integrations"] = [i.model_dump(mode="json") for i in self.integrations]
        return out

    @classmethod
    def from_stored(cls, raw: Any) -> JobSpec:
        """A stored spec (:meth:`to_json`) parsed back, with the checks it passed when it was stored."""
        return parse_spec(raw)

    def for_trainer(self) -> JobSpec:
        """The spec the trainer's run reads: without the integrations, which are the worker's."""
        return self.model_copy(update={"integrations": []})

    def with_hyperparameters(self, values: Mapping[str, Any]) -> JobSpec:
        """The spec with some hyperparameters set (lengths fitted to a model's context or to the data, a value model's
        local folder), checked as a spec is; :class:`SpecError` naming the field otherwise."""
        hp = self.method.hyperparameters
        try:
            hp = type(hp).model_validate({**hp.model_dump(), **values})
        except ValidationError as err:
            raise _first_error(err, self.hyperparameters_param) from None
        if isinstance(hp, RLHyperparameters):
            _check_rl_method(self.method.type, hp, self.hyperparameters_param)
        return self.model_copy(update={"method": self.method.model_copy(update={"hyperparameters": hp})})

    def reward_models(self) -> list[tuple[str, str]]:
        """(param, model) of every reward_model leaf of the grader: ``model`` as the spec names it (the service's
        stored spec: the reward_model job's id)."""
        if self.method.grader is None:
            return []
        leaves = graders.keyed_leaves(self.method.grader, f"method.{self.method.type}.grader")
        return [
            (f"{param}.model", leaf.model) for _, param, leaf in leaves if isinstance(leaf, graders.RewardModelGrader)
        ]

    def with_reward_models(self, models: Mapping[str, str]) -> JobSpec:
        """The spec with each reward_model leaf's ``model`` replaced by ``models[model]`` where it is a key."""
        if self.method.grader is None:
            return self
        grader = graders.with_models(self.method.grader, models)
        return self.model_copy(update={"method": self.method.model_copy(update={"grader": grader})})


def _loc(loc: tuple[int | str, ...]) -> str:
    return ".".join(str(p) for p in loc)


def _first_error(err: ValidationError, prefix: str) -> SpecError:
    e = err.errors()[0]
    path = ".".join(p for p in (prefix, _loc(e["loc"])) if p)
    if e["type"] == "extra_forbidden":
        return SpecError("unknown field", param=path)
    if e["type"] == "missing":
        return SpecError("field required", param=path)
    msg = e["msg"].removeprefix("Value error, ")
    return SpecError(msg, param=path or None)


def _parse_method(raw: Any) -> MethodSpec:
    if not isinstance(raw, dict):
        raise SpecError("must be an object with a 'type'", param="method")
    mtype = raw.get("type")
    if not isinstance(mtype, str):
        raise SpecError("field required", param="method.type")
    key = mtype
    if key not in HYPERPARAMETERS:
        raise SpecError(f"unknown method {mtype!r}; valid: {', '.join(METHODS)}", param="method.type")
    extra = [k for k in raw if k not in ("type", mtype)]
    if extra:
        raise SpecError(f"unknown field (the method block's key must equal type {mtype!r})", param=f"method.{extra[0]}")
    if mtype not in raw:
        raise SpecError("field required", param=f"method.{mtype}")
    rl = key in RL_METHODS
    if not rl and isinstance(raw[mtype], dict) and "response_format" in raw[mtype]:
        raise SpecError(
            f"{mtype} samples no answers: response_format is for the online RL methods",
            param=f"method.{mtype}.response_format",
        )
    try:
        body: RLMethod | TrainingMethod = (RLMethod if rl else TrainingMethod).model_validate(raw[mtype])
    except ValidationError as err:
        raise _first_error(err, f"method.{mtype}") from None
    try:
        hp = HYPERPARAMETERS[key].model_validate(body.hyperparameters)
    except ValidationError as err:
        raise _first_error(err, f"method.{mtype}.hyperparameters") from None
    grader: graders.Grader | None = None
    if isinstance(body, RLMethod):
        try:
            grader = graders.parse_grader(body.grader)
        except graders.GraderError as err:
            raise SpecError(str(err), param=f"method.{mtype}.grader") from None
    if isinstance(hp, RLHyperparameters):
        _check_rl_method(key, hp, f"method.{mtype}.hyperparameters")
    agent = _parse_agent(body, f"method.{mtype}") if isinstance(body, RLMethod) else None
    fmt = body.response_format if isinstance(body, RLMethod) else None
    _check_response_format(fmt, hp, agent, f"method.{mtype}")
    return MethodSpec(type=key, hyperparameters=hp, grader=grader, lora=body.lora, agent=agent, response_format=fmt)


def _check_response_format(fmt: Format | None, hp: Hyperparameters, agent: AgentSpec | None, where: str) -> None:
    """What an online method's ``response_format`` goes with, refused naming the field."""
    if json_schema_of(fmt) is None:
        return  # plain text: nothing is constrained
    if agent is not None:
        # as chat completions refuse it with tools: an episode's turns write tool calls, which no JSON format admits
        raise SpecError(
            "response_format cannot be combined with tools or an environment: an episode's turns call tools",
            param=f"{where}.response_format",
        )
    if isinstance(hp, RLHyperparameters) and hp.min_completion_tokens > 0:
        # EOS held off while the grammar admits nothing else would leave no token to sample
        raise SpecError(
            "must be 0 with a JSON response_format: the answer ends where the JSON does",
            param=f"{where}.hyperparameters.min_completion_tokens",
        )


def _parse_agent(body: RLMethod, where: str) -> AgentSpec | None:
    """``tools`` / ``environment`` / ``max_episode_steps`` of an online method's body: None when it has neither tools
    nor an environment (``max_episode_steps`` alone is refused: it would do nothing)."""
    if body.tools is None and body.environment is None:
        if body.max_episode_steps is not None:
            raise SpecError("has no effect without tools or an environment", param=f"{where}.max_episode_steps")
        return None
    raw: dict[str, Any] = {"tools": body.tools or []}
    if body.environment is not None:
        raw["environment"] = body.environment
    if body.max_episode_steps is not None:
        raw["max_episode_steps"] = body.max_episode_steps
    try:
        return AgentSpec.model_validate(raw)
    except ValidationError as err:
        e = err.errors()[0]
        loc = _loc(e["loc"])
        msg = e["msg"].removeprefix("Value error, ")
        if not loc and ": " in msg and msg.split(": ", 1)[0].replace(".", "").replace("_", "").isalnum():
            loc, msg = msg.split(": ", 1)  # the model validator names its field at the start of its message
        if e["type"] == "extra_forbidden":
            msg = "unknown field"
        elif e["type"] == "missing":
            msg = "field required"
        raise SpecError(msg, param=f"{where}.{loc}" if loc else where) from None


def _check_rl_method(method: str, hp: RLHyperparameters, where: str) -> None:
    recipe = RECIPES[recipe_name(method)]
    scaled = hp.compute_multiplier != 1.0
    if recipe.needs_group and hp.samples_per_prompt < 2:
        raise SpecError(
            f"{recipe.name} compares samples within a group: group_size must be at least 2"
            + (f" (group_size × compute_multiplier gives {hp.samples_per_prompt})" if scaled else ""),
            param=f"{where}.{'compute_multiplier' if scaled and hp.group_size >= 2 else 'group_size'}",
        )
    if hp.min_completion_tokens > hp.max_completion_tokens:
        raise SpecError("must not exceed max_completion_tokens", param=f"{where}.min_completion_tokens")
    if isinstance(hp, ReinforceHyperparameters):
        for name in ("iterations_per_batch", "mini_batches"):
            if getattr(hp, name) != 1:
                raise SpecError("reinforce is on-policy: must be 1", param=f"{where}.{name}")
    rollout = hp.batch_size * hp.samples_per_prompt
    per_prompt = "group_size × compute_multiplier" if scaled else "group_size"
    if rollout > MAX_ROLLOUT:
        raise SpecError(
            f"batch_size × {per_prompt} = {rollout:,} sequences a step; at most {MAX_ROLLOUT:,}",
            param=f"{where}.{'compute_multiplier' if scaled else 'group_size'}",
        )
    if rollout % hp.mini_batches:
        raise SpecError(
            f"batch_size × {per_prompt} = {rollout} is not divisible into {hp.mini_batches} mini-batches",
            param=f"{where}.mini_batches",
        )
    if isinstance(hp, PPOHyperparameters) and hp.critic == "policy_trunk" and hp.value_model is not None:
        raise SpecError(
            "critic 'policy_trunk' puts the value head on the policy's own hidden states: it takes no value_model",
            param=f"{where}.critic",
        )
    overlong = hp.overlong_buffer if isinstance(hp, DAPOHyperparameters) else None
    if overlong is not None and overlong > hp.max_completion_tokens:
        raise SpecError("overlong_buffer must not exceed max_completion_tokens", param=f"{where}.overlong_buffer")


def held_out_count(n_examples: int, share: float) -> int:
    """Examples a ``validation_split`` of ``share`` holds out of ``n_examples``: at least one, never all."""
    if n_examples < 2 or share <= 0:
        return 0
    return min(max(1, round(share * n_examples)), n_examples - 1)


def trained_examples(spec: JobSpec, n_examples: int) -> int:
    """The training file's examples the run trains on: all, less a reward model's validation split when the job has
    no validation file."""
    hp = spec.method.hyperparameters
    if isinstance(hp, RewardModelHyperparameters) and spec.validation_file is None:
        return n_examples - held_out_count(n_examples, hp.validation_split)
    return n_examples


def check_total_steps(spec: JobSpec, *, n_examples: int) -> None:
    """:class:`SpecError` when a run over ``n_examples`` training examples plans more than :data:`MAX_STEPS` steps
    (``n_epochs`` passes of ``batch_size``; ``max_steps`` is bounded on its own)."""
    hp = spec.method.hyperparameters
    if (steps := hp.total_steps(trained_examples(spec, n_examples))) > MAX_STEPS:
        raise SpecError(
            f"{hp.n_epochs} epochs of {n_examples:,} examples in batches of {hp.batch_size} are {steps:,} steps; "
            f"at most {MAX_STEPS:,}: lower n_epochs or set max_steps",
            param=f"method.{spec.method.type}.hyperparameters.n_epochs",
        )


def parse_spec(raw: Any) -> JobSpec:
    """Validate a spec dict; raises :class:`SpecError` naming the first bad field."""
    if not isinstance(raw, dict):
        raise SpecError("the spec must be a JSON/YAML object")
    method = _parse_method(raw.get("method")) if "method" in raw else None
    if method is None:
        raise SpecError("field required", param="method")
    trackers = tracking.parse(raw.get("integrations"))
    try:
        spec = JobSpec.model_validate({**raw, "method": method, "integrations": trackers})
    except ValidationError as err:
        raise _first_error(err, "") from None
    if spec.shard_base:
        _check_sharded(spec)
    elif spec.resources is not None and spec.resources.gather_for_generation:
        raise SpecError(
            "gather_for_generation gathers a sharded base: it needs shard_base", param="resources.gather_for_generation"
        )
    return spec


def _check_sharded(spec: JobSpec) -> None:
    """What a job with a sharded base (``resources.shard_base``) can run, refused naming the field."""
    m = spec.method
    if spec.gpus < 2:
        raise SpecError(
            "shard_base needs gpus of 2 or more: one device holds the whole base", param="resources.shard_base"
        )
    if m.type not in SHARDED_METHODS:
        raise SpecError(f"shard_base supports {', '.join(SHARDED_METHODS)}; not {m.type}", param="resources.shard_base")
    if m.agent is not None:
        raise SpecError(
            "shard_base does not run agent (multi-turn) jobs: the ranks' episodes take different numbers of turns",
            param="resources.shard_base",
        )
    if isinstance(m.hyperparameters, PPOHyperparameters) and m.hyperparameters.value_model is not None:
        raise SpecError(
            "shard_base shards the policy's base, not a separate value_model (it would be whole on every device): "
            "leave value_model out for the critic's own adapter on the sharded base, or use critic 'policy_trunk'",
            param="resources.shard_base",
        )


def load_spec(path: Path) -> JobSpec:
    """Read a YAML or JSON spec file (YAML is a superset of JSON)."""
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise SpecError(f"{path}: not valid YAML/JSON: {err}") from None
    spec = parse_spec(raw)
    if spec.integrations:
        raise SpecError(
            "the trainer's command line exports to no experiment tracker: integrations are the service's "
            "(its worker exports a job's run)",
            param="integrations",
        )
    return spec

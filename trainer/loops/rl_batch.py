"""What the online RL loop's phases pass to each other (``trainer.loops.rl``), typed: the recipe's parts with their
knobs and its math from the registries, the graded samples of a draw, the step's batch and what scoring adds to it,
the advantages, the update's sums, and the metrics and rollout records read from a batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, NamedTuple

import torch
from torch import Tensor

from trainer.agents.episodes import Episode
from trainer.algorithms.core_algos import (
    ADVANTAGE_ESTIMATORS,
    AGGREGATIONS,
    KL_ESTIMATORS,
    POLICY_LOSSES,
    AdvantageEstimator,
    AdvantageOptions,
    Aggregation,
    ClipOptions,
    KLEstimator,
    PolicyLoss,
    masked_mean,
)
from trainer.generation.rollout import Rollout
from trainer.generation.rollout_engine import Generation
from trainer.loops.agent import episode_metrics, episode_record
from trainer.loops.engine import cat_padded
from trainer.loops.evaluate import Scores
from trainer.spec import metrics as M
from trainer.spec.config import DAPOHyperparameters, RLHyperparameters
from trainer.spec.data import PromptItem
from trainer.spec.recipes import Recipe


def _knob(hp: RLHyperparameters, name: str) -> Any:
    """A part's knob: the method's own hyperparameter when it has one, else the default of the paper that defines the
    part (DAPO's, for dynamic sampling and overlong shaping), so that any recipe row can turn the part on."""
    if name in type(hp).model_fields:
        return getattr(hp, name)
    return DAPOHyperparameters.model_fields[name].default


@dataclass(frozen=True)
class Parts:
    """What the recipe row turns on, with its knobs."""

    dynamic_sampling_batches: int | None  # draw up to this many rollout batches to fill a step; None: off
    overlong: tuple[int, float] | None  # (buffer L_cache, factor) of DAPO's soft overlong punishment; None: off
    critic: bool

    @classmethod
    def of(cls, recipe: Recipe, hp: RLHyperparameters) -> Parts:
        dynamic = recipe.dynamic_sampling and bool(_knob(hp, "dynamic_sampling"))
        factor = float(_knob(hp, "overlong_penalty"))
        buffer = _knob(hp, "overlong_buffer") or max(hp.max_completion_tokens // 4, 1)
        return cls(
            dynamic_sampling_batches=int(_knob(hp, "max_sampling_batches")) if dynamic else None,
            overlong=(int(buffer), factor) if recipe.overlong_shaping and factor > 0 else None,
            critic=recipe.critic,
        )


@dataclass(frozen=True)
class Algorithm:
    """The recipe's math, taken from the registries once: the advantage estimator, the policy loss, the loss
    aggregation and the KL estimator, with their options."""

    advantage: AdvantageEstimator
    policy_loss: PolicyLoss
    aggregate: Aggregation
    kl: KLEstimator
    adv_opts: AdvantageOptions
    clip: ClipOptions
    # With one pass over one mini-batch the policy that sampled is the policy being updated: old = logp.detach()
    # makes ρ ≡ 1 exactly (as TRL does) instead of relying on two forward passes agreeing bit for bit.
    on_policy: bool

    @classmethod
    def of(cls, recipe: Recipe, hp: RLHyperparameters) -> Algorithm:
        return cls(
            advantage=ADVANTAGE_ESTIMATORS.get(recipe.advantage),
            policy_loss=POLICY_LOSSES.get(recipe.policy_loss),
            aggregate=AGGREGATIONS.get(hp.loss_aggregation),
            kl=KL_ESTIMATORS.get(hp.kl_estimator),
            adv_opts=AdvantageOptions(
                scale=getattr(hp, "scale_rewards", "group"),
                std_eps=getattr(hp, "std_eps", 1e-4),
                baseline=getattr(hp, "baseline", "batch_mean"),
                gamma=getattr(hp, "gamma", 1.0),
                lam=getattr(hp, "lam", 1.0),
                whiten=getattr(hp, "whiten_advantages", False),
            ),
            clip=ClipOptions(hp.epsilon_low, hp.epsilon_high, hp.dual_clip),
            on_policy=hp.iterations_per_batch == 1 and hp.mini_batches == 1,
        )


class KLController:
    """The KL coefficient β: fixed, or PPO's adaptive controller toward ``target_kl`` (Ziegler et al. 2019)."""

    def __init__(self, beta: float) -> None:
        self.coef = beta

    def state_dict(self) -> float:
        return self.coef

    def load_state_dict(self, state: float) -> None:
        self.coef = float(state)


@dataclass
class Samples:
    """Graded completions, ``N = P·G`` rows, the rows of a group adjacent."""

    rollout: Rollout  # on the CPU until the batch is complete
    items: list[PromptItem]  # [N]
    texts: list[str]  # [N]
    rewards: Tensor  # [N] the reward advantages are computed from (shaped; the KL joins it in score() where so)
    grader_rewards: Tensor  # [N] the grader's reward alone
    sub: dict[str, Tensor]  # named sub-grader → [N]
    sampling_logp: Tensor | None  # [N, C] the rollout engine's log-probs, when it gives them
    episodes: list[Episode] | None = None  # [N] an agent job's episodes (transcripts, tool calls, counts)

    def select(self, rows: list[int]) -> Samples:
        idx = torch.tensor(rows, dtype=torch.long)
        logp = self.sampling_logp
        return Samples(
            self.rollout.select(idx),
            [self.items[r] for r in rows],
            [self.texts[r] for r in rows],
            self.rewards[idx],
            self.grader_rewards[idx],
            {k: v[idx] for k, v in self.sub.items()},
            logp[idx.to(logp.device)] if logp is not None else None,
            [self.episodes[r] for r in rows] if self.episodes is not None else None,
        )

    @staticmethod
    def concat(parts: list[Samples], pad_id: int) -> Samples:
        rollout = Rollout.concat([p.rollout for p in parts], pad_id)
        logps = [p.sampling_logp for p in parts]
        width = rollout.completion_ids.shape[1]
        return Samples(
            rollout,
            [it for p in parts for it in p.items],
            [t for p in parts for t in p.texts],
            torch.cat([p.rewards for p in parts]),
            torch.cat([p.grader_rewards for p in parts]),
            {name: torch.cat([p.sub[name] for p in parts]) for name in parts[0].sub},
            cat_padded([lp for lp in logps if lp is not None], width) if all(lp is not None for lp in logps) else None,
            [e for p in parts for e in p.episodes or []] if all(p.episodes is not None for p in parts) else None,
        )


@dataclass(frozen=True)
class Graded:
    """One completion per prompt (an agent job: one episode), graded: the generation, its rows on the CPU, their
    texts, the grader's scores and the episodes."""

    generation: Generation
    rollout: Rollout
    texts: list[str]
    scores: Scores
    episodes: list[Episode] | None


@dataclass(frozen=True)
class Draw:
    """A draw's graded (and shaped) samples, and the seconds its generation took."""

    samples: Samples
    seconds: float


@dataclass
class DrawStats:
    groups_sampled: int = 0
    groups_zero_std: int = 0
    sampling_batches: int = 0
    generation_s: float = 0.0


@dataclass
class Batch:
    """The step's training batch: the samples on the training device and what score() adds."""

    samples: Samples
    draws: DrawStats
    loss_mask: Tensor  # [N, C] float: the policy's tokens, less truncated completions when they are masked
    old_logp: Tensor | None = None  # [N, C] behaviour log-probs (when the ratio or the KL needs them)
    ref_logp: Tensor | None = None  # [N, C]
    values: Tensor | None = None  # [N, C] the critic's V at sampling time
    token_rewards: Tensor | None = None  # [N, C] a critic's per-token rewards (score on the last policy token, −β·KL)
    seq_kl: Tensor | None = None  # [N] Σ_t KL_t over the policy's tokens (a critic's KL controller tracks it)

    @property
    def rollout(self) -> Rollout:
        return self.samples.rollout

    def __len__(self) -> int:
        return len(self.samples.items)


@dataclass
class Sums:
    """Per-step sums over micro-batches; turned into means by :meth:`trainer.loops.rl_update.Updater.optimise`."""

    tokens: float = 0.0
    clip_low: float = 0.0
    clip_high: float = 0.0
    clip_dual: float = 0.0
    approx_kl: float = 0.0
    entropy: float = 0.0
    entropy_tokens: float = 0.0
    kl: float = 0.0
    kl_tokens: float = 0.0
    loss_policy: float = 0.0
    loss_kl: float = 0.0
    loss_value: float = 0.0
    value_clipped: float = 0.0
    grad_norm: float = 0.0
    optimizer_steps: float = 0.0
    train_tokens: int = 0

    def add(self, other: Sums) -> None:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))


SUMMED_ACROSS_RANKS = tuple(
    f.name for f in fields(Sums) if f.name not in ("grad_norm", "optimizer_steps")
)  # each rank's share of a step; the gradient norm and step count are every rank's alike


@dataclass(frozen=True)
class Advantages:
    per_row: Tensor  # [N] or [N, C] on the training device
    returns: Tensor | None  # [N, C] the critic's targets
    metrics: dict[str, float] = field(default_factory=dict)


class UpdateForward(NamedTuple):
    """The update's forward of some rows: the policy's log-probs [B, C] with the graph, their entropy [B, C] (no
    graph) when asked, and V [B, C] with the graph where it comes with the policy's pass (a fused or trunk critic)."""

    logp: Tensor
    entropy: Tensor | None
    values: Tensor | None


def batch_metrics(
    batch: Batch,
    *,
    group_size: int,
    dynamic_sampling: bool,
    beta: float,
    lr: float,
    kl_coef: float,
    reward_clip: float | None = None,
) -> dict[str, float]:
    """Rewards, lengths and sampling statistics of the step's batch."""
    n, d, s = len(batch), batch.draws, batch.samples
    lengths = batch.rollout.lengths.float()
    m = {
        M.REWARD_MEAN: _mean(s.grader_rewards),
        M.REWARD_STD: _std(s.grader_rewards),
        M.COMPLETION_LEN_MEAN: _mean(lengths),
        M.COMPLETION_LEN_MAX: float(lengths.max()) if n else 0.0,
        M.TRUNCATED_FRAC: _mean(batch.rollout.truncated.float()),
        M.GROUPS_ZERO_STD_FRAC: d.groups_zero_std / max(d.groups_sampled, 1),
        M.LEARNING_RATE: lr,
        M.GENERATION_SECONDS: d.generation_s,
    }
    for name, v in s.sub.items():
        m[M.reward_of(name)] = _mean(v)
    if dynamic_sampling:
        m[M.GROUPS_DROPPED] = float(d.groups_sampled - n // group_size)
        m[M.SAMPLING_BATCHES] = float(d.sampling_batches)
    if beta > 0:
        m[M.KL_COEF] = kl_coef
    if reward_clip is not None:
        m[M.REWARD_CLIP_FRAC] = _mean((s.grader_rewards.abs() > reward_clip).float())
    m[M.TOKENS_PER_S_GENERATION] = float(lengths.sum()) / max(d.generation_s, 1e-9) if n else 0.0
    if s.episodes is not None:
        m |= episode_metrics(s.episodes)
    return m


def rollout_records(batch: Batch, adv: Tensor, k: int) -> list[dict[str, Any]]:
    """The first ``k`` samples with their rewards and (sequence-mean) advantages."""
    s = batch.samples
    seq_adv = (masked_mean(adv, batch.rollout.policy_mask.float(), dim=-1) if adv.dim() == 2 else adv).cpu()
    return [
        {
            "prompt": s.items[i].messages,
            "completion": s.texts[i],
            "reward": float(s.grader_rewards[i]),
            "rewards": {name: float(v[i]) for name, v in s.sub.items()},
            "advantage": float(seq_adv[i]),
            "length": int(batch.rollout.lengths[i]),
        }
        | ({"episode": episode_record(s.episodes[i])} if s.episodes is not None else {})
        for i in range(min(k, len(s.texts)))
    ]


def _mean(x: Tensor) -> float:
    return float(x.float().mean()) if x.numel() else 0.0


def _std(x: Tensor) -> float:
    return float(x.float().std()) if x.numel() > 1 else 0.0

"""The metric vocabulary: every per-step metric name, defined once and shared by trainer, database, API, CSV and
dashboard. Per-grader series are built with :func:`reward_of`."""

from __future__ import annotations

REWARD_MEAN = "reward/mean"
REWARD_STD = "reward/std"
ADVANTAGE_MEAN = "advantage/mean"
ADVANTAGE_STD = "advantage/std"
KL_MEAN = "kl/mean"  # estimator of KL(π‖π_ref) chosen by `kl_estimator`, mean over completion tokens
ENTROPY_MEAN = "entropy/mean"  # mean per-token entropy of the policy over completion tokens
CLIP_FRAC_LOW = "clip_frac/low"  # fraction of tokens with A < 0 and ρ < 1 − ε_low
CLIP_FRAC_HIGH = "clip_frac/high"  # fraction of tokens with A > 0 and ρ > 1 + ε_high
CLIP_FRAC_DUAL = "clip_frac/dual"  # fraction of tokens where the dual clip caps the loss
APPROX_KL = "approx_kl"  # ½·mean((log π − log π_old)²): how far the updates moved from the behaviour policy
LOSS_POLICY = "loss/policy"
LOSS_KL = "loss/kl"  # β · aggregated KL term (0 when the KL is in the reward or β = 0)
LOSS_TOTAL = "loss/total"
GRAD_NORM = "grad_norm"  # before clipping, mean over the optimiser steps of the training step
COMPLETION_LEN_MEAN = "completion_len/mean"
COMPLETION_LEN_MAX = "completion_len/max"
TRUNCATED_FRAC = "completion/truncated_frac"  # completions that hit max_completion_tokens without EOS
GROUPS_DROPPED = "groups/dropped"  # DAPO dynamic sampling: groups with all-equal rewards left out
GROUPS_ZERO_STD_FRAC = "groups/zero_std_frac"  # fraction of sampled groups whose rewards were all equal
SAMPLING_BATCHES = "groups/sampling_batches"  # rollout batches drawn to fill this step
TOKENS_PER_S_GENERATION = "throughput/generation_tokens_per_s"
TOKENS_PER_S_TRAINING = "throughput/training_tokens_per_s"
STEP_SECONDS = "time/step_s"
GENERATION_SECONDS = "time/generation_s"
LEARNING_RATE = "lr"
KL_COEF = "kl/coef"
VAL_REWARD_MEAN = "val/reward/mean"

# PPO's value model (GAE advantages; the KL penalty is in the per-token reward)
LOSS_VALUE = "loss/value"  # ½·max((V − R)², (V_clipped − R)²), token mean, before vf_coef
VALUE_MEAN = "value/mean"  # mean V over completion tokens at sampling time
RETURNS_MEAN = "returns/mean"  # mean GAE return R = A + V over completion tokens
EXPLAINED_VARIANCE = "value/explained_variance"  # 1 − Var(R − V)/Var(R) over completion tokens
VALUE_CLIP_FRAC = "value/clip_frac"  # fraction of tokens where the clipped value loss is the larger one
NON_SCORE_REWARD = "reward/non_score"  # mean over sequences of Σ_t −β·KL_t: the KL part of the return

# Preference methods (reward_model, dpo) and supervised; the training loss is LOSS_TOTAL
PREFERENCE_ACCURACY = "preference/accuracy"  # fraction of pairs whose chosen reward beats the rejected one
PREFERENCE_MARGIN = "preference/margin"  # mean r_chosen − r_rejected (DPO: of the implicit rewards)
REWARDS_CHOSEN = "rewards/chosen"  # mean reward of the chosen completions (DPO: β·(log π − log π_ref))
REWARDS_REJECTED = "rewards/rejected"
TOKEN_ACCURACY = "token_accuracy"  # supervised: argmax next-token accuracy on the trained (assistant) tokens
VAL_LOSS = "val/loss"

TIMING_METRICS = frozenset({TOKENS_PER_S_GENERATION, TOKENS_PER_S_TRAINING, STEP_SECONDS, GENERATION_SECONDS})
"""Wall-clock metrics: everything else is a deterministic function of the seed on a given machine."""


def validation(name: str) -> str:
    """The validation series of a training metric, e.g. ``val/preference/accuracy``."""
    return f"val/{name}"


def reward_of(grader: str, *, validation: bool = False) -> str:
    """Per named sub-grader reward series, e.g. ``reward/accuracy/mean`` or ``val/reward/accuracy/mean``."""
    return f"{'val/' if validation else ''}reward/{grader}/mean"

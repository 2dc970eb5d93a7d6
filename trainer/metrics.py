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

TIMING_METRICS = frozenset({TOKENS_PER_S_GENERATION, TOKENS_PER_S_TRAINING, STEP_SECONDS, GENERATION_SECONDS})
"""Wall-clock metrics: everything else is a deterministic function of the seed on a given machine."""


def reward_of(grader: str, *, validation: bool = False) -> str:
    """Per named sub-grader reward series, e.g. ``reward/accuracy/mean`` or ``val/reward/accuracy/mean``."""
    return f"{'val/' if validation else ''}reward/{grader}/mean"

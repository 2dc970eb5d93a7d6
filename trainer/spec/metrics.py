"""The metric vocabulary: every per-step metric name, defined once and shared by trainer, database, API, CSV and
dashboard.

A name is defined here with its unit and meaning (:func:`_metric`); series named by a parameter, such as one reward
per named sub-grader, are a :class:`Family` (:data:`REWARD_OF_GRADER`, built with :func:`reward_of`). The dashboard
receives :func:`vocabulary` as an ES module generated from this file (``api/routes/dashboard.py``) and imports the
names it charts from it by their constant names here, so it cannot chart a name the trainer does not define.

This module imports only the standard library: the API process serves it and must not import torch.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any


@dataclass(frozen=True)
class Metric:
    name: str
    description: str
    unit: str  # "" for a ratio, fraction or other plain number
    timing: bool  # wall-clock: differs between two runs of the same seed on the same machine


@dataclass(frozen=True)
class Family:
    """Series named by one parameter, e.g. ``reward/{grader}/mean`` with one series per named sub-grader."""

    pattern: str  # the name with one ``{<parameter>}`` placeholder
    description: str
    unit: str = ""

    @property
    def parameter(self) -> str:
        return _placeholder(self.pattern).group(1)

    @property
    def regex(self) -> str:
        """A regular expression that Python's ``re`` and JavaScript's ``RegExp`` read alike; group 1 is the parameter.
        The parameter may hold ``/``: a sub-grader's name is the user's."""
        head, tail = self.pattern.split(_placeholder(self.pattern).group(0))
        return f"^{re.escape(head)}(.+){re.escape(tail)}$"

    def name(self, value: str) -> str:
        return self.pattern.replace(_placeholder(self.pattern).group(0), value)

    def parameter_of(self, name: str) -> str | None:
        """The parameter's value if ``name`` is of this family, else None."""
        m = re.fullmatch(self.regex, name)
        return m.group(1) if m else None


def _placeholder(pattern: str) -> re.Match[str]:
    found = list(re.finditer(r"\{(\w+)\}", pattern))
    assert len(found) == 1, f"a family pattern has exactly one placeholder: {pattern!r}"
    return found[0]


_METRICS: dict[str, Metric] = {}


def _metric(name: str, description: str, *, unit: str = "", timing: bool = False) -> str:
    """Define a metric; returns its name, so that the constant below is the name itself."""
    assert name not in _METRICS, f"metric {name!r} defined twice"
    _METRICS[name] = Metric(name=name, description=description, unit=unit, timing=timing)
    return name


# -- online RL (grpo, dr_grpo, dapo, rloo, reinforce, ppo) ---------------------------------------------------------
REWARD_MEAN = _metric("reward/mean", "mean grader reward over the step's sampled completions")
REWARD_STD = _metric("reward/std", "standard deviation of the grader reward over the step's sampled completions")
ADVANTAGE_MEAN = _metric("advantage/mean", "mean advantage over the trained completion tokens")
ADVANTAGE_STD = _metric("advantage/std", "standard deviation of the advantage over the trained completion tokens")
KL_MEAN = _metric("kl/mean", "estimate of KL(π‖π_ref) chosen by `kl_estimator`, mean over completion tokens")
ENTROPY_MEAN = _metric("entropy/mean", "mean per-token entropy of the policy over completion tokens", unit="nats")
CLIP_FRAC_LOW = _metric("clip_frac/low", "fraction of tokens with A < 0 and ρ < 1 − ε_low")
CLIP_FRAC_HIGH = _metric("clip_frac/high", "fraction of tokens with A > 0 and ρ > 1 + ε_high")
CLIP_FRAC_DUAL = _metric("clip_frac/dual", "fraction of tokens where the dual clip caps the loss")
APPROX_KL = _metric("approx_kl", "½·mean((log π − log π_old)²): how far the updates moved from the behaviour policy")
LOSS_POLICY = _metric("loss/policy", "policy-gradient loss, mean over the optimiser steps of the training step")
LOSS_KL = _metric("loss/kl", "β · aggregated KL term (0 when the KL is in the reward or β = 0)")
LOSS_TOTAL = _metric("loss/total", "the training loss that was minimised, mean over the step's optimiser steps")
GRAD_NORM = _metric("grad_norm", "gradient norm before clipping, mean over the optimiser steps of the training step")
COMPLETION_LEN_MEAN = _metric("completion_len/mean", "mean completion length", unit="tokens")
COMPLETION_LEN_MAX = _metric("completion_len/max", "longest completion", unit="tokens")
TRUNCATED_FRAC = _metric(
    "completion/truncated_frac", "fraction of completions that hit max_completion_tokens without EOS"
)
GROUPS_DROPPED = _metric("groups/dropped", "DAPO dynamic sampling: groups with all-equal rewards left out")
GROUPS_ZERO_STD_FRAC = _metric("groups/zero_std_frac", "fraction of sampled groups whose rewards were all equal")
SAMPLING_BATCHES = _metric("groups/sampling_batches", "DAPO dynamic sampling: rollout batches drawn to fill this step")
TOKENS_PER_S_GENERATION = _metric(
    "throughput/generation_tokens_per_s", "completion tokens sampled per second", unit="tokens/s", timing=True
)
TOKENS_PER_S_TRAINING = _metric(
    "throughput/training_tokens_per_s", "tokens through forward and backward per second", unit="tokens/s", timing=True
)
STEP_SECONDS = _metric("time/step_s", "wall-clock time of the training step", unit="s", timing=True)
GENERATION_SECONDS = _metric("time/generation_s", "wall-clock time of the step's sampling", unit="s", timing=True)
LEARNING_RATE = _metric("lr", "learning rate of the step, after warm-up and schedule")
KL_COEF = _metric("kl/coef", "the KL coefficient β in effect (PPO's adaptive controller moves it)")
VAL_REWARD_MEAN = _metric(
    "val/reward/mean", "mean reward on the validation prompts (greedy; with eval_samples > 1, of the samples)"
)
GRADER_ERROR_RATE = _metric(
    "grader/error_rate",
    "fraction of the step's sampled completions the grader produced no score for (a python grader that raised or "
    "returned no finite number, a sandbox timeout, CPU limit or crash, a grading timeout); each scored 0",
)

# Agent episodes (tools or an environment): the step's sampled episodes
EPISODE_TURNS_MEAN = _metric("episode/turns_mean", "mean model turns per episode")
EPISODE_TOOL_CALLS_MEAN = _metric("episode/tool_calls_mean", "mean tool calls per episode")
EPISODE_TOOL_CALL_RATE = _metric("episode/tool_call_rate", "fraction of episodes that called a tool at least once")
EPISODE_FORMAT_ERROR_FRAC = _metric(
    "episode/format_error_frac", "fraction of episodes ended by a turn whose tool call did not parse"
)
EPISODE_TRUNCATED_FRAC = _metric(
    "episode/truncated_frac", "fraction of episodes ended by max_episode_steps or the token budget before an answer"
)
EPISODE_POLICY_TOKENS_MEAN = _metric(
    "episode/policy_tokens_mean", "mean tokens the policy wrote per episode", unit="tokens"
)
EPISODE_TOOL_TOKENS_MEAN = _metric(
    "episode/tool_tokens_mean", "mean tokens of tool results and template per episode (not trained)", unit="tokens"
)
TOOL_ERROR_RATE = _metric(
    "tools/error_rate", "fraction of the step's tool calls that failed (timeout, HTTP error, bad answer, unknown tool)"
)
TOOL_LATENCY_MEAN = _metric("tools/latency_s", "mean wall time of the step's tool calls", unit="s", timing=True)
VAL_EPISODE_TOOL_CALL_RATE = _metric(
    "val/episode/tool_call_rate", "fraction of greedy validation episodes that called a tool"
)

# PPO's value model (GAE advantages; the KL penalty is in the per-token reward)
LOSS_VALUE = _metric("loss/value", "½·max((V − R)², (V_clipped − R)²), token mean, before vf_coef")
VALUE_MEAN = _metric("value/mean", "mean V over completion tokens at sampling time")
RETURNS_MEAN = _metric("returns/mean", "mean GAE return R = A + V over completion tokens")
EXPLAINED_VARIANCE = _metric("value/explained_variance", "1 − Var(R − V)/Var(R) over completion tokens")
VALUE_CLIP_FRAC = _metric("value/clip_frac", "fraction of tokens where the clipped value loss is the larger one")
REWARD_CLIP_FRAC = _metric("reward/clip_frac", "fraction of samples whose reward was clipped to ±reward_clip")
VAL_OVEROPTIMISATION = _metric(
    "val/overoptimisation",
    "how far the held-out graders' validation mean (a multi's sub-graders its formula does not read) has fallen "
    "below its best while the trained reward's validation mean stands above its value at that best; 0 otherwise",
)
NON_SCORE_REWARD = _metric("reward/non_score", "mean over sequences of Σ_t −β·KL_t: the KL part of the return")

# Preference methods (reward_model, dpo) and supervised; the training loss is LOSS_TOTAL
PREFERENCE_ACCURACY = _metric("preference/accuracy", "fraction of pairs whose chosen reward beats the rejected one")
PREFERENCE_MARGIN = _metric("preference/margin", "mean r_chosen − r_rejected (DPO: of the implicit rewards)")
REWARDS_CHOSEN = _metric("rewards/chosen", "mean reward of the chosen completions (DPO: β·(log π − log π_ref))")
REWARDS_REJECTED = _metric("rewards/rejected", "mean reward of the rejected completions (DPO: β·(log π − log π_ref))")
TOKEN_ACCURACY = _metric("token_accuracy", "supervised: argmax next-token accuracy on the trained (assistant) tokens")
VAL_LOSS = _metric("val/loss", "the training loss on the validation set")
VAL_PREFERENCE_ACCURACY = _metric("val/preference/accuracy", "preference/accuracy on the validation pairs")
VAL_PREFERENCE_MARGIN = _metric("val/preference/margin", "preference/margin on the validation pairs")
VAL_REWARDS_CHOSEN = _metric("val/rewards/chosen", "rewards/chosen on the validation pairs")
VAL_REWARDS_REJECTED = _metric("val/rewards/rejected", "rewards/rejected on the validation pairs")
VAL_TOKEN_ACCURACY = _metric("val/token_accuracy", "token_accuracy on the validation examples")

# Series per named sub-grader of a `multi` grader
REWARD_OF_GRADER = Family("reward/{grader}/mean", "mean reward of one named sub-grader over the sampled completions")
VAL_REWARD_OF_GRADER = Family("val/reward/{grader}/mean", "greedy mean reward of one named sub-grader on validation")

# Series per kind of preference pair (a line's optional "kind")
VAL_PREFERENCE_ACCURACY_OF_KIND = Family(
    "val/preference/accuracy/{kind}", "preference/accuracy on the validation pairs of one kind (a line's 'kind')"
)

# Series per tool of an agent job
TOOL_CALLS_OF = Family("tools/{tool}/calls", "mean calls of one tool per episode")
TOOL_ERRORS_OF = Family("tools/{tool}/errors", "failed calls of one tool in the step")
TOOL_LATENCY_OF = Family("tools/{tool}/latency_s", "mean wall time of one tool's calls", unit="s")

METRICS: Mapping[str, Metric] = MappingProxyType(_METRICS)
"""Every metric name that is not of a family, with its definition."""
FAMILIES: tuple[Family, ...] = (
    REWARD_OF_GRADER,
    VAL_REWARD_OF_GRADER,
    VAL_PREFERENCE_ACCURACY_OF_KIND,
    TOOL_CALLS_OF,
    TOOL_ERRORS_OF,
    TOOL_LATENCY_OF,
)

TIMING_METRICS = frozenset(m.name for m in _METRICS.values() if m.timing)
"""Wall-clock metrics: everything else is a deterministic function of the seed on a given machine."""


def validation(name: str) -> str:
    """The validation series of a training metric, e.g. ``val/preference/accuracy``; it must be defined above."""
    val = f"val/{name}"
    if val not in _METRICS:
        known = sorted(n for n in _METRICS if n.startswith("val/"))
        raise ValueError(f"{name!r} has no validation series in trainer/spec/metrics.py; defined: {', '.join(known)}")
    return val


def reward_of(grader: str, *, validation: bool = False) -> str:
    """Per named sub-grader reward series, e.g. ``reward/accuracy/mean`` or ``val/reward/accuracy/mean``."""
    return (VAL_REWARD_OF_GRADER if validation else REWARD_OF_GRADER).name(grader)


def is_known(name: str) -> bool:
    """Whether ``name`` is a metric of this vocabulary, exactly or as a member of a family."""
    return name in _METRICS or any(f.parameter_of(name) is not None for f in FAMILIES)


def _constants() -> dict[str, str | Family]:
    """The module's public constants (``REWARD_MEAN`` → ``"reward/mean"``), the names other languages use too."""
    out: dict[str, str | Family] = {}
    for key, value in globals().items():
        if key.isupper() and (isinstance(value, Family) or (isinstance(value, str) and value in _METRICS)):
            out[key] = value
    return out


def vocabulary() -> dict[str, Any]:
    """The vocabulary as JSON-able data: ``metrics`` and ``families`` (with a regex whose group 1 is the parameter),
    each with the constant name it has here, so that the dashboard imports the same names."""
    constants = _constants()
    constant_of = {value if isinstance(value, str) else value.pattern: key for key, value in constants.items()}
    return {
        "metrics": [
            {
                "constant": constant_of[m.name],
                "name": m.name,
                "description": m.description,
                "unit": m.unit,
                "timing": m.timing,
            }
            for m in _METRICS.values()
        ],
        "families": [
            {
                "constant": constant_of[f.pattern],
                "pattern": f.pattern,
                "parameter": f.parameter,
                "regex": f.regex,
                "description": f.description,
                "unit": f.unit,
            }
            for f in FAMILIES
        ],
    }

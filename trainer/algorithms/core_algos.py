"""The math of policy optimisation: small pure tensor functions, chosen by name from registries.

Shapes: ``P`` prompts, ``G`` samples per prompt (group size), ``B`` sequences in a (micro-)batch, ``T`` completion
tokens (right padded). A ``mask`` is 1 on the completion tokens that count (up to and including the first EOS) and 0
elsewhere; it is always built from generation lengths, never from token values (pad may equal EOS).

Every registry has one typed signature; the registry is the only way a recipe picks a function, and an unknown name
is an error listing the valid ones.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Generic, Literal, TypeVar

import torch
from torch import Tensor

from trainer.spec import names

F = TypeVar("F", bound=Callable[..., object])


class Registry(Generic[F]):
    """Name → function. ``get`` of an unknown name raises ``KeyError`` naming the valid choices.

    The names are declared up front (``trainer.spec.names``, which torch-free code validates against): registering an
    undeclared name fails, and :meth:`check_complete`, called once this module has registered everything, fails on a
    declared name without a function."""

    def __init__(self, kind: str, declared: tuple[str, ...]) -> None:
        self.kind = kind
        self.declared = declared
        self._items: dict[str, F] = {}

    def register(self, name: str) -> Callable[[F], F]:
        if name not in self.declared:
            raise ValueError(f"{self.kind} {name!r} is not declared in trainer.spec.names")

        def deco(fn: F) -> F:
            if name in self._items:
                raise ValueError(f"{self.kind} {name!r} is registered twice")
            self._items[name] = fn
            return fn

        return deco

    def check_complete(self) -> None:
        missing = [n for n in self.declared if n not in self._items]
        if missing:
            raise ValueError(
                f"{self.kind} {', '.join(map(repr, missing))} declared in trainer.spec.names but not registered"
            )

    def get(self, name: str) -> F:
        try:
            return self._items[name]
        except KeyError:
            raise KeyError(f"unknown {self.kind} {name!r}; valid: {', '.join(sorted(self._items))}") from None

    def names(self) -> list[str]:
        return sorted(self._items)

    def __contains__(self, name: object) -> bool:
        return name in self._items

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self._items))


# ---------------------------------------------------------------------------------------------------------------
# Masked reductions and log-probs
# ---------------------------------------------------------------------------------------------------------------


def masked_sum(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Σ x·m, with masked positions zeroed by ``where`` first so that a NaN/inf there cannot leak (NaN·0 = NaN)."""
    x = torch.where(mask.bool(), x, torch.zeros((), dtype=x.dtype, device=x.device))
    return x.sum() if dim is None else x.sum(dim)


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Σ x·m / Σ m (0 where Σ m = 0)."""
    n = mask.sum() if dim is None else mask.sum(dim)
    return masked_sum(x, mask, dim) / n.clamp(min=1)


def masked_whiten(x: Tensor, mask: Tensor, *, shift_mean: bool = True, eps: float = 1e-8) -> Tensor:
    """(x − mean) / sqrt(var + eps) over masked entries, var unbiased (Bessel); masked positions set to 0.

    As TRL's and verl's ``masked_whiten``; with ``shift_mean=False`` the mean is added back.
    """
    n = mask.sum()
    if n < 2:
        raise ValueError("masked_whiten needs at least two unmasked values")
    mean = masked_mean(x, mask)
    var = masked_sum((x - mean) ** 2, mask) / (n - 1)
    out = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return torch.where(mask.bool(), out, torch.zeros_like(out))


def selective_log_softmax(logits: Tensor, ids: Tensor) -> Tensor:
    """log softmax(logits)[ids] in fp32. logits [..., V], ids [...] → [...].

    gather − logsumexp on fp32 logits: bf16 logsumexp is not accurate enough for importance ratios.
    """
    logits = logits.float()
    picked = torch.gather(logits, -1, ids.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)


def candidate_logprobs(logits: Tensor, targets: Tensor) -> Tensor:
    """log softmax(logits)[targets] in fp32 for K candidates a position: logits [..., V], targets [..., K] → [..., K]
    (:func:`selective_log_softmax` with one logsumexp shared by the K candidates)."""
    logits = logits.float()
    return torch.gather(logits, -1, targets) - torch.logsumexp(logits, dim=-1, keepdim=True)


def entropy_from_logits(logits: Tensor) -> Tensor:
    """H = logsumexp(z) − Σ softmax(z)·z per position, fp32. logits [..., V] → [...]."""
    logits = logits.float()
    p = torch.softmax(logits, dim=-1)
    # A −inf logit is a zero-probability token: 0·(−inf) would be NaN, so it is left out of the sum.
    return torch.logsumexp(logits, dim=-1) - torch.where(p > 0, p * logits, 0.0).sum(-1)


# ---------------------------------------------------------------------------------------------------------------
# KL estimators (Schulman, "Approximating KL divergence", http://joschu.net/blog/kl-approx.html)
# ---------------------------------------------------------------------------------------------------------------

KLEstimator = Callable[[Tensor, Tensor], Tensor]
KL_ESTIMATORS: Registry[KLEstimator] = Registry("kl estimator", names.KL_ESTIMATORS)


@KL_ESTIMATORS.register("k1")
def kl_k1(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """k1 = log π − log π_ref per token [B, T]; unbiased for KL(π‖π_ref) under x ~ π, can be negative."""
    return logp - ref_logp


@KL_ESTIMATORS.register("k2")
def kl_k2(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """k2 = ½ (log π − log π_ref)² per token [B, T]; ≥ 0, its gradient is the reverse-KL gradient (log-ratio clamped
    to ±20 as for k3)."""
    return 0.5 * (logp - ref_logp).clamp(-20.0, 20.0) ** 2


@KL_ESTIMATORS.register("k3")
def kl_k3(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """k3 = exp(ref − logp) − (ref − logp) − 1 per token [B, T]; ≥ 0, unbiased, low variance (DeepSeekMath's KL).

    The log-ratio is clamped to ±20 as verl does, so one far-off token cannot overflow exp.
    """
    d = (ref_logp - logp).clamp(-20.0, 20.0)
    return torch.exp(d) - d - 1.0


# ---------------------------------------------------------------------------------------------------------------
# Advantage estimators: (AdvantageInputs, AdvantageOptions) → AdvantageOutput. The group estimators are the math
# functions rewards [P, G] → advantages [P, G] (one scalar per sample, broadcast over its tokens), registered through
# ``_per_sequence``; GAE gives per-token advantages and the critic's returns.
# ---------------------------------------------------------------------------------------------------------------

ZERO_STD = 1e-6
"""Groups whose reward std is below this are treated as all-equal (fp residue, e.g. of 0.35 rewards, would
otherwise be blown up by the division; NeMo-RL PR 4161) and get advantage 0."""


@dataclass(frozen=True)
class AdvantageOptions:
    """Options of the estimators. ``scale``: GRPO's std division (``group`` as in DeepSeekMath, ``batch`` as in
    LitePPO, ``none`` as in Dr. GRPO). ``std_eps``: added to the std (TRL 1e-4). ``baseline``: REINFORCE's."""

    scale: Literal["group", "batch", "none"] = "group"
    std_eps: float = 1e-4
    baseline: Literal["none", "batch_mean"] = "batch_mean"
    gamma: float = 1.0  # GAE's discount
    lam: float = 0.95  # GAE's λ
    whiten: bool = True  # GAE: whiten the advantages over the batch's trained tokens


@dataclass(frozen=True)
class AdvantageInputs:
    """What an estimator reads; ``N = P·G`` rows, the rows of a group adjacent."""

    rewards: Tensor  # [N] sequence rewards
    group_size: int  # G
    mask: Tensor  # [N, C] the policy's tokens (need not be a prefix: an episode's environment tokens are 0)
    token_rewards: Tensor | None = None  # [N, C] per-token rewards (a critic's methods)
    values: Tensor | None = None  # [N, C] the critic's V at sampling time


@dataclass(frozen=True)
class AdvantageOutput:
    advantages: Tensor  # [N] one per sequence, or [N, C] per token
    returns: Tensor | None = None  # [N, C] the critic's regression targets (GAE)


AdvantageEstimator = Callable[[AdvantageInputs, AdvantageOptions], AdvantageOutput]
ADVANTAGE_ESTIMATORS: Registry[AdvantageEstimator] = Registry("advantage estimator", names.ADVANTAGE_ESTIMATORS)


def _per_sequence(fn: Callable[[Tensor, AdvantageOptions], Tensor]) -> AdvantageEstimator:
    """A group estimator [P, G] → [P, G] as a registry entry: the [N] rewards viewed as groups, one advantage a row."""

    def estimator(x: AdvantageInputs, opts: AdvantageOptions) -> AdvantageOutput:
        return AdvantageOutput(fn(x.rewards.view(-1, x.group_size), opts).reshape(-1))

    estimator.__doc__ = fn.__doc__
    return estimator


def _group_stats(rewards: Tensor) -> tuple[Tensor, Tensor]:
    mean = rewards.mean(dim=1, keepdim=True)
    std = rewards.std(dim=1, keepdim=True, unbiased=True) if rewards.shape[1] > 1 else torch.zeros_like(mean)
    return mean, std


def advantage_grpo(rewards: Tensor, opts: AdvantageOptions) -> Tensor:
    """A_i = (r_i − mean_g) / (std_g + eps), std unbiased (DeepSeekMath, arXiv 2402.03300). [P, G] → [P, G].

    ``opts.scale``: ``group`` divides by the group std, ``batch`` by the std of all rewards, ``none`` not at all.
    All-equal groups get exactly 0.
    """
    mean, std = _group_stats(rewards)
    centred = rewards - mean
    if opts.scale == "group":
        adv = centred / (std + opts.std_eps)
    elif opts.scale == "batch":
        adv = centred / (rewards.std(unbiased=True) + opts.std_eps) if rewards.numel() > 1 else centred
    else:
        adv = centred
    return torch.where(std < ZERO_STD, torch.zeros_like(adv), adv)


def advantage_dr_grpo(rewards: Tensor, opts: AdvantageOptions) -> Tensor:
    """A_i = r_i − mean_g: GRPO without the std division (Dr. GRPO, arXiv 2503.20783). [P, G] → [P, G]."""
    mean, std = _group_stats(rewards)
    adv = rewards - mean
    return torch.where(std < ZERO_STD, torch.zeros_like(adv), adv)


def advantage_rloo(rewards: Tensor, opts: AdvantageOptions) -> Tensor:
    """A_i = r_i − (1/(G−1)) Σ_{j≠i} r_j = G/(G−1)·(r_i − mean_g) (Ahmadian et al. 2024, arXiv 2402.14740).

    [P, G] → [P, G]; needs G ≥ 2.
    """
    g = rewards.shape[1]
    if g < 2:
        raise ValueError("RLOO needs a group of at least 2 samples per prompt")
    loo_baseline = (rewards.sum(dim=1, keepdim=True) - rewards) / (g - 1)
    return rewards - loo_baseline


def advantage_reinforce(rewards: Tensor, opts: AdvantageOptions) -> Tensor:
    """A_i = r_i − b with b = 0 (``baseline='none'``) or the batch mean (Williams 1992). [P, G] → [P, G]."""
    if opts.baseline == "none":
        return rewards.clone()
    return rewards - rewards.mean()


for _name, _fn in (
    ("grpo", advantage_grpo),
    ("dr_grpo", advantage_dr_grpo),
    ("rloo", advantage_rloo),
    ("reinforce", advantage_reinforce),
):
    ADVANTAGE_ESTIMATORS.register(_name)(_per_sequence(_fn))


# ---------------------------------------------------------------------------------------------------------------
# Policy losses: per-token losses [B, T] (0 on masked positions) and clip indicators
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ClipOptions:
    """ε_low / ε_high of the clipped surrogate (DAPO's clip-higher when they differ), and the dual-clip constant c
    (Ye et al. 2019, arXiv 1912.09729; None disables it)."""

    epsilon_low: float = 0.2
    epsilon_high: float = 0.2
    dual_clip: float | None = None


@dataclass(frozen=True)
class PolicyLossOutput:
    per_token: Tensor  # [B, T] loss per token, 0 where mask = 0
    ratio: Tensor  # [B, T] importance ratio π/π_old actually used
    clipped_low: Tensor  # [B, T] bool: A < 0 and ρ < 1 − ε_low (zero gradient)
    clipped_high: Tensor  # [B, T] bool: A > 0 and ρ > 1 + ε_high (zero gradient)
    clipped_dual: Tensor  # [B, T] bool: A < 0 and ρ > c (dual clip active)


PolicyLoss = Callable[[Tensor, Tensor, Tensor, Tensor, ClipOptions], PolicyLossOutput]
POLICY_LOSSES: Registry[PolicyLoss] = Registry("policy loss", names.POLICY_LOSSES)


def _clipped_surrogate(
    ratio: Tensor, adv: Tensor, mask: Tensor, opts: ClipOptions
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - opts.epsilon_low, 1.0 + opts.epsilon_high)
    loss = torch.maximum(unclipped, clipped)
    dual = torch.zeros_like(mask, dtype=torch.bool)
    if opts.dual_clip is not None:
        capped = torch.minimum(loss, -adv * opts.dual_clip)  # for A < 0, −c·A = c·|A|
        dual = (adv < 0) & (loss > -adv * opts.dual_clip) & mask.bool()
        loss = torch.where(adv < 0, capped, loss)
    m = mask.bool()
    low = (adv < 0) & (ratio < 1.0 - opts.epsilon_low) & m
    high = (adv > 0) & (ratio > 1.0 + opts.epsilon_high) & m
    return torch.where(m, loss, torch.zeros_like(loss)), low, high, dual


@POLICY_LOSSES.register("clipped")
def policy_loss_clipped(
    logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, opts: ClipOptions
) -> PolicyLossOutput:
    """Token-level PPO surrogate (Schulman et al. 2017): L_t = max(−A ρ_t, −A clip(ρ_t, 1−ε_low, 1+ε_high)).

    logp, old_logp, mask [B, T]; advantages [B] (broadcast over tokens) or [B, T]. With ``dual_clip = c``,
    L_t = min(L_t, c·|A|) for A < 0. log ρ is clamped to ±20 before exp, as verl does.
    """
    adv = advantages.unsqueeze(-1).expand_as(logp) if advantages.dim() == 1 else advantages
    ratio = torch.exp((logp - old_logp).clamp(-20.0, 20.0))
    loss, low, high, dual = _clipped_surrogate(ratio, adv, mask, opts)
    return PolicyLossOutput(loss, ratio, low, high, dual)


@POLICY_LOSSES.register("sequence_clipped")
def policy_loss_sequence_clipped(
    logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, opts: ClipOptions
) -> PolicyLossOutput:
    """Sequence-level surrogate, the whole completion one action (RLOO as TRL implements it):
    ρ_i = exp(Σ_t log π − Σ_t log π_old), L_i = max(−A_i ρ_i, −A_i clip(ρ_i, 1−ε_low, 1+ε_high)).

    advantages [B]. L_i is written on every valid token of sequence i, so that the ``seq_mean_token_mean``
    aggregation yields (1/B) Σ_i L_i exactly.
    """
    seq_log_ratio = masked_sum(logp - old_logp, mask, dim=-1)  # [B]
    ratio = torch.exp(seq_log_ratio.clamp(-20.0, 20.0))
    seq_mask = mask.sum(-1) > 0
    loss, low, high, dual = _clipped_surrogate(ratio, advantages, seq_mask, opts)
    expand = mask.bool()
    per_token = torch.where(expand, loss.unsqueeze(-1).expand_as(logp), torch.zeros_like(logp))
    return PolicyLossOutput(
        per_token,
        ratio.unsqueeze(-1).expand_as(logp),
        low.unsqueeze(-1) & expand,
        high.unsqueeze(-1) & expand,
        dual.unsqueeze(-1) & expand,
    )


def _zero_outside(x: Tensor, mask: Tensor) -> Tensor:
    """x where mask = 1, else 0, so that a NaN/inf on a masked position reaches neither the loss nor a gradient."""
    return torch.where(mask.bool(), x, torch.zeros((), dtype=x.dtype, device=x.device))


@POLICY_LOSSES.register("importance_sampling")
def policy_loss_importance_sampling(
    logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, opts: ClipOptions
) -> PolicyLossOutput:
    """REINFORCE with the sampler's importance weight, unclipped: L_t = −ρ_t·A_t, ρ_t = π/π_old (Tinker's
    ``importance_sampling``, tinker-docs "Loss functions"; its value is the IS estimate of −E_q[ρA], its gradient
    −ρ·A·∇log π, the policy gradient corrected for the sampler/learner mismatch).

    logp, old_logp, mask [B, T]; advantages [B] or [B, T]. ``opts`` is unused (nothing is clipped; the clip
    indicators are all False). log ρ is clamped to ±20 before exp, as for ``clipped``.
    """
    adv = advantages.unsqueeze(-1).expand_as(logp) if advantages.dim() == 1 else advantages
    ratio = torch.exp((_zero_outside(logp, mask) - _zero_outside(old_logp, mask)).clamp(-20.0, 20.0))
    none = torch.zeros_like(mask, dtype=torch.bool)
    return PolicyLossOutput(_zero_outside(-_zero_outside(adv, mask) * ratio, mask), ratio, none, none, none)


@POLICY_LOSSES.register("cispo")
def policy_loss_cispo(
    logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, opts: ClipOptions
) -> PolicyLossOutput:
    """CISPO: the clipped importance weight as a constant coefficient of the log-likelihood,
    L_t = −sg(clip(ρ_t, 1−ε_low, 1+ε_high))·A_t·log π_t (MiniMax-M1, arXiv 2506.13585, eq. 4; Tinker's ``cispo``).

    Unlike the PPO surrogate no token loses its gradient: a clipped weight only caps it. logp, old_logp, mask
    [B, T]; advantages [B] or [B, T]. ``clipped_low`` / ``clipped_high`` mark the tokens whose weight was capped
    (either sign of A); ``clipped_dual`` is all False. log ρ is clamped to ±20 before exp.
    """
    adv = advantages.unsqueeze(-1).expand_as(logp) if advantages.dim() == 1 else advantages
    safe_logp = _zero_outside(logp, mask)
    ratio = torch.exp((safe_logp - _zero_outside(old_logp, mask)).clamp(-20.0, 20.0)).detach()
    weight = ratio.clamp(1.0 - opts.epsilon_low, 1.0 + opts.epsilon_high)
    loss = -weight * _zero_outside(adv, mask) * safe_logp
    m = mask.bool()
    low, high = (ratio < 1.0 - opts.epsilon_low) & m, (ratio > 1.0 + opts.epsilon_high) & m
    return PolicyLossOutput(_zero_outside(loss, mask), ratio, low, high, torch.zeros_like(m))


def gspo_token_old_logp(logp: Tensor, old_logp: Tensor, ratio_mask: Tensor) -> Tensor:
    """The behaviour log-probs that make the token-level clipped surrogate (``clipped``) GSPO-token (Zheng et al.
    2025, arXiv 2507.18071, §4.3; Tinker's ``gspo``): with log s_i = mean_{t ∈ M_i} (log π_t − log π_old,t), the
    sequence's mean log-ratio over its ``ratio_mask`` tokens M_i, this returns sg(log π_t) − sg(log s_i), so that
    ρ_t = exp(log π_t − old_t) has the value s_i at every position and the gradient s_i·∇log π_t.

    logp, old_logp, ratio_mask [B, T] → [B, T], no graph. A row with no ratio token gets s = 1.
    """
    log_s = masked_mean(logp.detach() - old_logp, ratio_mask, dim=-1)  # [B]
    return logp.detach() - log_s.unsqueeze(-1)


def dro_loss(logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, *, beta: float) -> Tensor:
    """Direct reward optimisation's per-token loss, L_t = −(A_t·log π_t − ½β·(log π_t − log π_old,t)²) (Richemond
    et al. 2024, arXiv 2405.19107; Kimi k1.5, arXiv 2501.12599; Tinker's ``dro``): off-policy regression with a
    quadratic penalty on the log-ratio. A is the client's soft advantage. logp, old_logp, advantages, mask [B, T] →
    [B, T], 0 where mask = 0.
    """
    safe_logp = _zero_outside(logp, mask)
    log_ratio = safe_logp - _zero_outside(old_logp, mask)
    loss = -(_zero_outside(advantages, mask) * safe_logp - 0.5 * beta * log_ratio**2)
    return _zero_outside(loss, mask)


# ---------------------------------------------------------------------------------------------------------------
# Loss aggregation: per-token losses of one micro-batch → its exact share of the whole mini-batch's loss
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LossScale:
    """Totals of the whole mini-batch (all its micro-batches together). Aggregating each micro-batch against these
    totals and summing the micro-batch losses gives exactly the full-batch loss: no per-micro-batch bias (the
    gradient-accumulation pitfall of TRL issue 2617 / ms-swift 10117)."""

    total_tokens: float  # Σ_i |o_i| over the mini-batch
    total_sequences: int  # B of the mini-batch
    max_completion_tokens: int  # L_max, Dr. GRPO's constant


Aggregation = Callable[[Tensor, Tensor, LossScale], Tensor]
AGGREGATIONS: Registry[Aggregation] = Registry("loss aggregation", names.AGGREGATIONS)


@AGGREGATIONS.register("token_mean")
def aggregate_token_mean(per_token: Tensor, mask: Tensor, scale: LossScale) -> Tensor:
    """Σ_{i,t} L_{i,t} / Σ_i |o_i| over the whole mini-batch (DAPO's token-level loss, arXiv 2503.14476)."""
    return masked_sum(per_token, mask) / max(scale.total_tokens, 1.0)


@AGGREGATIONS.register("seq_mean_token_mean")
def aggregate_seq_mean_token_mean(per_token: Tensor, mask: Tensor, scale: LossScale) -> Tensor:
    """(1/B) Σ_i (1/|o_i|) Σ_t L_{i,t} (the original GRPO, DeepSeekMath arXiv 2402.03300)."""
    per_seq = masked_sum(per_token, mask, dim=-1) / mask.sum(-1).clamp(min=1)
    return per_seq.sum() / max(scale.total_sequences, 1)


@AGGREGATIONS.register("seq_mean_token_sum_norm")
def aggregate_seq_mean_token_sum_norm(per_token: Tensor, mask: Tensor, scale: LossScale) -> Tensor:
    """Σ_{i,t} L_{i,t} / (B · L_max): a constant normaliser, no length bias (Dr. GRPO, arXiv 2503.20783; TRL's
    ``dr_grpo``)."""
    return masked_sum(per_token, mask) / max(scale.total_sequences * scale.max_completion_tokens, 1)


# ---------------------------------------------------------------------------------------------------------------
# PPO with a value model: per-token rewards, GAE, the clipped value loss
# ---------------------------------------------------------------------------------------------------------------


def ppo_token_rewards(scores: Tensor, kl: Tensor, mask: Tensor, *, beta: float) -> Tensor:
    """Per-token rewards of RLHF's PPO (Ziegler et al. 2019; Ouyang et al. 2022): r_t = −β·KL_t on every completion
    token, and the score added on the last one (verl's and OpenRLHF's placement, not TRL's one-past-EOS slot,
    rl-algorithms §4.5): the last token of ``mask``, the policy's last token, not the sequence's. scores [B], kl and
    mask [B, T] → [B, T], 0 where mask = 0. A sequence with no policy token gets no reward."""
    rewards = torch.where(mask.bool(), -beta * kl, torch.zeros_like(kl))
    rows = torch.nonzero(mask.bool().any(-1)).squeeze(-1)
    rewards[rows, last_true(mask)[rows]] += scores[rows].to(rewards.dtype)
    return rewards


def last_true(mask: Tensor) -> Tensor:
    """Index of the last nonzero of each row of ``mask`` [B, T] → [B] (0 for an all-zero row). The policy mask of
    an episode is not a prefix (environment tokens may follow the last policy token): its last 1 is not length − 1."""
    t = mask.shape[-1]
    positions = torch.arange(t, device=mask.device).expand_as(mask)
    return torch.where(mask.bool(), positions, torch.zeros_like(positions)).amax(-1)


def gae(rewards: Tensor, values: Tensor, mask: Tensor, *, gamma: float, lam: float) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation (Schulman et al. 2016, arXiv 1506.02438), rewards / values / mask [B, T] →
    (advantages, returns) [B, T], both 0 where mask = 0:

        δ_t = r_t + γ·V_{t+1} − V_t,   A_t = δ_t + γλ·A_{t+1},   returns = A + V,

    with V = 0 past the last completion token. Masked positions are skipped, carrying V_{t+1} and A_{t+1} through
    them (verl's masked GAE), so values on non-completion positions never reach the advantages."""
    m = mask.to(values.dtype)
    next_value = torch.zeros_like(values[:, 0])
    last_adv = torch.zeros_like(values[:, 0])
    adv = torch.zeros_like(values)
    for t in reversed(range(values.shape[1])):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        a = delta + gamma * lam * last_adv
        next_value = torch.where(m[:, t] > 0, values[:, t], next_value)
        last_adv = torch.where(m[:, t] > 0, a, last_adv)
        adv[:, t] = last_adv
    adv = adv * m
    return adv, (adv + values) * m


@ADVANTAGE_ESTIMATORS.register("gae")
def advantage_gae(x: AdvantageInputs, opts: AdvantageOptions) -> AdvantageOutput:
    """PPO's estimator: :func:`gae` over the per-token rewards and the critic's values (both required), then (with
    ``opts.whiten``) whitened over the policy's tokens. → advantages [N, C] and returns [N, C]."""
    if x.token_rewards is None or x.values is None:
        raise ValueError("GAE needs per-token rewards and a value model's values (a recipe with a critic)")
    m = x.mask.to(torch.float32)
    adv, returns = gae(x.token_rewards, x.values, m, gamma=opts.gamma, lam=opts.lam)
    if opts.whiten:
        adv = masked_whiten(adv, m) * m
    return AdvantageOutput(adv, returns)


@dataclass(frozen=True)
class ValueLossOutput:
    per_token: Tensor  # [B, T] ½·max((V − R)², (V_clip − R)²), 0 where mask = 0
    clipped: Tensor  # [B, T] bool: the clipped term is the larger one (its gradient is 0)


def value_loss_clipped(
    values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor, *, clip: float | None
) -> ValueLossOutput:
    """PPO's clipped value loss (TRL, verl, OpenRLHF alike), [B, T] each: V_clip = V_old + clamp(V − V_old, ±ε_v),
    L_t = ½·max((V − R)², (V_clip − R)²); ``clip = None`` gives ½(V − R)²."""
    unclipped = (values - returns) ** 2
    if clip is None:
        loss, clipped = unclipped, torch.zeros_like(mask, dtype=torch.bool)
    else:
        v_clip = old_values + (values - old_values).clamp(-clip, clip)
        clipped_sq = (v_clip - returns) ** 2
        loss = torch.maximum(unclipped, clipped_sq)
        clipped = (clipped_sq > unclipped) & mask.bool()
    return ValueLossOutput(torch.where(mask.bool(), 0.5 * loss, torch.zeros_like(loss)), clipped)


def explained_variance(values: Tensor, returns: Tensor, mask: Tensor) -> float:
    """1 − Var(R − V)/Var(R) over the masked tokens: 1 is a perfect critic, 0 no better than a constant, < 0 worse.
    NaN when the returns do not vary."""
    m = mask.bool()
    r, v = returns[m].double(), values[m].double()
    if r.numel() < 2:
        return float("nan")
    var_r = r.var()
    return float(1.0 - (r - v).var() / var_r) if var_r > 0 else float("nan")


# ---------------------------------------------------------------------------------------------------------------
# DAPO's reward shaping and the adaptive KL controller
# ---------------------------------------------------------------------------------------------------------------


def overlong_penalty(lengths: Tensor, *, max_tokens: int, buffer: int, factor: float = 1.0) -> Tensor:
    """DAPO's soft overlong punishment (arXiv 2503.14476, eq. 13), [N] lengths → [N] penalties:
    0 if |y| ≤ L_max − L_cache; ((L_max − L_cache) − |y|)/L_cache inside the buffer; −1 beyond L_max; × factor."""
    if buffer <= 0 or buffer > max_tokens:
        raise ValueError("overlong buffer must be in 1..max_tokens")
    lengths = lengths.float()
    start = max_tokens - buffer
    inside = (start - lengths) / buffer
    pen = torch.where(lengths <= start, torch.zeros_like(lengths), inside)
    pen = torch.where(lengths > max_tokens, torch.full_like(lengths, -1.0), pen)
    return pen * factor


def adaptive_kl_update(beta: float, *, observed_kl: float, target: float, horizon: int, n_steps: int) -> float:
    """Ziegler et al. 2019 (arXiv 1909.08593): e = clip(KL/target − 1, ±0.2); β ← β·(1 + e·n_steps/horizon)."""
    err = min(max(observed_kl / target - 1.0, -0.2), 0.2)
    return beta * (1.0 + err * n_steps / horizon)


def cosine_or_constant_lr(step: int, *, warmup: int, total: int, schedule: Literal["constant", "cosine"]) -> float:
    """LR multiplier for training step ``step`` (0-based): linear warm-up over ``warmup`` steps, then 1 or a cosine
    decay to 0 at ``total``."""
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    if schedule == "constant":
        return 1.0
    span = max(total - warmup, 1)
    progress = min(max(step - warmup, 0) / span, 1.0)
    return 0.5 * (1.0 + math.cos(math.pi * progress))


# ---------------------------------------------------------------------------------------------------------------
# Pairwise preference losses: Bradley–Terry reward models and DPO
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PairwiseOptions:
    """What a pairwise loss may need besides the two [B] inputs. Defaults are the papers'.

    ``beta``: DPO's β (the Bradley–Terry loss ignores it); ``label_smoothing``: ε, the assumed fraction of flipped
    labels (cDPO / robust DPO); ``margin``: the Bradley–Terry margin m, a constant or one per pair [B];
    ``center_coefficient``: c of the reward-centring term c·(r_c + r_r)²; ``chosen_tokens`` / ``rejected_tokens``
    [B]: completion lengths |o|, used by IPO's length normalisation."""

    beta: float = 0.1
    label_smoothing: float = 0.0
    margin: Tensor | float = 0.0
    center_coefficient: float = 0.0
    chosen_tokens: Tensor | None = None
    rejected_tokens: Tensor | None = None


PairwiseLoss = Callable[[Tensor, Tensor, PairwiseOptions], Tensor]
PAIRWISE_LOSSES: Registry[PairwiseLoss] = Registry("pairwise loss", names.PAIRWISE_LOSSES)
"""(chosen, rejected, options) → the loss of every pair [B]; the batch loss is its mean. For ``bradley_terry`` the
inputs are the reward model's scores r_c, r_r; for the ``dpo_*`` losses they are the policy-to-reference log-ratios
Δ_c = log π(y_c|x) − log π_ref(y_c|x) and Δ_r, each a sum over the completion's tokens."""


@PAIRWISE_LOSSES.register("bradley_terry")
def pairwise_bradley_terry(chosen: Tensor, rejected: Tensor, opts: PairwiseOptions) -> Tensor:
    """−log σ(r_c − r_r − m) + c·(r_c + r_r)², per pair [B] (Bradley & Terry 1952; InstructGPT arXiv 2203.02155;
    the centring term of Eisenstein et al. arXiv 2312.09244, TRL's ``center_rewards_coefficient``)."""
    # −log σ(x) = softplus(−x), stable for any x
    loss = torch.nn.functional.softplus(-(chosen - rejected - opts.margin))
    if opts.center_coefficient:
        loss = loss + opts.center_coefficient * (chosen + rejected) ** 2
    return loss


@PAIRWISE_LOSSES.register("dpo_sigmoid")
def pairwise_dpo_sigmoid(chosen: Tensor, rejected: Tensor, opts: PairwiseOptions) -> Tensor:
    """−(1 − ε)·log σ(β·u) − ε·log σ(−β·u), u = Δ_c − Δ_r, per pair [B] (DPO, Rafailov et al. arXiv 2305.18290;
    with ε > 0 the conservative cDPO of Mitchell 2023, TRL's ``sigmoid`` with ``label_smoothing``)."""
    z = opts.beta * (chosen - rejected)
    eps = opts.label_smoothing
    return (1 - eps) * torch.nn.functional.softplus(-z) + eps * torch.nn.functional.softplus(z)


@PAIRWISE_LOSSES.register("dpo_robust")
def pairwise_dpo_robust(chosen: Tensor, rejected: Tensor, opts: PairwiseOptions) -> Tensor:
    """[−(1 − ε)·log σ(β·u) + ε·log σ(−β·u)] / (1 − 2ε), u = Δ_c − Δ_r, per pair [B]: unbiased under label noise ε
    (robust DPO, Chowdhury et al. arXiv 2403.00409; TRL's ``robust``). Needs ε < 1/2."""
    z = opts.beta * (chosen - rejected)
    eps = opts.label_smoothing
    return ((1 - eps) * torch.nn.functional.softplus(-z) - eps * torch.nn.functional.softplus(z)) / (1 - 2 * eps)


@PAIRWISE_LOSSES.register("dpo_ipo")
def pairwise_dpo_ipo(chosen: Tensor, rejected: Tensor, opts: PairwiseOptions) -> Tensor:
    """(Δ_c/|o_c| − Δ_r/|o_r| − 1/(2β))², per pair [B] (IPO, Azar et al. arXiv 2310.12036), each log-ratio divided
    by its completion length as TRL does (lengths 1 when not given)."""
    c = chosen / opts.chosen_tokens if opts.chosen_tokens is not None else chosen
    r = rejected / opts.rejected_tokens if opts.rejected_tokens is not None else rejected
    return (c - r - 1 / (2 * opts.beta)) ** 2


@PAIRWISE_LOSSES.register("dpo_hinge")
def pairwise_dpo_hinge(chosen: Tensor, rejected: Tensor, opts: PairwiseOptions) -> Tensor:
    """max(0, 1 − β·u), u = Δ_c − Δ_r, per pair [B] (SLiC, Zhao et al. arXiv 2305.10425; TRL's ``hinge``)."""
    return torch.relu(1 - opts.beta * (chosen - rejected))


# Last in the module: every name declared in ``trainer.spec.names`` has its function by now.
for _registry in (KL_ESTIMATORS, ADVANTAGE_ESTIMATORS, POLICY_LOSSES, AGGREGATIONS, PAIRWISE_LOSSES):
    _registry.check_complete()

"""The policy-loss parts added for Tinker's losses (trainer.algorithms.core_algos): importance_sampling and cispo in the
POLICY_LOSSES registry, GSPO-token's behaviour log-probs and DRO's loss, each against its formula by hand (values and
gradients), and NaN/inf on masked positions reaching neither the loss nor a gradient."""

from __future__ import annotations

import math

import pytest
import torch

from trainer.algorithms.core_algos import (
    AGGREGATIONS,
    POLICY_LOSSES,
    ClipOptions,
    LossScale,
    dro_loss,
    gspo_token_old_logp,
    masked_sum,
)
from trainer.spec import names

MASK = torch.tensor([[1.0, 1.0, 1.0, 0.0]])


def logp_for_ratios(ratios: list[float], old: list[float]) -> tuple[torch.Tensor, torch.Tensor]:
    """logp (with grad) and old_logp [1, T] whose ratios π/π_old are ``ratios``."""
    old_t = torch.tensor([old])
    return (old_t + torch.log(torch.tensor([ratios]))).requires_grad_(True), old_t


def test_the_new_losses_are_declared_and_registered() -> None:
    assert {"importance_sampling", "cispo"} <= set(names.POLICY_LOSSES)
    assert {"importance_sampling", "cispo"} <= set(POLICY_LOSSES.names())


def test_importance_sampling_is_minus_ratio_times_advantage_unclipped() -> None:
    logp, old = logp_for_ratios([0.5, 1.0, 3.0, 7.0], [-1.0, -2.0, -0.5, -1.5])
    adv = torch.tensor([[2.0, -1.0, 1.0, 5.0]])

    out = POLICY_LOSSES.get("importance_sampling")(logp, old, adv, MASK, ClipOptions(0.2, 0.2))
    out.per_token.sum().backward()

    assert out.per_token[0].tolist() == pytest.approx([-1.0, 1.0, -3.0, 0.0], abs=1e-5)
    # d(−ρA)/d log π = −ρA: the gradient is not clipped, whatever ClipOptions say
    assert logp.grad is not None
    assert logp.grad[0].tolist() == pytest.approx([-1.0, 1.0, -3.0, 0.0], abs=1e-5)
    assert not (out.clipped_low | out.clipped_high | out.clipped_dual).any()


def test_importance_sampling_broadcasts_a_sequence_advantage() -> None:
    logp, old = logp_for_ratios([1.0, 2.0, 1.0, 1.0], [-1.0] * 4)
    out = POLICY_LOSSES.get("importance_sampling")(logp, old, torch.tensor([3.0]), MASK, ClipOptions())
    assert out.per_token[0].tolist() == pytest.approx([-3.0, -6.0, -3.0, 0.0], abs=1e-5)


def test_cispo_weights_the_log_likelihood_by_the_clipped_ratio_without_its_gradient() -> None:
    old = [-1.0, -2.0, -0.5, -1.5]
    logp, old_t = logp_for_ratios([0.5, 1.1, 3.0, 1.0], old)
    adv = torch.tensor([[2.0, -1.0, 1.0, 1.0]])

    out = POLICY_LOSSES.get("cispo")(logp, old_t, adv, MASK, ClipOptions(epsilon_low=0.2, epsilon_high=0.28))
    out.per_token.sum().backward()

    weights = [0.8, 1.1, 1.28]  # clip(ρ, 0.8, 1.28)
    lp = [o + math.log(r) for o, r in zip(old, [0.5, 1.1, 3.0], strict=False)]
    expected = [-w * a * x for w, a, x in zip(weights, [2.0, -1.0, 1.0], lp, strict=True)]
    assert out.per_token[0, :3].tolist() == pytest.approx(expected, abs=1e-5)
    assert out.per_token[0, 3].item() == 0.0
    # the weight is a constant: ∂L/∂log π = −clip(ρ)·A, never 0 (unlike the PPO surrogate's clipped tokens)
    assert logp.grad is not None
    assert logp.grad[0].tolist() == pytest.approx([-1.6, 1.1, -1.28, 0.0], abs=1e-5)
    assert out.clipped_low.tolist() == [[True, False, False, False]]
    assert out.clipped_high.tolist() == [[False, False, True, False]]


def test_gspo_token_makes_every_ratio_the_sequence_ratio_with_its_own_gradient() -> None:
    logp, old = logp_for_ratios([2.0, 0.5, 1.5, 9.0], [-1.0, -2.0, -0.5, -1.0])
    ratio_mask = torch.tensor([[0.0, 1.0, 1.0, 0.0]])  # the sequence ratio over positions 1 and 2 only
    adv = torch.tensor([[1.0, 1.0, -1.0, 0.0]])

    new_old = gspo_token_old_logp(logp, old, ratio_mask)
    out = POLICY_LOSSES.get("clipped")(logp, new_old, adv, MASK, ClipOptions(0.2, 0.2))
    out.per_token.sum().backward()

    s = math.sqrt(0.5 * 1.5)  # geometric mean of the masked ratios: 0.866
    assert not new_old.requires_grad
    assert out.ratio[0, :3].tolist() == pytest.approx([s] * 3, abs=1e-5)
    # s is inside [0.8, 1.2]: L_t = −s·A_t, ∂L_t/∂log π_t = −s·A_t
    assert out.per_token[0].tolist() == pytest.approx([-s, -s, s, 0.0], abs=1e-5)
    assert logp.grad is not None
    assert logp.grad[0].tolist() == pytest.approx([-s, -s, s, 0.0], abs=1e-5)


def test_gspo_token_without_ratio_tokens_uses_ratio_one() -> None:
    logp, old = logp_for_ratios([2.0, 0.5, 1.5, 9.0], [-1.0] * 4)
    new_old = gspo_token_old_logp(logp, old, torch.zeros(1, 4))
    torch.testing.assert_close(new_old, logp.detach())


def test_dro_is_the_advantage_weighted_log_likelihood_minus_a_quadratic_penalty() -> None:
    logp, old = logp_for_ratios([2.0, 0.5, 1.0, 1.0], [-1.0, -2.0, -0.5, -1.5])
    adv = torch.tensor([[1.0, -2.0, 0.5, 3.0]])

    loss = dro_loss(logp, old, adv, MASK, beta=0.5)
    loss.sum().backward()

    d = [math.log(2.0), math.log(0.5), 0.0]
    lp = [-1.0 + d[0], -2.0 + d[1], -0.5]
    expected = [-(a * x - 0.25 * di**2) for a, x, di in zip([1.0, -2.0, 0.5], lp, d, strict=True)]
    assert loss[0].tolist() == pytest.approx([*expected, 0.0], abs=1e-5)
    # ∂L/∂log π = −(A − β·(log π − log π_old))
    assert logp.grad is not None
    assert logp.grad[0].tolist() == pytest.approx([-(1 - 0.5 * d[0]), -(-2 - 0.5 * d[1]), -0.5, 0.0], abs=1e-5)


@pytest.mark.parametrize("loss_name", ["importance_sampling", "cispo", "dro"])
def test_masked_positions_with_nan_and_inf_contribute_nothing(loss_name: str) -> None:
    nan, inf = float("nan"), float("inf")
    logp = torch.tensor([[-1.0, -0.5, nan, -inf], [-2.0, inf, nan, nan]], requires_grad=True)
    old = torch.tensor([[-1.1, -0.4, nan, -inf], [-1.9, -inf, 0.0, nan]])
    adv = torch.tensor([[1.0, -2.0, nan, inf], [0.5, nan, 1.0, 1.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]])

    if loss_name == "dro":
        per_token = dro_loss(logp, old, adv, mask, beta=0.1)
    else:
        per_token = POLICY_LOSSES.get(loss_name)(logp, old, adv, mask, ClipOptions()).per_token
    assert torch.isfinite(per_token).all()
    assert (per_token[mask == 0] == 0).all()
    loss = AGGREGATIONS.get("token_mean")(per_token, mask, LossScale(3.0, 2, 4)) + masked_sum(per_token, mask)
    loss.backward()
    assert logp.grad is not None
    assert torch.isfinite(logp.grad).all()
    assert (logp.grad[mask == 0] == 0).all()
    assert (logp.grad[mask == 1] != 0).all()

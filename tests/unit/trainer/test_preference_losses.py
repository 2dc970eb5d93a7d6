"""core_algos' pairwise losses against closed forms and the invariants of rl-algorithms.md §5 (27, 29, 30)."""

import math

import pytest
import torch

from trainer.algorithms.core_algos import PAIRWISE_LOSSES, PairwiseOptions

LOG2 = math.log(2.0)
DPO = ["dpo_sigmoid", "dpo_robust", "dpo_ipo", "dpo_hinge"]


def grads(name: str, chosen: torch.Tensor, rejected: torch.Tensor, opts: PairwiseOptions) -> tuple:
    c, r = chosen.clone().requires_grad_(), rejected.clone().requires_grad_()
    loss = PAIRWISE_LOSSES.get(name)(c, r, opts)
    loss.sum().backward()
    return loss.detach(), c.grad, r.grad


def test_registry_holds_the_bradley_terry_and_dpo_losses_and_names_the_valid_ones() -> None:
    assert PAIRWISE_LOSSES.names() == ["bradley_terry", *sorted(DPO)]
    with pytest.raises(KeyError, match="valid: bradley_terry, dpo_hinge"):
        PAIRWISE_LOSSES.get("dpo_kto")


# --- Bradley–Terry (invariant 27) ---------------------------------------------------------------------------


def test_bradley_terry_is_softplus_of_minus_delta_and_log2_at_a_tie() -> None:
    chosen, rejected = torch.tensor([0.0, 2.0, -1.0, 30.0]), torch.tensor([0.0, 0.5, 1.0, -30.0])
    loss = PAIRWISE_LOSSES.get("bradley_terry")(chosen, rejected, PairwiseOptions())
    delta = chosen - rejected
    torch.testing.assert_close(loss, torch.log1p(torch.exp(-delta)))
    assert loss[0].item() == pytest.approx(LOG2, abs=1e-7)
    assert torch.isfinite(loss).all() and loss[3].item() == pytest.approx(0.0, abs=1e-12)


def test_bradley_terry_gradients_are_minus_and_plus_sigmoid_of_minus_delta() -> None:
    chosen, rejected = torch.tensor([0.3, -2.0, 4.0]), torch.tensor([1.0, -2.5, 0.0])
    _, gc, gr = grads("bradley_terry", chosen, rejected, PairwiseOptions())
    expected = -torch.sigmoid(-(chosen - rejected))
    torch.testing.assert_close(gc, expected)
    torch.testing.assert_close(gr, -expected)


def test_bradley_terry_swapped_pair_gives_softplus_of_delta() -> None:
    chosen, rejected = torch.tensor([1.5, -0.2]), torch.tensor([0.5, 0.7])
    swapped = PAIRWISE_LOSSES.get("bradley_terry")(rejected, chosen, PairwiseOptions())
    torch.testing.assert_close(swapped, torch.nn.functional.softplus(chosen - rejected))


def test_bradley_terry_margin_shifts_delta_constant_or_per_pair() -> None:
    chosen, rejected = torch.tensor([2.0, 1.0]), torch.tensor([1.0, 1.0])
    bt = PAIRWISE_LOSSES.get("bradley_terry")
    # With Δ = m the loss is log 2: the margin is what Δ must beat.
    assert bt(chosen, rejected, PairwiseOptions(margin=1.0))[0].item() == pytest.approx(LOG2)
    per_pair = bt(chosen, rejected, PairwiseOptions(margin=torch.tensor([1.0, -3.0])))
    torch.testing.assert_close(per_pair, -torch.nn.functional.logsigmoid(torch.tensor([0.0, 3.0])))


def test_bradley_terry_centring_term_adds_c_times_the_squared_reward_sum() -> None:
    chosen, rejected = torch.tensor([2.0, -1.0]), torch.tensor([1.0, -3.0])
    plain = PAIRWISE_LOSSES.get("bradley_terry")(chosen, rejected, PairwiseOptions())
    centred = PAIRWISE_LOSSES.get("bradley_terry")(chosen, rejected, PairwiseOptions(center_coefficient=0.01))
    torch.testing.assert_close(centred - plain, 0.01 * torch.tensor([9.0, 16.0]))


# --- DPO (invariants 29 and 30) -----------------------------------------------------------------------------


@pytest.mark.parametrize("beta", [0.1, 0.5])
@pytest.mark.parametrize("eps", [0.0, 0.2])
def test_dpo_losses_at_initialisation_have_their_closed_forms(beta: float, eps: float) -> None:
    """Policy ≡ reference: Δ_c = Δ_r = 0, so u = 0."""
    zero = torch.zeros(3)
    opts = PairwiseOptions(beta=beta, label_smoothing=eps, chosen_tokens=torch.ones(3) * 4, rejected_tokens=zero + 2)
    expected = {"dpo_sigmoid": LOG2, "dpo_robust": LOG2, "dpo_hinge": 1.0, "dpo_ipo": 1 / (4 * beta**2)}
    for name, value in expected.items():
        loss = PAIRWISE_LOSSES.get(name)(zero, zero, opts)
        torch.testing.assert_close(loss, torch.full((3,), value), msg=name)


@pytest.mark.parametrize("beta", [0.1, 0.5])
def test_dpo_sigmoid_gradient_at_initialisation_is_minus_and_plus_beta_over_two(beta: float) -> None:
    _, gc, gr = grads("dpo_sigmoid", torch.zeros(2), torch.zeros(2), PairwiseOptions(beta=beta))
    torch.testing.assert_close(gc, torch.full((2,), -beta / 2))
    torch.testing.assert_close(gr, torch.full((2,), beta / 2))


def test_dpo_robust_gradient_at_initialisation_is_beta_over_two_scaled_by_one_minus_two_eps() -> None:
    """d/du of [(1−ε)·softplus(−βu) − ε·softplus(βu)]/(1−2ε) at u = 0 is −β/2 · 1/(1−2ε)."""
    beta, eps = 0.3, 0.25
    opts = PairwiseOptions(beta=beta, label_smoothing=eps)
    _, gc, gr = grads("dpo_robust", torch.zeros(2), torch.zeros(2), opts)
    torch.testing.assert_close(gc, torch.full((2,), -beta / 2 / (1 - 2 * eps)))
    torch.testing.assert_close(gr, -gc)


def test_dpo_sigmoid_with_label_smoothing_is_the_conservative_mixture() -> None:
    u = torch.tensor([-2.0, 0.5, 3.0])
    beta, eps = 0.2, 0.1
    loss = PAIRWISE_LOSSES.get("dpo_sigmoid")(u, torch.zeros(3), PairwiseOptions(beta=beta, label_smoothing=eps))
    logsig = torch.nn.functional.logsigmoid
    torch.testing.assert_close(loss, -(1 - eps) * logsig(beta * u) - eps * logsig(-beta * u))


def test_dpo_robust_and_hinge_and_ipo_match_their_formulas() -> None:
    dc, dr = torch.tensor([1.0, -3.0, 6.0]), torch.tensor([0.5, 2.0, -2.0])
    lc, lr = torch.tensor([2.0, 1.0, 4.0]), torch.tensor([1.0, 5.0, 2.0])
    beta, eps = 0.5, 0.2
    opts = PairwiseOptions(beta=beta, label_smoothing=eps, chosen_tokens=lc, rejected_tokens=lr)
    u = dc - dr
    logsig = torch.nn.functional.logsigmoid
    robust = (-(1 - eps) * logsig(beta * u) + eps * logsig(-beta * u)) / (1 - 2 * eps)
    torch.testing.assert_close(PAIRWISE_LOSSES.get("dpo_robust")(dc, dr, opts), robust)
    torch.testing.assert_close(PAIRWISE_LOSSES.get("dpo_hinge")(dc, dr, opts), torch.relu(1 - beta * u))
    ipo = (dc / lc - dr / lr - 1 / (2 * beta)) ** 2  # TRL: each log-ratio normalised by its length
    torch.testing.assert_close(PAIRWISE_LOSSES.get("dpo_ipo")(dc, dr, opts), ipo)


@pytest.mark.parametrize("name", ["dpo_sigmoid", "dpo_robust", "dpo_hinge"])
def test_dpo_is_invariant_to_a_shared_offset_of_policy_and_reference_log_probs(name: str) -> None:
    logp_c, logp_r = torch.tensor([-5.0, -2.0]), torch.tensor([-4.0, -6.0])
    ref_c, ref_r = torch.tensor([-4.5, -3.0]), torch.tensor([-4.2, -5.0])
    opts = PairwiseOptions(beta=0.3, label_smoothing=0.1)
    loss = PAIRWISE_LOSSES.get(name)
    base = loss(logp_c - ref_c, logp_r - ref_r, opts)
    for k in (7.0, -123.0):
        torch.testing.assert_close(loss((logp_c + k) - (ref_c + k), (logp_r + k) - (ref_r + k), opts), base)
        # An offset shared by the chosen and rejected log-ratios leaves u unchanged too.
        torch.testing.assert_close(loss(logp_c - ref_c + k, logp_r - ref_r + k, opts), base)


def test_dpo_swapping_chosen_and_rejected_negates_u() -> None:
    dc, dr = torch.tensor([0.7, -1.1]), torch.tensor([-0.4, 0.9])
    opts = PairwiseOptions(beta=0.5)
    swapped = PAIRWISE_LOSSES.get("dpo_sigmoid")(dr, dc, opts)
    torch.testing.assert_close(swapped, torch.nn.functional.softplus(0.5 * (dc - dr)))

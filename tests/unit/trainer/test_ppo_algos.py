"""PPO's math in trainer.algorithms.core_algos: per-token rewards, GAE, the clipped value loss and explained variance,
against hand-computed values and the invariants of rl-algorithms.md §5 (13, 18, 19, 23)."""

import math

import pytest
import torch

from trainer.algorithms.core_algos import (
    ADVANTAGE_ESTIMATORS,
    AdvantageInputs,
    AdvantageOptions,
    adaptive_kl_update,
    explained_variance,
    gae,
    last_true,
    masked_mean,
    masked_whiten,
    ppo_token_rewards,
    value_loss_clipped,
)


def test_gae_matches_hand_computed_values() -> None:
    rewards = torch.tensor([[0.0, 0.0, 1.0]])
    values = torch.tensor([[0.5, 0.6, 0.7]])
    adv, ret = gae(rewards, values, torch.ones(1, 3), gamma=0.9, lam=0.8)
    # δ2 = 1 − 0.7 = 0.3; δ1 = 0.9·0.7 − 0.6 = 0.03; δ0 = 0.9·0.6 − 0.5 = 0.04; A_t = δ_t + 0.72·A_{t+1}
    assert adv.tolist()[0] == pytest.approx([0.04 + 0.72 * (0.03 + 0.72 * 0.3), 0.03 + 0.72 * 0.3, 0.3])
    assert ret.tolist()[0] == pytest.approx([0.71712, 0.846, 1.0])


def test_gae_with_gamma_and_lambda_one_is_monte_carlo_return_minus_value() -> None:
    torch.manual_seed(0)
    rewards, values = torch.randn(4, 6), torch.randn(4, 6)
    mask = torch.ones(4, 6)
    mask[1, 4:] = 0
    mask[3, 2:] = 0
    adv, ret = gae(rewards * mask, values, mask, gamma=1.0, lam=1.0)
    for i in range(4):
        n = int(mask[i].sum())
        mc = torch.flip(torch.cumsum(torch.flip(rewards[i, :n], [0]), 0), [0])  # Σ_{k≥t} r_k
        assert torch.allclose(ret[i, :n], mc, atol=1e-6)
        assert torch.allclose(adv[i, :n], mc - values[i, :n], atol=1e-6)
        assert adv[i, n:].abs().sum() == 0 and ret[i, n:].abs().sum() == 0


def test_gae_with_lambda_zero_is_the_one_step_td_error() -> None:
    rewards = torch.tensor([[0.1, -0.2, 1.0]])
    values = torch.tensor([[0.3, 0.4, 0.5]])
    adv, _ = gae(rewards, values, torch.ones(1, 3), gamma=0.9, lam=0.0)
    assert adv.tolist()[0] == pytest.approx([0.1 + 0.9 * 0.4 - 0.3, -0.2 + 0.9 * 0.5 - 0.4, 1.0 - 0.5])


def test_gae_returns_equal_advantages_plus_values_and_ignore_values_outside_the_mask() -> None:
    torch.manual_seed(1)
    rewards, values = torch.randn(3, 5), torch.randn(3, 5)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]], dtype=torch.float32)
    adv, ret = gae(rewards, values, mask, gamma=0.95, lam=0.9)
    assert torch.allclose(ret, (adv + values) * mask)
    other = values.clone()
    other[mask == 0] = 1e3  # values past the end must not leak into the advantages
    adv2, _ = gae(rewards, other, mask, gamma=0.95, lam=0.9)
    assert torch.equal(adv, adv2)


def test_gae_with_only_a_final_reward_and_zero_values_decays_geometrically() -> None:
    t, r, gamma, lam = 5, 2.0, 0.9, 0.8
    rewards = torch.zeros(1, t)
    rewards[0, -1] = r
    adv, _ = gae(rewards, torch.zeros(1, t), torch.ones(1, t), gamma=gamma, lam=lam)
    expected = [(gamma * lam) ** (t - 1 - k) * r for k in range(t)]
    assert adv.tolist()[0] == pytest.approx(expected)


def test_token_rewards_put_the_kl_penalty_on_completion_tokens_and_the_score_on_the_last_one() -> None:
    kl = torch.tensor([[0.1, 0.2, 0.3, 0.4], [0.5, 0.6, 0.7, 0.8]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]], dtype=torch.float32)
    scores = torch.tensor([1.0, -2.0])
    r = ppo_token_rewards(scores, kl, mask, beta=0.5)
    assert r.tolist()[0] == pytest.approx([-0.05, -0.1, -0.15 + 1.0, 0.0])  # nothing past the last token
    assert r.tolist()[1] == pytest.approx([-0.25, -0.3, -0.35, -0.4 - 2.0])
    # Σ_t r_t = score − β·Σ_t KL_t (rl-algorithms §5.18)
    assert r.sum(-1).tolist() == pytest.approx([1.0 - 0.5 * 0.6, -2.0 - 0.5 * 2.6])


def test_token_rewards_put_the_score_on_the_last_policy_token_of_an_episode() -> None:
    """An episode's policy mask is not a prefix: environment tokens (0) sit between and after the policy's turns.
    The score goes on the last policy token (index 3), not on the sequence's last token (index 5)."""
    kl = torch.ones(1, 6)
    mask = torch.tensor([[1, 0, 1, 1, 0, 0]], dtype=torch.float32)
    r = ppo_token_rewards(torch.tensor([2.0]), kl, mask, beta=0.5)
    assert r.tolist()[0] == pytest.approx([-0.5, 0.0, -0.5, -0.5 + 2.0, 0.0, 0.0])
    assert last_true(torch.tensor([[1, 0, 1, 1, 0, 0], [1, 1, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0]])).tolist() == [3, 1, 0]


def test_gae_skips_environment_tokens_of_an_episode() -> None:
    """Masked GAE over [policy, env, policy]: the environment token gets no advantage, and the policy tokens'
    advantages equal GAE over the policy tokens alone (the env position carries V_{t+1} and A_{t+1} through)."""
    gamma, lam = 0.9, 0.8
    rewards = torch.tensor([[0.0, 0.0, 1.0]])
    values = torch.tensor([[0.2, 5.0, 0.4]])  # the env position's value must not matter
    adv, ret = gae(rewards, values, torch.tensor([[1.0, 0.0, 1.0]]), gamma=gamma, lam=lam)
    dense, _ = gae(torch.tensor([[0.0, 1.0]]), torch.tensor([[0.2, 0.4]]), torch.ones(1, 2), gamma=gamma, lam=lam)
    assert adv[0, 1] == 0 and ret[0, 1] == 0
    assert [adv[0, 0].item(), adv[0, 2].item()] == pytest.approx(dense[0].tolist())


def test_the_gae_estimator_is_chosen_from_the_registry_and_whitens_over_policy_tokens() -> None:
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, -1.0, 0.0]])
    values = torch.tensor([[0.1, 0.2, 0.3], [0.0, 0.5, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    x = AdvantageInputs(rewards=torch.zeros(2), group_size=1, mask=mask, token_rewards=rewards, values=values)
    raw = ADVANTAGE_ESTIMATORS.get("gae")(x, AdvantageOptions(gamma=1.0, lam=0.95, whiten=False))
    expected, returns = gae(rewards, values, mask.float(), gamma=1.0, lam=0.95)
    assert torch.equal(raw.advantages, expected) and raw.returns is not None and torch.equal(raw.returns, returns)
    white = ADVANTAGE_ESTIMATORS.get("gae")(x, AdvantageOptions(gamma=1.0, lam=0.95, whiten=True)).advantages
    kept = white[mask.bool()]
    assert float(kept.mean()) == pytest.approx(0.0, abs=1e-6) and white[1, 2] == 0
    with pytest.raises(ValueError, match="GAE needs"):
        ADVANTAGE_ESTIMATORS.get("gae")(AdvantageInputs(torch.zeros(2), 1, mask), AdvantageOptions())


def test_token_rewards_give_an_empty_completion_nothing() -> None:
    r = ppo_token_rewards(torch.tensor([3.0]), torch.ones(1, 3), torch.zeros(1, 3), beta=0.1)
    assert r.abs().sum() == 0


def test_value_loss_is_clipped_only_beyond_the_boundary() -> None:
    old = torch.zeros(1, 3)
    returns = torch.ones(1, 3)
    values = torch.tensor([[0.5, 0.1, -0.5]], requires_grad=True)
    out = value_loss_clipped(values, old, returns, torch.ones(1, 3), clip=0.2)
    # 0.5 moved past V_old + 0.2 toward R: the clipped term (0.2 − 1)² = 0.64 wins, its gradient is 0;
    # 0.1 is inside the range: both terms agree; −0.5 moved away from R: the unclipped 2.25 wins.
    assert out.per_token.tolist()[0] == pytest.approx([0.32, 0.405, 1.125])
    assert out.clipped.tolist()[0] == [True, False, False]
    out.per_token.sum().backward()
    assert values.grad is not None
    assert values.grad.tolist()[0] == pytest.approx([0.0, -0.9, -1.5])


def test_value_loss_at_the_old_values_equals_half_the_squared_error_and_respects_the_mask() -> None:
    torch.manual_seed(2)
    v, r = torch.randn(2, 4), torch.randn(2, 4)
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]], dtype=torch.float32)
    clipped = value_loss_clipped(v, v, r, mask, clip=0.2)
    unclipped = value_loss_clipped(v, v, r, mask, clip=None)
    assert torch.allclose(clipped.per_token, unclipped.per_token)
    assert torch.allclose(clipped.per_token, 0.5 * (v - r) ** 2 * mask)
    assert not clipped.clipped.any()


def test_explained_variance() -> None:
    r = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    mask = torch.ones(1, 4)
    assert explained_variance(r, r, mask) == pytest.approx(1.0)
    assert explained_variance(torch.full_like(r, 2.5), r, mask) == pytest.approx(0.0)
    assert explained_variance(-r, r, mask) < 0
    assert math.isnan(explained_variance(torch.zeros(1, 4), torch.ones(1, 4), mask))  # constant returns


def test_whitened_advantages_have_zero_mean_unit_variance_on_the_mask() -> None:
    torch.manual_seed(3)
    adv = torch.randn(4, 6) * 3 + 1
    mask = torch.ones(4, 6)
    mask[0, 3:] = 0
    w = masked_whiten(adv, mask) * mask
    assert float(masked_mean(w, mask)) == pytest.approx(0.0, abs=1e-6)
    vals = w[mask.bool()]
    assert float(vals.var()) == pytest.approx(1.0, abs=1e-5)
    assert w[0, 3:].abs().sum() == 0


def test_adaptive_kl_controller_moves_beta_toward_the_target() -> None:
    beta = 0.1
    for _ in range(10):  # KL persistently above target: β grows, by at most 20%·n/horizon per update
        new = adaptive_kl_update(beta, observed_kl=12.0, target=6.0, horizon=100, n_steps=10)
        assert new == pytest.approx(beta * 1.02)
        beta = new
    assert adaptive_kl_update(0.1, observed_kl=6.0, target=6.0, horizon=100, n_steps=10) == pytest.approx(0.1)
    assert adaptive_kl_update(0.1, observed_kl=5.7, target=6.0, horizon=100, n_steps=10) == pytest.approx(
        0.1 * (1 - 0.05 * 0.1)
    )

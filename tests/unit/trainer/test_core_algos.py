"""trainer.algorithms.core_algos: registries, log-probs, KL estimators, advantages, policy losses and aggregations
against hand-computed values and the invariants of rl-algorithms.md §5."""

import math
from itertools import pairwise

import pytest
import torch

from trainer.algorithms.core_algos import (
    ADVANTAGE_ESTIMATORS,
    AGGREGATIONS,
    KL_ESTIMATORS,
    POLICY_LOSSES,
    AdvantageInputs,
    AdvantageOptions,
    ClipOptions,
    LossScale,
    PolicyLossOutput,
    Registry,
    adaptive_kl_update,
    cosine_or_constant_lr,
    entropy_from_logits,
    masked_mean,
    masked_sum,
    masked_whiten,
    overlong_penalty,
    selective_log_softmax,
)

AGG_NAMES = ["seq_mean_token_mean", "seq_mean_token_sum_norm", "token_mean"]


def lengths_mask(lengths: list[int], width: int) -> torch.Tensor:
    """[B, width] right-padded mask of the given lengths."""
    return (torch.arange(width).unsqueeze(0) < torch.tensor(lengths).unsqueeze(-1)).long()


# ---------------------------------------------------------------------------------------------------------------
# Registries
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("registry", "expected"),
    [
        (ADVANTAGE_ESTIMATORS, ["dr_grpo", "gae", "grpo", "reinforce", "rloo"]),
        (POLICY_LOSSES, ["cispo", "clipped", "importance_sampling", "sequence_clipped"]),
        (KL_ESTIMATORS, ["k1", "k2", "k3"]),
        (AGGREGATIONS, AGG_NAMES),
    ],
)
def test_registry_holds_exactly_the_expected_names(registry: Registry, expected: list[str]) -> None:
    assert registry.names() == expected
    assert list(registry) == expected
    for name in expected:
        assert name in registry
        assert callable(registry.get(name))


@pytest.mark.parametrize("registry", [ADVANTAGE_ESTIMATORS, POLICY_LOSSES, KL_ESTIMATORS, AGGREGATIONS])
def test_registry_unknown_name_raises_key_error_listing_valid_names(registry: Registry) -> None:
    with pytest.raises(KeyError) as exc:
        registry.get("no_such_thing")
    message = str(exc.value)
    assert "no_such_thing" in message
    for name in registry.names():
        assert name in message
    assert "no_such_thing" not in registry


def test_registry_registering_a_name_twice_raises() -> None:
    reg: Registry = Registry("thing", ("a",))
    reg.register("a")(lambda: 1)
    with pytest.raises(ValueError, match="registered twice"):
        reg.register("a")(lambda: 2)
    assert reg.get("a")() == 1


# ---------------------------------------------------------------------------------------------------------------
# Masked reductions, log-probs, entropy
# ---------------------------------------------------------------------------------------------------------------


def test_masked_sum_and_mean_ignore_nan_and_inf_at_masked_positions() -> None:
    x = torch.tensor([[1.0, 2.0, float("nan")], [4.0, float("inf"), float("-inf")]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    assert masked_sum(x, mask).item() == 7.0
    assert masked_sum(x, mask, dim=-1).tolist() == [3.0, 4.0]
    assert masked_mean(x, mask).item() == pytest.approx(7.0 / 3.0)
    assert masked_mean(x, mask, dim=-1).tolist() == [1.5, 4.0]


def test_masked_mean_of_empty_mask_is_zero() -> None:
    assert masked_mean(torch.ones(2, 3), torch.zeros(2, 3)).item() == 0.0


def test_selective_log_softmax_equals_log_softmax_gather_fp32() -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 11, generator=g) * 4
    ids = torch.randint(0, 11, (3, 5), generator=g)
    expected = torch.log_softmax(logits, -1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    got = selective_log_softmax(logits, ids)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=0)


def test_selective_log_softmax_of_bf16_input_is_computed_in_fp32() -> None:
    g = torch.Generator().manual_seed(1)
    logits = (torch.randn(4, 6, 50, generator=g) * 3).bfloat16()
    ids = torch.randint(0, 50, (4, 6), generator=g)
    expected = torch.log_softmax(logits.float(), -1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    got = selective_log_softmax(logits, ids)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=0)
    # a bf16 log-softmax would be off by far more than that: the fp32 path is what makes ratios exact
    bf16_path = torch.log_softmax(logits, -1).gather(-1, ids.unsqueeze(-1)).squeeze(-1).float()
    assert (bf16_path - expected).abs().max() > 1e-4


def test_selective_log_softmax_is_shift_invariant_and_stable_for_large_logits() -> None:
    logits = torch.tensor([[1.0, 2.0, 3.0]])
    ids = torch.tensor([2])
    base = selective_log_softmax(logits, ids)
    shifted = selective_log_softmax(logits + 1e4, ids)
    assert torch.isfinite(shifted).all()
    torch.testing.assert_close(shifted, base, atol=1e-3, rtol=0)  # fp32 resolution at 1e4 is ~1e-3
    assert base.item() == pytest.approx(3.0 - math.log(math.exp(1) + math.exp(2) + math.exp(3)), abs=1e-6)


def test_entropy_of_uniform_is_log_v() -> None:
    for v in (2, 7, 32):
        assert entropy_from_logits(torch.zeros(v)).item() == pytest.approx(math.log(v), abs=1e-6)
    # any constant logits are uniform too
    assert entropy_from_logits(torch.full((3, 5), 7.5)).tolist() == pytest.approx([math.log(5)] * 3, abs=1e-6)


def test_entropy_of_near_one_hot_is_zero() -> None:
    logits = torch.tensor([100.0, 0.0, 0.0, 0.0])
    assert entropy_from_logits(logits).item() == pytest.approx(0.0, abs=1e-6)


def test_entropy_of_known_two_way_distribution() -> None:
    logits = torch.tensor([[math.log(0.25), math.log(0.75)]])
    expected = -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))  # 0.5623351...
    assert entropy_from_logits(logits).item() == pytest.approx(expected, abs=1e-6)
    # shift invariant; bf16 input is computed in fp32 (only the logits' own bf16 rounding remains)
    assert entropy_from_logits(logits + 3.0).item() == pytest.approx(expected, abs=1e-6)
    got = entropy_from_logits(logits.bfloat16())
    assert got.dtype == torch.float32
    assert got.item() == pytest.approx(expected, abs=2e-3)


def test_entropy_with_a_minus_inf_logit_ignores_that_token() -> None:
    logits = torch.tensor([[0.0, 0.0, float("-inf")], [5.0, float("-inf"), float("-inf")]])
    assert entropy_from_logits(logits).tolist() == pytest.approx([math.log(2), 0.0], abs=1e-6)


# ---------------------------------------------------------------------------------------------------------------
# KL estimators
# ---------------------------------------------------------------------------------------------------------------


def test_kl_estimators_on_hand_values() -> None:
    logp = torch.tensor([-1.0, -2.0])
    ref = torch.tensor([-1.5, -1.0])
    # Δ = logp − ref = [0.5, −1]
    assert KL_ESTIMATORS.get("k1")(logp, ref).tolist() == pytest.approx([0.5, -1.0])
    assert KL_ESTIMATORS.get("k2")(logp, ref).tolist() == pytest.approx([0.125, 0.5])
    expected_k3 = [math.exp(-0.5) + 0.5 - 1, math.exp(1.0) - 1.0 - 1.0]  # exp(−Δ) + Δ − 1
    assert KL_ESTIMATORS.get("k3")(logp, ref).tolist() == pytest.approx(expected_k3, abs=1e-6)


@pytest.mark.parametrize("name", ["k1", "k2", "k3"])
def test_kl_estimator_is_zero_with_zero_gradient_when_policy_equals_reference(name: str) -> None:
    logp = torch.tensor([[-0.3, -2.0, -7.0]], requires_grad=True)
    kl = KL_ESTIMATORS.get(name)(logp, logp.detach().clone())
    assert kl.tolist() == [[0.0, 0.0, 0.0]]
    if name != "k1":  # k1's gradient is 1 by construction; k2/k3 are minimal at Δ = 0
        kl.sum().backward()
        assert logp.grad is not None
        assert logp.grad.abs().max().item() == 0.0


def test_k2_and_k3_are_non_negative_everywhere_and_k3_finite_at_extremes() -> None:
    grid = torch.linspace(-30, 0, 61)
    logp, ref = torch.meshgrid(grid, grid, indexing="ij")
    assert (KL_ESTIMATORS.get("k2")(logp, ref) >= 0).all()
    k3 = KL_ESTIMATORS.get("k3")(logp, ref)
    assert (k3 >= 0).all()
    assert torch.isfinite(k3).all()
    # log-ratio clamped at ±20: one far-off token cannot overflow exp
    far = KL_ESTIMATORS.get("k3")(torch.tensor([-200.0, 0.0]), torch.tensor([0.0, -200.0]))
    assert far.tolist() == pytest.approx([math.exp(20) - 21, math.exp(-20) + 19], rel=1e-5)


def test_k1_and_k3_monte_carlo_means_converge_to_analytic_kl() -> None:
    p = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05])
    q = torch.tensor([0.2, 0.2, 0.2, 0.2, 0.2])
    analytic = float((p * (p / q).log()).sum())
    g = torch.Generator().manual_seed(1234)
    x = torch.multinomial(p, 200_000, replacement=True, generator=g)
    logp, ref = p.log()[x], q.log()[x]
    for name in ("k1", "k3"):
        k = KL_ESTIMATORS.get(name)(logp, ref).double()
        stderr = float(k.std() / math.sqrt(k.numel()))
        assert abs(float(k.mean()) - analytic) < 5 * stderr, name
    # k2 is biased: its mean is visibly not the KL on this toy
    k2 = KL_ESTIMATORS.get("k2")(logp, ref).double()
    assert abs(float(k2.mean()) - analytic) > 0.01


# ---------------------------------------------------------------------------------------------------------------
# Advantages
# ---------------------------------------------------------------------------------------------------------------


def adv(name: str, rewards: torch.Tensor, **opts: object) -> torch.Tensor:
    """The registry's estimator on rewards [P, G] (one completion token per row), back as [P, G]."""
    x = AdvantageInputs(rewards.reshape(-1), rewards.shape[1], mask=torch.ones(rewards.numel(), 1))
    return ADVANTAGE_ESTIMATORS.get(name)(x, AdvantageOptions(**opts)).advantages.view_as(rewards)  # type: ignore[arg-type]


def test_grpo_hand_values_with_unbiased_std_and_eps() -> None:
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0]])
    std = math.sqrt(1 / 3)  # unbiased: Σ(0.5²)·4 / 3
    expected = [0.5 / (std + 1e-4), -0.5 / (std + 1e-4), -0.5 / (std + 1e-4), 0.5 / (std + 1e-4)]
    assert adv("grpo", rewards).squeeze(0).tolist() == pytest.approx(expected, rel=1e-6)


def test_grpo_groups_sum_to_zero_and_have_unit_std() -> None:
    g = torch.Generator().manual_seed(0)
    rewards = torch.randn(5, 8, generator=g) * 3 + 1
    eps = 1e-4
    a = adv("grpo", rewards, std_eps=eps)
    torch.testing.assert_close(a.sum(1), torch.zeros(5), atol=1e-5, rtol=0)
    std = rewards.std(1, unbiased=True)
    torch.testing.assert_close(a.std(1, unbiased=True), std / (std + eps), atol=1e-6, rtol=0)


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_grpo_all_equal_group_gives_exact_zeros_without_nan(scale: str) -> None:
    rewards = torch.tensor([[0.1 + 0.2, 0.3, 0.1 * 3, 0.3], [1.0, 0.0, 1.0, 0.0], [0.35, 0.35, 0.35, 0.35]])
    a = adv("grpo", rewards, scale=scale)
    assert torch.isfinite(a).all()
    assert a[0].tolist() == [0.0] * 4
    assert a[2].tolist() == [0.0] * 4
    assert a[1].abs().min() > 0


def test_grpo_group_of_one_gives_zero_advantage() -> None:
    assert adv("grpo", torch.tensor([[3.0], [5.0]])).tolist() == [[0.0], [0.0]]


def test_grpo_scale_none_is_reward_minus_group_mean() -> None:
    rewards = torch.tensor([[1.0, 2.0, 6.0], [0.0, 0.0, 3.0]])
    expected = torch.tensor([[-2.0, -1.0, 3.0], [-1.0, -1.0, 2.0]])
    torch.testing.assert_close(adv("grpo", rewards, scale="none"), expected)


def test_grpo_scale_batch_divides_by_std_of_all_rewards() -> None:
    rewards = torch.tensor([[1.0, 2.0, 6.0], [0.0, 0.0, 3.0]])
    batch_std = float(rewards.flatten().std(unbiased=True))
    centred = torch.tensor([[-2.0, -1.0, 3.0], [-1.0, -1.0, 2.0]])
    torch.testing.assert_close(adv("grpo", rewards, scale="batch"), centred / (batch_std + 1e-4))


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo"])
def test_advantages_are_permutation_equivariant(name: str) -> None:
    g = torch.Generator().manual_seed(3)
    rewards = torch.randn(3, 5, generator=g)
    base = adv(name, rewards)
    within = torch.randperm(5, generator=g)
    torch.testing.assert_close(adv(name, rewards[:, within]), base[:, within], atol=1e-6, rtol=0)
    rows = torch.tensor([2, 0, 1])
    torch.testing.assert_close(adv(name, rewards[rows]), base[rows], atol=1e-6, rtol=0)


def test_dr_grpo_is_reward_minus_group_mean_and_ignores_scale() -> None:
    rewards = torch.tensor([[1.0, 2.0, 6.0], [4.0, 4.0, 4.0]])
    expected = torch.tensor([[-2.0, -1.0, 3.0], [0.0, 0.0, 0.0]])
    torch.testing.assert_close(adv("dr_grpo", rewards), expected)
    torch.testing.assert_close(adv("dr_grpo", rewards, scale="group"), adv("grpo", rewards, scale="none"))


def test_rloo_hand_values_leave_one_out() -> None:
    rewards = torch.tensor([[1.0, 2.0, 6.0]])
    # A_i = r_i − mean_{j≠i}: 1 − 4, 2 − 3.5, 6 − 1.5
    a = adv("rloo", rewards)
    assert a.squeeze(0).tolist() == pytest.approx([-3.0, -1.5, 4.5])
    # = G/(G−1)·(r_i − mean)
    assert a.squeeze(0).tolist() == pytest.approx((1.5 * (rewards - rewards.mean())).squeeze(0).tolist())


def test_rloo_sums_to_zero_and_scales_centred_rewards() -> None:
    g = torch.Generator().manual_seed(5)
    rewards = torch.randn(4, 6, generator=g)
    a = adv("rloo", rewards)
    torch.testing.assert_close(a.sum(1), torch.zeros(4), atol=1e-5, rtol=0)
    torch.testing.assert_close(a, 6 / 5 * (rewards - rewards.mean(1, keepdim=True)), atol=1e-6, rtol=0)


def test_rloo_with_two_samples_is_the_difference() -> None:
    a = adv("rloo", torch.tensor([[3.0, 1.0], [0.0, 0.5]]))
    assert a.tolist() == [[2.0, -2.0], [-0.5, 0.5]]


def test_rloo_baseline_of_a_sample_does_not_depend_on_its_own_reward() -> None:
    rewards = torch.tensor([[1.0, 2.0, 6.0, 3.0]])
    bumped = rewards.clone()
    bumped[0, 2] = -10.0
    baseline = rewards - adv("rloo", rewards)
    baseline_bumped = bumped - adv("rloo", bumped)
    assert baseline_bumped[0, 2].item() == pytest.approx(baseline[0, 2].item())
    assert (baseline_bumped[0, [0, 1, 3]] != baseline[0, [0, 1, 3]]).all()


def test_rloo_group_of_one_raises() -> None:
    with pytest.raises(ValueError, match="at least 2"):
        adv("rloo", torch.tensor([[1.0], [2.0]]))


def test_reinforce_baselines() -> None:
    rewards = torch.tensor([[1.0, 3.0], [5.0, 7.0]])
    none = adv("reinforce", rewards, baseline="none")
    assert none.tolist() == rewards.tolist()
    none[0, 0] = 99.0  # a copy, not a view of the rewards
    assert rewards[0, 0].item() == 1.0
    # the batch mean (4), not the group means
    assert adv("reinforce", rewards, baseline="batch_mean").tolist() == [[-3.0, -1.0], [1.0, 3.0]]
    assert adv("reinforce", torch.tensor([[2.0], [4.0]])).tolist() == [[-1.0], [1.0]]


# ---------------------------------------------------------------------------------------------------------------
# Token-level clipped surrogate
# ---------------------------------------------------------------------------------------------------------------


def clipped(
    logp: torch.Tensor, old: torch.Tensor, a: torch.Tensor, mask: torch.Tensor, **opts: object
) -> PolicyLossOutput:
    return POLICY_LOSSES.get("clipped")(logp, old, a, mask, ClipOptions(**opts))  # type: ignore[arg-type]


@pytest.mark.parametrize("dual_clip", [None, 3.0])
def test_clipped_first_iteration_is_reinforce(dual_clip: float | None) -> None:
    g = torch.Generator().manual_seed(0)
    logp = (torch.randn(3, 4, generator=g) - 2).requires_grad_()
    a = torch.tensor([1.5, -0.7, 0.0])
    mask = lengths_mask([4, 2, 3], 4)
    out = clipped(logp, logp.detach(), a, mask, dual_clip=dual_clip, epsilon_high=0.28)
    assert (out.ratio == 1.0).all()
    expected = -a.unsqueeze(-1) * mask
    torch.testing.assert_close(out.per_token, expected, atol=0, rtol=0)
    assert not out.clipped_low.any() and not out.clipped_high.any() and not out.clipped_dual.any()

    out.per_token.sum().backward()
    grad_loss = logp.grad.clone()  # type: ignore[union-attr]
    logp.grad = None
    (-a.unsqueeze(-1) * logp * mask).sum().backward()
    torch.testing.assert_close(grad_loss, logp.grad, atol=1e-7, rtol=0)


def test_clipped_accepts_per_token_advantages() -> None:
    logp = torch.tensor([[-1.0, -2.0]])
    a = torch.tensor([[2.0, -3.0]])
    out = clipped(logp, logp, a, torch.ones(1, 2))
    assert out.per_token.tolist() == [[-2.0, 3.0]]


def clip_grid() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ρ ∈ {0.5, 0.9, 1.1, 1.5} × A ∈ {+1, −1}: logp, old_logp, advantages [2, 4]."""
    ratios = torch.tensor([0.5, 0.9, 1.1, 1.5])
    old = torch.tensor([[-1.0, -2.0, -0.5, -3.0], [-1.5, -0.2, -4.0, -1.0]])
    logp = old + ratios.log()
    a = torch.tensor([[1.0] * 4, [-1.0] * 4])
    return logp, old, a


def test_clipped_loss_values_in_every_region() -> None:
    logp, old, a = clip_grid()
    out = clipped(logp, old, a, torch.ones(2, 4))
    torch.testing.assert_close(out.ratio, torch.tensor([[0.5, 0.9, 1.1, 1.5]] * 2), atol=1e-6, rtol=0)
    expected = torch.tensor(
        [
            [-0.5, -0.9, -1.1, -1.2],  # A>0: max(−ρ, −clip(ρ)); ρ=1.5 capped at 1+ε
            [0.8, 0.9, 1.1, 1.5],  # A<0: max(ρ, clip(ρ)); ρ=0.5 floored at 1−ε
        ]
    )
    torch.testing.assert_close(out.per_token, expected, atol=1e-6, rtol=0)


def test_clipped_gradient_is_zero_exactly_in_the_clipped_regions_and_flags_count_them() -> None:
    logp, old, a = clip_grid()
    logp.requires_grad_()
    out = clipped(logp, old, a, torch.ones(2, 4))
    out.per_token.sum().backward()
    grad = logp.grad
    assert grad is not None
    zero = torch.tensor([[False, False, False, True], [True, False, False, False]])
    assert (grad[zero] == 0).all()
    # elsewhere the unclipped branch: d(−Aρ)/dlogp = −Aρ
    torch.testing.assert_close(grad[~zero], (-a * out.ratio.detach())[~zero], atol=1e-6, rtol=0)
    assert (grad[~zero] != 0).all()
    assert out.clipped_high.tolist() == [[False, False, False, True], [False] * 4]
    assert out.clipped_low.tolist() == [[False] * 4, [True, False, False, False]]
    assert not out.clipped_dual.any()


def test_clipped_epsilon_high_differs_from_epsilon_low() -> None:
    old = torch.tensor([[-1.0]])
    logp = (old + math.log(1.25)).requires_grad_()
    a = torch.tensor([1.0])
    wide = clipped(logp, old, a, torch.ones(1, 1), epsilon_low=0.2, epsilon_high=0.28)
    wide.per_token.sum().backward()
    assert wide.per_token.item() == pytest.approx(-1.25, abs=1e-6)
    assert logp.grad is not None and logp.grad.item() == pytest.approx(-1.25, abs=1e-6)
    assert not wide.clipped_high.any()

    logp.grad = None
    narrow = clipped(logp, old, a, torch.ones(1, 1), epsilon_low=0.2, epsilon_high=0.2)
    narrow.per_token.sum().backward()
    assert narrow.per_token.item() == pytest.approx(-1.2, abs=1e-6)
    assert logp.grad.item() == 0.0
    assert narrow.clipped_high.all()

    # ε_high does not move the lower bound: A<0, ρ=0.75 is clipped at 1−ε_low = 0.8 either way
    low = clipped(old + math.log(0.75), old, -a, torch.ones(1, 1), epsilon_low=0.2, epsilon_high=0.28)
    assert low.per_token.item() == pytest.approx(0.8, abs=1e-6)
    assert low.clipped_low.all()


def test_dual_clip_caps_negative_advantage_loss_and_leaves_positive_unchanged() -> None:
    ratios = torch.tensor([[4.0, 2.0, 4.0, 0.5]])
    old = torch.tensor([[-1.0, -1.0, -2.0, -1.0]])
    logp = (old + ratios.log()).requires_grad_()
    a = torch.tensor([[-1.0, -1.0, 1.0, 1.0]])
    mask = torch.ones(1, 4)
    out = clipped(logp, old, a, mask, dual_clip=3.0)
    out.per_token.sum().backward()
    # A<0, ρ=4 > c: c·|A| = 3 with zero gradient; A<0, ρ=2 < c: unchanged ρ·|A| = 2
    assert out.per_token[0, :2].tolist() == pytest.approx([3.0, 2.0], abs=1e-5)
    assert logp.grad is not None
    assert logp.grad[0, 0].item() == 0.0
    assert logp.grad[0, 1].item() == pytest.approx(2.0, abs=1e-5)
    assert out.clipped_dual.tolist() == [[True, False, False, False]]
    # A>0: identical to no dual clip
    plain = clipped(logp.detach(), old, a, mask)
    torch.testing.assert_close(out.per_token[0, 2:].detach(), plain.per_token[0, 2:], atol=0, rtol=0)
    assert out.per_token[0, 2].item() == pytest.approx(-1.2, abs=1e-6)


@pytest.mark.parametrize("loss_name", ["clipped", "sequence_clipped"])
@pytest.mark.parametrize("agg_name", AGG_NAMES)
def test_masked_positions_with_nan_and_inf_contribute_nothing(loss_name: str, agg_name: str) -> None:
    nan, inf = float("nan"), float("inf")
    logp = torch.tensor([[-1.0, -0.5, nan, -inf], [-2.0, inf, nan, nan]], requires_grad=True)
    old = torch.tensor([[-1.1, -0.4, nan, -inf], [-1.9, -inf, 0.0, nan]])
    mask = lengths_mask([2, 1], 4)
    a = torch.tensor([1.0, -2.0])
    out = POLICY_LOSSES.get(loss_name)(logp, old, a, mask, ClipOptions())
    assert torch.isfinite(out.per_token).all()
    assert (out.per_token[mask == 0] == 0).all()
    loss = AGGREGATIONS.get(agg_name)(out.per_token, mask, LossScale(3.0, 2, 4))
    assert torch.isfinite(loss)
    loss.backward()
    assert logp.grad is not None
    assert torch.isfinite(logp.grad).all()
    assert (logp.grad[mask == 0] == 0).all()
    assert (logp.grad[mask == 1] != 0).all()

    # the same loss as with finite garbage there
    clean_logp = torch.where(mask.bool(), logp.detach(), torch.full_like(logp, -3.0))
    clean_old = torch.where(mask.bool(), old, torch.full_like(old, -3.0))
    clean = POLICY_LOSSES.get(loss_name)(clean_logp, clean_old, a, mask, ClipOptions())
    assert AGGREGATIONS.get(agg_name)(clean.per_token, mask, LossScale(3.0, 2, 4)).item() == pytest.approx(loss.item())


# ---------------------------------------------------------------------------------------------------------------
# Sequence-level clipped surrogate
# ---------------------------------------------------------------------------------------------------------------


def test_sequence_clipped_ratio_is_constant_over_the_sequence() -> None:
    g = torch.Generator().manual_seed(2)
    old = torch.randn(3, 5, generator=g) - 2
    logp = old + 0.05 * torch.randn(3, 5, generator=g)
    mask = lengths_mask([5, 2, 3], 5)
    out = POLICY_LOSSES.get("sequence_clipped")(logp, old, torch.tensor([1.0, -1.0, 0.5]), mask, ClipOptions())
    for i, n in enumerate([5, 2, 3]):
        expected = math.exp(float((logp[i, :n] - old[i, :n]).sum()))
        assert out.ratio[i, :n].tolist() == pytest.approx([expected] * n, rel=1e-6)


def test_sequence_clipped_seq_mean_token_mean_is_mean_of_sequence_losses_with_hand_gradient() -> None:
    old = torch.tensor([[-1.0, -2.0, -1.0], [-0.5, -0.5, -0.5], [-1.0, -1.0, -1.0]])
    # Σ log ρ per sequence: 0.1 (ρ≈1.105, unclipped), 0.4 (ρ≈1.49, clipped for A>0), −0.4 (ρ≈0.67, A<0 → clipped)
    delta = torch.tensor([[0.05, 0.05, 0.0], [0.2, 0.2, 7.0], [-0.2, -0.2, 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 0], [1, 1, 1]])
    logp = (old + delta).requires_grad_()
    a = torch.tensor([2.0, 1.0, -1.0])
    out = POLICY_LOSSES.get("sequence_clipped")(logp, old, a, mask, ClipOptions())
    rho = [math.exp(0.1), math.exp(0.4), math.exp(-0.4)]
    per_seq = [-2.0 * rho[0], -1.0 * 1.2, 1.0 * 0.8]
    loss = AGGREGATIONS.get("seq_mean_token_mean")(out.per_token, mask, LossScale(7.0, 3, 3))
    assert loss.item() == pytest.approx(sum(per_seq) / 3, abs=1e-6)
    assert out.clipped_high[1, :2].all() and out.clipped_low[2].all()
    assert not out.clipped_high[0].any() and not out.clipped_low[0].any()
    loss.backward()
    grad = logp.grad
    assert grad is not None
    # d/dlogp_t of −A·ρ_i = −A·ρ_i on every valid token of sequence 0; 1/B from the mean over sequences
    assert grad[0, :2].tolist() == pytest.approx([-2.0 * rho[0] / 3] * 2, abs=1e-6)
    assert grad[0, 2].item() == 0.0
    assert grad[1].abs().max().item() == 0.0
    assert grad[2].abs().max().item() == 0.0


def test_sequence_clipped_first_iteration_has_unit_ratio() -> None:
    logp = torch.tensor([[-1.0, -2.0], [-0.3, -0.1]])
    mask = torch.tensor([[1, 1], [1, 0]])
    out = POLICY_LOSSES.get("sequence_clipped")(logp, logp, torch.tensor([1.5, -2.0]), mask, ClipOptions())
    assert (out.ratio == 1).all()
    assert out.per_token.tolist() == [[-1.5, -1.5], [2.0, 0.0]]


# ---------------------------------------------------------------------------------------------------------------
# Aggregations
# ---------------------------------------------------------------------------------------------------------------


def test_aggregations_on_unequal_lengths_by_hand() -> None:
    per_token = torch.tensor([[1.0, 100.0, 100.0], [2.0, 3.0, 4.0]])  # garbage where masked
    mask = torch.tensor([[1, 0, 0], [1, 1, 1]])
    scale = LossScale(total_tokens=4.0, total_sequences=2, max_completion_tokens=3)
    token_mean = AGGREGATIONS.get("token_mean")(per_token, mask, scale).item()
    seq_mean = AGGREGATIONS.get("seq_mean_token_mean")(per_token, mask, scale).item()
    sum_norm = AGGREGATIONS.get("seq_mean_token_sum_norm")(per_token, mask, scale).item()
    assert token_mean == pytest.approx(10 / 4)
    assert seq_mean == pytest.approx((1 + 3) / 2)
    assert sum_norm == pytest.approx(10 / (2 * 3))
    assert len({round(token_mean, 6), round(seq_mean, 6), round(sum_norm, 6)}) == 3
    # Dr. GRPO's constant is the generation budget of the scale, not the padded width
    budget = LossScale(total_tokens=4.0, total_sequences=2, max_completion_tokens=8)
    assert AGGREGATIONS.get("seq_mean_token_sum_norm")(per_token, mask, budget).item() == pytest.approx(10 / 16)


def test_aggregation_per_token_weights() -> None:
    lengths = [1, 3, 2]
    mask = lengths_mask(lengths, 4)
    per_token = torch.zeros(3, 4, requires_grad=True)
    scale = LossScale(total_tokens=6.0, total_sequences=3, max_completion_tokens=5)
    expected = {
        "token_mean": mask / 6,  # every token 1/N
        "seq_mean_token_mean": mask / (3 * torch.tensor(lengths).unsqueeze(-1)),  # every sequence 1/B
        "seq_mean_token_sum_norm": mask / (3 * 5),  # every token 1/(B·L_max)
    }
    for name, weights in expected.items():
        per_token.grad = None
        AGGREGATIONS.get(name)(per_token, mask, scale).backward()
        torch.testing.assert_close(per_token.grad, weights.float(), atol=1e-7, rtol=0, msg=name)


@pytest.mark.parametrize("name", AGG_NAMES)
def test_aggregation_over_micro_batches_equals_full_batch(name: str) -> None:
    g = torch.Generator().manual_seed(7)
    lengths = [1, 3, 2, 5, 4]
    width = 6
    mask = lengths_mask(lengths, width)
    param = torch.randn(len(lengths), width, generator=g).requires_grad_()
    scale = LossScale(total_tokens=float(sum(lengths)), total_sequences=len(lengths), max_completion_tokens=8)
    agg = AGGREGATIONS.get(name)

    full = agg(param * 2.0, mask, scale)
    full.backward()
    full_grad = param.grad.clone()  # type: ignore[union-attr]
    param.grad = None

    total = torch.zeros(())
    for rows in (slice(0, 1), slice(1, 3), slice(3, 5)):
        micro_mask = mask[rows]
        w = int(micro_mask.sum(-1).max())  # each micro-batch trimmed to its own padded width
        micro = agg(param[rows, :w] * 2.0, micro_mask[:, :w], scale)
        micro.backward()
        total = total + micro.detach()
    assert total.item() == pytest.approx(full.item(), abs=1e-6)
    torch.testing.assert_close(param.grad, full_grad, atol=1e-7, rtol=0)


@pytest.mark.parametrize("name", AGG_NAMES)
def test_aggregation_is_unchanged_by_extra_padding_columns(name: str) -> None:
    g = torch.Generator().manual_seed(8)
    lengths = [2, 4, 1]
    mask = lengths_mask(lengths, 4)
    per_token = torch.randn(3, 4, generator=g)
    scale = LossScale(total_tokens=7.0, total_sequences=3, max_completion_tokens=6)
    padded = torch.cat([per_token, torch.randn(3, 3, generator=g) * 1e3], dim=1)
    padded_mask = torch.cat([mask, torch.zeros(3, 3, dtype=mask.dtype)], dim=1)
    agg = AGGREGATIONS.get(name)
    assert agg(padded, padded_mask, scale).item() == pytest.approx(agg(per_token, mask, scale).item(), abs=1e-6)


def test_seq_mean_token_mean_of_zero_sum_advantages_on_first_step_is_zero_but_gradient_is_not() -> None:
    # open-r1 issue 239: ρ ≡ 1, whole groups, advantages summing to zero → loss 0, gradient ≠ 0
    logp = torch.tensor([[-1.0, -2.0], [-0.5, -0.7]], requires_grad=True)
    mask = torch.ones(2, 2)
    a = adv("grpo", torch.tensor([[1.0, 0.0]])).flatten()
    out = clipped(logp, logp.detach(), a, mask)
    loss = AGGREGATIONS.get("seq_mean_token_mean")(out.per_token, mask, LossScale(4.0, 2, 2))
    assert loss.item() == pytest.approx(0.0, abs=1e-6)
    loss.backward()
    assert logp.grad is not None and logp.grad.abs().min() > 0


# ---------------------------------------------------------------------------------------------------------------
# DAPO overlong penalty, adaptive KL, LR schedule, whitening
# ---------------------------------------------------------------------------------------------------------------


def test_overlong_penalty_hand_values() -> None:
    lengths = torch.tensor([0, 12, 13, 16, 20, 21, 100])
    pen = overlong_penalty(lengths, max_tokens=20, buffer=8)
    assert pen.tolist() == pytest.approx([0.0, 0.0, -1 / 8, -0.5, -1.0, -1.0, -1.0])
    assert overlong_penalty(lengths, max_tokens=20, buffer=8, factor=0.5).tolist() == pytest.approx(
        [0.0, 0.0, -1 / 16, -0.25, -0.5, -0.5, -0.5]
    )


def test_overlong_penalty_is_monotone_and_continuous() -> None:
    pen = overlong_penalty(torch.arange(0, 40), max_tokens=32, buffer=8)
    steps = pen[1:] - pen[:-1]
    assert (steps <= 0).all()
    assert steps.abs().max().item() == pytest.approx(1 / 8)


@pytest.mark.parametrize("buffer", [0, -1, 21])
def test_overlong_penalty_rejects_bad_buffer(buffer: int) -> None:
    with pytest.raises(ValueError, match="buffer"):
        overlong_penalty(torch.tensor([5]), max_tokens=20, buffer=buffer)


def test_overlong_penalty_buffer_equal_to_max_tokens_is_allowed() -> None:
    assert overlong_penalty(torch.tensor([0, 10, 20]), max_tokens=20, buffer=20).tolist() == [0.0, -0.5, -1.0]


def test_adaptive_kl_update() -> None:
    kw = {"target": 0.1, "horizon": 1000, "n_steps": 100}
    assert adaptive_kl_update(0.2, observed_kl=0.1, **kw) == pytest.approx(0.2)
    assert adaptive_kl_update(0.2, observed_kl=0.11, **kw) == pytest.approx(0.2 * (1 + 0.1 * 100 / 1000))
    assert adaptive_kl_update(0.2, observed_kl=0.09, **kw) == pytest.approx(0.2 * (1 - 0.1 * 100 / 1000))
    # error clipped at ±0.2
    assert adaptive_kl_update(0.2, observed_kl=10.0, **kw) == pytest.approx(0.2 * (1 + 0.2 * 0.1))
    assert adaptive_kl_update(0.2, observed_kl=0.0, **kw) == pytest.approx(0.2 * (1 - 0.2 * 0.1))


def test_lr_warmup_then_cosine() -> None:
    lr = [cosine_or_constant_lr(s, warmup=4, total=14, schedule="cosine") for s in range(20)]
    assert lr[:4] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    assert lr[4] == pytest.approx(1.0)
    assert lr[9] == pytest.approx(0.5)  # half-way through the 10 decay steps
    assert lr[14] == pytest.approx(0.0, abs=1e-12)
    assert lr[19] == pytest.approx(0.0, abs=1e-12)
    assert all(b <= a for a, b in pairwise(lr[3:]))


def test_lr_constant_and_no_warmup() -> None:
    assert [cosine_or_constant_lr(s, warmup=2, total=10, schedule="constant") for s in range(5)] == [
        0.5,
        1.0,
        1.0,
        1.0,
        1.0,
    ]
    assert cosine_or_constant_lr(0, warmup=0, total=10, schedule="cosine") == 1.0
    assert cosine_or_constant_lr(5, warmup=0, total=10, schedule="cosine") == pytest.approx(0.5)


def test_masked_whiten_has_zero_mean_unit_variance_and_zero_at_masked() -> None:
    g = torch.Generator().manual_seed(4)
    x = torch.randn(3, 6, generator=g) * 5 + 2
    mask = lengths_mask([6, 2, 4], 6)
    x[mask == 0] = float("nan")
    out = masked_whiten(x, mask)
    valid = out[mask == 1].double()
    assert valid.mean().item() == pytest.approx(0.0, abs=1e-6)
    assert valid.var(unbiased=True).item() == pytest.approx(1.0, abs=1e-6)
    assert (out[mask == 0] == 0).all()

    kept = masked_whiten(x, mask, shift_mean=False)
    original = x[mask == 1]
    assert kept[mask == 1].mean().item() == pytest.approx(original.mean().item(), abs=1e-5)
    assert kept[mask == 1].var(unbiased=True).item() == pytest.approx(1.0, abs=1e-5)


def test_masked_whiten_needs_two_values() -> None:
    with pytest.raises(ValueError, match="two"):
        masked_whiten(torch.tensor([1.0, 2.0]), torch.tensor([1, 0]))

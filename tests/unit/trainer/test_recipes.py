"""Recipe rows: a critic and GAE go together, and a critic's KL is a per-token reward."""

from __future__ import annotations

import pytest

from trainer.spec.recipes import RECIPES, Recipe


def test_gae_without_a_critic_and_a_critic_without_gae_are_refused() -> None:
    with pytest.raises(ValueError, match="GAE needs a critic"):
        Recipe("x", "gae", "clipped", "reward", needs_group=False)
    with pytest.raises(ValueError, match="GAE needs a critic"):
        Recipe("x", "grpo", "clipped", "reward", needs_group=True, critic=True)
    with pytest.raises(ValueError, match="per-token reward"):
        Recipe("x", "gae", "clipped", "loss", needs_group=False, critic=True)


def test_only_ppo_has_a_critic_and_only_dapo_its_sampling_parts() -> None:
    assert [n for n, r in RECIPES.items() if r.critic] == ["ppo"]
    assert [n for n, r in RECIPES.items() if r.dynamic_sampling or r.overlong_shaping] == ["dapo"]
    assert RECIPES["ppo"].advantage == "gae"

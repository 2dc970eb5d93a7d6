"""Methods are recipes, not subclasses: each online RL method is one row naming its parts.

The preference methods (reward_model, dpo) and supervised have their own loops (``trainer.loops.preference``,
``trainer.loops.supervised``) and losses in registries of ``trainer.algorithms.core_algos``.

The hyperparameter model of each method (``trainer.spec.config``) carries the paper's defaults for the knobs a user can
turn (clip range, β, aggregation, ...); the row fixes what makes the method itself.

Rows name their parts by the names declared in ``trainer.spec.names`` (checked here, without torch, so that the service
can read the recipes); ``trainer.algorithms.core_algos`` holds the functions under the same names.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from trainer.spec import names


@dataclass(frozen=True)
class Recipe:
    name: str
    advantage: str  # a name of names.ADVANTAGE_ESTIMATORS ("gae" for a method with a value model)
    policy_loss: str  # a name of names.POLICY_LOSSES
    kl_placement: Literal["loss", "reward"]  # β·KL added to the per-token loss, or −β·Σ_t KL to the reward
    needs_group: bool  # the baseline compares samples of one prompt: G ≥ 2
    # The parts a row turns on; their knobs are the method's hyperparameters, else the defining paper's defaults
    # (``trainer.loops.rl.Parts``), so that any row may combine them.
    dynamic_sampling: bool = False  # DAPO: drop all-equal groups and sample more (hyperparameter can turn it off)
    overlong_shaping: bool = False  # DAPO: soft overlong punishment added to the reward
    critic: bool = (
        False  # PPO: a value model, per-token rewards and GAE (``trainer.algorithms.core_algos.advantage_gae``)
    )
    paper: str = ""

    def __post_init__(self) -> None:
        names.check_name("advantage estimator", self.advantage, names.ADVANTAGE_ESTIMATORS)
        names.check_name("policy loss", self.policy_loss, names.POLICY_LOSSES)
        if self.critic != (self.advantage == "gae"):
            raise ValueError(f"recipe {self.name!r}: GAE needs a critic's values, and a critic's advantages are GAE's")
        if self.critic and self.kl_placement != "reward":
            raise ValueError(f"recipe {self.name!r}: a critic's KL is a per-token reward (kl_placement 'reward')")


RECIPES: dict[str, Recipe] = {
    r.name: r
    for r in (
        Recipe("grpo", "grpo", "clipped", "loss", needs_group=True, paper="arXiv 2402.03300"),
        Recipe("dr_grpo", "dr_grpo", "clipped", "loss", needs_group=True, paper="arXiv 2503.20783"),
        Recipe(
            "dapo",
            "grpo",
            "clipped",
            "loss",
            needs_group=True,
            dynamic_sampling=True,
            overlong_shaping=True,
            paper="arXiv 2503.14476",
        ),
        Recipe("rloo", "rloo", "sequence_clipped", "reward", needs_group=True, paper="arXiv 2402.14740"),
        Recipe("reinforce", "reinforce", "clipped", "reward", needs_group=False, paper="Williams 1992"),
        Recipe("ppo", "gae", "clipped", "reward", needs_group=False, critic=True, paper="arXiv 1707.06347, 2203.02155"),
    )
}

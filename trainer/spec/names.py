"""The names of the trainer's registries, declared once and importable without torch.

``trainer.algorithms.core_algos`` builds each registry from these declarations and fails at import when a declared name
has no function or a function is registered under an undeclared name, so the names here and the functions there cannot
drift. The spec (``trainer.spec.config``), the recipes and the service validate against these names without loading
torch.

Each set is a ``Literal`` type (what a typed config field accepts) and the tuple of its values (what code iterates).
"""

from __future__ import annotations

from typing import Literal, get_args

AdvantageEstimatorName = Literal["grpo", "dr_grpo", "rloo", "reinforce", "gae"]
PolicyLossName = Literal["clipped", "sequence_clipped", "importance_sampling", "cispo"]
KLEstimatorName = Literal["k1", "k2", "k3"]
AggregationName = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"]
DPOLossType = Literal["sigmoid", "robust", "ipo", "hinge"]
"""DPO's ``loss_type`` hyperparameter; the pairwise loss it selects is ``dpo_<loss_type>``."""

ADVANTAGE_ESTIMATORS: tuple[str, ...] = get_args(AdvantageEstimatorName)
POLICY_LOSSES: tuple[str, ...] = get_args(PolicyLossName)
KL_ESTIMATORS: tuple[str, ...] = get_args(KLEstimatorName)
AGGREGATIONS: tuple[str, ...] = get_args(AggregationName)
PAIRWISE_LOSSES: tuple[str, ...] = ("bradley_terry", *(f"dpo_{t}" for t in get_args(DPOLossType)))
BUILTIN_MODELS: tuple[str, ...] = ("tiny-arith", "tiny-calc")
"""The base models the project builds itself (`proxima models build NAME`): tiny-arith (addition with dropped
carries) and tiny-calc (three-number sums with a calculator tool, the agent task)."""


def check_name(kind: str, name: str, declared: tuple[str, ...]) -> None:
    """Raise ``KeyError`` naming the valid choices when ``name`` is not one of ``declared`` (the message a registry's
    ``get`` gives, for callers that must not import the registry)."""
    if name not in declared:
        raise KeyError(f"unknown {kind} {name!r}; valid: {', '.join(sorted(declared))}")

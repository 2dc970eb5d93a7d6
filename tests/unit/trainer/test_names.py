"""trainer.spec.names: the registries' names declared once, torch-free, and held equal to the registered functions."""

from __future__ import annotations

import subprocess
import sys

import pytest
from pydantic import ValidationError

from trainer.algorithms import core_algos
from trainer.algorithms.core_algos import Registry
from trainer.spec import names
from trainer.spec.config import DPOHyperparameters, GRPOHyperparameters
from trainer.spec.recipes import Recipe


@pytest.mark.parametrize(
    ("registry", "declared"),
    [
        (core_algos.ADVANTAGE_ESTIMATORS, names.ADVANTAGE_ESTIMATORS),
        (core_algos.POLICY_LOSSES, names.POLICY_LOSSES),
        (core_algos.KL_ESTIMATORS, names.KL_ESTIMATORS),
        (core_algos.AGGREGATIONS, names.AGGREGATIONS),
        (core_algos.PAIRWISE_LOSSES, names.PAIRWISE_LOSSES),
    ],
)
def test_each_registry_holds_exactly_its_declared_names(registry: Registry, declared: tuple[str, ...]) -> None:
    assert registry.names() == sorted(declared)


def test_pairwise_names_are_bradley_terry_and_one_dpo_loss_per_loss_type() -> None:
    assert names.PAIRWISE_LOSSES == ("bradley_terry", "dpo_sigmoid", "dpo_robust", "dpo_ipo", "dpo_hinge")


def test_registering_an_undeclared_name_raises_at_registration() -> None:
    reg: Registry = Registry("thing", ("a",))
    with pytest.raises(ValueError, match=r"^thing 'b' is not declared in trainer.spec.names$"):
        reg.register("b")


def test_a_declared_name_without_a_function_fails_the_completeness_check() -> None:
    reg: Registry = Registry("thing", ("a", "b", "c"))
    reg.register("b")(lambda: 1)
    with pytest.raises(ValueError, match=r"^thing 'a', 'c' declared in trainer.spec.names but not registered$"):
        reg.check_complete()
    reg.register("a")(lambda: 1)
    reg.register("c")(lambda: 1)
    reg.check_complete()


def test_config_accepts_every_declared_name_and_refuses_another() -> None:
    for name in names.KL_ESTIMATORS:
        assert GRPOHyperparameters(kl_estimator=name).kl_estimator == name
    for name in names.AGGREGATIONS:
        assert GRPOHyperparameters(loss_aggregation=name).loss_aggregation == name
    with pytest.raises(ValidationError):
        GRPOHyperparameters(kl_estimator="k4")
    with pytest.raises(ValidationError):
        GRPOHyperparameters(loss_aggregation="sum")
    for loss_type in ("sigmoid", "robust", "ipo", "hinge"):
        assert f"dpo_{DPOHyperparameters(loss_type=loss_type).loss_type}" in names.PAIRWISE_LOSSES


def test_a_recipe_naming_an_undeclared_part_is_refused_listing_the_valid_names() -> None:
    valid = "dr_grpo, gae, grpo, reinforce, rloo"
    with pytest.raises(KeyError, match=rf"unknown advantage estimator 'gspo'; valid: {valid}"):
        Recipe("x", "gspo", "clipped", "loss", needs_group=True)
    valid_losses = "cispo, clipped, importance_sampling, sequence_clipped"
    with pytest.raises(KeyError, match=rf"unknown policy loss 'gspo'; valid: {valid_losses}"):
        Recipe("x", "grpo", "gspo", "loss", needs_group=True)


@pytest.mark.parametrize(
    "module", ["trainer.spec.names", "trainer.spec.data", "trainer.spec.config", "trainer.spec.recipes"]
)
def test_module_imports_no_torch(module: str) -> None:
    # A fresh interpreter: this test process has torch loaded already.
    code = f"import sys, {module}; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout == "False\n"

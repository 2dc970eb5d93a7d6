"""Every hyperparameter of every method is finite and bounded: the same models serve the API
and ``proxima train``, so a bound here holds for both; no integer can overflow the database's int4 columns."""

from __future__ import annotations

import math
import types
import typing
from pathlib import Path
from typing import Any

import pytest

from trainer.spec.config import (
    HYPERPARAMETERS,
    MAX_STEPS,
    RL_METHODS,
    LoraSpec,
    SpecError,
    check_total_steps,
    load_spec,
    parse_spec,
)

GRADER = {
    "type": "string_check",
    "name": "acc",
    "input": "{{sample.output_text}}",
    "reference": "{{item.answer}}",
    "operation": "eq",
}
INT4_MAX = 2**31 - 1


def spec(method: str, hyperparameters: dict[str, Any] | None = None, **block: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"hyperparameters": hyperparameters or {}, **block}
    if method in RL_METHODS:
        body["grader"] = GRADER
    return {"model": "tiny", "training_file": "train.jsonl", "method": {"type": method, method: body}}


def numeric_kind(annotation: Any) -> type | None:
    """int or float for a field typed ``int``, ``float`` or either ``| None``; None for any other field."""
    args = set(typing.get_args(annotation)) if isinstance(annotation, types.UnionType) else {annotation}
    args.discard(type(None))
    return next(iter(args)) if len(args) == 1 and next(iter(args)) in (int, float) else None


NUMERIC = [
    (method, name, kind)
    for method, model in HYPERPARAMETERS.items()
    for name, field in model.model_fields.items()
    if (kind := numeric_kind(field.annotation)) is not None
]
FLOATS = [pytest.param(m, n, id=f"{m}.{n}") for m, n, kind in NUMERIC if kind is float]
INTS = [pytest.param(m, n, id=f"{m}.{n}") for m, n, kind in NUMERIC if kind is int]
LORA_NUMERIC = [(n, k) for n, f in LoraSpec.model_fields.items() if (k := numeric_kind(f.annotation)) is not None]


def test_the_numeric_fields_are_found() -> None:  # the tests below would pass vacuously on an empty list
    names = {name for _, name, _ in NUMERIC}
    assert len(FLOATS) > 50 and len(INTS) > 100
    assert {"learning_rate_multiplier", "weight_decay", "beta", "margin", "max_steps", "batch_size"} <= names
    assert {n for n, _ in LORA_NUMERIC} == {"r", "alpha", "dropout"}


@pytest.mark.parametrize(("method", "name"), FLOATS)
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, 1e308, float(2**31)])
def test_every_float_refuses_non_finite_and_huge_values(method: str, name: str, value: float) -> None:
    with pytest.raises(SpecError) as err:
        parse_spec(spec(method, {name: value}))
    assert err.value.param == f"method.{method}.hyperparameters.{name}"


@pytest.mark.parametrize(("method", "name"), INTS)
@pytest.mark.parametrize("value", [INT4_MAX + 1, 2**40, -(2**40)])
def test_every_integer_is_bounded_within_int4(method: str, name: str, value: int) -> None:
    with pytest.raises(SpecError) as err:
        parse_spec(spec(method, {name: value}))
    assert err.value.param == f"method.{method}.hyperparameters.{name}"


@pytest.mark.parametrize("name", [n for n, _ in LORA_NUMERIC])
@pytest.mark.parametrize("value", [math.nan, math.inf, 2**40])
def test_every_lora_number_is_finite_and_bounded(name: str, value: float) -> None:
    with pytest.raises(SpecError) as err:
        parse_spec(spec("grpo", lora={name: value}))
    assert err.value.param == f"method.grpo.lora.{name}"


def test_learning_rate_times_its_multiplier_is_at_most_one() -> None:
    assert parse_spec(spec("grpo", {"learning_rate": 0.01, "learning_rate_multiplier": 100})).method
    with pytest.raises(SpecError) as err:
        parse_spec(spec("grpo", {"learning_rate": 0.5, "learning_rate_multiplier": 3}))
    assert err.value.param == "method.grpo.hyperparameters.learning_rate_multiplier"
    assert "1.5" in err.value.detail


def test_one_rl_step_samples_at_most_65536_sequences() -> None:
    assert parse_spec(spec("grpo", {"batch_size": 256, "group_size": 256}))
    with pytest.raises(SpecError) as err:
        parse_spec(spec("grpo", {"batch_size": 512, "group_size": 256}))
    assert err.value.param == "method.grpo.hyperparameters.group_size"


def test_the_seed_fits_int4() -> None:
    assert parse_spec({**spec("grpo"), "seed": INT4_MAX}).seed == INT4_MAX
    with pytest.raises(SpecError) as err:
        parse_spec({**spec("grpo"), "seed": INT4_MAX + 1})
    assert err.value.param == "seed"


def test_yaml_nan_and_inf_are_refused_by_the_command_line_too(tmp_path: Path) -> None:
    path = tmp_path / "spec.yaml"
    path.write_text(
        "model: tiny\ntraining_file: t.jsonl\nmethod:\n  type: dpo\n  dpo:\n    hyperparameters:\n      beta: .nan\n"
    )
    with pytest.raises(SpecError) as err:
        load_spec(path)
    assert err.value.param == "method.dpo.hyperparameters.beta"
    path.write_text(path.read_text().replace(".nan", ".inf"))
    with pytest.raises(SpecError):
        load_spec(path)


def test_total_steps_are_max_steps_or_epochs_of_batches() -> None:
    hp = parse_spec(spec("supervised", {"batch_size": 4, "n_epochs": 3})).method.hyperparameters
    assert hp.total_steps(10) == 3 * 3
    hp = parse_spec(spec("supervised", {"batch_size": 4, "n_epochs": 3, "max_steps": 5})).method.hyperparameters
    assert hp.total_steps(10) == 5


def test_epochs_planning_more_than_max_steps_are_refused_naming_n_epochs() -> None:
    job = parse_spec(spec("dpo", {"batch_size": 1, "n_epochs": 1000}))
    check_total_steps(job, n_examples=MAX_STEPS // 1000)
    with pytest.raises(SpecError) as err:
        check_total_steps(job, n_examples=MAX_STEPS // 1000 + 1)
    assert err.value.param == "method.dpo.hyperparameters.n_epochs"
    assert "max_steps" in err.value.detail
    # max_steps, bounded on its own, decides instead of the epochs
    check_total_steps(parse_spec(spec("dpo", {"batch_size": 1, "n_epochs": 1000, "max_steps": 10})), n_examples=10**9)

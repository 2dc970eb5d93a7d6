"""keep_best and early stopping in the shared step loop, the over-optimisation watch, held-out sub-graders, and the
reward model's validation split and pair kinds: each against a scripted sequence of validation values."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from trainer.generation.distributed import World
from trainer.generation.encoding import EncodedPair
from trainer.grading.graders import grade
from trainer.loops import checkpoint as ckpt
from trainer.loops.preference import held_out
from trainer.loops.steps import INITIAL_ADAPTER, BestCheckpoint, run_steps
from trainer.spec import graders
from trainer.spec import metrics as M
from trainer.spec.callbacks import BaseCallback, Level
from trainer.spec.config import SpecError, parse_spec
from trainer.spec.data import parse_preference_line
from trainer.spec.overoptimisation import DROP, OveroptimisationWatch

METRIC = "val/reward/truth/mean"


class Recorder(BaseCallback):
    def __init__(self) -> None:
        self.events: list[tuple[str, str, dict[str, Any]]] = []
        self.checkpoints: list[int] = []

    def on_event(self, level: Level, message: str, data: dict[str, Any] | None = None) -> None:
        self.events.append((level, message, data or {}))

    def on_checkpoint(self, step: int, path: Path, metrics: dict[str, float]) -> None:
        self.checkpoints.append(step)


class ScriptedLoop:
    """A StepLoop whose validation (every ``every`` steps, and at step 0) reads ``values``; an adapter is a folder
    holding the step it was saved at."""

    precision = "fp32"
    world = World()

    def __init__(self, out: Path, values: dict[int, float], *, total: int, every: int) -> None:
        self.out, self.cb, self.total_steps, self.values, self.every = out, Recorder(), total, values, every
        self.spec = parse_spec(
            {"model": "m", "training_file": "t.jsonl", "method": {"type": "supervised", "supervised": {}}}
        )
        self.at = 0

    def load_state(self, state: dict[str, Any]) -> int:
        self.at = int(state["step"])
        return self.at

    def _write_adapter(self, path: Path) -> None:
        path.mkdir(parents=True, exist_ok=True)
        (path / "step.txt").write_text(str(self.at))

    def save_adapter(self, path: Path) -> None:
        self._write_adapter(path)

    def save(self, step: int, metrics: dict[str, float]) -> ckpt.Checkpoint:
        root = self.out / ckpt.CHECKPOINTS / f"step-{step:06d}"
        self._write_adapter(root / "adapter")
        (root / ckpt.STATE_FILE).write_text("")
        self.cb.on_checkpoint(step, root, metrics)
        return ckpt.Checkpoint(step, root)

    def step(self, step: int) -> dict[str, float]:
        self.at = step
        return {METRIC: self.values[step]} if step % self.every == 0 or step == self.total_steps else {}

    def validation_metrics(self) -> dict[str, float]:
        return {METRIC: self.values[0]}


def run(tmp_path: Path, values: list[float], *, total: int, every: int = 2, patience: int | None = None) -> Any:
    loop = ScriptedLoop(tmp_path, {i * every: v for i, v in enumerate(values)} | {total: values[-1]}, total=total,
                        every=every)  # fmt: skip
    result = run_steps(
        loop,  # type: ignore[arg-type]
        resume=False,
        validate_first=True,
        checkpoint_interval=5,
        best=BestCheckpoint(METRIC, patience),
    )
    return loop, result, (tmp_path / "adapter" / "step.txt").read_text()


def test_the_result_is_the_checkpoint_of_the_best_validation_saved_even_off_the_checkpoint_interval(
    tmp_path: Path,
) -> None:
    # validations at steps 0, 2, 4, 6, 8, 10: best 0.7 at step 4 (not a multiple of checkpoint_interval 5)
    loop, result, adapter_step = run(tmp_path, [0.4, 0.6, 0.7, 0.5, 0.3, 0.2], total=10)
    assert result.best_step == 4 and adapter_step == "4"
    assert loop.cb.checkpoints == [2, 4, 5, 10]  # 2 and 4 each a new best, 5 and 10 by the interval
    message = next(m for _, m, _ in loop.cb.events if "best checkpoint" in m)
    assert "step 4" in message and "0.7" in message and "0.2" in message
    assert json.loads((tmp_path / BestCheckpoint.FILE).read_text()) == {
        "metric": METRIC,
        "step": 4,
        "value": 0.7,
        "stale": 3,
    }


def test_a_run_that_never_beats_the_base_ends_with_the_initial_adapter(tmp_path: Path) -> None:
    loop, result, adapter_step = run(tmp_path, [0.5, 0.4, 0.45, 0.3], total=6)
    assert result.best_step == 0 and adapter_step == "0"
    assert (tmp_path / INITIAL_ADAPTER / "step.txt").read_text() == "0"
    assert any("the base model (no step improved on it)" in m for _, m, _ in loop.cb.events)


def test_the_last_step_when_it_is_the_best_and_no_event(tmp_path: Path) -> None:
    loop, result, adapter_step = run(tmp_path, [0.1, 0.2, 0.3], total=4)
    assert result.best_step == 4 and adapter_step == "4"
    assert not any("best checkpoint" in m for _, m, _ in loop.cb.events)


def test_early_stopping_after_patience_validations_without_a_new_best(tmp_path: Path) -> None:
    loop, result, adapter_step = run(tmp_path, [0.1, 0.5, 0.4, 0.45, 0.3, 0.9, 0.9], total=12, patience=3)
    assert result.last_step == 8 and result.best_step == 2 and adapter_step == "2"
    assert loop.cb.checkpoints[-1] == 8  # the step it stopped at is saved: a resume continues from there
    assert any(m.startswith("early stopping at step 8") for _, m, _ in loop.cb.events)


def test_a_loss_is_minimised() -> None:
    best = BestCheckpoint("val/loss", None, value=0.5)
    assert best.minimise and best.better(0.4) and not best.better(0.6)
    assert not BestCheckpoint(METRIC, None, value=0.5).better(0.4)


def test_keep_best_must_name_a_validation_metric_and_patience_needs_it() -> None:
    def spec(**hp: Any) -> Any:
        grader = {"type": "string_check", "name": "a", "input": "x", "reference": "y", "operation": "eq"}
        body = {"grader": grader, "hyperparameters": hp}
        return parse_spec({"model": "m", "training_file": "t", "method": {"type": "ppo", "ppo": body}})

    assert spec(keep_best=METRIC).method.hyperparameters.keep_best == METRIC
    assert spec(keep_best="val/preference/accuracy/units").method.hyperparameters.keep_best
    for bad in ("reward/mean", "val/nonsense", "loss/total"):
        with pytest.raises(SpecError, match="keep_best"):
            spec(keep_best=bad)
    with pytest.raises(SpecError, match="early_stopping_patience needs keep_best"):
        spec(early_stopping_patience=2)


def test_reward_model_defaults_keep_the_best_validation_accuracy() -> None:
    hp = parse_spec(
        {"model": "m", "training_file": "t", "method": {"type": "reward_model", "reward_model": {}}}
    ).method.hyperparameters
    assert (hp.keep_best, hp.head, hp.n_epochs, hp.learning_rate, hp.batch_size, hp.validation_split) == (
        "val/preference/accuracy",
        "likelihood",
        1,
        3e-4,
        32,
        0.1,
    )


# -- the over-optimisation watch --------------------------------------------------------------------------------


def observe(watch: OveroptimisationWatch, step: int, proxy: float, truth: float) -> tuple[float, str | None]:
    return watch.observe(step, {M.VAL_REWARD_MEAN: proxy, M.reward_of("truth", validation=True): truth})


def test_the_watch_reports_the_fall_of_the_held_out_grader_while_the_trained_reward_rises() -> None:
    watch = OveroptimisationWatch(("truth",))
    assert observe(watch, 0, -0.2, 0.40) == (0.0, None)
    assert observe(watch, 10, 0.1, 0.60) == (0.0, None)  # both rise: a new best
    fall, warning = observe(watch, 20, 0.3, 0.58)
    assert fall == pytest.approx(0.02) and warning is None  # below DROP
    fall, warning = observe(watch, 30, 0.6, 0.45)
    assert fall == pytest.approx(0.15) and fall >= DROP
    assert warning is not None and "since step 10" in warning and "0.100 to 0.600" in warning
    assert "0.600 to 0.450" in warning
    assert observe(watch, 40, 0.7, 0.40)[1] is None  # warned once per fall
    assert observe(watch, 50, 0.05, 0.40) == (0.0, None)  # the trained reward fell too: not the signature
    assert observe(watch, 60, 0.8, 0.65) == (0.0, None)  # a new best re-arms the warning
    assert observe(watch, 70, 0.9, 0.5)[1] is not None


def test_held_out_keys_are_the_sub_graders_the_formula_does_not_read() -> None:
    check = {
        "type": "string_check",
        "name": "c",
        "input": "{{sample.output_text}}",
        "reference": "1",
        "operation": "eq",
    }
    multi = {
        "type": "multi",
        "name": "m",
        "graders": {"rm": {**check, "name": "rm"}, "truth": check, "other": check},
        "calculate_output": "2 * rm + 0 * other",
    }
    assert graders.held_out_keys(graders.parse_grader(multi)) == ("truth",)
    assert graders.held_out_keys(graders.parse_grader(check)) == ()


# -- the reward model's data ------------------------------------------------------------------------------------


def test_held_out_split_is_deterministic_disjoint_and_never_takes_all() -> None:
    pairs = [EncodedPair([1], [2], [3], 0.0, i) for i in range(50)]
    train, val = held_out(pairs, 0.1, seed=3)
    assert len(val) == 5 and len(train) == 45
    assert {p.line for p in train} | {p.line for p in val} == set(range(50))
    assert [p.line for p in train] == sorted(p.line for p in train)
    assert held_out(pairs, 0.1, seed=3) == (train, val) and held_out(pairs, 0.1, seed=4) != (train, val)
    assert held_out(pairs[:2], 0.9, seed=0)[0] and held_out(pairs[:1], 0.5, seed=0) == (pairs[:1], [])


def test_a_preference_line_may_name_its_kind() -> None:
    line = {"prompt": "q", "chosen": "a", "rejected": "b"}
    assert parse_preference_line({**line, "kind": "units"}).kind == "units"
    assert parse_preference_line(line).kind is None
    for bad in ("", "has space", 3, "x" * 65):
        with pytest.raises(ValueError, match="'kind'"):
            parse_preference_line({**line, "kind": bad})


def test_the_readme_ensemble_formula_is_the_mean_less_half_the_standard_deviation() -> None:
    """README's uncertainty penalty for three reward models, graded with their scores given (as grade_batch does)."""
    rm = {"type": "reward_model", "model": "unused"}
    formula = "(rm1 + rm2 + rm3) / 3 - 0.5 * sqrt(((rm1 - rm2) ^ 2 + (rm2 - rm3) ^ 2 + (rm1 - rm3) ^ 2) / 9)"
    multi = graders.parse_grader(
        {
            "type": "multi",
            "name": "ensemble",
            "graders": {k: {**rm, "name": k} for k in ("rm1", "rm2", "rm3")},
            "calculate_output": formula,
        }
    )
    for scores in ((0.0, 0.0, 3.0), (1.0, 2.0, 4.5), (2.0, 2.0, 2.0)):
        result = grade(
            multi, output_text="x", item={}, model_scores=dict(zip(("rm1", "rm2", "rm3"), scores, strict=True))
        )
        mean = sum(scores) / 3
        std = (sum((s - mean) ** 2 for s in scores) / 3) ** 0.5
        assert result.score == pytest.approx(mean - 0.5 * std)


def test_a_best_checkpoint_that_is_not_on_this_machine_falls_back_to_the_last(tmp_path: Path) -> None:
    """A run resumed elsewhere may lack the best step's adapter (here the initial one): the last step's is kept."""
    loop = ScriptedLoop(tmp_path, {0: 0.5, 2: 0.1, 4: 0.2}, total=4, every=2)
    loop.save_adapter = lambda path: None  # type: ignore[method-assign]  # the initial adapter never written
    result = run_steps(
        loop, resume=False, validate_first=True, checkpoint_interval=5, best=BestCheckpoint(METRIC, None)
    )  # type: ignore[arg-type]
    assert result.best_step == 4 and (tmp_path / "adapter" / "step.txt").read_text() == "4"
    assert not any("best checkpoint" in m for _, m, _ in loop.cb.events)

"""The reward-model, DPO and supervised loops end to end on a small random model: metrics, adapters, exact resume,
accumulation and packing invariance, bad input before weights load, a reward model as a later job's grader."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from trainer.loops.checkpoint import list_checkpoints
from trainer.loops.preference import PreferenceTrainer
from trainer.loops.supervised import SupervisedTrainer
from trainer.spec import metrics as M
from trainer.spec.callbacks import BaseCallback, Callbacks, JsonlFiles
from trainer.spec.config import SpecError, parse_spec
from trainer.spec.data import DatasetError
from trainer.train import build_trainer, train

FILES = {
    "reward_model": ("preferences.jsonl", "validation_preferences.jsonl"),
    "dpo": ("preferences.jsonl", "validation_preferences.jsonl"),
    "supervised": ("supervised.jsonl", "validation_supervised.jsonl"),
}
PREFERENCE_KEYS = (
    M.LOSS_TOTAL,
    M.PREFERENCE_ACCURACY,
    M.PREFERENCE_MARGIN,
    M.REWARDS_CHOSEN,
    M.REWARDS_REJECTED,
    M.GRAD_NORM,
    M.LEARNING_RATE,
    M.TOKENS_PER_S_TRAINING,
    M.STEP_SECONDS,
    M.VAL_LOSS,
    M.validation(M.PREFERENCE_ACCURACY),
    M.validation(M.PREFERENCE_MARGIN),
    M.validation(M.REWARDS_CHOSEN),
    M.validation(M.REWARDS_REJECTED),
)
SUPERVISED_KEYS = (M.LOSS_TOTAL, M.TOKEN_ACCURACY, M.GRAD_NORM, M.VAL_LOSS, M.validation(M.TOKEN_ACCURACY))


def make_spec(model: Path, data: Path, method: str, *, lora: dict[str, Any] | None = None, **hp: Any) -> dict:
    hyper = {
        "max_steps": 4,
        "batch_size": 8,
        "checkpoint_interval": 2,
        "eval_interval": 2,
        "eval_samples": 16,
        "precision": "fp32",
        "learning_rate": 1e-2,
        **hp,
    }
    train_file, val_file = FILES[method]
    return {
        "model": str(model),
        "training_file": str(data / train_file),
        "validation_file": str(data / val_file),
        "seed": 5,
        "method": {"type": method, method: {"hyperparameters": hyper, "lora": lora or {"r": 4, "alpha": 8}}},
    }


def read_metrics(run: Path) -> list[dict[str, float]]:
    return [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()]


def deterministic(rows: list[dict[str, float]]) -> list[dict[str, float]]:
    return [{k: v for k, v in r.items() if k not in M.TIMING_METRICS} for r in rows]


class StopAfter(BaseCallback):
    def __init__(self, step: int) -> None:
        self.step, self.seen = step, 0

    def on_metrics(self, step: int, metrics: dict[str, float]) -> None:
        self.seen = step

    def should_stop(self) -> bool:
        return self.seen >= self.step


@pytest.mark.parametrize("method", ["reward_model", "dpo", "supervised"])
def test_each_method_records_its_metric_vocabulary_and_a_loadable_adapter(
    method: str, random_model_dir: Path, arithmetic_data: Path, tmp_path: Path
) -> None:
    res = train(
        parse_spec(make_spec(random_model_dir, arithmetic_data, method, max_steps=2, eval_interval=1)),
        output_dir=tmp_path,
        callback=JsonlFiles(tmp_path),
    )
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [0, 1, 2]  # step 0: validation of the starting model
    for key in PREFERENCE_KEYS if method != "supervised" else SUPERVISED_KEYS:
        assert key in rows[-1], key
        assert math.isfinite(rows[-1][key])
    assert res.adapter_dir == tmp_path / "adapter"
    files = {p.name for p in res.adapter_dir.iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors"} <= files
    assert ("reward_model.json" in files) == (method == "reward_model")
    if method == "reward_model":
        info = json.loads((res.adapter_dir / "reward_model.json").read_text())
        assert info["scored_on"] == "validation" and info["n_scores"] == 32 and info["score_std"] > 0
        assert info["head"] == "likelihood" and info["scale"] > 0  # the default head; its scale trained from 1
        config = json.loads((res.adapter_dir / "adapter_config.json").read_text())
        assert config["task_type"] == "CAUSAL_LM"


def test_dpo_starts_at_log_2_with_zero_implicit_rewards(
    random_model_dir: Path, arithmetic_data: Path, tmp_path: Path
) -> None:
    """Fresh LoRA (B = 0) and the adapter-disabled reference are the same policy: u = 0 (rl-algorithms §5.29)."""
    train(
        parse_spec(make_spec(random_model_dir, arithmetic_data, "dpo", max_steps=1, eval_interval=1)),
        output_dir=tmp_path,
        callback=JsonlFiles(tmp_path),
    )
    start, first = read_metrics(tmp_path)[:2]
    assert start[M.VAL_LOSS] == pytest.approx(math.log(2), abs=1e-6)
    assert first[M.LOSS_TOTAL] == pytest.approx(math.log(2), abs=1e-6)
    for key in (M.REWARDS_CHOSEN, M.REWARDS_REJECTED, M.PREFERENCE_MARGIN, M.PREFERENCE_ACCURACY):
        assert start[M.validation(key)] == 0.0 and first[key] == 0.0
    assert first[M.GRAD_NORM] > 0


@pytest.mark.parametrize("method", ["reward_model", "dpo"])
def test_preference_micro_batches_give_the_same_update_as_the_full_batch(
    method: str, random_model_dir: Path, arithmetic_data: Path, tmp_path: Path
) -> None:
    grads, results = [], []
    for micro in (None, 3):
        spec = parse_spec(make_spec(random_model_dir, arithmetic_data, method, max_steps=1, micro_batch_size=micro))
        t = PreferenceTrainer(spec, output_dir=tmp_path / str(micro), callback=BaseCallback())
        results.append(t.run().final_metrics)
        grads.append({n: p.grad.clone() for n, p in t.model.named_parameters() if p.grad is not None})
    assert results[1][M.LOSS_TOTAL] == pytest.approx(results[0][M.LOSS_TOTAL], rel=1e-5)
    assert results[1][M.GRAD_NORM] == pytest.approx(results[0][M.GRAD_NORM], rel=1e-5)
    for name, g in grads[0].items():
        torch.testing.assert_close(grads[1][name], g, rtol=1e-4, atol=1e-7)


def test_supervised_packing_gives_the_loss_and_gradient_of_unpacked_rows(
    random_model_dir: Path, arithmetic_data: Path, tmp_path: Path
) -> None:
    """Packed conversations attend only within themselves: the same token losses as one conversation a row."""
    grads, results = [], []
    for packing in (False, True):
        raw = make_spec(
            random_model_dir,
            arithmetic_data,
            "supervised",
            max_steps=1,
            max_length=40,
            packing=packing,
            group_by_length=False,  # the same conversations in both runs
        )
        t = SupervisedTrainer(parse_spec(raw), output_dir=tmp_path / str(packing), callback=BaseCallback())
        results.append(t.run().final_metrics)
        grads.append({n: p.grad.clone() for n, p in t.model.named_parameters() if p.grad is not None})
    for key in (M.LOSS_TOTAL, M.TOKEN_ACCURACY, M.GRAD_NORM):
        assert results[1][key] == pytest.approx(results[0][key], rel=1e-5), key
    for name, g in grads[0].items():
        torch.testing.assert_close(grads[1][name], g, rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize(
    ("method", "hp"),
    [("reward_model", {}), ("dpo", {"loss_type": "robust", "label_smoothing": 0.1}), ("supervised", {"packing": True})],
)
def test_stopped_and_resumed_run_matches_an_uninterrupted_run_bit_for_bit(
    method: str, hp: dict[str, Any], random_model_dir: Path, arithmetic_data: Path, tmp_path: Path
) -> None:
    raw = make_spec(random_model_dir, arithmetic_data, method, max_steps=4, n_epochs=1, batch_size=8, **hp)
    full = tmp_path / "full"
    train(parse_spec(raw), output_dir=full, callback=JsonlFiles(full))

    part = tmp_path / "part"
    first = train(parse_spec(raw), output_dir=part, callback=Callbacks(JsonlFiles(part), StopAfter(3)))
    assert first.stopped and first.last_step == 3 and first.adapter_dir is None
    assert [c.step for c in list_checkpoints(part)] == [2, 3]  # the stop wrote a final checkpoint
    second = train(parse_spec(raw), output_dir=part, callback=JsonlFiles(part, resume_step=3), resume=True)
    assert not second.stopped and second.last_step == 4

    assert deterministic(read_metrics(part)) == deterministic(read_metrics(full))
    a = (full / "adapter" / "adapter_model.safetensors").read_bytes()
    assert (part / "adapter" / "adapter_model.safetensors").read_bytes() == a
    if method == "reward_model":
        assert (part / "adapter" / "reward_model.json").read_text() == (
            full / "adapter" / "reward_model.json"
        ).read_text()


@pytest.mark.parametrize("method", ["reward_model", "dpo", "supervised"])
def test_bad_lines_are_reported_before_the_model_is_loaded(method: str, arithmetic_data: Path, tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    if method == "supervised":
        bad.write_text('{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}\n')
        bad.write_text(bad.read_text() + '{"messages": [{"role": "user", "content": "q"}]}\n')
        expected = r"bad.jsonl:2: the last message must be an assistant turn"
    else:
        bad.write_text(
            '{"prompt": "q", "chosen": "1", "rejected": "2"}\n{"prompt": "q", "chosen": "1", "rejected": "1"}\n'
        )
        expected = r"bad.jsonl:2: the chosen and rejected completions are identical"
    raw = make_spec(tmp_path / "no-such-model", arithmetic_data, method)
    raw["training_file"] = str(bad)
    with pytest.raises(DatasetError, match=expected):
        build_trainer(parse_spec(raw), output_dir=tmp_path / "run", callback=BaseCallback())


def test_a_pair_longer_than_max_length_or_the_context_is_refused(
    random_model_dir: Path, arithmetic_data: Path, tmp_path: Path
) -> None:
    raw = make_spec(random_model_dir, arithmetic_data, "dpo", max_length=12)
    with pytest.raises(DatasetError, match=r"preferences.jsonl:1: the prompt and its longer reply are 1\d tokens"):
        PreferenceTrainer(parse_spec(raw), output_dir=tmp_path, callback=BaseCallback())
    long = tmp_path / "long.jsonl"
    long.write_text(json.dumps({"prompt": "1 " * 40, "chosen": "2", "rejected": "3"}) + "\n")
    raw = make_spec(random_model_dir, arithmetic_data, "reward_model")
    raw["training_file"] = str(long)
    with pytest.raises(SpecError) as err:  # the random model's context is 64 tokens
        PreferenceTrainer(parse_spec(raw), output_dir=tmp_path, callback=BaseCallback())
    assert err.value.param == "method.reward_model.hyperparameters.max_length"


def test_a_trained_reward_model_is_the_grader_of_a_grpo_job(
    random_model_dir: Path, arithmetic_data: Path, tmp_path: Path
) -> None:
    train(
        parse_spec(make_spec(random_model_dir, arithmetic_data, "reward_model", max_steps=2)),
        output_dir=tmp_path / "rm",
        callback=BaseCallback(),
    )
    grader = {"type": "reward_model", "name": "rm", "model": str(tmp_path / "rm"), "normalize": True}
    spec = parse_spec(
        {
            "model": str(random_model_dir),
            "training_file": str(arithmetic_data / "train.jsonl"),
            "validation_file": str(arithmetic_data / "validation.jsonl"),
            "seed": 1,
            "method": {
                "type": "grpo",
                "grpo": {
                    "grader": grader,
                    "hyperparameters": {
                        "max_steps": 1,
                        "batch_size": 2,
                        "group_size": 4,
                        "max_completion_tokens": 4,
                        "eval_prompts": 4,
                        "precision": "fp32",
                    },
                },
            },
        }
    )
    res = train(spec, output_dir=tmp_path / "grpo", callback=JsonlFiles(tmp_path / "grpo"))
    last = res.final_metrics
    assert last[M.reward_of("rm")] == pytest.approx(last[M.REWARD_MEAN])
    assert last[M.REWARD_STD] > 0 and math.isfinite(last[M.VAL_REWARD_MEAN])


def test_cli_trains_a_reward_model_and_evaluates_with_it_as_a_grader(
    random_model_dir: Path, arithmetic_data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``proxima train`` and ``proxima eval`` in process (their subprocess start is covered by test_cli.py)."""
    from typer.testing import CliRunner

    from trainer.cli import app

    monkeypatch.setenv("PROXIMA_HOME", str(tmp_path / "home"))
    runner = CliRunner()
    spec_file = tmp_path / "rm.json"
    spec_file.write_text(json.dumps(make_spec(random_model_dir, arithmetic_data, "reward_model", max_steps=2)))
    done = runner.invoke(app, ["train", str(spec_file), "--output", str(tmp_path / "rm")])
    assert done.exit_code == 0, done.output
    assert f"adapter: {tmp_path / 'rm' / 'adapter'}" in done.stderr

    grader_file = tmp_path / "grader.json"
    grader_file.write_text(json.dumps({"type": "reward_model", "name": "rm", "model": str(tmp_path / "rm")}))
    args = ["eval", "--model", str(random_model_dir), "--data", str(arithmetic_data / "validation.jsonl")]
    done = runner.invoke(app, [*args, "--grader", str(grader_file), "--limit", "6", "--max-tokens", "4", "--json"])
    assert done.exit_code == 0, done.output
    out = json.loads(done.stdout)
    assert out["n"] == 6 and math.isfinite(out["mean_reward"]) and set(out["sub_rewards"]) == {"rm"}

    grader_file.write_text(json.dumps({"type": "reward_model", "name": "rm", "model": str(tmp_path / "none")}))
    done = runner.invoke(app, [*args, "--grader", str(grader_file), "--limit", "2", "--max-tokens", "2"])
    assert done.exit_code == 2 and "grader 'rm': model" in done.stderr and "does not exist" in done.stderr

"""The online RL loop end to end on a small random model: metrics, checkpoints, resume, cancel, adapters, bad input."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from trainer.generation.rollout_engine import HFRolloutEngine
from trainer.loops.checkpoint import list_checkpoints
from trainer.loops.rl import RLTrainer
from trainer.spec import metrics as M
from trainer.spec.callbacks import BaseCallback, Callbacks, JsonlFiles
from trainer.spec.config import SpecError, parse_spec
from trainer.spec.data import DatasetError
from trainer.train import train

SIM = {
    "type": "text_similarity",
    "name": "sim",
    "input": "{{sample.output_text}}",
    "reference": "{{item.answer}}",
    "evaluation_metric": "fuzzy_match",
}


def make_spec(model: Path, data: Path, method: str = "grpo", **hp: Any) -> dict[str, Any]:
    hyper = {
        "max_steps": 4,
        "batch_size": 4,
        "group_size": 4,
        "max_completion_tokens": 6,
        "checkpoint_interval": 2,
        "eval_interval": 2,
        "eval_prompts": 8,
        "precision": "fp32",
        "learning_rate": 1e-2,
        **hp,
    }
    return {
        "model": str(model),
        "training_file": str(data / "train.jsonl"),
        "validation_file": str(data / "validation.jsonl"),
        "seed": 3,
        "method": {"type": method, method: {"grader": SIM, "hyperparameters": hyper}},
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


@pytest.mark.parametrize("method", ["grpo", "dr_grpo", "dapo", "rloo", "reinforce"])
def test_every_method_records_the_metric_vocabulary_and_a_loadable_adapter(
    method: str, random_model_dir: Path, arithmetic_data: Path, tmp_path: Path
) -> None:
    spec = parse_spec(make_spec(random_model_dir, arithmetic_data, method, max_steps=2))
    res = train(spec, output_dir=tmp_path, callback=JsonlFiles(tmp_path))
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [0, 1, 2]  # step 0: validation of the base policy
    last = rows[-1]
    for key in (
        M.REWARD_MEAN,
        M.REWARD_STD,
        M.ADVANTAGE_MEAN,
        M.ENTROPY_MEAN,
        M.CLIP_FRAC_LOW,
        M.CLIP_FRAC_HIGH,
        M.APPROX_KL,
        M.LOSS_POLICY,
        M.GRAD_NORM,
        M.COMPLETION_LEN_MEAN,
        M.COMPLETION_LEN_MAX,
        M.TRUNCATED_FRAC,
        M.TOKENS_PER_S_GENERATION,
        M.TOKENS_PER_S_TRAINING,
        M.STEP_SECONDS,
        M.LEARNING_RATE,
        M.VAL_REWARD_MEAN,
        M.reward_of("sim"),
    ):
        assert key in last, key
    assert last[M.reward_of("sim")] == pytest.approx(last[M.REWARD_MEAN])
    assert 1 <= last[M.COMPLETION_LEN_MEAN] <= last[M.COMPLETION_LEN_MAX] <= 6
    assert 0.0 <= last[M.TRUNCATED_FRAC] <= 1.0
    assert last[M.ENTROPY_MEAN] > 0
    if method in ("grpo", "rloo"):  # β > 0 by default
        assert M.KL_MEAN in last
    if method == "dapo":
        assert last[M.GROUPS_DROPPED] >= 0 and last[M.SAMPLING_BATCHES] >= 1
    assert res.adapter_dir is not None and (res.adapter_dir / "adapter_config.json").is_file()
    rollouts = [json.loads(ln) for ln in (tmp_path / "rollouts.jsonl").read_text().splitlines()]
    assert {r["step"] for r in rollouts} == {1, 2}
    assert set(rollouts[0]) >= {"prompt", "completion", "reward", "rewards", "advantage"}


def test_first_iteration_ratio_is_one_and_nothing_is_clipped(
    random_model_dir: Path, arithmetic_data: Path, tmp_path: Path
) -> None:
    spec = parse_spec(make_spec(random_model_dir, arithmetic_data, max_steps=1, beta=0.0))
    train(spec, output_dir=tmp_path, callback=JsonlFiles(tmp_path))
    last = read_metrics(tmp_path)[-1]
    assert last[M.APPROX_KL] == 0.0 and last[M.CLIP_FRAC_LOW] == 0.0 and last[M.CLIP_FRAC_HIGH] == 0.0


def test_micro_batches_give_the_same_update_as_the_full_batch(
    random_model_dir: Path, arithmetic_data: Path, tmp_path: Path
) -> None:
    """Gradient accumulation normalised by the mini-batch totals is the full-batch loss exactly (token_mean)."""
    params, results = [], []
    for micro in (None, 3):
        spec = parse_spec(
            make_spec(
                random_model_dir,
                arithmetic_data,
                "dapo",
                max_steps=1,
                micro_batch_size=micro,
                dynamic_sampling=False,
                eval_interval=0,
            )
        )
        t = RLTrainer(spec, output_dir=tmp_path / str(micro), callback=BaseCallback())
        results.append(t.run().final_metrics)
        # One step of one mini-batch: .grad still holds that mini-batch's accumulated gradient.
        params.append({n: p.grad.clone() for n, p in t.models.model.named_parameters() if p.requires_grad})
    assert results[0][M.LOSS_POLICY] != 0.0
    assert results[1][M.LOSS_POLICY] == pytest.approx(results[0][M.LOSS_POLICY], rel=1e-5)
    assert results[1][M.GRAD_NORM] == pytest.approx(results[0][M.GRAD_NORM], rel=1e-5)
    for name, g in params[0].items():
        torch.testing.assert_close(params[1][name], g, rtol=1e-4, atol=1e-8)


def test_stopped_and_resumed_run_matches_an_uninterrupted_run_step_by_step(
    random_model_dir: Path, arithmetic_data: Path, tmp_path: Path
) -> None:
    raw = make_spec(random_model_dir, arithmetic_data, max_steps=4, iterations_per_batch=2, mini_batches=2)
    full = tmp_path / "full"
    train(parse_spec(raw), output_dir=full, callback=JsonlFiles(full))

    part = tmp_path / "part"
    first = train(parse_spec(raw), output_dir=part, callback=Callbacks(JsonlFiles(part), StopAfter(3)))
    assert first.stopped and first.last_step == 3
    assert [c.step for c in list_checkpoints(part)] == [2, 3]  # the stop wrote a final checkpoint
    second = train(parse_spec(raw), output_dir=part, callback=JsonlFiles(part, resume_step=3), resume=True)
    assert not second.stopped and second.last_step == 4

    assert deterministic(read_metrics(part)) == deterministic(read_metrics(full))
    a = torch.load(full / "checkpoints/step-000004/trainer_state.pt", weights_only=False)["trainable"]
    b = torch.load(part / "checkpoints/step-000004/trainer_state.pt", weights_only=False)["trainable"]
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_saved_adapter_reloaded_with_peft_reproduces_the_policy_logprobs(
    random_model_dir: Path, arithmetic_data: Path, tmp_path: Path
) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from trainer.generation.rollout import completion_logprobs, generate, left_pad

    spec = parse_spec(make_spec(random_model_dir, arithmetic_data, max_steps=2))
    t = RLTrainer(spec, output_dir=tmp_path, callback=BaseCallback())
    res = t.run()
    ids, mask = left_pad(t.prompts.train_ids[:6], t.prompts.tokenizer.pad_token_id)
    ro = generate(
        t.models.model,
        ids,
        mask,
        max_new_tokens=6,
        eos_id=t.prompts.tokenizer.eos_token_id,
        pad_id=t.prompts.tokenizer.pad_token_id,
        temperature=1.0,
        generator=torch.Generator().manual_seed(0),
    )
    with torch.no_grad():
        trained, _ = completion_logprobs(t.models.model, ro, temperature=1.0, precision="fp32")
        base = AutoModelForCausalLM.from_pretrained(random_model_dir, dtype=torch.float32).eval()
        with_base, _ = completion_logprobs(base, ro, temperature=1.0, precision="fp32")
        reloaded = PeftModel.from_pretrained(base, str(res.adapter_dir)).eval()
        again, _ = completion_logprobs(reloaded, ro, temperature=1.0, precision="fp32")
    m = ro.completion_mask.bool()
    torch.testing.assert_close(again[m], trained[m], rtol=0, atol=1e-5)
    assert (with_base[m] - trained[m]).abs().max() > 1e-3  # the adapter really changed the policy


def test_cancel_between_steps_stops_after_a_final_checkpoint(
    random_model_dir: Path, arithmetic_data: Path, tmp_path: Path
) -> None:
    spec = parse_spec(make_spec(random_model_dir, arithmetic_data, max_steps=10, checkpoint_interval=5))
    res = train(spec, output_dir=tmp_path, callback=Callbacks(JsonlFiles(tmp_path), StopAfter(1)))
    assert res.stopped and res.last_step == 1 and res.adapter_dir is None
    assert [c.step for c in list_checkpoints(tmp_path)] == [1]
    assert not (tmp_path / "adapter").exists()


def test_bad_dataset_line_is_reported_before_the_model_is_loaded(arithmetic_data: Path, tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "What is 1 + 1?", "answer": "2"}\n{not json}\n')
    raw = make_spec(tmp_path / "no-such-model", arithmetic_data)
    raw["training_file"] = str(bad)
    with pytest.raises(DatasetError, match=r"bad.jsonl:2: not valid JSON"):
        RLTrainer(parse_spec(raw), output_dir=tmp_path / "run", callback=BaseCallback())

    bad.write_text('{"prompt": "What is 1 + 1?"}\n')  # the grader needs {{item.answer}}
    with pytest.raises(DatasetError, match=r"bad.jsonl:1: .*answer"):
        RLTrainer(parse_spec(raw), output_dir=tmp_path / "run", callback=BaseCallback())

    bad.write_text('{"messages": []}\n')
    with pytest.raises(DatasetError, match=r"bad.jsonl:1: 'messages' must be a non-empty list"):
        RLTrainer(parse_spec(raw), output_dir=tmp_path / "run", callback=BaseCallback())


def test_completion_longer_than_the_context_is_refused(
    random_model_dir: Path, arithmetic_data: Path, tmp_path: Path
) -> None:
    raw = make_spec(random_model_dir, arithmetic_data, max_completion_tokens=60)  # context is 64 tokens
    with pytest.raises(SpecError) as err:
        RLTrainer(parse_spec(raw), output_dir=tmp_path, callback=BaseCallback())
    assert err.value.param == "method.grpo.hyperparameters.max_completion_tokens"


def _proxima(*args: str, env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "trainer.cli", *args], env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )


def test_cli_train_killed_with_sigkill_resumes_to_the_same_metrics(
    random_model_dir: Path, arithmetic_data: Path, tmp_path: Path
) -> None:
    raw = make_spec(random_model_dir, arithmetic_data, max_steps=6, checkpoint_interval=1, eval_interval=0)
    spec_file = tmp_path / "spec.json"
    spec_file.write_text(json.dumps(raw))
    env = {**os.environ, "PROXIMA_HOME": str(tmp_path / "home")}

    ref = _proxima("train", str(spec_file), "--output", str(tmp_path / "ref"), env=env)
    assert ref.wait(timeout=300) == 0, ref.stderr.read() if ref.stderr else ""

    run = tmp_path / "killed"
    proc = _proxima("train", str(spec_file), "--output", str(run), env=env)
    deadline = time.monotonic() + 300
    while not (run / "checkpoints" / "step-000003").exists():
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (run / "adapter").exists()

    again = _proxima("train", str(spec_file), "--output", str(run), "--resume", env=env)
    _, err = again.communicate(timeout=300)
    assert again.returncode == 0, err
    assert deterministic(read_metrics(run)) == deterministic(read_metrics(tmp_path / "ref"))
    assert (run / "adapter" / "adapter_model.safetensors").is_file()


def test_cli_refuses_an_unknown_hyperparameter_naming_it(
    random_model_dir: Path, arithmetic_data: Path, tmp_path: Path
) -> None:
    raw = make_spec(random_model_dir, arithmetic_data, learning_rat=1e-3)
    spec_file = tmp_path / "spec.json"
    spec_file.write_text(json.dumps(raw))
    proc = _proxima("train", str(spec_file), "--output", str(tmp_path / "run"), env=dict(os.environ))
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 2
    assert "method.grpo.hyperparameters.learning_rat: unknown field" in err


def test_bf16_run_samples_from_the_merged_copy_and_trains(
    random_model_dir: Path, arithmetic_data: Path, tmp_path: Path
) -> None:
    spec = parse_spec(make_spec(random_model_dir, arithmetic_data, max_steps=2, precision="bf16"))
    t = RLTrainer(spec, output_dir=tmp_path, callback=JsonlFiles(tmp_path))
    engine = t.models.rollout_engine
    assert isinstance(engine, HFRolloutEngine) and engine.merged is not None
    assert t.precision == "bf16" and not engine.exact_logprobs  # bf16 rounding: the loop recomputes old log-probs
    res = t.run()
    last = read_metrics(tmp_path)[-1]
    assert all(v == v for v in last.values())  # no NaN
    assert last[M.GRAD_NORM] > 0 and res.adapter_dir is not None
    # The sampler holds exactly the current policy's merged weights after a push and a sync.
    engine.push_weights(t.models.model, t.engine.weights_version)
    sampler, _ = engine.sampling_model()
    for target, lora in engine.merged.pairs:
        expected = (lora.base_layer.weight + lora.get_delta_weight("default")).to(torch.bfloat16)
        assert torch.equal(target.weight, expected)
    assert sampler is engine.merged.model


@pytest.mark.parametrize("method,hp", [("rloo", {"beta": 0.1}), ("grpo", {"iterations_per_batch": 2})])
def test_fp32_policy_sampling_itself_gives_the_old_logprobs_without_a_policy_pass(
    random_model_dir: Path, arithmetic_data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, method: str, hp: Any
) -> None:
    """When the fp32 policy samples itself, the sampler's log-probs are the old log-probs (the KL in RLOO's reward,
    the ratio's denominator over GRPO's second pass): no no-grad policy pass runs, and they equal that pass's."""
    spec = parse_spec(make_spec(random_model_dir, arithmetic_data, method=method, max_steps=1, **hp))
    t = RLTrainer(spec, output_dir=tmp_path, callback=JsonlFiles(tmp_path))
    engine = t.models.rollout_engine
    assert isinstance(engine, HFRolloutEngine) and engine.merged is None and engine.exact_logprobs
    batch = t.collect()
    t.score(batch)
    assert batch.old_logp is not None
    t2 = RLTrainer(spec, output_dir=tmp_path / "b", callback=JsonlFiles(tmp_path / "b"))
    passes: list[bool] = []
    real = t2.engine.logprobs

    def counting(ro: Any, *, temperature: float, micro_batch_size: int | None, reference: bool = False) -> Any:
        passes.append(reference)
        return real(ro, temperature=temperature, micro_batch_size=micro_batch_size, reference=reference)

    monkeypatch.setattr(t2.engine, "logprobs", counting)
    b2 = t2.collect()
    t2.score(b2)
    assert False not in passes  # only the reference's pass (RLOO's KL) runs, no policy pass
    full = t.engine.logprobs(batch.rollout, temperature=1.0, micro_batch_size=None)
    m = batch.rollout.completion_mask.bool()
    torch.testing.assert_close(batch.old_logp[m], full[m], rtol=0, atol=1e-5)
    assert torch.equal(b2.old_logp, batch.old_logp)  # seeded: the same rollout again
    res = t.run()
    assert res.adapter_dir is not None
    assert read_metrics(tmp_path)[-1][M.GRAD_NORM] > 0


class Recorder(BaseCallback):
    def __init__(self) -> None:
        self.events: list[tuple[str, str]] = []
        self.rollouts: dict[int, list[dict[str, Any]]] = {}

    def on_event(self, level: str, message: str, data: dict[str, Any] | None = None) -> None:  # type: ignore[override]
        self.events.append((level, message))

    def on_rollouts(self, step: int, rollouts: list[dict[str, Any]]) -> None:
        self.rollouts[step] = rollouts


def test_openai_compute_multiplier_samples_more_per_prompt_and_reasoning_effort_says_it_has_no_effect(
    random_model_dir: Path, arithmetic_data: Path, tmp_path: Path
) -> None:
    raw = make_spec(
        random_model_dir,
        arithmetic_data,
        max_steps=1,
        batch_size=2,
        group_size=2,
        rollouts_logged=256,
        compute_multiplier=2.0,
        reasoning_effort="high",
    )
    recorder = Recorder()
    train(parse_spec(raw), output_dir=tmp_path, callback=Callbacks(JsonlFiles(tmp_path), recorder))
    [step_rollouts] = recorder.rollouts.values()
    assert len(step_rollouts) == 2 * 4  # 2 prompts × (2 × 2.0) samples, each group's prompt four times in a row
    prompts = [json.dumps(r["prompt"]) for r in step_rollouts]
    assert prompts[:4] == [prompts[0]] * 4 and prompts[4:] == [prompts[4]] * 4
    assert (
        "info",
        f"reasoning_effort 'high' has no effect: the chat template of {random_model_dir} has no thinking mode",
    ) in recorder.events


def test_a_completion_cut_at_the_token_limit_reaches_the_python_grader_as_finish_reason_length(
    random_model_dir: Path, arithmetic_data: Path, tmp_path: Path
) -> None:
    # One token, EOS held off until then: every completion is cut at the limit (Rollout.truncated), and the python
    # grader's OpenAI sample says so; with longer completions the random model's ends are mixed.
    source = "def grade(sample, item):\n    return 1.0 if sample['choices'][0]['finish_reason'] == 'length' else 0.0\n"
    raw = make_spec(random_model_dir, arithmetic_data, max_steps=1, max_completion_tokens=1, min_completion_tokens=1)
    raw["method"]["grpo"]["grader"] = {"type": "python", "name": "cut", "source": source}
    train(parse_spec(raw), output_dir=tmp_path, callback=JsonlFiles(tmp_path))
    rows = read_metrics(tmp_path)
    trained = [r for r in rows if r["step"] == 1]
    assert trained and trained[0][M.REWARD_MEAN] == 1.0 and trained[0][M.reward_of("cut")] == 1.0


def test_reward_clip_clips_the_reward_trained_on_and_reports_the_fraction(
    random_model_dir: Path, arithmetic_data: Path, tmp_path: Path
) -> None:
    """GRPO's advantages recomputed by hand from the logged grader rewards clipped to ±0.3 (the group's mean and
    unbiased std, eps 1e-4) equal the logged ones; reward/clip_frac is the share of rewards above 0.3."""
    spec = make_spec(random_model_dir, arithmetic_data, max_steps=1, rollouts_logged=16, reward_clip=0.3)
    train(parse_spec(spec), output_dir=tmp_path, callback=JsonlFiles(tmp_path))
    rows = [json.loads(ln) for ln in (tmp_path / "rollouts.jsonl").read_text().splitlines()]
    rewards = torch.tensor([r["reward"] for r in rows])
    assert len(rows) == 16 and (rewards > 0.3).any() and (rewards < 0.3).any()  # both sides of the clip occur
    clipped = rewards.clamp(-0.3, 0.3).view(4, 4)
    expected = (clipped - clipped.mean(1, keepdim=True)) / (clipped.std(1, keepdim=True) + 1e-4)
    torch.testing.assert_close(torch.tensor([r["advantage"] for r in rows]), expected.flatten(), rtol=0, atol=1e-5)
    step = read_metrics(tmp_path)[-1]
    assert step[M.REWARD_CLIP_FRAC] == pytest.approx(float((rewards > 0.3).float().mean()))
    assert step[M.REWARD_MEAN] == pytest.approx(float(rewards.mean()))  # the grader's reward, as reported


def test_a_compiled_decode_step_trains_as_the_growing_cache_does(
    random_model_dir: Path, arithmetic_data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """compile_decode on: the engine decodes on a static cache with a compiled step, says once what compiling cost,
    keeps its compile cache under PROXIMA_HOME, and the run's metrics are those of compile_decode off (the same
    draws; fp32 logits equal to rounding)."""
    monkeypatch.setenv("PROXIMA_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "unset")  # recorded, so that the test leaves it as it was
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR")
    runs = {}
    for setting in ("on", "off"):
        out = tmp_path / setting
        rec = Recorder()
        spec = parse_spec(make_spec(random_model_dir, arithmetic_data, max_steps=2, compile_decode=setting))
        t = RLTrainer(spec, output_dir=out, callback=Callbacks(JsonlFiles(out), rec))
        assert isinstance(t.models.rollout_engine, HFRolloutEngine)
        assert t.models.rollout_engine.decode == ("compiled" if setting == "on" else "dynamic")
        t.run()
        compiled = [m for _, m in rec.events if m.startswith("compiled the decode step")]
        assert len(compiled) == (1 if setting == "on" else 0), rec.events
        runs[setting] = deterministic(read_metrics(out))
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "home" / "torch-compile")
    assert any((tmp_path / "home" / "torch-compile").iterdir())
    assert len(runs["on"]) == len(runs["off"]) == 3  # the validation before step 1, then 2 steps
    for a, b in zip(runs["on"], runs["off"], strict=True):
        assert a.keys() == b.keys()
        for k in a:
            assert a[k] == pytest.approx(b[k], rel=1e-4, abs=1e-6), k


def test_a_job_whose_decode_step_cannot_be_compiled_warns_once_and_trains(
    random_model_dir: Path, arithmetic_data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import trainer.generation.rollout as rollout

    def cannot_compile(fn: Any) -> Any:
        def compiled(*args: Any, **kwargs: Any) -> Any:
            raise RuntimeError("InvalidCxxCompiler: No working C++ compiler found")

        return compiled

    monkeypatch.setattr(rollout.torch, "compile", cannot_compile)
    rec = Recorder()
    spec = parse_spec(make_spec(random_model_dir, arithmetic_data, max_steps=2, compile_decode="on"))
    res = RLTrainer(spec, output_dir=tmp_path, callback=Callbacks(JsonlFiles(tmp_path), rec)).run()
    warned = [m for level, m in rec.events if level == "warn" and "could not be compiled" in m]
    assert len(warned) == 1 and "C++ compiler" in warned[0], rec.events
    assert res.adapter_dir is not None and len(read_metrics(tmp_path)) == 3


def validation_generations(t: RLTrainer, monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int, float]]:
    """(step, rows, temperature) of every generation the trainer's validations make, appended as the run goes."""
    seen: list[tuple[int, int, float]] = []
    engine, validate = t.models.rollout_engine, t._validation_metrics
    real = engine.generate

    def counted(prompts: Any, params: Any, **kw: Any) -> Any:
        seen.append((t.last_step, len(prompts), params.temperature))
        return real(prompts, params, **kw)

    def validating() -> dict[str, float]:
        monkeypatch.setattr(engine, "generate", counted)
        try:
            return validate()
        finally:
            monkeypatch.setattr(engine, "generate", real)

    monkeypatch.setattr(t, "_validation_metrics", validating)
    return seen


def test_openai_eval_interval_auto_and_eval_samples_validate_each_step_with_k_completions_per_prompt(
    random_model_dir: Path, arithmetic_data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """eval_interval "auto" over 3 steps validates at every step (ceil(3 / 10) = 1, and the base policy at step 0);
    eval_samples 2 generates 2 completions for each of the eval_prompts (3) at the job's temperature, and the training
    samples nothing differently for it: its metrics equal those of a run with one greedy validation completion."""
    runs, calls = {}, {}
    for k in (2, 1):
        hp = {"max_steps": 3, "batch_size": 2, "group_size": 2, "eval_interval": "auto", "eval_prompts": 3}
        spec = parse_spec(make_spec(random_model_dir, arithmetic_data, eval_samples=k, **hp))
        t = RLTrainer(spec, output_dir=tmp_path / str(k), callback=JsonlFiles(tmp_path / str(k)))
        calls[k] = validation_generations(t, monkeypatch)
        t.run()
        runs[k] = read_metrics(tmp_path / str(k))
    assert calls[2] == [(step, 3 * 2, 1.0) for step in (0, 1, 2, 3)]  # [P·k] rows at the temperature, every step
    assert calls[1] == [(step, 3, 0.0) for step in (0, 1, 2, 3)]  # one greedy completion a prompt
    for rows in runs.values():
        assert [r["step"] for r in rows] == [0, 1, 2, 3] and all(M.VAL_REWARD_MEAN in r for r in rows)
    training = {
        k: deterministic([{n: v for n, v in r.items() if not n.startswith("val/")} for r in runs[k]]) for k in runs
    }
    assert training[2] == training[1]


def test_openais_reinforcement_method_trains_exactly_as_grpo(
    random_model_dir: Path, arithmetic_data: Path, tmp_path: Path
) -> None:
    rows = {}
    for method in ("reinforcement", "grpo"):
        spec = parse_spec(make_spec(random_model_dir, arithmetic_data, method, max_steps=2))
        assert spec.method.type == method and spec.method.recipe_name == "grpo"
        train(spec, output_dir=tmp_path / method, callback=JsonlFiles(tmp_path / method))
        rows[method] = deterministic(read_metrics(tmp_path / method))
    assert rows["reinforcement"] == rows["grpo"] and len(rows["grpo"]) == 3

"""The rollout-engine seam: the RL loop trains unchanged with engines other than the HF sampler.

- :class:`ScriptedEngine` answers from a script (right for some rows, wrong for others) and gives no log-probs: the
  loop computes the behaviour log-probs itself, and the policy learns the scripted right answers.
- :class:`TwoTurnEngine` makes two-turn episodes with environment tokens between and after the policy's turns: the
  policy mask is not a prefix, the engine's log-probs are exact, PPO's score lands on the last *policy* token and
  neither the losses nor the advantages touch an environment token.
- A new recipe row made of existing parts (GRPO + dynamic sampling) takes effect, and a short batch after dynamic
  sampling with fewer rows than mini-batches trains (it crashed with ``range() arg 3 must not be zero``).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from peft import PeftModel
from transformers import PreTrainedTokenizerBase

from tests.e2e.test_rl_loop import make_spec
from trainer.generation.encoding import completion_batch
from trainer.generation.rollout import completion_logprobs
from trainer.generation.rollout_engine import Generation, HFRolloutEngine, SamplingParams
from trainer.loops.rl import RLTrainer
from trainer.spec import metrics as M
from trainer.spec.callbacks import BaseCallback, JsonlFiles
from trainer.spec.config import parse_spec
from trainer.spec.recipes import RECIPES, Recipe

EXACT = {
    "type": "string_check",
    "name": "exact",
    "input": "{{sample.output_text}}",
    "reference": "{{item.answer}}",
    "operation": "eq",
}


def _sum_in(text: str) -> int:
    a, b = (int(x) for x in re.findall(r"What is (\d+) \+ (\d+)\?", text)[-1])
    return a + b


class ScriptedEngine:
    """Completions from a script: ``answer(row, right_sum) -> text`` for row ``row`` of the batch; no log-probs."""

    exact_logprobs = False

    def __init__(self, tokenizer: PreTrainedTokenizerBase, answer: Callable[[int, int], str]) -> None:
        self.tok, self.answer = tokenizer, answer
        self.pushed: list[int] = []

    def push_weights(self, policy: torch.nn.Module, version: int) -> None:
        self.pushed.append(version)

    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams, *, generator: torch.Generator | None
    ) -> Generation:
        replies = []
        for row, p in enumerate(prompts):
            text = self.answer(row, _sum_in(self.tok.decode(list(p))))
            ids = self.tok.encode(text, add_special_tokens=False)[: params.max_new_tokens - 1]
            replies.append([*ids, self.tok.eos_token_id])
        rollout = completion_batch([list(p) for p in prompts], replies, self.tok.pad_token_id)
        return Generation(rollout, None, 0.0)


def scripted(answer: Callable[[int, int], str]) -> Callable[[PeftModel, PreTrainedTokenizerBase], ScriptedEngine]:
    return lambda policy, tok: ScriptedEngine(tok, answer)


def half_right(row: int, right: int) -> str:
    return str(right) if row % 2 == 0 else str(right + 1)


def test_a_scripted_engine_trains_the_policy_toward_its_right_answers(
    random_model_dir: Path, arithmetic_data: Path, tmp_path: Path
) -> None:
    raw = make_spec(random_model_dir, arithmetic_data, "grpo", max_steps=6, iterations_per_batch=2, eval_interval=0)
    raw["method"]["grpo"]["grader"] = EXACT
    t = RLTrainer(
        parse_spec(raw), output_dir=tmp_path, callback=JsonlFiles(tmp_path), rollout_engine=scripted(half_right)
    )
    engine = t.models.rollout_engine
    assert isinstance(engine, ScriptedEngine)

    batch = t.collect()
    right, wrong = batch.rollout.select(torch.tensor([0])), batch.rollout.select(torch.tensor([1]))

    def margin() -> float:
        with torch.no_grad():
            lp_right, _ = completion_logprobs(t.models.model, right, temperature=1.0, precision="fp32")
            lp_wrong, _ = completion_logprobs(t.models.model, wrong, temperature=1.0, precision="fp32")
        return float((lp_right * right.policy_mask).sum() - (lp_wrong * wrong.policy_mask).sum())

    before = margin()
    t.score(batch)
    assert batch.old_logp is not None  # no log-probs from the engine: the loop's own no-grad policy pass
    t.run()
    rows = [json.loads(ln) for ln in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r[M.REWARD_MEAN] for r in rows if r["step"] > 0] == [0.5] * 6  # half the rows are right, by script
    gained = margin() - before
    assert gained > 0.2, gained  # the right answer gained over the wrong one
    assert engine.pushed[-1] > engine.pushed[0]  # the loop pushed the new weights before each draw


class TwoTurnEngine:
    """Episodes of two policy turns with environment tokens between and after them:

        [turn 1: exactly K policy tokens][env: E tokens][turn 2: policy tokens up to EOS][env: E tokens]

    Both turns are sampled by the HF engine (turn 2 conditioned on the prompt, turn 1 and the environment's tokens),
    so its log-probs are the policy's own on the whole episode: exact."""

    K = 2

    def __init__(self, policy: PeftModel, tok: PreTrainedTokenizerBase) -> None:
        self.hf = HFRolloutEngine(
            policy, eos_id=tok.eos_token_id, pad_id=tok.pad_token_id, device=torch.device("cpu"), precision="fp32"
        )
        self.tok = tok
        self.env = tok.encode(" = 7", add_special_tokens=False)

    @property
    def exact_logprobs(self) -> bool:
        return self.hf.exact_logprobs

    def push_weights(self, policy: torch.nn.Module, version: int) -> None:
        self.hf.push_weights(policy, version)

    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams, *, generator: torch.Generator | None
    ) -> Generation:
        k, e = self.K, len(self.env)
        first = self.hf.generate(
            prompts, SamplingParams(k, params.temperature, params.top_p, min_new_tokens=k), generator=generator
        )
        second_prompts = [[*p, *first.rollout.completion_ids[i, :k].tolist(), *self.env] for i, p in enumerate(prompts)]
        rest = SamplingParams(params.max_new_tokens - k - 2 * e, params.temperature, params.top_p)
        second = self.hf.generate(second_prompts, rest, generator=generator)
        # greedy decoding (validation) comes without log-probs; sampling always has them, the engine being exact
        assert (first.logprobs is None) == (second.logprobs is None) == (params.temperature == 0)
        episodes, policy, turns, logps = [], [], [], []
        for i in range(len(prompts)):
            n2 = int(second.rollout.lengths[i])
            t2 = second.rollout.completion_ids[i, :n2].tolist()
            episodes.append([*first.rollout.completion_ids[i, :k].tolist(), *self.env, *t2, *self.env])
            policy.append([1] * k + [0] * e + [1] * n2 + [0] * e)
            turns.append([0] * k + [1] * e + [2] * n2 + [3] * e)
            if first.logprobs is not None and second.logprobs is not None:
                lp1, lp2 = first.logprobs[i, :k].tolist(), second.logprobs[i, :n2].tolist()
                logps.append([*lp1, *[0.0] * e, *lp2, *[0.0] * e])
        ro = completion_batch([list(p) for p in prompts], episodes, self.tok.pad_token_id)
        width = ro.completion_ids.shape[1]

        def pad(rows: list[list[Any]], dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor([r + [0] * (width - len(r)) for r in rows], dtype=dtype)

        ro.policy_mask, ro.turn_ids = pad(policy, torch.long), pad(turns, torch.long)
        ro.truncated = second.rollout.truncated.cpu()
        logp = pad(logps, torch.float32) if logps else None
        return Generation(ro, logp, first.seconds + second.seconds)


@pytest.mark.parametrize("method", ["ppo", "grpo"])
def test_two_turn_episodes_train_on_policy_tokens_only(
    method: str, random_model_dir: Path, arithmetic_data: Path, tmp_path: Path
) -> None:
    extra = {"group_size": 2, "batch_size": 4, "iterations_per_batch": 2} if method == "ppo" else {}
    raw = make_spec(random_model_dir, arithmetic_data, method, max_steps=2, max_completion_tokens=12, **extra)
    t = RLTrainer(parse_spec(raw), output_dir=tmp_path, callback=JsonlFiles(tmp_path), rollout_engine=TwoTurnEngine)
    assert t.models.rollout_engine.exact_logprobs

    batch = t.collect()
    ro = batch.rollout
    e = len(t.models.rollout_engine.env)  # type: ignore[attr-defined]
    env = (ro.completion_mask.bool() & ~ro.policy_mask.bool()).float()
    assert env.sum(-1).tolist() == [2.0 * e] * len(batch)  # two environment segments per episode
    assert torch.equal(batch.loss_mask, ro.policy_mask.float())
    # the engine's log-probs are the trainer's own on the policy's tokens: the behaviour policy needs no pass
    t.score(batch)
    with torch.no_grad():
        full, _ = completion_logprobs(t.models.model, ro, temperature=1.0, precision="fp32")
    sampled = batch.samples.sampling_logp
    assert sampled is not None
    torch.testing.assert_close(sampled * ro.policy_mask, full * ro.policy_mask, rtol=0, atol=1e-4)
    adv = t.advantages(batch)
    if method == "ppo":
        assert batch.token_rewards is not None
        last_policy = ro.lengths - 1 - e  # the episode ends with E environment tokens: not where the score goes
        rows = torch.arange(len(batch))
        scores = batch.samples.rewards.to(batch.token_rewards.device)
        kl_part = batch.token_rewards[rows, last_policy] - scores
        assert kl_part.abs().max() < 0.5  # the score sits on the last policy token (less −β·KL, small here)
        assert (batch.token_rewards * env).abs().sum() == 0
        assert (adv.per_row * env).abs().sum() == 0 and adv.returns is not None
        assert (adv.returns * env).abs().sum() == 0
    m = t.run().final_metrics
    assert all(torch.isfinite(torch.tensor(v)) for v in m.values())
    assert m[M.LOSS_POLICY] != 0.0


def test_a_new_recipe_row_of_existing_parts_takes_effect(
    random_model_dir: Path, arithmetic_data: Path, tmp_path: Path
) -> None:
    """GRPO + dynamic sampling: a row no method has. Every draw's groups are all right (no signal), so the loop draws
    again up to DAPO's max_sampling_batches (4) and warns; the stock GRPO row draws once."""
    all_right = scripted(lambda row, right: str(right))
    raw = make_spec(random_model_dir, arithmetic_data, "grpo", max_steps=1, eval_interval=0)
    raw["method"]["grpo"]["grader"] = EXACT
    grpo_ds = Recipe("grpo_ds", "grpo", "clipped", "loss", needs_group=True, dynamic_sampling=True)

    class Events(BaseCallback):
        def __init__(self) -> None:
            self.events: list[str] = []

        def on_event(self, level: str, message: str, data: dict[str, Any] | None = None) -> None:
            self.events.append(f"{level}: {message}")

    ev = Events()
    m = (
        RLTrainer(parse_spec(raw), output_dir=tmp_path / "ds", callback=ev, recipe=grpo_ds, rollout_engine=all_right)
        .run()
        .final_metrics
    )
    assert m[M.SAMPLING_BATCHES] == 4.0 and m[M.GROUPS_DROPPED] == 4 * 4
    assert any("dynamic sampling filled 0 of 4 groups" in e for e in ev.events)

    plain = RLTrainer(parse_spec(raw), output_dir=tmp_path / "plain", callback=BaseCallback(), rollout_engine=all_right)
    assert plain.recipe == RECIPES["grpo"]
    m = plain.run().final_metrics
    assert M.SAMPLING_BATCHES not in m and m[M.GROUPS_ZERO_STD_FRAC] == 1.0


def test_a_short_batch_with_fewer_rows_than_mini_batches_trains_one_row_per_mini_batch(
    random_model_dir: Path, arithmetic_data: Path, tmp_path: Path
) -> None:
    """DAPO, 2 prompts × 2 samples in 4 mini-batches, one draw: the second prompt's group is all right and dropped,
    so the step has 2 rows for 4 mini-batches: 2 optimiser steps per pass (it crashed before)."""
    script = scripted(lambda row, right: str(right) if row >= 2 or row == 0 else str(right + 1))
    raw = make_spec(
        random_model_dir,
        arithmetic_data,
        "dapo",
        max_steps=1,
        batch_size=2,
        group_size=2,
        mini_batches=4,
        iterations_per_batch=3,
        max_sampling_batches=1,
        eval_interval=0,
    )
    raw["method"]["dapo"]["grader"] = EXACT
    t = RLTrainer(parse_spec(raw), output_dir=tmp_path, callback=BaseCallback(), rollout_engine=script)
    steps = 0
    optim_step = t.engine.optim_step

    def counted() -> list[float]:
        nonlocal steps
        steps += 1
        return optim_step()

    t.engine.optim_step = counted  # type: ignore[method-assign]
    m = t.run().final_metrics
    assert steps == 2 * 3
    assert m[M.GROUPS_DROPPED] == 1.0 and m[M.REWARD_MEAN] == 0.5
    assert m[M.LOSS_POLICY] != 0.0

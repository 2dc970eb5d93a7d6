"""Scoring completions with a grader, and the mean reward of a policy on a dataset (``proxima eval``, validation)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor
from transformers import PreTrainedTokenizerBase

from trainer import graders, grading_pool, reward_model
from trainer.data import PromptItem
from trainer.generation import HFRolloutEngine, RolloutEngine, SamplingParams
from trainer.models import Precision
from trainer.rollout import Rollout


@dataclass(frozen=True)
class Scores:
    rewards: Tensor  # [N] float32
    sub: dict[str, Tensor]  # named sub-grader → [N]
    texts: list[str]


def decode_completions(tokenizer: PreTrainedTokenizerBase, rollout: Rollout) -> list[str]:
    """Completion text of every row, cut at its length (EOS and padding dropped)."""
    return [
        tokenizer.decode(rollout.completion_ids[i, : int(n)].tolist(), skip_special_tokens=True)
        for i, n in enumerate(rollout.lengths)
    ]


def grade_batch(grader: graders.Grader, texts: Sequence[str], items: Sequence[PromptItem]) -> Scores:
    """Grade each (text, item) pair: rewards [N] and each named sub-grader's scores [N].

    The grader's reward_model leaves are scored first, each over the whole batch in batched forward passes (the
    model loaded once per process); the pure graders then run in this process's grading process
    (`trainer.grading_pool`), each sample within a hard time limit: a sample that exceeds it, or whose grading fails,
    scores 0.0 (its error is flagged there, as every grading problem is)."""
    names = graders.grader_names(grader)
    rows = [it.item for it in items]
    by_model: dict[str, Tensor] = {}  # the same reward model, prompt and normalisation are scored once
    model_scores: dict[str, Tensor] = {}
    for key, leaf in graders.model_graders(grader):
        same = leaf.model_dump_json(exclude={"name", "batch_size"})
        if same not in by_model:
            by_model[same] = reward_model.score_samples(leaf, texts, rows)
        model_scores[key] = by_model[same]
    samples = [
        grading_pool.Sample(text, row, {key: float(s[i]) for key, s in model_scores.items()})
        for i, (text, row) in enumerate(zip(texts, rows, strict=True))
    ]
    try:
        results = grading_pool.default_pool().run(grader.model_dump(mode="json"), samples).results
    except grading_pool.GradingTimeout as err:  # the grader validated here; a process that cannot is a failed batch
        problem = graders.GradeError(f"{err}; scored 0.0", "timeout")
        results = [graders.GradeResult(0.0, {}, (problem,))] * len(samples)
    rewards = torch.tensor([res.score for res in results], dtype=torch.float32)
    sub = {n: torch.zeros(len(texts), dtype=torch.float32) for n in names}
    for i, res in enumerate(results):
        for n, v in res.sub_scores.items():
            if n in sub:
                sub[n][i] = v
    return Scores(rewards, sub, list(texts))


@dataclass(frozen=True)
class EvalResult:
    mean_reward: float
    n: int
    sub_means: dict[str, float]
    texts: list[str]

    def as_json(self) -> dict[str, object]:
        return {"mean_reward": self.mean_reward, "n": self.n, "sub_rewards": self.sub_means}


def evaluate_engine(
    engine: RolloutEngine,
    tokenizer: PreTrainedTokenizerBase,
    prompts: Sequence[list[int]],
    items: Sequence[PromptItem],
    grader: graders.Grader,
    params: SamplingParams,
    *,
    batch_size: int = 64,
    generator: torch.Generator | None = None,
) -> EvalResult:
    """Mean reward of one completion per prompt from a rollout engine (greedy at temperature 0)."""
    texts: list[str] = []
    for start in range(0, len(prompts), batch_size):
        gen = engine.generate(prompts[start : start + batch_size], params, generator=generator)
        texts += decode_completions(tokenizer, gen.rollout)
    scores = grade_batch(grader, texts, items)
    return EvalResult(
        mean_reward=float(scores.rewards.mean()),
        n=len(texts),
        sub_means={k: float(v.mean()) for k, v in scores.sub.items()},
        texts=texts,
    )


def evaluate(
    model: torch.nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    prompts: Sequence[list[int]],
    items: Sequence[PromptItem],
    grader: graders.Grader,
    *,
    max_new_tokens: int,
    precision: Precision,
    temperature: float = 0.0,
    batch_size: int = 64,
    generator: torch.Generator | None = None,
) -> EvalResult:
    """:func:`evaluate_engine` with a model sampled in this process (``proxima eval``)."""
    device = next(model.parameters()).device
    engine = HFRolloutEngine(
        model, eos_id=tokenizer.eos_token_id, pad_id=tokenizer.pad_token_id, device=device, precision=precision
    )
    params = SamplingParams(max_new_tokens, temperature=temperature)
    return evaluate_engine(
        engine, tokenizer, prompts, items, grader, params, batch_size=batch_size, generator=generator
    )

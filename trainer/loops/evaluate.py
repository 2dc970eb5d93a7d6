"""Scoring completions with a grader, and the mean reward of a policy on a dataset (``proxima eval``, validation)."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
from torch import Tensor
from transformers import PreTrainedTokenizerBase

from trainer.generation.distributed import World
from trainer.generation.models import Precision
from trainer.generation.rollout import Rollout
from trainer.generation.rollout_engine import HFRolloutEngine, RolloutEngine, SamplingParams
from trainer.grading import batch, remote_graders
from trainer.grading import pool as grading_pool
from trainer.grading.remote_process import remote_budget, remote_config
from trainer.grading.sandbox import PythonSandbox, SandboxUnavailable
from trainer.loops import reward_model
from trainer.spec import graders
from trainer.spec import metrics as M
from trainer.spec.callbacks import Callback
from trainer.spec.data import PromptItem


@dataclass(frozen=True)
class Scores:
    rewards: Tensor  # [N] float32
    sub: dict[str, Tensor]  # named sub-grader → [N]
    texts: list[str]
    errors: list[tuple[graders.GradeError, ...]] = field(default_factory=list)  # [N] the problems of each sample

    @property
    def failures(self) -> list[graders.GradeError | None]:
        """[N] the first error of each sample that the grader produced no score for (graders.FAILURE_KINDS)."""
        return [next((e for e in errs if e.kind in graders.FAILURE_KINDS), None) for errs in self.errors]


_sandbox: PythonSandbox | None = None


def python_sandbox() -> PythonSandbox:
    """This process's sandbox for python graders (trainer.grading.sandbox's defaults: OpenAI's limits, stdlib only)."""
    global _sandbox
    if _sandbox is None:
        _sandbox = PythonSandbox()
    return _sandbox


def decode_completions(tokenizer: PreTrainedTokenizerBase, rollout: Rollout) -> list[str]:
    """Completion text of every row, cut at its length (EOS and padding dropped)."""
    return [
        tokenizer.decode(rollout.completion_ids[i, : int(n)].tolist(), skip_special_tokens=True)
        for i, n in enumerate(rollout.lengths)
    ]


def finish_reasons(rollout: Rollout) -> list[graders.FinishReason]:
    """[N] why each completion ended: `length` where it was cut at the token limit (no EOS), else `stop`."""
    return ["length" if cut else "stop" for cut in rollout.truncated.tolist()]


def grade_batch(
    grader: graders.Grader,
    texts: Sequence[str],
    items: Sequence[PromptItem],
    reasons: Sequence[graders.FinishReason] | None = None,
    *,
    output_tools: Sequence[Sequence[Mapping[str, Any]]] | None = None,
    trace_ids: Sequence[str] | None = None,
) -> Scores:
    """Grade each (text, item) pair: rewards [N] and each named sub-grader's scores [N].

    The grader's reward_model leaves are scored first, each over the whole batch in batched forward passes (the
    model loaded once per process), its python leaves each over the whole batch in one sandbox
    (`trainer.grading.sandbox`: the grader's code never runs in this process), and its remote leaves (a judge, an
    endpoint, embeddings) over the whole batch with concurrent requests (`trainer.grading.remote_graders`, configured by
    `configure_remote`); the pure graders then run in this process's grading process (`trainer.grading.pool`), each
    sample within a hard time limit: a sample that exceeds it, or whose grading fails, scores 0.0 (its error is flagged
    there, as every grading problem is). A python grader that cannot run at all here (no sandbox can start) raises
    `graders.GraderFailed`, as does a spent judge budget; a remote leaf this process has no service for raises
    `graders.GraderError`.

    `reasons`: why each completion ended (`finish_reasons`), the `finish_reason` of the `sample` object python and
    endpoint graders get; `stop` for all when not given. An agent episode's `text` is its final answer,
    `output_tools` its tool calls (OpenAI's `sample.output_tools`) and `trace_ids` the trace id its tool calls carried
    (an endpoint grader's `trace_id`)."""
    names = graders.grader_names(grader)
    rows = [it.item for it in items]
    how = batch.BatchGrading(python_sandbox(), remote_config(), remote_budget(), grading_pool.default_pool())
    try:
        results = batch.grade_results(
            grader,
            texts,
            rows,
            reasons,
            how=how,
            leaf_scores=_reward_model_scores(grader, texts, rows),
            output_tools=output_tools,
            trace_ids=trace_ids,
        )
    except SandboxUnavailable as err:
        raise graders.GraderFailed(f"python graders cannot run on this worker: {err}") from None
    except remote_graders.BudgetSpent as err:
        raise graders.GraderFailed(str(err)) from None
    rewards = torch.tensor([res.score for res in results], dtype=torch.float32)
    sub = {n: torch.zeros(len(texts), dtype=torch.float32) for n in names}
    for i, res in enumerate(results):
        for n, v in res.sub_scores.items():
            if n in sub:
                sub[n][i] = v
    return Scores(rewards, sub, list(texts), [res.errors for res in results])


def _reward_model_scores(
    grader: graders.Grader, texts: Sequence[str], rows: list[dict[str, Any]]
) -> dict[str, list[float]]:
    """Each reward_model leaf's scores [N] by its key, each over the whole batch in batched forward passes."""
    by_model: dict[str, Tensor] = {}  # the same reward model, prompt and normalisation are scored once
    scores: dict[str, list[float]] = {}
    for key, leaf in graders.model_graders(grader):
        same = leaf.model_dump_json(exclude={"name", "batch_size"})
        if same not in by_model:
            by_model[same] = reward_model.score_samples(leaf, texts, rows)
        scores[key] = by_model[same].tolist()
    return scores


FAILED_STEP_FRACTION = 0.5
"""A step whose samples the grader failed on more than this fraction of is a failed step."""
FAILED_STEPS = 2
FAILED_MIN_SAMPLES = 16
"""The job fails with `graders.GraderFailed` once FAILED_STEPS consecutive steps failed and hold FAILED_MIN_SAMPLES
samples or more together (more consecutive failed steps where the steps are small)."""


class GraderMonitor:
    """Counts the samples the grader produced no score for (`Scores.failures`: each scored 0.0), step by step: the
    step's `grader/error_rate` metric, a warning event the first time each kind of failure shows (with an example),
    and `graders.GraderFailed` when the grader fails on most samples for consecutive steps (a broken grader, not an
    unlucky sample: a single timeout or crash never fails a job).

    The loop calls `observe` with each graded batch of the step and `end_step` once the step's metrics are out."""

    def __init__(self, callback: Callback, grader: graders.Grader) -> None:
        self.cb = callback
        self.grader = grader
        self._samples = 0
        self._failures: list[graders.GradeError] = []
        self._reported: set[tuple[str, str | None]] = set()
        self._streak_steps = 0
        self._streak_samples = 0
        self._streak_example: graders.GradeError | None = None

    def observe(self, scores: Scores) -> None:
        self._samples += len(scores.texts)
        self._failures += [f for f in scores.failures if f is not None]

    def metrics(self) -> dict[str, float]:
        """The step's metric so far (0.0 before any sample)."""
        return {M.GRADER_ERROR_RATE: len(self._failures) / self._samples if self._samples else 0.0}

    def end_step(self, step: int) -> None:
        """Report the step's failures (an event per kind never reported before), start the next step's count, and
        raise GraderFailed when the failure rule is met."""
        n, failures = self._samples, self._failures
        self._samples, self._failures = 0, []
        kinds = Counter((f.kind, f.cause) for f in failures)
        for (kind, cause), count in kinds.items():
            if (kind, cause) in self._reported:
                continue
            self._reported.add((kind, cause))
            example = next(f for f in failures if (f.kind, f.cause) == (kind, cause))
            self.cb.on_event(
                "warn",
                f"step {step}: the grader produced no score for {count} of {n} samples ({cause or kind}), each "
                f"scored 0; later ones are counted in {M.GRADER_ERROR_RATE}. Example: {example[:500]}",
                {"step": step, "kind": kind, "cause": cause, "count": count, "samples": n},
            )
        if n and len(failures) > FAILED_STEP_FRACTION * n:
            self._streak_steps += 1
            self._streak_samples += n
            self._streak_example = failures[0]
        else:
            self._streak_steps = self._streak_samples = 0
        if self._streak_steps >= FAILED_STEPS and self._streak_samples >= FAILED_MIN_SAMPLES:
            last = self._streak_example
            assert last is not None
            raise graders.GraderFailed(
                f"grader {self.grader.name!r} produced no score for most samples of {self._streak_steps} consecutive "
                f"steps (more than {FAILED_STEP_FRACTION:.0%} of {self._streak_samples} samples; "
                f"{last.cause or last.kind}): {last[:1000]}"
            )


T = TypeVar("T")


def per_prompt(values: Sequence[T], samples: int) -> list[T]:
    """Each value ``samples`` times in a row: the prompts (and items) of an evaluation with ``samples`` completions
    per prompt (OpenAI's ``eval_samples``), [P] → [P·samples]."""
    return [v for v in values for _ in range(samples)]


def validation_params(
    max_new_tokens: int, *, samples: int, temperature: float, top_p: float, min_new_tokens: int = 0
) -> SamplingParams:
    """How validation samples: the greedy completion when each prompt gets one (deterministic, the default), else at
    the job's ``temperature`` and ``top_p`` (``samples`` greedy completions of a prompt would all be the same)."""
    if samples == 1:
        return SamplingParams(max_new_tokens, temperature=0.0, min_new_tokens=min_new_tokens)
    return SamplingParams(max_new_tokens, temperature=temperature, top_p=top_p, min_new_tokens=min_new_tokens)


def validation_generator(device: torch.device, *, seed: int, step: int, samples: int) -> torch.Generator | None:
    """The sampling RNG of the validation at ``step``: its own, seeded from the job's seed and the step, so that
    validating never moves the training sampler's RNG and a resumed run validates alike; None when greedy."""
    if samples == 1:
        return None
    return torch.Generator(device).manual_seed(seed * 1_000_003 + step)


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
    world: World | None = None,
) -> EvalResult:
    """Mean reward of one completion per prompt from a rollout engine (greedy at temperature 0), ``batch_size`` rows
    a generation. With ``world`` (the ranks of a sharded model, ``trainer.generation.distributed``) every rank takes
    part and gets the result: each generates and grades its block of the prompts in the same number of generations (the
    largest block's; the engine decodes in lockstep, a rank with no rows a padding row), and the scores are
    gathered; the texts are then this rank's."""
    if world is None:
        lo, hi = 0, len(prompts)
        chunks = [list(range(s, min(s + batch_size, hi))) for s in range(0, hi, batch_size)]
    else:
        lo, hi = world.block(len(prompts))
        largest = math.ceil(len(prompts) / world.size)
        calls = max(1, math.ceil(largest / batch_size))
        chunks = [c.tolist() for c in torch.arange(lo, hi).tensor_split(calls)]
    texts: list[str] = []
    reasons: list[graders.FinishReason] = []
    for chunk in chunks:
        gen = engine.generate([prompts[i] for i in chunk], params, generator=generator)
        texts += decode_completions(tokenizer, gen.rollout)
        reasons += finish_reasons(gen.rollout)
    mine = grade_batch(grader, texts, items[lo:hi], reasons) if texts or world is None else None
    scored = [(mine.rewards, mine.sub)] if world is None and mine is not None else []
    if world is not None:
        scored = [b for b in world.gather(None if mine is None else (mine.rewards, mine.sub)) if b is not None]
    rewards = torch.cat([r for r, _ in scored])
    return EvalResult(
        mean_reward=float(rewards.mean()),
        n=len(rewards),
        sub_means={k: float(torch.cat([sub[k] for _, sub in scored]).mean()) for k in scored[0][1]},
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

"""One grader over a batch of samples, torch-free: what training, validation and eval runs share.

The grader's python leaves run over the whole batch in a sandbox (one per source), its remote leaves (a judge, an
endpoint, embeddings) over the whole batch with concurrent requests; then, unless the grader is one of those leaves
alone, the pure graders and a multi's formula run in a grading process with a hard time limit per sample
(`trainer.grading.pool`), given every leaf score computed before (reward-model scores among them: they need torch,
so the caller brings them). Each sample's errors are kept in the order they arose, each once.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from trainer.grading import remote_graders
from trainer.grading.graders import grade_python_leaves
from trainer.grading.pool import GradingPool, GradingTimeout, Sample
from trainer.grading.remote_graders import JudgeBudget, RemoteConfig
from trainer.grading.sandbox import PythonSandbox
from trainer.spec import graders


@dataclass(frozen=True)
class BatchGrading:
    """Where a batch's leaves are graded: the sandbox of its python leaves, the services (and judge budget) of its
    remote leaves, the grading processes of the rest."""

    sandbox: PythonSandbox
    remote: RemoteConfig
    budget: JudgeBudget
    pool: GradingPool


def grade_results(
    grader: graders.Grader,
    texts: Sequence[str],
    rows: Sequence[Mapping[str, Any]],
    reasons: Sequence[graders.FinishReason] | None = None,
    *,
    how: BatchGrading,
    leaf_scores: Mapping[str, list[float]] | None = None,
    output_tools: Sequence[Sequence[Mapping[str, Any]]] | None = None,
    trace_ids: Sequence[str] | None = None,
) -> list[graders.GradeResult]:
    """Each sample's result [N]. `reasons`: why each completion ended (`stop` for all when not given), the `sample`
    object's `finish_reason`; `output_tools` and `trace_ids`: an agent episode's tool calls and the trace id they
    carried. Raises `trainer.grading.sandbox.SandboxUnavailable` when a python leaf has no sandbox to run in,
    `remote_graders.BudgetSpent` once the judge budget is spent, and `graders.GraderError` for a remote leaf `how`
    has no service for: what each means (a failed job, a failed eval run) is the caller's."""
    python = grade_python_leaves(grader, how.sandbox, texts, rows, reasons, output_tools)
    remote = remote_graders.grade_remote_leaves(
        grader,
        texts,
        rows,
        config=how.remote,
        budget=how.budget,
        finish_reasons=reasons,
        output_tools=output_tools,
        trace_ids=trace_ids,
    )
    errors = [[*p, *r] for p, r in zip(python.errors, remote.errors, strict=True)]
    scores = {**(leaf_scores or {}), **python.scores, **remote.scores}
    if graders.is_batched(grader):  # a python or remote leaf alone: nothing for the grading process to do
        return [
            graders.GradeResult(score, {grader.name: score}, tuple(dict.fromkeys(errs)))
            for score, errs in zip(scores[grader.name], errors, strict=True)
        ]
    results = _in_pool(how.pool, grader, texts, rows, scores, output_tools)
    return [
        graders.GradeResult(r.score, r.sub_scores, tuple(dict.fromkeys((*errs, *r.errors)))) if errs else r
        for r, errs in zip(results, errors, strict=True)
    ]


def _in_pool(
    pool: GradingPool,
    grader: graders.Grader,
    texts: Sequence[str],
    rows: Sequence[Mapping[str, Any]],
    leaf_scores: Mapping[str, list[float]],
    output_tools: Sequence[Sequence[Mapping[str, Any]]] | None,
) -> list[graders.GradeResult]:
    samples = [
        Sample(text, row, {key: s[i] for key, s in leaf_scores.items()}, output_tools[i] if output_tools else ())
        for i, (text, row) in enumerate(zip(texts, rows, strict=True))
    ]
    try:
        return pool.run(grader.model_dump(mode="json"), samples).results
    except GradingTimeout as err:  # the grader validated here; a process that cannot is a failed batch
        problem = graders.GradeError(f"{err}; scored 0.0", "timeout")
        return [graders.GradeResult(0.0, {}, (problem,))] * len(samples)

"""Python graders: their leaves graded over a batch in a sandbox, and OpenAI's `sample` object they get."""

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from trainer.grading.graders.render import output_json
from trainer.spec.graders import FinishReason, GradeError, GradeErrorKind, Grader, python_graders

if TYPE_CHECKING:
    from trainer.grading.sandbox import PythonSandbox, Result

_PYTHON_RUNTIME_CAUSES = frozenset({"exception", "not_a_number", "non_finite", "invalid_source"})


def python_grade_error(grader_name: str, cause: str, error: str | None) -> GradeError:
    """The GradeError of a python grader's sample that scored no number, from the sandbox's result kind (`cause`):
    the grader's own failure (`python_runtime`: it raised, returned no finite number, or its source is unusable) or
    the sandbox's (`python_server`: timeout, cpu_limit, memory_limit, output_limit, crash)."""
    kind: GradeErrorKind = "python_runtime" if cause in _PYTHON_RUNTIME_CAUSES else "python_server"
    return GradeError(f"python grader {grader_name!r} ({cause}): {error or cause}; scored 0.0", kind, cause)


@dataclass(frozen=True)
class PythonScores:
    """The scores of a grader's python leaves over a batch: `scores[key][i]` for sample i, keyed as `model_scores`
    is, and `errors[i]`, the problems of sample i (a leaf that scored no number adds one)."""

    scores: dict[str, list[float]]
    errors: list[list[GradeError]]


def grade_python_leaves(
    grader: Grader,
    sandbox: "PythonSandbox",
    output_texts: Sequence[str],
    items: Sequence[Mapping[str, Any]],
    finish_reasons: Sequence[FinishReason] | None = None,
    output_tools: Sequence[Sequence[Mapping[str, Any]]] | None = None,
) -> PythonScores:
    """Grade every python leaf of `grader` over the batch, one sandbox per leaf (leaves with the same source share
    it), with OpenAI's `sample` object (`sample_object`, with each sample's `finish_reason`: `stop` where none is
    given) and the item. Raises `trainer.grading.sandbox.SandboxUnavailable` when no sandbox could start."""
    errors: list[list[GradeError]] = [[] for _ in output_texts]
    scores: dict[str, list[float]] = {}
    leaves = python_graders(grader)
    if not leaves or not output_texts:
        return PythonScores({key: [] for key, _ in leaves}, errors)
    reasons = finish_reasons or ["stop"] * len(output_texts)
    tools = output_tools or [()] * len(output_texts)
    samples = [
        sample_object(text, finish_reason=reason, output_tools=calls)
        for text, reason, calls in zip(output_texts, reasons, tools, strict=True)
    ]
    by_source: dict[str, list[Result]] = {}
    for key, leaf in leaves:
        if leaf.source not in by_source:
            by_source[leaf.source] = sandbox.grade_batch(leaf.source, samples, items)
        results = by_source[leaf.source]
        scores[key] = [r.score if r.kind is None else 0.0 for r in results]
        for i, r in enumerate(results):
            if r.kind is not None:
                errors[i].append(python_grade_error(leaf.name, r.kind, r.error))
    return PythonScores(scores, errors)


def sample_object(
    output_text: str,
    *,
    finish_reason: FinishReason = "stop",
    output_tools: Sequence[Mapping[str, Any]] = (),
) -> dict[str, Any]:
    """OpenAI's `sample` of a python grader (and of the graders guide's `{{sample.*}}`) for a chat completion:
    `output_text`; `output_json`, the text parsed as JSON when it is JSON (else None; NaN and infinities are not):
    under a job's JSON `response_format` every finished answer is JSON the schema admits, so it is that answer (None
    only for one cut by its token budget), as OpenAI gives it with structured output; without one it is still the
    parsed text when that happens to be JSON (OpenAI's is then null), so that a grader reading it never sees less;
    `output_tools`, the tool calls of an agent episode in chat-completions shape (`{"id", "type": "function",
    "function": {"name", "arguments"}}`; none for a single reply); `choices`, the one chat-completions choice (its
    message the final answer, which calls no tool); `output_audio` None."""
    return {
        "output_text": output_text,
        "output_json": output_json(output_text),
        "output_tools": [dict(c) for c in output_tools],
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": output_text, "tool_calls": []},
                "finish_reason": finish_reason,
            }
        ],
        "output_audio": None,
    }

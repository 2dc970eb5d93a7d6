"""OpenAI's grader dry-run: validate a grader, score one sample with it."""

from __future__ import annotations

import time
from typing import Any

from api.errors import InvalidRequest
from api.schemas import GraderRunErrors, GraderRunMetadata, GraderRunResponse
from trainer import graders


def _parse(obj: dict[str, Any]) -> graders.Grader:
    try:
        return graders.parse_grader(obj)
    except graders.GraderError as err:
        raise InvalidRequest(str(err), param=err.param, code="invalid_grader") from None


def validate(*, grader: dict[str, Any]) -> dict[str, Any]:
    """The grader as it will run (defaults filled in); 400 naming the field when it is invalid."""
    return _parse(grader).model_dump(mode="json", exclude_none=True)


def _flags(errors: tuple[graders.GradeError, ...]) -> GraderRunErrors:
    """OpenAI's error flags of a grader run, from the kinds of the problems met while grading."""
    kinds = {error.kind for error in errors}
    return GraderRunErrors(
        invalid_variable_error="invalid_variable" in kinds,
        formula_parse_error="formula" in kinds,
        other_error="other" in kinds,
    )


def run(*, grader: dict[str, Any], model_sample: str, item: dict[str, Any] | None) -> GraderRunResponse:
    """Score ``model_sample`` against ``item`` as a training step would."""
    parsed = _parse(grader)
    start = time.perf_counter()
    try:
        result = graders.grade(parsed, output_text=model_sample, item=item or {})
    except graders.GraderError as err:  # a reward_model grader needs its model: it runs in training jobs only
        raise InvalidRequest(str(err), param="grader", code="invalid_grader") from None
    elapsed = time.perf_counter() - start
    return GraderRunResponse(
        reward=result.score,
        metadata=GraderRunMetadata(
            name=parsed.name,
            type=parsed.type,
            errors=_flags(result.errors),
            execution_time=elapsed,
            scores=dict(result.sub_scores),
            error_messages=list(result.errors),
        ),
        sub_rewards=dict(result.sub_scores),
    )

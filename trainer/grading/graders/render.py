"""Rendering templates against one sample and its item."""

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from trainer.spec.graders import GradeError
from trainer.spec.graders.templates import lookup, missing_field_message, parse_template


@dataclass
class Context:
    output_text: str
    item: Mapping[str, Any]
    errors: list[GradeError]
    model_scores: Mapping[str, float]
    output_tools: Sequence[Mapping[str, Any]] = ()


def render_template(template: str, grader_name: str, ctx: Context) -> str:
    """Fill a template; a missing item field renders as '' and adds an error flag."""
    out: list[str] = []
    for part in parse_template(template):
        if isinstance(part, str):
            out.append(part)
        elif part.namespace == "sample":
            if part.path == ("output_tools",):
                out.append(json.dumps(list(ctx.output_tools), ensure_ascii=False))
            else:
                out.append(ctx.output_text)
        else:
            found, value = lookup(ctx.item, part.path)
            if not found:
                ctx.errors.append(
                    GradeError(missing_field_message(grader_name, part) + "; rendered as ''", "invalid_variable")
                )
                out.append("")
            elif isinstance(value, str):
                out.append(value)
            else:
                out.append(json.dumps(value, ensure_ascii=False, default=str))
    return "".join(out)


def render(
    template: str,
    grader_name: str,
    *,
    output_text: str,
    item: Mapping[str, Any],
    output_tools: Sequence[Mapping[str, Any]] = (),
) -> tuple[str, list[GradeError]]:
    """A template filled with the sample and the item, and the problems met (a missing item field renders as '' and
    adds an `invalid_variable` error), as every grader renders its templates."""
    ctx = Context(output_text=output_text, item=item, errors=[], model_scores={}, output_tools=output_tools)
    return render_template(template, grader_name, ctx), ctx.errors

"""Rendering templates against one sample and its item."""

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from trainer.spec.graders import GradeError
from trainer.spec.graders.templates import lookup, missing_field_message, parse_template
from trainer.spec.json_values import refuse_constant


def output_json(text: str) -> Any:
    """OpenAI's `sample.output_json`: the output parsed as JSON, None when it is not JSON (NaN and infinities are
    not; nor is a text nested too deep to parse)."""
    try:
        return json.loads(text, parse_constant=refuse_constant)
    except (ValueError, RecursionError):  # JSONDecodeError is a ValueError
        return None


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
        elif part.path == ("output_tools",):
            out.append(json.dumps(list(ctx.output_tools), ensure_ascii=False))
        elif part.path == ("output_text",):
            out.append(ctx.output_text)
        elif part.namespace == "sample":  # output_json, or a path into it
            found, value = lookup({"output_json": output_json(ctx.output_text)}, part.path)
            if not found or (value is None and len(part.path) == 1):
                what = "is not JSON" if len(part.path) == 1 else f"has no field {'.'.join(part.path[1:])!r}"
                message = f"grader {grader_name!r} references {part.text} but the sample's output {what}"
                ctx.errors.append(GradeError(message + "; rendered as ''", "invalid_variable"))
                out.append("")
            else:
                out.append(_as_text(value))
        else:
            found, value = lookup(ctx.item, part.path)
            if not found:
                ctx.errors.append(
                    GradeError(missing_field_message(grader_name, part) + "; rendered as ''", "invalid_variable")
                )
                out.append("")
            else:
                out.append(_as_text(value))
    return "".join(out)


def _as_text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, default=str)


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

"""numeric_match: the last number of a text, and whether two numbers match within a tolerance."""

import re

from trainer.grading.graders.render import Context, render_template
from trainer.spec.graders import GradeError, NumericMatchGrader

# The last number of a text: optional sign (not when it is a binary minus as in "10-12"), digits with optional
# thousands separators ("1,234"), optional decimals and exponent. U+2212 (−) counts as a minus sign.
_NUMBER_RE = re.compile(
    r"(?:(?<![\w)])[-+\u2212])?"
    r"(?:(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?|\.\d+)"
    r"(?:[eE][-+]?\d+)?"
)


def parse_last_number(text: str) -> float | None:
    """The last number written in `text` ("-1,234.5", "0.25", "3e-2"), or None when there is none."""
    last = None
    for last in _NUMBER_RE.finditer(text):  # noqa: B007 — only the final match is wanted
        pass
    if last is None:
        return None
    return float(last.group(0).replace(",", "").replace("\u2212", "-"))


def numbers_match(value: float, reference: float, *, tolerance: float, relative_tolerance: float) -> bool:
    """|value − reference| ≤ max(tolerance, relative_tolerance · |reference|)."""
    return abs(value - reference) <= max(tolerance, relative_tolerance * abs(reference))


def score_numeric_match(grader: NumericMatchGrader, ctx: Context) -> float:
    value = parse_last_number(render_template(grader.input, grader.name, ctx))
    reference_text = render_template(grader.reference, grader.name, ctx)
    reference = parse_last_number(reference_text)
    if reference is None:
        ctx.errors.append(
            GradeError(f"grader {grader.name!r}: no number in the rendered reference {reference_text[:80]!r}", "other")
        )
        return 0.0
    if value is None:
        return 0.0
    return float(
        numbers_match(value, reference, tolerance=grader.tolerance, relative_tolerance=grader.relative_tolerance)
    )

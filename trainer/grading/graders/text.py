"""The text graders: string_check, text_similarity (the local metrics), regex and length_penalty."""

import functools
import operator
from collections.abc import Callable
from typing import Any

import re2
from rapidfuzz.distance import Indel

from trainer.grading import similarity
from trainer.grading.graders.render import Context, render_template
from trainer.spec.graders import (
    MAX_PATTERN_CHARS,
    MAX_REGEX_INPUT_CHARS,
    MAX_SIMILARITY_CHARS,
    GradeError,
    LengthPenaltyGrader,
    RegexGrader,
    StringCheckGrader,
    TextSimilarityGrader,
)
from trainer.spec.graders.patterns import RE2_OPTIONS, REGEX_FLAGS
from trainer.spec.graders.text_metrics import SIMILARITY_METRICS, UNAVAILABLE


def _contains_ci(text: str, reference: str) -> bool:
    return reference.lower() in text.lower()


# OpenAI's string_check: eq/ne compare exactly (nothing stripped); like/ilike: input contains reference.
_STRING_OPERATIONS: dict[str, Callable[[str, str], bool]] = {
    "eq": operator.eq,
    "ne": operator.ne,
    "like": lambda text, reference: reference in text,
    "ilike": _contains_ci,
}


def fuzzy_match(a: str, b: str) -> float:
    """Similarity ratio in [0, 1]: 2·LCS(a, b) / (len(a) + len(b)), LCS the length of a longest common
    subsequence of characters; two empty strings score 1.0.

    This is RapidFuzz's normalised InDel similarity (`fuzz.ratio` / 100), which OpenAI cites for `fuzzy_match`,
    computed by RapidFuzz in C (bit-parallel, O(len(a)·len(b)/64)). It equals `difflib.SequenceMatcher`'s `ratio()`,
    which this function computed before, whenever difflib's greedy matching blocks form a longest common subsequence
    (they do on ordinary text); where they do not, difflib scored lower ('bbabaa' and 'aaaabbba': 3/7 by difflib's
    blocks, 4/7 by the LCS 'bbba').
    """
    total = len(a) + len(b)
    # Indel.similarity is len(a) + len(b) − distance = 2·LCS, an integer: the ratio is rounded once, as difflib's
    # 2.0 * matches / total is, so ordinary inputs score bit for bit what they scored with difflib.
    return Indel.similarity(a, b) / total if total else 1.0


_SIMILARITY_METRICS: dict[str, Callable[[str, str], float]] = {"fuzzy_match": fuzzy_match, **similarity.METRICS}
# The contract names the metrics (trainer.spec.graders.text_metrics); every available one needs its scorer here.
assert set(_SIMILARITY_METRICS) == set(SIMILARITY_METRICS) - set(UNAVAILABLE), "similarity metrics out of step"


def length_penalty(n_chars: int, *, max_chars: int, penalty_per_char: float, min_score: float | None) -> float:
    """−max(0, n_chars − max_chars) · penalty_per_char, clipped below at min_score (None: unclipped)."""
    excess = n_chars - max_chars
    if excess <= 0:
        return 0.0
    score = -excess * penalty_per_char
    return score if min_score is None else max(score, min_score)


@functools.lru_cache(maxsize=32)  # keys are at most MAX_PATTERN_CHARS long; values at most RE2_MAX_MEM each
def _compile_pattern(pattern: str, flags: tuple[str, ...]) -> Any:
    """The compiled RE2 pattern (`re2._Regexp`) with `flags` as a leading inline group: `(?is)pattern`."""
    if len(pattern) > MAX_PATTERN_CHARS:
        raise ValueError(f"longer than {MAX_PATTERN_CHARS} characters")
    inline = "".join(flag for flag in REGEX_FLAGS if flag in flags)
    return re2.compile(f"(?{inline}){pattern}" if inline else pattern, RE2_OPTIONS)


def score_string_check(grader: StringCheckGrader, ctx: Context) -> float:
    operation = _STRING_OPERATIONS[grader.operation]
    return float(
        operation(render_template(grader.input, grader.name, ctx), render_template(grader.reference, grader.name, ctx))
    )


def score_similarity(grader: TextSimilarityGrader, ctx: Context) -> float:
    """A local metric of the rendered input and reference; 0.0 with an error flag when either is longer than the
    metric compares."""
    texts = {
        "input": render_template(grader.input, grader.name, ctx),
        "reference": render_template(grader.reference, grader.name, ctx),
    }
    max_chars = similarity.MAX_CHARS.get(grader.evaluation_metric, MAX_SIMILARITY_CHARS)
    for field, text in texts.items():
        if len(text) > max_chars:
            ctx.errors.append(
                GradeError(
                    f"grader {grader.name!r}: the rendered {field} is {len(text)} characters long; "
                    f"{grader.evaluation_metric} compares texts of at most {max_chars}; scored 0.0",
                    "other",
                )
            )
            return 0.0
    metric = _SIMILARITY_METRICS[grader.evaluation_metric]
    return float(metric(texts["input"], texts["reference"]))


def score_regex(grader: RegexGrader, ctx: Context) -> float:
    pattern = _compile_pattern(grader.pattern, tuple(grader.flags))
    return float(pattern.search(render_template(grader.input, grader.name, ctx)[:MAX_REGEX_INPUT_CHARS]) is not None)


def score_length_penalty(grader: LengthPenaltyGrader, ctx: Context) -> float:
    return length_penalty(
        len(render_template(grader.input, grader.name, ctx)),
        max_chars=grader.max_chars,
        penalty_per_char=grader.effective_penalty_per_char,
        min_score=grader.min_score,
    )

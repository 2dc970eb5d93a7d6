"""The score of one leaf grader on one sample, by its type."""

from typing import assert_never

from trainer.grading.graders.batched import batched_score
from trainer.grading.graders.numeric import score_numeric_match
from trainer.grading.graders.render import Context
from trainer.grading.graders.text import score_length_penalty, score_regex, score_similarity, score_string_check
from trainer.spec.graders import (
    REMOTE_SIMILARITY_METRICS,
    EndpointGrader,
    LabelModelGrader,
    LeafGrader,
    LengthPenaltyGrader,
    NumericMatchGrader,
    PythonGrader,
    RegexGrader,
    RewardModelGrader,
    ScoreModelGrader,
    StringCheckGrader,
    TextSimilarityGrader,
)


def score_leaf(grader: LeafGrader, ctx: Context, path: str) -> float:
    """The leaf's score; `path` is its key in sub_scores and `model_scores` (`quality.judge`). Problems are added to
    `ctx.errors`; a batched leaf whose score is not in `ctx.model_scores` raises GraderError."""
    match grader:
        case StringCheckGrader():
            return score_string_check(grader, ctx)
        case TextSimilarityGrader():
            if grader.evaluation_metric in REMOTE_SIMILARITY_METRICS:
                return batched_score(grader, ctx, path)
            return score_similarity(grader, ctx)
        case NumericMatchGrader():
            return score_numeric_match(grader, ctx)
        case RegexGrader():
            return score_regex(grader, ctx)
        case LengthPenaltyGrader():
            return score_length_penalty(grader, ctx)
        case RewardModelGrader() | PythonGrader() | ScoreModelGrader() | LabelModelGrader() | EndpointGrader():
            return batched_score(grader, ctx, path)
        case _:
            assert_never(grader)

"""The leaves scored over whole batches outside `grade` (a reward model's forward passes, a python grader's sandbox, a
remote service): `grade` reads their scores from `model_scores`; and the conversation a reward model scores."""

from collections.abc import Mapping
from typing import Any

from trainer.grading.graders.render import Context, render_template
from trainer.spec.graders import (
    EndpointGrader,
    GraderError,
    LabelModelGrader,
    PythonGrader,
    RewardModelGrader,
    ScoreModelGrader,
    TextSimilarityGrader,
    item_conversation,
)

BatchedLeaf = (
    RewardModelGrader | PythonGrader | ScoreModelGrader | LabelModelGrader | EndpointGrader | TextSimilarityGrader
)

# What a remote leaf calls over the batch (trainer.grading.remote_graders), by grader type.
_SERVICES = {
    "score_model": "judge model",
    "label_model": "judge model",
    "endpoint": "grading service",
    "text_similarity": "embeddings endpoint",
}


def _why_not_here(grader: BatchedLeaf) -> str:
    if isinstance(grader, RewardModelGrader):
        return (
            "reward_model graders run a model over batches of samples; they are scored during training and "
            "evaluation, and cannot be run on a single sample here"
        )
    if isinstance(grader, PythonGrader):
        return "python graders run in a sandbox over batches of samples (trainer.loops.evaluate.grade_batch), not here"
    return (
        f"{grader.type} graders call a {_SERVICES[grader.type]} over batches of samples "
        "(trainer.grading.remote_graders), not here"
    )


def batched_score(grader: BatchedLeaf, ctx: Context, path: str) -> float:
    """The leaf's score, computed over the batch and handed to `grade` in `model_scores` under the leaf's key `path`;
    GraderError when it is missing."""
    if path not in ctx.model_scores:
        raise GraderError(f"grader {grader.name!r}: {_why_not_here(grader)}")
    return float(ctx.model_scores[path])


def reward_model_prompt(grader: RewardModelGrader, item: Mapping[str, Any]) -> list[dict[str, str]] | None:
    """The conversation a reward_model grader scores the sample as the reply to: its `prompt` rendered against
    the item, or the item's own `messages` / `prompt`; None when the item has neither."""
    if grader.prompt is not None:
        ctx = Context(output_text="", item=item, errors=[], model_scores={})
        return [{"role": m.role, "content": render_template(m.content, grader.name, ctx)} for m in grader.prompt]
    return item_conversation(item)

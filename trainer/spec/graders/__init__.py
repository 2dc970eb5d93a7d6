"""Graders: the rewards of RL fine-tuning, shaped like OpenAI's grader objects. This package is their contract: the
models, `parse_grader`, the errors and results of grading, and walks over a grader's tree; scoring them is
`trainer.grading.graders`'s.

A grader is a pydantic model parsed from JSON (`parse_grader`) and scored by a pure function of one sample and its
dataset row (`trainer.grading.graders.grade`). Strings may hold templates: `{{sample.output_text}}` is the model's
completion, `{{item.<path>}}` a field of the row (dotted path for nesting; a digit indexes a list: `{{item.a.0}}`).
Strings render verbatim; any other value renders as compact JSON (`3`, `true`, `null`, `{"a": 1}`).

OpenAI's types: `string_check`, `text_similarity`, `multi`, `python`, `score_model`, `label_model` and `endpoint`.
Ours: `numeric_match`, `regex`, `length_penalty`, and `reward_model` (the score of a reward model trained by a
`reward_model` job). Every score is a float. Problems found at grading time (a missing item field, a division by zero
in a formula) never raise: they are listed in `GradeResult.errors`, each a `GradeError` that says its kind.

A `reward_model` grader needs a model, a `python` grader a sandbox, and the remote graders (`score_model` and
`label_model`: a judge model behind an HTTP endpoint; `endpoint`: the tenant's own grading service; `text_similarity`
with the `cosine` metric: an embeddings endpoint) the network, so `grade` scores none of them:
`trainer.loops.evaluate.grade_batch` scores every reward-model leaf of a batch in batched forward passes
(`trainer.loops.reward_model`), every python leaf in one sandbox per batch (`trainer.grading.sandbox`, with the `sample`
object of `trainer.grading.graders.sample_object`) and every remote leaf over the whole batch, concurrently
(`trainer.grading.remote_graders`), and hands the scores to `grade` as `model_scores`; `grade` without them raises
`GraderError`.

Graders are user input, parsed on the API's request threads: parsing is linear in the grader's size and the size is
capped (the MAX_* bounds, each a `GraderError` naming the field), regular expressions run on RE2 (linear-time
matching), and `grade` itself runs in a grading process with a hard time limit per sample (`trainer.grading.pool`).

The names below are the public ones; the submodules hold them by kind (limits, errors, templates, formulas, patterns,
text_metrics, leaves, judges, tree, walks).
"""

from trainer.spec.graders.errors import (
    FAILURE_KINDS,
    FinishReason,
    GradeError,
    GradeErrorKind,
    GraderError,
    GradeResult,
    GraderFailed,
)
from trainer.spec.graders.formulas import FORMULA_FUNCTIONS
from trainer.spec.graders.judges import (
    MAX_CONTENT_PARTS,
    MAX_ENDPOINT_HEADERS,
    MAX_HEADER_NAME_CHARS,
    MAX_HEADER_VALUE_CHARS,
    MAX_JUDGE_MESSAGES,
    MAX_JUDGE_MODEL_CHARS,
    MAX_JUDGE_TOKENS,
    MAX_LABEL_CHARS,
    MAX_LABELS,
    MAX_RATE_LIMIT,
    EndpointGrader,
    JudgeMessage,
    LabelModelGrader,
    SamplingParams,
    ScoreModelGrader,
    TextPart,
)
from trainer.spec.graders.leaves import (
    MAX_PYTHON_SOURCE_BYTES,
    PYTHON_IMAGE_TAGS,
    LengthPenaltyGrader,
    NumericMatchGrader,
    PromptMessage,
    PythonGrader,
    RegexGrader,
    RewardModelGrader,
    StringCheckGrader,
    TextSimilarityGrader,
)
from trainer.spec.graders.limits import (
    MAX_FORMULA_CHARS,
    MAX_FORMULA_DEPTH,
    MAX_GRADER_DEPTH,
    MAX_GRADERS,
    MAX_NAME_CHARS,
    MAX_PATTERN_CHARS,
    MAX_REGEX_INPUT_CHARS,
    MAX_SIMILARITY_CHARS,
    MAX_TEMPLATE_CHARS,
    RE2_MAX_MEM,
)
from trainer.spec.graders.templates import Template
from trainer.spec.graders.text_metrics import REMOTE_SIMILARITY_METRICS
from trainer.spec.graders.tree import GRADER_TYPES, Grader, LeafGrader, MultiGrader, RemoteGrader, parse_grader
from trainer.spec.graders.walks import (
    batched_leaf_params,
    check_item,
    grader_names,
    held_out_keys,
    is_batched,
    is_remote,
    item_conversation,
    keyed_leaves,
    model_graders,
    python_grader_params,
    python_graders,
    remote_graders,
    template_fields,
    with_models,
)

__all__ = [
    "FAILURE_KINDS",
    "FORMULA_FUNCTIONS",
    "GRADER_TYPES",
    "MAX_CONTENT_PARTS",
    "MAX_ENDPOINT_HEADERS",
    "MAX_FORMULA_CHARS",
    "MAX_FORMULA_DEPTH",
    "MAX_GRADERS",
    "MAX_GRADER_DEPTH",
    "MAX_HEADER_NAME_CHARS",
    "MAX_HEADER_VALUE_CHARS",
    "MAX_JUDGE_MESSAGES",
    "MAX_JUDGE_MODEL_CHARS",
    "MAX_JUDGE_TOKENS",
    "MAX_LABELS",
    "MAX_LABEL_CHARS",
    "MAX_NAME_CHARS",
    "MAX_PATTERN_CHARS",
    "MAX_PYTHON_SOURCE_BYTES",
    "MAX_RATE_LIMIT",
    "MAX_REGEX_INPUT_CHARS",
    "MAX_SIMILARITY_CHARS",
    "MAX_TEMPLATE_CHARS",
    "PYTHON_IMAGE_TAGS",
    "RE2_MAX_MEM",
    "REMOTE_SIMILARITY_METRICS",
    "EndpointGrader",
    "FinishReason",
    "GradeError",
    "GradeErrorKind",
    "GradeResult",
    "Grader",
    "GraderError",
    "GraderFailed",
    "JudgeMessage",
    "LabelModelGrader",
    "LeafGrader",
    "LengthPenaltyGrader",
    "MultiGrader",
    "NumericMatchGrader",
    "PromptMessage",
    "PythonGrader",
    "RegexGrader",
    "RemoteGrader",
    "RewardModelGrader",
    "SamplingParams",
    "ScoreModelGrader",
    "StringCheckGrader",
    "Template",
    "TextPart",
    "TextSimilarityGrader",
    "batched_leaf_params",
    "check_item",
    "grader_names",
    "held_out_keys",
    "is_batched",
    "is_remote",
    "item_conversation",
    "keyed_leaves",
    "model_graders",
    "parse_grader",
    "python_grader_params",
    "python_graders",
    "remote_graders",
    "template_fields",
    "with_models",
]

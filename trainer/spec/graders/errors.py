"""The errors of graders: an invalid grader object (`GraderError`), a problem met grading one sample (`GradeError`,
listed in `GradeResult.errors`, never raised), and a grader failing a whole run (`GraderFailed`)."""

from dataclasses import dataclass
from typing import Literal, Self, get_args


class GraderError(ValueError):
    """An invalid grader object; the message names the offending field: `grader.graders.acc.operation: …`, and
    `param` is that field's path (the first one's, when there are several; `grader` when no field is to blame)."""

    def __init__(self, message: str, *, param: str = "grader") -> None:
        super().__init__(message)
        self.param = param


GradeErrorKind = Literal[
    "invalid_variable",
    "formula",
    "timeout",
    "other",
    "python_runtime",
    "python_server",
    "model_grader_parse",
    "model_grader_refusal",
    "model_grader_server",
    "endpoint_parse",
    "endpoint_server",
    "embeddings",
]
"""What went wrong while grading (OpenAI's grader-run error flags): a template named an item field the row lacks, a
multi grader's `calculate_output` failed, grading one sample took longer than its time limit (trainer.grading.pool),
anything else; a python grader's code failed (`python_runtime`: it raised, returned something that is not a finite
number, or its source defines no usable `grade`) or its sandbox stopped it (`python_server`: timeout, CPU limit,
output limit, crash; the sandbox's kind is the error's `cause`); a score_model or label_model grader's judge answered
something that does not parse as its result (`model_grader_parse`: not the JSON asked for, a score outside `range`, a
label not in `labels`), refused (`model_grader_refusal`) or did not answer (`model_grader_server`: a timeout, a
connection error or an HTTP error after the retries); an endpoint grader's service answered no `{"score": number}`
(`endpoint_parse`) or did not answer (`endpoint_server`, or its URL is not allowed); the embeddings of a `cosine`
text_similarity could not be had (`embeddings`). The remote kinds' `cause` says more (`timeout`, `http_503`, ...)."""

FAILURE_KINDS: frozenset[str] = frozenset(get_args(GradeErrorKind)) - {"invalid_variable", "formula", "other"}
"""The kinds of error that mean the grader produced no score for the sample (scored 0.0): what a job counts as the
grader failing (`grader/error_rate`, and the job fails when most samples of consecutive steps fail)."""


class GradeError(str):
    """A problem met while grading one sample: its message (it is a `str`, so it reads and compares as one), its
    `kind`, so that callers tell problems apart by what they are, not by their wording, and for a python grader the
    sandbox's result kind as `cause` (`exception`, `timeout`, ...: `trainer.grading.sandbox.ResultKind`)."""

    kind: GradeErrorKind
    cause: str | None

    def __new__(cls, message: str, kind: GradeErrorKind, cause: str | None = None) -> Self:
        error = super().__new__(cls, message)
        error.kind = kind
        error.cause = cause
        return error

    def __getnewargs__(self) -> tuple[str, GradeErrorKind, str | None]:  # type: ignore[override]
        return str(self), self.kind, self.cause  # pickling (a result sent to another process) keeps the kind


class GraderFailed(GraderError):
    """The grader failed on most samples of a run (trainer.loops.evaluate.GraderMonitor): the job fails with it."""


@dataclass(frozen=True)
class GradeResult:
    """The reward of one sample: `score`, per-grader `sub_scores` and the problems met while grading."""

    score: float
    sub_scores: dict[str, float]
    errors: tuple[GradeError, ...]


FinishReason = Literal["stop", "length"]
"""Why a sampled completion ended, as OpenAI's chat completions say it: `stop` (the model's end of sequence) or
`length` (cut at the token limit)."""

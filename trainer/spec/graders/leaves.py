"""The graders scored from the sample and the item alone (string_check, text_similarity, numeric_match, regex,
length_penalty) and the ones scored over batches by a model or a sandbox (reward_model, python)."""

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from trainer.spec.graders.limits import MAX_NAME_CHARS, MAX_PATTERN_CHARS
from trainer.spec.graders.patterns import REGEX_FLAGS, check_pattern
from trainer.spec.graders.templates import Ref, Template, parse_template
from trainer.spec.graders.text_metrics import REMOTE_SIMILARITY_METRICS, SIMILARITY_METRICS, UNAVAILABLE


class GraderBase(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True, allow_inf_nan=False)

    name: str = Field(min_length=1, max_length=MAX_NAME_CHARS)


class StringCheckGrader(GraderBase):
    """1.0 when `operation` holds between rendered input and reference, else 0.0.

    eq: input == reference; ne: input != reference; like: reference is a substring of input; ilike: the same
    after lower-casing both. No whitespace is stripped.
    """

    type: Literal["string_check"]
    input: Template
    reference: Template
    operation: Literal["eq", "ne", "like", "ilike"]


class TextSimilarityGrader(GraderBase):
    """The `evaluation_metric` of rendered input and reference: `fuzzy_match` (fuzzy_match()); `bleu`, `gleu`,
    `meteor`, `rouge_1` … `rouge_5`, `rouge_l`, in [0, 1] (trainer.grading.similarity, which says how each is computed
    with nltk and rouge-score); and `cosine`: the cosine similarity of the two texts' embeddings from the deployment's
    embeddings endpoint (in [-1, 1]; scored over the batch by `trainer.grading.remote_graders`, not here).

    Each rendered text may be at most MAX_SIMILARITY_CHARS long, or `similarity.MAX_CHARS[metric]` (meteor: 10,000):
    a sample whose input or reference is longer scores 0.0 with an error flag. `pass_threshold` is accepted as OpenAI
    has it and does not change the score.
    """

    type: Literal["text_similarity"]
    input: Template
    reference: Template
    evaluation_metric: str
    pass_threshold: float | None = Field(default=None, allow_inf_nan=False)

    @field_validator("evaluation_metric")
    @classmethod
    def _known_metric(cls, value: str) -> str:
        if value in UNAVAILABLE:
            raise ValueError(f"evaluation_metric {value!r} is not available here: {UNAVAILABLE[value]}")
        if value not in SIMILARITY_METRICS and value not in REMOTE_SIMILARITY_METRICS:
            valid = ", ".join([*(m for m in SIMILARITY_METRICS if m not in UNAVAILABLE), *REMOTE_SIMILARITY_METRICS])
            raise ValueError(f"unsupported evaluation_metric {value!r}; valid: {valid}")
        return value


class NumericMatchGrader(GraderBase):
    """1.0 when a, the last number of the rendered input, and b, the last number of the rendered reference,
    satisfy |a − b| ≤ max(tolerance, relative_tolerance · |b|), else 0.0. An input with no number
    scores 0.0; a reference with none scores 0.0 and adds an error flag. parse_last_number says what counts.
    """

    type: Literal["numeric_match"]
    input: Template
    reference: Template
    tolerance: float = Field(default=0.0, ge=0.0, allow_inf_nan=False)
    relative_tolerance: float = Field(default=0.0, ge=0.0, allow_inf_nan=False)


class RegexGrader(GraderBase):
    """1.0 when `pattern` matches somewhere in the first MAX_REGEX_INPUT_CHARS characters of the rendered input,
    else 0.0.

    `pattern` is a literal regular expression, not a template, in RE2 syntax (https://github.com/google/re2/wiki/Syntax),
    which matches in time linear in the text: Python's `re` syntax less backreferences (`\\1`), lookarounds
    (`(?=`, `(?!`, `(?<=`, `(?<!`), atomic groups and possessive repeats; a pattern RE2 refuses is an error naming
    this field. As in RE2, `\\d`, `\\w`, `\\s` and `\\b` are ASCII (use `\\pN`, `\\pL` for Unicode), and without `m`
    `$` matches only at the very end of the text. Flags: i (case-insensitive), m (`^`/`$` at line breaks),
    s (`.` matches a newline).
    """

    type: Literal["regex"]
    input: Template
    pattern: str = Field(max_length=MAX_PATTERN_CHARS)
    flags: list[Literal["i", "m", "s"]] = Field(default_factory=list, max_length=len(REGEX_FLAGS))

    @field_validator("pattern")
    @classmethod
    def _valid_pattern(cls, value: str) -> str:
        check_pattern(value)
        return value


class LengthPenaltyGrader(GraderBase):
    """−max(0, len(rendered input) − max_chars) · penalty_per_char, clipped below at min_score.

    Length counts characters (code points). penalty_per_char defaults to 1 / max_chars, so with the default
    min_score of −1.0 the score falls linearly from 0 at max_chars to −1 at 2 · max_chars. None: no clip.
    """

    type: Literal["length_penalty"]
    input: Template
    max_chars: int = Field(ge=1)
    penalty_per_char: float | None = Field(default=None, ge=0.0, allow_inf_nan=False)
    min_score: float | None = Field(default=-1.0, le=0.0, allow_inf_nan=False)

    @property
    def effective_penalty_per_char(self) -> float:
        return self.penalty_per_char if self.penalty_per_char is not None else 1.0 / self.max_chars


class PromptMessage(BaseModel):
    """One message of a reward_model grader's prompt; its content is a template."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    role: Literal["system", "developer", "user", "assistant"]
    content: Template


class RewardModelGrader(GraderBase):
    """The scalar score a reward model gives the conversation `prompt` + the sample as the assistant's reply.

    `model`: the output folder of a `reward_model` job (the service rewrites a job id or model name to it);
    `prompt`: the conversation the sample answers, templates allowed; default: the item's own `messages` (or its
    `prompt` string as a user turn), i.e. the prompt the policy was given. `normalize`: standardise the score with
    the mean and standard deviation of the reward model's scores on its own preference data (stored with it).
    `batch_size`: samples per forward pass.
    """

    type: Literal["reward_model"]
    model: str = Field(min_length=1)
    prompt: list[PromptMessage] | None = Field(default=None, min_length=1)
    normalize: bool = False
    batch_size: int = Field(default=32, ge=1, le=4096)

    @field_validator("prompt")
    @classmethod
    def _no_sample_in_prompt(cls, value: list[PromptMessage] | None) -> list[PromptMessage] | None:
        for i, m in enumerate(value or ()):
            if any(isinstance(p, Ref) and p.namespace == "sample" for p in parse_template(m.content)):
                raise ValueError(
                    f"prompt[{i}].content: the sample is the reply the model scores, not part of the prompt"
                )
        return value


PYTHON_IMAGE_TAGS: tuple[str, ...] = ("2025-05-08",)
"""The `image_tag`s a python grader may name: OpenAI's. Here "2025-05-08" (the default) is the sandbox's interpreter,
Python 3.11, with the packages of OpenAI's image: numpy, scipy, sympy, pandas, rapidfuzz, scikit-learn, rouge-score,
deepdiff, jsonschema, pydantic, pyyaml, nltk and sqlparse (`trainer/grading/sandbox_packages/requirements.txt`, the
deployment's packages folder: PROXIMA_SANDBOX_PACKAGES). A grader importing a package that is not there fails as on
OpenAI: a runtime error whose details hold the ImportError, every sample scored 0.0. A deployment that built no
packages folder offers the standard library only."""
MAX_PYTHON_SOURCE_BYTES = 256 * 1024
"""OpenAI's bound on a python grader's `source` ("< 256 kB"), in UTF-8 bytes (the sandbox's runner checks it too)."""


class PythonGrader(GraderBase):
    """OpenAI's `python` grader: `source` defines `grade(sample, item) -> float`, run in a sandbox
    (trainer.grading.sandbox).

    `sample` is OpenAI's sample object (`sample_object`: output_text, output_json, output_tools, choices,
    output_audio), `item` the dataset row. The score is what float() makes of grade's result when it is a finite
    number (not clipped); anything else (an exception, a value that is not a number, NaN) scores 0.0 with an error
    flag. `name` is optional, as in OpenAI's guide (default "python"). Whether `grade` is defined is checked in a
    sandbox (`trainer.grading.sandbox.check_source`) where the grader arrives, never by parsing the source here.
    """

    type: Literal["python"]
    name: str = Field(default="python", min_length=1, max_length=MAX_NAME_CHARS)
    source: str
    image_tag: str | None = None

    @field_validator("source")
    @classmethod
    def _source_size(cls, value: str) -> str:
        size = len(value.encode("utf-8", errors="surrogatepass"))
        if size > MAX_PYTHON_SOURCE_BYTES:
            raise ValueError(f"source is {size} bytes long; at most {MAX_PYTHON_SOURCE_BYTES} bytes are allowed")
        return value

    @field_validator("image_tag")
    @classmethod
    def _known_image(cls, value: str | None) -> str | None:
        if value is not None and value not in PYTHON_IMAGE_TAGS:
            raise ValueError(f"unknown image_tag {value!r}; valid: {', '.join(PYTHON_IMAGE_TAGS)}")
        return value

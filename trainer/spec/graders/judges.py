"""Remote graders: a judge model (score_model, label_model) and the tenant's grading service (endpoint). They are
shaped here and scored over whole batches by trainer.grading.remote_graders."""

import re
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PlainSerializer,
    PlainValidator,
    StringConstraints,
    ValidationError,
    ValidationInfo,
    field_validator,
)

from trainer.spec import urls
from trainer.spec.graders.leaves import GraderBase
from trainer.spec.graders.limits import MAX_TEMPLATE_CHARS
from trainer.spec.graders.templates import Template, validate_template

MAX_JUDGE_MESSAGES = 32
MAX_CONTENT_PARTS = 16
MAX_JUDGE_MODEL_CHARS = 256
MAX_LABELS = 64
MAX_LABEL_CHARS = 256
MAX_JUDGE_TOKENS = 65_536
MAX_ENDPOINT_HEADERS = 32
MAX_HEADER_NAME_CHARS = 256
MAX_HEADER_VALUE_CHARS = 8_192
MAX_RATE_LIMIT = 10_000
_HEADER_NAME_RE = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")  # RFC 9110's token
# Headers the HTTP client writes itself (framing, the connection, the pinned Host: trainer.grading.url_policy) or that
# would route the request elsewhere: a tenant's value for them could break the request or the pinning.
_RESERVED_HEADERS = frozenset(
    {
        "host",
        "content-length",
        "content-type",
        "transfer-encoding",
        "connection",
        "keep-alive",
        "upgrade",
        "te",
        "trailer",
        "expect",
        "proxy-authorization",
        "proxy-connection",
    }
)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True, allow_inf_nan=False)


class TextPart(_Strict):
    """A text content block of a judge's input message (OpenAI's `input_text`, or `output_text` for an assistant's
    turn); its text is a template."""

    type: Literal["input_text", "output_text"]
    text: Template


_TEXT_PART_TYPES = ("input_text", "output_text")


def _content(value: Any) -> "str | TextPart | list[TextPart]":
    """A message's content, checked one way by its form (so that an error names one problem, not every form's):
    a template string, a text block, or a list of 1 to MAX_CONTENT_PARTS text blocks. The content blocks OpenAI also
    takes (input_image, input_audio) are refused: the judge here takes text."""
    if isinstance(value, str):
        if len(value) > MAX_TEMPLATE_CHARS:
            raise ValueError(f"longer than {MAX_TEMPLATE_CHARS} characters")
        return validate_template(value)
    if isinstance(value, TextPart):
        return value
    single = isinstance(value, dict)
    parts = [value] if single else value
    if not isinstance(parts, list) or not parts or len(parts) > MAX_CONTENT_PARTS:
        raise ValueError(f"expected a string, a text block or a list of 1 to {MAX_CONTENT_PARTS} text blocks")
    out: list[TextPart] = []
    for i, part in enumerate(parts):
        where = "" if single else f"[{i}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if isinstance(kind, str) and kind not in _TEXT_PART_TYPES:
            prefix = f"{where}: " if where else ""
            raise ValueError(
                f"{prefix}content blocks of type {kind!r} are not supported: this deployment's judge takes text "
                f"({', '.join(_TEXT_PART_TYPES)} blocks, or a string)"
            )
        try:
            out.append(TextPart.model_validate(part))
        except ValidationError as exc:
            first = exc.errors()[0]
            field = ".".join(str(x) for x in first["loc"])
            problem = str(first.get("ctx", {}).get("error", first["msg"]))
            raise ValueError(f"{where}{'.' if where and field else ''}{field}: {problem}") from None
    return out[0] if single else out


def _content_json(value: "str | TextPart | list[TextPart]") -> Any:
    if isinstance(value, str):
        return value
    if isinstance(value, TextPart):
        return value.model_dump()
    return [part.model_dump() for part in value]


class JudgeMessage(_Strict):
    """One message of a score_model or label_model grader's `input` (OpenAI's EvalItem): a role and a content that is
    a template string, a text block or a list of text blocks. `{{sample.output_text}}` is the sample to judge."""

    role: Literal["user", "assistant", "system", "developer"]
    content: Annotated[str | TextPart | list[TextPart], PlainValidator(_content), PlainSerializer(_content_json)]
    type: Literal["message"] | None = None

    @property
    def templates(self) -> tuple[str, ...]:
        if isinstance(self.content, str):
            return (self.content,)
        if isinstance(self.content, TextPart):
            return (self.content.text,)
        return tuple(part.text for part in self.content)


class SamplingParams(_Strict):
    """OpenAI's `sampling_params` of a score_model grader, sent to the judge as chat-completions parameters
    (`max_completions_tokens`, OpenAI's spelling, as `max_completion_tokens`)."""

    max_completions_tokens: int | None = Field(default=None, ge=1, le=MAX_JUDGE_TOKENS)
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    seed: int | None = Field(default=None, ge=-(2**63), lt=2**63)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)


def _model_name(value: str) -> str:
    if not value.strip():
        raise ValueError("the judge model's name is empty")
    return value


JudgeModelName = Annotated[str, StringConstraints(min_length=1, max_length=MAX_JUDGE_MODEL_CHARS)]


class ScoreModelGrader(GraderBase):
    """OpenAI's `score_model`: a judge model reads `input` (templates rendered against the sample and the item) and
    answers OpenAI's structured result `{"steps": [{"description", "conclusion"}, ...], "result": <number>}`; the
    score is `result`, which must lie in `range` (default [0, 1]).

    `model` names one of the judge models the deployment offers (`PROXIMA_JUDGE_MODELS`); the judge's URL is the
    deployment's, never the tenant's. An answer that does not parse, or a result outside `range`, scores 0.0 with a
    `model_grader_parse` error; a refusal `model_grader_refusal`; no answer after the retries `model_grader_server`.
    `pass_threshold` is accepted (OpenAI's evals have it) and does not change the score.
    """

    type: Literal["score_model"]
    model: JudgeModelName
    input: list[JudgeMessage] = Field(min_length=1, max_length=MAX_JUDGE_MESSAGES)
    range: list[float] = Field(default_factory=lambda: [0.0, 1.0])
    sampling_params: SamplingParams | None = None
    pass_threshold: float | None = Field(default=None, allow_inf_nan=False)

    @field_validator("model")
    @classmethod
    def _named(cls, value: str) -> str:
        return _model_name(value)

    @field_validator("range")
    @classmethod
    def _valid_range(cls, value: list[float]) -> list[float]:
        if len(value) != 2 or not value[0] < value[1]:
            raise ValueError(f"expected [low, high] with low < high, got {value}")
        return [float(v) for v in value]


class LabelModelGrader(GraderBase):
    """OpenAI's `label_model`: a judge model reads `input` and answers one of `labels` (structured output
    `{"steps": [...], "result": "<label>"}`); the score is 1.0 when that label is one of `passing_labels`, else 0.0.
    An answer that is not one of `labels` scores 0.0 with a `model_grader_parse` error."""

    type: Literal["label_model"]
    model: JudgeModelName
    input: list[JudgeMessage] = Field(min_length=1, max_length=MAX_JUDGE_MESSAGES)
    labels: list[Annotated[str, StringConstraints(min_length=1, max_length=MAX_LABEL_CHARS)]] = Field(
        min_length=1, max_length=MAX_LABELS
    )
    passing_labels: list[str] = Field(min_length=1, max_length=MAX_LABELS)

    @field_validator("model")
    @classmethod
    def _named(cls, value: str) -> str:
        return _model_name(value)

    @field_validator("labels")
    @classmethod
    def _distinct(cls, value: list[str]) -> list[str]:
        repeated = sorted({label for label in value if value.count(label) > 1})
        if repeated:
            raise ValueError(f"labels must be distinct; repeated: {repeated}")
        return value

    @field_validator("passing_labels")
    @classmethod
    def _subset(cls, value: list[str], info: ValidationInfo) -> list[str]:
        labels = info.data.get("labels")
        if labels is not None:  # else the labels failed validation and are reported on their own
            unknown = [label for label in value if label not in labels]
            if unknown:
                raise ValueError(f"{unknown} not among labels {labels}; passing_labels must be a subset of labels")
        return value


def _check_headers(value: dict[str, str] | None) -> dict[str, str] | None:
    if value is None:
        return value
    if len(value) > MAX_ENDPOINT_HEADERS:
        raise ValueError(f"at most {MAX_ENDPOINT_HEADERS} headers are allowed")
    for name, text in value.items():
        if len(name) > MAX_HEADER_NAME_CHARS or not _HEADER_NAME_RE.fullmatch(name):
            raise ValueError(f"{name[:40]!r} is not a valid header name")
        if name.lower() in _RESERVED_HEADERS or name.lower().startswith("proxy-"):
            raise ValueError(f"header {name!r} is set by the service and cannot be given")
        if len(text) > MAX_HEADER_VALUE_CHARS:
            raise ValueError(f"header {name!r}: its value is longer than {MAX_HEADER_VALUE_CHARS} characters")
        if not all(c == "\t" or " " <= c <= "~" for c in text):
            raise ValueError(f"header {name!r}: its value may hold printable ASCII characters only")
    return value


class EndpointGrader(GraderBase):
    """The `endpoint` grader of OpenAI's agent-RFT preview: the tenant's own grading service at `url`.

    Each sample is one `POST url` with JSON `{"sample": <OpenAI's sample object>, "item": <the dataset row>,
    "trace_id": "trace_<hex>"}` and `headers`, answered by `{"score": <number>}` (the score, not clipped). Requests
    start at most `rate_limit` per second (none: no limit beyond the deployment's concurrency). A sample whose request
    fails (timeout, connection error, HTTP 5xx or 429) is retried with backoff; after the retries, or on another HTTP
    error, it is discarded: scored 0.0 with an `endpoint_server` error; an answer that is not `{"score": number}` is an
    `endpoint_parse` error. `pass_threshold` is accepted as OpenAI has it and does not change the score.

    The URL must be `http(s)://`, without credentials or fragment; whether this deployment allows it (its scheme and
    the addresses its host resolves to: no internal addresses by default) is checked where the grader arrives and
    again at every batch (trainer.grading.url_policy).
    """

    type: Literal["endpoint"]
    url: str
    headers: dict[str, str] | None = None
    rate_limit: int | None = Field(default=None, ge=1, le=MAX_RATE_LIMIT)
    pass_threshold: float | None = Field(default=None, allow_inf_nan=False)

    @field_validator("url")
    @classmethod
    def _url_form(cls, value: str) -> str:
        try:
            urls.parse_url(value)
        except urls.UrlRefused as err:
            raise ValueError(str(err)) from None
        return value

    @field_validator("headers")
    @classmethod
    def _valid_headers(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        return _check_headers(value)

"""API schemas of evals, shaped as OpenAI's ``/v1/evals`` (``openai.types.eval_*`` and ``openai.types.evals``): the
request bodies (an eval, its update, a run), the data sources a run reads, and the objects answered (an eval, a run,
an output item, the deleted ones).

Bodies are strict (unknown fields refused, naming them); the parts whose shape depends on a ``type`` are parsed by the
service (``api.services.evals``) with the models below, so that an error names its full path
(``data_source.input_messages.template[0].content``) rather than a branch of a union."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from api.orm import Eval, EvalOutputItem, EvalRun
from api.schemas import _Request
from api.schemas_inference import Seed, Temperature, TokenCount, TopP
from api.status import EvalRunStatus

MAX_NAME_CHARS = 256
MAX_METADATA_PAIRS = 16
MAX_CRITERIA = 32
MAX_INLINE_ITEMS = 10_000
MAX_TEMPLATE_MESSAGES = 64
REPORT_PATH = "/dashboard/#/evals/{eval_id}/runs/{run_id}"
"""A run's page in the dashboard (``api.routes.dashboard`` serves it; ``api/static/js/evals.js`` routes it)."""


def check_metadata(value: dict[str, str] | None) -> dict[str, str] | None:
    """OpenAI's metadata limits: at most 16 pairs, keys of 1 to 64 characters, values of at most 512."""
    if value is None:
        return None
    if len(value) > MAX_METADATA_PAIRS:
        raise ValueError(f"at most {MAX_METADATA_PAIRS} pairs; got {len(value)}")
    for key, item in value.items():
        if not key or len(key) > 64:
            raise ValueError(f"key {key[:70]!r}: keys are 1 to 64 characters")
        if len(item) > 512:
            raise ValueError(f"value of {key!r}: values are at most 512 characters")
    return value


Metadata = Annotated[dict[str, str] | None, AfterValidator(check_metadata), Field(description="up to 16 string pairs")]


class EvalCreate(_Request):
    name: str | None = Field(None, min_length=1, max_length=MAX_NAME_CHARS)
    metadata: Metadata = None
    data_source_config: dict[str, Any] = Field(
        description="`{type: custom, item_schema, include_sample_schema}`: the JSON schema of a data source's items"
    )
    testing_criteria: list[dict[str, Any]] = Field(
        min_length=1,
        max_length=MAX_CRITERIA,
        description="graders, each with a `name` (distinct); `pass_threshold` where the grader scores a range",
    )


class EvalUpdate(_Request):
    name: str | None = Field(None, min_length=1, max_length=MAX_NAME_CHARS)
    metadata: Metadata = None


class RunCreate(_Request):
    name: str | None = Field(None, min_length=1, max_length=MAX_NAME_CHARS)
    metadata: Metadata = None
    data_source: dict[str, Any] = Field(description="`jsonl` (items graded as they are) or `completions` (sampled)")


# -- the parts parsed by the service ------------------------------------------------------------------------------


class _Part(BaseModel):
    model_config = ConfigDict(extra="forbid")


class CustomDataSourceConfig(_Part):
    type: Literal["custom"]
    item_schema: dict[str, Any]
    include_sample_schema: bool = False


class ContentRow(_Part):
    item: dict[str, Any]
    sample: dict[str, Any] | None = None


class FileContentSource(_Part):
    type: Literal["file_content"]
    content: list[ContentRow] = Field(min_length=1, max_length=MAX_INLINE_ITEMS)


class FileIdSource(_Part):
    type: Literal["file_id"]
    id: str = Field(min_length=1, max_length=64)


class TextContent(_Part):
    type: Literal["input_text", "output_text"]
    text: str


class TemplateMessage(_Part):
    """A message of a template: OpenAI's ``{role, content}`` or ``{type: message, role, content}``; the content a
    string or one text part (images and audio are not sampled here)."""

    type: Literal["message"] | None = None
    role: Literal["system", "developer", "user", "assistant"]
    content: str | TextContent

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else self.content.text


class TemplateInput(_Part):
    type: Literal["template"]
    template: list[TemplateMessage] = Field(min_length=1, max_length=MAX_TEMPLATE_MESSAGES)


class ItemReferenceInput(_Part):
    type: Literal["item_reference"]
    item_reference: str = Field(min_length=1, description="`item.<path>`: a list of {role, content} messages")


class SamplingParams(_Part):
    temperature: Temperature | None = None
    top_p: TopP | None = None
    max_completion_tokens: TokenCount | None = None
    seed: Seed | None = None


class JsonlDataSource(_Part):
    type: Literal["jsonl"]
    source: dict[str, Any]


class CompletionsDataSource(_Part):
    type: Literal["completions"]
    source: dict[str, Any]
    input_messages: dict[str, Any]
    model: str = Field(min_length=1, max_length=512)
    sampling_params: SamplingParams | None = None


# -- answers --------------------------------------------------------------------------------------------------


class EvalAPIError(BaseModel):
    code: str
    message: str


class ResultCounts(BaseModel):
    total: int
    errored: int
    failed: int
    passed: int


class PerTestingCriteriaResult(BaseModel):
    testing_criteria: str
    passed: int
    failed: int


class PerModelUsage(BaseModel):
    model_name: str
    invocation_count: int
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    cached_tokens: int


class EvalObject(BaseModel):
    id: str
    object: Literal["eval"] = "eval"
    name: str
    data_source_config: dict[str, Any]
    testing_criteria: list[dict[str, Any]]
    created_at: int
    metadata: dict[str, str] | None

    @classmethod
    def from_row(cls, row: Eval, *, data_source_config: dict[str, Any], criteria: list[dict[str, Any]]) -> EvalObject:
        return cls(
            id=row.id,
            name=row.name,
            data_source_config=data_source_config,
            testing_criteria=criteria,
            created_at=row.created_at,
            metadata=row.metadata_,
        )


class EvalDeleted(BaseModel):
    object: Literal["eval.deleted"] = "eval.deleted"
    deleted: bool = True
    eval_id: str


class EvalRunObject(BaseModel):
    id: str
    object: Literal["eval.run"] = "eval.run"
    eval_id: str
    name: str
    status: EvalRunStatus
    model: str | None
    data_source: dict[str, Any]
    created_at: int
    metadata: dict[str, str] | None
    error: EvalAPIError | None
    result_counts: ResultCounts
    per_testing_criteria_results: list[PerTestingCriteriaResult] = Field(description="counted when the run ends")
    per_model_usage: list[PerModelUsage] | None = Field(
        description="the sampled model's token counts as the inference server reported them (completions runs)"
    )
    report_url: str = Field(description="the run's page in the dashboard (an absolute URL on this API's host)")

    @classmethod
    def from_row(cls, row: EvalRun, *, base_url: str) -> EvalRunObject:
        """``base_url``: the API's address as the request reached it (``request.base_url``)."""
        counts = row.result_counts or {"total": 0, "errored": 0, "failed": 0, "passed": 0}
        per_criteria = row.per_testing_criteria_results or []
        return cls(
            id=row.id,
            eval_id=row.eval_id,
            name=row.name,
            status=EvalRunStatus(row.status),
            model=row.model,
            data_source=row.data_source,
            created_at=row.created_at,
            metadata=row.metadata_,
            error=EvalAPIError(**row.error) if row.error else None,
            result_counts=ResultCounts(**counts),
            per_testing_criteria_results=[PerTestingCriteriaResult(**r) for r in per_criteria],
            per_model_usage=None if row.per_model_usage is None else [PerModelUsage(**u) for u in row.per_model_usage],
            report_url=base_url.rstrip("/") + REPORT_PATH.format(eval_id=row.eval_id, run_id=row.id),
        )


class EvalRunDeleted(BaseModel):
    object: Literal["eval.run.deleted"] = "eval.run.deleted"
    deleted: bool = True
    run_id: str


class OutputItemObject(BaseModel):
    id: str
    object: Literal["eval.run.output_item"] = "eval.run.output_item"
    run_id: str
    eval_id: str
    created_at: int
    status: Literal["pass", "fail"]
    datasource_item_id: int
    datasource_item: dict[str, Any]
    results: list[dict[str, Any]] = Field(description="per criterion: name, type, score, passed, sample, errors")
    sample: dict[str, Any] | None = Field(
        description="the completion (completions runs), or the row's own sample (jsonl: null when it has none)"
    )

    @classmethod
    def from_row(cls, row: EvalOutputItem) -> OutputItemObject:
        return cls(
            id=row.id,
            run_id=row.run_id,
            eval_id=row.eval_id,
            created_at=row.created_at,
            status=row.status,  # type: ignore[arg-type]
            datasource_item_id=row.datasource_item_id,
            datasource_item=row.datasource_item,
            results=row.results,
            sample=row.sample or None,  # stored {} when a jsonl row has no sample
        )

"""The schemas of ``POST /v1/chat/completions`` and ``POST /v1/completions``: OpenAI's parameters, strict on input.

The API validates every parameter before it forwards a request to the inference server (``api.services.inference``):
an unknown parameter, a value of the wrong type or out of OpenAI's range is a 400 naming it (``param``), whichever
server (``proxima inference`` or vLLM) stands behind. The answers are the server's, passed through with ``model``
rewritten (not validated again); ``proxima inference`` builds its answers with the response models here, and takes
the same requests, with its adapter endpoints' bodies besides.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    TypeAdapter,
    ValidationError,
    ValidatorFunctionWrapHandler,
    field_validator,
    model_validator,
)
from pydantic_core import InitErrorDetails, PydanticCustomError

from api.schemas import _Request

INT64_MAX = 2**63 - 1
MAX_STOP = 4  # OpenAI's limit on stop sequences

Temperature = Annotated[float, Field(ge=0, le=2, description="0: greedy (argmax) decoding")]
TopP = Annotated[float, Field(gt=0, le=1, description="nucleus sampling: the smallest set of tokens of this mass")]
TokenCount = Annotated[int, Field(ge=1, le=2**31 - 1)]
N = Annotated[int, Field(ge=1, le=128, description="completions sampled for the prompt")]
Seed = Annotated[
    int, Field(ge=-(2**63), le=INT64_MAX, description="the same seed and parameters sample the same completions")
]
StopList = Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1, max_length=MAX_STOP)]
Stop = Annotated[
    str | StopList,
    Field(description=f"a string, or a list of up to {MAX_STOP}, where sampling stops (not in the text)"),
]


def _invalid(model: str, loc: tuple[str, ...], message: str) -> ValidationError:
    """A validation error located at ``loc``, so that the 400's ``param`` names the parameter."""
    error = PydanticCustomError("invalid_value", message)
    return ValidationError.from_exception_data(model, [InitErrorDetails(type=error, loc=loc, input=None)])


def _string_or_list(value: Any, items: TypeAdapter[Any], what: str) -> Any:
    """A ``str | list[...]`` field validated by hand: pydantic's union would name each branch in the error's
    location (``stop.str``, ``stop.list[...]``), where the 400's ``param`` must be the field itself."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        return items.validate_python(value)  # its errors keep their place in the list (``stop.2``)
    raise PydanticCustomError("invalid_type", f"expected {what}")


class StreamOptions(_Request):
    include_usage: bool | None = Field(None, description="a last chunk carries the request's `usage` (no choices)")
    include_obfuscation: bool | None = Field(None, description="accepted, as OpenAI's clients may send it; unused")


class TextPart(_Request):
    """A text content part (``{"type": "text", "text": ...}``); images and audio are not supported."""

    type: Literal["text"]
    text: str


class ChatMessage(_Request):
    """A message of the conversation, rendered through the base model's chat template."""

    role: Literal["system", "developer", "user", "assistant"]
    content: str | Annotated[list[TextPart], Field(min_length=1)]
    name: str | None = Field(None, max_length=256)

    @field_validator("content", mode="wrap")
    @classmethod
    def _content(cls, value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        return _string_or_list(value, _TEXT_PARTS, "a string or a list of text parts")

    def text(self) -> str:
        """The content as one string (text parts joined by newlines, as vLLM joins them)."""
        return self.content if isinstance(self.content, str) else "\n".join(p.text for p in self.content)


_TEXT_PARTS: TypeAdapter[list[TextPart]] = TypeAdapter(Annotated[list[TextPart], Field(min_length=1)])
_STOP_LIST: TypeAdapter[list[str]] = TypeAdapter(StopList)


class _Sampling(_Request):
    """The parameters both endpoints share."""

    model: str = Field(
        description="a base model offered (`GET /v1/models`), an `ft:…` model or a checkpoint's "
        "`fine_tuned_model_checkpoint` (`ft:…:ckpt-step-N`)"
    )
    temperature: Temperature | None = None
    top_p: TopP | None = None
    max_tokens: TokenCount | None = None
    n: N | None = None
    stop: Stop | None = None
    seed: Seed | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    user: str | None = Field(None, max_length=512, description="accepted and ignored")

    @field_validator("stop", mode="wrap")
    @classmethod
    def _stop(cls, value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        return (
            None
            if value is None
            else _string_or_list(value, _STOP_LIST, f"a string or a list of 1 to {MAX_STOP} strings")
        )

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> _Sampling:
        if self.stream_options is not None and not self.stream:
            raise _invalid(
                type(self).__name__, ("stream_options",), "stream_options is only allowed when stream is true"
            )
        return self

    def stops(self) -> tuple[str, ...]:
        """The stop sequences as a tuple (none, one or several)."""
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    def forwarded(self, *, served: str) -> dict[str, Any]:
        """The body for the inference server: the parameters the client set (nulls dropped), ``model`` the
        server's name for it."""
        body = self.model_dump(exclude_none=True)
        body["model"] = served
        return body


class ChatCompletionRequest(_Sampling):
    """``POST /v1/chat/completions``: OpenAI's parameters that Proxima serves; any other is a 400 naming it."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: TokenCount | None = Field(None, description="the newer name of max_tokens")
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise _invalid(type(self).__name__, ("top_logprobs",), "top_logprobs requires logprobs to be true")
        return self

    def forwarded(self, *, served: str) -> dict[str, Any]:
        body = super().forwarded(served=served)
        body["messages"] = [
            {"role": m.role, "content": m.text(), **({"name": m.name} if m.name is not None else {})}
            for m in self.messages
        ]
        return body


class CompletionRequest(_Sampling):
    """``POST /v1/completions``: a plain prompt, no chat template."""

    prompt: str
    logprobs: (
        Annotated[int, Field(ge=0, le=5, description="the most likely tokens' log probabilities to add")] | None
    ) = None


# -- the inference server's adapters (vLLM's dynamic LoRA endpoints; the API calls them, clients never do) -------


class LoadLoraAdapterRequest(_Request):
    """``POST /v1/load_lora_adapter``: ``lora_path`` an artifact-store key of an adapter archive or an absolute path
    to an adapter folder; ``base_model_name`` may be left out where the server has one base model."""

    lora_name: str = Field(min_length=1, max_length=512)
    lora_path: str = Field(min_length=1, max_length=4096)
    base_model_name: str | None = None


class UnloadLoraAdapterRequest(_Request):
    """``POST /v1/unload_lora_adapter``."""

    lora_name: str = Field(min_length=1)
    lora_int_id: int | None = Field(None, description="vLLM's; ignored")


# -- answers (the inference server builds them; the API passes its JSON through) ---------------------------------


class _Answer(BaseModel):
    model_config = ConfigDict(extra="allow")


class Usage(_Answer):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class AssistantMessage(_Answer):
    role: Literal["assistant"] = "assistant"
    content: str | None
    refusal: str | None = None


class ChatChoice(_Answer):
    index: int
    message: AssistantMessage
    logprobs: dict[str, Any] | None = None
    finish_reason: Literal["stop", "length"]


class ChatCompletion(_Answer):
    """OpenAI's ``chat.completion``; with ``stream: true`` the answer is ``text/event-stream``: one
    ``chat.completion.chunk`` per ``data:`` line, then ``data: [DONE]``."""

    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str = Field(description="the model as the request named it")
    choices: list[ChatChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None


class CompletionChoice(_Answer):
    index: int
    text: str
    logprobs: dict[str, Any] | None = None
    finish_reason: Literal["stop", "length"]


class Completion(_Answer):
    """OpenAI's ``text_completion``; streamed as ``text_completion`` chunks like chat completions."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None

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
    ValidationInfo,
    ValidatorFunctionWrapHandler,
    field_validator,
    model_validator,
)
from pydantic_core import InitErrorDetails, PydanticCustomError

from api.schemas import _Request
from trainer.spec.response_format import ResponseFormat, check_schema, check_strict

INT64_MAX = 2**63 - 1
MAX_STOP = 4  # OpenAI's limit on stop sequences
MAX_TOOLS = 128  # OpenAI's limit on a request's tools
FUNCTION_NAME = r"^[A-Za-z0-9_-]{1,64}$"  # OpenAI's function names

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


def _invalid(model: str, loc: tuple[str | int, ...], message: str) -> ValidationError:
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


class CalledFunction(_Request):
    name: str = Field(pattern=FUNCTION_NAME)
    arguments: str = Field(description="the arguments as JSON text, as the model wrote them")


class MessageToolCall(_Request):
    """A tool call of an earlier assistant turn, as a client sends it back (``message.tool_calls`` of an answer)."""

    id: str = Field(min_length=1, max_length=256)
    type: Literal["function"]
    function: CalledFunction


class ChatMessage(_Request):
    """A message of the conversation, rendered through the base model's chat template. An assistant turn may hold
    ``tool_calls`` (its ``content`` then may be null); a ``tool`` message answers one of them (``tool_call_id``)."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | Annotated[list[TextPart], Field(min_length=1)] | None
    name: str | None = Field(None, max_length=256)
    tool_calls: Annotated[list[MessageToolCall], Field(min_length=1)] | None = None
    tool_call_id: str | None = Field(None, min_length=1, max_length=256)

    @field_validator("content", mode="wrap")
    @classmethod
    def _content(cls, value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        return None if value is None else _string_or_list(value, _TEXT_PARTS, "a string or a list of text parts")

    @model_validator(mode="after")
    def _roles(self) -> ChatMessage:
        name = type(self).__name__
        if self.tool_calls is not None and self.role != "assistant":
            raise _invalid(name, ("tool_calls",), "only assistant messages hold tool_calls")
        if self.content is None and self.tool_calls is None:
            raise _invalid(name, ("content",), "content may be null only in an assistant message with tool_calls")
        if self.role == "tool" and self.tool_call_id is None:
            raise _invalid(name, ("tool_call_id",), "a tool message needs the tool_call_id it answers")
        if self.role != "tool" and self.tool_call_id is not None:
            raise _invalid(name, ("tool_call_id",), "only tool messages have a tool_call_id")
        return self

    def text(self) -> str:
        """The content as one string (text parts joined by newlines, as vLLM joins them; '' for none)."""
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "\n".join(p.text for p in self.content)

    def rendered(self) -> dict[str, Any]:
        """The message as chat templates take it and as it is forwarded (OpenAI's shape: tool calls with their
        arguments as JSON text)."""
        # a null content (a turn of calls alone) renders as '': templates test it for truth, and simple ones would
        # print None
        out: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.name is not None:
            out["name"] = self.name
        if self.tool_calls is not None:
            out["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


class FunctionDefinition(_Request):
    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    # ``strict`` before ``parameters``: their validator reads it (OpenAI's strict-mode rules), its errors located there
    strict: bool | None = None
    parameters: dict[str, Any] | None = Field(None, description="a JSON schema of the arguments (an object)")

    @field_validator("parameters")
    @classmethod
    def _schema(cls, value: dict[str, Any] | None, info: ValidationInfo) -> dict[str, Any] | None:
        if value is None:
            return None
        check_schema(value)
        return check_strict(value) if info.data.get("strict") else value


class FunctionTool(_Request):
    """OpenAI's function tool: rendered by the model's chat template, its calls parsed from the model's answer."""

    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Request):
    name: str


class NamedToolChoice(_Request):
    """``{"type": "function", "function": {"name": ...}}``: the model must call that tool."""

    type: Literal["function"]
    function: NamedFunction


TOOL_CHOICES = ("none", "auto", "required")
ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


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
    tools: Annotated[list[FunctionTool], Field(min_length=1, max_length=MAX_TOOLS)] | None = None
    tool_choice: ToolChoice | None = Field(
        None, description="`auto` (the default with tools), `none`, `required` or one named function"
    )
    parallel_tool_calls: bool | None = Field(None, description="false: at most one call a turn")
    response_format: ResponseFormat = Field(
        None, description="`text`, `json_object` or `json_schema`: JSON enforced by constrained decoding"
    )

    @field_validator("tool_choice", mode="wrap")
    @classmethod
    def _tool_choice(cls, value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        if value is None or isinstance(value, NamedToolChoice):
            return value
        if isinstance(value, str):
            if value not in TOOL_CHOICES:
                raise PydanticCustomError("invalid_value", f"expected one of {', '.join(TOOL_CHOICES)} or a function")
            return value
        return NamedToolChoice.model_validate(value)  # its errors keep their place (``tool_choice.function.name``)

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise _invalid(type(self).__name__, ("top_logprobs",), "top_logprobs requires logprobs to be true")
        return self

    @model_validator(mode="after")
    def _tools_agree(self) -> ChatCompletionRequest:
        name = type(self).__name__
        names = [t.function.name for t in self.tools or []]
        for i, n in enumerate(names):
            if n in names[:i]:
                raise _invalid(name, ("tools", i, "function", "name"), f"the tool {n!r} is defined twice")
        if self.tools is None:
            for field in ("tool_choice", "parallel_tool_calls"):
                if getattr(self, field) is not None:
                    raise _invalid(name, (field,), f"{field} is only allowed when tools are specified")
        if isinstance(self.tool_choice, NamedToolChoice) and self.tool_choice.function.name not in names:
            message = f"the function {self.tool_choice.function.name!r} is not among the tools"
            raise _invalid(name, ("tool_choice", "function", "name"), message)
        return self

    @model_validator(mode="after")
    def _tool_messages_answer_calls(self) -> ChatCompletionRequest:
        """Each tool message answers a call of the assistant turn before it (OpenAI refuses any other)."""
        open_calls: set[str] = set()
        for i, m in enumerate(self.messages):
            if m.role == "assistant":
                open_calls = {c.id for c in m.tool_calls or []}
            elif m.role == "tool":
                if m.tool_call_id not in open_calls:
                    message = f"{m.tool_call_id!r} is not the id of a tool call of the assistant message before it"
                    raise _invalid(type(self).__name__, ("messages", i, "tool_call_id"), message)
            else:
                open_calls = set()
        return self

    def tool_mode(self) -> str | None:
        """What the tools are for: None without tools, else ``auto``, ``none``, ``required`` or ``named``."""
        if self.tools is None:
            return None
        if isinstance(self.tool_choice, NamedToolChoice):
            return "named"
        return self.tool_choice or "auto"

    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tools as chat templates take them (OpenAI's shape)."""
        return None if self.tools is None else [t.model_dump(exclude_none=True) for t in self.tools]

    def forwarded(self, *, served: str) -> dict[str, Any]:
        body = super().forwarded(served=served)
        body["messages"] = [m.rendered() for m in self.messages]
        if self.response_format is not None:  # by its alias: json_schema's `schema`
            body["response_format"] = self.response_format.model_dump(by_alias=True, exclude_none=True)
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
    tool_calls: list[dict[str, Any]] | None = Field(
        None, description='[{"id": "call_…", "type": "function", "function": {"name", "arguments": JSON text}}]'
    )


ChatFinishReason = Literal["stop", "length", "tool_calls"]


class ChatChoice(_Answer):
    index: int
    message: AssistantMessage
    logprobs: dict[str, Any] | None = None
    finish_reason: ChatFinishReason


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

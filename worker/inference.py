"""``proxima inference``: the inference server, a process of its own that imports torch.

It speaks the subset of vLLM's OpenAI-compatible API that the internal inference contract names, so that the API can
point ``PROXIMA_INFERENCE_URL`` at it or at vLLM: ``GET /health``, ``GET /v1/models``, ``POST /v1/load_lora_adapter``
and ``/v1/unload_lora_adapter``, ``POST /v1/chat/completions`` and ``/v1/completions`` in OpenAI's shapes (streamed
as server-sent events with ``stream: true``), errors in OpenAI's envelope. The work is ``trainer.serving.inference``'s
engine; the bodies and answers are the API's schemas (``api.schemas_inference``) and the errors are rendered by
``api.errors``: this module parses, checks and renders.

Chat completions take OpenAI's ``tools`` (rendered by the model's chat template), ``tool_choice`` and
``parallel_tool_calls``, and ``response_format``: the answer's tool calls are parsed in the model family's syntax
(``trainer.agents.tool_calls``) into ``message.tool_calls`` (finish_reason ``tool_calls``, or ``stop`` where
``tool_choice`` names the function, as OpenAI's; streamed as OpenAI streams them, once the turn has ended), and a
forced call (``required``, a named function), a forbidden one (``none``) or JSON (``json_object``, ``json_schema``)
is enforced by constrained decoding (``trainer.generation.constrained``).

Adapters are registered by name with ``lora_path`` either an artifact-store key of a PEFT adapter ``.tar.gz``
archive (fetched from ``PROXIMA_ARTIFACTS`` and extracted once into ``<PROXIMA_HOME>/inference/adapters/``: store
keys never change content) or an absolute path to an adapter folder. When ``PROXIMA_INFERENCE_API_KEY`` is set, every
request but ``GET /health`` needs it as a bearer token.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import hmac
import json
import logging
import sys
import tarfile
import tempfile
import time
import uuid
import warnings
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Annotated, Any, TypeVar

import uvicorn
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from transformers.utils import logging as hf_logging

from api import errors
from api import schemas_inference as schemas
from api.errors import ApiError, Internal, InvalidRequest, ModelNotFound, Unauthorized, Unavailable
from api.schemas_inference import (
    ChatCompletionRequest,
    CompletionRequest,
    LoadLoraAdapterRequest,
    UnloadLoraAdapterRequest,
)
from api.settings import Settings
from api.storage import ArtifactStore, NotFound, StorageError, validate_key
from trainer.agents.tool_calls import (
    ToolCall,
    ToolCallFormatError,
    ToolCallParser,
    ToolChoiceUnsupported,
    call_grammar,
    call_markers,
)
from trainer.generation.constrained import Grammar, GrammarError, response_grammar, text_without
from trainer.generation.models import ModelError, default_device, resolve_precision
from trainer.serving.inference import (
    Completion,
    EngineError,
    Event,
    Failed,
    Finished,
    FinishReason,
    InferenceEngine,
    Progress,
    Sampling,
    Ticket,
    TokenLogprob,
    UnknownModel,
)
from worker.errors import JobError
from worker.models import resolve_model, store_for

log = logging.getLogger("proxima.inference")
T = TypeVar("T")

ADAPTER_CACHE = "inference/adapters"  # under PROXIMA_HOME: extracted adapter archives, one folder per store key

SamplingRequest = ChatCompletionRequest | CompletionRequest


# -- adapters from the artifact store ----------------------------------------------------------------------------


def fetch_adapter(store: ArtifactStore, key: str, cache: Path) -> Path:
    """The adapter archive at store ``key`` extracted under ``cache`` (once: a store key never changes content).
    Extraction refuses absolute paths, ``..``, links leaving the folder and special files (tarfile's ``data``
    filter); the archive must hold ``adapter_config.json`` at its top level."""
    try:
        validate_key(key)
    except ValueError as err:
        raise InvalidRequest(f"lora_path: {err}", param="lora_path") from None
    dest = cache / hashlib.sha256(key.encode()).hexdigest()[:32]
    if (dest / "adapter_config.json").is_file():
        return dest
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache, prefix=".fetch-") as tmp:
        archive = Path(tmp) / "adapter.tar.gz"
        try:
            store.get_to_path(key, archive)
        except NotFound:
            raise InvalidRequest(f"lora_path: no adapter archive at {key!r}", param="lora_path") from None
        out = Path(tmp) / "adapter"
        out.mkdir()
        try:
            with tarfile.open(archive) as tar:
                tar.extractall(out, filter="data")
        except (tarfile.TarError, OSError, EOFError) as err:
            message = f"lora_path: {key!r} is not a readable adapter archive: {err}"
            raise InvalidRequest(message, param="lora_path") from None
        if not (out / "adapter_config.json").is_file():
            raise InvalidRequest(f"lora_path: {key!r} holds no adapter_config.json", param="lora_path")
        with contextlib.suppress(OSError):  # another request extracted it meanwhile: theirs is as good
            out.rename(dest)
    return dest


# -- what the routes share ---------------------------------------------------------------------------------------


class Server:
    """The engine and what the routes share: the names of the models and adapters a request may use, and the
    engine's sampling parameters for a request."""

    def __init__(
        self,
        settings: Settings,
        engine: InferenceEngine,
        store: ArtifactStore | None,
        *,
        unavailable: dict[str, str] | None = None,
    ) -> None:
        self.settings, self.engine, self.store = settings, engine, store
        self.adapter_cache = settings.home / ADAPTER_CACHE
        self.unavailable = unavailable or {}  # offered base models this server cannot load, and why
        key = settings.inference_api_key
        self.api_key = key.get_secret_value() if key is not None else None

    def no_model(self, name: str) -> str:
        if name in self.unavailable:
            return f"The model `{name}` is not available on this inference server: {self.unavailable[name]}"
        return f"The model `{name}` does not exist."

    def base_of(self, model: str) -> str:
        """The base model that serves ``model`` (a base model or a registered adapter)."""
        try:
            base, _ = self.engine.resolve(model)
        except UnknownModel:
            raise ModelNotFound(self.no_model(model)) from None
        return base

    def adapter_base(self, name: str | None) -> str:
        """The base model an adapter is registered on: the one named, or the server's only one."""
        names = self.engine.base_names()
        if name is None:
            if len(names) != 1:
                message = "base_model_name is required: this server has several base models"
                raise InvalidRequest(message, param="base_model_name")
            return names[0]
        if name not in names:
            raise ModelNotFound(self.no_model(name), param="base_model_name")
        return name

    async def adapter_path(self, lora_path: str) -> Path:
        """The adapter folder ``lora_path`` names: an absolute path to one, or an archive's key in the store."""
        path = Path(lora_path)
        if path.is_absolute():
            if not (path / "adapter_config.json").is_file():
                raise InvalidRequest(f"lora_path: no PEFT adapter (adapter_config.json) in {path}", param="lora_path")
            return path
        if self.store is None:
            raise InvalidRequest("lora_path: this server has no artifact store", param="lora_path")
        try:
            return await asyncio.to_thread(fetch_adapter, self.store, lora_path, self.adapter_cache)
        except StorageError as err:
            log.error("inference: artifact store failed fetching %s: %s", lora_path, err)
            raise Unavailable("the artifact store is unavailable; retry later", code="service_unavailable") from None

    def sampling(
        self, body: SamplingRequest, base: str, prompt: list[int], max_tokens: int | None, what: str
    ) -> Sampling:
        """The engine's sampling parameters; a prompt that with ``max_tokens`` exceeds the context is a 400 naming
        ``what`` (the messages or the prompt), as OpenAI's is."""
        budget = _engine_call(lambda: self.engine.fit(base, len(prompt), max_tokens, param=what))
        return Sampling(
            max_tokens=budget,
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            n=body.n or 1,
            stop=body.stops(),
            seed=body.seed,
        )

    def chat_constraints(self, body: ChatCompletionRequest, base: str) -> tuple[Grammar | None, ToolCallParser | None]:
        """What the request's choices may write (a grammar, with the parameter that asked for it set as
        ``grammar_param`` by the caller) and the parser of their tool calls (None: they are not parsed).

        ``tool_choice``: ``auto`` leaves the model free and parses its calls; ``required`` and a named function
        force a call by a grammar of the model's call syntax; ``none`` renders the tools, as vLLM does, and forbids
        the text that opens a call (in any tokens), so the model answers in text. ``response_format`` JSON is a
        grammar of its own, so it goes with tools only under ``tool_choice: none``."""
        mode = body.tool_mode()
        parser = _engine_call(lambda: self.engine.tool_parser(base)) if mode is not None else None
        grammar = response_grammar(body.response_format)
        if grammar is not None:
            if mode not in (None, "none"):
                message = "response_format JSON cannot be combined with tool calls: set tool_choice to none"
                raise InvalidRequest(message, param="response_format")
            return grammar, None
        if parser is None or mode == "auto":
            return None, parser
        if mode == "none":
            markers = call_markers(parser)
            return (text_without(markers) if markers else None), None
        assert body.tools is not None
        named = body.tool_choice.function.name if isinstance(body.tool_choice, schemas.NamedToolChoice) else None
        tools = body.template_tools() or []
        try:
            return call_grammar(parser, tools, name=named, parallel=body.parallel_tool_calls is not False), parser
        except (ToolChoiceUnsupported, GrammarError) as err:
            raise InvalidRequest(f"tool_choice cannot be enforced for this model: {err}", param="tool_choice") from None


def _engine_call(fn: Callable[[], T]) -> T:
    """An engine call with its refusals as the API's errors (unknown model 404, bad input 400)."""
    try:
        return fn()
    except UnknownModel as err:
        raise ModelNotFound(err.message, param=err.param) from None
    except EngineError as err:
        raise InvalidRequest(err.message, param=err.param, code=err.code) from None
    except ModelError as err:
        raise Unavailable(str(err), code="model_not_available") from None


def _with_logprobs(sampling: Sampling, logprobs: bool, top: int) -> Sampling:
    return dataclasses.replace(sampling, logprobs=logprobs, top_logprobs=top if logprobs else 0)


def _server(request: Request) -> Server:
    server: Server = request.app.state.server
    return server


ServerDep = Annotated[Server, Depends(_server)]


def _authorized(request: Request, server: ServerDep) -> None:
    """With ``PROXIMA_INFERENCE_API_KEY`` set, a request needs it as its bearer token."""
    if server.api_key is None:
        return
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), server.api_key.encode()):
        raise Unauthorized("Incorrect API key provided.", code="invalid_api_key")


# -- the routes ---------------------------------------------------------------------------------------------------

public = APIRouter()
router = APIRouter(dependencies=[Depends(_authorized)])


@public.get("/health")
async def health(server: ServerDep) -> JSONResponse:
    if not server.engine.ready:
        return JSONResponse({"status": "starting"}, status_code=503)
    return JSONResponse({"status": "ok"})


@router.get("/v1/models")
async def models(server: ServerDep) -> dict[str, Any]:
    engine = server.engine
    data = [
        {"id": n, "object": "model", "created": engine.started, "owned_by": "proxima", "root": n, "parent": None}
        for n in engine.base_names()
    ]
    data += [
        {"id": a.name, "object": "model", "created": a.created, "owned_by": "proxima", "root": a.base, "parent": a.base}
        for a in engine.adapters()
    ]
    return {"object": "list", "data": data}


@router.post("/v1/load_lora_adapter")
async def load_lora_adapter(body: LoadLoraAdapterRequest, server: ServerDep) -> dict[str, Any]:
    base = server.adapter_base(body.base_model_name)
    path = await server.adapter_path(body.lora_path)
    _engine_call(lambda: server.engine.register_adapter(body.lora_name, base=base, path=path))
    return {"lora_name": body.lora_name}


@router.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(body: UnloadLoraAdapterRequest, server: ServerDep) -> dict[str, Any]:
    _engine_call(lambda: server.engine.unregister_adapter(body.lora_name))
    return {"lora_name": body.lora_name}


@router.post("/v1/chat/completions", response_model=None)
async def chat_completions(body: ChatCompletionRequest, server: ServerDep) -> StreamingResponse | dict[str, Any]:
    base = server.base_of(body.model)
    try:  # off the loop: the tokenizer's parser and a schema's grammar can take a while to build
        grammar, parser = await asyncio.to_thread(server.chat_constraints, body, base)
    except GrammarError as err:  # a schema the API's checks let through and the matcher refuses
        raise InvalidRequest(f"response_format: {err}", param="response_format") from None
    messages, tools = [m.rendered() for m in body.messages], body.template_tools()
    prompt = await asyncio.to_thread(_engine_call, lambda: server.engine.encode_chat(base, messages, tools=tools))
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    sampling = server.sampling(body, base, prompt, max_tokens, "messages")
    sampling = _with_logprobs(sampling, bool(body.logprobs), body.top_logprobs or 0)
    param = "tool_choice" if body.response_format is None else "response_format"
    keep = call_markers(parser) if parser is not None else ()  # the parser needs its markers, special tokens or not
    sampling = dataclasses.replace(sampling, grammar=grammar, grammar_param=param, keep_special=keep)
    # OpenAI ends a turn that tool_choice forced to name a function with "stop", any other call with "tool_calls"
    calls: schemas.ChatFinishReason = "stop" if body.tool_mode() == "named" else "tool_calls"
    return await _respond(server, body, prompt, sampling, chat=True, parser=parser, call_finish=calls)


@router.post("/v1/completions", response_model=None)
async def completions(body: CompletionRequest, server: ServerDep) -> StreamingResponse | dict[str, Any]:
    base = server.base_of(body.model)
    prompt = await asyncio.to_thread(_engine_call, lambda: server.engine.encode_text(base, body.prompt))
    sampling = server.sampling(body, base, prompt, body.max_tokens, "prompt")
    if body.logprobs is not None:
        sampling = _with_logprobs(sampling, True, body.logprobs)
    return await _respond(server, body, prompt, sampling, chat=False)


# -- answers ------------------------------------------------------------------------------------------------------


def _failure(ev: Failed) -> ApiError:
    """What a request that could not run answers: a bad adapter is the request's model (400), a base model that
    does not load or a closing server a 503, a bug a 500."""
    if ev.kind == "adapter":
        return InvalidRequest(ev.message, param="model", code="adapter_not_loadable")
    if ev.kind == "internal":
        return Internal(ev.message)
    return Unavailable(ev.message, code="model_not_available" if ev.kind == "model" else "shutting_down")


def _usage(prompt_tokens: int, completion_tokens: int) -> schemas.Usage:
    return schemas.Usage(
        prompt_tokens=prompt_tokens, completion_tokens=completion_tokens, total_tokens=prompt_tokens + completion_tokens
    )


def _chat_logprobs(entries: list[TokenLogprob]) -> dict[str, Any]:
    return {
        "content": [
            {
                "token": e.token,
                "bytes": e.bytes,
                "logprob": e.logprob,
                "top_logprobs": [{"token": t.token, "bytes": t.bytes, "logprob": t.logprob} for t in e.top],
            }
            for e in entries
        ],
        "refusal": None,
    }


def _text_logprobs(entries: list[TokenLogprob], offset: int) -> dict[str, Any]:
    """The legacy completions' logprobs object; ``offset``: the characters of the choice sent before these."""
    offsets = []
    for e in entries:
        offsets.append(offset)
        offset += len(e.token)
    return {
        "tokens": [e.token for e in entries],
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [{t.token: t.logprob for t in e.top} for e in entries],
        "text_offset": offsets,
    }


async def _respond(
    server: Server,
    body: SamplingRequest,
    prompt: list[int],
    sampling: Sampling,
    *,
    chat: bool,
    parser: ToolCallParser | None = None,
    call_finish: schemas.ChatFinishReason = "tool_calls",
) -> StreamingResponse | dict[str, Any]:
    """The request submitted to the engine, answered as one object or (``stream``) as server-sent events; with a
    ``parser``, each chat choice's tool calls parsed out of its text (its finish reason then ``call_finish``)."""
    created = int(time.time())
    rid = f"chatcmpl-{uuid.uuid4().hex}" if chat else f"cmpl-{uuid.uuid4().hex}"
    if body.stream:
        events, ticket = await _submit_streamed(server, body.model, prompt, sampling)
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        head = _Head(rid, created, body.model, chat=chat, include_usage=include_usage)
        relays = [_CallRelay(parser, call_finish) for _ in range(sampling.n)] if parser is not None else None
        stream = _stream(events, ticket, head, sampling.n, relays)
        return StreamingResponse(stream, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    out = await _gathered(server, body.model, prompt, sampling)
    if chat:
        calls = (parser, call_finish) if parser is not None else None
        return _chat_answer(rid, created, body.model, out, logprobs=sampling.logprobs, calls=calls)
    return _text_answer(rid, created, body.model, out, logprobs=sampling.logprobs)


async def _submit(
    server: Server, model: str, prompt: list[int], sampling: Sampling, on_event: Callable[[Event], None]
) -> Ticket:
    """The request submitted off the event loop: the engine sets its grammar up there (the matcher's view of the
    tokenizer, a schema's compilation), which can take seconds that every other request would wait. A request
    whose client went away meanwhile is cancelled once submitted."""
    task = asyncio.ensure_future(
        asyncio.to_thread(_engine_call, lambda: server.engine.submit(model, prompt, sampling, on_event))
    )
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        task.add_done_callback(_cancel_submitted)
        raise


def _cancel_submitted(task: asyncio.Future[Ticket]) -> None:
    if not task.cancelled() and task.exception() is None:
        task.result().cancel()


async def _submit_streamed(
    server: Server, model: str, prompt: list[int], sampling: Sampling
) -> tuple[asyncio.Queue[Event], Ticket]:
    """The request submitted with its events queued on this event loop, as the model thread sends them."""
    loop = asyncio.get_running_loop()
    events: asyncio.Queue[Event] = asyncio.Queue()

    def on_event(ev: Event) -> None:  # on the model thread
        with contextlib.suppress(RuntimeError):  # the loop is closing: nobody is waiting any more
            loop.call_soon_threadsafe(events.put_nowait, ev)

    return events, await _submit(server, model, prompt, sampling, on_event)


async def _gathered(server: Server, model: str, prompt: list[int], sampling: Sampling) -> Completion:
    """The request's completion, its choices gathered on the model thread as they come (``Completion.gather``);
    a request that could not run raises its error."""
    loop = asyncio.get_running_loop()
    out, gather, _ = Completion.gather(sampling.n)
    ended: asyncio.Future[Event] = loop.create_future()

    def end(ev: Event) -> None:  # on the loop
        if not ended.done():  # cancelled when the client went away
            ended.set_result(ev)

    def on_event(ev: Event) -> None:  # on the model thread
        gather(ev)
        if not isinstance(ev, Progress):
            with contextlib.suppress(RuntimeError):  # the loop is closing: nobody is waiting any more
                loop.call_soon_threadsafe(end, ev)

    ticket = await _submit(server, model, prompt, sampling, on_event)
    try:
        last = await ended
    finally:
        ticket.cancel()  # a no-op once finished; a client gone mid-request frees its rows
    if isinstance(last, Failed):
        raise _failure(last)
    return out


def _tool_turn(
    parser: ToolCallParser | None, text: str, reason: FinishReason, call_finish: schemas.ChatFinishReason
) -> tuple[str | None, list[ToolCall], schemas.ChatFinishReason]:
    """A choice's (content, tool calls, finish reason): the calls parsed out of a turn that ended (EOS), the text
    left as content (None when only calls remain), finish reason ``call_finish``. A turn cut by its budget, or
    whose call does not parse, is text, as it came."""
    if parser is None or reason != "stop":
        return text, [], reason
    try:
        turn = parser.parse(text)
    except ToolCallFormatError:
        return text, [], reason
    if not turn.calls:
        return text, [], reason
    return turn.content or None, turn.calls, call_finish


def _chat_answer(
    rid: str,
    created: int,
    model: str,
    out: Completion,
    *,
    logprobs: bool,
    calls: tuple[ToolCallParser, schemas.ChatFinishReason] | None,
) -> dict[str, Any]:
    """The whole chat answer; with ``calls`` (a parser and the finish reason of a turn that calls), each choice's
    tool calls parsed out of its text."""
    parser: ToolCallParser | None = None
    call_finish: schemas.ChatFinishReason = "tool_calls"
    if calls is not None:
        parser, call_finish = calls
    choices = []
    for i in range(len(out.texts)):
        content, tool_calls, finish = _tool_turn(parser, out.texts[i], _ended(out, i), call_finish)
        message = schemas.AssistantMessage(
            content=content, tool_calls=[c.chat_completions() for c in tool_calls] or None
        )
        lp = _chat_logprobs(out.logprobs[i]) if logprobs else None
        choices.append(schemas.ChatChoice(index=i, message=message, logprobs=lp, finish_reason=finish))
    usage = _usage(out.prompt_tokens, out.completion_tokens)
    answer = schemas.ChatCompletion(id=rid, created=created, model=model, choices=choices, usage=usage)
    return answer.model_dump()


def _text_answer(rid: str, created: int, model: str, out: Completion, *, logprobs: bool) -> dict[str, Any]:
    choices = [
        schemas.CompletionChoice(
            index=i,
            text=out.texts[i],
            logprobs=_text_logprobs(out.logprobs[i], 0) if logprobs else None,
            finish_reason=_ended(out, i),
        )
        for i in range(len(out.texts))
    ]
    usage = _usage(out.prompt_tokens, out.completion_tokens)
    answer = schemas.Completion(id=rid, created=created, model=model, choices=choices, usage=usage)
    return answer.model_dump()


def _ended(out: Completion, i: int) -> FinishReason:
    reason = out.finish_reasons[i]
    assert reason is not None, "the engine finishes a request once every choice has ended"
    return reason


@dataclasses.dataclass(frozen=True)
class _Head:
    """What every chunk of a stream carries."""

    rid: str
    created: int
    model: str
    chat: bool
    include_usage: bool

    def chunk(self, choices: list[dict[str, Any]], **more: Any) -> str:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        extra = {"usage": None} if self.include_usage else {}
        payload = {"id": self.rid, "object": obj, "created": self.created, "model": self.model, "choices": choices}
        return f"data: {json.dumps({**payload, **extra, **more}, separators=(',', ':'))}\n\n"


class _CallRelay:
    """One streamed chat choice's text while its tool calls are parsed: content goes out as it comes, up to where a
    call may begin (its opening marker, or a prefix of one); the rest waits for the turn's end, where the calls are
    parsed and sent as OpenAI streams them (a delta with the call's id, type and name, then its arguments)."""

    def __init__(self, parser: ToolCallParser, call_finish: schemas.ChatFinishReason = "tool_calls") -> None:
        self.parser, self.markers, self.call_finish = parser, call_markers(parser), call_finish
        self.text, self.sent = "", 0

    def content(self, text: str) -> str:
        """The part of the text so far that can be sent now (syntaxes without a marker send it at the end)."""
        self.text += text
        if not self.markers:
            return ""
        found = [i for i in (self.text.find(m) for m in self.markers) if i >= 0]
        cut = min(found) if found else len(self.text) - _marker_prefix(self.text, self.markers)
        out = self.text[self.sent : cut] if cut > self.sent else ""
        self.sent = max(self.sent, cut)
        return out

    def end(self, reason: FinishReason) -> tuple[list[dict[str, Any]], schemas.ChatFinishReason]:
        """The deltas left at the turn's end (held content, then each call), and the choice's finish reason."""
        content, calls, finish = _tool_turn(self.parser, self.text, reason, self.call_finish)
        rest = self.text[self.sent :]
        if calls:
            sent = self.text[: self.sent].strip()
            rest = content or ""
            rest = rest[len(sent) :] if rest.startswith(sent) else rest
        deltas: list[dict[str, Any]] = [{"content": rest}] if rest else []
        for k, c in enumerate(calls):
            head = {"index": k, "id": c.id, "type": "function", "function": {"name": c.name, "arguments": ""}}
            deltas += [{"tool_calls": [head]}, {"tool_calls": [{"index": k, "function": {"arguments": c.arguments}}]}]
        return deltas, finish


def _marker_prefix(text: str, markers: tuple[str, ...]) -> int:
    """The length of the longest suffix of ``text`` that begins one of ``markers``."""
    return max((k for m in markers for k in range(1, len(m)) if text.endswith(m[:k])), default=0)


def _chat_chunks(head: _Head, ev: Progress, relays: list[_CallRelay] | None) -> list[str]:
    """A step's chat chunks: one with every choice's delta, then, for a choice whose tool calls end with this
    step, a chunk per call delta and one with its finish reason."""
    choices, after = [], []
    for d in ev.deltas:
        lp = _chat_logprobs(list(d.logprobs)) if d.logprobs else None
        text, finish = d.text, d.finish_reason
        if relays is not None:
            relay = relays[d.index]
            text = relay.content(d.text)
            if d.finish_reason is not None:
                rest, ended = relay.end(d.finish_reason)
                after += [
                    head.chunk([{"index": d.index, "delta": r, "logprobs": None, "finish_reason": None}]) for r in rest
                ]
                after.append(head.chunk([{"index": d.index, "delta": {}, "logprobs": None, "finish_reason": ended}]))
                finish = None
        delta = {"content": text} if text else {}
        choices.append({"index": d.index, "delta": delta, "logprobs": lp, "finish_reason": finish})
    return [head.chunk(choices), *after]


def _text_chunk(head: _Head, ev: Progress, sent: list[int]) -> str:
    choices = []
    for d in ev.deltas:
        lp = _text_logprobs(list(d.logprobs), sent[d.index]) if d.logprobs else None
        choices.append({"index": d.index, "text": d.text, "logprobs": lp, "finish_reason": d.finish_reason})
        sent[d.index] += len(d.text)
    return head.chunk(choices)


async def _stream(
    events: asyncio.Queue[Event], ticket: Ticket, head: _Head, n: int, relays: list[_CallRelay] | None
) -> AsyncIterator[str]:
    """Server-sent events as OpenAI streams them: ``chat.completion.chunk`` objects (a first chunk per choice with
    the assistant role, then content deltas, the last with its finish_reason; with ``relays``, tool calls as
    ``tool_calls`` deltas at the turn's end) or ``text_completion`` ones, an optional usage chunk (no choices), then
    ``[DONE]``."""
    sent = [0] * n
    try:
        if head.chat:
            for i in range(n):
                first = {"role": "assistant", "content": ""}
                yield head.chunk([{"index": i, "delta": first, "logprobs": None, "finish_reason": None}])
        while True:
            ev = await events.get()
            if isinstance(ev, Failed):  # the status is sent: the error goes in the stream, as vLLM sends it
                err = _failure(ev)
                yield f"data: {json.dumps(errors.envelope(err.message, err.type, err.param, err.code))}\n\n"
                break
            if isinstance(ev, Finished):
                if head.include_usage:
                    yield head.chunk([], usage=_usage(ev.prompt_tokens, ev.completion_tokens).model_dump())
                break
            if head.chat:
                for chunk in _chat_chunks(head, ev, relays):
                    yield chunk
            else:
                yield _text_chunk(head, ev, sent)
        yield "data: [DONE]\n\n"
    finally:
        ticket.cancel()


# -- the app ------------------------------------------------------------------------------------------------------


def resolved_models(settings: Settings) -> tuple[dict[str, str], dict[str, str]]:
    """The offered base models (settings ``base_models``) → their folders in the model store (as a worker resolves
    them, ``worker.models.resolve_model``); and those that cannot be found here, with why."""
    found, missing = {}, {}
    for name in settings.base_models:
        try:
            found[name] = resolve_model(name, settings.model_store)
        except JobError as err:
            missing[name] = err.message
    return found, missing


def build_engine(settings: Settings, models: dict[str, str]) -> InferenceEngine:
    """The engine on this machine's device, at the precision the trainer picks here (``trainer.generation.models``)."""
    device = default_device()
    return InferenceEngine(
        models,
        device=device,
        precision=resolve_precision(settings.inference_precision, device),
        max_batch=settings.inference_max_batch,
        max_adapters=settings.inference_max_adapters,
        idle_unload_s=settings.inference_idle_unload_s,
    )


@contextlib.asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    """The engine starts with the app (and its base models load) and stops with it."""
    engine: InferenceEngine = app.state.server.engine
    engine.start()
    await asyncio.to_thread(engine.wait_ready)
    log.info("inference: ready (%s)", ", ".join(engine.base_names()) or "no base model")
    try:
        yield
    finally:
        await asyncio.to_thread(engine.close)


def create_app(
    settings: Settings, *, engine: InferenceEngine | None = None, store: ArtifactStore | None = None
) -> FastAPI:
    """The inference server's app over ``engine`` (by default one on this machine's device with the offered base
    models) and ``store`` (by default the configured artifact store)."""
    models, missing = resolved_models(settings)
    for why in missing.values():
        log.warning("inference: %s", why)
    if engine is None:
        engine = build_engine(settings, models)
    server = Server(settings, engine, store if store is not None else store_for(settings), unavailable=missing)
    app = FastAPI(title="Proxima inference", lifespan=_lifespan, docs_url=None, redoc_url=None)
    app.state.server = server
    errors.install(app, openai_wording=True)  # its clients are OpenAI's and vLLM's: their words for a bad request
    app.include_router(public)
    app.include_router(router)
    return app


def run_server(settings: Settings, *, host: str, port: int) -> None:
    """Serve until interrupted; logs (and prints) a line once the models are loaded and the port is open."""
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s %(message)s")
    hf_logging.disable_progress_bar()  # weight-loading bars at every model load say nothing to an operator
    # peft calls a transformers API that transformers 5 deprecates, and says when the active adapter changes
    warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
    warnings.filterwarnings("ignore", message="Adapter .* was active which is now deleted", category=UserWarning)
    app = create_app(settings)

    class Ready(uvicorn.Server):
        async def startup(self, sockets: Any = None) -> None:
            await super().startup(sockets)
            if self.started:
                print(f"proxima inference: ready on http://{host}:{port}", file=sys.stderr, flush=True)

    config = uvicorn.Config(app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=5)
    Ready(config).run()


__all__ = ["create_app", "fetch_adapter", "run_server"]

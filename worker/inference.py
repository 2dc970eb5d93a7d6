"""``proxima inference``: the inference server, a process of its own that imports torch.

It speaks the subset of vLLM's OpenAI-compatible API that the internal inference contract names, so that the API can
point ``PROXIMA_INFERENCE_URL`` at it or at vLLM: ``GET /health``, ``GET /v1/models``, ``POST /v1/load_lora_adapter``
and ``/v1/unload_lora_adapter``, ``POST /v1/chat/completions`` and ``/v1/completions`` in OpenAI's shapes (streamed
as server-sent events with ``stream: true``), errors in OpenAI's envelope. The work is ``trainer.serving.inference``'s
engine; the bodies and answers are the API's schemas (``api.schemas_inference``) and the errors are rendered by
``api.errors``: this module parses, checks and renders.

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
    messages = [{"role": m.role, "content": m.text()} for m in body.messages]
    prompt = await asyncio.to_thread(_engine_call, lambda: server.engine.encode_chat(base, messages))
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    sampling = server.sampling(body, base, prompt, max_tokens, "messages")
    sampling = _with_logprobs(sampling, bool(body.logprobs), body.top_logprobs or 0)
    return await _respond(server, body, prompt, sampling, chat=True)


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
    server: Server, body: SamplingRequest, prompt: list[int], sampling: Sampling, *, chat: bool
) -> StreamingResponse | dict[str, Any]:
    """The request submitted to the engine, answered as one object or (``stream``) as server-sent events."""
    created = int(time.time())
    rid = f"chatcmpl-{uuid.uuid4().hex}" if chat else f"cmpl-{uuid.uuid4().hex}"
    if body.stream:
        events, ticket = _submit_streamed(server, body.model, prompt, sampling)
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        stream = _stream(events, ticket, rid, created, body.model, sampling.n, chat=chat, include_usage=include_usage)
        return StreamingResponse(stream, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    out = await _gathered(server, body.model, prompt, sampling)
    if chat:
        return _chat_answer(rid, created, body.model, out, logprobs=sampling.logprobs)
    return _text_answer(rid, created, body.model, out, logprobs=sampling.logprobs)


def _submit_streamed(
    server: Server, model: str, prompt: list[int], sampling: Sampling
) -> tuple[asyncio.Queue[Event], Ticket]:
    """The request submitted with its events queued on this event loop, as the model thread sends them."""
    loop = asyncio.get_running_loop()
    events: asyncio.Queue[Event] = asyncio.Queue()

    def on_event(ev: Event) -> None:  # on the model thread
        with contextlib.suppress(RuntimeError):  # the loop is closing: nobody is waiting any more
            loop.call_soon_threadsafe(events.put_nowait, ev)

    return events, _engine_call(lambda: server.engine.submit(model, prompt, sampling, on_event))


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

    ticket = _engine_call(lambda: server.engine.submit(model, prompt, sampling, on_event))
    try:
        last = await ended
    finally:
        ticket.cancel()  # a no-op once finished; a client gone mid-request frees its rows
    if isinstance(last, Failed):
        raise _failure(last)
    return out


def _chat_answer(rid: str, created: int, model: str, out: Completion, *, logprobs: bool) -> dict[str, Any]:
    choices = [
        schemas.ChatChoice(
            index=i,
            message=schemas.AssistantMessage(content=out.texts[i]),
            logprobs=_chat_logprobs(out.logprobs[i]) if logprobs else None,
            finish_reason=_ended(out, i),
        )
        for i in range(len(out.texts))
    ]
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


async def _stream(
    events: asyncio.Queue[Event],
    ticket: Ticket,
    rid: str,
    created: int,
    model: str,
    n: int,
    *,
    chat: bool,
    include_usage: bool,
) -> AsyncIterator[str]:
    """Server-sent events as OpenAI streams them: ``chat.completion.chunk`` objects (a first chunk per choice with
    the assistant role, then content deltas, the last with its finish_reason) or ``text_completion`` ones, an
    optional usage chunk (no choices), then ``[DONE]``."""
    obj = "chat.completion.chunk" if chat else "text_completion"
    extra = {"usage": None} if include_usage else {}
    sent = [0] * n

    def chunk(choices: list[dict[str, Any]], **more: Any) -> str:
        payload = {"id": rid, "object": obj, "created": created, "model": model, "choices": choices, **extra, **more}
        return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"

    try:
        if chat:
            for i in range(n):
                first = {"role": "assistant", "content": ""}
                yield chunk([{"index": i, "delta": first, "logprobs": None, "finish_reason": None}])
        while True:
            ev = await events.get()
            if isinstance(ev, Failed):  # the status is sent: the error goes in the stream, as vLLM sends it
                err = _failure(ev)
                yield f"data: {json.dumps(errors.envelope(err.message, err.type, err.param, err.code))}\n\n"
                break
            if isinstance(ev, Finished):
                if include_usage:
                    yield chunk([], usage=_usage(ev.prompt_tokens, ev.completion_tokens).model_dump())
                break
            choices = []
            for d in ev.deltas:
                if chat:
                    delta = {"content": d.text} if d.text else {}
                    lp = _chat_logprobs(list(d.logprobs)) if d.logprobs else None
                    choices.append({"index": d.index, "delta": delta, "logprobs": lp, "finish_reason": d.finish_reason})
                else:
                    lp = _text_logprobs(list(d.logprobs), sent[d.index]) if d.logprobs else None
                    choices.append({"index": d.index, "text": d.text, "logprobs": lp, "finish_reason": d.finish_reason})
                sent[d.index] += len(d.text)
            yield chunk(choices)
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

"""``proxima inference``: the inference server (issue 14), a process of its own that imports torch.

It speaks the subset of vLLM's OpenAI-compatible API that the internal inference contract names, so that the API can
point ``PROXIMA_INFERENCE_URL`` at it or at vLLM: ``GET /health``, ``GET /v1/models``, ``POST /v1/load_lora_adapter``
and ``/v1/unload_lora_adapter``, ``POST /v1/chat/completions`` and ``/v1/completions`` in OpenAI's shapes (streamed
as server-sent events with ``stream: true``), errors in OpenAI's envelope. The work is ``trainer.serving.inference``'s
engine; this module parses, checks and renders.

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
from typing import Any, Literal, TypeVar

import uvicorn
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator
from transformers.utils import logging as hf_logging

from api.errors import ApiError, InvalidRequest, Unauthorized, error_json
from api.settings import Settings
from api.storage import ArtifactStore, NotFound, StorageError, validate_key
from trainer.generation.models import ModelError, default_device, resolve_precision
from trainer.serving.inference import (
    EngineError,
    Event,
    Failed,
    Finished,
    InferenceEngine,
    Sampling,
    Ticket,
    TokenLogprob,
    UnknownModel,
)
from worker.errors import JobError
from worker.tasks import resolve_model, store_for

log = logging.getLogger("proxima.inference")
T = TypeVar("T")

ADAPTER_CACHE = "inference/adapters"  # under PROXIMA_HOME: extracted adapter archives, one folder per store key


# -- errors ------------------------------------------------------------------------------------------------------


class ModelNotFound(ApiError):
    status = 404

    def __init__(self, message: str, *, param: str | None = "model") -> None:
        super().__init__(message, param=param, code="model_not_found")


class Unavailable(ApiError):
    status = 503
    type = "server_error"


class Internal(ApiError):
    status = 500
    type = "server_error"


def _param(loc: tuple[Any, ...]) -> str | None:
    """A pydantic location as OpenAI names a parameter: ``messages[0].content``."""
    parts = [p for p in loc if p not in ("body", "query")]
    out = ""
    for p in parts:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out or None


def _validation_error(err: RequestValidationError) -> JSONResponse:
    first = err.errors()[0]
    loc = tuple(first.get("loc", ()))
    if first.get("type") == "extra_forbidden":
        # OpenAI's own words for an unknown top-level parameter (a nested one is named by its path)
        name = _param(loc) or "?"
        return error_json(400, f"Unrecognized request argument supplied: {name}", "invalid_request_error")
    if first.get("type") == "json_invalid":
        message = "We could not parse the JSON body of your request. (HINT: This likely means you aren't using your "
        message += "HTTP library correctly. The OpenAI API expects a JSON payload.)"
        return error_json(400, message, "invalid_request_error")
    param = _param(loc)
    msg = str(first.get("msg", "invalid value"))
    if first.get("type") == "missing":
        return error_json(400, f"Missing required parameter: '{param}'.", "invalid_request_error", param=param)
    return error_json(400, f"Invalid value for '{param}': {msg}", "invalid_request_error", param=param)


# -- request bodies ----------------------------------------------------------------------------------------------


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TextPart(_Body):
    type: Literal["text"]
    text: str


class Message(_Body):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class StreamOptions(_Body):
    include_usage: bool | None = None
    include_obfuscation: bool | None = None  # accepted as OpenAI's client may send it; nothing is obfuscated


class _Sampling(_Body):
    model: str
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    max_tokens: int | None = Field(None, ge=1)
    n: int | None = Field(None, ge=1, le=128)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=-(2**63), lt=2**63)
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    user: str | None = None

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: str | list[str] | None) -> str | list[str] | None:
        stops = [v] if isinstance(v, str) else v or []
        if len(stops) > 4:
            raise ValueError("at most 4 stop sequences")
        if any(not s for s in stops):
            raise ValueError("a stop sequence may not be empty")
        return v

    def stops(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())


class ChatRequest(_Sampling):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)


class CompletionRequest(_Sampling):
    prompt: str
    logprobs: int | None = Field(None, ge=0, le=20)


class LoadLora(_Body):
    lora_name: str = Field(min_length=1, max_length=512)
    lora_path: str = Field(min_length=1, max_length=4096)
    base_model_name: str | None = None


class UnloadLora(_Body):
    lora_name: str = Field(min_length=1)
    lora_int_id: int | None = None  # vLLM's; ignored


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


# -- the app ------------------------------------------------------------------------------------------------------


class Server:
    """The engine and what the routes share."""

    def __init__(self, settings: Settings, engine: InferenceEngine, store: ArtifactStore | None) -> None:
        self.settings, self.engine, self.store = settings, engine, store
        self.adapter_cache = settings.home / ADAPTER_CACHE
        self.unavailable: dict[str, str] = {}  # offered base models this server cannot load, and why


def resolved_models(settings: Settings) -> tuple[dict[str, str], dict[str, str]]:
    """The offered base models (settings ``base_models``) → their folders in the model store (as a worker resolves
    them, ``worker.tasks.resolve_model``); and those that cannot be found here, with why."""
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


def create_app(
    settings: Settings, *, engine: InferenceEngine | None = None, store: ArtifactStore | None = None
) -> FastAPI:
    """The inference server's app: the engine starts with the app (and its base models load) and stops with it."""
    models, missing = resolved_models(settings)
    for why in missing.values():
        log.warning("inference: %s", why)
    if engine is None:
        engine = build_engine(settings, models)
    server = Server(settings, engine, store if store is not None else store_for(settings))
    server.unavailable = missing

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine.start()
        await asyncio.to_thread(engine.wait_ready)
        log.info("inference: ready (%s)", ", ".join(engine.base_names()) or "no base model")
        try:
            yield
        finally:
            await asyncio.to_thread(engine.close)

    app = FastAPI(title="Proxima inference", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.server = server

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, err: ApiError) -> JSONResponse:
        return error_json(err.status, err.message, err.type, param=err.param, code=err.code)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, err: RequestValidationError) -> JSONResponse:
        return _validation_error(err)

    @app.exception_handler(404)
    async def _no_route(request: Request, _: Exception) -> JSONResponse:
        return error_json(404, f"Invalid URL ({request.method} {request.url.path})", "invalid_request_error")

    @app.exception_handler(405)
    async def _no_method(request: Request, _: Exception) -> JSONResponse:
        return error_json(405, f"Method not allowed ({request.method} {request.url.path})", "invalid_request_error")

    @app.exception_handler(Exception)
    async def _bug(request: Request, _: Exception) -> JSONResponse:
        log.exception("inference: unhandled error on %s %s", request.method, request.url.path)
        return error_json(500, "internal error", "server_error")

    @app.get("/health")
    async def health() -> JSONResponse:
        if not engine.ready:
            return JSONResponse({"status": "starting"}, status_code=503)
        return JSONResponse({"status": "ok"})

    app.include_router(_routes(server), dependencies=[Depends(_auth(settings))])
    return app


def _auth(settings: Settings) -> Callable[[Request], None]:
    key = settings.inference_api_key.get_secret_value() if settings.inference_api_key else None

    def check(request: Request) -> None:
        if key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, given = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), key.encode()):
            raise Unauthorized("Incorrect API key provided.", code="invalid_api_key")

    return check


def _routes(server: Server) -> APIRouter:
    router = APIRouter()
    engine = server.engine

    @router.get("/v1/models")
    async def models() -> dict[str, Any]:
        data = [
            {"id": n, "object": "model", "created": engine.started, "owned_by": "proxima", "root": n, "parent": None}
            for n in engine.base_names()
        ]
        data += [
            {
                "id": a.name,
                "object": "model",
                "created": a.created,
                "owned_by": "proxima",
                "root": a.base,
                "parent": a.base,
            }
            for a in engine.adapters()
        ]
        return {"object": "list", "data": data}

    @router.post("/v1/load_lora_adapter")
    async def load_lora_adapter(body: LoadLora) -> dict[str, Any]:
        base = body.base_model_name
        if base is None:
            names = engine.base_names()
            if len(names) != 1:
                raise InvalidRequest(
                    "base_model_name is required: this server has several base models", param="base_model_name"
                )
            base = names[0]
        if base not in engine.base_names():
            raise ModelNotFound(_no_model(server, base), param="base_model_name")
        path = Path(body.lora_path)
        if path.is_absolute():
            if not (path / "adapter_config.json").is_file():
                raise InvalidRequest(f"lora_path: no PEFT adapter (adapter_config.json) in {path}", param="lora_path")
        else:
            if server.store is None:
                raise InvalidRequest("lora_path: this server has no artifact store", param="lora_path")
            try:
                path = await asyncio.to_thread(fetch_adapter, server.store, body.lora_path, server.adapter_cache)
            except StorageError as err:
                log.error("inference: artifact store failed fetching %s: %s", body.lora_path, err)
                raise Unavailable(
                    "the artifact store is unavailable; retry later", code="service_unavailable"
                ) from None
        _engine_call(lambda: engine.register_adapter(body.lora_name, base=base, path=path))
        return {"lora_name": body.lora_name}

    @router.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadLora) -> dict[str, Any]:
        _engine_call(lambda: engine.unregister_adapter(body.lora_name))
        return {"lora_name": body.lora_name}

    @router.post("/v1/chat/completions", response_model=None)
    async def chat_completions(body: ChatRequest) -> StreamingResponse | dict[str, Any]:
        if body.top_logprobs and not body.logprobs:
            raise InvalidRequest("top_logprobs requires logprobs to be true", param="top_logprobs")
        base = _base_of(server, body.model)
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        prompt = await asyncio.to_thread(_engine_call, lambda: engine.encode_chat(base, messages))
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        sampling = _sampling(server, body, base, prompt, max_tokens, "messages")
        sampling = _with_logprobs(sampling, bool(body.logprobs), body.top_logprobs or 0)
        return await _respond(server, body, prompt, sampling, chat=True)

    @router.post("/v1/completions", response_model=None)
    async def completions(body: CompletionRequest) -> StreamingResponse | dict[str, Any]:
        base = _base_of(server, body.model)
        prompt = await asyncio.to_thread(_engine_call, lambda: engine.encode_text(base, body.prompt))
        sampling = _sampling(server, body, base, prompt, body.max_tokens, "prompt")
        if body.logprobs is not None:
            sampling = _with_logprobs(sampling, True, body.logprobs)
        return await _respond(server, body, prompt, sampling, chat=False)

    return router


def _no_model(server: Server, name: str) -> str:
    if name in server.unavailable:
        return f"The model `{name}` is not available on this inference server: {server.unavailable[name]}"
    return f"The model `{name}` does not exist."


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


def _base_of(server: Server, model: str) -> str:
    try:
        base, _ = server.engine.resolve(model)
    except UnknownModel:
        raise ModelNotFound(_no_model(server, model)) from None
    return base


def _sampling(
    server: Server, body: _Sampling, base: str, prompt: list[int], max_tokens: int | None, what: str
) -> Sampling:
    """The engine's sampling parameters; a prompt that with ``max_tokens`` exceeds the context is a 400 naming
    ``what`` (the messages or the prompt), as OpenAI's is."""
    budget = _engine_call(lambda: server.engine.fit(base, len(prompt), max_tokens, param=what))
    return Sampling(
        max_tokens=budget,
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        n=body.n or 1,
        stop=body.stops(),
        seed=body.seed,
    )


def _with_logprobs(sampling: Sampling, logprobs: bool, top: int) -> Sampling:
    return dataclasses.replace(sampling, logprobs=logprobs, top_logprobs=top if logprobs else 0)


# -- answers ------------------------------------------------------------------------------------------------------


def _failure(ev: Failed) -> ApiError:
    """What a request that could not run answers: a bad adapter is the request's model (400), a base model that
    does not load or a closing server a 503, a bug a 500."""
    if ev.kind == "adapter":
        return InvalidRequest(ev.message, param="model", code="adapter_not_loadable")
    if ev.kind == "internal":
        return Internal(ev.message)
    return Unavailable(ev.message, code="model_not_available" if ev.kind == "model" else "shutting_down")


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


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
    server: Server, body: _Sampling, prompt: list[int], sampling: Sampling, *, chat: bool
) -> StreamingResponse | dict[str, Any]:
    loop = asyncio.get_running_loop()
    events: asyncio.Queue[Event] = asyncio.Queue()

    def on_event(ev: Event) -> None:  # on the model thread
        with contextlib.suppress(RuntimeError):  # the loop is closing: nobody is waiting any more
            loop.call_soon_threadsafe(events.put_nowait, ev)

    ticket = _engine_call(lambda: server.engine.submit(body.model, prompt, sampling, on_event))
    created = int(time.time())
    rid = f"chatcmpl-{uuid.uuid4().hex}" if chat else f"cmpl-{uuid.uuid4().hex}"
    obj = "chat.completion" if chat else "text_completion"
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        stream = _stream(events, ticket, rid, created, body.model, sampling.n, chat=chat, include_usage=include_usage)
        return StreamingResponse(stream, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    texts = [""] * sampling.n
    reasons: list[str | None] = [None] * sampling.n
    logprobs: list[list[TokenLogprob]] = [[] for _ in range(sampling.n)]
    try:
        while True:
            ev = await events.get()
            if isinstance(ev, Failed):
                raise _failure(ev)
            if isinstance(ev, Finished):
                break
            for d in ev.deltas:
                texts[d.index] += d.text
                logprobs[d.index] += d.logprobs
                reasons[d.index] = d.finish_reason or reasons[d.index]
    finally:
        ticket.cancel()  # a no-op once finished; a client gone mid-request frees its rows
    choices: list[dict[str, Any]] = []
    for i in range(sampling.n):
        if chat:
            choices.append(
                {
                    "index": i,
                    "message": {"role": "assistant", "content": texts[i], "refusal": None},
                    "logprobs": _chat_logprobs(logprobs[i]) if sampling.logprobs else None,
                    "finish_reason": reasons[i],
                }
            )
        else:
            choices.append(
                {
                    "index": i,
                    "text": texts[i],
                    "logprobs": _text_logprobs(logprobs[i], 0) if sampling.logprobs else None,
                    "finish_reason": reasons[i],
                }
            )
    return {
        "id": rid,
        "object": obj,
        "created": created,
        "model": body.model,
        "choices": choices,
        "usage": _usage(ev.prompt_tokens, ev.completion_tokens),
        "system_fingerprint": None,
    }


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
                error = {"error": {"message": err.message, "type": err.type, "param": err.param, "code": err.code}}
                yield f"data: {json.dumps(error)}\n\n"
                break
            if isinstance(ev, Finished):
                if include_usage:
                    yield chunk([], usage=_usage(ev.prompt_tokens, ev.completion_tokens))
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

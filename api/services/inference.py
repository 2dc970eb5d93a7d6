"""Chat and text completions: the API's side of the inference contract.

The API process never runs a model. It authenticates the caller, resolves the model name the caller sent to what
the inference server knows (``proxima inference``, or vLLM's OpenAI server, at ``PROXIMA_INFERENCE_URL``) after
checking tenancy, and forwards the request, already validated (``api.schemas_inference``):

- an offered base model (``settings.base_models``) is served under its own name;
- ``ft:<base>:<tenant>:<suffix>:<id>``, the ``fine_tuned_model`` of one of the caller's succeeded jobs, is the job's
  final adapter archive (its result file ``…-adapter.tar.gz``), registered with the server under the job's id;
- ``ft:…:ckpt-step-N``, a checkpoint's ``fine_tuned_model_checkpoint``, is ``<checkpoint folder>/adapter.tar.gz``,
  registered under the checkpoint's id.

Anything else, another tenant's model among others, is OpenAI's 404 ``model_not_found``. An adapter is registered
(``POST /v1/load_lora_adapter``) the first time this process uses it; when the server answers 404
``model_not_found`` for it (it restarted, or dropped the name), it is registered again and the request retried once.

Answers are passed through as they arrive, ``model`` rewritten to the caller's name in the JSON and in every
server-sent event; the server's 4xx come back in OpenAI's envelope as they are, any internal name in them
rewritten. The server down, too slow or failing is a 503 (``inference_unavailable``) that says so, never a 500.
The route resolves the model first, in autocommit reads (``api.deps.read_only``): nothing is held open in the
database while a completion is generated.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import anyio
import httpx
from anyio.lowlevel import RunVar
from sqlalchemy import Connection
from starlette.responses import JSONResponse, Response, StreamingResponse

from api import ids
from api.auth import Caller
from api.errors import RETRY_AFTER_S, ModelNotFound, error_json
from api.repositories import inference as inference_repo
from api.schemas_inference import ChatCompletionRequest, CompletionRequest
from api.settings import Settings
from api.status import JobStatus

log = logging.getLogger("proxima.api.inference")

CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"
LOAD_ADAPTER_PATH = "/v1/load_lora_adapter"
CHECKPOINT_ADAPTER = "adapter.tar.gz"  # in a checkpoint's folder (worker.tasks)

_CHECKPOINT_NAME = re.compile(r"^(?P<model>ft:.+):ckpt-step-(?P<step>[0-9]{1,9})$")
_FINE_TUNED_NAME = re.compile(r"^ft:.+:(?P<job>[A-Za-z0-9]{1,64})$")


def _no_such_model(model: str) -> ModelNotFound:
    """OpenAI's answer to a model that does not exist or that the caller may not use (the two are not told apart)."""
    return ModelNotFound(f"The model `{model}` does not exist or you do not have access to it.")


@dataclass(frozen=True)
class Adapter:
    lora_name: str  # the name the inference server knows it by: a job's or a checkpoint's id
    lora_path: str  # its archive's key in the artifact store
    base: str


@dataclass(frozen=True)
class Target:
    model: str  # as the caller named it, and as the answers name it
    served: str  # as the inference server knows it: a base model's name or an adapter's lora_name
    adapter: Adapter | None


# -- resolution -----------------------------------------------------------------------------------------------


def resolve(conn: Connection, *, settings: Settings, tenant: Caller, model: str) -> Target:
    """What ``model`` names for ``tenant``: a base model, a fine-tuned model or a checkpoint; else ModelNotFound."""
    if model in settings.base_models:
        return Target(model=model, served=model, adapter=None)
    step: int | None = None
    name = model
    if checkpoint_match := _CHECKPOINT_NAME.match(model):
        name, step = checkpoint_match["model"], int(checkpoint_match["step"])
    match = _FINE_TUNED_NAME.match(name)
    if match is None:
        raise _no_such_model(model)
    job = inference_repo.job(conn, tenant_id=tenant.id, job_id=f"ftjob-{match['job']}")
    # The name is rebuilt from the job and compared whole: a name that only ends with a job's id names nothing.
    if job is None or name != ids.fine_tuned_model_name(
        model=job.model, tenant_id=job.tenant_id, suffix=job.suffix, job_id=job.id
    ):
        raise _no_such_model(model)
    if step is None:
        if job.status != JobStatus.SUCCEEDED or job.fine_tuned_model != model:
            raise _no_such_model(model)
        key = inference_repo.final_adapter_key(conn, tenant_id=tenant.id, file_ids=list(job.result_files or []))
        if key is None:  # its adapter file was deleted
            raise _no_such_model(model)
        return Target(model=model, served=job.id, adapter=Adapter(lora_name=job.id, lora_path=key, base=job.model))
    # A checkpoint answers while its job still runs (or after it failed): it is the tenant's all the same.
    ckpt = inference_repo.checkpoint(conn, job_id=job.id, step=step)
    if ckpt is None:
        raise _no_such_model(model)
    path = f"{str(ckpt.storage_key).rstrip('/')}/{CHECKPOINT_ADAPTER}"
    return Target(model=model, served=ckpt.id, adapter=Adapter(lora_name=ckpt.id, lora_path=path, base=job.model))


# -- the inference server's client ----------------------------------------------------------------------------

# One client (and its pool of connections) per event loop: an httpx client's connections belong to the loop that
# opened them.
_clients: RunVar[dict[tuple[str, float], httpx.AsyncClient]] = RunVar("proxima_inference_clients")
# lora_name → lora_path of the adapters this process registered, per inference server URL.
_registered: dict[str, dict[str, str]] = {}


def _client(settings: Settings) -> httpx.AsyncClient:
    assert settings.inference_url is not None
    key = (settings.inference_url, settings.inference_timeout_s)
    try:
        clients = _clients.get()
    except LookupError:
        clients = {}
        _clients.set(clients)
    if key not in clients:
        headers = {}
        if settings.inference_api_key is not None:
            headers["authorization"] = f"Bearer {settings.inference_api_key.get_secret_value()}"
        clients[key] = httpx.AsyncClient(
            base_url=settings.inference_url.rstrip("/"),
            headers=headers,
            timeout=httpx.Timeout(settings.inference_timeout_s, connect=min(10.0, settings.inference_timeout_s)),
            limits=httpx.Limits(max_connections=256, max_keepalive_connections=64),
        )
    return clients[key]


async def close_clients() -> None:
    """Close this event loop's clients and their connections: a loop that ends (a worker's eval run has one of its
    own) would otherwise leave them open until the process exits."""
    try:
        clients = _clients.get()
    except LookupError:
        return
    for client in clients.values():
        await client.aclose()
    clients.clear()


class _Refused(Exception):
    """The inference server answered an error: the answer to send the caller."""

    def __init__(self, response: Response) -> None:
        super().__init__()
        self.response = response


def _unavailable(message: str, *, code: str = "inference_unavailable") -> JSONResponse:
    return error_json(503, message, "server_error", code=code, **{"retry-after": str(RETRY_AFTER_S)})


def _upstream_error(body: bytes) -> dict[str, Any]:
    """The ``error`` object of an answer in OpenAI's envelope ({} when the answer is not one)."""
    try:
        data = json.loads(body)
    except ValueError:
        return {}
    error = data.get("error") if isinstance(data, dict) else None
    return error if isinstance(error, dict) else {}


def _passed_through(response: httpx.Response, target: Target, *, loading: bool = False) -> Response:
    """The caller's answer to the server's error ``response`` (read already)."""
    error = _upstream_error(response.content)
    message = str(error.get("message") or f"the inference server answered {response.status_code}")
    if target.adapter is not None:  # the server knows the adapter by its internal name: say the caller's
        message = message.replace(target.served, target.model)
    status = response.status_code
    if status in (401, 403):  # the API's own credentials: not the caller's business to fix
        log.error("the inference server refused the API's key (PROXIMA_INFERENCE_API_KEY): %s", message)
        return _unavailable("the inference server refused this API's credentials; the operator must check them")
    if status >= 500 or status < 400:
        log.error("the inference server failed (%d): %s", status, message)
        return _unavailable(f"the inference server failed: {message}", code="inference_error")
    if loading:
        message = f"The model `{target.model}` cannot be loaded: {message}"
        return error_json(status, message, "invalid_request_error", param="model", code=error.get("code"))
    param, code = error.get("param"), error.get("code")
    return error_json(
        400 if status == 422 else status,
        message,
        str(error.get("type") or "invalid_request_error"),
        param=param if isinstance(param, str) or param is None else str(param),
        code=code if isinstance(code, str) or code is None else str(code),
    )


async def _register(client: httpx.AsyncClient, url: str, target: Target, *, again: bool) -> None:
    """Register the target's adapter with the server (first use in this process, or ``again`` after the server
    forgot it). vLLM answers 400 to a name it already has: that is registered too."""
    adapter = target.adapter
    assert adapter is not None
    known = _registered.setdefault(url, {})
    if not again and known.get(adapter.lora_name) == adapter.lora_path:
        return
    body = {"lora_name": adapter.lora_name, "lora_path": adapter.lora_path, "base_model_name": adapter.base}
    response = await client.post(LOAD_ADAPTER_PATH, json=body)
    already = response.status_code == 400 and "already" in str(_upstream_error(response.content).get("message"))
    if response.status_code != 200 and not already:
        raise _Refused(_passed_through(response, target, loading=True))
    known[adapter.lora_name] = adapter.lora_path


async def _open(client: httpx.AsyncClient, path: str, body: dict[str, Any]) -> httpx.Response:
    return await client.send(client.build_request("POST", path, json=body), stream=True)


async def _forget_unknown(response: httpx.Response) -> bool:
    """Whether ``response`` is the server's 404 ``model_not_found`` (read and closed then)."""
    if response.status_code != 404:
        return False
    await response.aread()
    await response.aclose()
    return _upstream_error(response.content).get("code") == "model_not_found"


async def _send(client: httpx.AsyncClient, url: str, target: Target, path: str, body: dict[str, Any]) -> httpx.Response:
    """The server's answer, open (streamed): after registering the adapter, and once more after registering it
    again when the server did not know it."""
    if target.adapter is None:
        return await _open(client, path, body)
    await _register(client, url, target, again=False)
    response = await _open(client, path, body)
    if await _forget_unknown(response):
        _registered.get(url, {}).pop(target.adapter.lora_name, None)
        await _register(client, url, target, again=True)
        response = await _open(client, path, body)
    return response


# -- relaying -------------------------------------------------------------------------------------------------


def _renamed(data: bytes, target: Target) -> bytes:
    """A JSON answer with its ``model`` set to the caller's name for it, and an error's message (an error event in
    a stream) naming it so too; other JSON as it is."""
    try:
        obj = json.loads(data)
    except ValueError:
        return data
    if not isinstance(obj, dict):
        return data
    if "model" in obj:
        obj["model"] = target.model
    elif isinstance(error := obj.get("error"), dict) and isinstance(error.get("message"), str):
        error["message"] = error["message"].replace(target.served, target.model)
    else:
        return data
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode()


def _event(lines: list[bytes], target: Target) -> bytes:
    """One server-sent event, its ``data:`` JSON renamed, framed with its blank line."""
    out = []
    for line in lines:
        if line.startswith(b"data:"):
            payload = line[5:].strip()
            if payload and payload != b"[DONE]":
                line = b"data: " + _renamed(payload, target)
        out.append(line)
    return b"\n".join(out) + b"\n\n"


def _stream_error(message: str) -> bytes:
    """An error event as OpenAI's clients read one mid-stream (they raise it as an APIError)."""
    error = {"message": message, "type": "server_error", "param": None, "code": "inference_unavailable"}
    return b"data: " + json.dumps({"error": error}).encode() + b"\n\n"


async def _relay(response: httpx.Response, target: Target) -> AsyncIterator[bytes]:
    """The server's events as they arrive, each renamed; a server that fails mid-stream ends it with an error
    event. The upstream answer is closed however the stream ends (the caller gone included)."""
    lines: list[bytes] = []
    buffer = b""
    try:
        async for chunk in response.aiter_bytes():
            buffer += chunk
            *complete, buffer = buffer.split(b"\n")
            events = []
            for raw in complete:
                line = raw.rstrip(b"\r")
                if line:
                    lines.append(line)
                elif lines:
                    events.append(_event(lines, target))
                    lines = []
            if events:
                yield b"".join(events)
        if buffer.strip():
            lines.append(buffer.rstrip(b"\r"))
        if lines:
            yield _event(lines, target)
    except httpx.HTTPError as err:
        log.warning("the inference server's stream broke off for %s: %r", target.model, err)
        yield _stream_error("the inference server stopped answering during the stream; retry the request")
    finally:
        with anyio.CancelScope(shield=True):
            await response.aclose()


async def forward(
    *, settings: Settings, target: Target, path: str, body: ChatCompletionRequest | CompletionRequest
) -> Response:
    """Forward the request for ``target`` (``resolve``d for the caller) to the inference server's ``path`` and answer
    as it does: JSON, or (``stream``) server-sent events passed through as they arrive."""
    url = settings.inference_url
    if url is None:
        return _unavailable(
            "no inference server is configured: set PROXIMA_INFERENCE_URL (`proxima serve` starts one unless told "
            "--no-inference)"
        )
    client = _client(settings)
    try:
        response = await _send(client, url, target, path, body.forwarded(served=target.served))
    except _Refused as refused:
        return refused.response
    except httpx.TimeoutException:
        log.warning("the inference server at %s did not answer in time for %s", url, target.model)
        return _unavailable(f"the inference server did not answer within {settings.inference_timeout_s:g} s")
    except httpx.HTTPError as err:
        log.warning("the inference server at %s is unreachable: %r", url, err)
        return _unavailable("the inference server is unavailable; retry later")
    relayed = False
    try:
        if response.status_code != 200:
            await response.aread()
            return _passed_through(response, target)
        if body.stream and response.headers.get("content-type", "").startswith("text/event-stream"):
            relayed = True  # _relay closes it
            return StreamingResponse(
                _relay(response, target),
                media_type="text/event-stream",
                headers={"cache-control": "no-cache", "x-accel-buffering": "no"},
            )
        data = await response.aread()
    except httpx.HTTPError as err:
        log.warning("the inference server at %s broke off its answer: %r", url, err)
        return _unavailable("the inference server broke off its answer; retry later")
    finally:
        if not relayed:
            with anyio.CancelScope(shield=True):
                await response.aclose()
    return Response(_renamed(data, target), media_type="application/json")

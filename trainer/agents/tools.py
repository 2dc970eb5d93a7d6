"""What runs an agent episode's tool calls: a tool server over HTTP, or a Python environment in the sandbox.

`trainer.agents.episodes.EpisodeRunner` drives a `ToolExecutor` per job: `start` when an episode begins (a Python
environment's `reset` may replace its opening messages), `call` for each tool call the policy makes (from many threads
at once: the calls of a batch's episodes run concurrently), `finish` when the episode ends, `close` at the end of the
job. Whatever goes wrong with a call is a `ToolResult` with an error kind and the text the model is shown as the tool
message, never an exception out of `call` and never a wait past the deployment's time limits: one bad tool server or
environment never fails a job, and the job's metrics count the errors (`tools/errors/<name>`).

- `HttpToolExecutor`: OpenAI's agent RFT. Each call is a `POST` to the tool's `server_url` with its `headers` and a
  Responses `function_call` item as the body, plus the episode's `trace_id` and the dataset `item`:

      {"type": "function_call", "id": "fc_…", "call_id": <the model's call id>, "name": <tool>,
       "arguments": <the JSON text the model wrote>, "trace_id": "trace_…", "item": {…}}

  answered by a `function_call_output` item, `{"type": "function_call_output", "call_id": …, "output": <string>}` (a
  non-string output is shown as its JSON). The URL is checked against the deployment's policy and the request pinned
  to the checked address for every call, as an endpoint grader's is (`trainer.grading.url_policy`); requests and answers
  are at most 1 MiB; time limits, retries (timeouts, connection errors, 5xx, 429) and the bound on requests in flight
  per server are the deployment's `RemoteConfig`, shared with the remote graders (`trainer.grading.remote_graders`).
- `PythonEnvironmentExecutor`: the job's `environment` source, one sandbox per episode (`trainer.grading.sandbox.
  SandboxSession`, the python grader's bubblewrap: no network, limits on CPU, memory, processes and output), whose
  runner (`trainer.grading.environment_runner`) calls `reset(item)` at the start and `step(tool_call)` for each call. A
  step that raises, runs past the wall time, crashes the sandbox or returns something other than `(str, bool)` ends the
  episode (`done`), its message shown to the model.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, Self, get_args

import httpx

from trainer.grading.environments import environment_session
from trainer.grading.remote_graders import (
    CallFailed,
    HttpClient,
    RemoteConfig,
    short,
)
from trainer.grading.sandbox import SandboxConfig, SandboxSession, SessionStopped, configured_sandbox
from trainer.grading.url_policy import CLIENT_OPTIONS, Pinned, Resolver
from trainer.spec.agent_spec import EnvironmentSpec, ToolSpec
from trainer.spec.json_values import refuse_constant
from trainer.spec.urls import UrlRefused

ToolErrorKind = Literal[
    "timeout", "connection", "http_status", "too_large", "bad_answer", "unknown_tool", "refused_url", "environment"
]
"""Why a call has no answer: `timeout` and `connection` (after the retries), `http_status` (a 4xx, or a 5xx/429 after
the retries, or a redirect, which is not followed), `too_large` (a request or an answer over the bound),
`bad_answer` (not a function_call_output), `unknown_tool` (no tool of that name, or none with a server),
`refused_url` (the deployment's URL policy), `environment` (a Python environment's reset or step failed)."""
TOOL_ERROR_KINDS: tuple[str, ...] = get_args(ToolErrorKind)
MAX_TOOL_BYTES = 1 << 20
"""The bound on a tool request and on its answer (OpenAI's agent RFT: payloads up to 1 MB each way)."""


class ToolCallLike(Protocol):
    """A tool call as parsed from the model's turn (`trainer.agents.tool_calls.ToolCall` is one): its id, the tool's
    name and the arguments as the JSON text the model wrote."""

    @property
    def id(self) -> str: ...

    @property
    def name(self) -> str: ...

    @property
    def arguments(self) -> str: ...


@dataclass(frozen=True)
class ToolResult:
    """A tool call's result: `output`, the tool message's content the model sees (the answer, or what went wrong);
    `error`, None or why there is no answer; `seconds`, the wall time of the call, retries included; `done`, the
    episode ends here (a Python environment said so, or failed)."""

    output: str
    error: ToolErrorKind | None
    seconds: float
    done: bool = False


class ToolExecutor(Protocol):
    """Runs the tool calls of a job's episodes; thread-safe."""

    def start(
        self, item: Mapping[str, Any], trace_id: str, prompt_messages: Sequence[Mapping[str, Any]]
    ) -> list[dict[str, Any]] | None:
        """An episode begins: the messages that open it instead of `prompt_messages` (a Python environment's
        reset), or None to keep them."""
        ...

    def call(self, call: ToolCallLike, tool: ToolSpec | None, *, item: Mapping[str, Any], trace_id: str) -> ToolResult:
        """Run one call (`tool`: the episode's tool of that name, None when it offers none); blocks, bounded by the
        time limits; never raises for what the tool or the environment does."""
        ...

    def finish(self, trace_id: str) -> None:
        """The episode has ended: release what it holds."""
        ...

    def close(self) -> None:
        """The job is done: release everything."""
        ...


def new_trace_id() -> str:
    """An episode's trace id, `trace_<hex>` (the same in every tool call of the episode)."""
    return f"trace_{uuid.uuid4().hex}"


def _seconds_since(start: float) -> float:
    return time.monotonic() - start


# ----------------------------------------------------------------------------------------------------
# Tool servers over HTTP


class HttpToolExecutor:
    """Calls tool servers as OpenAI's agent RFT does (see the module's docstring), with the deployment's limits.

    The requests run on one event loop in a thread of this executor (tool calls wait on the network: one loop carries
    any number of them), with one HTTP client whose connections are reused across calls; `call` hands its request to
    that loop and waits for the result, so it may be called from any number of threads. At most `config.concurrency`
    requests are in flight to one server (`host:port`) at once, the others wait their turn. Each request has
    `config.timeout_s` for the whole exchange; timeouts, connection errors, 5xx and 429 are retried `max_retries`
    times after `backoff_s`, twice that, … (with jitter, a `Retry-After` honoured): a call takes at most about
    `(max_retries + 1) × timeout_s` plus the backoffs, and its turn in the queue of its server. `resolver` replaces
    DNS (tests)."""

    def __init__(
        self, config: RemoteConfig, *, max_bytes: int = MAX_TOOL_BYTES, resolver: Resolver | None = None
    ) -> None:
        if max_bytes < 1:
            raise ValueError(f"max_bytes must be positive, not {max_bytes}")
        self.config = config
        self.max_bytes = max_bytes
        self._policy = config.url_policy
        self._resolver = resolver
        self._closed = False
        self._close_lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="tool-calls", daemon=True)
        self._thread.start()
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=config.concurrency)
        self._client = httpx.AsyncClient(timeout=config.timeout_s, limits=limits, **CLIENT_OPTIONS)
        # The remote graders' HTTP layer: one request within timeout_s and at most max_bytes read, the slots bounding
        # requests per server, the backoff. Used from the loop's thread only (its semaphores belong to the loop).
        self._http = HttpClient(self._client, config)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(
        self, item: Mapping[str, Any], trace_id: str, prompt_messages: Sequence[Mapping[str, Any]]
    ) -> list[dict[str, Any]] | None:
        """Tool servers keep no episode here (they see its `trace_id` in each call): the prompt stays."""
        return None

    def call(self, call: ToolCallLike, tool: ToolSpec | None, *, item: Mapping[str, Any], trace_id: str) -> ToolResult:
        """POST the call to its tool's server and the answer's `output`; every failure is a ToolResult with its
        kind. Raises RuntimeError only when the executor is closed (the caller's mistake)."""
        start = time.monotonic()
        with self._close_lock:  # submitted before close() stops the loop, or not at all
            if self._closed:
                raise RuntimeError("the tool executor is closed")
            future = asyncio.run_coroutine_threadsafe(self._call(call, tool, item, trace_id, start), self._loop)
        try:
            return future.result()
        except Exception as err:  # a fault of this module's own, kept inside the episode like any other
            detail = short(f"{type(err).__name__}: {err}", 200)
            return ToolResult(
                f"Error: the call to {call.name!r} failed ({detail})", "connection", _seconds_since(start)
            )

    def finish(self, trace_id: str) -> None:
        """Nothing is held per episode."""

    def close(self) -> None:
        """Close the HTTP client and stop the loop's thread; calls in flight end with an error. Idempotent."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        try:
            asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop).result(timeout=10.0)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10.0)
            if not self._thread.is_alive():
                self._loop.close()

    async def _shutdown(self) -> None:
        """Cancel the calls in flight (their callers get an error) and close the client."""
        tasks = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self._client.aclose()

    async def _call(
        self, call: ToolCallLike, tool: ToolSpec | None, item: Mapping[str, Any], trace_id: str, start: float
    ) -> ToolResult:
        """The call checked against the tool it names, its server's address resolved and pinned, the request sent
        (and retried) and the answer read; each failure a ToolResult with its kind."""

        def failed(kind: ToolErrorKind, message: str) -> ToolResult:
            return ToolResult(f"Error: {message}", kind, _seconds_since(start))

        if tool is None or tool.name != call.name:
            return failed("unknown_tool", f"there is no tool named {short(call.name, 100)!r}")
        if tool.server_url is None:
            return failed("unknown_tool", f"the tool {tool.name!r} has no server to call")
        try:
            pinned = await self._pin(tool.name, tool.server_url)
            body = self._body(call, tool.name, item, trace_id)
            status, content = await self._post(tool, pinned, body)
        except _CallRefused as err:
            return failed(err.kind, err.message)
        output, error = _answer(status, content, call.id, tool.name)
        return ToolResult(output, error, _seconds_since(start))

    async def _pin(self, name: str, server_url: str) -> Pinned:
        """The request to the tool's server, pinned to an address the URL policy allows."""
        try:
            async with asyncio.timeout(self.config.timeout_s):  # a DNS server that does not answer
                return await self._policy.resolve(server_url, self._resolver)
        except UrlRefused as err:
            raise _CallRefused("refused_url", f"the server of the tool {name!r} may not be called: {err}") from None
        except TimeoutError:
            raise _CallRefused(
                "timeout", f"the host of the tool {name!r} did not resolve within {self.config.timeout_s:g} s"
            ) from None

    def _body(self, call: ToolCallLike, name: str, item: Mapping[str, Any], trace_id: str) -> bytes:
        """The function_call payload as JSON, at most ``max_bytes`` long."""
        payload = {
            "type": "function_call",
            "id": f"fc_{uuid.uuid4().hex}",
            "call_id": call.id,
            "name": call.name,
            "arguments": call.arguments,
            "trace_id": trace_id,
            "item": item,
        }
        try:
            body = json.dumps(payload, ensure_ascii=False, allow_nan=False).encode("utf-8")
        except (ValueError, TypeError) as err:  # an item or arguments that JSON cannot carry (NaN, a lone surrogate)
            raise _CallRefused(
                "too_large", f"the call to {name!r} cannot be sent as JSON ({short(str(err), 200)})"
            ) from None
        if len(body) > self.max_bytes:
            raise _CallRefused(
                "too_large", f"the call to {name!r} is {len(body)} bytes long; at most {self.max_bytes} are sent"
            )
        return body

    async def _post(self, tool: ToolSpec, pinned: Pinned, body: bytes) -> tuple[int, bytes]:
        """The status and content of the server's final answer (not a 5xx or 429): a timeout, a connection error, a
        5xx or a 429 is tried again, ``max_retries`` times after growing backoffs, in the server's turn of slots."""
        own = {k: v for k, v in tool.headers.items() if k.lower() not in _SET_HEADERS}
        headers = {**own, "Content-Type": "application/json", **pinned.headers}
        service = f"tool {pinned.url.host}:{pinned.url.port or (443 if pinned.url.scheme == 'https' else 80)}"
        last: tuple[ToolErrorKind, str] = ("connection", "no request was made")
        retry_after: float | None = None
        tries = self.config.max_retries + 1
        for attempt in range(tries):
            if attempt:
                await asyncio.sleep(self._http.backoff(attempt, retry_after))
            retry_after = None
            try:
                async with self._http.slot(service):
                    status, content, retry_after = await self._http.once(
                        pinned.request_url, body, headers, pinned.extensions, self.max_bytes
                    )
            except CallFailed as err:
                if err.cause == "too_large":
                    raise _CallRefused(
                        "too_large", f"the answer of {tool.name!r} is larger than {self.max_bytes} bytes"
                    ) from None
                kind: ToolErrorKind = "timeout" if err.cause == "timeout" else "connection"
                last = (kind, f"the tool {tool.name!r} did not answer ({err.detail})")
                continue
            if status >= 500 or status == 429:
                last = ("http_status", f"the tool {tool.name!r} failed with HTTP {status}: {short(_text(content))}")
                continue
            return status, content
        kind, message = last
        raise _CallRefused(kind, f"{message} (after {tries} tr{'y' if tries == 1 else 'ies'})")


class _CallRefused(Exception):
    """A tool call that ends before an answer: its error kind and the message the model is shown."""

    def __init__(self, kind: ToolErrorKind, message: str) -> None:
        super().__init__(message)
        self.kind, self.message = kind, message


_SET_HEADERS = frozenset({"host", "content-type", "content-length", "transfer-encoding"})
"""Headers this module sets: a tool's own of these names are left out (a second Host could undo the pinning)."""


def _text(content: bytes) -> str:
    return content.decode("utf-8", errors="replace")


def _answer(status: int, content: bytes, call_id: str, name: str) -> tuple[str, ToolErrorKind | None]:
    """(output, error) of a tool server's final answer (not a 5xx or 429, which are retried). A 2xx must be a
    function_call_output item; a 4xx's `output`, when it has one, is shown, else its payload as it came; a 3xx is
    not followed."""
    if 300 <= status < 400:
        return f"Error: the tool {name!r} answered HTTP {status}, a redirect, which is not followed", "http_status"
    try:
        answer = json.loads(content, parse_constant=refuse_constant)
    except (ValueError, RecursionError):
        answer = None
    output = _output(answer, call_id)
    if status >= 400:
        if output is not None:
            return output, "http_status"
        return (
            _text(content) if content.strip() else f"Error: the tool {name!r} answered HTTP {status}"
        ), "http_status"
    if output is None:
        return (
            f"Error: the answer of {name!r} is not a function_call_output with an output: {short(_text(content))}",
            "bad_answer",
        )
    return output, None


def _output(answer: Any, call_id: str) -> str | None:
    """The output of a `{"type": "function_call_output", "call_id", "output"}` answer (type and call_id may be left
    out, but when there must be these), a non-string one as its JSON; None for anything else."""
    if not isinstance(answer, dict) or "output" not in answer:
        return None
    if answer.get("type", "function_call_output") != "function_call_output":
        return None
    if answer.get("call_id", call_id) != call_id:
        return None
    output = answer["output"]
    return output if isinstance(output, str) else json.dumps(output, ensure_ascii=False)


# ----------------------------------------------------------------------------------------------------
# Python environments in the sandbox


class EnvironmentFailed(RuntimeError):
    """An episode's environment could not begin: its source does not load (it does not parse, defines no usable
    `reset` and `step`, or its top-level code raised or ran too long) or its `reset` failed. The message says
    which; the episode cannot run. (A sandbox that does not start at all is `SandboxUnavailable`.)"""


@dataclass
class _Episode:
    session: SandboxSession | None
    lock: threading.Lock = field(default_factory=threading.Lock)


class PythonEnvironmentExecutor:
    """Runs a job's `environment` (see the module's docstring): one sandbox per episode, from `start` to `finish`.

    Limits (`config`, the python grader's `SandboxConfig`; unless given, this process's: `configure_sandbox`, its
    packages folder included): `startup_timeout_s` for the sandbox to start and the
    source's top-level code to run, `sample_timeout_s` of wall time for `reset` and for each `step`, `cpu_seconds` of
    CPU time per episode, memory, processes, output and files as a grader's. Each episode holds one of the host's
    `uid_slots` while it runs: more concurrent episodes (and grading batches) than slots wait for one up to
    `slot_wait_s`. The environment answers every tool call, whatever its name (the tools an environment's job lists
    only say what the model is shown). The calls of one episode are run one at a time, in the order they take the
    episode's lock: a caller that wants them in order makes them from one thread."""

    def __init__(self, spec: EnvironmentSpec, config: SandboxConfig | None = None) -> None:
        self.spec = spec
        self.config = config or configured_sandbox()  # this process's packages folder and limits
        self._episodes: dict[str, _Episode] = {}
        self._lock = threading.Lock()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(
        self, item: Mapping[str, Any], trace_id: str, prompt_messages: Sequence[Mapping[str, Any]]
    ) -> list[dict[str, Any]] | None:
        """Start the episode's sandbox, load the source and call `reset(item)`: the messages it returns, or None
        (None or []: the episode opens with `prompt_messages`, the dataset line's). Raises EnvironmentFailed when the
        source or reset fails (the sandbox is gone then), SandboxUnavailable when no sandbox starts, ValueError for a
        trace id already running."""
        with self._lock:
            if trace_id in self._episodes:
                raise ValueError(f"the episode {trace_id!r} has already started")
            episode = self._episodes[trace_id] = _Episode(None)  # reserved: a second start of it fails meanwhile
        try:
            with episode.lock:
                episode.session, messages = self._begin(item)
            return messages
        except BaseException:
            with self._lock:
                self._episodes.pop(trace_id, None)
            raise

    def _begin(self, item: Mapping[str, Any]) -> tuple[SandboxSession, list[dict[str, Any]] | None]:
        """A sandbox with the source loaded and reset(item) called, and the messages reset returned."""
        session = environment_session(self.config)
        try:
            ready = self._request(session, {"source": self.spec.source}, self.config.startup_timeout_s, "load")
            if "fatal" in ready:
                raise EnvironmentFailed(f"the environment {self.spec.name!r} does not load: {ready['fatal']}")
            if ready != {"ready": True}:
                raise EnvironmentFailed(f"the environment {self.spec.name!r} answered something that is not ready")
            reply = self._request(session, {"reset": dict(item)}, self.config.sample_timeout_s, "reset")
        except BaseException:
            session.close()
            raise
        messages = reply.get("messages")
        if "error" in reply or len(reply) != 1 or not (messages is None or _is_messages(messages)):
            session.close()
            detail = reply.get("error", "its reply to reset is not a list of messages")
            raise EnvironmentFailed(f"the environment {self.spec.name!r} could not reset: {detail}")
        return session, messages

    def _request(self, session: SandboxSession, message: dict[str, Any], timeout_s: float, what: str) -> dict[str, Any]:
        try:
            return session.request(message, timeout_s)
        except SessionStopped as stop:
            raise EnvironmentFailed(
                f"the environment {self.spec.name!r} failed in {what}: {self._stopped(stop, timeout_s, what)}"
            ) from None

    def _stopped(self, stop: SessionStopped, timeout_s: float, what: str) -> str:
        """What the model and the job are told of a sandbox that stopped."""
        match stop.kind:
            case "timeout":
                return f"{what} took longer than {timeout_s:g} s"
            case "cpu_limit":
                return f"the episode's CPU time of {self.config.cpu_seconds} s is spent"
            case "output_limit":
                return f"the environment printed more than {self.config.output_bytes} bytes"
            case _:
                return stop.message

    def call(self, call: ToolCallLike, tool: ToolSpec | None, *, item: Mapping[str, Any], trace_id: str) -> ToolResult:
        """`step({"id", "name", "arguments"})` in the episode's sandbox: its `(content, done)`. A step that raises,
        runs past `sample_timeout_s`, crashes the sandbox or returns anything else ends the episode: error
        `environment`, `done`, the sandbox gone, and the reason as the output. A call to an episode that has ended
        (or never started) is such an error too."""
        start = time.monotonic()
        with self._lock:
            episode = self._episodes.get(trace_id)
        if episode is None:
            return ToolResult("Error: the environment is not running for this episode", "environment", 0.0, True)
        with episode.lock:
            session = episode.session
            if session is None or not session.alive:
                episode.session = None
                return ToolResult("Error: the environment has ended this episode", "environment", 0.0, True)
            step = {"id": call.id, "name": call.name, "arguments": call.arguments}
            timeout_s = self.config.sample_timeout_s
            try:
                reply = session.request({"step": step}, timeout_s)
            except SessionStopped as stop:
                episode.session = None
                return ToolResult(
                    f"Error: {self._stopped(stop, timeout_s, 'step')}", "environment", _seconds_since(start), True
                )
            content, done = reply.get("content"), reply.get("done")
            if len(reply) == 2 and isinstance(content, str) and isinstance(done, bool):
                if done:  # the episode is over: its sandbox need not wait for finish
                    episode.session = None
                    session.close(graceful=True)
                return ToolResult(content, None, _seconds_since(start), done)
            episode.session = None
            session.close()
            error = reply.get("error")
            message = error if len(reply) == 1 and isinstance(error, str) else "the environment answered garbage"
            return ToolResult(f"Error: {message}", "environment", _seconds_since(start), True)

    def finish(self, trace_id: str) -> None:
        """End the episode's sandbox (if it still runs) and release its uid slot. Idempotent."""
        with self._lock:
            episode = self._episodes.pop(trace_id, None)
        if episode is None:
            return
        with episode.lock:
            session, episode.session = episode.session, None
        if session is not None:
            session.close(graceful=True)

    def close(self) -> None:
        """Finish every episode still running."""
        with self._lock:
            running = list(self._episodes)
        for trace_id in running:
            self.finish(trace_id)


def _is_messages(value: Any) -> bool:
    return isinstance(value, list) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in value
    )

"""The graders that call out over HTTP, each scored over a whole batch of samples with concurrent requests:

- `score_model` and `label_model`: a judge model behind the deployment's OpenAI-compatible chat-completions endpoint
  (`JudgeConfig`: its base URL, its key, and the judge models a grader's `model` may name, each mapped to the name the
  endpoint knows). The tenant names a model, never a URL.
- `endpoint`: the tenant's own grading service, at a URL the deployment's policy allows (`trainer.grading.url_policy`:
no
  internal addresses by default), each request connected to the address that was checked.
- `text_similarity` with `evaluation_metric: cosine`: the cosine similarity of two embeddings from the deployment's
  OpenAI-compatible embeddings endpoint (`EmbeddingsConfig`).

`grade_remote_leaves` returns each remote leaf's scores over the batch, keyed as `trainer.grading.graders.grade` reads
them from `model_scores`, and each sample's problems as `GradeError`s (`trainer.loops.evaluate.grade_batch` merges both,
as it does a python grader's).

Every request has a hard time limit (`RemoteConfig.timeout_s`, the whole exchange: connection, upload and answer), is
retried up to `max_retries` times after a timeout, a connection error, an HTTP 5xx or a 429, waiting `backoff_s`, then
twice that, ... (at most MAX_BACKOFF_S, with jitter; a server's `Retry-After` is honoured up to MAX_RETRY_AFTER_S),
and at most `concurrency` requests go to one service at once. A sample whose request fails for good scores 0.0 with a
failure kind (`trainer.spec.graders.FAILURE_KINDS`), which the job counts (`trainer.loops.evaluate.GraderMonitor`):
one bad answer never fails a job, a grader that fails on most samples does. Answers are parsed strictly: a judge's
answer must be OpenAI's structured result (JSON, asked for with `response_format` and accepted as well from a server
that ignores it), an endpoint's `{"score": number}`; a number is never fished out of prose.

Judge calls are counted against a budget (`JudgeBudget`, every request including retries): the worker gives each
trainer process its job's budget (`RemoteConfig.max_judge_calls`); once it is spent `BudgetSpent` is raised, which
fails the job (`trainer.spec.graders.GraderFailed`) rather than train on rewards that are no longer the grader's.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import re
import threading
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeGuard

import httpx
from pydantic import BaseModel, ConfigDict, Field, model_validator

from trainer.grading import similarity
from trainer.grading.graders import render, sample_object
from trainer.grading.url_policy import CLIENT_OPTIONS, Pinned, Resolver, UrlPolicy
from trainer.spec import graders
from trainer.spec.graders import GradeError, GradeErrorKind
from trainer.spec.json_values import refuse_constant
from trainer.spec.urls import UrlRefused

MAX_BACKOFF_S = 8.0
MAX_RETRY_AFTER_S = 30.0
MAX_ANSWER_BYTES = 1 << 20
"""The largest answer read from a judge or an endpoint (a larger one is a failed request, not a partial read)."""
MAX_EMBEDDINGS_ANSWER_BYTES = 64 << 20
MAX_ENDPOINT_REQUEST_BYTES = 1 << 20
"""OpenAI's bound on an endpoint grader's request ("max input payload 1 MB"): a larger sample fails unsent."""
MAX_DETAIL_CHARS = 300


class JudgeConfig(BaseModel):
    """The deployment's judge: `base_url` of an OpenAI-compatible API (`…/v1`; requests go to
    `{base_url}/chat/completions`), its key, and `models`: {grader `model` a tenant may name: the model name sent}."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    base_url: str = Field(min_length=1)
    api_key: str | None = Field(default=None, repr=False)
    models: dict[str, str] = Field(default_factory=dict)


class EmbeddingsConfig(BaseModel):
    """The deployment's embeddings endpoint for `cosine`: `{base_url}/embeddings` with `model`; `batch_size` texts
    per request."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    base_url: str = Field(min_length=1)
    api_key: str | None = Field(default=None, repr=False)
    model: str = Field(min_length=1)
    batch_size: int = Field(default=64, ge=1, le=2048)


class RemoteConfig(BaseModel):
    """Everything the remote graders of one process need, as the worker hands it to the trainer (JSON): the judge,
    the embeddings endpoint, the URL policy of endpoint graders, and the limits of every request."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    judge: JudgeConfig | None = None
    embeddings: EmbeddingsConfig | None = None
    url_schemes: tuple[str, ...] = ("https",)
    allow_networks: tuple[str, ...] = ()
    deny_networks: tuple[str, ...] = ()
    timeout_s: float = Field(default=60.0, gt=0)
    max_retries: int = Field(default=3, ge=0, le=10)
    backoff_s: float = Field(default=0.5, ge=0)
    concurrency: int = Field(default=16, ge=1, le=1024)
    max_judge_calls: int | None = Field(default=100_000, ge=0)

    @model_validator(mode="after")
    def _valid_policy(self) -> RemoteConfig:
        self.url_policy  # noqa: B018 — builds the policy: a bad network or scheme fails here, not at the first batch
        return self

    @property
    def url_policy(self) -> UrlPolicy:
        return UrlPolicy(self.url_schemes, self.allow_networks, self.deny_networks)


class BudgetSpent(RuntimeError):
    """The job's judge calls are spent."""


class JudgeBudget:
    """The judge calls a process may still make (None: no bound); every request counts, retries included.
    Thread-safe: one budget serves every batch of a trainer process."""

    def __init__(self, max_calls: int | None) -> None:
        self.max_calls = max_calls
        self.used = 0
        self._lock = threading.Lock()

    def take(self) -> None:
        with self._lock:
            if self.max_calls is not None and self.used >= self.max_calls:
                raise BudgetSpent(
                    f"this job has made its budget of {self.max_calls} judge calls (set by the deployment), so its "
                    "score_model and label_model graders cannot score more samples"
                )
            self.used += 1


@dataclass(frozen=True)
class RemoteScores:
    """The remote leaves' scores over a batch: `scores[key][i]` for sample i, keyed as `model_scores` is;
    `errors[i]`, the problems of sample i; `token_usage`, the judge's tokens by grader `model` (prompt_tokens,
    completion_tokens, total_tokens, as the endpoint reported them)."""

    scores: dict[str, list[float]]
    errors: list[list[GradeError]]
    token_usage: dict[str, dict[str, int]] = field(default_factory=dict)


class ConfigMissing(graders.GraderError):
    """A remote leaf this process has no service for; `code`: `judge_unavailable` (no judge configured),
    `model_not_available` (a judge model the deployment does not offer), `embeddings_unavailable`."""

    def __init__(self, message: str, *, param: str, code: str) -> None:
        super().__init__(message, param=param)
        self.code = code


def missing_service(leaf: graders.RemoteGrader, config: RemoteConfig, param: str) -> ConfigMissing | None:
    """Why `config` cannot score the leaf (its param path names the field to blame), or None when it can."""
    match leaf:
        case graders.ScoreModelGrader() | graders.LabelModelGrader():
            if config.judge is None:
                return ConfigMissing(
                    f"{param}: {leaf.type} graders need a judge model, and this deployment has no judge configured "
                    "(PROXIMA_JUDGE_BASE_URL)",
                    param=f"{param}.model",
                    code="judge_unavailable",
                )
            if leaf.model not in config.judge.models:
                offered = ", ".join(sorted(config.judge.models)) or "none"
                return ConfigMissing(
                    f"{param}.model: judge model {leaf.model!r} is not offered by this deployment; offered: {offered}",
                    param=f"{param}.model",
                    code="model_not_available",
                )
        case graders.TextSimilarityGrader():
            if config.embeddings is None:
                return ConfigMissing(
                    f"{param}.evaluation_metric: cosine needs an embeddings endpoint, and this deployment has none "
                    "configured (PROXIMA_EMBEDDINGS_BASE_URL)",
                    param=f"{param}.evaluation_metric",
                    code="embeddings_unavailable",
                )
        case graders.EndpointGrader():
            pass
    return None


# ----------------------------------------------------------------------------------------------------
# Answers, parsed strictly (pure functions)


class AnswerError(ValueError):
    """An answer that is not what was asked for; the message says how."""


_FENCE_RE = re.compile(r"```(?:json)?[ \t]*\n?(.*?)\n?[ \t]*```", re.DOTALL)


def json_object(text: str) -> dict[str, Any]:
    """The JSON object that is the whole text, or the whole of one ```json fenced block (how a server that ignores
    `response_format` tends to answer); AnswerError otherwise."""
    body = text.strip()
    if (fence := _FENCE_RE.fullmatch(body)) is not None:
        body = fence.group(1).strip()
    try:
        value = json.loads(body, parse_constant=refuse_constant)
    except (ValueError, RecursionError):
        raise AnswerError(f"not a JSON object: {short(text)}") from None
    if not isinstance(value, dict):
        raise AnswerError(f"not a JSON object: {short(text)}")
    return value


def _steps_ok(answer: dict[str, Any]) -> None:
    steps = answer.get("steps")
    if steps is not None and not isinstance(steps, list):
        raise AnswerError(f"'steps' is not a list: {short(json.dumps(steps))}")


def parse_score(content: str, low: float, high: float) -> float:
    """A score_model judge's answer `{"steps": [...], "result": <number>}` → result, which must be a finite number in
    [low, high] (a bool or a numeric string is not a number)."""
    answer = json_object(content)
    _steps_ok(answer)
    result = answer.get("result")
    if not _is_number(result):
        raise AnswerError(f"'result' is not a number: {short(json.dumps(result))}")
    value = float(result)
    if not math.isfinite(value):
        raise AnswerError(f"'result' is not finite: {value}")
    if not low <= value <= high:
        raise AnswerError(f"'result' {value:g} is outside the grader's range [{low:g}, {high:g}]")
    return value


def parse_label(content: str, labels: Sequence[str]) -> str:
    """A label_model judge's answer `{"steps": [...], "result": "<label>"}` → the label, which must be one of
    `labels` exactly."""
    answer = json_object(content)
    _steps_ok(answer)
    result = answer.get("result")
    if not isinstance(result, str) or result not in labels:
        raise AnswerError(f"'result' {short(json.dumps(result))} is not one of the labels {list(labels)}")
    return result


def judge_message(answer: Any) -> tuple[str | None, str | None]:
    """(content, refusal) of a chat completion's first choice; AnswerError when it has none."""
    choices = answer.get("choices") if isinstance(answer, dict) else None
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise AnswerError(f"a chat completion without choices: {short(json.dumps(answer))}")
    message = choices[0].get("message")
    if not isinstance(message, dict):
        raise AnswerError("a chat completion choice without a message")
    content, refusal = message.get("content"), message.get("refusal")
    if not isinstance(refusal, str | None) or not isinstance(content, str | None):
        raise AnswerError("a message whose content or refusal is not a string")
    if content is None and not refusal:
        raise AnswerError("a message with neither content nor refusal")
    return content, refusal or None


def parse_endpoint_score(answer: Any) -> float:
    """An endpoint grader's answer `{"score": <number>}` → the score (finite; other keys are ignored)."""
    if not isinstance(answer, dict):
        raise AnswerError(f"not a JSON object: {short(json.dumps(answer))}")
    score = answer.get("score")
    if not _is_number(score) or not math.isfinite(float(score)):
        raise AnswerError(f"'score' is not a finite number: {short(json.dumps(score))}")
    return float(score)


def parse_embeddings(answer: Any, n: int) -> list[list[float]]:
    """An embeddings answer `{"data": [{"index": i, "embedding": [floats]}, ...]}` for n inputs → the n vectors in
    input order (by `index`, else by position); each must be a non-empty list of finite numbers, all of one length."""
    data = answer.get("data") if isinstance(answer, dict) else None
    if not isinstance(data, list) or len(data) != n:
        got = len(data) if isinstance(data, list) else "no"
        raise AnswerError(f"{got} embeddings for {n} inputs")
    vectors: list[list[float] | None] = [None] * n
    for position, entry in enumerate(data):
        index = entry.get("index", position) if isinstance(entry, dict) else None
        vector = entry.get("embedding") if isinstance(entry, dict) else None
        if not isinstance(index, int) or isinstance(index, bool) or not 0 <= index < n or vectors[index] is not None:
            raise AnswerError(f"embedding {position} has a missing, repeated or out-of-range index")
        if not isinstance(vector, list) or not vector or not all(_is_number(x) for x in vector):
            raise AnswerError(f"embedding {position} is not a list of numbers")
        floats = [float(x) for x in vector]
        if not all(math.isfinite(x) for x in floats):
            raise AnswerError(f"embedding {position} holds a non-finite number")
        vectors[index] = floats
    out = [v for v in vectors if v is not None]
    if len({len(v) for v in out}) != 1:
        raise AnswerError("embeddings of different lengths")
    return out


def cosine(a: Sequence[float], b: Sequence[float]) -> float:
    """a·b / (|a| |b|); ValueError for a zero vector (no direction to compare)."""
    norm = math.sqrt(math.fsum(x * x for x in a)) * math.sqrt(math.fsum(y * y for y in b))
    if norm == 0.0:
        raise ValueError("an embedding is the zero vector")
    return math.fsum(x * y for x, y in zip(a, b, strict=True)) / norm


def score_schema() -> dict[str, Any]:
    """The JSON schema a score_model judge is asked to answer in (OpenAI's: reasoning steps, then the result)."""
    return _result_schema({"type": "number"})


def label_schema(labels: Sequence[str]) -> dict[str, Any]:
    """The JSON schema a label_model judge is asked to answer in: the result is one of the labels."""
    return _result_schema({"type": "string", "enum": list(labels)})


def _result_schema(result: dict[str, Any]) -> dict[str, Any]:
    step = {
        "type": "object",
        "properties": {"description": {"type": "string"}, "conclusion": {"type": "string"}},
        "required": ["description", "conclusion"],
        "additionalProperties": False,
    }
    return {
        "type": "object",
        "properties": {"steps": {"type": "array", "items": step}, "result": result},
        "required": ["steps", "result"],
        "additionalProperties": False,
    }


def _is_number(value: Any) -> TypeGuard[int | float]:
    return isinstance(value, int | float) and not isinstance(value, bool)


def short(text: str, limit: int = MAX_DETAIL_CHARS) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


# ----------------------------------------------------------------------------------------------------
# HTTP: retries, time limits, bounded answers


class CallFailed(Exception):
    """A request that produced no usable answer: `cause` (`timeout`, `connection`, `http_503`, `too_large`,
    `not_json`, `redirect`, `url_not_allowed`, `request_too_large`, `deadline`) and a detail for the message."""

    def __init__(self, cause: str, detail: str) -> None:
        super().__init__(detail)
        self.cause = cause
        self.detail = detail


_RETRIED = frozenset({"timeout", "connection"})


class _RateLimiter:
    """Request starts at least 1/per_second seconds apart (one event loop: no lock needed)."""

    def __init__(self, per_second: int | None) -> None:
        self.interval = 1.0 / per_second if per_second else 0.0
        self.next_at = 0.0

    async def wait(self) -> None:
        if not self.interval:
            return
        now = asyncio.get_running_loop().time()
        at = max(now, self.next_at)
        self.next_at = at + self.interval
        if at > now:
            await asyncio.sleep(at - now)


@dataclass
class HttpClient:
    client: httpx.AsyncClient
    config: RemoteConfig
    slots: dict[str, asyncio.Semaphore] = field(default_factory=dict)

    def slot(self, service: str) -> asyncio.Semaphore:
        if service not in self.slots:
            self.slots[service] = asyncio.Semaphore(self.config.concurrency)
        return self.slots[service]

    async def post_json(
        self,
        url: str | httpx.URL,
        body: bytes,
        *,
        service: str,
        headers: Mapping[str, str],
        extensions: Mapping[str, Any] | None = None,
        max_bytes: int = MAX_ANSWER_BYTES,
        before_attempt: Callable[[], Awaitable[None]] | None = None,
    ) -> Any:
        """POST `body` (JSON) and the parsed JSON answer, retrying what may pass (timeouts, connection errors, 5xx,
        429) with backoff; CallFailed when there is no usable answer after the retries (or at once for another 4xx,
        a redirect or an answer that is not JSON)."""
        last: CallFailed | None = None
        retry_after: float | None = None
        for attempt in range(self.config.max_retries + 1):
            if attempt:
                await asyncio.sleep(self.backoff(attempt, retry_after))
            if before_attempt is not None:
                await before_attempt()
            try:
                async with self.slot(service):
                    status, content, retry_after = await self.once(url, body, headers, extensions, max_bytes)
            except CallFailed as failed:
                if failed.cause not in _RETRIED:
                    raise
                last = failed
                continue
            if status >= 500 or status == 429:
                last = CallFailed(f"http_{status}", f"HTTP {status}: {short(_text(content))}")
                continue
            if 300 <= status < 400:
                raise CallFailed("redirect", f"HTTP {status}: redirects are not followed")
            if status >= 400:
                raise CallFailed(f"http_{status}", f"HTTP {status}: {short(_text(content))}")
            try:
                return json.loads(content, parse_constant=refuse_constant)
            except (ValueError, RecursionError):
                raise CallFailed("not_json", f"the answer is not JSON: {short(_text(content))}") from None
        assert last is not None
        tries = self.config.max_retries + 1
        raise CallFailed(last.cause, f"after {tries} tr{'y' if tries == 1 else 'ies'}: {last.detail}")

    async def once(
        self,
        url: str | httpx.URL,
        body: bytes,
        headers: Mapping[str, str],
        extensions: Mapping[str, Any] | None,
        max_bytes: int,
    ) -> tuple[int, bytes, float | None]:
        """(status, body, Retry-After seconds) of one request, all of it within `timeout_s`."""
        timeout = self.config.timeout_s
        try:
            async with asyncio.timeout(timeout):
                async with self.client.stream(
                    "POST", url, content=body, headers=dict(headers), extensions=dict(extensions or {})
                ) as response:
                    data = bytearray()
                    async for chunk in response.aiter_bytes():
                        data += chunk
                        if len(data) > max_bytes:
                            raise CallFailed("too_large", f"the answer is larger than {max_bytes} bytes")
                    return response.status_code, bytes(data), _retry_after(response.headers.get("retry-after"))
        except TimeoutError:
            raise CallFailed("timeout", f"no answer within {timeout:g} s") from None
        except httpx.TimeoutException:
            raise CallFailed("timeout", f"no answer within {timeout:g} s") from None
        except (httpx.TransportError, OSError) as err:
            detail = f"connection failed ({type(err).__name__}: {short(str(err), 200)})"
            raise CallFailed("connection", detail) from None

    def backoff(self, attempt: int, retry_after: float | None) -> float:
        wait = min(MAX_BACKOFF_S, self.config.backoff_s * 2 ** (attempt - 1)) * random.uniform(0.5, 1.0)
        if retry_after is not None:
            wait = max(wait, min(retry_after, MAX_RETRY_AFTER_S))
        return wait


def _retry_after(value: str | None) -> float | None:
    try:
        seconds = float(value) if value is not None else None
    except ValueError:
        return None  # an HTTP date: ignored (the backoff applies)
    return seconds if seconds is not None and math.isfinite(seconds) and seconds >= 0 else None


def _text(content: bytes) -> str:
    return content.decode("utf-8", errors="replace")


def _auth(api_key: str | None) -> dict[str, str]:
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    return headers


# ----------------------------------------------------------------------------------------------------
# Grading a batch

_SampleResult = tuple[float, list[GradeError]]


@dataclass
class _Batch:
    http: HttpClient
    config: RemoteConfig
    budget: JudgeBudget
    resolver: Resolver | None
    output_texts: Sequence[str]
    items: Sequence[Mapping[str, Any]]
    deadline: float | None
    finish_reasons: Sequence[graders.FinishReason] | None = None
    output_tools: Sequence[Sequence[Mapping[str, Any]]] | None = None  # an agent episode's tool calls, per sample
    trace_ids: Sequence[str] | None = None  # an agent episode's trace id (its tool calls had it), per sample
    usage: dict[str, dict[str, int]] = field(default_factory=dict)

    def tools_of(self, i: int) -> Sequence[Mapping[str, Any]]:
        return self.output_tools[i] if self.output_tools is not None else ()

    async def bounded(
        self, work: Awaitable[_SampleResult], fail: Callable[[CallFailed], _SampleResult]
    ) -> _SampleResult:
        """`work` within the batch's deadline (dry-runs have one), else the failure it meets."""
        if self.deadline is None:
            return await work
        try:
            async with asyncio.timeout_at(self.deadline):
                return await work
        except TimeoutError:
            return fail(CallFailed("deadline", "the grader run's time limit passed before an answer came"))

    # -- score_model and label_model -------------------------------------------------------------------------

    async def judge_leaf(self, leaf: graders.ScoreModelGrader | graders.LabelModelGrader) -> list[_SampleResult]:
        judge = self.config.judge
        assert judge is not None  # checked by grade_remote_leaves
        url = judge.base_url.rstrip("/") + "/chat/completions"
        headers = _auth(judge.api_key)
        requests: list[tuple[bytes, list[GradeError]]] = []
        for i, (text, item) in enumerate(zip(self.output_texts, self.items, strict=True)):
            messages, errors = _judge_messages(leaf, text, item, self.tools_of(i))
            requests.append((json.dumps(_judge_body(leaf, judge, messages)).encode(), errors))
        # Identical requests (the same rendered prompt: a group's identical completions) are asked once per batch.
        answers: dict[bytes, asyncio.Task[_SampleResult]] = {}
        async with asyncio.TaskGroup() as group:  # a BudgetSpent cancels the leaf's other requests
            for body, _ in requests:
                if body not in answers:
                    answers[body] = group.create_task(
                        self.bounded(self._judge_once(leaf, url, headers, body), lambda f: _judge_failure(leaf, f))
                    )
        out = []
        for body, errors in requests:
            score, problems = answers[body].result()
            out.append((score, [*errors, *problems]))
        return out

    async def _judge_once(
        self, leaf: graders.ScoreModelGrader | graders.LabelModelGrader, url: str, headers: dict[str, str], body: bytes
    ) -> _SampleResult:
        async def take() -> None:
            self.budget.take()

        try:
            answer = await self.http.post_json(url, body, service="judge", headers=headers, before_attempt=take)
        except CallFailed as failed:
            return _judge_failure(leaf, failed)
        self._count_usage(leaf.model, answer)
        try:
            content, refusal = judge_message(answer)
            if refusal is not None:
                problem = f"{leaf.type} grader {leaf.name!r}: the judge refused ({short(refusal)}); scored 0.0"
                return 0.0, [GradeError(problem, "model_grader_refusal", "refusal")]
            assert content is not None
            if isinstance(leaf, graders.ScoreModelGrader):
                return parse_score(content, leaf.range[0], leaf.range[1]), []
            return float(parse_label(content, leaf.labels) in leaf.passing_labels), []
        except AnswerError as err:
            problem = f"{leaf.type} grader {leaf.name!r}: the judge's answer does not parse ({err}); scored 0.0"
            return 0.0, [GradeError(problem, "model_grader_parse", "invalid_answer")]

    def _count_usage(self, model: str, answer: Any) -> None:
        usage = answer.get("usage") if isinstance(answer, dict) else None
        if not isinstance(usage, dict):
            return
        totals = self.usage.setdefault(model, {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0})
        for name in totals:
            value = usage.get(name)
            if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
                totals[name] += value

    # -- endpoint ---------------------------------------------------------------------------------------------

    async def endpoint_leaf(self, leaf: graders.EndpointGrader) -> list[_SampleResult]:
        try:
            pinned = await self.config.url_policy.resolve(leaf.url, self.resolver)
        except UrlRefused as err:
            failed = CallFailed("url_not_allowed", f"its URL is not allowed: {err}")
            return [_endpoint_failure(leaf, failed)] * len(self.output_texts)
        limiter = _RateLimiter(leaf.rate_limit)
        headers = {**(leaf.headers or {}), "Content-Type": "application/json", **pinned.headers}
        service = f"endpoint {pinned.url.host}:{pinned.url.port}"
        reasons = self.finish_reasons or ["stop"] * len(self.output_texts)
        tasks = [
            self.bounded(
                self._endpoint_once(leaf, pinned, headers, service, limiter, text, item, reason, i),
                lambda f: _endpoint_failure(leaf, f),
            )
            for i, (text, item, reason) in enumerate(zip(self.output_texts, self.items, reasons, strict=True))
        ]
        return list(await asyncio.gather(*tasks))

    async def _endpoint_once(
        self,
        leaf: graders.EndpointGrader,
        pinned: Pinned,
        headers: dict[str, str],
        service: str,
        limiter: _RateLimiter,
        text: str,
        item: Mapping[str, Any],
        finish_reason: graders.FinishReason,
        i: int,
    ) -> _SampleResult:
        sample = sample_object(text, finish_reason=finish_reason, output_tools=self.tools_of(i))
        trace_id = self.trace_ids[i] if self.trace_ids is not None else f"trace_{uuid.uuid4().hex}"
        payload = {"sample": sample, "item": dict(item), "trace_id": trace_id}
        try:
            body = json.dumps(payload, allow_nan=False).encode()
        except ValueError as err:
            return _endpoint_failure(leaf, CallFailed("request_too_large", f"the sample is not JSON ({err})"))
        if len(body) > MAX_ENDPOINT_REQUEST_BYTES:
            detail = f"the request would be {len(body)} bytes; at most {MAX_ENDPOINT_REQUEST_BYTES} are sent"
            return _endpoint_failure(leaf, CallFailed("request_too_large", detail))
        try:
            answer = await self.http.post_json(
                pinned.request_url,
                body,
                service=service,
                headers=headers,
                extensions=pinned.extensions,
                before_attempt=limiter.wait,
            )
            return parse_endpoint_score(answer), []
        except CallFailed as failed:
            return _endpoint_failure(leaf, failed)
        except AnswerError as err:
            problem = f'endpoint grader {leaf.name!r}: its answer is not {{"score": number}} ({err}); scored 0.0'
            return 0.0, [GradeError(problem, "endpoint_parse", "invalid_answer")]

    # -- cosine -----------------------------------------------------------------------------------------------

    async def cosine_leaf(self, leaf: graders.TextSimilarityGrader) -> list[_SampleResult]:
        """The cosine similarity of each sample's rendered input and reference embeddings; each distinct text is
        embedded once, in chunks of the endpoint's batch size."""
        pairs, errors = self._cosine_pairs(leaf)
        texts = list(dict.fromkeys(t for pair in pairs if pair is not None and all(pair) for t in pair))
        vectors, failures = await self._embed(texts)
        out: list[_SampleResult] = []
        for pair, problems in zip(pairs, errors, strict=True):
            if pair is None:
                out.append((0.0, problems))
                continue
            a, b = pair
            if not a or not b:  # nothing to embed: identical when both are empty, unrelated when one is
                out.append((float(a == b), problems))
                continue
            failed = failures.get(a) or failures.get(b)
            if failed is not None:
                out.append(_embeddings_failure(leaf, failed, problems))
                continue
            try:
                out.append((cosine(vectors[a], vectors[b]), problems))
            except ValueError as err:
                out.append(_embeddings_failure(leaf, CallFailed("invalid_answer", str(err)), problems))
        return out

    def _cosine_pairs(
        self, leaf: graders.TextSimilarityGrader
    ) -> tuple[list[tuple[str, str] | None], list[list[GradeError]]]:
        """Each sample's rendered (input, reference), None where either is longer than cosine compares, and the
        problems met rendering them."""
        max_chars = similarity.MAX_CHARS.get(leaf.evaluation_metric, graders.MAX_SIMILARITY_CHARS)
        pairs: list[tuple[str, str] | None] = []
        errors: list[list[GradeError]] = []
        for text, item in zip(self.output_texts, self.items, strict=True):
            rendered, problems = [], []
            for template in (leaf.input, leaf.reference):
                value, found = render(template, leaf.name, output_text=text, item=item)
                rendered.append(value)
                problems += found
            too_long = [(f, v) for f, v in zip(("input", "reference"), rendered, strict=True) if len(v) > max_chars]
            if too_long:
                f, v = too_long[0]
                problems.append(
                    GradeError(
                        f"grader {leaf.name!r}: the rendered {f} is {len(v)} characters long; cosine compares texts "
                        f"of at most {max_chars}; scored 0.0",
                        "other",
                    )
                )
            pairs.append(None if too_long else (rendered[0], rendered[1]))
            errors.append(problems)
        return pairs, errors

    async def _embed(self, texts: list[str]) -> tuple[dict[str, list[float]], dict[str, CallFailed]]:
        """The embedding of each text, and why for the texts that got none (their chunk's request failed)."""
        embeddings = self.config.embeddings
        assert embeddings is not None  # checked by grade_remote_leaves
        vectors: dict[str, list[float]] = {}
        failures: dict[str, CallFailed] = {}
        url = embeddings.base_url.rstrip("/") + "/embeddings"
        chunks = [texts[i : i + embeddings.batch_size] for i in range(0, len(texts), embeddings.batch_size)]

        headers = _auth(embeddings.api_key)

        async def embed(chunk: list[str]) -> _SampleResult:
            body = json.dumps({"model": embeddings.model, "input": chunk}).encode()
            try:
                answer = await self.http.post_json(
                    url, body, service="embeddings", headers=headers, max_bytes=MAX_EMBEDDINGS_ANSWER_BYTES
                )
                vectors.update(zip(chunk, parse_embeddings(answer, len(chunk)), strict=True))
            except CallFailed as failed:
                failures.update(dict.fromkeys(chunk, failed))
            except AnswerError as err:
                failures.update(dict.fromkeys(chunk, CallFailed("invalid_answer", str(err))))
            return 0.0, []

        def unanswered(chunk: list[str]) -> Callable[[CallFailed], _SampleResult]:
            def fail(failed: CallFailed) -> _SampleResult:
                failures.update(dict.fromkeys(chunk, failed))
                return 0.0, []

            return fail

        await asyncio.gather(*(self.bounded(embed(chunk), unanswered(chunk)) for chunk in chunks))
        return vectors, failures


def _judge_messages(
    leaf: graders.ScoreModelGrader | graders.LabelModelGrader,
    output_text: str,
    item: Mapping[str, Any],
    output_tools: Sequence[Mapping[str, Any]] = (),
) -> tuple[list[dict[str, Any]], list[GradeError]]:
    """The grader's input as chat-completions messages, its templates rendered (text blocks become `text` parts)."""
    errors: list[GradeError] = []

    def fill(template: str) -> str:
        value, found = render(template, leaf.name, output_text=output_text, item=item, output_tools=output_tools)
        errors.extend(found)
        return value

    messages: list[dict[str, Any]] = []
    for message in leaf.input:
        content: str | list[dict[str, str]]
        if isinstance(message.content, str):
            content = fill(message.content)
        elif isinstance(message.content, graders.TextPart):
            content = [{"type": "text", "text": fill(message.content.text)}]
        else:
            content = [{"type": "text", "text": fill(part.text)} for part in message.content]
        messages.append({"role": message.role, "content": content})
    return messages, errors


def _judge_body(
    leaf: graders.ScoreModelGrader | graders.LabelModelGrader, judge: JudgeConfig, messages: list[dict[str, Any]]
) -> dict[str, Any]:
    """A chat-completions request asking for OpenAI's structured result (`response_format` with a strict schema)."""
    if isinstance(leaf, graders.ScoreModelGrader):
        name, schema = "score_model_result", score_schema()
    else:
        name, schema = "label_model_result", label_schema(leaf.labels)
    body: dict[str, Any] = {
        "model": judge.models[leaf.model],
        "messages": messages,
        "response_format": {"type": "json_schema", "json_schema": {"name": name, "strict": True, "schema": schema}},
    }
    params = leaf.sampling_params if isinstance(leaf, graders.ScoreModelGrader) else None
    if params is not None:
        if params.max_completions_tokens is not None:
            body["max_completion_tokens"] = params.max_completions_tokens
        for key in ("reasoning_effort", "seed", "temperature", "top_p"):
            if (value := getattr(params, key)) is not None:
                body[key] = value
    return body


def _failure(kind: GradeErrorKind, what: str, failed: CallFailed, problems: Sequence[GradeError] = ()) -> _SampleResult:
    return 0.0, [*problems, GradeError(f"{what} ({failed.detail}); scored 0.0", kind, failed.cause)]


def _judge_failure(leaf: graders.ScoreModelGrader | graders.LabelModelGrader, failed: CallFailed) -> _SampleResult:
    return _failure("model_grader_server", f"{leaf.type} grader {leaf.name!r}: the judge did not answer", failed)


def _endpoint_failure(leaf: graders.EndpointGrader, failed: CallFailed) -> _SampleResult:
    return _failure("endpoint_server", f"endpoint grader {leaf.name!r}: the sample was discarded", failed)


def _embeddings_failure(
    leaf: graders.TextSimilarityGrader, failed: CallFailed, problems: Sequence[GradeError]
) -> _SampleResult:
    return _failure("embeddings", f"grader {leaf.name!r}: no embeddings for cosine", failed, problems)


def grade_remote_leaves(
    grader: graders.Grader,
    output_texts: Sequence[str],
    items: Sequence[Mapping[str, Any]],
    *,
    config: RemoteConfig,
    budget: JudgeBudget,
    resolver: Resolver | None = None,
    deadline_s: float | None = None,
    finish_reasons: Sequence[graders.FinishReason] | None = None,
    output_tools: Sequence[Sequence[Mapping[str, Any]]] | None = None,
    trace_ids: Sequence[str] | None = None,
) -> RemoteScores:
    """Score every remote leaf of `grader` over the batch, all leaves and samples concurrently (bounded per service).

    Raises `ConfigMissing` (a GraderError naming the field) when a leaf needs a service `config` lacks, and
    `BudgetSpent` once the judge budget is spent (the batch's other requests are cancelled). `deadline_s` bounds the
    whole batch (dry-runs): a sample without an answer by then fails with cause `deadline`. Runs its own event loop:
    call it from a thread that has none running. `output_tools` and `trace_ids`: an agent episode's tool calls (the
    `sample.output_tools` of endpoint graders and `{{sample.output_tools}}` of judges) and the trace id its tool
    calls carried (an endpoint grader's `trace_id`), per sample."""
    leaves = graders.remote_graders(grader)
    errors: list[list[GradeError]] = [[] for _ in output_texts]
    if not leaves or not output_texts:
        return RemoteScores({key: [] for key, _, _ in leaves}, errors)
    for _, param, leaf in leaves:
        if (missing := missing_service(leaf, config, param)) is not None:
            raise missing
    results, usage = asyncio.run(
        _grade(
            leaves, output_texts, items, config, budget, resolver, deadline_s, finish_reasons, output_tools, trace_ids
        )
    )
    scores: dict[str, list[float]] = {}
    for (key, _, _), per_sample in zip(leaves, results, strict=True):
        scores[key] = [score for score, _ in per_sample]
        for i, (_, problems) in enumerate(per_sample):
            errors[i] += problems
    return RemoteScores(scores, errors, usage)


async def _grade(
    leaves: list[tuple[str, str, graders.RemoteGrader]],
    output_texts: Sequence[str],
    items: Sequence[Mapping[str, Any]],
    config: RemoteConfig,
    budget: JudgeBudget,
    resolver: Resolver | None,
    deadline_s: float | None,
    finish_reasons: Sequence[graders.FinishReason] | None,
    output_tools: Sequence[Sequence[Mapping[str, Any]]] | None = None,
    trace_ids: Sequence[str] | None = None,
) -> tuple[list[list[_SampleResult]], dict[str, dict[str, int]]]:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=config.concurrency)
    async with httpx.AsyncClient(timeout=config.timeout_s, limits=limits, **CLIENT_OPTIONS) as client:
        deadline = None if deadline_s is None else asyncio.get_running_loop().time() + deadline_s
        batch = _Batch(
            HttpClient(client, config),
            config,
            budget,
            resolver,
            output_texts,
            items,
            deadline,
            finish_reasons,
            output_tools,
            trace_ids,
        )
        try:
            async with asyncio.TaskGroup() as group:
                tasks = [group.create_task(_grade_leaf(batch, leaf)) for _, _, leaf in leaves]
        except* BudgetSpent as spent:  # the other requests were cancelled: the job ends here
            raise _first(spent) from None
        return [task.result() for task in tasks], batch.usage


def _first(group: BaseExceptionGroup[BudgetSpent]) -> BudgetSpent:
    """The first BudgetSpent of a (nested) exception group."""
    first = group.exceptions[0]
    return first if isinstance(first, BudgetSpent) else _first(first)


async def _grade_leaf(batch: _Batch, leaf: graders.RemoteGrader) -> list[_SampleResult]:
    match leaf:
        case graders.ScoreModelGrader() | graders.LabelModelGrader():
            return await batch.judge_leaf(leaf)
        case graders.EndpointGrader():
            return await batch.endpoint_leaf(leaf)
        case graders.TextSimilarityGrader():
            return await batch.cosine_leaf(leaf)

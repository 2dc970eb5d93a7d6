"""OpenAI's grader dry-run: validate a grader, score one sample with it.

Both run in grading processes (`trainer.grading.pool`), never on the API's threads or its event loop, each within a
hard time limit: a request waits (asynchronously) for one of POOL_SIZE processes, behind at most MAX_IN_FLIGHT others
(beyond that it is a 429). A sample that takes longer than SAMPLE_TIMEOUT_S is a result with OpenAI's
`unresponsive_reward_error` flag, as any other grading problem is a flag.

A `python` grader's code runs in a sandbox (`trainer.grading.sandbox`, with SANDBOX's limits and the deployment's
packages folder and memory bound: `sandbox_config`, which job creation's checks use too), waited on by the same threads
and counted in the same bound: its source is checked there (`check_source`: it parses and defines
`grade(sample, item)`) by validate, run and job creation, and run grades the sample there. Its failures are OpenAI's
`python_grader_runtime_error` (with details) and `python_grader_server_error` (with its type: timeout, cpu_limit,
memory_limit, output_limit, crash); a sandbox that cannot start here is a 400 `sandbox_unavailable` saying why. A grader
importing a package the folder does not hold fails as OpenAI's does: a runtime error whose details hold the
ImportError.

The remote graders (`score_model`, `label_model`, `endpoint`, text_similarity's `cosine`:
`trainer.grading.remote_graders`) are checked against the deployment's configuration (`remote_config`) by validate, run
and job creation: a judge model the deployment does not offer is a 400 naming `…model` (`model_not_available`), a model
grader where no judge is configured `judge_unavailable`, cosine without an embeddings endpoint `embeddings_unavailable`
(naming `…evaluation_metric`), an endpoint URL the policy refuses (its scheme, or an address its host resolves to)
`url_not_allowed` naming `…url`. Run calls them from the same waiting threads, with shorter limits than training's
(DRY_RUN_TIMEOUT_S a request, DRY_RUN_MAX_RETRIES retries, DRY_RUN_DEADLINE_S in all); their failures are OpenAI's
`model_grader_parse_error`, `model_grader_refusal_error` and `model_grader_server_error` (with details), and for an
endpoint `unresponsive_reward_error` (no answer) or `other_error` (an answer that is not a score).
"""

from __future__ import annotations

import asyncio
import atexit
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any, TypeVar

from api.errors import ApiError, InvalidRequest, Unavailable
from api.schemas import GraderRunErrors, GraderRunMetadata, GraderRunResponse
from api.settings import Settings
from trainer.grading import remote_graders
from trainer.grading.environments import check_environment_source
from trainer.grading.graders import grade_python_leaves
from trainer.grading.pool import GradedBatch, GradingPool, GradingTimeout, GradingUnavailable, Sample
from trainer.grading.remote_graders import EmbeddingsConfig, JudgeConfig, RemoteConfig
from trainer.grading.sandbox import PythonSandbox, SandboxConfig, SandboxUnavailable, sandbox_available
from trainer.spec import graders
from trainer.spec.agent_spec import AgentSpec
from trainer.spec.urls import UrlRefused

POOL_SIZE = 2
"""Grading processes of one API process: dry-runs of different requests run side by side up to this many."""
SAMPLE_TIMEOUT_S = 10.0
"""The hard time limit of validating a grader and of grading its sample."""
MAX_IN_FLIGHT = 32
"""Dry-runs an API process holds at once, running or waiting for a grading process; more are a 429."""
WAITERS = 8
"""Threads of an API process that wait on grading processes and sandboxes (a sandbox is a process of its own, so
more dry-runs than POOL_SIZE may run at once when some are python graders)."""
SANDBOX = SandboxConfig(sample_timeout_s=SAMPLE_TIMEOUT_S, startup_timeout_s=SAMPLE_TIMEOUT_S, cpu_seconds=30)
"""The limits of a dry-run's python graders' sandbox: the hard limit of the others, for its start and its sample each
(`sandbox_config` adds the deployment's packages folder and memory bound)."""
DRY_RUN_TIMEOUT_S = 15.0
"""The time limit of one request of a dry-run's remote grader (at most the deployment's)."""
DRY_RUN_MAX_RETRIES = 1
DRY_RUN_DEADLINE_S = 30.0
"""A dry-run's remote graders answer within this, retries included, or their sample fails with cause `deadline`."""


T = TypeVar("T")


class TooManyGraderRuns(ApiError):
    status = 429
    type = "requests"


class _Grading:
    """The API process's grading pool, made on first use, and the threads that wait on it (one per process, so that
    no request thread of the API waits on a grader)."""

    def __init__(self, pool: GradingPool | None = None) -> None:
        self._lock = threading.Lock()
        self._pool = pool
        self._waiters: ThreadPoolExecutor | None = None
        self._in_flight = 0

    def _start(self) -> tuple[GradingPool, ThreadPoolExecutor]:
        with self._lock:
            if self._pool is None:
                self._pool = GradingPool(POOL_SIZE, sample_timeout_s=SAMPLE_TIMEOUT_S)
            if self._waiters is None:
                self._waiters = ThreadPoolExecutor(WAITERS, thread_name_prefix="grading")
            return self._pool, self._waiters

    async def call(self, work: Callable[[GradingPool], T]) -> T:
        """`work(pool)` on a waiting thread, counted against MAX_IN_FLIGHT until it ends (a 429 beyond it)."""
        pool, waiters = self._start()
        self._enter()
        try:
            future = waiters.submit(work, pool)
        except RuntimeError:  # shut down: the process is exiting
            self._done(None)
            raise GradingUnavailable("the server is shutting down") from None
        future.add_done_callback(self._done)  # counted until it ends, even when its request has gone
        return await asyncio.wrap_future(future)

    def call_sync(self, work: Callable[[GradingPool], T]) -> T:
        """`work(pool)` on this (request) thread, counted against MAX_IN_FLIGHT: for a route that is a thread of its
        own already (job creation) and waits on a process, not on the GIL."""
        pool, _ = self._start()
        self._enter()
        try:
            return work(pool)
        finally:
            self._done(None)

    async def run(self, grader: dict[str, Any], samples: Sequence[Sample]) -> GradedBatch:
        return await self.call(lambda pool: pool.run(grader, samples))

    def _enter(self) -> None:
        with self._lock:
            if self._in_flight >= MAX_IN_FLIGHT:
                raise TooManyGraderRuns(
                    f"{MAX_IN_FLIGHT} grader runs are already in progress on this server; retry in a few seconds",
                    code="rate_limit_exceeded",
                )
            self._in_flight += 1

    def _done(self, _: Future[Any] | None) -> None:
        with self._lock:
            self._in_flight -= 1

    def close(self) -> None:
        with self._lock:
            pool, waiters, self._pool, self._waiters = self._pool, self._waiters, None, None
        if waiters is not None:
            waiters.shutdown(wait=False, cancel_futures=True)
        if pool is not None:
            pool.close()


_grading = _Grading()
atexit.register(_grading.close)


def sandbox_config(settings: Settings, *, dry_run: bool = False) -> SandboxConfig:
    """The sandbox of this deployment's python graders and python environments: its packages folder
    (`PROXIMA_SANDBOX_PACKAGES`) and whole-sandbox memory bound (`PROXIMA_SANDBOX_MEMORY_BYTES`), with OpenAI's limits
    (`SandboxConfig`'s defaults: what a job's graders and environments get, and evaluations), or with `dry_run` those
    of a grader dry-run and of the API's source checks (SANDBOX). The worker hands it to each trainer process
    (`worker.runner`)."""
    limits = SANDBOX if dry_run else SandboxConfig()
    return replace(limits, packages_dir=settings.sandbox_packages, memory_bytes=settings.sandbox_memory_bytes)


def _sandbox(config: SandboxConfig) -> PythonSandbox:
    """A sandbox with `config`, once this process has found it can start one (else 400 saying why)."""
    reason = sandbox_available(config)
    if reason is not None:
        raise SandboxUnavailable(reason)
    return PythonSandbox(config)


def check_python_sources(grader: dict[str, Any], *, param: str, config: SandboxConfig) -> None:
    """400 naming `<param>…source` when a python leaf's source does not parse or defines no `grade(sample, item)`
    (checked in a sandbox: parsing hostile source is not for an API thread); 400 `sandbox_unavailable` when python
    graders cannot run here. Blocks its thread on the sandbox: call it from a waiting thread or a sync route."""
    sources = graders.python_grader_params(grader, param)
    if not sources:
        return
    try:
        sandbox = _sandbox(config)
        for path, source in sources:
            problem = sandbox.check_source(source)
            if problem is not None:
                raise InvalidRequest(f"{path}: {problem}", param=path, code="invalid_grader")
    except SandboxUnavailable as err:
        raise InvalidRequest(
            f"python graders cannot run on this server: {err}",
            param=sources[0][0].removesuffix(".source"),
            code="sandbox_unavailable",
        ) from None


def remote_config(settings: Settings) -> RemoteConfig:
    """The deployment's remote graders as the trainer takes them (`trainer.grading.remote_graders.RemoteConfig`): the
    judge and its models, the embeddings endpoint, the URL policy of endpoint graders and the limits of every request.
    The worker hands it to each trainer process (`worker.runner`); the dry-runs use it with shorter limits."""
    judge = None
    if settings.judge_base_url:
        key = settings.judge_api_key.get_secret_value() if settings.judge_api_key else None
        judge = JudgeConfig(base_url=settings.judge_base_url, api_key=key, models=dict(settings.judge_models))
    embeddings = None
    if settings.embeddings_base_url and settings.embeddings_model:
        key = settings.embeddings_api_key.get_secret_value() if settings.embeddings_api_key else None
        embeddings = EmbeddingsConfig(
            base_url=settings.embeddings_base_url, api_key=key, model=settings.embeddings_model
        )
    return RemoteConfig(
        judge=judge,
        embeddings=embeddings,
        url_schemes=tuple(settings.grader_url_schemes),
        allow_networks=tuple(settings.grader_url_allow_networks),
        deny_networks=tuple(settings.grader_url_deny_networks),
        timeout_s=settings.grader_http_timeout_s,
        max_retries=settings.grader_http_max_retries,
        concurrency=settings.grader_http_concurrency,
        max_judge_calls=settings.judge_max_calls_per_job,
    )


def check_remote_graders(grader: graders.Grader, config: RemoteConfig, *, param: str) -> None:
    """400 naming the field when a remote leaf cannot run on this deployment: its judge model is not offered (or no
    judge is configured), cosine has no embeddings endpoint, or an endpoint grader's URL is refused by the policy
    (after resolving its host: blocks its thread on DNS, so call it from a waiting thread or a sync route)."""
    for _, path, leaf in graders.remote_graders(grader, param):
        if (missing := remote_graders.missing_service(leaf, config, path)) is not None:
            raise InvalidRequest(str(missing), param=missing.param, code=missing.code)
        if isinstance(leaf, graders.EndpointGrader):
            try:
                config.url_policy.resolve_sync(leaf.url)
            except UrlRefused as err:
                raise InvalidRequest(f"{path}.url: {err}", param=f"{path}.url", code="url_not_allowed") from None


def check_job_grader(grader: dict[str, Any], *, param: str, settings: Settings) -> None:
    """Job creation's check of a validated grader: its python sources (`check_python_sources`, counted against
    MAX_IN_FLIGHT with the dry-runs) and its remote leaves (`check_remote_graders`)."""
    if graders.python_grader_params(grader, param):
        config = sandbox_config(settings, dry_run=True)
        with _api_errors():
            _grading.call_sync(lambda _: check_python_sources(grader, param=param, config=config))
    with _api_errors():
        parsed = graders.parse_grader(grader)  # validated by the spec already: linear and bounded
    if graders.remote_graders(parsed):
        check_remote_graders(parsed, remote_config(settings), param=param)


def check_agent(agent: AgentSpec, *, param: str, settings: Settings) -> None:
    """Job creation's check of an agent job: every tool's ``server_url`` is allowed by the deployment's URL policy
    (the endpoint grader's: resolved, so blocks its thread on DNS), and an environment's source parses and defines
    ``reset`` and ``step`` (checked in a sandbox, counted against MAX_IN_FLIGHT with the grader checks)."""
    policy = remote_config(settings).url_policy
    for i, tool in enumerate(agent.tools):
        if tool.server_url is None:
            continue
        try:
            policy.resolve_sync(tool.server_url)
        except UrlRefused as err:
            where = f"{param}.tools.{i}.server_url"
            raise InvalidRequest(f"{where}: {err}", param=where, code="url_not_allowed") from None
    if agent.environment is not None:
        source = agent.environment.source
        where = f"{param}.environment.source"
        config = sandbox_config(settings, dry_run=True)
        with _api_errors():
            _grading.call_sync(lambda _: _check_environment_source(source, param=where, config=config))


def _check_environment_source(source: str, *, param: str, config: SandboxConfig) -> None:
    try:
        reason = sandbox_available(config)
        if reason is not None:
            raise SandboxUnavailable(reason)
        problem = check_environment_source(source, config)
    except SandboxUnavailable as err:
        raise InvalidRequest(
            f"python environments cannot run on this server: {err}", param=param, code="sandbox_unavailable"
        ) from None
    if problem is not None:
        raise InvalidRequest(f"{param}: {problem}", param=param, code="invalid_environment")


@contextmanager
def _api_errors() -> Iterator[None]:
    """Grading's errors as the API's: an invalid grader or one too slow to validate a 400, no grading process 503."""
    try:
        yield
    except graders.GraderError as err:
        raise InvalidRequest(str(err), param=err.param, code="invalid_grader") from None
    except GradingTimeout as err:
        raise InvalidRequest(f"grader: {err}", param="grader", code="grader_timeout") from None
    except GradingUnavailable as err:
        raise Unavailable(f"graders cannot run right now: {err}", code="grading_unavailable") from None


async def _grade(work: Callable[[GradingPool], T]) -> T:
    with _api_errors():
        return await _grading.call(work)


def _validate(
    pool: GradingPool, grader: dict[str, Any], config: RemoteConfig, sandbox: SandboxConfig
) -> dict[str, Any]:
    validated = pool.run(grader, []).grader
    check_python_sources(validated, param="grader", config=sandbox)
    check_remote_graders(graders.parse_grader(validated), config, param="grader")
    return validated


async def validate(*, grader: dict[str, Any], settings: Settings) -> dict[str, Any]:
    """The grader as it will run (defaults filled in); 400 naming the field when it is invalid (a python grader's
    source included) or cannot run on this deployment (a remote grader's model, metric or URL)."""
    config, sandbox = remote_config(settings), sandbox_config(settings, dry_run=True)
    return await _grade(lambda pool: _validate(pool, grader, config, sandbox))


def _flags(errors: tuple[graders.GradeError, ...]) -> GraderRunErrors:
    """OpenAI's error flags of a grader run, from the kinds of the problems met while grading (a python grader's
    runtime error with its details, its server error with its type: the first of each)."""
    kinds = {error.kind for error in errors}
    runtime = next((e for e in errors if e.kind == "python_runtime"), None)
    server = next((e for e in errors if e.kind == "python_server"), None)
    judge = next((e for e in errors if e.kind == "model_grader_server"), None)
    return GraderRunErrors(
        invalid_variable_error="invalid_variable" in kinds,
        formula_parse_error="formula" in kinds,
        unresponsive_reward_error=bool(kinds & {"timeout", "endpoint_server"}),
        other_error=bool(kinds & {"other", "endpoint_parse", "embeddings"}),
        python_grader_runtime_error=runtime is not None,
        python_grader_runtime_error_details=str(runtime) if runtime is not None else None,
        python_grader_server_error=server is not None,
        python_grader_server_error_type=server.cause if server is not None else None,
        model_grader_parse_error="model_grader_parse" in kinds,
        model_grader_refusal_error="model_grader_refusal" in kinds,
        model_grader_server_error=judge is not None,
        model_grader_server_error_details=str(judge) if judge is not None else None,
    )


def dry_run_config(config: RemoteConfig) -> RemoteConfig:
    """The deployment's remote graders with a dry-run's limits (DRY_RUN_TIMEOUT_S, DRY_RUN_MAX_RETRIES) and no judge
    budget (a dry-run makes a few calls at most; the in-flight bound limits how many run at once)."""
    return config.model_copy(
        update={
            "timeout_s": min(config.timeout_s, DRY_RUN_TIMEOUT_S),
            "max_retries": min(config.max_retries, DRY_RUN_MAX_RETRIES),
            "max_judge_calls": None,
        }
    )


@dataclass(frozen=True)
class _RunResult:
    grader: dict[str, Any]  # as validated
    result: graders.GradeResult
    seconds: float
    token_usage: dict[str, dict[str, int]]


def _run(
    pool: GradingPool, grader: dict[str, Any], sample: Sample, config: RemoteConfig, sandbox: SandboxConfig
) -> _RunResult:
    """The validated grader and the sample's result: python leaves in one sandbox each, remote leaves by their
    services, the rest (and a multi's formula over the batched leaves' scores) in a grading process."""
    if not graders.batched_leaf_params(grader):  # graded in one round trip (an invalid grader: the pool names it)
        batch = pool.run(grader, [sample])
        return _RunResult(batch.grader, batch.results[0], batch.seconds[0], {})
    validated = pool.run(grader, []).grader
    parsed = graders.parse_grader(validated)  # parsed before, in a grading process: known valid and bounded
    check_python_sources(validated, param="grader", config=sandbox)
    check_remote_graders(parsed, config, param="grader")
    start = time.monotonic()
    try:
        python = grade_python_leaves(parsed, _sandbox(sandbox), [sample.output_text], [sample.item])
    except SandboxUnavailable as err:
        raise InvalidRequest(
            f"python graders cannot run on this server: {err}", param="grader", code="sandbox_unavailable"
        ) from None
    remote = remote_graders.grade_remote_leaves(
        parsed,
        [sample.output_text],
        [sample.item],
        config=dry_run_config(config),
        budget=remote_graders.JudgeBudget(None),
        deadline_s=DRY_RUN_DEADLINE_S,
    )
    errors = (*python.errors[0], *remote.errors[0])
    scores = {key: values[0] for key, values in (python.scores | remote.scores).items()}
    if graders.is_batched(parsed):
        score = scores[parsed.name]
        result = graders.GradeResult(score, {parsed.name: score}, errors)
        return _RunResult(validated, result, time.monotonic() - start, remote.token_usage)
    batch = pool.run(validated, [Sample(sample.output_text, sample.item, {**sample.model_scores, **scores})])
    result = batch.results[0]
    merged = graders.GradeResult(result.score, result.sub_scores, (*errors, *result.errors))
    return _RunResult(validated, merged, time.monotonic() - start, remote.token_usage)


async def run(
    *, grader: dict[str, Any], model_sample: str, item: dict[str, Any] | None, settings: Settings
) -> GraderRunResponse:
    """Score ``model_sample`` against ``item`` as a training step would (a reward_model grader cannot: 400). A model
    grader's judge tokens are reported as OpenAI does (`token_usage`, `model_grader_token_usage_per_model`)."""
    sample = Sample(output_text=model_sample, item=item or {})
    config, sandbox = remote_config(settings), sandbox_config(settings, dry_run=True)
    run = await _grade(lambda pool: _run(pool, grader, sample, config, sandbox))
    judge_models = [leaf.model for _, _, leaf in _judge_leaves(run.grader)]
    return GraderRunResponse(
        reward=run.result.score,
        metadata=GraderRunMetadata(
            name=str(run.grader.get("name", "")),
            type=str(run.grader.get("type", "")),
            errors=_flags(run.result.errors),
            execution_time=run.seconds,
            scores=dict(run.result.sub_scores),
            token_usage=sum(u["total_tokens"] for u in run.token_usage.values()) if run.token_usage else None,
            sampled_model_name=judge_models[0] if judge_models else None,
            error_messages=list(run.result.errors),
        ),
        sub_rewards=dict(run.result.sub_scores),
        model_grader_token_usage_per_model=dict(run.token_usage),
    )


def _judge_leaves(grader: dict[str, Any]) -> list[tuple[str, str, graders.ScoreModelGrader | graders.LabelModelGrader]]:
    return [
        (key, path, leaf)
        for key, path, leaf in graders.remote_graders(graders.parse_grader(grader))
        if isinstance(leaf, graders.ScoreModelGrader | graders.LabelModelGrader)
    ]

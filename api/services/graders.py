"""OpenAI's grader dry-run: validate a grader, score one sample with it.

Both run in grading processes (`trainer.grading_pool`), never on the API's threads or its event loop, each within a
hard time limit: a request waits (asynchronously) for one of POOL_SIZE processes, behind at most MAX_IN_FLIGHT others
(beyond that it is a 429). A sample that takes longer than SAMPLE_TIMEOUT_S is a result with OpenAI's
`unresponsive_reward_error` flag, as any other grading problem is a flag.

A `python` grader's code runs in a sandbox (`trainer.sandbox`, SANDBOX), waited on by the same threads and counted
in the same bound: its source is checked there (`check_source`: it parses and defines `grade(sample, item)`) by
validate, run and job creation, and run grades the sample there. Its failures are OpenAI's
`python_grader_runtime_error` (with details) and `python_grader_server_error` (with its type: timeout, cpu_limit,
output_limit, crash); a sandbox that cannot start here is a 400 `sandbox_unavailable` saying why.
"""

from __future__ import annotations

import asyncio
import atexit
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any, TypeVar

from api.errors import ApiError, InvalidRequest, Unavailable
from api.schemas import GraderRunErrors, GraderRunMetadata, GraderRunResponse
from trainer import graders
from trainer.grading_pool import GradedBatch, GradingPool, GradingTimeout, GradingUnavailable, Sample
from trainer.sandbox import PythonSandbox, SandboxConfig, SandboxUnavailable, sandbox_available

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
"""The python graders' sandbox of a dry-run: the hard limit of the others, for its start and its sample each."""


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


def _sandbox() -> PythonSandbox:
    """A sandbox with SANDBOX's limits, once this process has found it can start one (else 400 saying why)."""
    reason = sandbox_available(SANDBOX)
    if reason is not None:
        raise SandboxUnavailable(reason)
    return PythonSandbox(SANDBOX)


def check_python_sources(grader: dict[str, Any], *, param: str) -> None:
    """400 naming `<param>…source` when a python leaf's source does not parse or defines no `grade(sample, item)`
    (checked in a sandbox: parsing hostile source is not for an API thread); 400 `sandbox_unavailable` when python
    graders cannot run here. Blocks its thread on the sandbox: call it from a waiting thread or a sync route."""
    sources = graders.python_grader_params(grader, param)
    if not sources:
        return
    try:
        sandbox = _sandbox()
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


def check_job_grader(grader: dict[str, Any], *, param: str) -> None:
    """Job creation's check of a validated grader's python sources (`check_python_sources`, counted against
    MAX_IN_FLIGHT with the dry-runs); nothing to do for a grader without python leaves."""
    if graders.python_grader_params(grader, param):
        with _api_errors():
            _grading.call_sync(lambda _: check_python_sources(grader, param=param))


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


def _validate(pool: GradingPool, grader: dict[str, Any]) -> dict[str, Any]:
    validated = pool.run(grader, []).grader
    check_python_sources(validated, param="grader")
    return validated


async def validate(*, grader: dict[str, Any]) -> dict[str, Any]:
    """The grader as it will run (defaults filled in); 400 naming the field when it is invalid (a python grader's
    source included)."""
    return await _grade(lambda pool: _validate(pool, grader))


def _flags(errors: tuple[graders.GradeError, ...]) -> GraderRunErrors:
    """OpenAI's error flags of a grader run, from the kinds of the problems met while grading (a python grader's
    runtime error with its details, its server error with its type: the first of each)."""
    kinds = {error.kind for error in errors}
    runtime = next((e for e in errors if e.kind == "python_runtime"), None)
    server = next((e for e in errors if e.kind == "python_server"), None)
    return GraderRunErrors(
        invalid_variable_error="invalid_variable" in kinds,
        formula_parse_error="formula" in kinds,
        unresponsive_reward_error="timeout" in kinds,
        other_error="other" in kinds,
        python_grader_runtime_error=runtime is not None,
        python_grader_runtime_error_details=str(runtime) if runtime is not None else None,
        python_grader_server_error=server is not None,
        python_grader_server_error_type=server.cause if server is not None else None,
    )


def _run(
    pool: GradingPool, grader: dict[str, Any], sample: Sample
) -> tuple[dict[str, Any], graders.GradeResult, float]:
    """(the validated grader, the sample's result, its seconds): python leaves in one sandbox each, the rest (and a
    multi's formula over the python leaves' scores) in a grading process."""
    if not graders.python_grader_params(grader):  # no python leaf (or an invalid one, which the pool names)
        batch = pool.run(grader, [sample])
        return batch.grader, batch.results[0], batch.seconds[0]
    validated = pool.run(grader, []).grader
    parsed = graders.parse_grader(validated)  # parsed before, in a grading process: known valid and bounded
    check_python_sources(validated, param="grader")
    start = time.monotonic()
    try:
        python = graders.grade_python_leaves(parsed, _sandbox(), [sample.output_text], [sample.item])
    except SandboxUnavailable as err:
        raise InvalidRequest(
            f"python graders cannot run on this server: {err}", param="grader", code="sandbox_unavailable"
        ) from None
    errors = python.errors[0]
    if isinstance(parsed, graders.PythonGrader):
        score = python.scores[parsed.name][0]
        return validated, graders.GradeResult(score, {parsed.name: score}, tuple(errors)), time.monotonic() - start
    scores = {key: values[0] for key, values in python.scores.items()}
    batch = pool.run(grader, [Sample(sample.output_text, sample.item, {**sample.model_scores, **scores})])
    result = batch.results[0]
    merged = graders.GradeResult(result.score, result.sub_scores, (*errors, *result.errors))
    return validated, merged, time.monotonic() - start


async def run(*, grader: dict[str, Any], model_sample: str, item: dict[str, Any] | None) -> GraderRunResponse:
    """Score ``model_sample`` against ``item`` as a training step would (a reward_model grader cannot: 400)."""
    sample = Sample(output_text=model_sample, item=item or {})
    validated, result, seconds = await _grade(lambda pool: _run(pool, grader, sample))
    return GraderRunResponse(
        reward=result.score,
        metadata=GraderRunMetadata(
            name=str(validated.get("name", "")),
            type=str(validated.get("type", "")),
            errors=_flags(result.errors),
            execution_time=seconds,
            scores=dict(result.sub_scores),
            error_messages=list(result.errors),
        ),
        sub_rewards=dict(result.sub_scores),
    )

"""OpenAI's grader dry-run: validate a grader, score one sample with it.

Both run in grading processes (`trainer.grading_pool`), never on the API's threads or its event loop, each within a
hard time limit: a request waits (asynchronously) for one of POOL_SIZE processes, behind at most MAX_IN_FLIGHT others
(beyond that it is a 429). A sample that takes longer than SAMPLE_TIMEOUT_S is a result with OpenAI's
`unresponsive_reward_error` flag, as any other grading problem is a flag.
"""

from __future__ import annotations

import asyncio
import atexit
import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from api.errors import ApiError, InvalidRequest, Unavailable
from api.schemas import GraderRunErrors, GraderRunMetadata, GraderRunResponse
from trainer import graders
from trainer.grading_pool import GradedBatch, GradingPool, GradingTimeout, GradingUnavailable, Sample

POOL_SIZE = 2
"""Grading processes of one API process: dry-runs of different requests run side by side up to this many."""
SAMPLE_TIMEOUT_S = 10.0
"""The hard time limit of validating a grader and of grading its sample."""
MAX_IN_FLIGHT = 32
"""Dry-runs an API process holds at once, running or waiting for a grading process; more are a 429."""


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
                self._waiters = ThreadPoolExecutor(POOL_SIZE, thread_name_prefix="grading")
            return self._pool, self._waiters

    async def run(self, grader: dict[str, Any], samples: Sequence[Sample]) -> GradedBatch:
        pool, waiters = self._start()
        with self._lock:
            if self._in_flight >= MAX_IN_FLIGHT:
                raise TooManyGraderRuns(
                    f"{MAX_IN_FLIGHT} grader runs are already in progress on this server; retry in a few seconds",
                    code="rate_limit_exceeded",
                )
            self._in_flight += 1
        try:
            future = waiters.submit(pool.run, grader, samples)
        except RuntimeError:  # shut down: the process is exiting
            self._done(None)
            raise GradingUnavailable("the server is shutting down") from None
        future.add_done_callback(self._done)  # counted until it ends, even when its request has gone
        return await asyncio.wrap_future(future)

    def _done(self, _: Future[GradedBatch] | None) -> None:
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


async def _grade(grader: dict[str, Any], samples: Sequence[Sample]) -> GradedBatch:
    try:
        return await _grading.run(grader, samples)
    except graders.GraderError as err:
        raise InvalidRequest(str(err), param=err.param, code="invalid_grader") from None
    except GradingTimeout as err:
        raise InvalidRequest(f"grader: {err}", param="grader", code="grader_timeout") from None
    except GradingUnavailable as err:
        raise Unavailable(f"graders cannot run right now: {err}", code="grading_unavailable") from None


async def validate(*, grader: dict[str, Any]) -> dict[str, Any]:
    """The grader as it will run (defaults filled in); 400 naming the field when it is invalid."""
    return (await _grade(grader, [])).grader


def _flags(errors: tuple[graders.GradeError, ...]) -> GraderRunErrors:
    """OpenAI's error flags of a grader run, from the kinds of the problems met while grading."""
    kinds = {error.kind for error in errors}
    return GraderRunErrors(
        invalid_variable_error="invalid_variable" in kinds,
        formula_parse_error="formula" in kinds,
        unresponsive_reward_error="timeout" in kinds,
        other_error="other" in kinds,
    )


async def run(*, grader: dict[str, Any], model_sample: str, item: dict[str, Any] | None) -> GraderRunResponse:
    """Score ``model_sample`` against ``item`` as a training step would (a reward_model grader cannot: 400)."""
    batch = await _grade(grader, [Sample(output_text=model_sample, item=item or {})])
    [result], [seconds] = batch.results, batch.seconds
    return GraderRunResponse(
        reward=result.score,
        metadata=GraderRunMetadata(
            name=str(batch.grader.get("name", "")),
            type=str(batch.grader.get("type", "")),
            errors=_flags(result.errors),
            execution_time=seconds,
            scores=dict(result.sub_scores),
            error_messages=list(result.errors),
        ),
        sub_rewards=dict(result.sub_scores),
    )

"""``proxima.evals.run``: claim an eval run in the database, sample its items (a ``completions`` run), grade them with
the eval's criteria, record each item and the run's counts.

:func:`run_eval` is the plain function behind the Celery task (tests call it directly). One attempt:

1. claim the run with a lease (``api.repositories.evals.claim``: one conditional UPDATE; losing means another worker
   has it, or it is finished or canceled: return); a heartbeat thread renews the lease while the attempt runs and sees
   a cancel asked for through the API;
2. read the data source (the inline rows, or the tenant's file from the artifact store), each item checked against
   the eval's item schema: a line that is not ``{"item": {...}, "sample"?: {...}}`` or does not fit fails the run
   naming it;
3. in batches of ``BATCH`` items not graded yet (an attempt after a dead worker's goes on from there): sample each
   item's messages from the run's model through the inference server (``api.services.inference``: the model resolved
   for the run's tenant, an adapter registered as chat completions register it, each completion within
   ``inference_timeout_s``), grade them with every criterion (the pure graders in grading processes, python graders
   in the sandbox, remote graders by their services: as a job grades), and write the batch (only while the lease is
   ours); a cancel seen between batches ends the run ``canceled``;
4. end the run ``completed`` with its counts (or ``failed`` with an error a user can act on); its event
   (``eval.run.succeeded|failed|canceled``) is written with the end, for the webhook outbox.

An item whose completion failed, or that a criterion could not score (a grader's failure: a python grader that
raised, a judge that did not answer), is ``errored``: counted in ``result_counts.errored``, not in passed or failed.
"""

from __future__ import annotations

import json
import logging
import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import anyio
import anyio.from_thread
from celery import Celery
from pydantic import ValidationError

from api import ids
from api.auth import Caller
from api.db import read, session_scope
from api.errors import ApiError
from api.orm import EvalOutputItem, Tenant, now
from api.repositories import evals as evals_repo
from api.repositories import files as files_repo
from api.schemas_inference import ChatCompletionRequest
from api.services import evals as evals_service
from api.services import graders as graders_service
from api.services import inference as inference_service
from api.settings import Settings
from api.status import EvalRunStatus
from api.tasks import DEFAULT_QUEUE, RUN_EVAL
from trainer.grading import batch, remote_graders
from trainer.grading.pool import GradingPool
from trainer.grading.sandbox import PythonSandbox, SandboxUnavailable
from trainer.spec import graders
from worker.celery_app import app
from worker.celery_app import settings as current_settings
from worker.models import store_for
from worker.outbox import DatabaseUnavailable, is_transient, retry_db
from worker.tasks import default_worker_id

log = logging.getLogger("proxima.evals")

BATCH = 16
"""Items sampled, graded and written together: a worker that dies loses at most one batch's work."""
CONCURRENCY = 8
"""Completions of a batch in flight at once (the inference server batches them)."""
GRADING_PROCESSES = 1
RETRY_FIRST_S = 0.25
RETRY_MOST_S = 4.0
"""The wait before retrying a completion the inference server refused for now (429, 5xx), doubling up to the most."""
UNAVAILABLE = "inference_unavailable"
"""The run's error when the inference server kept refusing a completion until ``inference_timeout_s`` passed."""


class RunFailed(Exception):
    """The run cannot go on: it ends ``failed`` with this code and message."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code, self.message = code, message


@app.task(name=RUN_EVAL, bind=True, acks_late=True, reject_on_worker_lost=True, ignore_result=True)
def run_eval_task(self: Any, run_id: str) -> str:
    return run_eval(run_id, settings=current_settings(), worker_id=default_worker_id(self.request.hostname))


def run_eval(run_id: str, *, settings: Settings, worker_id: str) -> str:
    """One attempt at the run if this worker can claim it; the status it ended in, ``"skipped"`` (not claimable),
    ``"lost"`` (the lease was taken, or the run deleted) or ``"abandoned"`` (the database stayed unreachable: the
    lease runs out and the sweeper wakes another worker)."""

    def claim() -> bool:
        with session_scope(settings.db_url) as s:
            return evals_repo.claim(s, run_id=run_id, worker_id=worker_id, lease_seconds=settings.lease_seconds)

    if not retry_db(f"eval run {run_id}: claim", claim):
        log.info("eval run %s not claimable by %s: skipped", run_id, worker_id)
        return "skipped"
    log.info("eval run %s claimed by %s", run_id, worker_id)
    lease = _Lease(settings, run_id, worker_id)
    lease.start()
    try:
        return _Attempt(settings, run_id, worker_id, lease).run()
    except DatabaseUnavailable:
        log.error("eval run %s: the database stayed unreachable; leaving it to its lease's expiry", run_id)
        return "abandoned"
    except RunFailed as err:
        return _end(settings, run_id, worker_id, EvalRunStatus.FAILED, {"code": err.code, "message": err.message})
    except ApiError as err:  # the service's checks, met here (a package this worker lacks)
        error = {"code": err.code or "evals_unavailable", "message": err.message}
        return _end(settings, run_id, worker_id, EvalRunStatus.FAILED, error)
    except Exception:
        log.exception("eval run %s: worker error", run_id)
        error = {"code": "internal_error", "message": "the worker failed running the eval; retry the run"}
        return _end(settings, run_id, worker_id, EvalRunStatus.FAILED, error)
    finally:
        lease.stop()


def _end(settings: Settings, run_id: str, worker_id: str, status: EvalRunStatus, error: dict[str, str] | None) -> str:
    def finish() -> bool:
        with session_scope(settings.db_url) as s:
            return evals_repo.finish(s, run_id=run_id, worker_id=worker_id, status=status, error=error)

    won = retry_db(f"eval run {run_id}: finish", finish)
    log.info("eval run %s: %s%s", run_id, status, "" if won else " (not recorded: no longer this worker's)")
    return str(status) if won else "lost"


class _Lease(threading.Thread):
    """Renews the run's lease every third of it; ``lost`` once it is gone, ``cancel`` once a cancel was asked for."""

    def __init__(self, settings: Settings, run_id: str, worker_id: str) -> None:
        super().__init__(daemon=True, name=f"eval-lease-{run_id}")
        self.settings, self.run_id, self.worker_id = settings, run_id, worker_id
        self.lost = threading.Event()
        self.cancel = threading.Event()
        self._stopped = threading.Event()

    def run(self) -> None:
        while not self._stopped.wait(self.settings.lease_seconds / 3):
            self.renew()

    def renew(self) -> None:
        try:
            with session_scope(self.settings.db_url) as s:
                held, cancel = evals_repo.renew(
                    s, run_id=self.run_id, worker_id=self.worker_id, lease_seconds=self.settings.lease_seconds
                )
        except Exception as err:  # a database hiccup: the next renewal may succeed before the lease runs out
            if not is_transient(err):
                log.warning("eval run %s: lease renewal failed", self.run_id, exc_info=True)
            return
        if not held:
            self.lost.set()
        if cancel:
            self.cancel.set()

    def stop(self) -> None:
        self._stopped.set()


@dataclass(frozen=True)
class Row:
    """One item of the data source, with the sample it carries (a jsonl run's ``{{sample.*}}``)."""

    index: int
    item: dict[str, Any]
    sample: dict[str, Any] | None


@dataclass
class Sampled:
    """What one item was graded on: the text, why it ended, and the output item's ``sample`` (None: a jsonl row
    without one); ``error`` when no completion could be had."""

    text: str
    finish_reason: graders.FinishReason = "stop"
    sample: dict[str, Any] | None = None
    error: dict[str, str] | None = None


@dataclass
class _Plan:
    tenant: Caller
    eval_id: str
    config: dict[str, Any]
    criteria: list[dict[str, Any]]
    data_source: dict[str, Any]
    model: str | None
    done: set[int] = field(default_factory=set)


class _Attempt:
    """The attempt's phases: read the plan and the rows, then sample, grade and write batch by batch."""

    def __init__(self, settings: Settings, run_id: str, worker_id: str, lease: _Lease) -> None:
        self.settings, self.run_id, self.worker_id, self.lease = settings, run_id, worker_id, lease

    def run(self) -> str:
        plan = retry_db(f"eval run {self.run_id}: read", self._plan)
        if plan is None:
            return "lost"
        rows = [r for r in self._rows(plan) if r.index not in plan.done]
        target = self._target(plan) if plan.model is not None else None
        pool = GradingPool(GRADING_PROCESSES, sample_timeout_s=graders_service.SAMPLE_TIMEOUT_S)
        try:
            with anyio.from_thread.start_blocking_portal() as portal:
                try:
                    for start in range(0, len(rows), BATCH):
                        if self.lease.lost.is_set():
                            return "lost"
                        if self.lease.cancel.is_set():
                            return _end(self.settings, self.run_id, self.worker_id, EvalRunStatus.CANCELED, None)
                        if not self._batch(portal, pool, plan, target, rows[start : start + BATCH]):
                            return "lost"
                finally:
                    portal.call(inference_service.close_clients)
        finally:
            pool.close()
        self.lease.renew()
        status = EvalRunStatus.CANCELED if self.lease.cancel.is_set() else EvalRunStatus.COMPLETED
        return _end(self.settings, self.run_id, self.worker_id, status, None)

    def _batch(
        self,
        portal: anyio.from_thread.BlockingPortal,
        pool: GradingPool,
        plan: _Plan,
        target: inference_service.Target | None,
        batch: list[Row],
    ) -> bool:
        """Sample (a completions run), grade and write one batch; False when the run is no longer this worker's."""
        if target is None:
            sampled = [_row_sample(r) for r in batch]
        else:
            sampled = portal.call(_sample_batch, self.settings, target, plan.data_source, batch)
            check_available(sampled)
        items = grade_rows(pool, self.settings, plan, self.run_id, batch, sampled)
        return retry_db(f"eval run {self.run_id}: write items", lambda: self._write(items))

    def _plan(self) -> _Plan | None:
        with session_scope(self.settings.db_url) as s:
            found = evals_repo.load_run(s, run_id=self.run_id)
            if found is None:
                return None
            run, ev = found
            tenant = s.get(Tenant, run.tenant_id)
            if tenant is None:
                return None
            return _Plan(
                tenant=Caller(id=tenant.id, name=tenant.name, created_at=tenant.created_at),
                eval_id=ev.id,
                config=dict(ev.data_source_config),
                criteria=list(ev.testing_criteria),
                data_source=dict(run.data_source),
                model=run.model,
                done=evals_repo.done_item_ids(s, run_id=run.id),
            )

    def _rows(self, plan: _Plan) -> list[Row]:
        source = plan.data_source["source"]
        if source["type"] == "file_content":
            return [Row(i, r["item"], r.get("sample")) for i, r in enumerate(source["content"])]
        with session_scope(self.settings.db_url) as s:
            file = files_repo.get(s, tenant_id=plan.tenant.id, file_id=source["id"])
            key = None if file is None else file.storage_key
        if key is None:
            raise RunFailed("file_not_found", f"file {source['id']!r} no longer exists")
        return parse_rows(store_for(self.settings).get_bytes(key), plan.config, file_id=source["id"])

    def _target(self, plan: _Plan) -> inference_service.Target:
        assert plan.model is not None
        if self.settings.inference_url is None:
            raise RunFailed("inference_unavailable", "no inference server is configured (PROXIMA_INFERENCE_URL)")
        try:
            return read(
                self.settings.db_url,
                inference_service.resolve,
                settings=self.settings,
                tenant=plan.tenant,
                model=plan.model,
            )
        except ApiError as err:
            raise RunFailed(err.code or "model_not_found", err.message) from None

    def _write(self, items: list[EvalOutputItem]) -> bool:
        with session_scope(self.settings.db_url) as s:
            return evals_repo.add_items(
                s,
                run_id=self.run_id,
                worker_id=self.worker_id,
                lease_seconds=self.settings.lease_seconds,
                rows=items,
            )


# -- the data source ------------------------------------------------------------------------------------------


def parse_rows(data: bytes, config: dict[str, Any], *, file_id: str) -> list[Row]:
    """A JSONL file's rows, each ``{"item": {...}}`` with an optional ``"sample": {...}``, its item fitting the
    eval's schema; RunFailed naming the line otherwise."""
    rows: list[Row] = []
    for number, line in enumerate(data.decode("utf-8", errors="replace").splitlines(), start=1):
        if not line.strip():
            continue
        where = f"file {file_id!r}, line {number}"
        try:
            obj = json.loads(line)
        except ValueError as err:
            raise RunFailed("invalid_file", f"{where}: not JSON ({err})") from None
        if not isinstance(obj, dict) or not isinstance(obj.get("item"), dict) or set(obj) - {"item", "sample"}:
            raise RunFailed("invalid_file", f'{where}: expected {{"item": {{...}}, "sample"?: {{...}}}}')
        if obj.get("sample") is not None and not isinstance(obj["sample"], dict):
            raise RunFailed("invalid_file", f"{where}: sample must be an object")
        if (problem := evals_service.item_problem(config, obj["item"])) is not None:
            raise RunFailed("invalid_item", f"{where}: does not fit the eval's item_schema: {problem}")
        rows.append(Row(len(rows), obj["item"], obj.get("sample")))
    if not rows:
        raise RunFailed("invalid_file", f"file {file_id!r} holds no items")
    return rows


def _row_sample(row: Row) -> Sampled:
    """A jsonl row graded on its own sample: ``output_text``, or the first choice's message."""
    sample: dict[str, Any] = row.sample or {}
    text = sample.get("output_text")
    if not isinstance(text, str):
        choices = sample.get("choices")
        first = choices[0] if isinstance(choices, list) and choices else None
        message = first.get("message") if isinstance(first, dict) else None
        content = message.get("content") if isinstance(message, dict) else None
        text = content if isinstance(content, str) else ""
    return Sampled(text=str(text), sample=row.sample)


# -- sampling -------------------------------------------------------------------------------------------------


async def _sample_batch(
    settings: Settings, target: inference_service.Target, data_source: dict[str, Any], rows: Sequence[Row]
) -> list[Sampled]:
    out: list[Sampled] = [Sampled(text="") for _ in rows]
    limit = anyio.Semaphore(CONCURRENCY)

    async def one(i: int, row: Row) -> None:
        async with limit:
            out[i] = await sample_one(settings, target, data_source, row.item)

    async with anyio.create_task_group() as group:
        for i, row in enumerate(rows):
            group.start_soon(one, i, row)
    return out


def _request(target: inference_service.Target, data_source: dict[str, Any], item: dict[str, Any]) -> Any:
    """The chat completion request for ``item``, or a Sampled error when its messages cannot be made."""
    messages = evals_service.render_messages(data_source, item)
    params = data_source.get("sampling_params") or {}
    if isinstance(messages, str):
        return Sampled(text="", error={"code": "invalid_input", "message": messages})
    try:
        return ChatCompletionRequest.model_validate({"model": target.model, "messages": messages, **params})
    except ValidationError as err:
        problem = err.errors()[0]
        message = f"the item's messages cannot be sampled: {'.'.join(map(str, problem['loc']))}: {problem['msg']}"
        return Sampled(text="", error={"code": "invalid_input", "message": message})


async def sample_one(
    settings: Settings, target: inference_service.Target, data_source: dict[str, Any], item: dict[str, Any]
) -> Sampled:
    """One completion of the item's messages, as ``POST /v1/chat/completions`` makes it, within the deadline."""
    request = _request(target, data_source, item)
    if isinstance(request, Sampled):
        return request
    base = _sample_base(request)
    response, failure = await _answer(settings, target, request)
    if response is None:
        assert failure is not None
        return Sampled(text="", sample={**base, "error": failure}, error=failure)
    try:
        body = json.loads(bytes(response.body))
    except ValueError:
        body = None
    if response.status_code != 200:
        error = body.get("error") if isinstance(body, dict) else None
        error = error if isinstance(error, dict) else {}
        failure = {"code": str(error.get("code") or response.status_code), "message": str(error.get("message"))}
        return Sampled(text="", sample={**base, "error": failure}, error=failure)
    return _completion(base, body, model=target.model)


def check_available(sampled: Sequence[Sampled]) -> None:
    """RunFailed ``inference_unavailable`` when a completion of the batch could not be had because the server kept
    refusing: not the items' fault, and a run of errored items would hide the outage."""
    for one in sampled:
        if one.error is not None and one.error["code"] == UNAVAILABLE:
            raise RunFailed(UNAVAILABLE, one.error["message"])


def _retryable(status: int) -> bool:
    return status == 429 or status >= 500


async def _answer(
    settings: Settings, target: inference_service.Target, request: ChatCompletionRequest
) -> tuple[Any, dict[str, str] | None]:
    """The server's answer, (response, None); or (None, why) when ``inference_timeout_s`` passed first: ``timeout``
    (no answer), or ``inference_unavailable`` when it kept answering 429 or 5xx (restarting, overloaded), which are
    retried with backoff rather than graded as errored items."""
    refused: Any = None
    wait = RETRY_FIRST_S
    try:
        with anyio.fail_after(settings.inference_timeout_s):
            while True:
                response = await inference_service.forward(
                    settings=settings, target=target, path=inference_service.CHAT_PATH, body=request
                )
                if not _retryable(response.status_code):
                    return response, None
                refused = response
                await anyio.sleep(wait)
                wait = min(2 * wait, RETRY_MOST_S)
    except TimeoutError:
        within = f"within {settings.inference_timeout_s:g} s"
        if refused is None:
            return None, {"code": "timeout", "message": f"the inference server did not answer {within}"}
        message = f"the inference server answered {refused.status_code} to every try {within}"
        return None, {"code": UNAVAILABLE, "message": message}


def _completion(base: dict[str, Any], body: Any, *, model: str) -> Sampled:
    """The sample of a 200 answer; an ``invalid_response`` error when it is not a chat completion with a message."""
    body = body if isinstance(body, dict) else {}
    choices = body.get("choices")
    choice: dict[str, Any] = (
        choices[0] if isinstance(choices, list) and choices and isinstance(choices[0], dict) else {}
    )
    message = choice.get("message")
    if not isinstance(message, dict):
        failure = {"code": "invalid_response", "message": "the inference server's answer is not a chat completion"}
        return Sampled(text="", sample={**base, "error": failure}, error=failure)
    content = message.get("content")
    text = content if isinstance(content, str) else ""
    usage: dict[str, Any] = body["usage"] if isinstance(body.get("usage"), dict) else {}
    details = usage.get("prompt_tokens_details")
    cached = (details.get("cached_tokens") if isinstance(details, dict) else 0) or 0
    sample = {
        **base,
        "output": [{"role": "assistant", "content": text}],
        "finish_reason": choice.get("finish_reason"),
        "model": body.get("model", model),
        "usage": {
            "prompt_tokens": usage.get("prompt_tokens", 0),
            "completion_tokens": usage.get("completion_tokens", 0),
            "total_tokens": usage.get("total_tokens", 0),
            "cached_tokens": cached,
        },
    }
    reason: graders.FinishReason = "length" if choice.get("finish_reason") == "length" else "stop"
    return Sampled(text=text, finish_reason=reason, sample=sample)


def _sample_base(request: ChatCompletionRequest) -> dict[str, Any]:
    return {
        "input": [{"role": m.role, "content": m.text()} for m in request.messages],
        "output": [],
        "finish_reason": None,
        "model": request.model,
        "usage": None,
        "error": None,
        "temperature": request.temperature,
        "top_p": request.top_p,
        "max_completion_tokens": request.max_completion_tokens,
        "seed": request.seed,
    }


# -- grading --------------------------------------------------------------------------------------------------


def grade_criterion(
    pool: GradingPool,
    settings: Settings,
    grader: dict[str, Any],
    texts: list[str],
    items: list[dict[str, Any]],
    reasons: list[graders.FinishReason],
) -> list[graders.GradeResult]:
    """Every sample's result under one criterion, graded as a job grades (`trainer.grading.batch`): python leaves in
    the deployment's sandbox, remote leaves by its services, the rest and a multi's formula in a grading process."""
    parsed = graders.parse_grader(grader)
    config = graders_service.remote_config(settings)
    how = batch.BatchGrading(
        PythonSandbox(graders_service.sandbox_config(settings)),
        config,
        remote_graders.JudgeBudget(config.max_judge_calls),
        pool,
    )
    try:
        return batch.grade_results(parsed, texts, items, reasons, how=how)
    except SandboxUnavailable as err:
        raise RunFailed("sandbox_unavailable", f"python graders cannot run on this worker: {err}") from None
    except (graders.GraderError, remote_graders.BudgetSpent) as err:
        raise RunFailed("grader_error", f"grader {parsed.name!r}: {err}") from None


def grade_rows(
    pool: GradingPool, settings: Settings, plan: _Plan, run_id: str, rows: Sequence[Row], sampled: Sequence[Sampled]
) -> list[EvalOutputItem]:
    """The batch's output items: each criterion's result for every item that has a sample to grade."""
    graded = [i for i, s in enumerate(sampled) if s.error is None]
    texts = [sampled[i].text for i in graded]
    items = [rows[i].item for i in graded]
    reasons = [sampled[i].finish_reason for i in graded]
    per_criterion = [
        grade_criterion(pool, settings, c["grader"], texts, items, reasons) if graded else [] for c in plan.criteria
    ]
    by_row = {row_index: position for position, row_index in enumerate(graded)}
    out = []
    for i, (row, sample) in enumerate(zip(rows, sampled, strict=True)):
        results = []
        if i in by_row:
            results = [_result(c, per_criterion[k][by_row[i]]) for k, c in enumerate(plan.criteria)]
        errored = sample.error is not None or any(r["errored"] for r in results)
        passed = not errored and all(r["passed"] for r in results)
        out.append(
            EvalOutputItem(
                id=ids.output_item_id(),
                run_id=run_id,
                eval_id=plan.eval_id,
                datasource_item_id=row.index,
                datasource_item=row.item,
                sample={} if sample.sample is None else sample.sample,
                results=results,
                status="pass" if passed else "fail",
                errored=errored,
                created_at=now(),
            )
        )
    return out


def _result(criterion: dict[str, Any], result: graders.GradeResult) -> dict[str, Any]:
    grader = criterion["grader"]
    failed = [e for e in result.errors if e.kind in graders.FAILURE_KINDS]
    score = result.score if math.isfinite(result.score) else 0.0
    return {
        "name": grader["name"],
        "type": grader["type"],
        "score": score,
        "passed": not failed and evals_service.passes(criterion, score),
        "sample": None,  # a judge's own sample is not kept by the remote graders
        "errored": bool(failed),
        "errors": [str(e) for e in result.errors],
    }


# -- the sweeper's part ---------------------------------------------------------------------------------------


def sweep_eval_runs(
    app: Celery, settings: Settings, *, queued_grace_seconds: float, held: set[str] | None = None
) -> list[str]:
    """End the canceled runs whose worker died, and wake a worker for the runs whose worker died (their lease
    expired) or whose message is lost (queued, enqueued longer than the grace period ago, and not among ``held``:
    the runs the broker still holds a message for; None when it cannot tell, and every such run is sent again);
    the ids woken. A run that merely waits behind busy workers keeps its one message and its place."""
    with session_scope(settings.db_url) as s:
        for run_id in evals_repo.settle_abandoned(s, grace_seconds=settings.lease_seconds):
            log.info("eval run %s: its worker died after a cancel was asked for; ended canceled", run_id)
    with session_scope(settings.db_url) as s:
        expired = evals_repo.expired_runs(s, grace_seconds=settings.lease_seconds)
        waiting = evals_repo.waiting_runs(s, grace_seconds=queued_grace_seconds)
    lost = [r for r in waiting if held is None or r not in held]
    for run_id in expired + lost:
        app.send_task(RUN_EVAL, args=[run_id], queue=DEFAULT_QUEUE)
        with session_scope(settings.db_url) as s:
            evals_repo.mark_enqueued(s, run_id=run_id)
        log.info("re-enqueued eval run %s: %s", run_id, "its worker died" if run_id in expired else "message lost")
    return expired + lost

"""SQL for evals: a tenant's evals, their runs (leased like jobs) and each run's output items.

A run's lifecycle is a few conditional UPDATEs, as a job's is (``api.repositories.runs``): ``claim`` takes a queued run,
or one whose worker's lease expired, for one worker; ``renew`` extends the lease while the worker holds it and tells it
whether a cancel was asked for; ``add_items`` writes a batch of graded items only while the lease is the worker's;
``finish`` ends the run once, and the event its end sends (``api.repositories.webhooks.eval_run_finished``) commits with
it. A worker that dies leaves the run ``in_progress`` with a lease that expires: the sweeper wakes another worker
(``expired_runs``), which goes on after the items already written. Functions take a session and never commit.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterable
from typing import Any, Literal

from sqlalchemy import ColumnElement, delete, func, or_, select, tuple_, update
from sqlalchemy.orm import Session

from api.orm import Eval, EvalOutputItem, EvalRun, now
from api.repositories import webhooks
from api.status import EvalRunStatus

Order = Literal["asc", "desc"]


def _won(result: Any) -> bool:
    return int(result.rowcount) == 1


def _page(stmt: Any, key: Any, bound: Any, order: Order, limit: int, session: Session) -> tuple[list[Any], bool]:
    if bound is not None:
        stmt = stmt.where(key > bound if order == "asc" else key < bound)
    columns = key.clauses if hasattr(key, "clauses") else [key]
    stmt = stmt.order_by(*(c.asc() if order == "asc" else c.desc() for c in columns)).limit(limit + 1)
    rows = list(session.scalars(stmt))
    return rows[:limit], len(rows) > limit


# -- evals ----------------------------------------------------------------------------------------------------


def add_eval(session: Session, *, row: Eval) -> Eval:
    session.add(row)
    session.flush()
    return row


def get_eval(session: Session, *, tenant_id: str, eval_id: str) -> Eval | None:
    return session.scalar(select(Eval).where(Eval.id == eval_id, Eval.tenant_id == tenant_id))


def evals_page(
    session: Session,
    *,
    tenant_id: str,
    after: Eval | None,
    limit: int,
    order: Order,
    order_by: Literal["created_at", "updated_at"],
) -> tuple[list[Eval], bool]:
    """The tenant's evals by (``order_by``, id), after the row ``after``; (rows, has_more)."""
    column = Eval.created_at if order_by == "created_at" else Eval.updated_at
    bound = None if after is None else tuple_(getattr(after, order_by), after.id)
    stmt = select(Eval).where(Eval.tenant_id == tenant_id)
    return _page(stmt, tuple_(column, Eval.id), bound, order, limit, session)


def delete_eval(session: Session, *, row: Eval) -> None:
    """The eval, its runs and their items (explicitly: SQLite may not enforce the cascades)."""
    run_ids = select(EvalRun.id).where(EvalRun.eval_id == row.id)
    session.execute(delete(EvalOutputItem).where(EvalOutputItem.run_id.in_(run_ids)))
    session.execute(delete(EvalRun).where(EvalRun.eval_id == row.id))
    session.delete(row)
    session.flush()


# -- runs -----------------------------------------------------------------------------------------------------


def add_run(session: Session, *, row: EvalRun) -> EvalRun:
    session.add(row)
    session.flush()
    return row


def get_run(session: Session, *, tenant_id: str, eval_id: str, run_id: str) -> EvalRun | None:
    return session.scalar(
        select(EvalRun).where(EvalRun.id == run_id, EvalRun.eval_id == eval_id, EvalRun.tenant_id == tenant_id)
    )


def load_run(session: Session, *, run_id: str) -> tuple[EvalRun, Eval] | None:
    """A run and its eval, for the worker that holds it."""
    row = session.execute(select(EvalRun, Eval).join(Eval, Eval.id == EvalRun.eval_id).where(EvalRun.id == run_id))
    found = row.first()
    return None if found is None else (found[0], found[1])


def runs_page(
    session: Session, *, eval_id: str, after: EvalRun | None, limit: int, order: Order, status: str | None
) -> tuple[list[EvalRun], bool]:
    stmt = select(EvalRun).where(EvalRun.eval_id == eval_id)
    if status is not None:
        stmt = stmt.where(EvalRun.status == status)
    bound = None if after is None else tuple_(after.created_at, after.id)
    return _page(stmt, tuple_(EvalRun.created_at, EvalRun.id), bound, order, limit, session)


def delete_run(session: Session, *, row: EvalRun) -> None:
    """The run and its items; a worker running it loses its lease (``renew`` finds no row) and stops."""
    session.execute(delete(EvalOutputItem).where(EvalOutputItem.run_id == row.id))
    session.delete(row)
    session.flush()


def cancel_queued(session: Session, *, run_id: str) -> bool:
    """A queued run (no worker holds it) canceled now, with its event; False when it is no longer queued."""
    at = now()
    result = session.execute(
        update(EvalRun)
        .where(EvalRun.id == run_id, EvalRun.status == EvalRunStatus.QUEUED)
        .values(
            status=EvalRunStatus.CANCELED,
            finished_at=at,
            lease_owner=None,
            lease_expires_at=None,
            **outcome(session, run_id=run_id),
        )
        .execution_options(synchronize_session=False)
    )
    if not _won(result):
        return False
    webhooks.eval_run_finished(session, run_id=run_id, status=EvalRunStatus.CANCELED, at=at)
    return True


def request_cancel(session: Session, *, run_id: str) -> bool:
    """Ask the worker of an in-progress run to stop (it ends the run ``canceled`` before its next batch)."""
    result = session.execute(
        update(EvalRun)
        .where(EvalRun.id == run_id, EvalRun.status == EvalRunStatus.IN_PROGRESS)
        .values(cancel_requested=True)
        .execution_options(synchronize_session=False)
    )
    return _won(result)


# -- the lease ------------------------------------------------------------------------------------------------


def _lease_free(at: float) -> ColumnElement[bool]:
    return or_(EvalRun.lease_owner.is_(None), EvalRun.lease_expires_at < at)


def claim(session: Session, *, run_id: str, worker_id: str, lease_seconds: float, at: float | None = None) -> bool:
    """Take the run if it is queued, or in progress under an expired lease, and no cancel is pending."""
    at = time.time() if at is None else at
    result = session.execute(
        update(EvalRun)
        .where(
            EvalRun.id == run_id,
            EvalRun.status.in_((EvalRunStatus.QUEUED, EvalRunStatus.IN_PROGRESS)),
            _lease_free(at),
            EvalRun.cancel_requested.is_(False),
        )
        .values(
            status=EvalRunStatus.IN_PROGRESS,
            lease_owner=worker_id,
            lease_expires_at=at + lease_seconds,
            attempts=EvalRun.attempts + 1,
            started_at=func.coalesce(EvalRun.started_at, int(at)),
        )
        .execution_options(synchronize_session=False)
    )
    return _won(result)


def renew(session: Session, *, run_id: str, worker_id: str, lease_seconds: float) -> tuple[bool, bool]:
    """Extend the worker's lease; (still held, cancel requested)."""
    result = session.execute(
        update(EvalRun)
        .where(EvalRun.id == run_id, EvalRun.lease_owner == worker_id, EvalRun.status == EvalRunStatus.IN_PROGRESS)
        .values(lease_expires_at=time.time() + lease_seconds)
        .execution_options(synchronize_session=False)
    )
    if not _won(result):
        return False, False
    cancel = session.scalar(select(EvalRun.cancel_requested).where(EvalRun.id == run_id))
    return True, bool(cancel)


def done_item_ids(session: Session, *, run_id: str) -> set[int]:
    """The data source items of the run already graded (by an earlier attempt, or this one)."""
    return set(session.scalars(select(EvalOutputItem.datasource_item_id).where(EvalOutputItem.run_id == run_id)))


def add_items(
    session: Session, *, run_id: str, worker_id: str, lease_seconds: float, rows: Iterable[EvalOutputItem]
) -> bool:
    """Write graded items while the lease is the worker's (renewed by the same transaction); an item written already
    (a batch retried after its COMMIT was lost) is not written twice. False: the run is no longer this worker's."""
    held, _ = renew(session, run_id=run_id, worker_id=worker_id, lease_seconds=lease_seconds)
    if not held:
        return False
    batch = list(rows)
    done = set(
        session.scalars(
            select(EvalOutputItem.datasource_item_id).where(
                EvalOutputItem.run_id == run_id,
                EvalOutputItem.datasource_item_id.in_([r.datasource_item_id for r in batch]),
            )
        )
    )
    session.add_all(r for r in batch if r.datasource_item_id not in done)
    session.flush()
    return True


def finish(
    session: Session,
    *,
    run_id: str,
    worker_id: str,
    status: EvalRunStatus,
    error: dict[str, str] | None = None,
) -> bool:
    """End the worker's run in ``status`` with the counts of its items, the sampled model's usage (a completions
    run) and the event it sends; False when the run is no longer this worker's."""
    at = now()
    result = session.execute(
        update(EvalRun)
        .where(EvalRun.id == run_id, EvalRun.lease_owner == worker_id, EvalRun.status == EvalRunStatus.IN_PROGRESS)
        .values(
            status=status,
            error=error,
            finished_at=at,
            **outcome(session, run_id=run_id),
            lease_owner=None,
            lease_expires_at=None,
        )
        .execution_options(synchronize_session=False)
    )
    if not _won(result):
        return False
    webhooks.eval_run_finished(session, run_id=run_id, status=status, at=at)
    return True


def outcome(session: Session, *, run_id: str) -> dict[str, Any]:
    """The columns a run ends with, from the items written so far, however it ends: ``result_counts``,
    ``per_testing_criteria_results`` and (a completions run) ``per_model_usage``."""
    counts, per_criteria = tallies(session, run_id=run_id)
    sampled = session.scalar(select(EvalRun.model).where(EvalRun.id == run_id)) is not None
    return {
        "result_counts": counts,
        "per_testing_criteria_results": per_criteria,
        "per_model_usage": usage(session, run_id=run_id) if sampled else None,
    }


def tallies(session: Session, *, run_id: str) -> tuple[dict[str, int], list[dict[str, Any]]]:
    """``result_counts`` and ``per_testing_criteria_results`` of the run's items: an errored item (no sample, or a
    criterion that produced no score) counts as errored only; a criterion's passed/failed count the items it scored."""
    rows = session.execute(
        select(EvalOutputItem.status, EvalOutputItem.errored, EvalOutputItem.results).where(
            EvalOutputItem.run_id == run_id
        )
    ).all()
    counts = Counter[str]()
    passed: Counter[str] = Counter()
    failed: Counter[str] = Counter()
    names: list[str] = []
    for status, errored, results in rows:
        counts["total"] += 1
        counts["errored" if errored else ("passed" if status == "pass" else "failed")] += 1
        for result in results:
            name = str(result["name"])
            if name not in names:
                names.append(name)
            if result.get("errored"):
                continue
            (passed if result["passed"] else failed)[name] += 1
    totals = {k: counts[k] for k in ("total", "errored", "failed", "passed")}
    return totals, [{"testing_criteria": n, "passed": passed[n], "failed": failed[n]} for n in names]


def usage(session: Session, *, run_id: str) -> list[dict[str, Any]]:
    """``per_model_usage``: the token counts the inference server reported for the run's completions, by model."""
    by_model: dict[str, Counter[str]] = {}
    for (sample,) in session.execute(select(EvalOutputItem.sample).where(EvalOutputItem.run_id == run_id)):
        tokens = (sample or {}).get("usage")
        if not isinstance(tokens, dict):
            continue  # no completion (its sampling failed)
        counts = by_model.setdefault(str(sample.get("model")), Counter())
        counts["invocation_count"] += 1
        for key in ("prompt_tokens", "completion_tokens", "total_tokens", "cached_tokens"):
            counts[key] += int(tokens.get(key) or 0)
    fields = ("invocation_count", "prompt_tokens", "completion_tokens", "total_tokens", "cached_tokens")
    return [{"model_name": model, **{k: c[k] for k in fields}} for model, c in by_model.items()]


# -- the sweeper's ----------------------------------------------------------------------------------------------


def expired_runs(session: Session, *, grace_seconds: float) -> list[str]:
    """In-progress runs whose lease expired ``grace_seconds`` ago (their worker died) and that no cancel waits on."""
    at = time.time() - grace_seconds
    return list(
        session.scalars(
            select(EvalRun.id).where(
                EvalRun.status == EvalRunStatus.IN_PROGRESS,
                EvalRun.lease_expires_at < at,
                EvalRun.cancel_requested.is_(False),
            )
        )
    )


def settle_abandoned(session: Session, *, grace_seconds: float) -> list[str]:
    """End ``canceled`` the in-progress runs asked to cancel whose worker died (no worker claims them again)."""
    at = time.time() - grace_seconds
    ids = list(
        session.scalars(
            select(EvalRun.id).where(
                EvalRun.status == EvalRunStatus.IN_PROGRESS,
                EvalRun.lease_expires_at < at,
                EvalRun.cancel_requested.is_(True),
            )
        )
    )
    settled = []
    for run_id in ids:
        result = session.execute(
            update(EvalRun)
            .where(EvalRun.id == run_id, EvalRun.status == EvalRunStatus.IN_PROGRESS, EvalRun.lease_expires_at < at)
            .values(
                status=EvalRunStatus.CANCELED,
                finished_at=now(),
                lease_owner=None,
                lease_expires_at=None,
                **outcome(session, run_id=run_id),
            )
            .execution_options(synchronize_session=False)
        )
        if _won(result):
            webhooks.eval_run_finished(session, run_id=run_id, status=EvalRunStatus.CANCELED)
            settled.append(run_id)
    return settled


def waiting_runs(session: Session, *, grace_seconds: float) -> list[str]:
    """Queued runs never enqueued, or enqueued more than ``grace_seconds`` ago (the message may be lost: a duplicate
    is harmless, the claim lets one worker run it)."""
    at = time.time() - grace_seconds
    return list(
        session.scalars(
            select(EvalRun.id).where(
                EvalRun.status == EvalRunStatus.QUEUED,
                or_(EvalRun.enqueued_at.is_(None), EvalRun.enqueued_at < at),
            )
        )
    )


def mark_enqueued(session: Session, *, run_id: str) -> None:
    session.execute(
        update(EvalRun)
        .where(EvalRun.id == run_id)
        .values(enqueued_at=time.time())
        .execution_options(synchronize_session=False)
    )


# -- output items ---------------------------------------------------------------------------------------------


def items_page(
    session: Session,
    *,
    run_id: str,
    after: EvalOutputItem | None,
    limit: int,
    order: Order,
    status: str | None,
) -> tuple[list[EvalOutputItem], bool]:
    """The run's items by (datasource_item_id, id): the data source's order."""
    stmt = select(EvalOutputItem).where(EvalOutputItem.run_id == run_id)
    if status is not None:
        stmt = stmt.where(EvalOutputItem.status == status)
    bound = None if after is None else tuple_(after.datasource_item_id, after.id)
    return _page(stmt, tuple_(EvalOutputItem.datasource_item_id, EvalOutputItem.id), bound, order, limit, session)


def get_item(session: Session, *, run_id: str, item_id: str) -> EvalOutputItem | None:
    return session.scalar(select(EvalOutputItem).where(EvalOutputItem.id == item_id, EvalOutputItem.run_id == run_id))

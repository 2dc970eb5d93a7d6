"""The end of one attempt at a job: what the trainer's run ended as (succeeded with result files, cancelled, paused,
failed with an actionable code, or killed by someone else's SIGKILL), recorded with one conditional update and its
event. A job's error is for its owner: a code and a message to act on, the worker's paths replaced by the names the
user knows (``worker.redact``); a trainer's traceback goes to this worker's log only."""

from __future__ import annotations

import csv
import io
import logging
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from api import ids
from api.db import session_scope
from api.repositories import runs
from api.status import JobStatus
from api.storage import StoreFull
from worker import messages as msg
from worker.errors import ErrorCode
from worker.job_context import ClaimedJob, JobContext, Progress
from worker.job_follow import TrainerRun
from worker.job_prepare import TRAINING_COPY, VALIDATION_COPY
from worker.redact import Redactor
from worker.trainer_process import TrainerProcess
from worker.validation import dataset_message

log = logging.getLogger("proxima.worker")

STDERR_TAIL_LINES = 60  # of a failed trainer's output, written to the worker's log


@dataclass(frozen=True)
class KilledBySomeoneElse:
    """The trainer died of a SIGKILL this worker did not send; ``cause``: what the kernel says of it."""

    cause: str


@dataclass(frozen=True)
class StoredResults:
    """The final adapter's archive and the metrics table, uploaded as the job's result files."""

    adapter_id: str
    adapter_key: str
    adapter_size: int
    csv_id: str
    csv_key: str
    csv_size: int


def stopped_as(stop_reason: str | None, *, cancel_now: bool) -> str:
    """What a run that stopped early at a step boundary ends as (``cancel`` or ``pause``), given the reason it was
    told to stop for and whether a cancel is set when it has stopped. A cancel asked while the run was stopping for a
    pause still wins: the user's last word is cancel."""
    return "cancel" if cancel_now else (stop_reason or "pause")


def metrics_csv(rows: Sequence[tuple[int, Mapping[str, float | None]]]) -> bytes:
    """One line per step, a column per metric (sorted; ``step`` first); a metric a step lacks is left empty."""
    names = sorted({k for _, values in rows for k in values})
    out = io.StringIO()
    w = csv.writer(out)
    w.writerow(["step", *names])
    for step, values in rows:
        cells = []
        for n in names:
            v = values.get(n)
            cells.append("" if v is None or not math.isfinite(v) else repr(float(v)))
        w.writerow([step, *cells])
    return out.getvalue().encode()


def store_full_message(what: str) -> str:
    return (
        f"the artifact store is full: {what} of this job could not be stored. Free space in the store (delete "
        "files or finished jobs you no longer need) and create the job again"
    )


def record_outcome(ctx: JobContext, what: str, write: Callable[[Any], bool], event_id: str) -> bool:
    """Run ``write(session)`` (the outcome's conditional update, then its event of id ``event_id``) through an
    outage; True when it took. A try whose COMMIT landed unseen is recognised by that event."""

    def unit() -> bool:
        with session_scope(ctx.url) as s:
            if runs.event_exists(s, event_id=event_id):
                return True
            if write(s):
                return True
            s.rollback()
            return False

    return ctx.db(what, unit)


def fail(ctx: JobContext, code: ErrorCode, message: str) -> str:
    """Fail the job with ``code`` and ``message`` (the user's to act on) and its event."""
    event_id = ids.event_id()

    def write(s: Any) -> bool:
        error = {"code": code, "message": message, "param": None}
        if not runs.finish(s, job_id=ctx.job_id, worker_id=ctx.worker_id, status=JobStatus.FAILED, error=error):
            return False
        runs.add_event(s, job_id=ctx.job_id, level="error", message=f"The job failed: {message}", event_id=event_id)
        return True

    record_outcome(ctx, "record the failure", write, event_id)
    log.warning("job %s failed (%s): %s", ctx.job_id, code, message)
    return JobStatus.FAILED


class Finisher:
    """Judges a :class:`TrainerRun` and records the job's outcome; returns the status it ended in (``"lost"``: the
    lease was taken before the outcome landed)."""

    def __init__(self, ctx: JobContext, job: ClaimedJob, progress: Progress, redactor: Redactor) -> None:
        self.ctx, self.job, self.progress, self.redactor = ctx, job, progress, redactor

    def conclude(self, run: TrainerRun) -> str | KilledBySomeoneElse:
        final, trainer = run.final, run.trainer
        if isinstance(final, msg.Done) and run.rc == 0:
            if final.stopped:
                return self.stopped(stopped_as(run.stop_reason, cancel_now=run.cancel_now), final.last_step)
            return self.succeed()
        if run.cancel_now:
            return self.stopped("cancel", None)
        if run.stop_reason == "pause" and (trainer.forced or trainer.killed_by_someone_else):
            return self.stopped("pause", self.ctx.latest_stored_step())  # where the latest stored checkpoint is
        if isinstance(final, msg.Error):
            return fail(self.ctx, final.code, self._user_message(final, trainer))
        if trainer.killed_by_someone_else:
            confirmed = trainer.oom_confirmed
            log.warning(
                "job %s: the trainer (pid %d) was killed by SIGKILL not sent by this worker (cgroup OOM kill: %s)",
                self.ctx.job_id,
                trainer.pid,
                {True: "counted", False: "not counted", None: "not readable"}[confirmed],
            )
            if confirmed:
                return KilledBySomeoneElse("the kernel killed the trainer for running out of memory")
            return KilledBySomeoneElse("the trainer was killed (SIGKILL), most likely for running out of memory")
        self._log_trainer_output(trainer, f"exited with code {run.rc}")
        how = f"was ended by signal {-run.rc}" if run.rc < 0 else f"exited with code {run.rc}"
        return fail(
            self.ctx,
            ErrorCode.TRAINER_ERROR,
            f"the trainer {how} without reporting an error; the worker's log has its output",
        )

    def succeed(self) -> str:
        """Store the final adapter and the metrics table as result files and record the success; a full store or a
        missing adapter fails the job instead."""
        adapter = self.ctx.run_dir / "adapter"
        if not (adapter / "adapter_config.json").is_file():
            return fail(self.ctx, ErrorCode.TRAINER_ERROR, "the trainer finished without writing the final adapter")
        results = self._store_results(adapter)
        if results is None:
            return fail(self.ctx, ErrorCode.STORAGE_FULL, store_full_message("the final adapter or metrics"))
        j = self.job
        model = ids.fine_tuned_model_name(model=j.model, tenant_id=j.tenant_id, suffix=j.suffix, job_id=j.job_id)
        done_event = ids.event_id()
        if not record_outcome(
            self.ctx, "record the success", self._success_write(results, model, done_event), done_event
        ):
            self.ctx.store.delete(results.adapter_key)
            self.ctx.store.delete(results.csv_key)
            return "lost"
        return JobStatus.SUCCEEDED

    def _store_results(self, adapter: Path) -> StoredResults | None:
        """Upload the adapter's archive and the metrics table; None when the store is full (nothing left of them)."""
        from trainer.loops.checkpoint import archive_adapter

        ctx, tenant = self.ctx, self.job.tenant_id
        adapter_id, csv_id = ids.file_id(), ids.file_id()
        archive = archive_adapter(adapter, ctx.run_dir / "adapter.tar.gz")
        adapter_key = f"files/{tenant}/{adapter_id}.tar.gz"
        csv_key = f"files/{tenant}/{csv_id}.csv"

        def metric_rows() -> list[tuple[int, Mapping[str, float | None]]]:
            with session_scope(ctx.url) as s:
                return [(r.step, r.values) for r in runs.metric_rows(s, job_id=ctx.job_id)]

        table = metrics_csv(ctx.db("read the metrics", metric_rows))
        try:
            adapter_size = ctx.store.put_file(adapter_key, archive)
            csv_size = ctx.store.put_bytes(csv_key, table)
        except StoreFull:
            ctx.store.delete(adapter_key)
            return None
        return StoredResults(adapter_id, adapter_key, adapter_size, csv_id, csv_key, csv_size)

    def _success_write(self, results: StoredResults, model: str, done_event: str) -> Callable[[Any], bool]:
        """The success as one unit: the result files' rows, the job succeeded, its final progress and events."""
        ctx, tenant, p = self.ctx, self.job.tenant_id, self.progress

        def write(s: Any) -> bool:
            runs.add_result_file(
                s,
                tenant_id=tenant,
                filename=f"{ctx.job_id}-metrics.csv",
                size=results.csv_size,
                storage_key=results.csv_key,
                file_id=results.csv_id,
            )
            runs.add_result_file(
                s,
                tenant_id=tenant,
                filename=f"{ctx.job_id}-adapter.tar.gz",
                size=results.adapter_size,
                storage_key=results.adapter_key,
                file_id=results.adapter_id,
            )
            if not runs.finish(
                s,
                job_id=ctx.job_id,
                worker_id=ctx.worker_id,
                status=JobStatus.SUCCEEDED,
                fine_tuned_model=model,
                result_files=[results.csv_id, results.adapter_id],
            ):
                return False
            runs.update_progress(
                s,
                job_id=ctx.job_id,
                current_step=p.total_steps or 0,
                total_steps=p.total_steps,
                trained_tokens=p.trained_tokens(),
                estimated_finish=None,
            )
            runs.add_event(s, job_id=ctx.job_id, level="info", message=f"New fine-tuned model created: {model}")
            message = "The job has successfully completed"
            runs.add_event(s, job_id=ctx.job_id, level="info", message=message, event_id=done_event)
            return True

        return write

    def stopped(self, reason: str, step: int | None) -> str:
        """Record the job cancelled or paused (at ``step``, when known)."""
        ctx = self.ctx
        status = JobStatus.CANCELLED if reason == "cancel" else JobStatus.PAUSED
        at = f" at step {step}" if step is not None else ""
        message = (
            f"The job was cancelled{at}"
            if status == JobStatus.CANCELLED
            else f"The job was paused{at}: resume continues there"
        )
        event_id = ids.event_id()

        def write(s: Any) -> bool:
            if not runs.finish(s, job_id=ctx.job_id, worker_id=ctx.worker_id, status=status):
                return False
            runs.add_event(s, job_id=ctx.job_id, level="info", message=message, event_id=event_id)
            return True

        if record_outcome(ctx, f"record the {status}", write, event_id):
            return status
        # Refused: a cancel landed after the flags were read, and it wins.
        if status == JobStatus.PAUSED and ctx.db("read the control flags", ctx.read_flags)[0]:
            return self.stopped("cancel", step)
        return status

    def _user_message(self, error: msg.Error, trainer: TrainerProcess) -> str:
        """What the job's error says: a dataset error names the user's file id and line, not the worker's local copy;
        an unexpected error its class and first line (its traceback goes to this worker's log); paths are
        redacted."""
        if error.code == ErrorCode.TRAINER_ERROR:
            self._log_trainer_output(trainer, "failed")
            after = f" after step {error.step}" if error.step else ""
            return (
                f"the trainer failed{after} with an unexpected error ({self.redactor.text(error.message)}). An "
                "extreme hyperparameter (a very large learning rate, say) can cause this; otherwise it is a bug, "
                "and the worker's log has the details"
            )
        if error.path is not None and error.detail is not None:
            local, data = Path(error.path), self.ctx.data_dir
            if local == data / TRAINING_COPY:
                return dataset_message("training", self.job.training_file, line=error.line, detail=error.detail)
            if local == data / VALIDATION_COPY and self.job.validation_file:
                return dataset_message("validation", self.job.validation_file, line=error.line, detail=error.detail)
        return self.redactor.text(error.message)

    def _log_trainer_output(self, trainer: TrainerProcess, what: str) -> None:
        log.error(
            "job %s: the trainer %s; the end of its output:\n%s",
            self.ctx.job_id,
            what,
            trainer.stderr_tail(STDERR_TAIL_LINES),
        )

"""``proxima.jobs.run``: claim a job in the database, run its trainer in a child process, record what it reports.

:func:`run_job` is the plain function behind the Celery task (tests call it directly). A job still in
``validating_files`` first has its files validated (``worker.validation``), which ends it ``failed`` or ``queued``.
Then one attempt, phase by phase:

1. claim the job with a lease (``worker.job_claim``: one conditional UPDATE; losing the race means another worker
   has it: return);
2. prepare a run folder (``worker.job_prepare``): the dataset files from the artifact store, the spec with local
   paths and the model resolved, and the latest stored checkpoint, so the trainer resumes from it (step numbers
   continue);
3. start the trainer and follow it (``worker.job_follow``) while a heartbeat thread renews the lease
   (``worker.lease``): its metrics, events, rollouts and checkpoints written as they arrive, cancel and pause
   requests passed on, a trainer that does not stop within the grace period terminated;
4. record the outcome (``worker.job_finish``: succeeded with result files, cancelled, paused, failed with an
   actionable code) and release the lease. A worker that lost its lease kills its trainer and writes nothing more:
   the job belongs to another.

Faults the attempt rides out rather than fails on:

- the database unreachable for a while (a restart, a connection reset): progress is buffered in order and written
  when it is back (``worker.outbox``), the lease renewed as soon as it answers (``worker.lease``);
- the trainer killed by someone else's SIGKILL (the kernel's out-of-memory killer): it is started again once from
  the latest stored checkpoint (``OOM_RETRIES``); a second such kill fails the job ``out_of_memory``.

A job's error and events are for its owner: a code and a message to act on, the worker's paths replaced by the names
the user knows (``worker.redact``); a trainer's traceback goes to this worker's log only.
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import tempfile
import uuid
from pathlib import Path
from typing import Any

from api.db import session_scope
from api.repositories import runs
from api.settings import Settings
from api.status import JobStatus
from api.storage import StoreFull
from api.tasks import RUN_JOB
from worker import trackers
from worker.celery_app import app
from worker.celery_app import settings as current_settings
from worker.errors import ErrorCode, JobError
from worker.job_claim import claim, release, worker_error_recorder
from worker.job_context import ClaimedJob, JobContext, Progress
from worker.job_finish import Finisher, KilledBySomeoneElse, fail, store_full_message
from worker.job_follow import Follower, Relay
from worker.job_prepare import prepare_run_folder, restore_checkpoint
from worker.lease import Heartbeat
from worker.models import store_for
from worker.outbox import DatabaseUnavailable, retry_db
from worker.validation import validate_files

log = logging.getLogger("proxima.worker")

STOP_GRACE_S = 60.0
"""Default of ``--stop-grace``: how long a trainer asked to stop (cancel, pause) has before it is terminated."""
STOP_GRACE_CONF = "proxima_stop_grace_seconds"  # the Celery app's setting that carries the worker's --stop-grace
OOM_RETRIES = 1
_PROCESS_TOKEN = uuid.uuid4().hex[:8]

OOM_ADVICE = (
    "lower batch_size, group_size, max_completion_tokens or micro_batch_size, or use a machine with more memory"
)


def default_worker_id(hostname: str | None = None) -> str:
    """Unique per worker process (a restarted worker with a reused pid is not mistaken for the old owner)."""
    return f"{hostname or socket.gethostname()}:{os.getpid()}:{_PROCESS_TOKEN}"


@app.task(name=RUN_JOB, bind=True, acks_late=True, reject_on_worker_lost=True, ignore_result=True)
def run_job_task(self: Any, job_id: str) -> str:
    return run_job(
        job_id,
        settings=current_settings(),
        worker_id=default_worker_id(self.request.hostname),
        stop_grace_s=float(self.app.conf.get(STOP_GRACE_CONF) or STOP_GRACE_S),
    )


def run_job(job_id: str, *, settings: Settings, worker_id: str, stop_grace_s: float = STOP_GRACE_S) -> str:
    """Run one attempt at ``job_id`` if this worker can claim it; returns the status it ended in, or ``"skipped"``
    (not claimable: finished, paused, cancelled, or held by a live lease), ``"lost"`` (the lease was taken) or
    ``"abandoned"`` (the database stayed unreachable: the lease runs out and another worker resumes the job)."""
    url = settings.db_url
    if validate_files(job_id, settings=settings, store=store_for(settings), worker_id=worker_id) == JobStatus.FAILED:
        return JobStatus.FAILED
    job = retry_db(f"job {job_id}: claim", lambda: claim(settings, job_id, worker_id))
    if job is None:
        log.info("job %s not claimable by %s: skipped", job_id, worker_id)
        return "skipped"
    log.info("job %s claimed by %s (attempt %d)", job_id, worker_id, job.attempt)
    runs_root = settings.home / "runs"
    runs_root.mkdir(parents=True, exist_ok=True)
    run_dir = Path(tempfile.mkdtemp(prefix=f"{job_id}-", dir=runs_root))
    try:
        store = store_for(settings)
        ctx = JobContext(settings=settings, worker_id=worker_id, job_id=job.job_id, run_dir=run_dir, store=store)
        return _Runner(ctx, job, stop_grace_s=stop_grace_s).run()
    except DatabaseUnavailable:
        log.error("job %s: the database stayed unreachable; giving the job up to its lease's expiry", job_id)
        return "abandoned"
    except Exception:
        log.exception("job %s: worker error", job_id)
        try:
            retry_db(f"job {job_id}: record the worker error", worker_error_recorder(url, job_id, worker_id))
        except Exception:
            log.exception("job %s: could not record the worker error", job_id)
        return JobStatus.FAILED
    finally:
        try:
            retry_db(f"job {job_id}: release the lease", lambda: release(url, job_id, worker_id), patience_s=60)
        except Exception:
            log.warning("job %s: could not release the lease; it expires by itself", job_id, exc_info=True)
        shutil.rmtree(run_dir, ignore_errors=True)


class _Runner:
    """One attempt, phase by phase: the run folder prepared, the trainer followed (started again once after an
    out-of-memory kill) and its outcome recorded; exported to the job's experiment trackers as it goes."""

    def __init__(self, ctx: JobContext, job: ClaimedJob, *, stop_grace_s: float) -> None:
        self.ctx, self.job, self.stop_grace_s = ctx, job, stop_grace_s
        self.progress = Progress()
        self.trackers = trackers.Exporter([], job_id=job.job_id)  # run() starts the job's integrations
        # A job that asks for devices runs as that many ranks under the launcher (worker.launch), even one.
        resources = job.spec.resources
        self.ranks = resources.gpus if resources is not None else None

    def run(self) -> str:
        """The attempt; the trackers are closed with its outcome (after it is recorded: a slow tracker does not delay
        the job's end)."""
        outcome = "abandoned"  # the database stayed unreachable: another attempt continues the runs
        self.trackers = trackers.start(
            self.ctx.settings, job_id=self.job.job_id, model=self.job.model, spec=self.job.spec
        )
        try:
            outcome = self._attempt()
            return outcome
        except DatabaseUnavailable:
            raise
        except Exception:
            outcome = JobStatus.FAILED  # run_job fails the job (internal_error)
            raise
        finally:
            self._close_trackers(outcome)

    def _close_trackers(self, outcome: str) -> None:
        """Flush and close the trackers (bounded by ``tracker_close_timeout_s``) and record their last warnings; an
        attempt that lost the job, or the database, writes nothing more."""
        self.trackers.close(outcome)
        if outcome in ("lost", "abandoned"):
            return
        for warning in self.trackers.events():
            try:
                self.ctx.db(
                    "record an export warning", self.ctx.event_write("warn", warning.message, data=warning.data).run
                )
            except Exception:
                log.warning("job %s: could not record an export warning: %s", self.job.job_id, warning.message)

    def _attempt(self) -> str:
        ctx, job = self.ctx, self.job
        try:
            redactor = prepare_run_folder(ctx, job)
        except JobError as err:
            return fail(ctx, err.code, err.message)
        relay = Relay(ctx, job, self.progress, redactor, self.trackers)
        follower = Follower(ctx, relay, stop_grace_s=self.stop_grace_s, ranks=self.ranks)
        finisher = Finisher(ctx, job, self.progress, redactor)
        heartbeat = Heartbeat(ctx.settings, ctx.job_id, ctx.worker_id, claimed_at=job.claimed_at)
        heartbeat.start()
        try:
            self._announce_start(self._restore())
            retries = OOM_RETRIES
            while True:
                outcome = self._run_trainer(follower, finisher, heartbeat)
                if not isinstance(outcome, KilledBySomeoneElse):
                    return outcome
                if retries == 0:
                    return fail(ctx, ErrorCode.OUT_OF_MEMORY, f"{outcome.cause}: {OOM_ADVICE}")
                retries -= 1
                step = self._restore()
                where = f"the checkpoint at step {step}" if step else "the start (there was no checkpoint yet)"
                cause = outcome.cause[0].upper() + outcome.cause[1:]
                ctx.record_event("warn", f"{cause}; training again from {where}, once before the job fails")
        finally:
            heartbeat.done.set()

    def _restore(self) -> int:
        """The latest stored checkpoint in the run folder, the progress rewound to it; its step (0: none)."""
        restored = restore_checkpoint(self.ctx)
        self.progress.resume_step = restored.step
        self.progress.tokens_by_step = restored.tokens_by_step
        return restored.step

    def _announce_start(self, step: int) -> None:
        """The job's first event of this attempt; a resumed run's trackers get the metrics up to its checkpoint."""
        attempt = self.job.attempt
        if step:
            self.ctx.record_event("info", f"Resuming from the checkpoint at step {step} (attempt {attempt})")
            self.trackers.backfill(self.ctx.db("read the metrics", lambda: self._metric_rows(step)))
        else:
            self.ctx.record_event("info", "Fine-tuning job started" + (f" (attempt {attempt})" if attempt > 1 else ""))

    def _run_trainer(self, follower: Follower, finisher: Finisher, heartbeat: Heartbeat) -> str | KilledBySomeoneElse:
        """One start of the trainer, followed to its end and judged."""
        try:
            run = follower.follow(heartbeat)
        except StoreFull:
            return fail(self.ctx, ErrorCode.STORAGE_FULL, store_full_message("a checkpoint"))
        if isinstance(run, str):  # the lease was lost
            return run
        return finisher.conclude(run)

    def _metric_rows(self, up_to: int) -> list[tuple[int, dict[str, float | None]]]:
        with session_scope(self.ctx.url) as s:
            return [(r.step, dict(r.values)) for r in runs.metric_rows(s, job_id=self.ctx.job_id, up_to=up_to)]

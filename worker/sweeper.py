"""The sweeper: finishes what dead workers left, re-enqueues jobs the broker no longer holds a message for, and
cleans the artifact store now and then.

The database is the truth and a broker message only a wake-up call, so every worker runs a sweeper
thread that, every ``interval`` seconds:

1. ends the running jobs whose worker died after a cancel or a pause was asked for (``runs.settle_abandoned``):
   nobody would ever act on the request otherwise, since no worker claims a job with a cancel pending;
2. sends a new message for running jobs whose lease expired a while ago (their worker died, and its unacknowledged
   message may not come back for an hour);
3. sends a new message for jobs waiting for a worker (``validating_files``, ``queued``) enqueued longer ago than a
   grace period whose message the broker no longer holds (``worker.broker``): lost with a broker restart, or never
   sent. A job that merely waits behind busy workers keeps its one message and its place in the queue. Where the
   broker's contents cannot be read, a job waiting past the grace period is re-sent (at most once a grace period);
4. the same for eval runs (``worker.evals.sweep_eval_runs``): a canceled run whose worker died ends ``canceled``, one
   whose worker died is sent again, and so is a queued one whose ``proxima.evals.run`` message the broker no longer
   holds (read as for jobs: :func:`worker.broker.held_task_ids`);
5. every ``cleanup_every`` seconds, removes the artifact store's orphans (``api.services.cleanup``).

A job re-enqueued twice is harmless: the lease lets one worker run it.
"""

from __future__ import annotations

import logging
import threading
import time

from celery import Celery

from api.db import session_scope
from api.repositories import runs
from api.services.cleanup import clean_orphans
from api.settings import Settings
from api.storage import store_from_url
from api.tasks import DEFAULT_QUEUE, RUN_EVAL, RUN_JOB, queue_for, queues_of
from worker.broker import held_job_ids, held_task_ids
from worker.evals import sweep_eval_runs
from worker.outbox import is_transient

log = logging.getLogger("proxima.sweeper")

SWEEP_INTERVAL_S = 5.0
QUEUED_GRACE_S = 30.0
CLEANUP_INTERVAL_S = 600.0


def sweep_once(app: Celery, settings: Settings, *, queued_grace_seconds: float = QUEUED_GRACE_S) -> list[str]:
    """One round of steps 1-3; returns the ids of the jobs it sent a message for."""
    with session_scope(settings.db_url) as s:
        for job_id, status in runs.settle_abandoned(s, grace_seconds=settings.lease_seconds):
            log.info("job %s: its worker died after a stop was requested; ended %s", job_id, status)
    largest = max(settings.max_job_gpus, settings.worker_devices or 1)  # the job sizes whose queues are read
    try:  # read before the jobs: a message taken in between belongs to a job claimed by the time they are read
        held = held_job_ids(app, reserved_grace_s=queued_grace_seconds, queues=queues_of(largest))
    except Exception:
        log.warning("could not read the broker's queue; re-sending every waiting job", exc_info=True)
        held = None
    with session_scope(settings.db_url) as s:
        expired = runs.expired_jobs(s, grace_seconds=settings.lease_seconds)
        waiting = runs.waiting_jobs(s, grace_seconds=queued_grace_seconds)
        gpus = runs.job_gpus(s, job_ids=expired + waiting)
    # (a job larger than the queues read cannot be told held: it is sent again, which its lease makes harmless)
    lost = [j for j in waiting if held is None or j not in held or gpus.get(j, 1) > largest]
    sent = []
    for job_id in expired + lost:
        app.send_task(RUN_JOB, args=[job_id], queue=queue_for(gpus.get(job_id, 1)))
        with session_scope(settings.db_url) as s:
            runs.mark_enqueued(s, job_id=job_id)
        why = "its worker died" if job_id in expired else "its message was lost"
        log.info("re-enqueued job %s: %s", job_id, why)
        sent.append(job_id)
    return sent


def sweep_evals_once(app: Celery, settings: Settings, *, queued_grace_seconds: float = QUEUED_GRACE_S) -> list[str]:
    """Step 4; returns the ids of the eval runs it sent a message for."""
    try:  # read before the runs, as for jobs
        held = held_task_ids(app, task=RUN_EVAL, reserved_grace_s=queued_grace_seconds, queues=[DEFAULT_QUEUE])
    except Exception:
        log.warning("could not read the broker's queue; re-sending every waiting eval run", exc_info=True)
        held = None
    return sweep_eval_runs(app, settings, queued_grace_seconds=queued_grace_seconds, held=held)


# -- what the broker holds, for any task whose first argument is the id of its row --------------------------
# (worker.broker reads the same for proxima.jobs.run only)


class Sweeper(threading.Thread):
    def __init__(
        self,
        app: Celery,
        settings: Settings,
        *,
        interval: float = SWEEP_INTERVAL_S,
        queued_grace_seconds: float = QUEUED_GRACE_S,
        cleanup_every: float = CLEANUP_INTERVAL_S,
    ) -> None:
        super().__init__(daemon=True, name="proxima-sweeper")
        self.app, self.settings = app, settings
        self.interval, self.queued_grace_seconds = interval, queued_grace_seconds
        self.cleanup_every = cleanup_every
        self.stopped = threading.Event()

    def run(self) -> None:
        next_cleanup = time.monotonic() + self.cleanup_every
        while not self.stopped.wait(self.interval):
            for sweep in (sweep_once, sweep_evals_once):  # one failing does not hold the other back
                try:
                    sweep(self.app, self.settings, queued_grace_seconds=self.queued_grace_seconds)
                except Exception as err:  # a database or broker hiccup: try again next round
                    if is_transient(err):
                        log.warning("sweep skipped: the database is unavailable (%s)", type(err).__name__)
                    else:
                        log.warning("sweep failed", exc_info=True)
            if time.monotonic() >= next_cleanup:
                next_cleanup = time.monotonic() + self.cleanup_every
                self.clean_store()

    def clean_store(self) -> None:
        try:
            store = store_from_url(self.settings.artifacts_url, endpoint_url=self.settings.s3_endpoint_url)
            clean_orphans(url=self.settings.db_url, store=store)
        except Exception:
            log.warning("artifact store clean-up failed", exc_info=True)

    def stop(self) -> None:
        self.stopped.set()

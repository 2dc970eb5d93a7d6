"""``proxima.jobs.run``: claim a job in the database, run its trainer in a child process, record what it reports.

:func:`run_job` is the plain function behind the Celery task (tests call it directly). A job still in
``validating_files`` first has its files validated (``worker.validation``), which ends it ``failed`` or ``queued``.
Then one attempt:

1. claim the job with a lease (one conditional UPDATE; losing the race means another worker has it: return);
2. prepare a run folder: the dataset files from the artifact store, the spec with local paths and the model
   resolved, and the latest stored checkpoint, so the trainer resumes from it (step numbers continue);
3. start the trainer (``worker.trainer_process``) and, while it trains, renew the lease (a heartbeat thread), write
   its metrics, events, rollouts and checkpoints as they arrive (a checkpoint's objects are uploaded before its row
   is written, so a row always names a complete checkpoint), and pass on cancel and pause requests read from the
   database, terminating a trainer that does not stop within the grace period;
4. record the outcome (succeeded with result files, cancelled, paused, failed with an actionable code) and release
   the lease. A worker that lost its lease kills its trainer and writes nothing more: the job belongs to another.

Faults the attempt rides out rather than fails on:

- the database unreachable for a while (a restart, a connection reset): progress is buffered in order and written
  when it is back (``worker.outbox``), the lease renewed as soon as it answers (``worker.lease``);
- the trainer killed by someone else's SIGKILL (the kernel's out-of-memory killer): it is started again once from
  the latest stored checkpoint (``OOM_RETRIES``); a second such kill fails the job ``out_of_memory``.

A job's error and events are for its owner: a code and a message to act on, the worker's paths replaced by the names
the user knows (``worker.redact``); a trainer's traceback goes to this worker's log only.
"""

from __future__ import annotations

import csv
import io
import json
import logging
import math
import os
import shutil
import signal
import socket
import tarfile
import tempfile
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from api import ids
from api.db import session_scope
from api.orm import now
from api.repositories import runs
from api.services import graders as graders_service
from api.services.integrations import trainer_spec
from api.services.jobs import reward_model_refs
from api.settings import Settings
from api.status import JobStatus
from api.storage import ArtifactStore, NotFound, StoreFull, store_from_url
from api.tasks import RUN_JOB
from trainer import builtin_models
from trainer.spec import metrics as M
from trainer.spec.names import BUILTIN_MODELS
from worker import messages as msg
from worker import trackers
from worker.celery_app import app
from worker.celery_app import settings as current_settings
from worker.errors import ErrorCode, JobError
from worker.estimate import Cadence, StepTime, estimated_finish, ran_validation
from worker.lease import Heartbeat
from worker.outbox import DatabaseUnavailable, Outbox, Write, is_transient, retry_db
from worker.redact import Redactor
from worker.runner import REMOTE_GRADERS_ENV
from worker.trainer_process import Ended, TrainerProcess
from worker.validation import dataset_message, download_dataset, validate_files

log = logging.getLogger("proxima.worker")

T = TypeVar("T")

TRAINING_COPY, VALIDATION_COPY = "train.jsonl", "validation.jsonl"  # file names in the run folder's data/
CONTROL_POLL_S = 1.0  # how often the database is read for cancel and pause requests
STDERR_TAIL_LINES = 60  # of a failed trainer's output, written to the worker's log
STOP_GRACE_S = 60.0
"""Default of ``--stop-grace``: how long a trainer asked to stop (cancel, pause) has before it is terminated."""
STOP_GRACE_CONF = "proxima_stop_grace_seconds"  # the Celery app's setting that carries the worker's --stop-grace
OOM_RETRIES = 1
_PROCESS_TOKEN = uuid.uuid4().hex[:8]

OOM_ADVICE = (
    "lower batch_size, group_size, max_completion_tokens or micro_batch_size, or use a machine with more memory"
)


def store_for(settings: Settings) -> ArtifactStore:
    return store_from_url(settings.artifacts_url, endpoint_url=settings.s3_endpoint_url)


def default_worker_id(hostname: str | None = None) -> str:
    """Unique per worker process (a restarted worker with a reused pid is not mistaken for the old owner)."""
    return f"{hostname or socket.gethostname()}:{os.getpid()}:{_PROCESS_TOKEN}"


def checkpoint_prefix(job_id: str, step: int) -> str:
    return f"jobs/{job_id}/checkpoints/step-{step:06d}"


def resolve_model(name: str, model_store: Path) -> str:
    """A name in the model store → its folder (a built-in model missing there is installed first, from the shipped
    build); a local path must hold a model; anything else (a hub id) is passed through, and the trainer reports a
    model it cannot load as ``model_not_available``."""
    local = model_store / name
    if (local / "config.json").is_file():
        return str(local)
    path = Path(name)
    if path.is_absolute() or name.startswith(("./", "../")):
        if not (path / "config.json").is_file():
            message = f"model {name!r} is not available on this worker: no model there"
            raise JobError(ErrorCode.MODEL_NOT_AVAILABLE, message)
        return name
    if name in BUILTIN_MODELS:  # shipped with the project: installed on first use
        try:
            return str(builtin_models.install(name, model_store).path)
        except (builtin_models.BuiltinModelError, OSError) as err:
            raise JobError(ErrorCode.MODEL_NOT_AVAILABLE, f"model {name!r} cannot be installed here: {err}") from None
    return name


def step_tokens(values: Mapping[str, float | None]) -> int:
    """Completion tokens sampled in one step (generation throughput × generation time)."""
    tps, secs = values.get(M.TOKENS_PER_S_GENERATION), values.get(M.GENERATION_SECONDS)
    return round(tps * secs) if tps is not None and secs is not None else 0


@app.task(name=RUN_JOB, bind=True, acks_late=True, reject_on_worker_lost=True, ignore_result=True)
def run_job_task(self: Any, job_id: str) -> str:
    return run_job(
        job_id,
        settings=current_settings(),
        worker_id=default_worker_id(self.request.hostname),
        stop_grace_s=float(self.app.conf.get(STOP_GRACE_CONF) or STOP_GRACE_S),
    )


@dataclass
class _Attempt:
    job_id: str
    tenant_id: str
    model: str
    suffix: str | None
    spec: dict[str, Any]
    training_file: str
    validation_file: str | None
    attempt: int
    claimed_at: float
    resume_step: int = 0
    total_steps: int | None = None
    tokens_by_step: dict[int, int] = field(default_factory=dict)
    step_times: list[StepTime] = field(default_factory=list)  # this attempt's measured steps (worker.estimate)
    checkpoint_seconds: list[float] = field(default_factory=list)
    metrics_at: dict[int, float] = field(default_factory=dict)  # when each step's metrics arrived (monotonic)

    def cadence(self) -> Cadence:
        """The run's validation and checkpoint cadence, from its spec (the defaults are trainer.spec.config's)."""
        hp = self.spec["method"][self.spec["method"]["type"]].get("hyperparameters", {})
        return Cadence(
            total_steps=self.total_steps or 0,
            eval_interval=int(hp.get("eval_interval") or 0),
            checkpoint_interval=int(hp.get("checkpoint_interval") or 10),
            validates=self.validation_file is not None,
        )


def _claim(settings: Settings, job_id: str, worker_id: str) -> _Attempt | None:
    """Claim the job; None when it is not claimable. A try whose COMMIT landed unseen (the connection lost) is told
    by the lease it left: ours."""
    at = time.time()
    with session_scope(settings.db_url) as s:
        if not runs.claim(s, job_id=job_id, worker_id=worker_id, lease_seconds=settings.lease_seconds, at=at):
            job = runs.get_job(s, job_id=job_id)
            if job is None or job.lease_owner != worker_id or job.status != JobStatus.RUNNING:
                return None
        job = runs.get_job(s, job_id=job_id)
        assert job is not None
        return _Attempt(
            job_id=job.id,
            tenant_id=job.tenant_id,
            model=job.model,
            suffix=job.suffix,
            spec=dict(job.spec),
            training_file=job.training_file,
            validation_file=job.validation_file,
            attempt=job.attempts,
            claimed_at=at,
        )


def run_job(job_id: str, *, settings: Settings, worker_id: str, stop_grace_s: float = STOP_GRACE_S) -> str:
    """Run one attempt at ``job_id`` if this worker can claim it; returns the status it ended in, or ``"skipped"``
    (not claimable: finished, paused, cancelled, or held by a live lease), ``"lost"`` (the lease was taken) or
    ``"abandoned"`` (the database stayed unreachable: the lease runs out and another worker resumes the job)."""
    url = settings.db_url
    if validate_files(job_id, settings=settings, store=store_for(settings), worker_id=worker_id) == JobStatus.FAILED:
        return JobStatus.FAILED
    attempt = retry_db(f"job {job_id}: claim", lambda: _claim(settings, job_id, worker_id))
    if attempt is None:
        log.info("job %s not claimable by %s: skipped", job_id, worker_id)
        return "skipped"
    log.info("job %s claimed by %s (attempt %d)", job_id, worker_id, attempt.attempt)
    runs_root = settings.home / "runs"
    runs_root.mkdir(parents=True, exist_ok=True)
    run_dir = Path(tempfile.mkdtemp(prefix=f"{job_id}-", dir=runs_root))
    try:
        return _Runner(settings, worker_id, attempt, run_dir, stop_grace_s=stop_grace_s).run()
    except DatabaseUnavailable:
        log.error("job %s: the database stayed unreachable; giving the job up to its lease's expiry", job_id)
        return "abandoned"
    except Exception:
        log.exception("job %s: worker error", job_id)
        event_id = ids.event_id()

        def record() -> None:
            with session_scope(url) as s:
                if runs.finish(
                    s,
                    job_id=job_id,
                    worker_id=worker_id,
                    status=JobStatus.FAILED,
                    error={"code": ErrorCode.INTERNAL_ERROR, "message": "internal worker error", "param": None},
                ):
                    message = "The job failed: internal worker error"
                    runs.add_event(s, job_id=job_id, level="error", message=message, event_id=event_id)

        try:
            retry_db(f"job {job_id}: record the worker error", record)
        except Exception:
            log.exception("job %s: could not record the worker error", job_id)
        return JobStatus.FAILED
    finally:
        try:
            retry_db(f"job {job_id}: release the lease", lambda: _release(url, job_id, worker_id), patience_s=60)
        except Exception:
            log.warning("job %s: could not release the lease; it expires by itself", job_id, exc_info=True)
        shutil.rmtree(run_dir, ignore_errors=True)


def _release(url: str, job_id: str, worker_id: str) -> None:
    with session_scope(url) as s:
        runs.release_lease(s, job_id=job_id, worker_id=worker_id)


@dataclass(frozen=True)
class _KilledBySomeoneElse:
    """The trainer died of a SIGKILL this worker did not send; ``cause``: what the kernel says of it."""

    cause: str


class _Runner:
    def __init__(
        self, settings: Settings, worker_id: str, attempt: _Attempt, run_dir: Path, *, stop_grace_s: float
    ) -> None:
        self.settings, self.worker_id, self.a, self.run_dir = settings, worker_id, attempt, run_dir
        self.stop_grace_s = stop_grace_s
        self.url = settings.db_url
        self.store = store_for(settings)
        self.job_id = attempt.job_id
        self.data_dir = run_dir / "data"  # the datasets' local copies the trainer reads
        self.stop_reason: str | None = None
        self.redactor = Redactor({})
        self.trackers = trackers.Exporter([], job_id=attempt.job_id)  # run() starts the job's integrations
        # A job that asks for devices runs as that many ranks under the launcher (worker.launch), even one.
        resources = attempt.spec.get("resources")
        self.ranks = int(resources.get("gpus", 1)) if isinstance(resources, dict) else None

    def _db(self, what: str, fn: Callable[[], T]) -> T:
        try:
            return retry_db(f"job {self.job_id}: {what}", fn)
        except Exception as err:
            if is_transient(err):
                raise DatabaseUnavailable(what) from err
            raise

    # -- preparation ----------------------------------------------------------------------------------------------

    def _download_file(self, file_id: str, dest: Path) -> str:
        return str(
            self._db("download a dataset", lambda: download_dataset(self.url, self.store, file_id=file_id, dest=dest))
        )

    def _fetch_reward_model(self, job_id: str) -> Path:
        """A reward_model grader's job id (the API checked it) → the reward model's folder in the run folder: its
        final adapter archive, with the base model it names resolved on this worker."""
        dest = self.run_dir / "reward_models" / job_id
        if (dest / "adapter_config.json").is_file():
            return dest

        def find() -> tuple[str, str] | None:
            with session_scope(self.url) as s:
                job = runs.get_job(s, job_id=job_id)
                if job is not None and job.status == JobStatus.SUCCEEDED:
                    for file_id in job.result_files or []:
                        f = runs.get_file(s, file_id=file_id)
                        if f is not None and not f.deleted and f.filename.endswith("-adapter.tar.gz"):
                            return f.storage_key, job.model
            return None

        found = self._db("find a reward model", find)
        if found is None:
            message = f"reward model job {job_id} no longer has a stored adapter to grade with"
            raise JobError(ErrorCode.INVALID_REWARD_MODEL, message)
        key, base = found
        archive = dest.with_suffix(".tar.gz")
        dest.mkdir(parents=True)
        try:
            self.store.get_to_path(key, archive)
        except NotFound:
            raise JobError(
                ErrorCode.INVALID_REWARD_MODEL, f"reward model {job_id}'s adapter is missing from the store"
            ) from None
        with tarfile.open(archive) as tar:
            tar.extractall(dest, filter="data")
        archive.unlink()
        info_path = dest / "reward_model.json"
        if info_path.is_file():  # the base model as this worker finds it, not as the training worker did
            info = json.loads(info_path.read_text())
            info["base_model"] = resolve_model(base, self.settings.model_store)
            info_path.write_text(json.dumps(info, indent=2))
        return dest

    def _prepare_files(self) -> None:
        """The datasets, the models and the spec with local paths in the run folder; the redactor that turns those
        paths back into the names the user gave."""
        a = self.a
        spec = trainer_spec(a.spec)  # the integrations are this worker's (self.trackers), not the trainer's
        data = self.data_dir
        data.mkdir()
        local: dict[str, str] = {}
        spec["training_file"] = self._download_file(a.training_file, data / TRAINING_COPY)
        local[spec["training_file"]] = a.training_file
        if a.validation_file:
            spec["validation_file"] = self._download_file(a.validation_file, data / VALIDATION_COPY)
            local[spec["validation_file"]] = a.validation_file
        else:
            spec.pop("validation_file", None)
        model = str(spec.get("model") or a.model)
        spec["model"] = resolve_model(model, self.settings.model_store)
        local[spec["model"]] = model
        block = spec["method"][spec["method"]["type"]]
        hp = block.get("hyperparameters", {})
        if hp.get("value_model"):  # PPO's critic on a separate base model
            value_model = str(hp["value_model"])
            hp["value_model"] = resolve_model(value_model, self.settings.model_store)
            local[hp["value_model"]] = value_model
        if isinstance(block.get("grader"), dict):
            for _, leaf in reward_model_refs(block["grader"], "grader"):
                reward_job = str(leaf["model"])
                leaf["model"] = str(self._fetch_reward_model(reward_job))
                local[leaf["model"]] = f"reward model {reward_job}"
        (self.run_dir / "spec.json").write_text(json.dumps(spec, indent=2))
        self.redactor = Redactor(local)

    def _restore(self) -> int:
        """Put the latest stored checkpoint in the run folder (a killed trainer's own checkpoints are dropped: the
        stored ones are those the job's rows name) and forget what was recorded beyond it; its step (0: none)."""
        a = self.a
        local = self.run_dir / "checkpoints"
        shutil.rmtree(local, ignore_errors=True)

        def latest() -> tuple[int, str] | None:
            with session_scope(self.url) as s:
                ck = runs.latest_checkpoint(s, job_id=self.job_id)
                return (ck.step_number, ck.storage_key) if ck is not None else None

        found = self._db("find the latest checkpoint", latest)
        step = 0
        if found is not None:
            step, prefix = found
            dest = local / f"step-{step:06d}"
            for key in self.store.list(prefix):
                rel = key.removeprefix(prefix.rstrip("/") + "/")
                if rel == "adapter.tar.gz":
                    continue
                target = dest / rel
                target.parent.mkdir(parents=True, exist_ok=True)
                self.store.get_to_path(key, target)
        a.resume_step = step

        def forget() -> dict[int, int]:
            with session_scope(self.url) as s:
                runs.forget_after(s, job_id=self.job_id, step=step)
                rows = runs.metric_rows(s, job_id=self.job_id, up_to=step)
                tokens = {r.step: step_tokens(r.values) for r in rows}
                runs.update_progress(
                    s,
                    job_id=self.job_id,
                    current_step=step,
                    total_steps=None,
                    trained_tokens=sum(tokens.values()),
                    estimated_finish=None,
                )
                return tokens

        a.tokens_by_step = self._db("forget what the checkpoint does not hold", forget)
        return step

    # -- the attempt ----------------------------------------------------------------------------------------------

    def run(self) -> str:
        """The attempt, exported to the job's experiment trackers as it goes; they are closed with its outcome (after
        it is recorded: a slow tracker does not delay the job's end)."""
        outcome = "abandoned"  # the database stayed unreachable: another attempt continues the runs
        self.trackers = trackers.start(self.settings, job_id=self.job_id, model=self.a.model, spec=self.a.spec)
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

    def _metric_rows(self, up_to: int) -> list[tuple[int, dict[str, float | None]]]:
        with session_scope(self.url) as s:
            return [(r.step, dict(r.values)) for r in runs.metric_rows(s, job_id=self.job_id, up_to=up_to)]

    def _close_trackers(self, outcome: str) -> None:
        """Flush and close the trackers (bounded by ``tracker_close_timeout_s``) and record their last warnings; an
        attempt that lost the job, or the database, writes nothing more."""
        self.trackers.close(outcome)
        if outcome in ("lost", "abandoned"):
            return
        for warning in self.trackers.events():
            try:
                self._db("record an export warning", self._event_write("warn", warning.message, data=warning.data).run)
            except Exception:
                log.warning("job %s: could not record an export warning: %s", self.job_id, warning.message)

    def _attempt(self) -> str:
        a = self.a
        try:
            self._prepare_files()
        except JobError as err:
            return self._fail(err.code, err.message)
        heartbeat = Heartbeat(self.settings, self.job_id, self.worker_id, claimed_at=a.claimed_at)
        heartbeat.start()
        try:
            step = self._restore()
            if step:
                self._record_event("info", f"Resuming from the checkpoint at step {step} (attempt {a.attempt})")
                self.trackers.backfill(self._db("read the metrics", lambda: self._metric_rows(step)))
            else:
                self._record_event(
                    "info", "Fine-tuning job started" + (f" (attempt {a.attempt})" if a.attempt > 1 else "")
                )
            retries = OOM_RETRIES
            while True:
                outcome = self._supervise(heartbeat)
                if not isinstance(outcome, _KilledBySomeoneElse):
                    return outcome
                if retries == 0:
                    return self._fail(ErrorCode.OUT_OF_MEMORY, f"{outcome.cause}: {OOM_ADVICE}")
                retries -= 1
                step = self._restore()
                where = f"the checkpoint at step {step}" if step else "the start (there was no checkpoint yet)"
                cause = outcome.cause[0].upper() + outcome.cause[1:]
                self._record_event("warn", f"{cause}; training again from {where}, once before the job fails")
        finally:
            heartbeat.done.set()

    def _supervise(self, heartbeat: Heartbeat) -> str | _KilledBySomeoneElse:
        remote = graders_service.remote_config(self.settings).model_dump_json()  # judge and embeddings keys included
        trainer = TrainerProcess(
            self.run_dir, stop_grace_s=self.stop_grace_s, env={REMOTE_GRADERS_ENV: remote}, ranks=self.ranks
        )
        outbox = Outbox(may_write=heartbeat.holds)
        final: msg.Done | msg.Error | None = None
        next_poll = 0.0
        try:
            while True:
                if heartbeat.lost.is_set():
                    trainer.kill()
                    return "lost"
                if self.stop_reason is None and time.monotonic() >= next_poll:
                    next_poll = time.monotonic() + CONTROL_POLL_S
                    cancel, pause = self._control_flags() or (False, False)
                    if cancel or pause:
                        self.stop_reason = "cancel" if cancel else "pause"
                        trainer.stop()
                if (sig := trainer.enforce_stop()) is not None:
                    outbox.add(self._forced_stop_event(sig))
                try:
                    message = trainer.get(timeout=0.2)
                except Ended:
                    break
                if isinstance(message, msg.Done | msg.Error):
                    final = message
                elif message is not None:
                    self._on_message(message, outbox)
                outbox.flush()
            rc = trainer.close()
            if not outbox.drain(give_up=heartbeat.lost.is_set):
                if heartbeat.lost.is_set():
                    return "lost"
                raise DatabaseUnavailable("write the trainer's progress")
        except StoreFull:
            trainer.kill()
            return self._fail(ErrorCode.STORAGE_FULL, self._store_full_message("a checkpoint"))
        except BaseException:
            trainer.kill()
            raise
        cancel_now = (self._db("read the control flags", self._read_flags))[0]
        if heartbeat.lost.is_set():
            return "lost"
        if isinstance(final, msg.Done) and rc == 0:
            if final.stopped:
                return self._stopped(stopped_as(self.stop_reason, cancel_now=cancel_now), final.last_step)
            return self._succeed()
        if cancel_now:
            return self._stopped("cancel", None)
        if self.stop_reason == "pause" and (trainer.forced or trainer.killed_by_someone_else):
            return self._stopped("pause", self._latest_stored_step())  # where the latest stored checkpoint is
        if isinstance(final, msg.Error):
            return self._fail(final.code, self._user_message(final, trainer))
        if trainer.killed_by_someone_else:
            confirmed = trainer.oom_confirmed
            log.warning(
                "job %s: the trainer (pid %d) was killed by SIGKILL not sent by this worker (cgroup OOM kill: %s)",
                self.job_id,
                trainer.pid,
                {True: "counted", False: "not counted", None: "not readable"}[confirmed],
            )
            if confirmed:
                return _KilledBySomeoneElse("the kernel killed the trainer for running out of memory")
            return _KilledBySomeoneElse("the trainer was killed (SIGKILL), most likely for running out of memory")
        self._log_trainer_output(trainer, f"exited with code {rc}")
        how = f"was ended by signal {-rc}" if rc < 0 else f"exited with code {rc}"
        return self._fail(
            ErrorCode.TRAINER_ERROR,
            f"the trainer {how} without reporting an error; the worker's log has its output",
        )

    def _control_flags(self) -> tuple[bool, bool] | None:
        """The cancel and pause flags; None when the database cannot be read now (the next poll tries again)."""
        try:
            return self._read_flags()
        except Exception as err:
            if not is_transient(err):
                raise
            return None

    def _read_flags(self) -> tuple[bool, bool]:
        with session_scope(self.url) as s:
            return runs.control_flags(s, job_id=self.job_id)

    def _latest_stored_step(self) -> int:
        def latest() -> int:
            with session_scope(self.url) as s:
                ck = runs.latest_checkpoint(s, job_id=self.job_id)
                return ck.step_number if ck is not None else 0

        return self._db("find the latest checkpoint", latest)

    def _forced_stop_event(self, sig: int) -> Write:
        what = "cancel" if self.stop_reason == "cancel" else "pause"
        if sig == signal.SIGTERM:
            text = f"The trainer did not stop within {self.stop_grace_s:g} s of the {what}: terminating it"
        else:
            text = "The trainer did not exit after it was terminated: killing it"
        log.warning("job %s: %s", self.job_id, text)
        return self._event_write("warn", text)

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
            local = Path(error.path)
            if local == self.data_dir / TRAINING_COPY:
                return dataset_message("training", self.a.training_file, line=error.line, detail=error.detail)
            if local == self.data_dir / VALIDATION_COPY and self.a.validation_file:
                return dataset_message("validation", self.a.validation_file, line=error.line, detail=error.detail)
        return self.redactor.text(error.message)

    def _log_trainer_output(self, trainer: TrainerProcess, what: str) -> None:
        log.error(
            "job %s: the trainer %s; the end of its output:\n%s",
            self.job_id,
            what,
            trainer.stderr_tail(STDERR_TAIL_LINES),
        )

    def _store_full_message(self, what: str) -> str:
        return (
            f"the artifact store is full: {what} of this job could not be stored. Free space in the store (delete "
            "files or finished jobs you no longer need) and create the job again"
        )

    # -- messages → writes ----------------------------------------------------------------------------------------

    def _event_write(
        self, level: str, message: str, *, data: dict[str, Any] | None = None, type: str = "message"
    ) -> Write:
        """An event as a write: its id and time fixed now, so a write that runs twice records it once."""
        event_id, created_at = ids.event_id(), now()

        def run() -> None:
            with session_scope(self.url) as s:
                runs.add_event(
                    s,
                    job_id=self.job_id,
                    level=level,
                    message=message,
                    type=type,
                    data=data,
                    event_id=event_id,
                    created_at=created_at,
                )

        return Write(f"event {message[:40]!r}", run)

    def _record_event(self, level: str, message: str) -> None:
        """An event written now (retried through an outage)."""
        self._db("record an event", self._event_write(level, message).run)

    def _on_message(self, message: msg.RunnerMessage, outbox: Outbox) -> None:
        for warning in self.trackers.events():  # export failures, as the job's warnings
            outbox.add(self._event_write("warn", warning.message, data=warning.data))
        match message:
            case msg.Stopping(completed_step=done):
                what = "Cancellation" if self.stop_reason == "cancel" else "Pause"
                text = f"{what} requested: the trainer stops after step {done + 1} at the latest"
                outbox.add(self._event_write("info", text, data={"completed_step": done}))
            case msg.Checkpoint():
                if (arrived := self.a.metrics_at.get(message.step)) is not None:  # saved after its step's metrics
                    self.a.checkpoint_seconds.append(time.monotonic() - arrived)
                self._checkpoint_writes(message.step, Path(message.path), message.metrics, outbox)
            case msg.Started():
                self.a.total_steps = message.total_steps
                self.trackers.config({"total_steps": message.total_steps})
                outbox.add(self._progress_write(self.a.resume_step, eta=None))
            case msg.Event():
                text, data = self.redactor.text(message.message), self.redactor.value(message.data)
                outbox.add(self._event_write(message.level, text, data=data))
            case msg.Rollouts(step=step, rollouts=rollouts):
                outbox.add(Write(f"rollouts of step {step}", lambda: self._write_rollouts(step, rollouts)))
                self.trackers.rollouts(step, rollouts)
            case msg.Metrics():
                self._metrics_writes(message.step, message.metrics, outbox)
                self.trackers.metrics(message.step, message.metrics)
            case msg.Done() | msg.Error():  # the run's outcome: _supervise handles it
                raise AssertionError(f"{message.kind} is not a progress message")

    def _write_rollouts(self, step: int, rollouts: list[dict[str, Any]]) -> None:
        with session_scope(self.url) as s:
            runs.add_rollouts(s, job_id=self.job_id, step=step, rollouts=rollouts)

    def _progress_write(self, step: int, *, eta: int | None) -> Write:
        a = self.a
        total, tokens = a.total_steps, sum(a.tokens_by_step.values())

        def run() -> None:
            with session_scope(self.url) as s:
                runs.update_progress(
                    s,
                    job_id=self.job_id,
                    current_step=step,
                    total_steps=total,
                    trained_tokens=tokens,
                    estimated_finish=eta,
                )

        return Write(f"progress at step {step}", run)

    def _metrics_writes(self, step: int, values: dict[str, float | None], outbox: Outbox) -> None:
        def upsert() -> None:
            with session_scope(self.url) as s:
                runs.upsert_metrics(s, job_id=self.job_id, step=step, values=values)

        outbox.add(Write(f"metrics of step {step}", upsert))
        if step == 0:  # the base policy's validation point, before any training
            return
        a = self.a
        data = {"step": step, "total_steps": a.total_steps, **values}
        outbox.add(self._event_write("info", f"Step {step}/{a.total_steps}", data=data, type="metrics"))
        a.tokens_by_step[step] = step_tokens(values)
        a.metrics_at[step] = time.monotonic()
        secs = values.get(M.STEP_SECONDS)
        if secs is not None:
            a.step_times.append(StepTime(step=step, seconds=secs, evaluated=ran_validation(values)))
        eta = None
        if a.total_steps:
            eta = estimated_finish(a.step_times, a.checkpoint_seconds, done=step, cadence=a.cadence(), now=time.time())
        outbox.add(self._progress_write(step, eta=eta))

    def _checkpoint_writes(self, step: int, path: Path, metrics: dict[str, float | None], outbox: Outbox) -> None:
        """Upload the checkpoint's objects, then (a write of its own, so an outage does not upload them again) record
        its row: a row always names a complete checkpoint. A full store removes what was uploaded of it."""
        prefix = checkpoint_prefix(self.job_id, step)

        def upload() -> None:
            from trainer.loops.checkpoint import archive_adapter

            try:
                for f in sorted(p for p in path.rglob("*") if p.is_file()):
                    self.store.put_file(f"{prefix}/{f.relative_to(path).as_posix()}", f)
                archives = self.run_dir / "archives"
                archives.mkdir(exist_ok=True)
                archive = archive_adapter(path / "adapter", archives / f"step-{step:06d}.tar.gz")
                self.store.put_file(f"{prefix}/adapter.tar.gz", archive)
                archive.unlink()
            except StoreFull:
                self.store.delete_prefix(prefix)
                raise

        record_event = self._event_write("info", f"Checkpoint created at step {step}", data={"step": step})

        def record() -> None:
            with session_scope(self.url) as s:
                runs.add_checkpoint(s, job_id=self.job_id, step=step, metrics=metrics, storage_key=prefix)
            record_event.run()

        outbox.add(Write(f"upload the checkpoint of step {step}", upload))
        outbox.add(Write(f"record the checkpoint of step {step}", record))

    # -- outcomes ------------------------------------------------------------------------------------------------

    def _finish(self, what: str, write: Callable[[Any], bool], event_id: str) -> bool:
        """Run ``write(session)`` (the outcome's conditional update, then its event of id ``event_id``) through an
        outage; True when it took. A try whose COMMIT landed unseen is recognised by that event."""

        def unit() -> bool:
            with session_scope(self.url) as s:
                if runs.event_exists(s, event_id=event_id):
                    return True
                if write(s):
                    return True
                s.rollback()
                return False

        return self._db(what, unit)

    def _succeed(self) -> str:
        from trainer.loops.checkpoint import archive_adapter

        a = self.a
        adapter = self.run_dir / "adapter"
        if not (adapter / "adapter_config.json").is_file():
            return self._fail(ErrorCode.TRAINER_ERROR, "the trainer finished without writing the final adapter")
        adapter_id, csv_id = ids.file_id(), ids.file_id()
        archive = archive_adapter(adapter, self.run_dir / "adapter.tar.gz")
        adapter_key = f"files/{a.tenant_id}/{adapter_id}.tar.gz"
        csv_key = f"files/{a.tenant_id}/{csv_id}.csv"

        def metric_rows() -> list[tuple[int, Mapping[str, float | None]]]:
            with session_scope(self.url) as s:
                return [(r.step, r.values) for r in runs.metric_rows(s, job_id=self.job_id)]

        table = metrics_csv(self._db("read the metrics", metric_rows))
        try:
            adapter_size = self.store.put_file(adapter_key, archive)
            csv_size = self.store.put_bytes(csv_key, table)
        except StoreFull:
            self.store.delete(adapter_key)
            return self._fail(ErrorCode.STORAGE_FULL, self._store_full_message("the final adapter or metrics"))
        model = ids.fine_tuned_model_name(model=a.model, tenant_id=a.tenant_id, suffix=a.suffix, job_id=self.job_id)
        done_event = ids.event_id()

        def write(s: Any) -> bool:
            runs.add_result_file(
                s,
                tenant_id=a.tenant_id,
                filename=f"{self.job_id}-metrics.csv",
                size=csv_size,
                storage_key=csv_key,
                file_id=csv_id,
            )
            runs.add_result_file(
                s,
                tenant_id=a.tenant_id,
                filename=f"{self.job_id}-adapter.tar.gz",
                size=adapter_size,
                storage_key=adapter_key,
                file_id=adapter_id,
            )
            if not runs.finish(
                s,
                job_id=self.job_id,
                worker_id=self.worker_id,
                status=JobStatus.SUCCEEDED,
                fine_tuned_model=model,
                result_files=[csv_id, adapter_id],
            ):
                return False
            runs.update_progress(
                s,
                job_id=self.job_id,
                current_step=a.total_steps or 0,
                total_steps=a.total_steps,
                trained_tokens=sum(a.tokens_by_step.values()),
                estimated_finish=None,
            )
            runs.add_event(s, job_id=self.job_id, level="info", message=f"New fine-tuned model created: {model}")
            message = "The job has successfully completed"
            runs.add_event(s, job_id=self.job_id, level="info", message=message, event_id=done_event)
            return True

        if not self._finish("record the success", write, done_event):
            self.store.delete(adapter_key)
            self.store.delete(csv_key)
            return "lost"
        return JobStatus.SUCCEEDED

    def _stopped(self, reason: str, step: int | None) -> str:
        status = JobStatus.CANCELLED if reason == "cancel" else JobStatus.PAUSED
        at = f" at step {step}" if step is not None else ""
        message = (
            f"The job was cancelled{at}"
            if status == JobStatus.CANCELLED
            else f"The job was paused{at}: resume continues there"
        )
        event_id = ids.event_id()

        def write(s: Any) -> bool:
            if not runs.finish(s, job_id=self.job_id, worker_id=self.worker_id, status=status):
                return False
            runs.add_event(s, job_id=self.job_id, level="info", message=message, event_id=event_id)
            return True

        if self._finish(f"record the {status}", write, event_id):
            return status
        # Refused: a cancel landed after the flags were read, and it wins.
        if status == JobStatus.PAUSED and self._db("read the control flags", self._read_flags)[0]:
            return self._stopped("cancel", step)
        return status

    def _fail(self, code: ErrorCode, message: str) -> str:
        event_id = ids.event_id()

        def write(s: Any) -> bool:
            error = {"code": code, "message": message, "param": None}
            if not runs.finish(s, job_id=self.job_id, worker_id=self.worker_id, status=JobStatus.FAILED, error=error):
                return False
            runs.add_event(
                s, job_id=self.job_id, level="error", message=f"The job failed: {message}", event_id=event_id
            )
            return True

        self._finish("record the failure", write, event_id)
        log.warning("job %s failed (%s): %s", self.job_id, code, message)
        return JobStatus.FAILED


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

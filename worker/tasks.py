"""``proxima.jobs.run``: claim a job in the database, run its trainer in a child process, record what it reports.

:func:`run_job` is the plain function behind the Celery task (tests call it directly). A job still in
``validating_files`` first has its files validated (``worker.validation``), which ends it ``failed`` or ``queued``.
Then one attempt:

1. claim the job with a lease (one conditional UPDATE; losing the race means another worker has it: return);
2. prepare a run folder: the dataset files from the artifact store, the spec with local paths and the model
   resolved, and the latest stored checkpoint, so the trainer resumes from it (step numbers continue);
3. start ``python -m worker.runner`` and, while it trains, renew the lease (a heartbeat thread), write its metrics,
   events, rollouts and checkpoints as they arrive (a checkpoint's objects are uploaded before its row is written,
   so a row always names a complete checkpoint), and pass on cancel and pause requests read from the database;
4. record the outcome (succeeded with result files, cancelled, paused, failed with an actionable code) and release
   the lease. A worker that lost its lease kills its trainer and writes nothing more: the job belongs to another.
"""

from __future__ import annotations

import contextlib
import csv
import io
import json
import logging
import math
import os
import queue
import shutil
import socket
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
import uuid
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from pydantic import ValidationError

from api import ids
from api.db import session_scope
from api.repositories import runs
from api.services.jobs import reward_model_refs
from api.settings import Settings
from api.status import JobStatus
from api.storage import ArtifactStore, NotFound, store_from_url
from api.tasks import RUN_JOB
from trainer import metrics as M
from worker import messages as msg
from worker.celery_app import app
from worker.celery_app import settings as current_settings
from worker.errors import ErrorCode, JobError
from worker.lease import Heartbeat
from worker.validation import dataset_message, download_dataset, validate_files

log = logging.getLogger("proxima.worker")

TRAINING_COPY, VALIDATION_COPY = "train.jsonl", "validation.jsonl"  # file names in the run folder's data/
CONTROL_POLL_S = 1.0  # how often the database is read for cancel and pause requests
STDERR_TAIL_LINES = 20
_PROCESS_TOKEN = uuid.uuid4().hex[:8]

OOM_HINT = (
    "the trainer process was killed (SIGKILL), most likely for running out of memory: lower batch_size, "
    "group_size, max_completion_tokens or micro_batch_size, or use a machine with more memory"
)


def store_for(settings: Settings) -> ArtifactStore:
    return store_from_url(settings.artifacts_url, endpoint_url=settings.s3_endpoint_url)


def default_worker_id(hostname: str | None = None) -> str:
    """Unique per worker process (a restarted worker with a reused pid is not mistaken for the old owner)."""
    return f"{hostname or socket.gethostname()}:{os.getpid()}:{_PROCESS_TOKEN}"


def checkpoint_prefix(job_id: str, step: int) -> str:
    return f"jobs/{job_id}/checkpoints/step-{step:06d}"


def resolve_model(name: str, model_store: Path) -> str:
    """A name in the model store → its folder; a local path must hold a model; anything else (a hub id) is passed
    through, and the trainer reports a model it cannot load as ``model_not_available``."""
    local = model_store / name
    if (local / "config.json").is_file():
        return str(local)
    path = Path(name)
    if path.is_absolute() or name.startswith(("./", "../")):
        if not (path / "config.json").is_file():
            message = f"model {name!r} is not available on this worker: no model there"
            raise JobError(ErrorCode.MODEL_NOT_AVAILABLE, message)
        return name
    if name == "tiny-arith":
        message = f"model {name!r} is not built on this worker: run `proxima models build {name}`"
        raise JobError(ErrorCode.MODEL_NOT_AVAILABLE, message)
    return name


def step_tokens(values: Mapping[str, float | None]) -> int:
    """Completion tokens sampled in one step (generation throughput × generation time)."""
    tps, secs = values.get(M.TOKENS_PER_S_GENERATION), values.get(M.GENERATION_SECONDS)
    return round(tps * secs) if tps is not None and secs is not None else 0


@app.task(name=RUN_JOB, bind=True, acks_late=True, reject_on_worker_lost=True, ignore_result=True)
def run_job_task(self: Any, job_id: str) -> str:
    return run_job(job_id, settings=current_settings(), worker_id=default_worker_id(self.request.hostname))


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
    resume_step: int = 0
    total_steps: int | None = None
    tokens_by_step: dict[int, int] = field(default_factory=dict)
    step_seconds: list[float] = field(default_factory=list)


def run_job(job_id: str, *, settings: Settings, worker_id: str) -> str:
    """Run one attempt at ``job_id`` if this worker can claim it; returns the status it ended in, or ``"skipped"``
    (not claimable: finished, paused, cancelled, or held by a live lease) or ``"lost"`` (the lease was taken)."""
    url = settings.db_url
    if validate_files(job_id, settings=settings, store=store_for(settings), worker_id=worker_id) == JobStatus.FAILED:
        return JobStatus.FAILED
    with session_scope(url) as s:
        if not runs.claim(s, job_id=job_id, worker_id=worker_id, lease_seconds=settings.lease_seconds):
            log.info("job %s not claimable by %s: skipped", job_id, worker_id)
            return "skipped"
        job = runs.get_job(s, job_id=job_id)
        assert job is not None
        attempt = _Attempt(
            job_id=job.id,
            tenant_id=job.tenant_id,
            model=job.model,
            suffix=job.suffix,
            spec=dict(job.spec),
            training_file=job.training_file,
            validation_file=job.validation_file,
            attempt=job.attempts,
        )
    log.info("job %s claimed by %s (attempt %d)", job_id, worker_id, attempt.attempt)
    runs_root = settings.home / "runs"
    runs_root.mkdir(parents=True, exist_ok=True)
    run_dir = Path(tempfile.mkdtemp(prefix=f"{job_id}-", dir=runs_root))
    try:
        return _Runner(settings, worker_id, attempt, run_dir).run()
    except Exception:
        log.exception("job %s: worker error", job_id)
        with session_scope(url) as s:
            runs.add_event(s, job_id=job_id, level="error", message="The job failed: internal worker error")
            runs.finish(
                s,
                job_id=job_id,
                worker_id=worker_id,
                status=JobStatus.FAILED,
                error={"code": ErrorCode.INTERNAL_ERROR, "message": "internal worker error", "param": None},
            )
        return JobStatus.FAILED
    finally:
        with session_scope(url) as s:
            runs.release_lease(s, job_id=job_id, worker_id=worker_id)
        shutil.rmtree(run_dir, ignore_errors=True)


class _Runner:
    def __init__(self, settings: Settings, worker_id: str, attempt: _Attempt, run_dir: Path) -> None:
        self.settings, self.worker_id, self.a, self.run_dir = settings, worker_id, attempt, run_dir
        self.url = settings.db_url
        self.store = store_for(settings)
        self.job_id = attempt.job_id
        self.data_dir = run_dir / "data"  # the datasets' local copies the trainer reads
        self.stop_reason: str | None = None

    # -- preparation ----------------------------------------------------------------------------------------------

    def _download_file(self, file_id: str, dest: Path) -> str:
        return str(download_dataset(self.url, self.store, file_id=file_id, dest=dest))

    def _fetch_reward_model(self, job_id: str) -> Path:
        """A reward_model grader's job id (the API checked it) → the reward model's folder in the run folder: its
        final adapter archive, with the base model it names resolved on this worker."""
        dest = self.run_dir / "reward_models" / job_id
        if (dest / "adapter_config.json").is_file():
            return dest
        with session_scope(self.url) as s:
            job = runs.get_job(s, job_id=job_id)
            found = None
            if job is not None and job.status == JobStatus.SUCCEEDED:
                for file_id in job.result_files or []:
                    f = runs.get_file(s, file_id=file_id)
                    if f is not None and not f.deleted and f.filename.endswith("-adapter.tar.gz"):
                        found = (f.storage_key, job.model)
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

    def _restore_checkpoint(self) -> int:
        """Copy the latest stored checkpoint into the run folder; its step (0 when there is none)."""
        with session_scope(self.url) as s:
            ck = runs.latest_checkpoint(s, job_id=self.job_id)
            found = (ck.step_number, ck.storage_key) if ck is not None else None
        if found is None:
            return 0
        step, prefix = found
        dest = self.run_dir / "checkpoints" / f"step-{step:06d}"
        for key in self.store.list(prefix):
            rel = key.removeprefix(prefix.rstrip("/") + "/")
            if rel == "adapter.tar.gz":
                continue
            target = dest / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            self.store.get_to_path(key, target)
        return step

    def _prepare(self) -> None:
        a = self.a
        spec = dict(a.spec)
        data = self.data_dir
        data.mkdir()
        spec["training_file"] = self._download_file(a.training_file, data / TRAINING_COPY)
        if a.validation_file:
            spec["validation_file"] = self._download_file(a.validation_file, data / VALIDATION_COPY)
        else:
            spec.pop("validation_file", None)
        spec["model"] = resolve_model(str(spec.get("model") or a.model), self.settings.model_store)
        block = spec["method"][spec["method"]["type"]]
        hp = block.get("hyperparameters", {})
        if hp.get("value_model"):  # PPO's critic on a separate base model
            hp["value_model"] = resolve_model(str(hp["value_model"]), self.settings.model_store)
        if isinstance(block.get("grader"), dict):
            for _, leaf in reward_model_refs(block["grader"], "grader"):
                leaf["model"] = str(self._fetch_reward_model(str(leaf["model"])))
        (self.run_dir / "spec.json").write_text(json.dumps(spec, indent=2))
        a.resume_step = self._restore_checkpoint()
        with session_scope(self.url) as s:
            runs.forget_after(s, job_id=self.job_id, step=a.resume_step)
            a.tokens_by_step = {
                r.step: step_tokens(r.values) for r in runs.metric_rows(s, job_id=self.job_id, up_to=a.resume_step)
            }
            if a.resume_step:
                message = f"Resuming from the checkpoint at step {a.resume_step} (attempt {a.attempt})"
            else:
                again = f" (attempt {a.attempt})" if a.attempt > 1 else ""
                message = f"Fine-tuning job started{again}"
            runs.add_event(s, job_id=self.job_id, level="info", message=message)
            runs.update_progress(
                s,
                job_id=self.job_id,
                current_step=a.resume_step,
                total_steps=None,
                trained_tokens=sum(a.tokens_by_step.values()),
                estimated_finish=None,
            )

    # -- the attempt ----------------------------------------------------------------------------------------------

    def run(self) -> str:
        try:
            self._prepare()
        except JobError as err:
            return self._fail(err.code, err.message)
        heartbeat = Heartbeat(self.settings, self.job_id, self.worker_id)
        heartbeat.start()
        try:
            return self._supervise(heartbeat)
        finally:
            heartbeat.done.set()

    def _supervise(self, heartbeat: Heartbeat) -> str:
        stderr_path = self.run_dir / "stderr.log"
        with stderr_path.open("wb") as err_file:
            proc = subprocess.Popen(
                [sys.executable, "-m", "worker.runner", str(self.run_dir)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=err_file,
                text=True,
                encoding="utf-8",
            )
        assert proc.stdin is not None and proc.stdout is not None
        messages: queue.Queue[msg.RunnerMessage | None] = queue.Queue()
        reader = threading.Thread(target=_read_messages, args=(proc.stdout, messages), daemon=True)
        reader.start()

        stop_reason: str | None = None
        final: msg.Done | msg.Error | None = None
        next_poll = 0.0
        try:
            while True:
                if heartbeat.lost.is_set():
                    proc.kill()
                    proc.wait()
                    return "lost"
                if stop_reason is None and time.monotonic() >= next_poll:
                    next_poll = time.monotonic() + CONTROL_POLL_S
                    with session_scope(self.url) as s:
                        cancel, pause = runs.control_flags(s, job_id=self.job_id)
                    if cancel or pause:
                        stop_reason = "cancel" if cancel else "pause"
                        _send_stop(proc.stdin)
                        self.stop_reason = stop_reason
                try:
                    message = messages.get(timeout=0.2)
                except queue.Empty:
                    continue
                if message is None:
                    break
                if isinstance(message, msg.Done | msg.Error):
                    final = message
                else:
                    self._record(message)
        except BaseException:
            proc.kill()
            proc.wait()
            raise
        finally:
            _close(proc.stdin)
        rc = proc.wait()
        with session_scope(self.url) as s:  # a cancel that arrived during the last step still counts
            cancel, pause = runs.control_flags(s, job_id=self.job_id)
        if heartbeat.lost.is_set():
            return "lost"
        if isinstance(final, msg.Done) and rc == 0:
            if final.stopped:
                return self._stopped(stopped_as(stop_reason, cancel_now=cancel), final.last_step)
            return self._succeed()
        if cancel:
            return self._stopped("cancel", None)
        if isinstance(final, msg.Error):
            return self._fail(final.code, self._user_message(final))
        if rc in (-9, 137):
            return self._fail(ErrorCode.OUT_OF_MEMORY, OOM_HINT)
        tail = _tail(stderr_path, STDERR_TAIL_LINES)
        return self._fail(
            ErrorCode.TRAINER_ERROR, f"the trainer exited with code {rc}. Its last output:\n{tail}".rstrip()
        )

    def _user_message(self, error: msg.Error) -> str:
        """A dataset error names the user's file id and line, not the worker's local copy of the file."""
        if error.path is None or error.detail is None:
            return error.message
        local = Path(error.path)
        if local == self.data_dir / TRAINING_COPY:
            which, file_id = "training", self.a.training_file
        elif local == self.data_dir / VALIDATION_COPY and self.a.validation_file:
            which, file_id = "validation", self.a.validation_file
        else:
            return error.message
        return dataset_message(which, file_id, line=error.line, detail=error.detail)

    # -- messages ------------------------------------------------------------------------------------------------

    def _record(self, message: msg.RunnerMessage) -> None:
        match message:
            case msg.Stopping(completed_step=done):
                what = "Cancellation" if self.stop_reason == "cancel" else "Pause"
                with session_scope(self.url) as s:
                    runs.add_event(
                        s,
                        job_id=self.job_id,
                        level="info",
                        message=f"{what} requested: the trainer stops after step {done + 1} at the latest",
                        data={"completed_step": done},
                    )
            case msg.Checkpoint():
                self._upload_checkpoint(message.step, Path(message.path), message.metrics)
            case msg.Started():
                self.a.total_steps = message.total_steps
                with session_scope(self.url) as s:
                    runs.update_progress(
                        s,
                        job_id=self.job_id,
                        current_step=self.a.resume_step,
                        total_steps=self.a.total_steps,
                        trained_tokens=None,
                        estimated_finish=None,
                    )
            case msg.Event():
                with session_scope(self.url) as s:
                    runs.add_event(
                        s, job_id=self.job_id, level=message.level, message=message.message, data=message.data
                    )
            case msg.Rollouts():
                with session_scope(self.url) as s:
                    runs.add_rollouts(s, job_id=self.job_id, step=message.step, rollouts=message.rollouts)
            case msg.Metrics():
                with session_scope(self.url) as s:
                    self._record_metrics(s, message.step, message.metrics)
            case msg.Done() | msg.Error():  # the run's outcome: _supervise handles it
                raise AssertionError(f"{message.kind} is not a progress message")

    def _record_metrics(self, s: Any, step: int, values: dict[str, float | None]) -> None:
        a = self.a
        runs.upsert_metrics(s, job_id=self.job_id, step=step, values=values)
        if step == 0:  # the base policy's validation point, before any training
            return
        runs.add_event(
            s,
            job_id=self.job_id,
            level="info",
            type="metrics",
            message=f"Step {step}/{a.total_steps}",
            data={"step": step, "total_steps": a.total_steps, **values},
        )
        a.tokens_by_step[step] = step_tokens(values)
        secs = values.get(M.STEP_SECONDS)
        if secs is not None:
            a.step_seconds.append(secs)
        eta = None
        if a.total_steps and a.step_seconds:
            mean = sum(a.step_seconds) / len(a.step_seconds)
            eta = int(time.time() + mean * max(a.total_steps - step, 0))
        runs.update_progress(
            s,
            job_id=self.job_id,
            current_step=step,
            total_steps=a.total_steps,
            trained_tokens=sum(a.tokens_by_step.values()),
            estimated_finish=eta,
        )

    def _upload_checkpoint(self, step: int, path: Path, metrics: dict[str, float | None]) -> None:
        from trainer.checkpoint import archive_adapter

        prefix = checkpoint_prefix(self.job_id, step)
        for f in sorted(p for p in path.rglob("*") if p.is_file()):
            self.store.put_file(f"{prefix}/{f.relative_to(path).as_posix()}", f)
        archives = self.run_dir / "archives"
        archives.mkdir(exist_ok=True)
        archive = archive_adapter(path / "adapter", archives / f"step-{step:06d}.tar.gz")
        self.store.put_file(f"{prefix}/adapter.tar.gz", archive)
        archive.unlink()
        with session_scope(self.url) as s:  # the row only after every object is stored
            runs.add_checkpoint(s, job_id=self.job_id, step=step, metrics=metrics, storage_key=prefix)
            runs.add_event(
                s,
                job_id=self.job_id,
                level="info",
                message=f"Checkpoint created at step {step}",
                data={"step": step},
            )

    # -- outcomes ------------------------------------------------------------------------------------------------

    def _succeed(self) -> str:
        from trainer.checkpoint import archive_adapter

        a = self.a
        adapter = self.run_dir / "adapter"
        if not (adapter / "adapter_config.json").is_file():
            return self._fail(ErrorCode.TRAINER_ERROR, "the trainer finished without writing the final adapter")
        adapter_id, csv_id = ids.file_id(), ids.file_id()
        archive = archive_adapter(adapter, self.run_dir / "adapter.tar.gz")
        adapter_key = f"files/{a.tenant_id}/{adapter_id}.tar.gz"
        adapter_size = self.store.put_file(adapter_key, archive)
        with session_scope(self.url) as s:
            rows = runs.metric_rows(s, job_id=self.job_id)
            table = metrics_csv([(r.step, r.values) for r in rows])
        csv_key = f"files/{a.tenant_id}/{csv_id}.csv"
        csv_size = self.store.put_bytes(csv_key, table)
        model = ids.fine_tuned_model_name(model=a.model, tenant_id=a.tenant_id, suffix=a.suffix, job_id=self.job_id)
        with session_scope(self.url) as s:
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
                s.rollback()
                self.store.delete(adapter_key)
                self.store.delete(csv_key)
                return "lost"
            runs.update_progress(
                s,
                job_id=self.job_id,
                current_step=a.total_steps or 0,
                total_steps=a.total_steps,
                trained_tokens=sum(a.tokens_by_step.values()),
                estimated_finish=None,
            )
            runs.add_event(s, job_id=self.job_id, level="info", message=f"New fine-tuned model created: {model}")
            runs.add_event(s, job_id=self.job_id, level="info", message="The job has successfully completed")
        return JobStatus.SUCCEEDED

    def _stopped(self, reason: str, step: int | None) -> str:
        status = JobStatus.CANCELLED if reason == "cancel" else JobStatus.PAUSED
        at = f" at step {step}" if step is not None else ""
        message = (
            f"The job was cancelled{at}"
            if status == JobStatus.CANCELLED
            else f"The job was paused{at}: resume continues there"
        )
        with session_scope(self.url) as s:
            if runs.finish(s, job_id=self.job_id, worker_id=self.worker_id, status=status):
                runs.add_event(s, job_id=self.job_id, level="info", message=message)
                return status
        if status == JobStatus.PAUSED:  # refused: a cancel landed after the flags were read, and it wins
            with session_scope(self.url) as s:
                cancel, _ = runs.control_flags(s, job_id=self.job_id)
            if cancel:
                return self._stopped("cancel", step)
        return status

    def _fail(self, code: ErrorCode, message: str) -> str:
        with session_scope(self.url) as s:
            if runs.finish(
                s,
                job_id=self.job_id,
                worker_id=self.worker_id,
                status=JobStatus.FAILED,
                error={"code": code, "message": message, "param": None},
            ):
                runs.add_event(s, job_id=self.job_id, level="error", message=f"The job failed: {message}")
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


def _read_messages(stream: IO[str], out: queue.Queue[msg.RunnerMessage | None]) -> None:
    """Each line of the trainer's stdout parsed once into its typed message; a line that is not one is logged and
    dropped (the trainer's own output goes to stderr, so this is a protocol bug, not the user's)."""
    try:
        for line in stream:
            line = line.strip()
            if not line:
                continue
            try:
                out.put(msg.decode(line))
            except ValidationError as err:
                log.warning("unreadable message from the trainer (%s): %.200s", err.errors()[0]["msg"], line)
    finally:
        out.put(None)


def _send_stop(stdin: IO[str]) -> None:
    with contextlib.suppress(OSError, ValueError):  # the trainer already exited
        stdin.write(msg.STOP + "\n")
        stdin.flush()


def _close(stream: IO[str]) -> None:
    with contextlib.suppress(OSError):  # BrokenPipeError: the trainer already exited
        stream.close()


def _tail(path: Path, n: int) -> str:
    try:
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return ""
    return "\n".join(deque(lines, maxlen=n))

"""The ``validating_files`` phase (design §1, §4): a worker validates a job's datasets before it is queued to train.

``POST /v1/fine_tuning/jobs`` answers at once with ``validating_files`` after the cheap checks (the files exist,
belong to the tenant and have the right purpose; the spec and grader parse), as OpenAI's API does: reading a whole
dataset has no place in a request, and the parsers need no torch but the download and the parse take the time of
the file. The first worker to get the job's message takes its lease, downloads each file and validates every line
against the method's format with the trainer's own loaders. A bad file ends the job ``failed`` with
``invalid_file``, the message naming the file and the line; good files move it to ``queued``, and the same worker
goes on to claim it for training.

Each transition is one conditional UPDATE (``api.repositories.runs``), so a cancel or a pause that arrives while the
files are read wins, and a worker that dies mid-validation leaves a lease that expires and a job the sweeper
re-enqueues.
"""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path
from typing import Any, Literal

from api.db import session_scope
from api.orm import Job
from api.repositories import runs
from api.settings import Settings
from api.status import JobStatus
from api.storage import ArtifactStore, NotFound
from trainer.config import JobSpec, SpecError, check_total_steps, parse_spec
from trainer.data import DatasetError, load_preferences, load_prompts, load_supervised
from worker.errors import ErrorCode, JobError
from worker.lease import Heartbeat

log = logging.getLogger("proxima.worker")

VALIDATED_EVENT = "Validated files; job queued"


def dataset_message(which: str, file_id: str, *, line: int | None, detail: str) -> str:
    """``training file file-abc, line 3: <problem>``: the user's file id and line, never the worker's local copy."""
    at = f", line {line}" if line else ""
    return f"{which} file {file_id}{at}: {detail}"


def download_dataset(url: str, store: ArtifactStore, *, file_id: str, dest: Path) -> Path:
    """The file's contents at ``dest``; :class:`JobError` ``invalid_file`` when the file was deleted since the job
    was created or its contents are missing from the store."""
    with session_scope(url) as s:
        f = runs.get_file(s, file_id=file_id)
        key = f.storage_key if f is not None and not f.deleted else None
    if key is None:
        raise JobError(ErrorCode.INVALID_FILE, f"file {file_id} no longer exists: upload it again and create a new job")
    try:
        store.get_to_path(key, dest)
    except NotFound:
        raise JobError(
            ErrorCode.INVALID_FILE, f"file {file_id}'s contents are missing from the artifact store"
        ) from None
    return dest


def check_dataset(path: Path, spec: JobSpec) -> int:
    """Validate every line against the method's format (design §4) and return the number of examples;
    :class:`DatasetError` names the first bad line: one that is not JSON or holds a value the service cannot take
    (``trainer.json_values``), prompts without the fields the grader's templates name (RL), preference pairs
    (reward_model, dpo), or conversations ending with an assistant turn (supervised)."""
    fmt = spec.method.data_format
    if fmt == "prompts":
        return len(load_prompts(path, grader=spec.method.grader))
    if fmt == "preferences":
        return len(load_preferences(path))
    return len(load_supervised(path))


def _job_files(job: Job) -> list[tuple[str, str, str]]:
    """(label in messages, request field, file id) of the job's datasets."""
    files = [("training", "training_file", job.training_file)]
    if job.validation_file:
        files.append(("validation", "validation_file", job.validation_file))
    return files


def _verdict(
    url: str, store: ArtifactStore, spec_json: dict[str, Any], files: list[tuple[str, str, str]]
) -> JobError | None:
    """The first problem with the job's files, or None when every line of every file is valid."""
    spec = parse_spec(spec_json)  # the API parsed it when the job was created
    with tempfile.TemporaryDirectory(prefix="proxima-validate-") as tmp:
        for which, param, file_id in files:
            try:
                path = download_dataset(url, store, file_id=file_id, dest=Path(tmp) / f"{param}.jsonl")
                n_examples = check_dataset(path, spec)
            except DatasetError as err:
                message = dataset_message(which, file_id, line=err.line, detail=err.detail)
                return JobError(ErrorCode.INVALID_FILE, message, param=param)
            except JobError as err:
                err.param = param
                return err
            if param == "training_file":
                try:  # the number of steps n_epochs plans depends on the data: the request could not check it
                    check_total_steps(spec, n_examples=n_examples)
                except SpecError as err:
                    return JobError(ErrorCode.INVALID_HYPERPARAMETERS, err.detail, param=err.param)
    return None


def validate_files(
    job_id: str, *, settings: Settings, store: ArtifactStore, worker_id: str
) -> Literal[JobStatus.QUEUED, JobStatus.FAILED, "skipped"]:
    """Run the job's ``validating_files`` phase if it is in it; returns ``queued`` (files valid), ``failed``
    (a bad file, recorded as the job's error and an event) or ``"skipped"`` (not validating files, another worker
    validating them, or cancelled or paused meanwhile)."""
    url = settings.db_url
    with session_scope(url) as s:
        if not runs.claim_validation(s, job_id=job_id, worker_id=worker_id, lease_seconds=settings.lease_seconds):
            return "skipped"
        job = runs.get_job(s, job_id=job_id)
        assert job is not None
        spec_json, files = dict(job.spec), _job_files(job)
    heartbeat = Heartbeat(settings, job_id, worker_id)  # a large file may take longer to read than one lease
    heartbeat.start()
    try:
        try:
            problem = _verdict(url, store, spec_json, files)
        except Exception:  # a bug, not the user's file: fail the job rather than retry it forever
            log.exception("job %s: worker error while validating its files", job_id)
            problem = JobError(ErrorCode.INTERNAL_ERROR, "internal worker error")
        error = None if problem is None else {"code": problem.code, "message": problem.message, "param": problem.param}
        with session_scope(url) as s:
            if not runs.end_validation(s, job_id=job_id, worker_id=worker_id, error=error):
                return "skipped"
            if problem is None:
                runs.add_event(s, job_id=job_id, level="info", message=VALIDATED_EVENT)
            else:
                runs.add_event(s, job_id=job_id, level="error", message=f"The job failed: {problem.message}")
    finally:
        heartbeat.done.set()
        with session_scope(url) as s:  # no-op once end_validation released it
            runs.release_lease(s, job_id=job_id, worker_id=worker_id)
    if problem is not None:
        log.warning("job %s failed validation (%s): %s", job_id, problem.code, problem.message)
        return JobStatus.FAILED
    log.info("job %s: files validated, queued", job_id)
    return JobStatus.QUEUED

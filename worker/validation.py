"""The ``validating_files`` phase: a worker validates a job's datasets before it is queued to train.

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

import importlib
import logging
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from api.db import session_scope
from api.orm import Job, now
from api.repositories import runs, sizing
from api.services import model_limits
from api.settings import Settings
from api.status import JobStatus
from api.storage import ArtifactStore, NotFound
from trainer.spec.config import JobSpec, SpecError, check_total_steps
from trainer.spec.data import DatasetError, load_preferences, load_prompts, load_supervised, offered_functions
from worker.errors import ErrorCode, JobError
from worker.lease import Heartbeat

log = logging.getLogger("proxima.worker")

VALIDATED_EVENT = "Validated files; job queued"


def dataset_message(which: str, file_id: str, *, line: int | None, detail: str) -> str:
    """``training file file-abc, line 3: <problem>``: the user's file id and line, never the worker's local copy."""
    at = f", line {line}" if line else ""
    return f"{which} file {file_id}{at}: {detail}"


def download_dataset(url: str, store: ArtifactStore, *, file_id: str, dest: Path) -> Path:
    """The file's contents at ``dest``; :class:`JobError` ``invalid_file`` when the file was deleted or expired
    (``expires_after``) since the job was created, or its contents are missing from the store."""
    with session_scope(url) as s:
        f = runs.get_file(s, file_id=file_id)
        key = f.storage_key if f is not None and not f.deleted else None
        expired = f is not None and f.expires_at is not None and f.expires_at <= now()
    if expired:
        raise JobError(
            ErrorCode.INVALID_FILE, f"file {file_id} expired (expires_after) before the job read it: upload it again"
        )
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
    """Validate every line against the method's format (``trainer.spec.data``) and return the number of examples;
    :class:`DatasetError` names the first bad line: one that is not JSON or holds a value the service cannot take
    (``trainer.spec.json_values``), prompts without the fields the grader's templates name (RL), preference pairs
    (reward_model, dpo), or conversations ending with an assistant turn (supervised)."""
    fmt = spec.method.data_format
    if fmt == "prompts":
        return len(load_prompts(path, grader=spec.method.grader, agent=spec.method.agent))
    if fmt == "preferences":
        return len(load_preferences(path))
    return len(load_supervised(path))


def _job_files(job: Job) -> list[tuple[str, str, str]]:
    """(label in messages, request field, file id) of the job's datasets."""
    files = [("training", "training_file", job.training_file)]
    if job.validation_file:
        files.append(("validation", "validation_file", job.validation_file))
    return files


def preload_tokenising_code() -> None:
    """Import the trainer's tokenising code (torch, transformers) before the worker takes any job: fitting lengths
    tokenises prompts in this process, and importing torch holds the GIL for seconds at a time, during which the
    lease heartbeat of the job being validated could not run (a lease lost to an import)."""
    for module in ("trainer.generation.encoding", "trainer.generation.models"):
        importlib.import_module(module)


@dataclass(frozen=True)
class FittedLengths:
    """Length hyperparameters left at their default that the worker changed to fit the data, and the event that
    says so."""

    values: dict[str, int]
    message: str


def _longest_prompt(
    folder: Path, spec: JobSpec, datasets: list[tuple[str, str, str, Path]]
) -> tuple[int, tuple[str, str, str, int]]:
    """The longest prompt of the datasets in tokens, as the RL loop encodes it (chat template, thinking mode), and
    where it is: (label, request field, file id, line)."""
    # The tokenizer and the chat template are the trainer's (they import torch): loaded here only when the model
    # is on this worker and the method samples completions.
    from trainer.generation.encoding import encode_prompts, thinking_kwargs
    from trainer.generation.models import load_tokenizer
    from trainer.spec.config import MAX_TOKENS

    tokenizer = load_tokenizer(str(folder))
    hp = spec.method.hyperparameters
    template = thinking_kwargs(tokenizer, str(getattr(hp, "reasoning_effort", "default"))) or {}
    longest, at = 0, ("training", "training_file", "", 0)
    for which, param, file_id, path in datasets:
        items = load_prompts(path, grader=spec.method.grader, agent=spec.method.agent)
        tools = offered_functions(items, spec.method.agent)  # an agent job's prompts show the tools
        ids = encode_prompts(tokenizer, items, max_prompt_tokens=MAX_TOKENS, template_kwargs=template, tools=tools)
        for item, prompt in zip(items, ids, strict=True):
            if len(prompt) > longest:
                longest, at = len(prompt), (which, param, file_id, item.line)
    return longest, at


def _check_lengths(folder: Path, spec: JobSpec, datasets: list[tuple[str, str, str, Path]], max_length: int) -> None:
    """Every pair (reward_model, dpo) or conversation (supervised) within ``max_length`` tokens, tokenised as the
    trainer does, and rendered by the model's chat template without losing a field (its tools, names, tool calls);
    :class:`JobError` ``invalid_file`` naming the first line that is not."""
    from trainer.generation.encoding import ExampleTooLongError, encode_preferences, encode_supervised
    from trainer.generation.models import load_tokenizer

    tokenizer = load_tokenizer(str(folder))
    last_only = getattr(spec.method.hyperparameters, "assistant_turns", "all") == "last"
    for which, param, file_id, path in datasets:
        try:
            if spec.method.data_format == "preferences":
                encode_preferences(tokenizer, load_preferences(path), max_length=max_length)
            else:
                encode_supervised(tokenizer, load_supervised(path), max_length=max_length, last_turn_only=last_only)
        except DatasetError as err:  # too long, or a line the model's chat template cannot render (tools, names)
            hint = "; shorten it or raise max_length (at most the model's context)"
            detail = err.detail + (hint if isinstance(err, ExampleTooLongError) else "")
            raise JobError(
                ErrorCode.INVALID_FILE, dataset_message(which, file_id, line=err.line, detail=detail), param=param
            ) from None


def fit_lengths(
    spec: JobSpec, datasets: list[tuple[str, str, str, Path]], *, created: dict[str, Any] | None, model_store: Path
) -> FittedLengths | None:
    """Fit the lengths left at their default to the model and the data (``api.services.model_limits``, stage 1 when
    the API could not read the model's context, then stage 2 with the longest prompt); None when nothing changes or
    the model is not on this worker (the trainer reports that). :class:`JobError` when the data cannot fit: a prompt
    longer than a length the user gave, or than the context, the message naming its file and line."""
    mtype = spec.method.type
    fields = model_limits.length_fields(mtype)
    folder = model_limits.model_dir(spec.model, model_store)
    if not fields or folder is None:
        return None
    hp = spec.method.hyperparameters
    values: dict[str, Any] = hp.model_dump()
    recorded = (created or {}).get(model_limits.LENGTH_DEFAULTS) or {}
    defaulted = {f for f, v in recorded.items() if f in fields and values.get(f) == v}
    contexts = [model_limits.context_length(spec.model, model_store)]
    if (value_model := getattr(hp, "value_model", None)) is not None:
        contexts.append(model_limits.context_length(value_model, model_store))
    known = [c for c in contexts if c is not None]
    context = min(known) if known else None
    where = f"method.{mtype}.hyperparameters"
    changed: dict[str, int] = {}
    if created is not None and created.get(model_limits.CONTEXT_TOKENS) is None and context is not None and defaulted:
        try:  # the API could not read the model's context: what it would have resolved, here
            resolved = model_limits.fit_spec(mtype, values, explicit=set(fields) - defaulted, context=context)
        except model_limits.LengthError as err:
            message = f"{err.message} ({spec.model})"
            raise JobError(ErrorCode.INVALID_HYPERPARAMETERS, message, param=f"{where}.{err.field}") from None
        changed = {f: v for f, v in resolved.items() if values[f] != v}
        values.update(changed)
    longest_note = ""
    if model_limits.MAX_LENGTH in fields:
        try:
            _check_lengths(folder, spec, datasets, int(values[model_limits.MAX_LENGTH]))
        except JobError:
            raise
        except ValueError as err:  # the trainer's ModelError: a tokenizer it cannot load, which it reports itself
            log.warning("could not check the lengths of %s's examples: %s", spec.model, err)
    if spec.method.data_format == "prompts":
        try:
            longest, (which, param, file_id, line) = _longest_prompt(folder, spec, datasets)
        except ValueError as err:  # the trainer's ModelError: a tokenizer it cannot load, which it reports itself
            log.warning("could not fit the lengths of %s to its prompts: %s", spec.model, err)
            longest = 0
        if not longest:
            return _fitted(spec, changed, context, "")
        try:
            more = model_limits.fit_data(mtype, values, defaulted=defaulted, context=context, longest_prompt=longest)
        except model_limits.LengthError as err:
            message = dataset_message(which, file_id, line=line, detail=f"{err.message} ({spec.model})")
            raise JobError(ErrorCode.INVALID_FILE, message, param=param) from None
        changed |= more
        longest_note = f" and its longest prompt ({longest} tokens, {which} file {file_id}, line {line})"
    return _fitted(spec, changed, context, longest_note)


def _fitted(spec: JobSpec, changed: dict[str, int], context: int | None, note: str) -> FittedLengths | None:
    if not changed:
        return None
    before = spec.method.hyperparameters.model_dump()
    what = ", ".join(f"{f} {before[f]} → {v}" for f, v in sorted(changed.items()))
    of_context = f"{spec.model}'s context of {context} tokens" if context is not None else spec.model
    return FittedLengths(changed, f"Length defaults fitted to {of_context}{note}: {what}")


def _verdict(
    url: str,
    store: ArtifactStore,
    spec: JobSpec,
    files: list[tuple[str, str, str]],
    *,
    created: dict[str, Any] | None = None,
    model_store: Path | None = None,
) -> tuple[JobError | None, FittedLengths | None]:
    """The first problem with the job's files, or None when every line of every file is valid; with
    ``model_store``, the lengths fitted to the data (:func:`fit_lengths`)."""
    datasets: list[tuple[str, str, str, Path]] = []
    with tempfile.TemporaryDirectory(prefix="proxima-validate-") as tmp:
        for which, param, file_id in files:
            try:
                path = download_dataset(url, store, file_id=file_id, dest=Path(tmp) / f"{param}.jsonl")
                n_examples = check_dataset(path, spec)
            except DatasetError as err:
                message = dataset_message(which, file_id, line=err.line, detail=err.detail)
                return JobError(ErrorCode.INVALID_FILE, message, param=param), None
            except JobError as err:
                err.param = param
                return err, None
            if param == "training_file":
                try:  # the number of steps n_epochs plans depends on the data: the request could not check it
                    check_total_steps(spec, n_examples=n_examples)
                except SpecError as err:
                    return JobError(ErrorCode.INVALID_HYPERPARAMETERS, err.detail, param=err.param), None
            datasets.append((which, param, file_id, path))
        if model_store is None:
            return None, None
        try:
            return None, fit_lengths(spec, datasets, created=created, model_store=model_store)
        except JobError as err:
            return err, None


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
        stored, files = dict(job.spec), _job_files(job)
        created = sizing.creation_data(s, job_id=job_id)
    heartbeat = Heartbeat(settings, job_id, worker_id)  # a large file may take longer to read than one lease
    heartbeat.start()
    try:
        try:
            spec = JobSpec.from_stored(stored)  # the API parsed it when the job was created
            problem, fitted = _verdict(url, store, spec, files, created=created, model_store=settings.model_store)
        except Exception:  # a bug, not the user's file: fail the job rather than retry it forever
            log.exception("job %s: worker error while validating its files", job_id)
            problem, fitted = JobError(ErrorCode.INTERNAL_ERROR, "internal worker error"), None
        error = None if problem is None else {"code": problem.code, "message": problem.message, "param": problem.param}
        with session_scope(url) as s:
            if fitted is not None and not sizing.set_spec(
                s, job_id=job_id, worker_id=worker_id, spec=spec.with_hyperparameters(fitted.values).to_json()
            ):
                return "skipped"
            if not runs.end_validation(s, job_id=job_id, worker_id=worker_id, error=error):
                return "skipped"
            if fitted is not None:
                runs.add_event(s, job_id=job_id, level="info", message=fitted.message, data=dict(fitted.values))
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

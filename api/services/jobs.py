"""Fine-tuning jobs as the API drives them: create (validate the spec, check the files, then enqueue), read,
cancel, pause and resume, and the job's events, checkpoints, metrics, rollouts and adapters.

The database row is the truth and the broker message only a wake-up call: a job is enqueued by task name
(``proxima.jobs.run``) after the commit that made it ``validating_files``, so a worker never sees a job that is not
there. If the broker is down the job waits with ``enqueued_at`` unset and the worker's sweeper enqueues it from the
database later; the request does not fail.

A request never reads a dataset: the files' lines are validated by the worker that picks the job up
(``worker.validation``), which moves the job on to ``queued`` or fails it with ``invalid_file``.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Mapping
from functools import lru_cache
from typing import Any, BinaryIO

from celery import Celery
from sqlalchemy import Connection, Row
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session

from api import ids
from api.auth import Caller, tenant_for_key
from api.db import read, session_scope
from api.errors import Conflict, InvalidRequest, NotFound
from api.orm import Checkpoint, Job, JobEvent, Rollout, now
from api.repositories import files as files_repo
from api.repositories import jobs as jobs_repo
from api.repositories import runs as runs_repo
from api.schemas import FineTuningJob, JobCreate
from api.services import graders as graders_service
from api.services import integrations as integrations_service
from api.services import model_limits
from api.settings import Settings
from api.status import NOT_STARTED, TERMINAL_STATUSES, WAITING, JobStatus
from api.storage import ArtifactStore
from api.storage import NotFound as ArtifactNotFound
from api.tasks import RUN_JOB, gpus_of, queue_for
from trainer.spec.config import JobSpec, SpecError, parse_spec, trained_examples

log = logging.getLogger("proxima.api.jobs")

ADAPTER_ARCHIVE = "adapter.tar.gz"


# -- enqueueing -----------------------------------------------------------------------------------------------


@lru_cache
def celery_client(broker_url: str) -> Celery:
    """A Celery app used only to publish by task name (the API never imports ``worker/``). Publishing gives up
    fast when the broker is unreachable: the database, not the message, is what keeps a job alive."""
    app = Celery("proxima-api", broker=broker_url, set_as_current=False)
    app.conf.update(
        broker_connection_timeout=2,
        broker_connection_retry_on_startup=False,
        task_publish_retry=True,
        task_publish_retry_policy={"max_retries": 1, "interval_start": 0, "interval_step": 0.2, "interval_max": 0.2},
    )
    if broker_url.startswith(("redis://", "rediss://")):
        app.conf.broker_transport_options = {"socket_connect_timeout": 2, "socket_timeout": 5}
    return app


def enqueue(*, settings: Settings, job_id: str, gpus: int = 1) -> bool:
    """Publish the job's wake-up call, in the queue of its size (``api.tasks.queue_for``); False (and a warning)
    when the broker cannot be reached."""
    try:
        celery_client(settings.celery_broker_url).send_task(RUN_JOB, args=[job_id], queue=queue_for(gpus))
    except Exception as err:  # any broker failure: the sweeper re-enqueues queued jobs from the database
        log.warning(
            "could not enqueue job %s (%s: %s); it stays queued for the sweeper", job_id, type(err).__name__, err
        )
        return False
    return True


def _commit_and_enqueue(*, session: Session, settings: Settings, job: Job) -> None:
    """Commit the row first, then publish, then record ``enqueued_at``.

    Nothing after the commit may fail the request: a client told that its request failed retries it, and a job
    committed and queued behind a failed answer would train twice. So the publish reports failure instead of raising
    (the sweeper enqueues the job later), and ``enqueued_at`` is written in a transaction of its own whose failure is
    only logged (the sweeper then sends one more wake-up, which the database's lease makes harmless); the request's
    session, and the job the answer is built from, stay as committed."""
    session.commit()
    if not enqueue(settings=settings, job_id=job.id, gpus=gpus_of(job.spec)):
        return
    try:
        with session_scope(settings.db_url) as s:
            runs_repo.mark_enqueued(s, job_id=job.id)
    except SQLAlchemyError as err:
        log.warning("job %s: could not record that it was enqueued (%s); the sweeper will wake it again", job.id, err)


# -- create ---------------------------------------------------------------------------------------------------


def _spec_input(body: JobCreate) -> dict[str, Any]:
    """The body as ``parse_spec`` takes it: OpenAI's deprecated top-level ``hyperparameters`` moved under the
    method, a random seed when none is given (as OpenAI does)."""
    raw: dict[str, Any] = {"model": body.model, "training_file": body.training_file}
    for name in ("validation_file", "suffix", "metadata", "method", "resources", "integrations"):
        if (value := getattr(body, name)) is not None:
            raw[name] = value
    raw["seed"] = body.seed if body.seed is not None else secrets.randbelow(2**31)
    if body.hyperparameters is not None:
        method = raw.get("method")
        mtype = method.get("type") if isinstance(method, dict) else None
        if not isinstance(mtype, str):
            raise InvalidRequest("top-level hyperparameters need a method with a type", param="method")
        block = method.get(mtype)  # type: ignore[union-attr]
        block = dict(block) if isinstance(block, dict) else {}
        if block.get("hyperparameters"):
            raise InvalidRequest(
                f"give hyperparameters under method.{mtype}.hyperparameters only (the top-level field is deprecated)",
                param="hyperparameters",
            )
        block["hyperparameters"] = body.hyperparameters
        raw["method"] = {**method, mtype: block}  # type: ignore[dict-item]
    return raw


def _check_dataset_file(session: Session, *, tenant: Caller, file_id: str, param: str) -> None:
    """The cheap checks a request makes: the file exists, is the tenant's and is a dataset (its lines are the
    worker's to validate)."""
    row = files_repo.get(session, tenant_id=tenant.id, file_id=file_id)
    if row is None and files_repo.get_expired(session, tenant_id=tenant.id, file_id=file_id) is not None:
        raise InvalidRequest(
            f"file '{file_id}' has expired (its expires_after): upload it again", param=param, code="file_expired"
        )
    if row is None:  # another tenant's file does not exist either
        raise InvalidRequest(f"No such file: '{file_id}'", param=param, code="file_not_found")
    if row.purpose != "fine-tune":
        raise InvalidRequest(
            f"file '{file_id}' has purpose {row.purpose!r}; a dataset needs purpose 'fine-tune'",
            param=param,
            code="invalid_file_purpose",
        )


def _resolve_reward_models(session: Session, *, tenant: Caller, spec: JobSpec) -> JobSpec:
    """A reward_model grader names a succeeded ``reward_model`` job of the same tenant, by its id or its
    fine-tuned model name; the stored spec names it by job id, which the worker turns into a local folder."""
    job_ids: dict[str, str] = {}
    for param, ref in spec.reward_models():
        job = (
            jobs_repo.get(session, tenant_id=tenant.id, job_id=ref)
            if ref.startswith("ftjob-")
            else jobs_repo.get_by_model(session, tenant_id=tenant.id, fine_tuned_model=ref)
        )
        if job is None:
            raise InvalidRequest(
                f"no reward model {ref!r}: give the id or the fine-tuned model name of a reward_model job",
                param=param,
                code="invalid_reward_model",
            )
        if job.model_deleted_at is not None:  # deleted by its tenant: gone for new jobs, as for chat completions
            raise InvalidRequest(
                f"reward model {ref!r}: its fine-tuned model was deleted", param=param, code="invalid_reward_model"
            )
        method = JobSpec.from_stored(job.spec).method.type
        if method != "reward_model":
            raise InvalidRequest(
                f"job {job.id} is a {method} job, not a reward_model job", param=param, code="invalid_reward_model"
            )
        if job.status != JobStatus.SUCCEEDED:
            raise InvalidRequest(
                f"reward model job {job.id} is {job.status}: it can grade once it has succeeded",
                param=param,
                code="invalid_reward_model",
            )
        job_ids[ref] = job.id
    return spec.with_reward_models(job_ids)


def _fit_lengths(spec: JobSpec, *, settings: Settings, body: JobCreate) -> tuple[JobSpec, dict[str, Any] | None]:
    """Resolve the method's token lengths against the model's context (``api.services.model_limits``): a length the
    user gave that cannot fit is a 400 naming it; those left at their default are clamped. Returns the spec with
    them and the creation event's data recording them (the worker fits them to the longest prompt), None when the
    method has no length left at its default."""
    mtype = spec.method.type
    hp = spec.method.hyperparameters
    fields = model_limits.length_fields(mtype)
    explicit = hp.model_fields_set & set(fields)
    defaults = {f: int(getattr(hp, f)) for f in fields if f not in explicit}
    contexts = [model_limits.context_length(spec.model, settings.model_store)]
    if spec.value_model is not None:  # PPO's critic reads the same sequences
        contexts.append(model_limits.context_length(spec.value_model, settings.model_store))
    known = [c for c in contexts if c is not None]
    context = min(known) if known else None
    if context is not None:
        key = body.method.get("type") if isinstance(body.method, dict) else None
        where = f"method.{key if isinstance(key, str) else mtype}.hyperparameters"
        try:
            resolved = model_limits.fit_spec(mtype, hp.model_dump(), explicit=explicit, context=context)
            spec = spec.with_hyperparameters(resolved)
        except model_limits.LengthError as err:
            raise InvalidRequest(
                f"{err.message} ({spec.model})", param=f"{where}.{err.field}", code="context_length_exceeded"
            ) from None
        except SpecError as err:
            raise InvalidRequest(str(err), param=err.param, code="invalid_spec") from None
        defaults.update({f: v for f, v in resolved.items() if f in defaults})
    if not defaults:
        return spec, None
    return spec, {model_limits.LENGTH_DEFAULTS: defaults, model_limits.CONTEXT_TOKENS: context}


def validated_spec(
    *, session: Session, settings: Settings, tenant: Caller, body: JobCreate
) -> tuple[JobSpec, dict[str, Any] | None]:
    """What a job's creation checks, without writing anything: the spec parses, the model is offered, the grader and
    reward models are valid, the lengths fit the model, the files are the tenant's datasets. Returns the spec as it
    is stored (lengths fitted, reward models named by job id) and the creation event's data (:func:`_fit_lengths`)."""
    try:
        spec = parse_spec(_spec_input(body))
    except SpecError as err:
        raise InvalidRequest(str(err), param=err.param, code=err.code or "invalid_spec") from None
    if spec.gpus > settings.max_job_gpus:
        raise InvalidRequest(
            f"this deployment runs a job on at most {settings.max_job_gpus} device"
            f"{'s' if settings.max_job_gpus > 1 else ''} (PROXIMA_MAX_JOB_GPUS); asked for {spec.gpus}",
            param="resources.gpus",
            code="invalid_spec",
        )
    if spec.model not in settings.base_models:
        raise InvalidRequest(
            f"model {spec.model!r} is not available; offered: {', '.join(settings.base_models)}",
            param="model",
            code="model_not_available",
        )
    integrations_service.check_configured(spec, settings=settings)
    _check_method(spec, settings=settings)
    spec = _resolve_reward_models(session, tenant=tenant, spec=spec)
    _check_dataset_file(session, tenant=tenant, file_id=spec.training_file, param="training_file")
    if spec.validation_file is not None:
        _check_dataset_file(session, tenant=tenant, file_id=spec.validation_file, param="validation_file")
    spec, created_data = _fit_lengths(spec, settings=settings, body=body)
    spec = _resolve_eval_interval(session, tenant=tenant, spec=spec)
    hp = spec.method.hyperparameters
    if spec.gpus > hp.batch_size:  # each device samples whole groups
        raise InvalidRequest(
            f"batch_size ({hp.batch_size}) must be at least resources.gpus ({spec.gpus}): each device trains on a "
            "share of every batch",
            param="resources.gpus",
            code="invalid_spec",
        )
    return spec, created_data


def _resolve_eval_interval(session: Session, *, tenant: Caller, spec: JobSpec) -> JobSpec:
    """``eval_interval: "auto"`` replaced by the interval it picks from the run's length (``Hyperparameters.eval_every``
    over the training file's records), so that the stored spec, the worker's finish estimate and the job object all
    hold the number the run uses."""
    hp = spec.method.hyperparameters
    if hp.eval_interval != "auto":
        return spec
    row = files_repo.get(session, tenant_id=tenant.id, file_id=spec.training_file)
    assert row is not None  # _check_dataset_file found it
    total_steps = hp.total_steps(trained_examples(spec, row.lines))
    return spec.with_hyperparameters({"eval_interval": hp.eval_every(total_steps)})


def _check_method(spec: JobSpec, *, settings: Settings) -> None:
    """The grader (python sources checked in a sandbox, remote graders' models, metrics and URLs), the agent's tool
    servers under the deployment's URL policy and its environment's source, and a value model on offer."""
    mtype = spec.method.type
    if spec.method.grader is not None:
        grader = spec.method.grader.model_dump(mode="json", exclude_none=True)
        graders_service.check_job_grader(grader, param=f"method.{mtype}.grader", settings=settings)
    if spec.method.agent is not None:
        graders_service.check_agent(spec.method.agent, param=f"method.{mtype}", settings=settings)
    if spec.value_model is not None and spec.value_model not in settings.base_models:
        raise InvalidRequest(
            f"value model {spec.value_model!r} is not available; offered: {', '.join(settings.base_models)}",
            param=f"{spec.hyperparameters_param}.value_model",
            code="model_not_available",
        )


def create(*, session: Session, settings: Settings, tenant: Caller, body: JobCreate) -> Job:
    """Validate the spec, check the files (they exist, are the tenant's and are datasets), write the job in
    ``validating_files`` and enqueue it.

    Unlike other services this one commits (through the request's session) before publishing, because a worker
    must find the row when the message arrives; everything that can fail, building the answer included, happens
    before that commit (``_commit_and_enqueue``). The files' contents are the worker's to validate: a dataset that
    does not fit the method fails the job (``invalid_file``, naming the file and the line), not the request, as
    OpenAI's ``validating_files`` does.
    """
    spec, created_data = validated_spec(session=session, settings=settings, tenant=tenant, body=body)
    job = jobs_repo.add(
        session,
        row=Job(
            id=ids.job_id(),
            tenant_id=tenant.id,
            model=spec.model,
            training_file=spec.training_file,
            validation_file=spec.validation_file,
            status=JobStatus.VALIDATING_FILES,
            spec=spec.to_json(),
            seed=spec.seed,
            suffix=spec.suffix,
            metadata_=spec.metadata,
            result_files=[],
            created_at=now(),
            current_step=0,
        ),
    )
    jobs_repo.add_event(session, job_id=job.id, level="info", message="Created fine-tuning job", data=created_data)
    # The answer is built before the commit, so that whatever could fail in building it fails the request with
    # nothing stored (the route builds the same object from the same row).
    FineTuningJob.from_row(job).model_dump_json()
    _commit_and_enqueue(session=session, settings=settings, job=job)
    return job


# -- read -----------------------------------------------------------------------------------------------------


def get(*, session: Session, tenant: Caller, job_id: str) -> Job:
    job = jobs_repo.get(session, tenant_id=tenant.id, job_id=job_id)
    if job is None:
        raise NotFound("fine-tuning job", job_id, param="fine_tuning_job_id")
    return job


def warm_up_reads(url: str) -> None:
    """Open a connection of the read engine and compile the job poll's statement (and the key lookup's), so that
    the first polls a new API process serves do not pay for them: about 40 ms on the 2-core CI machine."""
    read(url, jobs_repo.get_row, tenant_id="", job_id="")
    with session_scope(url) as session:
        tenant_for_key(session, "warm-up: no such key")


def get_view(*, conn: Connection, tenant: Caller, job_id: str) -> Row[Any]:
    """``get`` for the read-only path (``api.db.read``): the job's row, with ``Job``'s attribute names."""
    row = jobs_repo.get_row(conn, tenant_id=tenant.id, job_id=job_id)
    if row is None:
        raise NotFound("fine-tuning job", job_id, param="fine_tuning_job_id")
    return row


def page(
    *,
    session: Session,
    tenant: Caller,
    after: str | None,
    limit: int,
    metadata: Mapping[str, str] | None,
    metadata_null: bool,
) -> tuple[list[Job], bool]:
    cursor = None
    if after is not None:
        cursor = jobs_repo.get(session, tenant_id=tenant.id, job_id=after)
        if cursor is None:
            raise InvalidRequest(f"no such fine-tuning job: {after!r}", param="after")
    return jobs_repo.page(
        session, tenant_id=tenant.id, after=cursor, limit=limit, metadata=metadata, metadata_null=metadata_null
    )


# -- control --------------------------------------------------------------------------------------------------


def cancel(*, session: Session, tenant: Caller, job_id: str) -> Job:
    """A job no worker runs is cancelled now; a running one is asked to stop (the worker ends it within a step)."""
    job = get(session=session, tenant=tenant, job_id=job_id)
    if job.status in TERMINAL_STATUSES:
        raise Conflict(f"job {job_id} is already {job.status}", param="fine_tuning_job_id", code="job_not_cancellable")
    # cancel_requested is set in every case, so that a worker that claims the job meanwhile stops it too. A running
    # job can leave `running` between the two conditional updates (its worker pauses it or gives it back): then the
    # first one is tried again, so the cancel is never lost.
    for _ in range(2):
        if jobs_repo.transition(
            session,
            job=job,
            from_statuses=NOT_STARTED,
            status=JobStatus.CANCELLED,
            finished_at=now(),
            cancel_requested=True,
            pause_requested=False,
            estimated_finish=None,
        ):
            jobs_repo.add_event(session, job_id=job.id, level="info", message="Fine-tuning job cancelled")
            return job
        if jobs_repo.transition(session, job=job, from_statuses=(JobStatus.RUNNING,), cancel_requested=True):
            jobs_repo.add_event(
                session,
                job_id=job.id,
                level="info",
                message="Cancellation requested; the job stops within one training step",
            )
            return job
        if job.status in TERMINAL_STATUSES:  # it finished between the read and the update
            raise Conflict(
                f"job {job_id} is already {job.status}", param="fine_tuning_job_id", code="job_not_cancellable"
            )
    return job


def pause(*, session: Session, tenant: Caller, job_id: str) -> Job:
    """A queued job pauses now; a running one pauses at its next checkpoint (the worker sets ``paused``)."""
    job = get(session=session, tenant=tenant, job_id=job_id)
    status = job.status  # as read: each transition below refreshes job
    if status == JobStatus.PAUSED or (status == JobStatus.RUNNING and job.pause_requested):
        return job
    if jobs_repo.transition(session, job=job, from_statuses=WAITING, status=JobStatus.PAUSED):
        jobs_repo.add_event(session, job_id=job.id, level="info", message="Fine-tuning job paused")
    elif jobs_repo.transition(session, job=job, from_statuses=(JobStatus.RUNNING,), pause_requested=True):
        jobs_repo.add_event(
            session, job_id=job.id, level="info", message="Pause requested; the job pauses at its next checkpoint"
        )
    elif job.status != JobStatus.PAUSED:
        raise Conflict(
            f"job {job_id} is {job.status} and cannot be paused", param="fine_tuning_job_id", code="job_not_pausable"
        )
    return job


def resume(*, session: Session, settings: Settings, tenant: Caller, job_id: str) -> Job:
    """A paused job is queued again (and continues from its latest checkpoint); a pending pause is withdrawn."""
    job = get(session=session, tenant=tenant, job_id=job_id)
    if job.status == JobStatus.RUNNING:
        if job.pause_requested and jobs_repo.transition(
            session, job=job, from_statuses=(JobStatus.RUNNING,), pause_requested=False
        ):
            jobs_repo.add_event(session, job_id=job.id, level="info", message="Pause withdrawn")
        return job
    if not jobs_repo.transition(
        session,
        job=job,
        from_statuses=(JobStatus.PAUSED,),
        status=JobStatus.QUEUED,
        pause_requested=False,
        enqueued_at=None,
    ):
        raise Conflict(f"job {job_id} is {job.status}, not paused", param="fine_tuning_job_id", code="job_not_paused")
    jobs_repo.add_event(session, job_id=job.id, level="info", message="Fine-tuning job resumed; job queued")
    _commit_and_enqueue(session=session, settings=settings, job=job)
    return job


# -- what a job produced --------------------------------------------------------------------------------------


def events(
    *, session: Session, tenant: Caller, job_id: str, after: str | None, limit: int
) -> tuple[list[JobEvent], bool]:
    job = get(session=session, tenant=tenant, job_id=job_id)
    cursor = None
    if after is not None:
        cursor = jobs_repo.get_event(session, job_id=job.id, event_id=after)
        if cursor is None:
            raise InvalidRequest(f"no such event: {after!r}", param="after")
    return jobs_repo.events_page(session, job_id=job.id, after=cursor, limit=limit)


def checkpoints(
    *, session: Session, tenant: Caller, job_id: str, after: str | None, limit: int
) -> tuple[Job, list[Checkpoint], bool]:
    job = get(session=session, tenant=tenant, job_id=job_id)
    cursor = None
    if after is not None:
        cursor = jobs_repo.get_checkpoint(session, job_id=job.id, checkpoint_id=after)
        if cursor is None:
            raise InvalidRequest(f"no such checkpoint: {after!r}", param="after")
    rows, has_more = jobs_repo.checkpoints_page(session, job_id=job.id, after=cursor, limit=limit)
    return job, rows, has_more


def metrics(
    *, session: Session, tenant: Caller, job_id: str, after_step: int | None, limit: int | None
) -> tuple[list[jobs_repo.MetricRow], bool]:
    job = get(session=session, tenant=tenant, job_id=job_id)
    rows = jobs_repo.metrics(session, job_id=job.id, after_step=after_step, limit=None if limit is None else limit + 1)
    if limit is not None and len(rows) > limit:
        return rows[:limit], True
    return rows, False


def rollouts(
    *, session: Session, tenant: Caller, job_id: str, step: int | None
) -> tuple[int | None, list[int], list[Rollout]]:
    """(step shown, steps with rollouts, the step's rollouts); the latest step when none is asked for."""
    job = get(session=session, tenant=tenant, job_id=job_id)
    steps = jobs_repo.rollout_steps(session, job_id=job.id)
    if step is None:
        step = steps[-1] if steps else None
    elif step not in steps:
        raise NotFound("rollouts for step", str(step), param="step")
    rows = jobs_repo.rollouts(session, job_id=job.id, step=step) if step is not None else []
    return step, steps, rows


def open_adapter(
    *, session: Session, store: ArtifactStore, tenant: Caller, job_id: str, checkpoint_id: str
) -> tuple[Job, Checkpoint, BinaryIO]:
    """The checkpoint's PEFT adapter archive, open for streaming (the caller closes it)."""
    job = get(session=session, tenant=tenant, job_id=job_id)
    ckpt = jobs_repo.get_checkpoint(session, job_id=job.id, checkpoint_id=checkpoint_id)
    if ckpt is None:
        raise NotFound("checkpoint", checkpoint_id, param="checkpoint_id")
    key = f"{ckpt.storage_key.rstrip('/')}/{ADAPTER_ARCHIVE}"
    try:
        return job, ckpt, store.open(key)
    except ArtifactNotFound:
        log.error("checkpoint %s of job %s has no adapter archive at %s", ckpt.id, job.id, key)
        raise NotFound("adapter archive for checkpoint", checkpoint_id, param="checkpoint_id") from None

"""The run folder of one attempt, before its trainer starts: the datasets from the artifact store, the spec with local
paths and its models resolved on this worker, the reward models its graders name, and the latest stored checkpoint
to resume from (what was recorded beyond it forgotten, so step numbers continue)."""

from __future__ import annotations

import json
import shutil
import tarfile
from dataclasses import dataclass
from pathlib import Path

from api.db import session_scope
from api.repositories import runs
from api.services import files as files_service
from api.services.graders import sandbox_config
from api.status import JobStatus
from api.storage import NotFound
from worker.errors import ErrorCode, JobError
from worker.job_context import ClaimedJob, JobContext, step_tokens
from worker.models import resolve_model
from worker.redact import Redactor
from worker.runner import write_sandbox_file
from worker.validation import download_dataset

TRAINING_COPY, VALIDATION_COPY = "train.jsonl", "validation.jsonl"  # file names in the run folder's data/


@dataclass(frozen=True)
class Restored:
    """Where the attempt resumes (0: from the start) and the tokens the steps up to there trained."""

    step: int
    tokens_by_step: dict[int, int]


def prepare_run_folder(ctx: JobContext, job: ClaimedJob) -> Redactor:
    """The datasets, the models, the spec with local paths and the deployment's sandbox of python graders and
    environments (`worker.runner.write_sandbox_file`) in the run folder; the redactor that turns those paths back into
    the names the user gave."""
    data = ctx.data_dir
    data.mkdir()
    model_store = ctx.settings.model_store
    training = _download_file(ctx, job.training_file, data / TRAINING_COPY)
    model = resolve_model(job.spec.model, model_store)
    local = {training: job.training_file, model: job.spec.model}
    validation = None
    if job.validation_file:
        validation = _download_file(ctx, job.validation_file, data / VALIDATION_COPY)
        local[validation] = job.validation_file
    # the integrations are this worker's (worker.trackers), not the trainer's
    paths = {"training_file": training, "validation_file": validation, "model": model}
    spec = job.spec.for_trainer().model_copy(update=paths)
    if (value_model := spec.value_model) is not None:  # PPO's critic on a separate base model
        spec = spec.with_hyperparameters({"value_model": resolve_model(value_model, model_store)})
        local[str(spec.value_model)] = value_model
    folders = {ref: str(fetch_reward_model(ctx, ref)) for _, ref in spec.reward_models()}
    local.update({folder: f"reward model {ref}" for ref, folder in folders.items()})
    spec = spec.with_reward_models(folders)
    (ctx.run_dir / "spec.json").write_text(json.dumps(spec.to_json(), indent=2))
    write_sandbox_file(ctx.run_dir, sandbox_config(ctx.settings))
    return Redactor(local)


def _download_file(ctx: JobContext, file_id: str, dest: Path) -> str:
    if ctx.db("read a dataset's expiry", lambda: files_service.is_expired(ctx.url, file_id=file_id)):
        message = f"file {file_id} expired (expires_after) before the job read it: upload it again, create a new job"
        raise JobError(ErrorCode.INVALID_FILE, message)
    return str(ctx.db("download a dataset", lambda: download_dataset(ctx.url, ctx.store, file_id=file_id, dest=dest)))


def _reward_model_adapter(ctx: JobContext, job_id: str) -> tuple[str, str] | None:
    """A succeeded job's final adapter archive (its storage key) and the base model it was trained on."""
    with session_scope(ctx.url) as s:
        job = runs.get_job(s, job_id=job_id)
        if job is not None and job.status == JobStatus.SUCCEEDED:
            for file_id in job.result_files or []:
                f = runs.get_file(s, file_id=file_id)
                if f is not None and not f.deleted and f.filename.endswith("-adapter.tar.gz"):
                    return f.storage_key, job.model
    return None


def fetch_reward_model(ctx: JobContext, job_id: str) -> Path:
    """A reward_model grader's job id (the API checked it) → the reward model's folder in the run folder: its
    final adapter archive, with the base model it names resolved on this worker."""
    dest = ctx.run_dir / "reward_models" / job_id
    if (dest / "adapter_config.json").is_file():
        return dest
    found = ctx.db("find a reward model", lambda: _reward_model_adapter(ctx, job_id))
    if found is None:
        message = f"reward model job {job_id} no longer has a stored adapter to grade with"
        raise JobError(ErrorCode.INVALID_REWARD_MODEL, message)
    key, base = found
    archive = dest.with_suffix(".tar.gz")
    dest.mkdir(parents=True)
    try:
        ctx.store.get_to_path(key, archive)
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
        info["base_model"] = resolve_model(base, ctx.settings.model_store)
        info_path.write_text(json.dumps(info, indent=2))
    return dest


def restore_checkpoint(ctx: JobContext) -> Restored:
    """Put the latest stored checkpoint in the run folder (a killed trainer's own checkpoints are dropped: the
    stored ones are those the job's rows name) and forget what was recorded beyond it."""
    local = ctx.run_dir / "checkpoints"
    shutil.rmtree(local, ignore_errors=True)

    def latest() -> tuple[int, str] | None:
        with session_scope(ctx.url) as s:
            ck = runs.latest_checkpoint(s, job_id=ctx.job_id)
            return (ck.step_number, ck.storage_key) if ck is not None else None

    found = ctx.db("find the latest checkpoint", latest)
    step = 0
    if found is not None:
        step, prefix = found
        dest = local / f"step-{step:06d}"
        for key in ctx.store.list(prefix):
            rel = key.removeprefix(prefix.rstrip("/") + "/")
            if rel == "adapter.tar.gz":
                continue
            target = dest / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            ctx.store.get_to_path(key, target)

    def forget() -> dict[int, int]:
        with session_scope(ctx.url) as s:
            runs.forget_after(s, job_id=ctx.job_id, step=step)
            rows = runs.metric_rows(s, job_id=ctx.job_id, up_to=step)
            tokens = {r.step: step_tokens(r.values) for r in rows}
            runs.update_progress(
                s,
                job_id=ctx.job_id,
                current_step=step,
                total_steps=None,
                trained_tokens=sum(tokens.values()),
                estimated_finish=None,
            )
            return tokens

    return Restored(step=step, tokens_by_step=ctx.db("forget what the checkpoint does not hold", forget))

"""A worker killed mid-job (another worker resumes from the stored checkpoint), and the embedded deployment (SQLite,
no broker server) running a job end to end."""

from __future__ import annotations

import tarfile
from collections.abc import Callable
from pathlib import Path

from trainer.spec import metrics as M

from .conftest import Service, grpo_spec

STEPS = 24  # enough that the kill lands mid-job even when steps take a tenth of a second


def assert_adapter_loads(svc: Service, file_id: str, base: Path, tmp: Path) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    archive = tmp / "adapter.tar.gz"
    svc.store.get_to_path(svc.file(file_id).storage_key, archive)
    with tarfile.open(archive) as tar:
        tar.extractall(tmp / "adapter", filter="data")
    PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), str(tmp / "adapter"))


def test_a_worker_killed_mid_job_is_replaced_by_one_that_resumes_from_the_checkpoint(
    make_service: Callable[..., Service], random_model_dir: Path, arithmetic_data: Path, tmp_path: Path
) -> None:
    svc = make_service()
    first = svc.start_worker("first")
    job_id = svc.create_job(grpo_spec(str(random_model_dir), steps=STEPS), arithmetic_data)
    svc.send(job_id)
    svc.wait_for("the first worker to claim the job", lambda: svc.job(job_id).lease_owner)
    svc.start_worker("second")  # idle: the job is the first worker's
    svc.wait_for("a checkpoint at step 2", lambda: any(c.step_number >= 2 for c in svc.checkpoints(job_id)))
    svc.kill_worker(first)  # SIGKILL to its process group: the worker and its trainer, as when a machine dies
    resume_from = max(c.step_number for c in svc.checkpoints(job_id))
    before = svc.metrics(job_id)
    assert svc.job(job_id).status == "running" and resume_from < STEPS
    job = svc.wait_status(job_id, "succeeded", "failed", timeout=120)
    assert job.status == "succeeded", job.error
    assert job.attempts == 2 and job.current_step == STEPS

    after = svc.metrics(job_id)
    assert sorted(after) == list(range(1, STEPS + 1))  # no gap, no step twice
    for step in range(1, resume_from + 1):  # not trained again: even the wall-clock metrics are the first run's
        assert after[step] == before[step]
    assert [c.step_number for c in svc.checkpoints(job_id)] == list(range(1, STEPS + 1))
    events = svc.events(job_id)
    resumed = next(i for i, e in enumerate(events) if e.message.startswith("Resuming from the checkpoint"))
    assert events[resumed].message == f"Resuming from the checkpoint at step {resume_from} (attempt 2)"
    assert any(e.message == f"resumed from checkpoint at step {resume_from}" for e in events[resumed:])
    new_steps = [e.data["step"] for e in events[resumed:] if e.type == "metrics" and e.data]
    assert new_steps == list(range(resume_from + 1, STEPS + 1))
    assert events[-1].message == "The job has successfully completed"
    assert_adapter_loads(svc, job.result_files[1], random_model_dir, tmp_path)


def test_the_embedded_deployment_runs_a_job_on_sqlite_without_a_broker_server(
    make_service: Callable[..., Service], random_model_dir: Path, arithmetic_data: Path, tmp_path: Path
) -> None:
    svc = make_service(embedded=True)
    assert svc.url.startswith("sqlite:") and svc.settings.celery_broker_url.startswith("sqla+sqlite:")
    svc.start_worker("embedded")
    job_id = svc.create_job(grpo_spec(str(random_model_dir), steps=3), arithmetic_data)
    svc.send(job_id)

    job = svc.wait_status(job_id, "succeeded", "failed")
    assert job.status == "succeeded", job.error
    assert sorted(svc.metrics(job_id)) == [1, 2, 3]
    assert all(M.REWARD_MEAN in v for v in svc.metrics(job_id).values())
    assert [c.step_number for c in svc.checkpoints(job_id)] == [1, 2, 3]
    assert_adapter_loads(svc, job.result_files[1], random_model_dir, tmp_path)

"""The run folder's sandbox.json is this worker's: `prepare_run_folder` writes it on every attempt, a resume included
(each attempt prepares a fresh run folder), so that the trainer never reads one a worker of another version wrote
(`SandboxConfig.from_json` refuses fields it does not know)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from api.services.graders import sandbox_config
from api.settings import Settings
from trainer.grading.sandbox import SandboxConfig, configure_sandbox, configured_sandbox
from trainer.spec.config import parse_spec
from worker import job_prepare
from worker.job_context import ClaimedJob, JobContext
from worker.runner import SANDBOX_FILE, configure_sandbox_of

SPEC = {"model": "m", "training_file": "file-a", "method": {"type": "supervised", "supervised": {}}}


def test_a_prepared_run_folder_holds_this_workers_sandbox_over_another_versions(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(job_prepare, "_download_file", lambda ctx, file_id, dest: str(dest))
    monkeypatch.setattr(job_prepare, "resolve_model", lambda name, store: f"/models/{name}")
    settings = Settings(sandbox_packages=None, sandbox_memory_bytes=768 << 20)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    stale = {**SandboxConfig().to_json(), "a_field_of_another_version": 1}
    (run_dir / SANDBOX_FILE).write_text(json.dumps(stale))  # as a worker of another version left it
    ctx = JobContext(settings=settings, worker_id="w", job_id="ftjob-1", run_dir=run_dir, store=None)  # type: ignore[arg-type]
    job = ClaimedJob("ftjob-1", "t", "m", None, parse_spec(SPEC), "file-a", None, attempt=2, claimed_at=0.0)
    job_prepare.prepare_run_folder(ctx, job)
    assert json.loads((run_dir / SANDBOX_FILE).read_text()) == sandbox_config(settings).to_json()
    before = configured_sandbox()
    try:
        configure_sandbox_of(run_dir)
        assert configured_sandbox() == sandbox_config(settings)
    finally:
        configure_sandbox(before)

"""Lengths that fit the model and the estimated finish on a real deployment (``proxima serve``: API and worker,
PostgreSQL, Redis): a GRPO job on tiny-arith with every hyperparameter but ``max_steps`` left at its default is
created with lengths that fit the model's 64-token context and trains to ``succeeded`` (before, its default
``max_completion_tokens`` of 256 failed it after queueing); while it runs, its ``estimated_finish`` is set, within a
bound from its measured steps, and ``proxima jobs follow`` prints it; at the end it is cleared. (README: "Lengths that
fit the model, estimated finish and estimates".)"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from api.status import TERMINAL_STATUSES
from tests.e2e.dashboard_support import MODEL, DashboardServer, upload
from trainer.spec import metrics as M

STEPS = 8
GRADER = {
    "type": "string_check",
    "name": "exact",
    "input": "{{sample.output_text}}",
    "reference": "{{item.answer}}",
    "operation": "eq",
}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, tiny_arith_dir: Path) -> Iterator[DashboardServer]:
    server = DashboardServer(tmp_path_factory.mktemp("defaults"), model_dir=tiny_arith_dir)
    models = Path(server.env["PROXIMA_HOME"]) / "models"
    shutil.move(models / MODEL, models / "tiny-arith")  # offered under its own name
    server.env["PROXIMA_BASE_MODELS"] = json.dumps(["tiny-arith"])
    try:
        server.start()
        yield server
    finally:
        server.close()


def test_an_all_defaults_grpo_job_on_tiny_arith_fits_trains_and_shows_its_estimated_finish(
    server: DashboardServer, arithmetic_data: Path, tmp_path: Path
) -> None:
    key = server.api_key("defaults")
    rows = (arithmetic_data / "train.jsonl").read_text().splitlines()[:64]
    (tmp_path / "train.jsonl").write_text("\n".join(rows) + "\n")
    with server.client(key) as api:
        training = upload(api, tmp_path / "train.jsonl")
        method = {"type": "grpo", "grpo": {"grader": GRADER, "hyperparameters": {"max_steps": STEPS}}}
        created = api.post(
            "/fine_tuning/jobs", json={"model": "tiny-arith", "training_file": training, "method": method}
        )
        assert created.status_code == 200, created.text
        job = created.json()
        hp = job["method"]["grpo"]["hyperparameters"]
        # tiny-arith's 64 tokens split in the defaults' 512 : 256 ratio; the other defaults as they are.
        assert (hp["max_prompt_tokens"], hp["max_completion_tokens"]) == (43, 21)
        assert (hp["batch_size"], hp["group_size"], hp["learning_rate"]) == (8, 8, 3e-4)

        env = {k: v for k, v in os.environ.items() if not k.startswith("PROXIMA_")}
        env |= {"PROXIMA_API_BASE": server.base, "PROXIMA_API_KEY": key}
        follow = subprocess.Popen(
            [sys.executable, "-m", "proxima.cli", "jobs", "follow", job["id"]],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            running: dict[str, Any] | None = None
            deadline = time.monotonic() + 600
            while True:
                read_at = time.time()
                job = api.get(f"/fine_tuning/jobs/{job['id']}").json()
                step, total = job["current_step"], job["total_steps"]
                if running is None and job["status"] == "running" and total and 1 <= step < total:
                    running, running_read_at = job, read_at
                    step_times = [
                        row["metrics"][M.STEP_SECONDS]
                        for row in api.get(f"/fine_tuning/jobs/{job['id']}/metrics").json()["data"]
                        if row["step"] >= 1
                    ]
                if job["status"] in TERMINAL_STATUSES:
                    break
                assert time.monotonic() < deadline, f"the job did not finish:\n{server.logs()}"
                time.sleep(0.2)
            _, err = follow.communicate(timeout=60)
        finally:
            if follow.poll() is None:
                follow.kill()
                follow.wait()

        assert job["status"] == "succeeded", (job["error"], server.logs())
        assert job["current_step"] == STEPS and job["estimated_finish"] is None  # cleared at the end
        assert running is not None, "never saw the job running between its steps"
        eta, done = running["estimated_finish"], running["current_step"]
        assert isinstance(eta, int), running
        # Set at step `done` from the measured steps: the steps left at the slowest step so far, with room for the
        # final checkpoint and the time between the worker's estimate and this read.
        bound = (STEPS - done) * max(step_times) * 3 + 30
        assert running_read_at - 5 <= eta <= running_read_at + bound, (eta, running_read_at, step_times)

    assert follow.returncode == 0, err
    progress = [line for line in err.splitlines() if re.match(rf"step \d+/{STEPS}\b", line)]
    assert len(progress) == STEPS, err
    assert any(re.search(r"  eta \d+s$", line) for line in progress[:-1]), err

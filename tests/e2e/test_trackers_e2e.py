"""Experiment trackers end to end: ``proxima serve`` with its worker, on a deployment that exports to W&B
(offline mode) and to MLflow (a file store), trains a small job created through the official client with both
integrations; the W&B offline run and the MLflow run then hold the job's metric series exactly as
``GET /v1/fine_tuning/jobs/{id}/metrics`` reports it, its rollouts as ``GET …/rollouts`` reports them, and its
config."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from mlflow.tracking import MlflowClient
from openai import OpenAI

from tests.e2e.conftest import Service, grpo_spec
from tests.e2e.dashboard_support import GRADER, MODEL, DashboardServer, hyperparameters, metrics, upload, wait_job
from tests.tracker_stores import WandbRun, mlflow_histories, wandb_runs
from worker.trackers import rollout_table

STEPS = 3
RESUME_STEPS = 12  # enough that the kill lands mid-job


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, random_model_dir: Path) -> Iterator[DashboardServer]:
    root = tmp_path_factory.mktemp("trackers")
    server = DashboardServer(root, model_dir=random_model_dir)
    server.env |= {
        "PROXIMA_WANDB_MODE": "offline",
        "PROXIMA_WANDB_DIR": str(root / "wandb"),
        "PROXIMA_MLFLOW_TRACKING_URI": (root / "mlruns").as_uri(),
        "WANDB_SILENT": "true",
        "WANDB_CONFIG_DIR": str(root / "wandb-config"),
        "WANDB_CACHE_DIR": str(root / "wandb-cache"),
        "WANDB_DATA_DIR": str(root / "wandb-data"),
    }
    for name in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_BASE_URL", "MLFLOW_TRACKING_URI"):
        server.env.pop(name, None)
    try:
        server.start()
        yield server
    finally:
        server.close()


def wait_for(what: str, check: Any, server: DashboardServer, timeout: float = 60.0) -> Any:
    deadline = time.monotonic() + timeout
    while not (value := check()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}\n{server.logs()}"
        time.sleep(0.3)
    return value


def test_a_jobs_metrics_rollouts_and_config_reach_wandb_offline_and_mlflow_exactly_as_the_api_reports_them(
    server: DashboardServer, arithmetic_data: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # this process reads MLflow's file store back
    key = server.api_key("trackers")
    with server.client(key) as api:
        train, valid = upload(api, arithmetic_data / "train.jsonl"), upload(api, arithmetic_data / "validation.jsonl")
    client = OpenAI(base_url=f"{server.base}/v1", api_key=key, max_retries=0)
    method: Any = {"type": "grpo", "grpo": {"grader": GRADER, "hyperparameters": hyperparameters(steps=STEPS)}}
    integrations: Any = [  # the client's type knows OpenAI's wandb only; it sends ours as it is
        {"type": "wandb", "wandb": {"project": "arith", "name": "e2e", "tags": ["e2e"]}},
        {"type": "mlflow", "mlflow": {"experiment_name": "arith", "tags": {"suite": "e2e"}}},
    ]
    job = client.fine_tuning.jobs.create(
        model=MODEL,
        training_file=train,
        validation_file=valid,
        method=method,
        seed=7,
        integrations=integrations,
    )
    assert [i.type for i in job.integrations or []] == ["wandb", "mlflow"]

    with server.client(key) as api:
        done = wait_job(api, job.id, lambda j: j["status"] == "succeeded", what="success", server=server, timeout=180)
        series = metrics(api, job.id)
        steps_with_rollouts = api.get(f"/fine_tuning/jobs/{job.id}/rollouts").json()["steps"]
        rollouts = {
            s: api.get(f"/fine_tuning/jobs/{job.id}/rollouts", params={"step": s}).json()["data"]
            for s in steps_with_rollouts
        }
        events = api.get(f"/fine_tuning/jobs/{job.id}/events", params={"limit": 100}).json()["data"]
    assert [p["step"] for p in series] == list(range(STEPS + 1))  # step 0: the base policy's validation
    assert steps_with_rollouts == list(range(1, STEPS + 1))
    expected_config = {
        "job_id": job.id,
        "model": MODEL,
        "method": "grpo",
        "training_file": train,
        "validation_file": valid,
        "seed": 7,
        "suffix": None,
        "hyperparameters": done["method"]["grpo"]["hyperparameters"],
        "lora": done["method"]["grpo"]["lora"],
        "grader": done["method"]["grpo"]["grader"],
        "total_steps": STEPS,
    }

    # The worker closes the trackers' runs after recording the job's success.
    mlflow = MlflowClient(tracking_uri=server.env["PROXIMA_MLFLOW_TRACKING_URI"])

    def mlflow_finished() -> Any:
        experiment = mlflow.get_experiment_by_name("arith")
        runs = mlflow.search_runs([experiment.experiment_id]) if experiment is not None else []
        return runs[0] if runs and runs[0].info.status == "FINISHED" else None

    def wandb_finished() -> WandbRun | None:
        runs = wandb_runs(Path(server.env["PROXIMA_WANDB_DIR"]))
        return runs[0] if runs and runs[0].exit_code is not None else None

    run = wait_for("the MLflow run to finish", mlflow_finished, server)
    wb = wait_for("the W&B run to finish", wandb_finished, server)

    # W&B: one offline run named by the job, each step's logged values the API's (null values are not logged)
    assert (wb.run.run_id, wb.run.project, wb.run.display_name) == (job.id, "arith", "e2e")
    assert list(wb.run.tags) == ["proxima/finetune", f"proxima/{MODEL}", f"proxima/{job.id}", "e2e"]
    assert wb.config == expected_config
    assert sorted(wb.history) == [p["step"] for p in series]
    for point in series:
        logged = {k: v for k, v in wb.history[point["step"]].items() if k != "rollouts"}
        assert logged == {k: v for k, v in point["metrics"].items() if v is not None}, point["step"]
    for step, rows in rollouts.items():
        expected = rollout_table(step, [{k: v for k, v in r.items() if k not in ("object", "step")} for r in rows])
        table = wb.table(wb.history[step]["rollouts"])
        assert (table["columns"], table["data"]) == (expected.columns, expected.rows)
        assert {"rewards/sim", "rewards/exact"} <= set(table["columns"])  # the multi grader's sub-graders
    assert wb.exit_code == 0 and wb.summary["status"] == "succeeded"

    # MLflow: the run tagged with the job, every metric's history the API's series, the same config and tables
    assert run.data.tags["proxima.job_id"] == job.id and run.data.tags["suite"] == "e2e"
    histories = mlflow_histories(mlflow, run.info.run_id)
    expected_histories: dict[str, list[tuple[int, float]]] = {}
    for point in series:
        for name, value in point["metrics"].items():
            if value is not None:
                expected_histories.setdefault(name, []).append((point["step"], value))
    assert histories == expected_histories
    assert run.data.params["hyperparameters.learning_rate"] == json.dumps(
        expected_config["hyperparameters"]["learning_rate"]
    )
    assert run.data.params["total_steps"] == str(STEPS)
    for step, rows in rollouts.items():
        expected = rollout_table(step, [{k: v for k, v in r.items() if k not in ("object", "step")} for r in rows])
        path = Path(mlflow.download_artifacts(run.info.run_id, f"rollouts/step-{step:06d}.json"))
        assert json.loads(path.read_text()) == {"columns": expected.columns, "data": expected.rows}

    # no export warning on the job
    assert not [e for e in events if (e.get("data") or {}).get("integration")], events


def tracker_env(root: Path) -> dict[str, str]:
    return {
        "PROXIMA_WANDB_MODE": "offline",
        "PROXIMA_WANDB_DIR": str(root / "wandb"),
        "PROXIMA_MLFLOW_TRACKING_URI": (root / "mlruns").as_uri(),
        "WANDB_SILENT": "true",
        "WANDB_CONFIG_DIR": str(root / "wandb-config"),
    }


def test_a_job_resumed_after_its_worker_was_killed_continues_its_mlflow_run_and_its_wandb_run_id(
    make_service: Callable[..., Service],
    random_model_dir: Path,
    arithmetic_data: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    svc = make_service()
    svc.env |= tracker_env(tmp_path)
    spec = grpo_spec(str(random_model_dir), steps=RESUME_STEPS) | {
        "integrations": [
            {"type": "wandb", "wandb": {"project": "arith", "entity": None, "name": None, "tags": []}},
            {"type": "mlflow", "mlflow": {"experiment_name": "arith", "run_name": None, "tags": {}}},
        ]
    }
    first = svc.start_worker("first")
    job_id = svc.create_job(spec, arithmetic_data)
    svc.send(job_id)
    svc.wait_for("the first worker to claim the job", lambda: svc.job(job_id).lease_owner)
    svc.start_worker("second")
    svc.wait_for("a checkpoint at step 2", lambda: any(c.step_number >= 2 for c in svc.checkpoints(job_id)))
    svc.kill_worker(first)  # the worker, its trainer and its W&B service process, as when a machine dies
    resume_from = max(c.step_number for c in svc.checkpoints(job_id))
    job = svc.wait_status(job_id, "succeeded", "failed", timeout=180)
    assert job.status == "succeeded" and job.attempts == 2, job.error
    series = svc.metrics(job_id)  # what GET …/metrics reports

    mlflow = MlflowClient(tracking_uri=(tmp_path / "mlruns").as_uri())

    def finished() -> Any:
        experiment = mlflow.get_experiment_by_name("arith")
        runs = mlflow.search_runs([experiment.experiment_id]) if experiment is not None else []
        return runs if runs and runs[0].info.status == "FINISHED" else None

    (run,) = svc.wait_for("the MLflow run to finish", finished, timeout=60)  # one run: the second attempt found it
    assert run.data.tags["proxima.job_id"] == job_id and run.info.run_name == job_id
    last: dict[str, dict[int, float]] = {}  # a step trained twice has two values: the later one is the job's
    for name, history in mlflow_histories(mlflow, run.info.run_id).items():
        for step, value in history:
            last.setdefault(name, {})[step] = value
    expected: dict[str, dict[int, float]] = {}
    for step, values in sorted(series.items()):
        for name, value in values.items():
            if value is not None:
                expected.setdefault(name, {})[step] = value
    assert last == expected

    runs = wandb_runs(tmp_path / "wandb", finished_within=60)  # an offline folder per attempt, one run id
    assert runs and {r.run.run_id for r in runs if r.run is not None} == {job_id}
    resumed = runs[-1]  # the killed attempt's may hold nothing: W&B's offline writer had not written it out
    assert resumed.exit_code == 0 and resumed.summary["status"] == "succeeded"
    assert sorted(resumed.history) == sorted(series) and resume_from >= 2  # the steps recorded before, filled in
    for step, values in series.items():
        logged = {k: v for k, v in resumed.history[step].items() if k != "rollouts"}
        assert logged == {k: v for k, v in values.items() if v is not None}, step

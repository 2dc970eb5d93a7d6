"""worker.trackers against the trackers' own local stores, no network: W&B in offline mode (the run's ``.wandb``
transaction log read back record by record, and the rollout tables' files), MLflow on a ``file://`` store (read back
with ``MlflowClient``); and what an unreachable or stalled tracker does to the job (nothing but one warning)."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from mlflow.tracking import MlflowClient

from api.settings import Settings
from tests import tracker_stores
from tests.tracker_stores import WandbRun, mlflow_histories
from trainer.spec.config import JobSpec
from worker import trackers
from worker.trackers import Exporter, flat_params, mlflow_key, rollout_table

JOB = "ftjob-tracked0001"
MODEL = "tiny-arith"
GIVEN: dict[str, Any] = {
    "model": MODEL,
    "training_file": "file-train1",
    "validation_file": "file-valid1",
    "seed": 7,
    "suffix": "exp",
    "method": {
        "type": "grpo",
        "grpo": {
            "grader": {
                "type": "string_check",
                "name": "exact",
                "input": "{{sample.output_text}}",
                "reference": "{{item.answer}}",
                "operation": "eq",
            },
            "hyperparameters": {"learning_rate": 1e-05, "batch_size": 2, "group_size": 4, "beta": 0.0},
            "lora": {"r": 16, "alpha": 32},
        },
    },
    "integrations": [
        {"type": "wandb", "wandb": {"project": "arith", "entity": None, "name": "first try", "tags": ["mine"]}},
        {"type": "mlflow", "mlflow": {"experiment_name": "arith-exp", "run_name": None, "tags": {"team": "rl"}}},
    ],
}
SPEC = JobSpec.from_stored(GIVEN).to_json()  # as the API stores it: every default resolved
HYPERPARAMETERS = SPEC["method"]["grpo"]["hyperparameters"]
METRICS: dict[int, dict[str, float | None]] = {
    0: {"valid/reward/mean": 0.25},
    1: {"reward/mean": 0.5, "kl/mean": 0.0, "loss": -0.125, "grad_norm": None},
    2: {"reward/mean": 0.625, "kl/mean": 0.0009765625, "loss": 0.03125, "grad_norm": 1.5},
    3: {"reward/mean": 0.75, "kl/mean": 0.001953125, "loss": 0.0, "grad_norm": 2.25, "valid/reward/mean": 0.5},
}
ROLLOUTS = [
    {
        "prompt": [{"role": "user", "content": "What is 2 + 2?"}],
        "completion": "4",
        "reward": 1.0,
        "rewards": {"exact": 1.0},
        "advantage": 0.5,
        "length": 2,
    },
    {
        "prompt": [{"role": "user", "content": "What is 2 + 2?"}],
        "completion": "5",
        "reward": 0.0,
        "rewards": {"exact": 0.0},
        "advantage": -0.5,
        "length": 2,
    },
]
CONFIG = {
    "job_id": JOB,
    "model": MODEL,
    "method": "grpo",
    "training_file": "file-train1",
    "validation_file": "file-valid1",
    "seed": 7,
    "suffix": "exp",
    "hyperparameters": HYPERPARAMETERS,
    "lora": {"r": 16, "alpha": 32.0, "dropout": 0.0, "target_modules": "all-linear"},
    "grader": GIVEN["method"]["grpo"]["grader"],
}


@pytest.fixture(scope="module", autouse=True)
def wandb_service_ends_with_the_module() -> Iterator[None]:
    """W&B's service process, which these tests start in this process: ``wandb.init`` also puts its address in
    ``os.environ`` (WANDB_SERVICE) for child processes to join. Torn down after the module, so that the processes a
    later test starts here (an e2e test's workers, under pytest-xdist) start their own: joined to this one, a worker
    killed by a test would leave its run open in it, and the job's next attempt would write into that run."""
    yield
    import wandb

    wandb.teardown()


@pytest.fixture(autouse=True)
def quiet_trackers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """W&B's and MLflow's own files and settings in temporary folders; nothing reaches a network."""
    for name in ("WANDB_DIR", "WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(name, str(tmp_path / "wandb-env" / name.lower()))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DISABLE_GIT", "true")
    for name in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_BASE_URL", "MLFLOW_TRACKING_URI", "MLFLOW_TRACKING_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")  # an unreachable server fails at once
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # for the reading client (the tracker sets it itself)


def settings_for(tmp_path: Path, **values: Any) -> Settings:
    base: dict[str, Any] = {
        "home": tmp_path / "home",
        "wandb_mode": "offline",
        "wandb_dir": tmp_path / "wandb",
        "mlflow_tracking_uri": (tmp_path / "mlruns").as_uri(),
    }
    return Settings(**(base | values))


WANDB_ONLY = {**SPEC, "integrations": SPEC["integrations"][:1]}
MLFLOW_ONLY = {**SPEC, "integrations": SPEC["integrations"][1:]}


def wandb_runs(settings: Settings) -> list[WandbRun]:
    return tracker_stores.wandb_runs(trackers.wandb_dir(settings))


def shown(values: dict[str, float | None]) -> dict[str, float]:
    return {k: v for k, v in values.items() if v is not None}


def table_rows() -> tuple[list[str], list[list[Any]]]:
    columns = ["step", "sample", "prompt", "completion", "reward", "advantage", "length", "rewards/exact"]
    prompt = json.dumps([{"role": "user", "content": "What is 2 + 2?"}])
    return columns, [[0, 0, prompt, "4", 1.0, 0.5, 2, 1.0], [0, 1, prompt, "5", 0.0, -0.5, 2, 0.0]]


def at_step(rows: list[list[Any]], step: int) -> list[list[Any]]:
    return [[step, *row[1:]] for row in rows]


# -- W&B ---------------------------------------------------------------------------------------------------------


def test_wandb_offline_run_holds_every_steps_metrics_the_config_and_rollout_tables(tmp_path: Path) -> None:
    settings = settings_for(tmp_path, mlflow_tracking_uri=None)
    exporter = export_job(settings, [0, 1, 2, 3], spec=WANDB_ONLY)
    assert exporter.failures == {} and exporter.events() == []

    (run,) = wandb_runs(settings)
    assert (run.run.run_id, run.run.project, run.run.display_name) == (JOB, "arith", "first try")
    assert list(run.run.tags) == ["proxima/finetune", f"proxima/{MODEL}", f"proxima/{JOB}", "mine"]
    assert run.config == CONFIG | {"total_steps": 3}
    given = {k: run.config["hyperparameters"][k] for k in ("learning_rate", "batch_size", "group_size", "beta")}
    assert given == {"learning_rate": 1e-05, "batch_size": 2, "group_size": 4, "beta": 0.0}
    assert sorted(run.history) == [0, 1, 2, 3]
    for step, values in METRICS.items():
        assert {k: v for k, v in run.history[step].items() if k != "rollouts"} == shown(values)
    columns, rows = table_rows()
    for step in (1, 2, 3):
        assert run.history[step]["rollouts"]["nrows"] == 2
        table = run.table(run.history[step]["rollouts"])
        assert table["columns"] == columns and table["data"] == at_step(rows, step)
    assert run.summary["status"] == "succeeded" and run.exit_code == 0


def test_a_failed_job_ends_its_wandb_run_with_exit_code_1(tmp_path: Path) -> None:
    settings = settings_for(tmp_path, mlflow_tracking_uri=None)
    export_job(settings, [0, 1], spec=WANDB_ONLY, outcome="failed")
    (run,) = wandb_runs(settings)
    assert run.exit_code == 1 and run.summary["status"] == "failed"


# -- MLflow ------------------------------------------------------------------------------------------------------


def mlflow_run(settings: Settings) -> tuple[MlflowClient, Any]:
    client = MlflowClient(tracking_uri=settings.mlflow_tracking_uri)
    experiment = client.get_experiment_by_name("arith-exp")
    assert experiment is not None
    (run,) = client.search_runs([experiment.experiment_id])
    return client, run


def expected_histories(steps: list[int]) -> dict[str, list[tuple[int, float]]]:
    out: dict[str, list[tuple[int, float]]] = {}
    for step in steps:
        for k, v in shown(METRICS[step]).items():
            out.setdefault(k, []).append((step, v))
    return out


def test_mlflow_file_store_holds_the_metric_histories_params_and_rollout_artifacts(tmp_path: Path) -> None:
    settings = settings_for(tmp_path, wandb_mode="online")  # no W&B key: W&B is not configured
    exporter = export_job(settings, [0, 1, 2, 3], spec=MLFLOW_ONLY)
    assert exporter.failures == {} and exporter.events() == []

    client, run = mlflow_run(settings)
    assert run.info.status == "FINISHED" and run.info.run_name == JOB
    assert {k: v for k, v in run.data.tags.items() if not k.startswith("mlflow.")} == {
        "team": "rl",
        "proxima.job_id": JOB,
        "proxima.model": MODEL,
        "proxima.status": "succeeded",
    }
    assert mlflow_histories(client, run.info.run_id) == expected_histories([0, 1, 2, 3])
    assert run.data.params == {
        "job_id": JOB,
        "model": MODEL,
        "method": "grpo",
        "training_file": "file-train1",
        "validation_file": "file-valid1",
        "seed": "7",
        "suffix": "exp",
        **{f"hyperparameters.{k}": v if isinstance(v, str) else json.dumps(v) for k, v in HYPERPARAMETERS.items()},
        "lora.r": "16",
        "lora.alpha": "32.0",
        "lora.dropout": "0.0",
        "lora.target_modules": "all-linear",
        "grader.type": "string_check",
        "grader.name": "exact",
        "grader.input": "{{sample.output_text}}",
        "grader.reference": "{{item.answer}}",
        "grader.operation": "eq",
        "total_steps": "3",
    }
    artifacts = Path(client.download_artifacts(run.info.run_id, "", str(tmp_path / "download")))
    assert json.loads((artifacts / "config.json").read_text()) == CONFIG
    columns, rows = table_rows()
    assert sorted(p.name for p in (artifacts / "rollouts").iterdir()) == [f"step-00000{s}.json" for s in (1, 2, 3)]
    for step in (1, 2, 3):
        table = json.loads((artifacts / "rollouts" / f"step-00000{step}.json").read_text())
        assert table == {"columns": columns, "data": at_step(rows, step)}


# -- resuming ----------------------------------------------------------------------------------------------------


def export_job(
    settings: Settings,
    steps: list[int],
    *,
    spec: dict[str, Any] = SPEC,
    outcome: str = "succeeded",
    resumed_from: int = 0,
) -> Exporter:
    """One attempt's exports, as the worker makes them: on a resume the steps recorded up to the checkpoint, then
    the run's length, then each step's metrics and (training steps) its rollouts, as the trainer sends them."""
    exporter = trackers.start(settings, job_id=JOB, model=MODEL, spec=JobSpec.from_stored(spec))
    if resumed_from:
        exporter.backfill([(step, METRICS[step]) for step in range(resumed_from + 1)])
    exporter.config({"total_steps": 3})
    for step in steps:
        exporter.metrics(step, METRICS[step])
        if step:
            exporter.rollouts(step, ROLLOUTS)
    exporter.close(outcome)
    return exporter


def first_attempt(settings: Settings, steps: list[int]) -> None:
    """An attempt that sent these steps and then lost the database (its runs are left open for the next one)."""
    first = trackers.start(settings, job_id=JOB, model=MODEL, spec=JobSpec.from_stored(SPEC))
    for step in steps:
        first.metrics(step, METRICS[step])
    first.close("abandoned")


def test_a_resumed_job_continues_its_wandb_run_and_its_mlflow_run(tmp_path: Path) -> None:
    """The first attempt sent steps 0 to 2; the next resumes from the checkpoint at step 1 and trains steps 2 and 3
    again."""
    settings = settings_for(tmp_path)
    first_attempt(settings, [0, 1, 2])
    client, run = mlflow_run(settings)
    assert run.info.status == "RUNNING"

    assert export_job(settings, [2, 3], resumed_from=1).failures == {}

    client, again = mlflow_run(settings)  # still the one run of the experiment
    assert again.info.run_id == run.info.run_id and again.info.status == "FINISHED"
    expected = expected_histories([0, 1, 2, 2, 3])  # the step trained twice has both values in MLflow's history
    assert mlflow_histories(client, run.info.run_id) == expected

    runs = wandb_runs(settings)  # one offline folder per attempt, of the same run: `wandb sync` appends the second
    assert [r.run.run_id for r in runs] == [JOB, JOB]
    assert sorted(runs[0].history) == [0, 1, 2]
    assert sorted(runs[1].history) == [0, 1, 2, 3]  # an offline run knows of no earlier step: it gets them all
    for step, values in METRICS.items():
        assert {k: v for k, v in runs[1].history[step].items() if k != "rollouts"} == shown(values)
    assert [r.summary["status"] for r in runs] == ["abandoned", "succeeded"]


def test_a_resumed_job_fills_in_the_recorded_steps_a_killed_attempt_never_sent(tmp_path: Path) -> None:
    """The first attempt sent step 0 only (steps 1 and 2 were in its queue when it was killed); the next resumes from
    the checkpoint at step 2: the MLflow run gets steps 1 and 2 from the job's records, once each."""
    settings = settings_for(tmp_path, wandb_mode="online")
    first_attempt(settings, [0])

    export_job(settings, [3], spec=MLFLOW_ONLY, resumed_from=2)

    client, run = mlflow_run(settings)
    assert mlflow_histories(client, run.info.run_id) == expected_histories([0, 1, 2, 3])


# -- outages -----------------------------------------------------------------------------------------------------


@pytest.fixture
def silent_server() -> Iterator[str]:
    """A server that accepts connections and never answers: a tracker that hangs."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    accepted: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        server.settimeout(0.1)
        while not stop.is_set():
            try:
                accepted.append(server.accept()[0])
            except TimeoutError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.getsockname()[1]}"
    stop.set()
    thread.join()
    for conn in accepted:
        conn.close()
    server.close()


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_an_unreachable_tracker_is_one_warning_and_the_exports_go_on_without_it(tmp_path: Path) -> None:
    settings = settings_for(tmp_path, mlflow_tracking_uri=f"http://127.0.0.1:{closed_port()}", wandb_mode="online")
    exporter = trackers.start(settings, job_id=JOB, model=MODEL, spec=JobSpec.from_stored(MLFLOW_ONLY))
    for step in (0, 1, 2, 3):
        exporter.metrics(step, METRICS[step])
    exporter.close("succeeded")
    events = exporter.events()
    assert [e.data for e in events] == [{"integration": "mlflow", "failure": "start"}]
    assert events[0].message.startswith("MLflow export: could not start the run, so this attempt exports nothing")
    assert "The job goes on" in events[0].message
    assert exporter.failures == {("mlflow", "start"): 1}


@pytest.mark.alone  # "never blocks" is timed: the calls return at once, the close within its timeout
def test_a_stalled_tracker_never_blocks_the_worker_drops_beyond_its_queue_and_is_given_up_at_close(
    tmp_path: Path, silent_server: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "60")
    settings = settings_for(
        tmp_path,
        mlflow_tracking_uri=silent_server,
        wandb_mode="online",
        tracker_queue_size=2,
        tracker_close_timeout_s=1.0,
    )
    began = time.monotonic()
    exporter = trackers.start(settings, job_id=JOB, model=MODEL, spec=JobSpec.from_stored(MLFLOW_ONLY))
    for step in range(40):  # the tracker's thread is stuck starting its run: two wait, the others are dropped
        exporter.metrics(step, {"reward/mean": step / 40})
        exporter.rollouts(step, ROLLOUTS)
    assert time.monotonic() - began < 1.0
    dropped = exporter.events()
    assert [e.data for e in dropped] == [{"integration": "mlflow", "failure": "dropped"}]
    assert dropped[0].message.startswith("MLflow export: it is behind: the metrics of step 1 and later exports")
    assert exporter.failures == {("mlflow", "dropped"): 78}

    began = time.monotonic()
    exporter.close("succeeded")
    assert time.monotonic() - began < 2.0
    (timeout,) = exporter.events()
    assert timeout.data == {"integration": "mlflow", "failure": "timeout"}
    assert timeout.message.startswith("MLflow export: did not finish within 1 s of the job's end")


def test_a_tracker_the_deployment_no_longer_configures_is_skipped_with_a_warning(tmp_path: Path) -> None:
    settings = settings_for(tmp_path, wandb_mode="online", mlflow_tracking_uri=None)
    exporter = trackers.start(settings, job_id=JOB, model=MODEL, spec=JobSpec.from_stored(SPEC))
    assert not exporter
    assert [(e.message, e.data) for e in exporter.events()] == [
        (
            "W&B export skipped: this deployment no longer exports to it",
            {"integration": "wandb", "failure": "not_configured"},
        ),
        (
            "MLflow export skipped: this deployment no longer exports to it",
            {"integration": "mlflow", "failure": "not_configured"},
        ),
    ]
    exporter.close("succeeded")
    # no run was opened: nothing to wait for (wandb_runs waits for a run's exit record)
    assert not (trackers.wandb_dir(settings) / "wandb").exists() and not (tmp_path / "mlruns").exists()


# -- what is exported, pure ---------------------------------------------------------------------------------------


def test_rollout_table_has_a_column_per_field_and_per_grader_and_json_prompts() -> None:
    rollouts = [
        {
            "prompt": [{"role": "user", "content": "1+1?"}],
            "completion": "2",
            "reward": 1.0,
            "rewards": {"b": 1.0, "a": 0.5},
            "length": 1,
        },
        {"prompt": "plain", "completion": "3", "reward": 0.0, "rewards": {"a": 0.0}, "advantage": -1.0},
    ]
    table = rollout_table(7, rollouts)
    assert table.columns == [
        "step",
        "sample",
        "prompt",
        "completion",
        "reward",
        "advantage",
        "length",
        "rewards/a",
        "rewards/b",
    ]
    assert table.rows == [
        [7, 0, '[{"role": "user", "content": "1+1?"}]', "2", 1.0, None, 1, 0.5, 1.0],
        [7, 1, "plain", "3", 0.0, -1.0, None, 0.0, None],
    ]


def test_flat_params_join_nested_keys_and_cut_long_values() -> None:
    config = {"a": {"b": {"c": 1}, "d": [1, 2], "e": None, "f": {}}, "g": "x" * 7000, "h": True}
    assert flat_params(config) == {
        "a.b.c": "1",
        "a.d": "[1, 2]",
        "a.e": "null",
        "a.f": "{}",
        "g": "x" * 6000,
        "h": "true",
    }


@pytest.mark.parametrize(
    ("name", "key"),
    [
        ("reward/mean", "reward/mean"),
        ("reward/sim+exact", "reward/sim_exact"),
        ("a//b", "a/_/b"),
        ("../x", "_/x"),
        ("/lead", "_/lead"),
        ("ok name:1.5-x", "ok name:1.5-x"),
    ],
)
def test_mlflow_key_keeps_valid_names_and_replaces_what_mlflow_refuses(name: str, key: str) -> None:
    assert mlflow_key(name) == key

"""Export a job to the experiment trackers its ``integrations`` name: Weights & Biases and MLflow.

What a tracker's run gets: the job's config (its model, method, files and the method's hyperparameters, LoRA and
grader as resolved at creation: :func:`job_config`), every step's metrics as the trainer reports them (the series
``GET /v1/fine_tuning/jobs/{id}/metrics`` shows, at the same steps), and each step's sampled rollouts as a table
(prompt, completion, reward, the record's other fields and one ``rewards/<grader>`` column per grader:
:func:`rollout_table`). W&B gets them as ``run.config``, ``run.log(metrics, step=step)`` and a ``wandb.Table`` under
``rollouts``; MLflow as parameters (flattened, ``hyperparameters.learning_rate``) and a ``config.json`` artifact,
metrics with their step, and a ``rollouts/step-NNNNNN.json`` artifact per step in the layout of MLflow's
``log_table`` (``{"columns": [...], "data": [[...], ...]}``).

It runs in the worker process, off the training path: the worker hands each message's content to an
:class:`Exporter` as it arrives, and each tracker has a thread of its own that sends it, behind a bounded queue
(``tracker_queue_size``). A slow or unreachable tracker so never delays the job's database writes or its lease
renewal: when its queue is full, further exports to it are dropped. Nor does it ever fail the job: each failure is
logged, and the first of each kind (the run could not start, a step's metrics could not be sent, exports dropped, ...)
becomes one warning event of the job (:meth:`Exporter.events`). At the job's end the worker waits up to
``tracker_close_timeout_s`` for the trackers to send what they hold and close their runs.

An attempt that resumes a job (after a killed worker, a pause) continues the same run: W&B's run id is the job's id
(``resume="allow"``), MLflow's run is the experiment's run tagged ``proxima.job_id``. It first sends the steps
recorded up to its checkpoint that the run lacks (:meth:`Exporter.backfill`: what a killed attempt still held in its
queue, or W&B's offline writer had not yet written out, is not lost). Steps that the resumed attempt trains again are
sent again: MLflow keeps both values of such a step in its history, a W&B server the first (a run's history cannot go
back), and an offline W&B run's folder for the new attempt has the job's series from its first step.

The tracker's address and credentials are the deployment's (``PROXIMA_WANDB_*``, ``PROXIMA_MLFLOW_*``), never the
job's. ``wandb`` and ``mlflow`` (``mlflow-skinny``) are the ``train`` extra's, imported by the export threads only.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import queue
import re
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from api.services.integrations import configured
from api.settings import Settings
from api.status import JobStatus
from trainer.spec.config import JobSpec
from trainer.spec.integrations import MlflowIntegration, WandbIntegration, block_of

log = logging.getLogger("proxima.worker.trackers")

MLFLOW_JOB_TAG = "proxima.job_id"
"""The tag that finds a job's MLflow run again when another attempt resumes the job."""
MLFLOW_STATUS_TAG = "proxima.status"
ROLLOUTS_KEY = "rollouts"
"""The W&B history key of the rollout tables; MLflow's artifacts are ``rollouts/step-NNNNNN.json``."""
_WANDB_TAG_MAX = 64
_MLFLOW_KEY_MAX = 250
_MLFLOW_PARAM_MAX = 6000  # MLflow's limit on a parameter's value; the whole config is in config.json as well
_MLFLOW_PARAMS_PER_BATCH = 100
_MLFLOW_BAD = re.compile(r"[^\w.\- :]")
_DETAIL_CHARS = 300
LABELS = {"wandb": "W&B", "mlflow": "MLflow"}


@dataclass(frozen=True)
class TrackerEvent:
    """A warning for the job's events: ``data`` names the integration and the kind of failure."""

    message: str
    data: dict[str, Any]


@dataclass(frozen=True)
class RolloutTable:
    columns: list[str]
    rows: list[list[Any]]


# -- what is exported ---------------------------------------------------------------------------------------------


def job_config(*, job_id: str, model: str, spec: JobSpec) -> dict[str, Any]:
    """A run's config: the job, its base model, method and files, and the method's hyperparameters, LoRA and grader
    as the job's spec holds them (every default resolved when the job was created)."""
    method = spec.method.to_json()[spec.method.type]
    config: dict[str, Any] = {
        "job_id": job_id,
        "model": model,
        "method": spec.method.type,
        "training_file": spec.training_file,
        "validation_file": spec.validation_file,
        "seed": spec.seed,
        "suffix": spec.suffix,
        "hyperparameters": method["hyperparameters"],
        "lora": method["lora"],
    }
    if "grader" in method:
        config["grader"] = method["grader"]
    return config


def _cell(value: Any) -> Any:
    """A table cell: a number, string, bool or null as it is; anything else (a prompt's messages) as JSON text."""
    if value is None or isinstance(value, str | int | float | bool):
        return value
    return json.dumps(value, ensure_ascii=False)


def rollout_table(step: int, rollouts: Sequence[Mapping[str, Any]]) -> RolloutTable:
    """One row per sampled rollout of the step: ``step``, ``sample`` (its index in the step), ``prompt`` (the messages
    as JSON), ``completion``, ``reward``, the record's other fields by name (``advantage``, ``length``, ...) and one
    ``rewards/<grader>`` column per grader of the records' ``rewards``."""
    lead = ["prompt", "completion", "reward"]
    others = sorted({k for r in rollouts for k in r} - {*lead, "rewards", "step"})
    graders = sorted({str(g) for r in rollouts for g in (r.get("rewards") or {})})
    columns = ["step", "sample", *lead, *others, *(f"rewards/{g}" for g in graders)]
    rows = [
        [
            step,
            i,
            *(_cell(r.get(k)) for k in (*lead, *others)),
            *(_cell((r.get("rewards") or {}).get(g)) for g in graders),
        ]
        for i, r in enumerate(rollouts)
    ]
    return RolloutTable(columns, rows)


def present(values: Mapping[str, float | None]) -> dict[str, float]:
    """A step's metrics without those it lacks (``null``: a value JSON cannot hold)."""
    return {k: float(v) for k, v in values.items() if v is not None}


def mlflow_key(name: str) -> str:
    """A metric or parameter name MLflow takes: letters, digits, spaces and ``_ - . :`` between slashes, no empty,
    ``.`` or ``..`` part (``reward/mean`` stays as it is)."""
    parts = [_MLFLOW_BAD.sub("_", p) for p in name.split("/")]
    return "/".join("_" if p in ("", ".", "..") else p for p in parts)[:_MLFLOW_KEY_MAX]


def flat_params(config: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """The config as MLflow parameters: nested keys joined with dots (``hyperparameters.learning_rate``), values as
    text (strings as they are, anything else as JSON), cut to MLflow's limit."""
    out: dict[str, str] = {}
    for key, value in config.items():
        name = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(value, Mapping) and value:
            out.update(flat_params(value, name))
        else:
            text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
            out[mlflow_key(name)] = text[:_MLFLOW_PARAM_MAX]
    return out


# -- trackers -----------------------------------------------------------------------------------------------------


class Tracker(ABC):
    """One run in one tracker; its methods are called by its export thread only, in order: ``open`` first, ``close``
    last."""

    kind: ClassVar[str]

    def __init__(self, settings: Settings, *, job_id: str, model: str, block: Any, config: dict[str, Any]) -> None:
        """``block``: the integration's settings (``trainer.spec.integrations``); ``config``: :func:`job_config`."""
        self.settings, self.job_id, self.model, self.block, self.initial = settings, job_id, model, block, config

    @abstractmethod
    def open(self) -> None:
        """Start the run, or continue the job's run when an earlier attempt started it; log the config."""

    @abstractmethod
    def config(self, values: Mapping[str, Any]) -> None:
        """Add to the run's config (the run's length, once the trainer knows it)."""

    @abstractmethod
    def metrics(self, step: int, values: Mapping[str, float]) -> None: ...

    @abstractmethod
    def rollouts(self, step: int, table: RolloutTable) -> None: ...

    def held_step(self) -> int:
        """The latest step whose metrics the run holds already (-1: none, or not known)."""
        return -1

    def backfill(self, rows: Sequence[tuple[int, Mapping[str, float]]]) -> None:
        """A resumed job's recorded steps that the run lacks: those after the latest it holds."""
        held = self.held_step()
        for step, values in rows:
            if step > held:
                self.metrics(step, values)

    @abstractmethod
    def close(self, outcome: str) -> None:
        """End the run with the attempt's outcome (a job status, or ``lost``/``abandoned``: another attempt goes on)."""


class WandbTracker(Tracker):
    """A ``wandb`` run: ``entity/project``, named ``name`` or the job id, with OpenAI's kind of default tags."""

    kind = "wandb"

    block: WandbIntegration
    run: Any = None

    def tags(self) -> list[str]:
        defaults = ["proxima/finetune", f"proxima/{self.model}", f"proxima/{self.job_id}"]
        return list(dict.fromkeys(t[:_WANDB_TAG_MAX] for t in (*defaults, *(self.block.tags or []))))

    def open(self) -> None:
        import wandb

        s = self.settings
        root = wandb_dir(s)
        root.mkdir(parents=True, exist_ok=True)
        # W&B's staging copies (an offline run's tables wait there for `wandb sync`) and cache, beside its runs
        # rather than in the worker's home; read by W&B from the environment only, so set there (unless set).
        os.environ.setdefault("WANDB_DATA_DIR", str(root / "data"))
        os.environ.setdefault("WANDB_CACHE_DIR", str(root / "cache"))
        settings = wandb.Settings(
            api_key=s.wandb_api_key.get_secret_value() if s.wandb_api_key else None,
            silent=True,
            console="off",  # the worker's own output is not the job's
            x_disable_stats=True,  # nor is the worker machine's load
            x_disable_meta=True,
            disable_git=True,
            disable_code=True,
            save_code=False,
        )
        if s.wandb_base_url:
            settings.base_url = s.wandb_base_url
        self.run = wandb.init(
            project=self.block.project,
            entity=self.block.entity,
            name=self.block.name or self.job_id,
            tags=self.tags(),
            id=self.job_id,
            resume="allow",
            dir=str(root),
            config=self.initial,
            mode=s.wandb_mode,
            reinit="create_new",  # one run per job, and this worker's next job another one
            settings=settings,
        )

    def held_step(self) -> int:
        # A run resumed from W&B's server continues after its latest step; an offline run knows of none.
        return int(self.run.step) - 1

    def config(self, values: Mapping[str, Any]) -> None:
        self.run.config.update(dict(values), allow_val_change=True)

    def metrics(self, step: int, values: Mapping[str, float]) -> None:
        self.run.log(dict(values), step=step)

    def rollouts(self, step: int, table: RolloutTable) -> None:
        import wandb

        columns: list[str | int] = list(table.columns)
        self.run.log({ROLLOUTS_KEY: wandb.Table(columns=columns, data=table.rows)}, step=step)

    def close(self, outcome: str) -> None:
        self.run.summary["status"] = str(outcome)
        self.run.finish(exit_code=1 if outcome == JobStatus.FAILED else 0)


_MLFLOW_STATUS = {
    JobStatus.SUCCEEDED: "FINISHED",
    JobStatus.FAILED: "FAILED",
    JobStatus.CANCELLED: "KILLED",
    JobStatus.PAUSED: "KILLED",  # stopped on the user's request; resuming the job sets it RUNNING again
}


class MlflowTracker(Tracker):
    """A run of the experiment ``experiment_name`` (created when missing), named ``run_name`` or the job id."""

    kind = "mlflow"

    block: MlflowIntegration
    client: Any = None
    run_id = ""

    def open(self) -> None:
        from mlflow.tracking import MlflowClient

        s = self.settings
        if s.mlflow_tracking_token is not None:  # read from the environment by MLflow's REST client, at each request
            os.environ["MLFLOW_TRACKING_TOKEN"] = s.mlflow_tracking_token.get_secret_value()
        if str(s.mlflow_tracking_uri).startswith("file:"):  # MLflow 3 asks for this to use its (maintained) file store
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.client = client = MlflowClient(tracking_uri=s.mlflow_tracking_uri)
        experiment = self._experiment(self.block.experiment_name)
        found = client.search_runs(
            [experiment], filter_string=f"tags.`{MLFLOW_JOB_TAG}` = '{self.job_id}'", max_results=1
        )
        if found:
            self.run_id = found[0].info.run_id
            client.update_run(self.run_id, status="RUNNING")
        else:
            tags = {**(self.block.tags or {}), MLFLOW_JOB_TAG: self.job_id, "proxima.model": self.model}
            run = client.create_run(experiment, run_name=self.block.run_name or self.job_id, tags=tags)
            self.run_id = run.info.run_id
        self._params(self.initial)
        client.log_dict(self.run_id, self.initial, "config.json")

    def _experiment(self, name: str) -> str:
        """The experiment's id, creating it if missing (another worker may create it at the same time)."""
        from mlflow.exceptions import MlflowException

        found = self.client.get_experiment_by_name(name)
        if found is not None:
            return str(found.experiment_id)
        try:
            return str(self.client.create_experiment(name))
        except MlflowException:
            found = self.client.get_experiment_by_name(name)
            if found is None:
                raise
            return str(found.experiment_id)

    def _params(self, config: Mapping[str, Any]) -> None:
        from mlflow.entities import Param

        params = [Param(k, v) for k, v in flat_params(config).items()]
        for i in range(0, len(params), _MLFLOW_PARAMS_PER_BATCH):
            self.client.log_batch(self.run_id, params=params[i : i + _MLFLOW_PARAMS_PER_BATCH])

    def held_step(self) -> int:
        names = self.client.get_run(self.run_id).data.metrics
        steps = (m.step for name in names for m in self.client.get_metric_history(self.run_id, name))
        return max(steps, default=-1)

    def config(self, values: Mapping[str, Any]) -> None:
        self._params(values)

    def metrics(self, step: int, values: Mapping[str, float]) -> None:
        from mlflow.entities import Metric

        at = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(mlflow_key(k), v, at, step) for k, v in values.items()])

    def rollouts(self, step: int, table: RolloutTable) -> None:
        data = {"columns": table.columns, "data": table.rows}
        self.client.log_dict(self.run_id, data, f"{ROLLOUTS_KEY}/step-{step:06d}.json")

    def close(self, outcome: str) -> None:
        self.client.set_tag(self.run_id, MLFLOW_STATUS_TAG, outcome)
        if outcome in _MLFLOW_STATUS:  # lost, abandoned: another attempt continues the run
            self.client.set_terminated(self.run_id, status=_MLFLOW_STATUS[JobStatus(outcome)])


TRACKERS: dict[str, type[Tracker]] = {"wandb": WandbTracker, "mlflow": MlflowTracker}


def wandb_dir(settings: Settings) -> Path:
    """Where W&B writes its run files (an offline run's for ``wandb sync``): ``wandb/`` under it."""
    return settings.wandb_dir or settings.home / "wandb"


# -- the export threads -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Export:
    kind: str  # metrics | rollouts | config: the kind of failure it reports
    what: str  # "the metrics of step 5"
    send: Callable[[Tracker], None]


_CLOSE = _Export("close", "close", lambda _: None)


class _Sink:
    """One tracker's thread and bounded queue. ``failed(tracker, kind, what, err)`` reports a failure."""

    def __init__(
        self, tracker: Tracker, *, size: int, failed: Callable[[Tracker, str, str, BaseException | None], None]
    ) -> None:
        self.tracker, self.size, self.failed = tracker, size, failed
        self.queue: queue.Queue[_Export] = queue.Queue(maxsize=size)
        self.outcome = "abandoned"
        self.closed = threading.Event()  # set by close(): the thread ends once the queue is empty
        self.thread = threading.Thread(target=self._loop, name=f"proxima-export-{tracker.kind}", daemon=True)
        self.thread.start()

    def put(self, export: _Export) -> None:
        try:
            self.queue.put_nowait(export)
        except queue.Full:
            self.failed(self.tracker, "dropped", f"it is behind: {export.what} and later exports were dropped", None)

    def _loop(self) -> None:
        t = self.tracker
        try:
            t.open()
            ready = True
        except Exception as err:
            self.failed(t, "start", "could not start the run, so this attempt exports nothing to it", err)
            ready = False
        while True:
            try:
                export = self.queue.get(timeout=1.0)
            except queue.Empty:
                if self.closed.is_set():
                    break
                continue
            if export is _CLOSE:
                break
            if ready:
                try:
                    export.send(t)
                except Exception as err:
                    self.failed(t, export.kind, f"{export.what} could not be sent", err)
        if ready:
            try:
                t.close(self.outcome)
            except Exception as err:
                self.failed(t, "finish", "could not finish the run", err)

    def close(self, outcome: str, *, deadline: float) -> bool:
        """Send what is queued, then close the run; False when that did not end by ``deadline`` (monotonic)."""
        self.outcome = outcome
        self.closed.set()
        with contextlib.suppress(queue.Full):  # a full queue: the thread sees `closed` once it has emptied it
            self.queue.put_nowait(_CLOSE)
        self.thread.join(max(deadline - time.monotonic(), 0.0))
        return not self.thread.is_alive()


class Exporter:
    """A job's trackers for one attempt. Its methods return at once; the export threads start with it."""

    def __init__(
        self,
        trackers: Sequence[Tracker],
        *,
        job_id: str,
        queue_size: int = 1000,
        close_timeout_s: float = 120.0,
        secrets: Sequence[str] = (),
    ) -> None:
        self.job_id, self.close_timeout_s = job_id, close_timeout_s
        self.secrets = [s for s in secrets if s]
        self.failures: dict[tuple[str, str], int] = {}
        """(integration, kind of failure) → how many times it happened."""
        self._events: list[TrackerEvent] = []
        self._lock = threading.Lock()
        self._sinks = [_Sink(t, size=queue_size, failed=self._failed) for t in trackers]

    def __bool__(self) -> bool:
        return bool(self._sinks)

    def _put(self, kind: str, what: str, send: Callable[[Tracker], None]) -> None:
        for sink in self._sinks:
            sink.put(_Export(kind, what, send))

    def config(self, values: Mapping[str, Any]) -> None:
        values = dict(values)
        self._put("config", "the config", lambda t: t.config(values))

    def metrics(self, step: int, values: Mapping[str, float | None]) -> None:
        if self._sinks and (shown := present(values)):
            self._put("metrics", f"the metrics of step {step}", lambda t: t.metrics(step, shown))

    def backfill(self, rows: Sequence[tuple[int, Mapping[str, float | None]]]) -> None:
        """A resumed attempt's first export: the metrics recorded up to its checkpoint (``rows``, by step), of which
        each run gets those it lacks (what an attempt killed before its trackers sent it, or W&B's offline writer
        had not written out, never reached it)."""
        recorded = [(step, shown) for step, values in rows if (shown := present(values))]
        if self._sinks and recorded:
            what = f"the metrics of steps {recorded[0][0]} to {recorded[-1][0]} (recorded before the resume)"
            self._put("metrics", what, lambda t: t.backfill(recorded))

    def rollouts(self, step: int, rollouts: Sequence[Mapping[str, Any]]) -> None:
        if self._sinks and rollouts:
            table = rollout_table(step, rollouts)
            self._put("rollouts", f"the rollouts of step {step}", lambda t: t.rollouts(step, table))

    def warn(self, integration: str, kind: str, message: str) -> None:
        """A warning of this exporter's (not a tracker's failure), e.g. a tracker the deployment no longer has."""
        with self._lock:
            self.failures[(integration, kind)] = self.failures.get((integration, kind), 0) + 1
            self._events.append(TrackerEvent(message, {"integration": integration, "failure": kind}))

    def events(self) -> list[TrackerEvent]:
        """The warnings not yet taken (the worker writes them as the job's events)."""
        with self._lock:
            out, self._events = self._events, []
        return out

    def close(self, outcome: str) -> None:
        """Send what is queued and close the runs, all within ``close_timeout_s``; a tracker still busy then is left
        to its thread (what it had not sent is lost) and reported."""
        deadline = time.monotonic() + self.close_timeout_s
        for sink in self._sinks:
            if not sink.close(outcome, deadline=deadline):
                what = f"did not finish within {self.close_timeout_s:g} s of the job's end (what it held is lost)"
                self._failed(sink.tracker, "timeout", what, None)
        for (integration, kind), n in sorted(self.failures.items()):
            if n > 1:
                log.warning("job %s: %s export: %d failures of kind %s", self.job_id, LABELS[integration], n, kind)

    def _failed(self, tracker: Tracker, kind: str, what: str, err: BaseException | None) -> None:
        label = LABELS[tracker.kind]
        detail = f" ({self._scrub(err)})" if err is not None else ""
        log.warning("job %s: %s export: %s%s", self.job_id, label, what, detail, exc_info=err)
        key = (tracker.kind, kind)
        with self._lock:
            self.failures[key] = n = self.failures.get(key, 0) + 1
            if n == 1:
                message = f"{label} export: {what}{detail}. The job goes on; later such failures are not reported"
                self._events.append(TrackerEvent(message, {"integration": tracker.kind, "failure": kind}))

    def _scrub(self, err: BaseException) -> str:
        """The error in one line, without the deployment's credentials."""
        text = " ".join(f"{type(err).__name__}: {err}".split())
        for secret in self.secrets:
            text = text.replace(secret, "[redacted]")
        return text if len(text) <= _DETAIL_CHARS else text[: _DETAIL_CHARS - 1] + "…"


def start(settings: Settings, *, job_id: str, model: str, spec: JobSpec) -> Exporter:
    """The exporter of one attempt at a job: a tracker per integration of its spec that this deployment configures
    (one it no longer does is a warning), each opening its run in its own thread."""
    config = job_config(job_id=job_id, model=model, spec=spec)
    trackers: list[Tracker] = []
    skipped: list[str] = []
    for item in spec.integrations:
        if not configured(settings, item.type):
            skipped.append(item.type)
            continue
        block = block_of(item)
        trackers.append(TRACKERS[item.type](settings, job_id=job_id, model=model, block=block, config=config))
    secrets = [s.get_secret_value() for s in (settings.wandb_api_key, settings.mlflow_tracking_token) if s is not None]
    exporter = Exporter(
        trackers,
        job_id=job_id,
        queue_size=settings.tracker_queue_size,
        close_timeout_s=settings.tracker_close_timeout_s,
        secrets=secrets,
    )
    for kind in skipped:
        exporter.warn(kind, "not_configured", f"{LABELS[kind]} export skipped: this deployment no longer exports to it")
    return exporter

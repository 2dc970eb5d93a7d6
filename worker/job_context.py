"""What the phases of one attempt at a job share (``worker.tasks`` runs them): the claimed job as read at its claim,
the attempt's progress, and the context every phase writes through (the database retried through an outage, the
job's events, its control flags)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from api import ids
from api.db import session_scope
from api.orm import now
from api.repositories import runs
from api.settings import Settings
from api.storage import ArtifactStore
from trainer.spec import metrics as M
from trainer.spec.config import JobSpec
from worker.estimate import Cadence, StepTime
from worker.outbox import DatabaseUnavailable, Write, is_transient, retry_db

T = TypeVar("T")


@dataclass(frozen=True)
class ClaimedJob:
    """The job as its claim read it: what the attempt trains, for whom, and which attempt this is."""

    job_id: str
    tenant_id: str
    model: str
    suffix: str | None
    spec: JobSpec  # as stored, parsed once by the claim
    training_file: str
    validation_file: str | None
    attempt: int
    claimed_at: float


@dataclass
class Progress:
    """What the attempt has learnt of its run so far: where it resumed, its length, and the measurements the
    finish estimate and the trained-token count are made of."""

    resume_step: int = 0
    total_steps: int | None = None
    tokens_by_step: dict[int, int] = field(default_factory=dict)
    step_times: list[StepTime] = field(default_factory=list)  # this attempt's measured steps (worker.estimate)
    checkpoint_seconds: list[float] = field(default_factory=list)
    metrics_at: dict[int, float] = field(default_factory=dict)  # when each step's metrics arrived (monotonic)

    def cadence(self, job: ClaimedJob) -> Cadence:
        """The run's validation and checkpoint cadence, from its spec."""
        hp = job.spec.method.hyperparameters
        return Cadence(
            total_steps=self.total_steps or 0,
            eval_interval=hp.eval_every(self.total_steps or 0),
            checkpoint_interval=hp.checkpoint_interval,
            validates=job.validation_file is not None,
        )

    def trained_tokens(self) -> int:
        return sum(self.tokens_by_step.values())


def step_tokens(values: Mapping[str, float | None]) -> int:
    """Completion tokens sampled in one step (generation throughput × generation time)."""
    tps, secs = values.get(M.TOKENS_PER_S_GENERATION), values.get(M.GENERATION_SECONDS)
    return round(tps * secs) if tps is not None and secs is not None else 0


@dataclass(frozen=True)
class JobContext:
    """The attempt's worker, job and run folder, and the writes every phase makes through them."""

    settings: Settings
    worker_id: str
    job_id: str
    run_dir: Path
    store: ArtifactStore

    @property
    def url(self) -> str:
        return self.settings.db_url

    @property
    def data_dir(self) -> Path:
        """The datasets' local copies the trainer reads."""
        return self.run_dir / "data"

    def db(self, what: str, fn: Callable[[], T]) -> T:
        """``fn`` retried through an outage; :class:`DatabaseUnavailable` when the database stays away."""
        try:
            return retry_db(f"job {self.job_id}: {what}", fn)
        except Exception as err:
            if is_transient(err):
                raise DatabaseUnavailable(what) from err
            raise

    def event_write(
        self, level: str, message: str, *, data: dict[str, Any] | None = None, type: str = "message"
    ) -> Write:
        """An event as a write: its id and time fixed now, so a write that runs twice records it once."""
        event_id, created_at = ids.event_id(), now()

        def run() -> None:
            with session_scope(self.url) as s:
                runs.add_event(
                    s,
                    job_id=self.job_id,
                    level=level,
                    message=message,
                    type=type,
                    data=data,
                    event_id=event_id,
                    created_at=created_at,
                )

        return Write(f"event {message[:40]!r}", run)

    def record_event(self, level: str, message: str) -> None:
        """An event written now (retried through an outage)."""
        self.db("record an event", self.event_write(level, message).run)

    def read_flags(self) -> tuple[bool, bool]:
        """The job's cancel and pause flags, read once."""
        with session_scope(self.url) as s:
            return runs.control_flags(s, job_id=self.job_id)

    def latest_stored_step(self) -> int:
        def latest() -> int:
            with session_scope(self.url) as s:
                ck = runs.latest_checkpoint(s, job_id=self.job_id)
                return ck.step_number if ck is not None else 0

        return self.db("find the latest checkpoint", latest)

"""A fine-tuning job's status: the one definition that the ORM, the API schemas, the services and
repositories, the worker and the sweeper use, and the groups of statuses the job's lifecycle is written in.

    validating_files → queued → running → succeeded | failed | cancelled
                  ↘ failed (a bad file)     ↘ paused → queued (resume)

Torch-free and import-light: the API process, the worker and the command line's REST client all read it.
"""

from __future__ import annotations

from enum import StrEnum


class JobStatus(StrEnum):
    VALIDATING_FILES = "validating_files"  # waiting for a worker to validate the datasets (``worker.validation``)
    QUEUED = "queued"  # files valid, waiting for a worker to train it
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"
    PAUSED = "paused"  # ours: stopped at a checkpoint, resumable


class EvalRunStatus(StrEnum):
    """An eval run's status (OpenAI's): queued → in_progress → completed | failed | canceled."""

    QUEUED = "queued"
    IN_PROGRESS = "in_progress"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELED = "canceled"


EVAL_RUN_TERMINAL: frozenset[EvalRunStatus] = frozenset(
    {EvalRunStatus.COMPLETED, EvalRunStatus.FAILED, EvalRunStatus.CANCELED}
)
"""The statuses an eval run ends in."""


LIFECYCLE = (
    JobStatus.VALIDATING_FILES,
    JobStatus.QUEUED,
    JobStatus.RUNNING,
    JobStatus.PAUSED,
    JobStatus.SUCCEEDED,
    JobStatus.FAILED,
    JobStatus.CANCELLED,
)
"""Every status in a job's usual order (how the dashboard's status filter lists them)."""
TERMINAL_STATUSES = frozenset({JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.CANCELLED})
"""A job in one of these never changes again."""
WAITING = (JobStatus.VALIDATING_FILES, JobStatus.QUEUED)
"""Waiting for a worker: a broker message must exist for it (the sweeper re-sends lost ones)."""
PAUSABLE = (*WAITING, JobStatus.RUNNING)
"""A pause request is accepted: at once while waiting, at the next checkpoint while running (what the dashboard
offers a pause button for)."""
NOT_STARTED = (*WAITING, JobStatus.PAUSED)
"""No trainer runs for it: a cancel takes effect at once."""
CLAIMABLE = (JobStatus.QUEUED, JobStatus.RUNNING)
"""A worker may claim it to train (running: when its lease has expired)."""
LEASED = (JobStatus.VALIDATING_FILES, JobStatus.RUNNING)
"""A worker holds and renews the job's lease in these."""

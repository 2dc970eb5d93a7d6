"""The Celery task names the API enqueues by and the worker registers under: the API publishes by name so that it
never imports ``worker/``, and both read the name from here."""

from __future__ import annotations

from typing import Any

RUN_JOB = "proxima.jobs.run"
"""Validate (if not yet done), claim and run one job; the only argument is the job's id."""

RUN_EVAL = "proxima.evals.run"
"""Claim and run one eval run (sample its items if it samples, grade them, count them); the only argument is its id."""

DEFAULT_QUEUE = "celery"
"""Celery's default queue: the jobs that need one device, and eval runs, which every worker takes."""


def queue_for(gpus: int) -> str:
    """The queue of the jobs that ask for ``gpus`` devices: the default one for one, ``proxima.gpus.N`` for N > 1
    (taken by the workers that have at least N: :func:`queues_of`)."""
    return DEFAULT_QUEUE if gpus <= 1 else f"proxima.gpus.{gpus}"


def queues_of(devices: int) -> list[str]:
    """The queues a worker with ``devices`` devices takes jobs from: every job size it can run."""
    return [queue_for(n) for n in range(1, max(devices, 1) + 1)]


def gpus_of(spec: dict[str, Any]) -> int:
    """How many devices a stored job spec asks for (``resources.gpus``; 1 when it says nothing)."""
    resources = spec.get("resources")
    return int(resources.get("gpus", 1)) if isinstance(resources, dict) else 1

"""The Celery task names the API enqueues by and the worker registers under: the API publishes by name so that it
never imports ``worker/`` (design §1), and both read the name from here."""

from __future__ import annotations

RUN_JOB = "proxima.jobs.run"
"""Validate (if not yet done), claim and run one job; the only argument is the job's id."""

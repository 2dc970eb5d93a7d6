"""Start a worker programmatically: a Celery worker consuming ``proxima.jobs.run`` plus the sweeper and webhook
delivery threads.

Used by ``proxima worker`` and ``proxima serve``; ``python -m worker.main`` runs one too. A worker says how many
devices it gives one job (:func:`advertised_devices`) by the queues it takes jobs from: a job asking for N devices
waits in the queue of its size (``api.tasks.queue_for``), which only workers with at least N take.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import socket
import subprocess
from typing import Any

from api.settings import Settings, get_settings
from api.tasks import queues_of
from worker.celery_app import configure
from worker.sessions import SessionHost
from worker.sweeper import QUEUED_GRACE_S, SWEEP_INTERVAL_S, Sweeper
from worker.tasks import STOP_GRACE_CONF, STOP_GRACE_S, default_worker_id  # importing it registers proxima.jobs.run
from worker.validation import preload_tokenising_code
from worker.webhooks import WebhookDeliverer

log = logging.getLogger("proxima.worker")


def run_worker(
    settings: Settings,
    *,
    concurrency: int = 1,
    hostname: str | None = None,
    sweep_interval: float = SWEEP_INTERVAL_S,
    queued_grace_seconds: float = QUEUED_GRACE_S,
    stop_grace_seconds: float | None = None,
    loglevel: str = "INFO",
) -> None:
    """Block running a worker (one job at a time per unit of concurrency: one per GPU) until it is shut down.
    ``stop_grace_seconds``: how long a trainer asked to stop (cancel, pause) has before it is terminated; default
    the deployment's ``PROXIMA_STOP_GRACE_S``."""
    app = configure(settings)
    app.conf.update({STOP_GRACE_CONF: settings.stop_grace_s if stop_grace_seconds is None else stop_grace_seconds})

    if settings.celery_broker_url.startswith("sqla+"):
        # kombu's SQLAlchemy transport creates its tables on first use; the folder of a SQLite file must exist.
        settings.home.mkdir(parents=True, exist_ok=True)
    preload_tokenising_code()  # before any lease is held (worker.validation)
    sweeper = Sweeper(app, settings, interval=sweep_interval, queued_grace_seconds=queued_grace_seconds)
    sweeper.start()
    deliverer = WebhookDeliverer(settings)  # webhooks go out wherever a worker runs (worker.webhooks)
    deliverer.start()
    # Tinker training sessions, beside the jobs: a worker holds up to PROXIMA_WORKER_SESSIONS (worker.sessions).
    sessions = SessionHost(settings, default_worker_id(hostname), capacity=settings.worker_sessions)
    if settings.worker_sessions > 0:
        sessions.start()
    devices = advertised_devices(settings)
    queues = queues_of(devices)
    log.info("this worker gives a job up to %d device%s: it takes jobs from %s", devices, "s" * (devices > 1), queues)
    try:
        celery_worker: Any = app.Worker(
            hostname=f"proxima@{hostname or socket.gethostname()}",
            concurrency=concurrency,
            pool="threads",  # the trainer runs in a child process of its own; the task only supervises it
            loglevel=loglevel,
            without_gossip=True,
            without_mingle=True,
            without_heartbeat=True,
            queues=queues,
        )
        celery_worker.start()
    finally:
        sweeper.stop()
        deliverer.stop()
        sessions.stop()


def advertised_devices(settings: Settings) -> int:
    """How many devices this worker gives one job: ``PROXIMA_WORKER_DEVICES``, else the GPUs it sees (the entries of
    ``CUDA_VISIBLE_DEVICES`` where it is set, else the lines of ``nvidia-smi -L``), else 1 (a CPU machine: its jobs'
    ranks are processes). Read without importing torch, which this process does not need."""
    if settings.worker_devices is not None:
        return settings.worker_devices
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return max(len([d for d in visible.split(",") if d.strip() and d.strip() != "-1"]), 1)
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return 1
    try:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return 1
    return max(sum(1 for line in out.splitlines() if line.startswith("GPU ")), 1)


def main() -> None:
    parser = argparse.ArgumentParser(description="Run a Proxima worker (Celery + sweeper).")
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--hostname", default=None)
    parser.add_argument("--sweep-interval", type=float, default=SWEEP_INTERVAL_S)
    parser.add_argument("--queued-grace", type=float, default=QUEUED_GRACE_S)
    parser.add_argument(
        "--stop-grace",
        type=float,
        default=None,
        help="seconds a trainer asked to stop (cancel, pause) has before it is terminated, then killed; default "
        f"PROXIMA_STOP_GRACE_S ({STOP_GRACE_S:g})",
    )
    parser.add_argument("--loglevel", default="INFO")
    args = parser.parse_args()
    logging.basicConfig(level=args.loglevel, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    run_worker(
        get_settings(),
        concurrency=args.concurrency,
        hostname=args.hostname,
        sweep_interval=args.sweep_interval,
        queued_grace_seconds=args.queued_grace,
        stop_grace_seconds=args.stop_grace,
        loglevel=args.loglevel,
    )


if __name__ == "__main__":
    main()

"""The Celery application. The broker message is only a wake-up call carrying a job's (or an eval run's) id: the
database lease decides who runs it, so a redelivered or duplicated message is harmless."""

from __future__ import annotations

from celery import Celery

from api.settings import Settings, get_settings

# worker.evals registers proxima.evals.run beside worker.tasks' proxima.jobs.run.
app = Celery("proxima", include=["worker.tasks", "worker.evals"])
_settings: Settings | None = None


def configure(settings: Settings) -> Celery:
    """Point the application at ``settings``' broker; tasks read the same settings through :func:`settings`."""
    global _settings
    _settings = settings
    app.conf.update(
        broker_url=settings.celery_broker_url,
        broker_connection_retry_on_startup=True,
        task_acks_late=True,  # a message is acknowledged after its job ran, so a dead worker's job is redelivered
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=1,  # one job at a time per worker (one per GPU): reserve nothing beyond it
        task_ignore_result=True,  # outcomes live in the database
        worker_hijack_root_logger=False,
        worker_redirect_stdouts=False,
    )
    return app


def settings() -> Settings:
    if _settings is None:
        configure(get_settings())
    assert _settings is not None
    return _settings

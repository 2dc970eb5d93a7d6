"""The sweeper's loop: a sweep every interval, whatever the last one met, and the artifact store's clean-up
(``api.services.cleanup.clean_orphans``) every ``cleanup_every`` seconds."""

from __future__ import annotations

import time
from typing import Any

import pytest
from sqlalchemy import exc

from worker import sweeper


def test_the_loop_sweeps_through_failures_and_cleans_the_store_now_and_then(monkeypatch: pytest.MonkeyPatch) -> None:
    sweeps: list[float] = []
    cleanups: list[dict[str, Any]] = []

    def sweep_once(app: Any, settings: Any, **kw: Any) -> list[str]:
        sweeps.append(time.monotonic())
        if len(sweeps) % 2:
            raise exc.OperationalError("SELECT", {}, Exception("connection refused"))  # the database is down
        return []

    monkeypatch.setattr(sweeper, "sweep_once", sweep_once)
    monkeypatch.setattr(sweeper, "store_from_url", lambda url, endpoint_url=None: "the store")
    monkeypatch.setattr(sweeper, "clean_orphans", lambda **kw: cleanups.append(kw))

    class Settings:
        db_url, artifacts_url, s3_endpoint_url = "postgresql://db", "/artifacts", None

    loop = sweeper.Sweeper(None, Settings(), interval=0.01, cleanup_every=0.2)  # type: ignore[arg-type]
    loop.start()
    time.sleep(0.5)
    loop.stop()
    loop.join(timeout=5)
    assert len(sweeps) >= 5
    assert 1 <= len(cleanups) <= 3 and cleanups[0] == {"url": "postgresql://db", "store": "the store"}

"""The sweeper's loop: a sweep every interval, whatever the last one met, and the artifact store's clean-up
(``api.services.cleanup.clean_orphans``) every ``cleanup_every`` seconds."""

from __future__ import annotations

import itertools
import time
from typing import Any

import pytest
from sqlalchemy import exc

from tests.waiting import wait_until
from worker import sweeper


def test_the_loop_sweeps_through_failures_and_cleans_the_store_now_and_then(monkeypatch: pytest.MonkeyPatch) -> None:
    sweeps: list[float] = []
    cleanups: list[tuple[float, dict[str, Any]]] = []  # when, and with what

    def sweep_once(app: Any, settings: Any, **kw: Any) -> list[str]:
        sweeps.append(time.monotonic())
        if len(sweeps) % 2:
            raise exc.OperationalError("SELECT", {}, Exception("connection refused"))  # the database is down
        return []

    monkeypatch.setattr(sweeper, "sweep_once", sweep_once)
    monkeypatch.setattr(sweeper, "store_from_url", lambda url, endpoint_url=None: "the store")
    monkeypatch.setattr(sweeper, "clean_orphans", lambda **kw: cleanups.append((time.monotonic(), kw)))

    class Settings:
        db_url, artifacts_url, s3_endpoint_url = "postgresql://db", "/artifacts", None

    loop = sweeper.Sweeper(None, Settings(), interval=0.01, cleanup_every=0.2)  # type: ignore[arg-type]
    started = time.monotonic()
    loop.start()
    try:
        wait_until(lambda: len(sweeps) >= 5 and len(cleanups) >= 2, "five sweeps and two clean-ups", timeout=30)
    finally:
        loop.stop()
        loop.join(timeout=5)
    assert cleanups[0][1] == {"url": "postgresql://db", "store": "the store"}
    # Now and then: never sooner than `cleanup_every` after the start or the last one, however many sweeps between
    # (less a hair: each time here is read just after the loop read its own).
    cleaned_at = [started] + [at for at, _ in cleanups]
    assert all(later - earlier >= 0.19 for earlier, later in itertools.pairwise(cleaned_at)), cleaned_at

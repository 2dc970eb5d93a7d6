"""Request sessions (``api.deps.get_session``) under a burst of more requests than the pool has connections."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import pytest

from api import db
from api.app import create_app
from tests.integration.conftest import Tenant, serve

BURST = 120  # concurrent requests: more than the 40 threadpool threads plus the pool's connections


async def _burst(base_url: str, key: str, n: int) -> list[int]:
    limits = httpx.Limits(max_connections=n, max_keepalive_connections=n)
    async with httpx.AsyncClient(
        base_url=base_url, headers={"authorization": f"Bearer {key}"}, limits=limits, timeout=120
    ) as client:
        responses = await asyncio.gather(*(client.get("/v1/fine_tuning/jobs") for _ in range(n)))
    return [r.status_code for r in responses]


@pytest.mark.alone
def test_a_burst_larger_than_the_pool_is_served_without_waiting_for_the_pool_timeout(
    settings: Any, tenant_a: Tenant, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Its own engine (another URL) with a pool of 2. Before admission control, requests holding a connection
    # waited for a threadpool thread while every thread waited for a connection: a deadlock that the pool's
    # 60 s timeout broke with 503s.
    monkeypatch.setattr(db, "POOL_SIZE", 2)
    monkeypatch.setattr(db, "MAX_OVERFLOW", 0)
    small = settings.model_copy(update={"database_url": f"{settings.db_url}?application_name=burst"})
    try:
        with serve(create_app(small)) as base_url:
            start = time.monotonic()
            statuses = asyncio.run(_burst(base_url, tenant_a.key, BURST))
            elapsed = time.monotonic() - start
    finally:
        db.engine_for(small.db_url).dispose()
    assert statuses == [200] * BURST
    assert elapsed < 30, elapsed
    assert db.engine_for(small.db_url).pool.size() == 2

"""Redis databases for the tests' brokers: every live deployment of this pytest process gets one that no other live
deployment uses (two deployments on one database take each other's messages: a worker of one consumes, and drops,
the jobs of the other), least recently used first, emptied before it is handed out. Under pytest-xdist each worker
process draws from a share of its own."""

from __future__ import annotations

import itertools
import os
import threading

REDIS = "redis://127.0.0.1:6379"
ALL_DATABASES = (*range(1, 13), 15)  # 0 is a developer's; 13 and 14 belong to bench/


def _share(databases: tuple[int, ...]) -> tuple[int, ...]:
    """This process's share of ``databases``: all of them, or under pytest-xdist worker ``gwK`` of N every N-th from
    the K-th (workers are processes of their own: no two share a database)."""
    worker, count = os.environ.get("PYTEST_XDIST_WORKER"), os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if not worker or not count:
        return databases
    k, n = int(worker.removeprefix("gw")), int(count)
    if n > len(databases):
        raise RuntimeError(f"{n} pytest-xdist workers: more than the {len(databases)} test Redis databases")
    return databases[k::n]


DATABASES = _share(ALL_DATABASES)
_lock = threading.Lock()
_live: set[int] = set()
_released: dict[int, int] = {}  # database → the order it was last given back in
_order = itertools.count(1)


def claim_redis_url() -> str:
    """A Redis URL on an emptied database no live deployment of this process uses; give it back with
    :func:`release_redis_url` when the deployment's processes are gone."""
    import redis

    with _lock:
        free = [db for db in DATABASES if db not in _live]
        if not free:
            raise RuntimeError(f"all {len(DATABASES)} test Redis databases are in use: a deployment was not closed")
        db = min(free, key=lambda d: _released.get(d, 0))
        _live.add(db)
    url = f"{REDIS}/{db}"
    client = redis.Redis.from_url(url)
    try:
        client.flushdb()
    finally:
        client.close()
    return url


def release_redis_url(url: str | None) -> None:
    """Give back a database of :func:`claim_redis_url` (None and unknown URLs are ignored)."""
    if not url or not url.startswith(f"{REDIS}/"):
        return
    db = int(url.rsplit("/", 1)[1])
    with _lock:
        if db in _live:
            _live.discard(db)
            _released[db] = next(_order)

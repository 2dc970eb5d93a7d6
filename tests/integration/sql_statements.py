"""The SQL statements the app in this process sends to the test database, recorded with SQLAlchemy's cursor event on
both of its engines (the request sessions' and the plain reads'): to count a request's queries, and to see that a GET
writes nothing."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
from sqlalchemy import event

WRITES = ("INSERT", "UPDATE", "DELETE")


@contextmanager
def recorded(db_url: str) -> Iterator[list[str]]:
    """The statements sent while the block runs, in order (BEGIN/COMMIT are not statements of a cursor)."""
    from api.db import engine_for, read_engine_for

    seen: list[str] = []

    def record(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        seen.append(statement)

    engines = {id(e): e for e in (engine_for(db_url), read_engine_for(db_url))}.values()
    for engine in engines:
        event.listen(engine, "before_cursor_execute", record)
    try:
        yield seen
    finally:
        for engine in engines:
            event.remove(engine, "before_cursor_execute", record)


def queries(statements: list[str]) -> list[str]:
    """The statements that read or write the app's tables (not the pool's pings nor LISTEN/NOTIFY)."""
    return [s for s in statements if s.lstrip().upper().startswith(("SELECT", *WRITES))]


def writes(statements: list[str]) -> list[str]:
    return [s for s in statements if s.lstrip().upper().startswith(WRITES)]


def page_queries(db_url: str, client: httpx.Client, path: str, **params: Any) -> int:
    """How many queries one GET of ``path`` costs (after a first GET: the key's lookup is then cached)."""
    assert client.get(path, params=params).status_code == 200
    with recorded(db_url) as seen:
        r = client.get(path, params=params)
    assert r.status_code == 200, r.text
    return len(queries(seen))

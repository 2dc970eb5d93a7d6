"""Waiting on a condition with a deadline, for tests that watch another thread or process.

A test that must show that something did *not* happen waits here for a positive sign that the system has had its
chance (a later round's work, a later event, the process that could have written having ended) and only then
asserts the negative: a fixed sleep would pass whenever the system is merely slow, and cost its length every run.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_until(
    check: Callable[[], T],
    what: str,
    *,
    timeout: float = 30.0,
    interval: float = 0.05,
    context: Callable[[], str] | None = None,
) -> T:
    """Call ``check`` every ``interval`` seconds until it returns something true, and return that; fail naming
    ``what`` (and ``context()``'s text, a log's tail say) once ``timeout`` seconds have passed without it."""
    deadline = time.monotonic() + timeout
    while not (value := check()):
        if time.monotonic() > deadline:
            raise AssertionError(
                f"timed out after {timeout:g} s waiting for {what}" + (f"\n{context()}" if context else "")
            )
        time.sleep(interval)
    return value

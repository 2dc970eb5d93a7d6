"""`UrlPolicy.resolve_sync` gives up on a host whose DNS lookup does not answer in time, without waiting for it."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from trainer.grading.url_policy import UrlPolicy
from trainer.spec.urls import UrlRefused


@pytest.fixture
def stuck_dns(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """getaddrinfo that does not return until the test ends (as a DNS server that never answers)."""
    release = threading.Event()

    def getaddrinfo(*_: Any, **__: Any) -> list[Any]:
        release.wait(30)
        return []

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    yield
    release.set()


def test_a_lookup_past_the_deadline_is_refused_without_waiting_for_it(stuck_dns: None) -> None:
    started = time.monotonic()
    with pytest.raises(UrlRefused, match=r"'slow\.example\.com' does not resolve \(no answer within 0\.2s\)"):
        UrlPolicy().resolve_sync("https://slow.example.com/hook", timeout=0.2)
    assert time.monotonic() - started < 2

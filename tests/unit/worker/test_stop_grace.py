"""The stop grace (how long a trainer asked to cancel or pause has before it is terminated) is the deployment's
setting, PROXIMA_STOP_GRACE_S, for `proxima worker` and `python -m worker.main` alike; `--stop-grace` overrides it."""

from __future__ import annotations

import sys
from typing import Any

import pytest
from pydantic import ValidationError

import worker.main
from api.settings import Settings, get_settings


def test_the_setting_is_read_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PROXIMA_STOP_GRACE_S", "7.5")
    assert Settings().stop_grace_s == 7.5  # type: ignore[call-arg]
    monkeypatch.delenv("PROXIMA_STOP_GRACE_S")
    assert Settings().stop_grace_s == 60.0  # type: ignore[call-arg]


@pytest.mark.parametrize("bad", ["0", "-1", "nan", "90000"])
def test_a_bad_value_fails_naming_the_setting(monkeypatch: pytest.MonkeyPatch, bad: str) -> None:
    monkeypatch.setenv("PROXIMA_STOP_GRACE_S", bad)
    with pytest.raises(ValidationError, match="stop_grace_s"):
        Settings()  # type: ignore[call-arg]


@pytest.mark.parametrize(("argv", "expected"), [([], None), (["--stop-grace", "3"], 3.0)])
def test_the_worker_flag_overrides_the_setting_only_when_given(
    monkeypatch: pytest.MonkeyPatch, argv: list[str], expected: float | None
) -> None:
    seen: dict[str, Any] = {}
    monkeypatch.setattr(worker.main, "run_worker", lambda settings, **kwargs: seen.update(kwargs))
    monkeypatch.setattr(sys, "argv", ["worker.main", *argv])
    get_settings.cache_clear()
    try:
        worker.main.main()
    finally:
        get_settings.cache_clear()
    assert seen["stop_grace_seconds"] == expected

"""Which rank the launcher (``worker.launch``) blames when ranks fail: the one ended by a signal it did not send."""

from __future__ import annotations

import signal

from worker.launch import cause

KILL, TERM, ABRT = -signal.SIGKILL, -signal.SIGTERM, -signal.SIGABRT


def test_a_killed_rank_is_the_cause_when_the_others_failed_in_a_collective() -> None:
    assert cause({0: 1, 1: KILL}) == (1, KILL)


def test_a_killed_rank_is_the_cause_when_the_launcher_terminated_a_rank_still_running() -> None:
    """Rank 1 killed while rank 0 was outside a collective: the launcher ended rank 0 by SIGTERM and counts it."""
    assert cause({0: TERM, 1: KILL}) == (1, KILL)
    assert cause({0: TERM, 1: ABRT, 2: TERM}) == (1, ABRT)


def test_a_crash_outranks_the_launchers_sigterm_and_an_error_exit() -> None:
    assert cause({0: TERM, 3: ABRT, 1: 1}) == (3, ABRT)


def test_sigterm_alone_is_reported_and_error_exits_go_to_the_lowest_rank() -> None:
    assert cause({2: TERM, 1: 1}) == (2, TERM)
    assert cause({3: 1, 1: 1}) == (1, 1)
    assert cause({1: KILL, 0: KILL}) == (0, KILL)

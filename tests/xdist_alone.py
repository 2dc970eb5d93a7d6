"""Under pytest-xdist, the tests marked ``alone`` run while no other worker runs a test.

Those tests measure wall-clock time (a latency, a time limit, calls that overlap): beside another worker's training
they would measure the machine instead. Every other test holds a shared claim on the machine while it runs (set-up,
call and tear-down); an ``alone`` test holds it exclusively. Two ``flock`` files per run of the suite, in the run's
own temporary folder: ``machine`` (the claim) and ``gate``, which a worker holds while it waits for the exclusive
claim, so that the other worker's next test queues behind it instead of starving it (Linux's ``flock`` lets new
shared claims in past a waiting exclusive one). A run of consecutive ``alone`` tests keeps the claim throughout: the
other worker's test in between would otherwise cost a wait per test. In one process nothing is claimed.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Generator
from pathlib import Path
from typing import IO

import pytest

_held: dict[str, IO[str]] = {}
_exclusive: list[bool] = []


def _folder(config: pytest.Config) -> Path:
    # pytest-xdist gives each worker the folder `<the run's base temp>/<worker id>`: the parent is the run's.
    return Path(config.option.basetemp).parent


def _claim(folder: Path, *, exclusive: bool) -> None:
    gate = (folder / "alone.gate").open("a")
    machine = (folder / "alone.machine").open("a")
    fcntl.flock(gate, fcntl.LOCK_EX)
    fcntl.flock(machine, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
    if exclusive:
        _held["gate"] = gate
    else:
        gate.close()  # closing the file releases its lock: the gate is passed straight through
    _held["machine"] = machine
    _exclusive[:] = [exclusive]


def _release() -> None:
    for f in _held.values():
        f.close()
    _held.clear()
    _exclusive.clear()


def _alone(item: pytest.Item | None) -> bool:
    return item is not None and item.get_closest_marker("alone") is not None


@pytest.hookimpl(hookwrapper=True, tryfirst=True)  # outermost: pytest-timeout's clock starts once the claim is held
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Generator[None, None, None]:
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        yield
        return
    alone = _alone(item)
    if _exclusive and _exclusive[0] != alone:
        _release()
    if not _exclusive:
        _claim(_folder(item.config), exclusive=alone)
    try:
        yield
    finally:
        if not (alone and _alone(nextitem)):
            _release()

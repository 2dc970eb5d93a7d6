"""The suite's time against its budget, and the files that took it, at the end of every run of the whole suite.

The budget is 15 minutes of pytest's own time on a 2-core machine with the virtual environment in place (`.ci/run`
prints the whole run's against 20 minutes, installs included). A run over it says so in its last lines rather than
failing: a loaded machine must not turn a green suite red, and the list of files says where to trim.

Under pytest-xdist each test's report reaches the controlling process, which sums them per file: that is time spent
in the file by one process (set-up, call and tear-down), not the run's share of the machine.
"""

from __future__ import annotations

import time
from collections import Counter

import pytest

BUDGET_S = 15 * 60
SHOWN_FILES = 12

_started: list[float] = []
_per_file: Counter[str] = Counter()


def pytest_sessionstart(session: pytest.Session) -> None:
    _started[:] = [time.monotonic()]


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _per_file[report.nodeid.split("::")[0]] += report.duration


@pytest.hookimpl(trylast=True)  # after the slowest durations: the last lines of the run
def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, config: pytest.Config) -> None:
    whole = config.args_source == pytest.Config.ArgsSource.TESTPATHS and not config.option.keyword
    whole = whole and not config.option.collectonly
    if hasattr(config, "workerinput") or not whole or not _started:
        return
    elapsed = time.monotonic() - _started[0]
    write = terminalreporter.write_line
    terminalreporter.section("time by file (set-up, call and tear-down)")
    for path, seconds in _per_file.most_common(SHOWN_FILES):
        write(f"{seconds:7.1f} s  {path}")
    verdict = "within" if elapsed <= BUDGET_S else "OVER"
    write(
        f"the suite took {elapsed / 60:.1f} min: {verdict} its budget of {BUDGET_S // 60} min on 2 cores "
        f"({elapsed / BUDGET_S:.0%}); {sum(_per_file.values()) / 60:.1f} min of tests in all"
    )

"""The ``alone`` marker under pytest-xdist (tests/xdist_alone.py): a real two-worker run of a generated suite whose
tests log when they ran. No other test runs beside an ``alone`` one; consecutive ``alone`` tests run back to back;
the others still run side by side."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO

CONFTEST = """
from tests.xdist_alone import pytest_runtest_protocol  # noqa: F401


def pytest_configure(config):
    config.addinivalue_line("markers", "alone: runs while no other test does")
"""

LOGGED = """
import json, os, time

import pytest


def logged(name, seconds=0.5):
    started = time.monotonic()
    time.sleep(seconds)
    with open(os.environ["ALONE_LOG"], "a") as f:
        f.write(json.dumps([name, started, time.monotonic()]) + "\\n")
"""


def test_alone_tests_run_with_no_other_test_beside_them_and_the_others_in_parallel(tmp_path: Path) -> None:
    suite = tmp_path / "suite"
    suite.mkdir()
    (suite / "conftest.py").write_text(CONFTEST)
    # Two files, one per worker (--dist loadfile): b's `alone` tests come second, while a's tests are running.
    (suite / "test_a.py").write_text(LOGGED + "".join(f"\n\ndef test_a{i}():\n    logged('a{i}')\n" for i in range(8)))
    (suite / "test_b.py").write_text(
        LOGGED
        + "\n\ndef test_b0():\n    logged('b0')\n"
        + "".join(f"\n\n@pytest.mark.alone\ndef test_alone{i}():\n    logged('alone{i}')\n" for i in range(2))
        + "".join(f"\n\ndef test_b{i}():\n    logged('b{i}')\n" for i in range(1, 5))
    )
    log = tmp_path / "log.jsonl"
    env = {**os.environ, "ALONE_LOG": str(log), "PYTHONPATH": str(REPO)}
    env.pop("PYTEST_XDIST_WORKER", None)  # this test may itself run under xdist
    pytest_args = ["-q", "-n", "2", "--dist", "loadfile", "-p", "no:cacheprovider", "--basetemp", str(tmp_path / "bt")]
    run = subprocess.run(
        [sys.executable, "-m", "pytest", *pytest_args, str(suite)],
        cwd=suite,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    spans = {name: (start, end) for name, start, end in map(json.loads, log.read_text().splitlines())}
    assert len(spans) == 15

    def overlap(x: str, y: str) -> bool:
        return spans[x][0] < spans[y][1] and spans[y][0] < spans[x][1]

    others = [n for n in spans if not n.startswith("alone")]
    for alone in ("alone0", "alone1"):
        assert not [n for n in others if overlap(alone, n)], (alone, spans)
    # Back to back: the other worker started nothing between them.
    between = [n for n in others if spans["alone0"][1] <= spans[n][0] < spans["alone1"][0]]
    assert between == [], spans
    # And the rest ran side by side: some of a's tests overlapped some of b's.
    assert any(overlap(f"a{i}", f"b{j}") for i in range(8) for j in range(5)), spans

"""What the worker reads of its trainer's end: the kernel's out-of-memory kill counter (cgroup v1 and v2), and an
unexpected error summed up in one line without its traceback."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from worker.runner import SUMMARY_CHARS, summary
from worker.trainer_process import oom_counter_file, read_oom_kills


def test_the_oom_kill_counter_is_read_from_cgroup_v2_and_v1_files(tmp_path: Path) -> None:
    v2 = tmp_path / "memory.events"
    v2.write_text("low 0\nhigh 0\nmax 12\noom 3\noom_kill 2\noom_group_kill 0\n")
    v1 = tmp_path / "memory.oom_control"
    v1.write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 5\n")
    assert (read_oom_kills(v2), read_oom_kills(v1)) == (2, 5)
    (tmp_path / "garbled").write_text("oom_kill many\n")
    assert read_oom_kills(tmp_path / "garbled") is None
    assert read_oom_kills(tmp_path / "absent") is None
    assert read_oom_kills(None) is None


def test_this_process_cgroup_counter_is_found_or_reported_unreadable() -> None:
    found = oom_counter_file(os.getpid())
    assert found is None or isinstance(read_oom_kills(found), int)
    assert oom_counter_file(2**22 + 12345) is None  # no such process


@pytest.mark.parametrize(
    ("err", "expected"),
    [
        (RuntimeError("value cannot be converted to type float without overflow"), "RuntimeError: value cannot"),
        (KeyError("lr"), "KeyError: 'lr'"),
        (ValueError(), "ValueError"),
        (ValueError("first line\n  File '/srv/x.py', line 3\nlast"), "ValueError: first line"),
    ],
)
def test_an_unexpected_error_is_summed_up_by_its_class_and_first_line(err: BaseException, expected: str) -> None:
    line = summary(err)
    assert line.startswith(expected) and "\n" not in line and "File" not in line


def test_a_long_error_message_is_shortened() -> None:
    line = summary(ValueError("x" * 10_000))
    assert len(line) == SUMMARY_CHARS and line.endswith("…")

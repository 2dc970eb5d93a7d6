"""trainer.grading.cgroups on a cgroup2 file tree made in a folder (the kernel's files are plain files here): which
bound a host gives (and why none), and the limits a sandbox's group is given. That a real bound stops a sandbox is
test_sandbox.py's (TestLimits), where this host has cgroups."""

from __future__ import annotations

import functools
import subprocess
from pathlib import Path

import pytest

from trainer.grading import cgroups


@pytest.fixture
def v2(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A cgroup2 root whose service runs in /svc, with the memory and pids controllers delegated below it."""
    (tmp_path / "cgroup.controllers").write_text("cpu memory pids\n")
    service = tmp_path / "svc"
    service.mkdir()
    (service / "cgroup.subtree_control").write_text("memory pids\n")
    monkeypatch.setattr(cgroups, "_own_groups", functools.partial(dict, {"": "/svc"}))
    return service


def test_cgroup2_with_delegated_controllers_bounds_each_sandbox_in_a_group_of_its_own(v2: Path) -> None:
    bound = cgroups.detect(v2.parent)
    assert bound == cgroups.Bound(2, v2, v2)
    group = cgroups.make_group(bound, 61003, memory_bytes=512 << 20, processes=24)
    assert group is not None
    made = v2 / "proxima-sandbox-61003"
    assert {f: (made / f).read_text() for f in ("memory.max", "memory.oom.group", "pids.max")} == {
        "memory.max": str(512 << 20),
        "memory.oom.group": "1",
        "pids.max": "24",
    }
    assert group.procs == (made / "cgroup.procs",)
    (made / "memory.events").write_text("low 0\nhigh 0\nmax 3\noom 1\noom_kill 2\n")
    assert group.oom_kills() == 2  # the count was 0 (no file) when the group was made
    assert bound.description(512 << 20, 24) == (
        f"python sandboxes: each in a cgroup v2 of its own under {v2}, bounded to 512 MiB of memory and 24 processes "
        "together (RLIMIT_AS per process too)"
    )


def test_a_sandbox_enters_its_groups_before_its_command_runs(tmp_path: Path) -> None:
    procs = (tmp_path / "a.procs", tmp_path / "b.procs")
    group = cgroups.SandboxGroup((tmp_path,), procs, tmp_path / "oom", 0)
    out = subprocess.run(group.enter_argv(["/bin/sh", "-c", "echo $$"]), capture_output=True, text=True, check=True)
    pid = out.stdout.strip()
    assert [p.read_text().strip() for p in procs] == [pid, pid]  # the same process: it wrote itself, then exec'd


def test_a_group_that_cannot_be_entered_stops_the_command(tmp_path: Path) -> None:
    group = cgroups.SandboxGroup((tmp_path,), (tmp_path / "absent" / "cgroup.procs",), tmp_path / "oom", 0)
    out = subprocess.run(group.enter_argv(["/bin/echo", "ran"]), capture_output=True, text=True)
    assert (out.returncode, out.stdout) == (125, "")


def test_controllers_that_cannot_be_enabled_are_no_bound_saying_why(v2: Path) -> None:
    control = v2 / "cgroup.subtree_control"
    control.unlink()
    control.mkdir()  # neither readable nor writable as a file: as the kernel refusing it
    bound = cgroups.detect(v2.parent)
    assert bound.version is None
    assert bound.reason.startswith(
        f"cgroup v2, but the memory and pids controllers cannot be enabled for groups under {v2}"
    )
    assert bound.description(2 << 30, 64).startswith("python sandboxes: no whole-sandbox memory bound (cgroup v2, but")

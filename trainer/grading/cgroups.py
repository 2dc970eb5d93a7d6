"""The bound on a whole sandbox's memory and processes: a cgroup of its own where the host lets this process make one.

RLIMIT_AS and RLIMIT_NPROC (`trainer.grading.sandbox`) bound each process of a sandbox, not the sandbox: 64 processes
of 2 GiB each could take 128 GiB together. A cgroup per sandbox (its uid slot's, `proxima-sandbox-<uid>`, made when
the slot is taken and removed when it is released) bounds them together: `memory_bytes` of memory (the scratch /tmp's
tmpfs included, no swap) and `processes` tasks. Past the memory bound the kernel's out-of-memory killer kills in that
cgroup alone (cgroup v2: all of it, `memory.oom.group`), and the parent, which reads the cgroup's `oom_kill` count
after every reply and exit, stops the sandbox with kind `memory_limit`.

Where it is made (`detect`, once per process):
- cgroup v2 (`/sys/fs/cgroup` is cgroup2): under this process's own cgroup, whose `cgroup.subtree_control` must enable
  `memory` and `pids` (enabled here when it can be: the kernel refuses while that cgroup holds processes, the service
  itself, as in a container that did not delegate a subtree; an operator then starts the service in a cgroup whose
  controllers are delegated, e.g. systemd's `Delegate=yes`).
- cgroup v1 (a `memory` and a `pids` hierarchy, as on hosts and VMs still on v1 or hybrid): under this process's own
  group in each, where this process may make groups (as root, where they are mounted writable).
- neither: no whole-sandbox bound, and `Bound.description` says why; each process keeps its RLIMIT_AS.

A sandbox enters its cgroups before it starts anything: its first process, /bin/sh, writes its own pid to each
`cgroup.procs` and then execs the sandbox's command (`enter_argv`), so that every process it starts is born inside.
"""

from __future__ import annotations

import functools
import logging
import os
import signal
import time
from collections.abc import Sequence
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

log = logging.getLogger(__name__)

CGROUP_ROOT = Path("/sys/fs/cgroup")
EMPTY_TIMEOUT_S = 2.0
"""How long removing a group waits for the processes it killed to be gone."""
GROUP_PREFIX = "proxima-sandbox-"
_ENTER = 'n=$1; shift; while [ "$n" -gt 0 ]; do echo $$ >"$1" || exit 125; shift; n=$((n - 1)); done; exec "$@"'
"""Writes its pid to the first $1 arguments (cgroup.procs files), then execs the rest."""


@dataclass(frozen=True)
class Bound:
    """Where this process makes its sandboxes' cgroups: `version` 2 (`memory` is `pids` is the one parent), 1 (a parent
    in each hierarchy) or None (no cgroups: `reason` says why)."""

    version: Literal[1, 2] | None
    memory: Path | None = None
    pids: Path | None = None
    reason: str = ""

    def description(self, memory_bytes: int, processes: int) -> str:
        """Which bound applies to a sandbox, in a sentence for an operator's log."""
        if self.version is None:
            return (
                f"python sandboxes: no whole-sandbox memory bound ({self.reason}); each process is bounded by "
                f"RLIMIT_AS, with at most {processes} processes of the sandbox's uid"
            )
        where = self.memory if self.version == 2 else f"{self.memory} and {self.pids}"
        return (
            f"python sandboxes: each in a cgroup v{self.version} of its own under {where}, bounded to "
            f"{memory_bytes / (1 << 20):g} MiB of memory and {processes} processes together (RLIMIT_AS per process too)"
        )


@functools.cache
def detect(root: Path = CGROUP_ROOT) -> Bound:
    """Where this process can make sandbox cgroups (cached for the process: the host does not change)."""
    try:
        own = _own_groups()
    except OSError as err:
        return Bound(None, reason=f"/proc/self/cgroup is not readable ({err})")
    if (root / "cgroup.controllers").exists():
        return _detect_v2(root / own.get("", "/").lstrip("/"))
    memory, pids = own.get("memory"), own.get("pids")
    if memory is None or pids is None:
        return Bound(None, reason=f"no cgroup2 at {root}, and no cgroup v1 memory and pids hierarchies")
    bound = Bound(1, root / "memory" / memory.lstrip("/"), root / "pids" / pids.lstrip("/"))
    for parent in (bound.memory, bound.pids):
        assert parent is not None
        problem = _probe(parent)
        if problem is not None:
            return Bound(None, reason=problem)
    return bound


def _own_groups() -> dict[str, str]:
    """This process's cgroup in each hierarchy, by controller ('' for cgroup v2's)."""
    groups: dict[str, str] = {}
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        for controller in controllers.split(",") if controllers else [""]:
            groups[controller] = path
    return groups


def _detect_v2(parent: Path) -> Bound:
    try:
        enabled = set((parent / "cgroup.subtree_control").read_text().split())
        if not {"memory", "pids"} <= enabled:
            (parent / "cgroup.subtree_control").write_text("+memory +pids")
    except OSError as err:
        return Bound(
            None,
            reason=f"cgroup v2, but the memory and pids controllers cannot be enabled for groups under {parent} "
            f"({err.strerror or err}: it holds processes, or is not delegated to this process)",
        )
    problem = _probe(parent)
    return Bound(None, reason=problem) if problem is not None else Bound(2, parent, parent)


def _probe(parent: Path) -> str | None:
    """None when a group can be made and removed under `parent`; else why not."""
    probe = parent / f"{GROUP_PREFIX}probe-{os.getpid()}"
    try:
        probe.mkdir(exist_ok=True)
    except OSError as err:
        return f"no group can be made under {parent} ({err.strerror or err})"
    problem = remove_group(probe)
    return None if problem is None else f"a group made under {parent} cannot be removed ({problem})"


@dataclass(frozen=True)
class SandboxGroup:
    """The cgroups of one uid slot: their `cgroup.procs` files, and the out-of-memory kill count to read."""

    dirs: tuple[Path, ...]
    procs: tuple[Path, ...]
    oom_file: Path
    oom_before: int

    def enter_argv(self, argv: Sequence[str]) -> list[str]:
        """`argv` started inside these groups (see the module's docstring)."""
        return ["/bin/sh", "-c", _ENTER, "sh", str(len(self.procs)), *map(str, self.procs), *argv]

    def oom_kills(self) -> int:
        """Processes of this slot's sandboxes killed for its memory bound since the slot was taken."""
        return _oom_count(self.oom_file) - self.oom_before

    def remove(self) -> None:
        """Kill whatever the slot's sandboxes left in the groups and remove them: a group left behind would be reused by
        the slot's next sandbox, whose memory and process bounds its leftovers would then count against. Logged where
        a group still cannot be removed."""
        for path in self.dirs:
            problem = remove_group(path)
            if problem is not None:
                log.warning("the sandbox cgroup %s could not be removed: %s", path, problem)


def remove_group(path: Path, timeout_s: float = EMPTY_TIMEOUT_S) -> str | None:
    """Kill the processes of the group at `path` and remove it; None when it is gone, else why not. cgroup v2 kills
    the group at once (`cgroup.kill`, which a process forking meanwhile cannot escape); v1 has no such file: its
    processes are sent SIGKILL until none is left."""
    kill = path / "cgroup.kill"
    with suppress(OSError):
        if kill.exists():
            _write(kill, 1)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            pids = _group_pids(path)
            if not pids:
                path.rmdir()
                return None
            problem = f"{len(pids)} processes are still in it"
        except FileNotFoundError:  # removed meanwhile
            return None
        except OSError as err:  # busy a moment after its last process died
            pids, problem = [], f"{err.strerror or err}"
        for pid in pids:
            with suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        if time.monotonic() > deadline:
            return problem
        time.sleep(0.01)


def _group_pids(path: Path) -> list[int]:
    """The pids in the group (v1's `cgroup.procs` lists processes, as v2's does); none where it has no such file (a
    folder that is not a cgroup, whose rmdir then says why)."""
    try:
        return [int(line) for line in (path / "cgroup.procs").read_text().split()]
    except FileNotFoundError:
        if path.is_dir():
            return []
        raise


def make_group(bound: Bound, uid: int, *, memory_bytes: int, processes: int) -> SandboxGroup | None:
    """The cgroups of slot `uid`, made (or reused) with these limits; None where `bound` has no cgroups. Raises
    OSError when they cannot be made or limited (the caller's SandboxUnavailable)."""
    if bound.version is None or bound.memory is None or bound.pids is None:
        return None
    name = f"{GROUP_PREFIX}{uid}"
    memory, pids = bound.memory / name, bound.pids / name
    for group in (memory, pids):
        if group.exists():  # left by a process that died holding the slot: its leftovers must not count against us
            remove_group(group)
        group.mkdir(exist_ok=True)
    if bound.version == 2:
        _write(memory / "memory.max", memory_bytes)
        _write_if_there(memory / "memory.swap.max", 0)
        _write(memory / "memory.oom.group", 1)  # an out-of-memory kill ends the whole sandbox, not one of its parts
        _write(pids / "pids.max", processes)
        oom = memory / "memory.events"
    else:
        memsw = memory / "memory.memsw.limit_in_bytes"
        if memsw.exists():  # memory+swap must stay at least memory: lowered after it, raised before it
            with suppress(OSError):
                _write(memsw, memory_bytes)
        _write(memory / "memory.limit_in_bytes", memory_bytes)
        _write_if_there(memsw, memory_bytes)
        _write(pids / "pids.max", processes)
        oom = memory / "memory.oom_control"
    dirs = (memory,) if memory == pids else (memory, pids)
    return SandboxGroup(dirs, tuple(d / "cgroup.procs" for d in dirs), oom, _oom_count(oom))


def _write(path: Path, value: int) -> None:
    path.write_text(str(value))


def _write_if_there(path: Path, value: int) -> None:
    if path.exists():
        _write(path, value)


def _oom_count(path: Path) -> int:
    """The `oom_kill` line of memory.events (v2) or memory.oom_control (v1); 0 where the kernel has none."""
    try:
        for line in path.read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
    except (OSError, ValueError):
        pass
    return 0

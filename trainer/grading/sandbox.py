"""The sandbox that runs a `python` grader's code: bubblewrap, as an unprivileged uid of its own.

A batch of samples costs one sandbox start: `PythonSandbox.grade_batch` starts the runner
(`trainer.grading.sandbox_runner`) under bubblewrap, sends it the source once, then each (sample, item) in turn, and
ends the sandbox when the batch is done. One sandbox per batch, not one kept alive across batches: the batch's CPU
budget is then the process's own RLIMIT_CPU, nothing of one batch (the grader's globals, its files in /tmp) reaches the
next, and a start is cheap: a batch of 1 sample took 80 ms (median of 15), one of 64 samples 93 ms, on a 2-core machine
busy with other work.

What the sandbox is (each point tested in tests/unit/trainer/test_sandbox.py):
- bubblewrap (`bwrap`, Debian's `bubblewrap`) with every namespace new: no network but its own loopback, no other
  process visible, `/proc` of its own. The filesystem is the interpreter's `/usr` read-only, a `/tmp` of
  `scratch_bytes`, a `/dev` with a 16 MiB `/dev/shm`, the runner and the optional packages folder read-only; no
  `/etc`, no home, no project folder. `/` and `/dev` are read-only. Creating user namespaces inside is refused
  (`--disable-userns`).
- The sandbox's environment is set from scratch (`--clearenv`), and bwrap itself starts with `PATH` alone.
- The runner is the pid namespace's pid 1 (`--as-pid-1`), so that our bwrap reaps it however it ends: under bwrap's
  own init, a runner that exits makes bwrap exit without reaping that init, and the host's init has to: a zombie of
  the slot's uid, counted against the slot's process limit meanwhile (forever where the host's pid 1 does not reap).
- It runs as an unprivileged uid of its own (`uid_base` + a slot claimed with `flock` in `slot_dir`), started with
  `setpriv`: RLIMIT_NPROC is not enforced for a process whose outer uid is 0, even inside a user namespace, and it
  counts every process and thread of a uid, so two sandboxes at once each need their own uid for each to get the
  limit. Starting as another uid needs root; `sandbox_available` says so when this process is not.
- Limits are set by `prlimit` on the command line rather than in a `preexec_fn`, which is not safe in a process with
  threads (the API's and the worker's): CPU seconds of the batch (RLIMIT_CPU; a sandbox restarted within the batch
  gets what is left), address space, processes of the uid, file size, open files, no core files.
- The sandbox as a whole, where the host lets this process make cgroups (`trainer.grading.cgroups`: v2, or v1's
  memory and pids hierarchies): a cgroup of its own bounds its processes' memory together, its scratch /tmp included
  (`memory_bytes`), and their number (`processes`); past the memory bound the sandbox is killed (`memory_limit`).
  Where the host does not, each process keeps its RLIMIT_AS only. A process logs which bound applies (`memory_bound`)
  and which packages as it starts its first sandbox (a warning where nothing bounds a sandbox as a whole). Entering
  the cgroups costs a start about 12 ms (cgroup v1 here: a batch of 1 sample took 41 ms against 29 ms, median of 40 on
  a 2-core machine): a migration to a cgroup waits for the kernel's RCU grace period.
- The parent enforces the rest: the wall time of each sample (past it the sandbox is killed, the sample scores 0.0
  with kind `timeout` and the batch goes on in a new sandbox, at most `max_restarts` times), the bytes the grader
  prints (`output_bytes` per sandbox, then killed: `output_limit`), the size of a reply.
- `--die-with-parent`: the sandbox dies with the thread that started it (grade_batch's caller: it runs no longer).

Scores: a finite number from `grade` is the score (what float() makes of it; not clipped); otherwise the sample
scores 0.0 with a `kind`: `exception`, `not_a_number`, `non_finite` (reported by the runner; OpenAI's
`python_grader_runtime_error`), `invalid_source` (the source does not parse, defines no usable `grade`, or its
top-level code raised or ran past `startup_timeout_s`: every sample; an import of a package that is not there is one),
`timeout`, `cpu_limit`, `memory_limit`, `output_limit`, `crash` (the sandbox died or answered garbage; OpenAI's
`python_grader_server_error` with that type). An error that
is not the grader's (bubblewrap cannot start, no uid slot is free) raises `SandboxUnavailable` instead.

A python environment of agent episodes runs in the same sandbox, one per episode: `SandboxSession` keeps a
sandbox, and its uid slot, for as long as the episode lasts, its runner `trainer.grading.environment_runner` answering
one request at a time (reset, then each step) within the wall time the caller gives each.

Checking a source (`check_source`) parses it in a sandbox too, never in the caller: a hostile 256 kB source takes
seconds of CPU and hundreds of MB to parse (measured: 6.5 s for an f-string of 87,000 placeholders).

The interpreter must lie under `/usr` (it is the only host folder mounted) and be readable by the slot's uid: Debian's
`/usr/bin/python3`, or `/usr/local/bin/python3` in the python Docker images. A pyenv or venv interpreter under
`/root` is neither. It must be Python ≥ 3.10 (the runner's syntax). It starts with `-I -S`: only the standard
library and `packages_dir` are importable, never the host's site-packages. `packages_dir` is the deployment's folder
of OpenAI's grader packages (`trainer/grading/sandbox_packages/`: its requirements, built by its `build` script for
this interpreter); a process's sandboxes use the one `configure_sandbox` gave it (the worker's trainer,
`proxima train/eval`), the API's the one its settings name (`api.services.graders.sandbox_config`).
"""

from __future__ import annotations

import fcntl
import json
import logging
import math
import os
import selectors
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager, suppress
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Literal, get_args

from trainer.grading import cgroups, sandbox_runner

ResultKind = Literal[
    "exception",
    "not_a_number",
    "non_finite",
    "invalid_source",
    "timeout",
    "cpu_limit",
    "memory_limit",
    "output_limit",
    "crash",
]
MAX_SOURCE_BYTES = sandbox_runner.MAX_SOURCE_BYTES
MAX_REPLY_BYTES = 64 << 10
"""The longest protocol line the parent reads (a reply holds a score or an error of at most 4000 characters)."""
OUTPUT_TAIL_BYTES = 2000
"""How much of what the grader printed last is quoted when its sandbox crashes."""
SANDBOX_ENV = {"PATH": "/usr/bin:/bin"}
"""bwrap's own environment: nothing of the service's, should any of it reach the sandbox (it does not: --clearenv)."""
PACKAGES_MOUNT = "/opt/grader-site"
RUNNER_MOUNT = "/sandbox/runner.py"
log = logging.getLogger("proxima.sandbox")
_RUNNER = Path(sandbox_runner.__file__).read_bytes()
assert len(_RUNNER) < 60_000, "the runner is sent to bwrap through a pipe, which must hold all of it"
_RUNNER_KINDS: frozenset[str] = frozenset(sandbox_runner.SAMPLE_ERROR_KINDS)
assert set(get_args(ResultKind)) >= _RUNNER_KINDS


class SandboxUnavailable(RuntimeError):
    """No sandbox could be started, for a reason that is not the grader's: its message says why."""


@dataclass(frozen=True)
class SandboxConfig:
    """Where the sandbox's parts are and its limits. The defaults follow OpenAI's python grader (2 min, 2 GB)."""

    python: str = "/usr/bin/python3"
    """The interpreter, under /usr (the only host folder the sandbox sees); Python ≥ 3.10."""
    packages_dir: Path | None = None
    """A folder of packages (`pip install --target`), bound read-only and put on sys.path; None: stdlib only."""
    sample_timeout_s: float = 10.0
    """Wall time of one sample's grade() call; past it the sandbox is killed and the sample scores 0.0 (`timeout`)."""
    startup_timeout_s: float = 30.0
    """Wall time for the sandbox to start and the source's top-level code (its imports) to run."""
    cpu_seconds: int = 120
    """CPU time of a batch, the sandbox's start and every restart included (RLIMIT_CPU); then `cpu_limit`."""
    address_space_bytes: int = 2 << 30
    """Address space of each process in the sandbox (RLIMIT_AS): a larger allocation raises MemoryError."""
    memory_bytes: int = 2 << 30
    """Memory of the whole sandbox, its processes and its scratch /tmp together, where its cgroup bounds it
    (`cgroups`); past it the sandbox is killed (`memory_limit`)."""
    processes: int = 64
    """Processes and threads of the sandbox's uid (RLIMIT_NPROC), bubblewrap's two included; in its cgroup, its
    tasks together (pids.max) as well."""
    cgroups: bool = True
    """Put each sandbox in a cgroup of its own (memory_bytes, processes) where the host allows it
    (`trainer.grading.cgroups`); False: the per-process limits alone."""
    file_size_bytes: int = 256 << 20
    """The largest file a process may write (RLIMIT_FSIZE)."""
    scratch_bytes: int = 256 << 20
    """Size of the writable /tmp (a tmpfs: host memory)."""
    output_bytes: int = 1 << 20
    """What one sandbox may print, stdout and stderr together; past it, killed (`output_limit`)."""
    open_files: int = 256
    max_restarts: int = 3
    """Sandboxes killed in one batch (timeout, crash, output) after which its remaining samples are not graded."""
    uid_base: int = 61000
    uid_slots: int = 16
    """The uids uid_base … uid_base + uid_slots - 1: one per concurrent sandbox, used by nothing else on the host."""
    slot_dir: Path = Path("/tmp/proxima-sandbox")
    """Where the uid slots' lock files are: the same folder for every process that uses these uids."""
    slot_wait_s: float = 60.0
    """How long a batch waits for a free uid slot before SandboxUnavailable."""
    bwrap: str = "bwrap"
    setpriv: str = "setpriv"
    prlimit: str = "prlimit"

    def __post_init__(self) -> None:
        positive = (
            "sample_timeout_s", "startup_timeout_s", "cpu_seconds", "address_space_bytes", "memory_bytes", "processes",
            "file_size_bytes", "scratch_bytes", "output_bytes", "open_files", "uid_slots", "slot_wait_s",
        )  # fmt: skip
        for name in positive:
            if not getattr(self, name) > 0:
                raise ValueError(f"SandboxConfig.{name} must be positive, not {getattr(self, name)!r}")
        if self.max_restarts < 0:
            raise ValueError(f"SandboxConfig.max_restarts must be 0 or more, not {self.max_restarts}")
        if not 1000 <= self.uid_base <= (1 << 31) - 1 - self.uid_slots:
            raise ValueError(f"SandboxConfig.uid_base must be an unprivileged uid (1000 or more), not {self.uid_base}")

    def to_json(self) -> dict[str, Any]:
        """The config as JSON values (how a worker hands it to its trainer process: `from_json`)."""
        return {f.name: _json_value(getattr(self, f.name)) for f in fields(self)}

    @classmethod
    def from_json(cls, values: Mapping[str, Any]) -> SandboxConfig:
        """The config `to_json` wrote; ValueError naming a field that is not one."""
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(values) - set(known))
        if unknown:
            raise ValueError(f"not fields of SandboxConfig: {', '.join(unknown)}")
        paths = {"packages_dir", "slot_dir"}
        kwargs: dict[str, Any] = {k: Path(v) if k in paths and v is not None else v for k, v in values.items()}
        return cls(**kwargs)


def _json_value(value: Any) -> Any:
    return str(value) if isinstance(value, Path) else value


@dataclass(frozen=True)
class Result:
    """One sample's grade: `score` (0.0 whenever `kind` is set), the error and its kind, and the wall time it took."""

    score: float
    error: str | None
    kind: ResultKind | None
    seconds: float


# ----------------------------------------------------------------------------------------------------
# The command line


def _tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        package = "bubblewrap" if Path(name).name == "bwrap" else "util-linux"
        raise SandboxUnavailable(f"{name} is not installed (Debian package {package})")
    return path


def sandbox_argv(
    config: SandboxConfig,
    *,
    uid: int,
    cpu_seconds: int,
    runner_fd: int,
    group: cgroups.SandboxGroup | None = None,
) -> list[str]:
    """The command that starts the runner in a sandbox as outer uid `uid`, inside `group` when given; `runner_fd` is a
    pipe holding the runner's source (inherited by bwrap, which copies it into the sandbox: no host path of the project
    is mounted)."""
    limits = [
        f"--cpu={cpu_seconds}:{cpu_seconds + 1}",  # SIGXCPU at the soft limit; SIGKILL a second later if ignored
        f"--as={config.address_space_bytes}",
        f"--nproc={config.processes}",
        f"--fsize={config.file_size_bytes}",
        f"--nofile={config.open_files}",
        "--core=0",
    ]
    drop = ["--clear-groups", "--inh-caps=-all", "--bounding-set=-all", "--no-new-privs"]
    bwrap = [
        "--unshare-all", "--unshare-user", "--die-with-parent", "--new-session", "--cap-drop", "ALL",
        "--clearenv", "--setenv", "PATH", "/usr/bin", "--setenv", "HOME", "/tmp", "--setenv", "TMPDIR", "/tmp",
        "--setenv", "LANG", "C.UTF-8", "--setenv", "OPENBLAS_NUM_THREADS", "1", "--setenv", "OMP_NUM_THREADS", "1",
        "--setenv", "MKL_NUM_THREADS", "1",
        "--ro-bind", "/usr", "/usr", "--symlink", "usr/lib", "/lib", "--symlink", "usr/lib64", "/lib64",
        "--symlink", "usr/bin", "/bin",
        "--proc", "/proc",
        "--dev", "/dev", "--size", str(16 << 20), "--tmpfs", "/dev/shm", "--remount-ro", "/dev",
        "--size", str(config.scratch_bytes), "--tmpfs", "/tmp",
        "--perms", "0444", "--ro-bind-data", str(runner_fd), RUNNER_MOUNT,
    ]  # fmt: skip
    runner_args: list[str] = []
    if config.packages_dir is not None:
        bwrap += ["--ro-bind", str(config.packages_dir), PACKAGES_MOUNT]
        runner_args = ["--site", PACKAGES_MOUNT]
    bwrap += ["--chdir", "/tmp", "--uid", "65534", "--gid", "65534", "--hostname", "sandbox", "--disable-userns"]
    bwrap += ["--as-pid-1"]  # reaped by our bwrap however it ends: see the module's docstring
    bwrap += ["--remount-ro", "/"]
    argv = [
        _tool(config.prlimit), *limits, "--",
        _tool(config.setpriv), f"--reuid={uid}", f"--regid={uid}", *drop, "--",
        _tool(config.bwrap), *bwrap, "--",
        config.python, "-I", "-S", "-B", RUNNER_MOUNT, *runner_args,
    ]  # fmt: skip
    return group.enter_argv(argv) if group is not None else argv


# ----------------------------------------------------------------------------------------------------
# uid slots


def _slot_processes(uid: int) -> list[int]:
    """The pids of the live processes (zombies left out) whose real uid is `uid`."""
    pids = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/status", "rb") as status:
                fields = dict(line.split(b":", 1) for line in status if line.startswith((b"State:", b"Uid:")))
            if int(fields[b"Uid"].split()[0]) == uid and not fields[b"State"].strip().startswith(b"Z"):
                pids.append(int(entry.name))
        except (OSError, ValueError, KeyError, IndexError):  # gone meanwhile
            continue
    return pids


def _cpu_seconds_of(pids: Sequence[int]) -> float:
    """CPU time of these processes and of the children they reaped (utime + stime + cutime + cstime)."""
    ticks = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat", "rb") as stat:
                fields = stat.read().rpartition(b")")[2].split()  # after the command name, which may hold spaces
            ticks += sum(int(f) for f in fields[11:15])
        except (OSError, ValueError):
            continue
    return ticks / os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class _Slot:
    """A uid slot held by this process, and its cgroups (None: the per-process limits alone)."""

    uid: int
    group: cgroups.SandboxGroup | None


def memory_bound(config: SandboxConfig) -> cgroups.Bound:
    """How a sandbox's memory is bounded as a whole here (`trainer.grading.cgroups`): `Bound.description` says it."""
    if not config.cgroups:
        return cgroups.Bound(None, reason="SandboxConfig.cgroups is off")
    return cgroups.detect()


def _slot_group(config: SandboxConfig, uid: int) -> cgroups.SandboxGroup | None:
    bound = memory_bound(config)
    _report(config, bound)
    try:
        return cgroups.make_group(bound, uid, memory_bytes=config.memory_bytes, processes=config.processes)
    except OSError as err:
        raise SandboxUnavailable(f"the sandbox's cgroup could not be made ({err})") from None


_REPORTED: set[tuple[cgroups.Bound, int, int, Path | None]] = set()


def _report(config: SandboxConfig, bound: cgroups.Bound) -> None:
    """Log which bound applies and which packages, once per process and kind of sandbox: at its first sandbox (a
    warning where nothing bounds a sandbox as a whole, which an operator should hear of)."""
    key = (bound, config.memory_bytes, config.processes, config.packages_dir)
    if key in _REPORTED:
        return
    _REPORTED.add(key)
    packages = f"packages from {config.packages_dir}" if config.packages_dir else "the standard library only"
    level = logging.INFO if bound.version is not None else logging.WARNING
    log.log(level, "%s; %s", bound.description(config.memory_bytes, config.processes), packages)


@contextmanager
def _uid_slot(config: SandboxConfig) -> Iterator[_Slot]:
    """A uid of the slot range that no other sandbox uses meanwhile (a lock file per uid, held with flock: released
    even when this process dies), with its cgroups. On release, kills what is left in the cgroups and removes them,
    then waits a little for the slot's processes to be gone, so that the next sandbox of this uid does not find its
    process limit taken by the last one's."""
    try:
        config.slot_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        info = config.slot_dir.stat()
    except OSError as err:
        raise SandboxUnavailable(f"the sandbox's slot folder {config.slot_dir} is not usable ({err})") from None
    if info.st_uid != os.geteuid() or info.st_mode & 0o022:
        raise SandboxUnavailable(
            f"the sandbox's slot folder {config.slot_dir} must be owned by uid {os.geteuid()} and writable by it alone"
        )
    first = (os.getpid() + threading.get_ident()) % config.uid_slots
    deadline = time.monotonic() + config.slot_wait_s
    while True:
        for n in range(config.uid_slots):
            uid = config.uid_base + (first + n) % config.uid_slots
            fd = os.open(config.slot_dir / f"uid-{uid}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            try:
                group = _slot_group(config, uid)
                try:
                    yield _Slot(uid, group)
                finally:
                    if group is not None:  # kills what the sandbox left in its groups: none outlives the slot
                        group.remove()
                    _wait_gone(uid, 2.0)
            finally:
                os.close(fd)  # releases the lock
            return
        if time.monotonic() > deadline:
            raise SandboxUnavailable(
                f"all {config.uid_slots} sandbox uid slots stayed busy for {config.slot_wait_s:g} s"
            )
        time.sleep(0.05)


def _wait_gone(uid: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while _slot_processes(uid) and time.monotonic() < deadline:
        time.sleep(0.01)


# ----------------------------------------------------------------------------------------------------
# One sandbox process


class _Stop(Exception):
    """The sandbox stopped answering: why (a result kind) and a message."""

    def __init__(self, kind: ResultKind, message: str) -> None:
        super().__init__(message)
        self.kind: ResultKind = kind
        self.message = message


class _Sandbox:
    """The runner in a sandbox, with the parent's ends of its pipes: stdin (requests), stdout (replies) and stderr
    (whatever the grader prints, counted and its tail kept). `runner`: the program's source (the python grader's
    by default; a `SandboxSession` brings its own), `max_reply_bytes`: the longest reply line read from it."""

    def __init__(
        self,
        config: SandboxConfig,
        *,
        slot: _Slot,
        cpu_seconds: int,
        runner: bytes = _RUNNER,
        max_reply_bytes: int = MAX_REPLY_BYTES,
    ) -> None:
        self.config = config
        self.uid = slot.uid
        self.group = slot.group
        self._oom_before = slot.group.oom_kills() if slot.group is not None else 0
        self.max_reply_bytes = max_reply_bytes
        read_end, write_end = os.pipe()
        try:
            os.write(write_end, runner)
            os.close(write_end)
            argv = sandbox_argv(config, uid=self.uid, cpu_seconds=cpu_seconds, runner_fd=read_end, group=self.group)
            self._proc = subprocess.Popen(
                argv,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env=SANDBOX_ENV,
                pass_fds=(read_end,),
                start_new_session=True,  # its own process group, killed as one; no signal meant for us reaches it
            )
        except OSError as err:
            raise SandboxUnavailable(f"the sandbox could not be started ({err})") from None
        finally:
            os.close(read_end)
        assert self._proc.stdin is not None and self._proc.stdout is not None and self._proc.stderr is not None
        self._stdin = self._proc.stdin.fileno()
        os.set_blocking(self._stdin, False)
        self._outbox = bytearray()
        self._replies = bytearray()
        self.output_bytes = 0
        self._output_tail = bytearray()
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._proc.stdout.fileno(), selectors.EVENT_READ, "replies")
        self._selector.register(self._proc.stderr.fileno(), selectors.EVENT_READ, "output")
        self._writing = False

    def send(self, message: Mapping[str, Any]) -> None:
        self._outbox += json.dumps(message).encode() + b"\n"
        if not self._writing and self._stdin >= 0:
            self._selector.register(self._stdin, selectors.EVENT_WRITE, "requests")
            self._writing = True

    def receive(self, deadline: float) -> dict[str, Any]:
        """The next reply, writing what is to be sent meanwhile; raises _Stop past `deadline` (monotonic), when the
        grader has printed too much, or when the sandbox has gone or sent something that is not a reply."""
        while (end := self._replies.find(b"\n")) == -1:
            if len(self._replies) > self.max_reply_bytes:
                raise _Stop("crash", f"the sandbox sent a reply longer than {self.max_reply_bytes} bytes")
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise _Stop("timeout", "")
            for key, _ in self._selector.select(remaining):
                if key.data == "requests":
                    self._write()
                elif key.data == "replies":
                    chunk = os.read(key.fd, 1 << 16)
                    if not chunk:
                        raise self._exited()
                    self._replies += chunk
                else:
                    self._read_output(key.fd)
        line = bytes(self._replies[:end])
        del self._replies[: end + 1]
        try:
            reply = json.loads(line)
        except ValueError:
            reply = None
        if not isinstance(reply, dict):
            raise _Stop("crash", "the sandbox sent something that is not a reply")
        if (memory := self._memory_stop()) is not None:  # a reply from a sandbox that lost a process to its bound
            raise memory
        return reply

    def _memory_stop(self) -> _Stop | None:
        """memory_limit when its cgroup's out-of-memory killer has killed one of its processes since it started."""
        if self.group is None or self.group.oom_kills() <= self._oom_before:
            return None
        return _Stop(
            "memory_limit",
            f"the sandbox's processes used more than {self.config.memory_bytes / (1 << 20):g} MiB of memory together"
            " (its whole-sandbox bound); killed",
        )

    def _write(self) -> None:
        try:
            written = os.write(self._stdin, self._outbox[: 1 << 16])
        except BlockingIOError:
            return
        except BrokenPipeError:  # it stopped reading: its exit shows on its output
            written = len(self._outbox)
        del self._outbox[:written]
        if not self._outbox:
            self._selector.unregister(self._stdin)
            self._writing = False

    def _read_output(self, fd: int) -> None:
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            self._selector.unregister(fd)
            return
        self.output_bytes += len(chunk)
        self._output_tail = (self._output_tail + chunk)[-OUTPUT_TAIL_BYTES:]
        if self.output_bytes > self.config.output_bytes:
            raise _Stop("output_limit", f"the grader printed more than {self.config.output_bytes} bytes")

    def _drain_output(self) -> None:
        """Read what is left of the output of a sandbox that has exited (its last words: a traceback, say)."""
        assert self._proc.stderr is not None
        fd = self._proc.stderr.fileno()
        deadline = time.monotonic() + 0.5
        try:
            while fd in self._selector.get_map() and (remaining := deadline - time.monotonic()) > 0:
                if self._selector.select(remaining):
                    self._read_output(fd)
        except _Stop:  # printed past the limit as it died: the exit is what it is reported for
            pass

    def output_tail(self) -> str:
        return self._output_tail.decode(errors="replace").strip()

    def _exited(self) -> _Stop:
        try:
            code = self._proc.wait(timeout=2.0)
        except subprocess.TimeoutExpired:
            return _Stop("crash", "the sandbox closed its replies" + self._quote_output())
        self._drain_output()
        if (memory := self._memory_stop()) is not None:
            return memory
        # bwrap exits with 128 + the signal that killed the runner; the runner, with 128 + SIGXCPU on that signal
        signum = -code if code < 0 else code - 128 if code > 128 else 0
        if signum == signal.SIGXCPU:
            return _Stop("cpu_limit", f"the batch's CPU time of {self.config.cpu_seconds} s is spent")
        how = f"was killed by {signal.Signals(signum).name}" if signum in signal.valid_signals() else f"exited ({code})"
        if signum == signal.SIGKILL:
            how += " (its CPU time's hard limit, or out of memory)"
        return _Stop("crash", f"the sandbox {how}" + self._quote_output())

    def _quote_output(self) -> str:
        tail = self.output_tail()
        return f"; it printed last:\n{tail}" if tail else ""

    def cpu_seconds(self) -> float:
        """CPU time its processes have used so far (read from /proc, as the sandbox's uid is its alone)."""
        return _cpu_seconds_of(_slot_processes(self.uid))

    def kill(self) -> None:
        """End the sandbox and reap it. Its pid 1 (the runner, a child of the bwrap we started) is killed first:
        that ends every process of its pid namespace, and our bwrap then exits and reaps it. Killing our bwrap
        first would leave its pid 1 to the host's init to reap: a zombie of the slot's uid, counted against the
        slot's process limit for as long as that init takes (seconds here; forever under an init that never reaps)."""
        if self._proc.poll() is None:
            for child in _children(self._proc.pid):  # a child cannot be reaped (nor its pid reused) before its parent
                with suppress(ProcessLookupError):
                    os.kill(child, signal.SIGKILL)
            try:
                self._proc.wait(timeout=2.0)
            except subprocess.TimeoutExpired:  # not started yet, or stuck: its group then
                with suppress(ProcessLookupError):
                    os.killpg(self._proc.pid, signal.SIGKILL)
                self._proc.wait()
        self._selector.close()
        for stream in (self._proc.stdin, self._proc.stdout, self._proc.stderr):
            if stream is not None:
                with suppress(OSError):
                    stream.close()

    def finish(self) -> None:
        """End a sandbox that has answered everything: its stdin closed, the runner exits, and bwrap with it."""
        with suppress(OSError):
            assert self._proc.stdin is not None
            self._proc.stdin.close()
        with suppress(subprocess.TimeoutExpired):
            self._proc.wait(timeout=1.0)
        self.kill()


def _await_started(sandbox: _Sandbox) -> None:
    """Wait for a new sandbox's `{"started": true}`; SandboxUnavailable when it does not come within
    `startup_timeout_s` (nothing of the tenant's has run yet, so what bwrap printed is safe to show)."""
    try:
        started = sandbox.receive(time.monotonic() + sandbox.config.startup_timeout_s)
    except _Stop as stop:
        detail = sandbox.output_tail() or stop.message or "no answer"
        if stop.kind == "timeout":
            detail = f"it did not start within {sandbox.config.startup_timeout_s:g} s"
        raise SandboxUnavailable(f"the sandbox did not start: {detail}") from None
    if started != {"started": True}:
        raise SandboxUnavailable(f"the sandbox did not start: it answered {started!r:.200}")


def _children(pid: int) -> list[int]:
    """The pids of the children of `pid` (Linux's task children file; else a scan of /proc)."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as children:
            return [int(child) for child in children.read().split()]
    except OSError:
        pass
    found = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                with open(f"/proc/{entry.name}/stat", "rb") as stat:
                    if int(stat.read().rpartition(b")")[2].split()[1]) == pid:
                        found.append(int(entry.name))
            except (OSError, ValueError, IndexError):
                continue
    return found


# ----------------------------------------------------------------------------------------------------
# Batches


class PythonSandbox:
    """Grades batches of samples with a python grader's source, one sandbox per batch. Thread-safe: concurrent
    batches take different uid slots. `starts` counts the sandboxes started (restarts and checks included)."""

    def __init__(self, config: SandboxConfig | None = None) -> None:
        self._config = config
        self.starts = 0
        self._lock = threading.Lock()

    @property
    def config(self) -> SandboxConfig:
        """The config it was given, else this process's (`configure_sandbox`), read at each batch."""
        return self._config or configured_sandbox()

    def _start(
        self, slot: _Slot, cpu_seconds: int, first: Mapping[str, Any], reply_timeout_s: float
    ) -> tuple[_Sandbox, dict[str, Any]]:
        """A started sandbox that has been sent `first`, and its reply to it within `reply_timeout_s`. Raises
        SandboxUnavailable when it did not start (nothing of the grader's has run then, so what bwrap printed is
        safe to show), _Stop when its answer to `first` took too long, or it printed too much or died meanwhile."""
        with self._lock:
            self.starts += 1
        sandbox = _Sandbox(self.config, slot=slot, cpu_seconds=cpu_seconds)
        try:
            _await_started(sandbox)
            sandbox.send(first)
            return sandbox, sandbox.receive(time.monotonic() + reply_timeout_s)
        except BaseException:
            sandbox.kill()
            raise

    def check_source(self, source: str) -> str | None:
        """What is wrong with `source` (`trainer.grading.sandbox_runner.source_problem`: size, syntax, a top-level
        `grade` taking two positional arguments), or None; nothing of the source runs. The parsing is done in a sandbox,
        within `sample_timeout_s`: hostile source can take seconds of CPU and hundreds of MB to parse (a 256 kB
        f-string of placeholders: 6.5 s), which no API thread should spend. Raises SandboxUnavailable."""
        problem = _size_problem(source)
        if problem is not None:
            return problem
        with _uid_slot(self.config) as slot:
            try:
                sandbox, reply = self._start(
                    slot, self.config.cpu_seconds, {"check": source}, self.config.sample_timeout_s
                )
            except _Stop as stop:
                if stop.kind == "timeout":
                    return f"source took longer than {self.config.sample_timeout_s:g} s to parse"
                return f"source could not be parsed ({stop.kind}: {stop.message})"
            sandbox.kill()
        problem = reply.get("problem", 0)
        if len(reply) != 1 or (problem is not None and not isinstance(problem, str)):
            raise SandboxUnavailable("the sandbox answered something that is not a source check")
        return problem

    def grade_batch(
        self, source: str, samples: Sequence[Mapping[str, Any]], items: Sequence[Mapping[str, Any]]
    ) -> list[Result]:
        """Grade each (sample, item) with the `grade` that `source` defines: one Result per sample, in order.
        Raises SandboxUnavailable when no sandbox could be started (nothing about the grader is known then)."""
        if len(samples) != len(items):
            raise ValueError(f"{len(samples)} samples but {len(items)} items")
        if not samples:
            return []
        problem = _size_problem(source)
        if problem is not None:
            return [Result(0.0, problem, "invalid_source", 0.0)] * len(samples)
        results: list[Result] = []
        with _uid_slot(self.config) as slot:
            cpu_left = float(self.config.cpu_seconds)
            kills = 0
            while len(results) < len(samples):
                stop = self._run(slot, max(1, int(cpu_left)), source, samples, items, results)
                if stop is None:
                    break
                stopped, cpu_used = stop
                cpu_left -= cpu_used
                if stopped.kind == "invalid_source":  # every sample, the same way
                    rest = Result(0.0, stopped.message, "invalid_source", 0.0)
                elif stopped.kind == "cpu_limit" or cpu_left < 1:
                    spent = f"not graded: the batch's CPU time of {self.config.cpu_seconds} s is spent"
                    rest = Result(0.0, spent, "cpu_limit", 0.0)
                else:
                    kills += 1
                    if kills <= self.config.max_restarts:
                        continue
                    message = f"not graded: {kills} sandboxes of this batch were killed (the last: {stopped.kind})"
                    rest = Result(0.0, message, stopped.kind, 0.0)
                results += [rest] * (len(samples) - len(results))
        return results

    def _run(
        self,
        slot: _Slot,
        cpu_seconds: int,
        source: str,
        samples: Sequence[Mapping[str, Any]],
        items: Sequence[Mapping[str, Any]],
        results: list[Result],
    ) -> tuple[_Stop, float] | None:
        """Grade the samples after `results` in one sandbox, appending to `results`: None when all are graded, else
        why it stopped (a result for the sample it stopped at is appended, unless it stopped before the first
        sample) and the CPU seconds it used."""
        try:
            sandbox, ready = self._start(slot, cpu_seconds, {"source": source}, self.config.startup_timeout_s)
        except _Stop as stop:
            if stop.kind == "timeout":
                stop = _Stop(
                    "invalid_source",
                    f"the grader's top-level code took longer than {self.config.startup_timeout_s:g} s",
                )
            elif stop.kind not in ("cpu_limit", "memory_limit"):
                stop = _Stop("invalid_source", f"the grader's top-level code failed: {stop.message}")
            return stop, float(cpu_seconds)
        finished = False
        try:
            if "fatal" in ready:
                return _Stop("invalid_source", str(ready["fatal"])[: sandbox_runner.MAX_ERROR_CHARS]), 0.0
            if ready != {"ready": True}:
                return self._stopped(sandbox, _Stop("crash", "the sandbox answered something that is not ready"))
            for i in range(len(results), len(samples)):
                sandbox.send({"i": i, "sample": samples[i], "item": items[i]})
                start = time.monotonic()
                try:
                    reply = sandbox.receive(start + self.config.sample_timeout_s)
                    result = _result(reply, i, time.monotonic() - start)
                except _Stop as stop:
                    if stop.kind == "timeout":
                        stop.message = f"grade took longer than {self.config.sample_timeout_s:g} s"
                    results.append(Result(0.0, stop.message, stop.kind, time.monotonic() - start))
                    return self._stopped(sandbox, stop)
                results.append(result)
            finished = True
            return None
        finally:
            if finished:
                sandbox.finish()
            else:
                sandbox.kill()

    @staticmethod
    def _stopped(sandbox: _Sandbox, stop: _Stop) -> tuple[_Stop, float]:
        return stop, sandbox.cpu_seconds()  # read before kill() (in _run's finally) ends its processes


def _size_problem(source: str) -> str | None:
    """The part of the source's check that needs no parsing (done before anything is sent to a sandbox)."""
    try:
        size = len(source.encode("utf-8"))
    except UnicodeEncodeError:
        return "source is not valid UTF-8 text"
    if size > MAX_SOURCE_BYTES:
        return f"source is {size} bytes long; at most {MAX_SOURCE_BYTES} bytes are allowed"
    return None


def _result(reply: Mapping[str, Any], i: int, seconds: float) -> Result:
    """The Result a reply for sample `i` holds; _Stop when it is not one."""
    if reply.get("i") != i or isinstance(reply.get("i"), bool):
        raise _Stop("crash", f"the sandbox answered for another sample than #{i}")
    score = reply.get("score")
    if len(reply) == 2 and isinstance(score, int | float) and not isinstance(score, bool) and math.isfinite(score):
        return Result(float(score), None, None, seconds)  # finite: json.loads reads NaN, which a forged reply can hold
    kind, error = reply.get("kind"), reply.get("error")
    if len(reply) == 3 and kind in _RUNNER_KINDS and isinstance(error, str):
        return Result(0.0, error[: sandbox_runner.MAX_ERROR_CHARS], kind, seconds)
    raise _Stop("crash", "the sandbox sent something that is not a result")


# ----------------------------------------------------------------------------------------------------
# Sessions


class SessionStopped(Exception):
    """A session's sandbox stopped answering, and has been killed: why (`timeout`, `cpu_limit`, `output_limit`,
    `crash`) and what happened."""

    def __init__(self, kind: ResultKind, message: str) -> None:
        super().__init__(message)
        self.kind: ResultKind = kind
        self.message = message


class SandboxSession:
    """One sandbox kept for a conversation of requests rather than a batch (a python environment's episode: reset,
    then each step), under the same bubblewrap, uid slot and limits as a grading batch.

    `runner` is the program's source (standard library only; bound at RUNNER_MOUNT as the grader's runner is), which
    speaks JSON lines on stdin and stdout and says `{"started": true}` first. The session holds its uid slot until
    `close`: at most `config.uid_slots` sessions and grading batches run at once on a host, more wait for a slot up
    to `slot_wait_s`. Its CPU time is `config.cpu_seconds` in all (the sandbox's RLIMIT_CPU); the wall time of each
    request is the caller's to give. Not thread-safe: one request at a time. Raises SandboxUnavailable when no
    sandbox starts."""

    def __init__(self, config: SandboxConfig, runner: bytes, *, max_reply_bytes: int = MAX_REPLY_BYTES) -> None:
        self.config = config
        self._slot = ExitStack()
        self._sandbox: _Sandbox | None = None
        try:
            slot = self._slot.enter_context(_uid_slot(config))
            self._sandbox = _Sandbox(
                config, slot=slot, cpu_seconds=config.cpu_seconds, runner=runner, max_reply_bytes=max_reply_bytes
            )
            _await_started(self._sandbox)
        except BaseException:
            self.close()
            raise

    @property
    def alive(self) -> bool:
        """Whether the sandbox still runs (not closed, not stopped)."""
        return self._sandbox is not None

    def request(self, message: Mapping[str, Any], timeout_s: float) -> dict[str, Any]:
        """Send `message`; the reply (a JSON object) within `timeout_s` of wall time. Raises SessionStopped, the
        sandbox killed and its slot released, when the reply took longer, the program printed more than
        `output_bytes`, ran out of CPU time, died or answered something that is not a JSON object line; RuntimeError
        once the session is closed."""
        if self._sandbox is None:
            raise RuntimeError("the sandbox session is closed")
        self._sandbox.send(message)
        try:
            return self._sandbox.receive(time.monotonic() + timeout_s)
        except _Stop as stop:
            self.close()
            raise SessionStopped(stop.kind, stop.message or f"no answer within {timeout_s:g} s") from None

    def close(self, *, graceful: bool = False) -> None:
        """End the sandbox and release its uid slot; `graceful`: close its stdin first so that the runner can exit on
        its own (what is left is killed a second later). Idempotent."""
        sandbox, self._sandbox = self._sandbox, None
        try:
            if sandbox is not None:
                if graceful:
                    sandbox.finish()
                else:
                    sandbox.kill()
        finally:
            self._slot.close()


# ----------------------------------------------------------------------------------------------------
# This process's sandbox, and its packages

BUILT_PACKAGES = (Path(__file__).resolve().parents[2] / "build" / "sandbox-packages").resolve()
"""The packages folder `make sandbox-packages` built for a checkout (`trainer/grading/sandbox_packages/`): what the
checkout's `build/sandbox-packages` links to (a folder the sandboxes' uids can reach wherever the checkout is)."""


def default_packages_dir() -> Path | None:
    """The packages folder `make sandbox-packages` built in this checkout, None where there is none (an installed
    package, or a checkout that has not built it): what `PROXIMA_SANDBOX_PACKAGES` and `proxima train/eval
    --sandbox-packages` default to. A built folder the sandboxes cannot use (a checkout under a folder only its owner
    can search, such as /root) is None too, with a warning saying why: python graders then run on the standard
    library, as they would without the folder, where mounting it would refuse every sandbox."""
    built = BUILT_PACKAGES
    if not built.is_dir():
        return None
    problem = packages_dir_problem(built)
    if problem is not None:
        log.warning(
            "python sandboxes: the standard library only: the checkout's built packages cannot be mounted (%s); set "
            "PROXIMA_SANDBOX_PACKAGES or --sandbox-packages to a folder every uid can read",
            problem,
        )
        return None
    return built


def packages_dir_problem(path: Path) -> str | None:
    """Why `path` cannot be a sandbox's packages folder, or None: it must be an absolute path to a folder that the
    sandboxes' unprivileged uids can read (bubblewrap binds it as theirs: each folder above it searchable by all)."""
    if not path.is_absolute():
        return f"{path} is not an absolute path"
    if not path.exists():
        return f"{path} is not there"
    if not path.is_dir():
        return f"{path} is not a folder"
    if path.stat().st_mode & 0o005 != 0o005:
        return (
            f"{path} is not readable by every uid (mode {path.stat().st_mode & 0o777:o}); the sandboxes' uids need it"
        )
    for parent in path.parents:
        if parent.stat().st_mode & 0o001 == 0:
            return f"{parent}, above {path}, cannot be searched by every uid (mode {parent.stat().st_mode & 0o777:o})"
    return None


_configured = SandboxConfig()


def configure_sandbox(config: SandboxConfig) -> None:
    """This process's python graders' and python environments' sandbox (its packages folder and limits), as the
    worker hands it to its trainer process (`worker.runner`) or the command line sets it (`proxima train/eval
    --sandbox-packages`). Until it is called, a process has SandboxConfig's defaults: the standard library only."""
    global _configured
    _configured = config


def configured_sandbox() -> SandboxConfig:
    """This process's sandbox config (`configure_sandbox`)."""
    return _configured


# ----------------------------------------------------------------------------------------------------
# Availability


def sandbox_available(config: SandboxConfig | None = None) -> str | None:
    """None when python graders can run here with `config`; else why not, in a sentence for an operator (or a 400).
    Checks the parts, then starts a sandbox and grades one sample. Success is kept for the process's lifetime; a
    failure is checked again on the next call (a passing one, such as every uid slot busy, must not last)."""
    config = config or configured_sandbox()
    if config in _AVAILABLE:
        return None
    problem = _available(config)
    if problem is None:
        _AVAILABLE.add(config)
    return problem


_AVAILABLE: set[SandboxConfig] = set()


def _available(config: SandboxConfig) -> str | None:
    if not sys.platform.startswith("linux"):
        return f"python graders need Linux (bubblewrap); this is {sys.platform}"
    try:
        for tool in (config.bwrap, config.setpriv, config.prlimit):
            _tool(tool)
    except SandboxUnavailable as err:
        return str(err)
    if os.geteuid() != 0:
        return (
            f"python graders start their sandboxes as uids {config.uid_base}–{config.uid_base + config.uid_slots - 1}"
            f" (setpriv), which needs root; this process runs as uid {os.geteuid()}"
        )
    python = Path(config.python)
    if not python.is_absolute() or python.parts[:2] != ("/", "usr"):
        return f"the sandbox's interpreter must be an absolute path under /usr, not {config.python}"
    if not os.access(python, os.X_OK):
        return f"the sandbox's interpreter {config.python} is not there"
    if config.packages_dir is not None and (problem := packages_dir_problem(config.packages_dir)) is not None:
        return f"the sandbox's packages folder {problem}"
    probe = "def grade(sample, item):\n    return 1.0\n"
    try:
        [result] = PythonSandbox(config).grade_batch(probe, [{}], [{}])
    except SandboxUnavailable as err:
        return str(err)
    if result.kind is not None:
        return f"the sandbox started but could not grade a sample: {result.kind}: {result.error}"
    return None


def check_source(source: str, config: SandboxConfig | None = None) -> str | None:
    """What is wrong with a python grader's source, or None: `PythonSandbox.check_source` (parsed in a sandbox)."""
    return PythonSandbox(config).check_source(source)

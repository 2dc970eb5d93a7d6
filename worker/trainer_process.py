"""The trainer's child process (``python -m worker.runner RUN_DIR``) as its worker drives it: its messages, a stop
that does not depend on its cooperation, and how it ended.

A stop (cancel or pause) is first asked for on the trainer's stdin (``worker.messages.STOP``); a trainer that has not
exited ``stop_grace_s`` later is sent SIGTERM, and SIGKILL ``min(stop_grace_s, KILL_AFTER_TERM_S)`` after that, so
a trainer stuck in a step (a grader that never returns, native code holding the GIL) cannot keep a cancelled job
running. The trainer, for its part, exits when its worker dies (``worker.runner``).

A trainer killed by SIGKILL that this worker did not send was killed by someone else, on a worker almost always the
kernel's out-of-memory killer. Where the kernel says so (the ``oom_kill`` counter of the trainer's memory cgroup:
``memory.events`` in cgroup v2, ``memory.oom_control`` in v1) :attr:`TrainerProcess.oom_confirmed` is True; the
counter counts the kills of that cgroup's own limit, so a kill for the whole machine's memory, or a kill where the
cgroup files are not readable, leaves it None or False, and the SIGKILL alone is the evidence.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Mapping
from pathlib import Path
from typing import IO

from pydantic import ValidationError

from worker import messages as msg

log = logging.getLogger("proxima.worker")

KILL_AFTER_TERM_S = 10.0
EXITED_WITHOUT_EOF_S = 5.0
"""How long the message stream may stay open after the trainer exited (a grandchild holding it) before it counts as
closed."""

CGROUP_ROOT = Path("/sys/fs/cgroup")


class Ended(Exception):
    """The trainer's message stream is closed: it exited (or is exiting)."""


class TrainerProcess:
    def __init__(
        self, run_dir: Path, *, stop_grace_s: float, env: Mapping[str, str] | None = None, ranks: int | None = None
    ) -> None:
        """Start `python -m worker.runner RUN_DIR` (with `ranks`: `python -m worker.launch RANKS RUN_DIR`, that many
        ranks of it under torch's launcher, one per device); `env`: variables added to this process's for it (the
        remote graders' configuration, with its API keys: in the environment, never on the command line, which any
        user of the machine can read)."""
        self.stop_grace_s = stop_grace_s
        self.stderr_path = run_dir / "stderr.log"
        with self.stderr_path.open("ab") as err_file:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "worker.runner", str(run_dir)]
                if ranks is None
                else [sys.executable, "-m", "worker.launch", str(ranks), str(run_dir)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=err_file,
                text=True,
                encoding="utf-8",
                env={**os.environ, **(env or {}), msg.PARENT_PID_ENV: str(os.getpid())},
            )
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.pid = self.proc.pid
        self._oom_file = oom_counter_file(self.pid)
        self._oom_before = read_oom_kills(self._oom_file)
        self._messages: queue.Queue[msg.RunnerMessage | None] = queue.Queue()
        threading.Thread(target=_read_messages, args=(self.proc.stdout, self._messages), daemon=True).start()
        self.stop_sent_at: float | None = None
        self.sent_signals: list[signal.Signals] = []
        self._exited_at: float | None = None

    # -- messages -------------------------------------------------------------------------------------------------

    def get(self, timeout: float) -> msg.RunnerMessage | None:
        """The next message, or None when none came within ``timeout``; :class:`Ended` once the stream is closed."""
        try:
            message = self._messages.get(timeout=timeout)
        except queue.Empty:
            if self.proc.poll() is not None:
                self._exited_at = self._exited_at or time.monotonic()
                if time.monotonic() - self._exited_at > EXITED_WITHOUT_EOF_S:
                    raise Ended from None
            return None
        if message is None:
            raise Ended
        return message

    # -- stopping -------------------------------------------------------------------------------------------------

    def stop(self) -> None:
        """Ask the trainer to stop at the next step boundary (once); :meth:`enforce_stop` sees that it does."""
        if self.stop_sent_at is not None:
            return
        self.stop_sent_at = time.monotonic()
        stdin = self.proc.stdin
        assert stdin is not None
        with contextlib.suppress(OSError, ValueError):  # the trainer already exited
            stdin.write(msg.STOP + "\n")
            stdin.flush()

    def enforce_stop(self) -> signal.Signals | None:
        """After a stop request, terminate a trainer that outlived the grace period, and kill one that outlived the
        termination; the signal sent now, if any."""
        if self.stop_sent_at is None or self.proc.poll() is not None:
            return None
        waited = time.monotonic() - self.stop_sent_at
        kill_at = self.stop_grace_s + min(self.stop_grace_s, KILL_AFTER_TERM_S)
        if waited >= kill_at and signal.SIGKILL not in self.sent_signals:
            self._signal(signal.SIGKILL)
            return signal.SIGKILL
        if waited >= self.stop_grace_s and not self.sent_signals:
            self._signal(signal.SIGTERM)
            return signal.SIGTERM
        return None

    def kill(self) -> None:
        """Kill the trainer now and reap it."""
        if self.proc.poll() is None:
            self._signal(signal.SIGKILL)
        self.proc.wait()

    def _signal(self, sig: signal.Signals) -> None:
        self.sent_signals.append(sig)
        with contextlib.suppress(ProcessLookupError):
            self.proc.send_signal(sig)

    @property
    def forced(self) -> bool:
        """Whether this worker terminated or killed the trainer."""
        return bool(self.sent_signals)

    # -- the end --------------------------------------------------------------------------------------------------

    def close(self) -> int:
        """Close the control channel and wait for the exit; the return code (negative: the signal that ended it)."""
        stdin = self.proc.stdin
        assert stdin is not None
        with contextlib.suppress(OSError):  # BrokenPipeError: the trainer already exited
            stdin.close()
        return self.proc.wait()

    @property
    def killed_by_someone_else(self) -> bool:
        """Ended by a SIGKILL this worker did not send (the kernel's out-of-memory killer, or an operator)."""
        return self.proc.returncode == -signal.SIGKILL and signal.SIGKILL not in self.sent_signals

    @property
    def oom_confirmed(self) -> bool | None:
        """Whether the kernel counted an out-of-memory kill in the trainer's cgroup while it ran; None when it cannot
        tell (no readable cgroup counter)."""
        after = read_oom_kills(self._oom_file)
        if self._oom_before is None or after is None:
            return None
        return after > self._oom_before

    def stderr_tail(self, lines: int) -> str:
        try:
            text = self.stderr_path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            return ""
        return "\n".join(deque(text.splitlines(), maxlen=lines))


def oom_counter_file(pid: int) -> Path | None:
    """The file holding the ``oom_kill`` counter of ``pid``'s memory cgroup (v2 or v1), None if none is readable.
    Inside a container the cgroup named in /proc may be mounted as the root, so the root's file is the fallback."""
    try:
        lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
    except OSError:
        return None
    candidates = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        rel = path.lstrip("/")
        if controllers == "":  # cgroup v2
            candidates += [CGROUP_ROOT / rel / "memory.events", CGROUP_ROOT / "memory.events"]
        elif "memory" in controllers.split(","):
            v1 = CGROUP_ROOT / "memory"
            candidates += [v1 / rel / "memory.oom_control", v1 / "memory.oom_control"]
    return next((c for c in candidates if read_oom_kills(c) is not None), None)


def read_oom_kills(path: Path | None) -> int | None:
    if path is None:
        return None
    try:
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == "oom_kill":
                return int(value)
    except (OSError, ValueError):
        return None
    return None


def _read_messages(stream: IO[str], out: queue.Queue[msg.RunnerMessage | None]) -> None:
    """Each line of the trainer's stdout parsed once into its typed message; a line that is not one is logged and
    dropped (the trainer's own output goes to stderr, so this is a protocol bug, not the user's)."""
    try:
        for line in stream:
            line = line.strip()
            if not line:
                continue
            try:
                out.put(msg.decode(line))
            except ValidationError as err:
                log.warning("unreadable message from the trainer (%s): %.200s", err.errors()[0]["msg"], line)
    finally:
        out.put(None)

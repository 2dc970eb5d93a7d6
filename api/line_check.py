"""Checking an upload's lines: every non-blank line a JSON object whose values the service can store and send back
(``trainer.spec.json_values``), and whose messages a fine-tuning method can keep whole (``trainer.spec.chat``: the
first problem is noted, and refuses the upload if its purpose is ``fine-tune``).

Checking costs about 9 ms of CPU per MiB in Python (1 KB lines: 4.3 ms for the JSON, as much again for the messages,
best of 5 on a 2-core EPYC), with the GIL held: done in an API thread, a 512 MiB
upload held the GIL for seconds and every other tenant's requests waited behind it (tenant A's p99 went from 13
to 88 ms while tenant B uploaded). So an upload is checked here for its first ``IN_PROCESS_BYTES`` (most datasets,
and every small test file, never leave the process), and past that by a child process (``python -m api.line_check``)
fed through a pipe: the API's thread only copies bytes, which releases the GIL. The child starts where the API
stopped (line number, count and the partial last line), so the outcome is the same whichever side checks a line.

A bad line is a :class:`LineError` naming it; the child reports the first one and exits, and the API stops reading
the upload at its next write."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from dataclasses import asdict, dataclass
from typing import IO

from trainer.spec import chat, json_values

IN_PROCESS_BYTES = 1 << 20
_READ_BYTES = 1 << 20


class LineError(ValueError):
    """A line that is not a JSON object the service can hold, or an empty file; the message names the line."""


class CheckerUnavailable(RuntimeError):
    """The checking process could not start or died without an answer."""


@dataclass
class LineChecker:
    """Splits a byte stream into lines across chunk boundaries and checks each non-blank line. The messages a line
    holds are checked too (``trainer.spec.chat.check_line_messages``), the first problem kept in ``chat_problem``
    rather than raised: it refuses a fine-tuning dataset, not an eval's rows, and the purpose may follow the file."""

    lines: int = 0  # non-blank lines seen
    number: int = 0  # physical line number, for messages
    rest: bytes = b""  # the last line's start, until its newline arrives
    chat_problem: str | None = None

    def feed(self, chunk: bytes) -> None:
        data = self.rest + chunk
        *complete, self.rest = data.split(b"\n")
        for raw in complete:
            self._line(raw)

    def close(self) -> None:
        if self.rest:
            self._line(self.rest)
            self.rest = b""
        if not self.lines:
            raise LineError("the file is empty: expected one JSON object per line")

    def _line(self, raw: bytes) -> None:
        self.number += 1
        n = self.number
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise LineError(f"line {n}: not valid UTF-8") from None
        if not text.strip():
            return
        try:
            obj = json_values.loads(text)
        except json_values.JsonValueError as err:
            raise LineError(f"line {n}: {err}") from None
        if not isinstance(obj, dict):
            raise LineError(f"line {n}: expected a JSON object, got {type(obj).__name__}")
        if self.chat_problem is None:
            try:
                chat.check_line_messages(obj)
            except ValueError as err:
                self.chat_problem = f"line {n}: {err}"
        self.lines += 1


class UploadChecker:
    """:class:`LineChecker`'s ``feed``/``close``, in this process for the first ``in_process_bytes``, then in a
    child process. ``lines`` is the count once ``close`` returned. Always ``close`` or ``abort`` it."""

    def __init__(self, *, in_process_bytes: int | None = None) -> None:
        self._local = LineChecker()
        self._budget = IN_PROCESS_BYTES if in_process_bytes is None else in_process_bytes
        self._child: subprocess.Popen[bytes] | None = None
        self.lines = 0
        self.chat_problem: str | None = None  # once closed: the first message no fine-tuning method can keep whole

    def feed(self, chunk: bytes) -> None:
        if self._child is None:
            head, chunk = chunk[: self._budget], chunk[self._budget :]
            self._budget -= len(head)
            self._local.feed(head)
            if not chunk:
                return
            self._child = _start(self._local)
        assert self._child.stdin is not None
        try:
            self._child.stdin.write(chunk)
        except BrokenPipeError:  # the child found a bad line and stopped reading
            self._finish()

    def close(self) -> None:
        if self._child is None:
            self._local.close()
            self.lines = self._local.lines
            self.chat_problem = self._local.chat_problem
        else:
            self._finish()

    def abort(self) -> None:
        """Stop the child, if any, without an answer (the upload failed for another reason)."""
        if self._child is not None:
            self._child.kill()
            with contextlib.suppress(OSError):
                _close(self._child.stdin)
                _close(self._child.stdout)
            self._child.wait()

    def _finish(self) -> None:
        """Read the child's answer: the line count, or raise its :class:`LineError`."""
        child = self._child
        assert child is not None and child.stdout is not None
        with contextlib.suppress(BrokenPipeError):
            _close(child.stdin)
        answer = child.stdout.read()
        child.wait()
        try:
            result = json.loads(answer)
        except ValueError:
            raise CheckerUnavailable(f"the line checker ended with code {child.returncode} and no answer") from None
        if "error" in result:
            raise LineError(result["error"])
        self.lines = int(result["lines"])
        self.chat_problem = result["chat_problem"]


def _start(state: LineChecker) -> subprocess.Popen[bytes]:
    try:
        child = subprocess.Popen(
            [sys.executable, "-m", "api.line_check"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
        )
    except OSError as err:
        raise CheckerUnavailable(f"the line checker could not start: {err}") from None
    assert child.stdin is not None
    header = {**asdict(state), "rest": state.rest.hex()}
    child.stdin.write(json.dumps(header).encode() + b"\n")
    return child


def _close(stream: IO[bytes] | None) -> None:
    if stream is not None:
        stream.close()


CHILD_NICENESS = 10
"""The checking child yields the CPU to the API's process: on a machine with few cores a large upload's check would
otherwise take a core from the requests of every other tenant (the upload itself is throttled by it: the API writes
into the child's pipe only as fast as it checks)."""


def main() -> int:
    """The child: a header line with the checker's state, then the rest of the upload; one JSON answer on stdout."""
    with contextlib.suppress(OSError):
        os.nice(CHILD_NICENESS)
    stdin = sys.stdin.buffer
    header = json.loads(stdin.readline())
    checker = LineChecker(
        lines=header["lines"],
        number=header["number"],
        rest=bytes.fromhex(header["rest"]),
        chat_problem=header["chat_problem"],
    )
    answer: dict[str, int | str | None]
    try:
        while chunk := stdin.read(_READ_BYTES):
            checker.feed(chunk)
        checker.close()
    except LineError as err:
        answer = {"error": str(err)}
    else:
        answer = {"lines": checker.lines, "chat_problem": checker.chat_problem}
    sys.stdout.write(json.dumps(answer))
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

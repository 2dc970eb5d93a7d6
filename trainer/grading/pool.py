"""Grading in processes of their own, with a hard time limit per sample (a grader never runs on the API's
threads, and every grader has a per-sample time budget).

`trainer.grading.graders` keeps each grading step linear and its inputs capped; this module makes the time limit hard. A
`GradingPool` keeps a few grading processes (`python -c "...serve()"`: they import `trainer.grading.graders` and nothing
heavier, torch least of all) and sends each one a batch: a grader and its samples. A sample that has not come back
within its limit, even one stuck in a C call that holds the GIL, gets its process killed and a `timeout` error flag
(scored 0.0); the batch goes on in a fresh process. A process that dies is replaced the same way. The API grades its
dry-runs here (`api.services.graders`), the trainer every batch of rewards (`trainer.loops.evaluate.grade_batch`).

The processes speak JSON lines, never pickle, so that a process need not be trusted: a later sandboxed grader (a
`python` grader under bubblewrap, a process per batch) is a `GradingProcess` started with another command and
speaking the same protocol, and whatever it answers is checked before it becomes a `GradeResult`:

    process → parent, once started:  {"ready": true}
    parent → process, per batch:     {"grader": {...}, "samples": [{"output_text", "item", "model_scores",
                                                                    "output_tools"?}, ...]}
    process → parent:                {"grader": {...as validated...}} or {"grader_error": {"message", "param"}};
                                     then per sample {"score", "sub_scores", "errors": [[message, kind], ...]}, or
                                     {"grader_error": ...}, which ends the batch (a reward_model leaf without scores)
"""

from __future__ import annotations

import atexit
import functools
import json
import os
import queue
import selectors
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, get_args

from trainer.grading import graders as scoring
from trainer.grading import similarity
from trainer.spec import graders

SAMPLE_TIMEOUT_S = 10.0
"""The default time limit of one sample (and of validating the grader). Grading one sample takes microseconds to a
few tens of milliseconds (trainer.grading.graders caps every input), so this is a limit for what should never happen."""
MAX_TIMEOUTS_PER_BATCH = 3
"""After this many samples of a batch time out, its remaining samples are scored as timed out without being graded:
a batch takes at most about this many time limits more than its grading, so a cancel never waits on a broken grader."""
STARTUP_TIMEOUT_S = 60.0
"""How long a grading process may take to start (import its modules); not counted against any sample."""
PREPARE_TIMEOUT_S = 30.0
"""The time a grading process is allowed, on top of validating a grader, to load what the grader's text_similarity
metrics need the first time it meets them (nltk and rouge-score: about a second; meteor's WordNet: 3 to 5 s), so that
a sample's own limit never pays for it."""
PROCESS_MEMORY_BYTES = 2 << 30
"""The address space of a grading process (RLIMIT_AS): a grader that would need more fails its sample."""
MAX_REPLY_BYTES = 64 << 20

_KINDS: frozenset[str] = frozenset(get_args(graders.GradeErrorKind))


class GradingUnavailable(RuntimeError):
    """No grading process could be started (or one died before it was ready)."""


class GradingTimeout(RuntimeError):
    """Validating the grader took longer than the time limit, or its process died doing it."""


@dataclass(frozen=True)
class Sample:
    """One sample to grade: the model's output, its dataset row and the scores of its reward_model leaves."""

    output_text: str
    item: Mapping[str, Any]
    model_scores: Mapping[str, float] = field(default_factory=dict)
    output_tools: Sequence[Mapping[str, Any]] = ()  # an agent episode's tool calls (`{{sample.output_tools}}`)


@dataclass(frozen=True)
class GradedBatch:
    grader: dict[str, Any]  # the grader as validated (JSON, fields left at None omitted)
    results: list[graders.GradeResult]  # one per sample, in order
    seconds: list[float]  # the wall time each sample took, its process's start excluded


def serve_command() -> list[str]:
    """The command line of a grading process: this interpreter, serving the protocol on stdin/stdout."""
    return [sys.executable, "-c", "from trainer.grading.pool import serve; serve()"]


class _Exited(Exception):
    pass


class GradingProcess:
    """One process speaking the protocol; the caller sends a batch, then reads its replies one by one."""

    def __init__(self, command: Sequence[str]) -> None:
        root = str(Path(__file__).resolve().parents[1])  # the folder holding `trainer`: the same code in the child
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        # A session of its own: a Ctrl-C meant for the service does not reach it (it exits when its stdin closes).
        try:
            self._proc = subprocess.Popen(
                list(command), stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, start_new_session=True
            )
        except OSError as err:
            raise GradingUnavailable(f"a grading process could not be started ({err})") from None
        assert self._proc.stdin is not None and self._proc.stdout is not None
        self._stdin: IO[bytes] = self._proc.stdin
        self._stdout = self._proc.stdout.fileno()
        self._buffer = bytearray()
        self.ready = False

    def wait_ready(self, timeout_s: float) -> None:
        try:
            reply = self.receive(timeout_s)
        except _Exited:
            reply = {}
        if reply != {"ready": True}:
            problem = "did not start in time" if reply is None else f"{self.describe_exit()} as it started"
            self.kill()
            raise GradingUnavailable(f"a grading process {problem}")
        self.ready = True

    def send(self, message: Mapping[str, Any]) -> None:
        try:
            self._stdin.write(json.dumps(message).encode() + b"\n")
            self._stdin.flush()
        except (BrokenPipeError, ValueError):  # ValueError: the pipe was closed by kill()
            raise _Exited from None

    def receive(self, timeout_s: float) -> dict[str, Any] | None:
        """The next reply; None once `timeout_s` has passed without one; `_Exited` when the process has gone or
        sent something that is not a reply."""
        deadline = time.monotonic() + timeout_s
        with selectors.DefaultSelector() as selector:
            selector.register(self._stdout, selectors.EVENT_READ)
            while (end := self._buffer.find(b"\n")) == -1:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or not selector.select(remaining):
                    return None
                chunk = os.read(self._stdout, 1 << 16)
                if not chunk or len(self._buffer) + len(chunk) > MAX_REPLY_BYTES:
                    raise _Exited
                self._buffer += chunk
        line = bytes(self._buffer[:end])
        del self._buffer[: end + 1]
        try:
            reply = json.loads(line)
        except ValueError:
            raise _Exited from None
        if not isinstance(reply, dict):
            raise _Exited
        return reply

    @property
    def alive(self) -> bool:
        return self._proc.poll() is None

    def describe_exit(self) -> str:
        """How the process ended, once its output has closed (it may take a moment to be reaped)."""
        try:
            return f"exited with code {self._proc.wait(timeout=1.0)}"
        except subprocess.TimeoutExpired:
            return "closed its output"

    def kill(self) -> None:
        if self._proc.poll() is None:
            self._proc.kill()
        self._proc.wait()
        for stream in (self._proc.stdin, self._proc.stdout):
            if stream is not None:
                stream.close()


class _Slot:
    """A place for one grading process in a pool: started ahead, replaced when killed."""

    def __init__(self, command: Sequence[str]) -> None:
        self._command = command
        self._process: GradingProcess | None = GradingProcess(command)

    def process(self, startup_timeout_s: float) -> GradingProcess:
        if self._process is None or not self._process.alive:
            self.discard()
        if self._process is None:
            self._process = GradingProcess(self._command)
        if not self._process.ready:
            try:
                self._process.wait_ready(startup_timeout_s)
            except GradingUnavailable:
                self._process = None  # killed; the next batch tries a new one
                raise
        return self._process

    def discard(self, *, restart: bool = True) -> None:
        """Kill the process; with `restart`, start its successor now, so that it is ready by the next batch."""
        if self._process is not None:
            self._process.kill()
        self._process = GradingProcess(self._command) if restart else None


class GradingPool:
    """`size` grading processes, each grading one batch at a time; `run` waits for a free one."""

    def __init__(
        self,
        size: int = 1,
        *,
        sample_timeout_s: float = SAMPLE_TIMEOUT_S,
        max_timeouts: int = MAX_TIMEOUTS_PER_BATCH,
        startup_timeout_s: float = STARTUP_TIMEOUT_S,
        command: Sequence[str] | None = None,
    ) -> None:
        self.sample_timeout_s = sample_timeout_s
        self.max_timeouts = max_timeouts
        self.startup_timeout_s = startup_timeout_s
        self._command = list(command or serve_command())
        self._idle: queue.SimpleQueue[_Slot] = queue.SimpleQueue()
        self._slots: list[_Slot] = []
        self._closed = False
        self._lock = threading.Lock()
        self.size = size

    @contextmanager
    def _slot(self) -> Iterator[_Slot]:
        with self._lock:
            if not self._closed and len(self._slots) < self.size:  # processes start on first use
                self._slots.append(_Slot(self._command))
                self._idle.put(self._slots[-1])
        slot = self._idle.get()
        try:
            if self._closed:
                raise GradingUnavailable("the grading pool is closed")
            yield slot
        finally:
            if self._closed:
                slot.discard(restart=False)
            self._idle.put(slot)

    def run(
        self, grader: Mapping[str, Any], samples: Sequence[Sample], *, sample_timeout_s: float | None = None
    ) -> GradedBatch:
        """Validate `grader` (a grader object as JSON) and grade `samples` with it, each within the time limit.

        Raises `graders.GraderError` for an invalid grader (or a reward_model leaf without its scores),
        `GradingTimeout` when validating it took longer than the limit, `GradingUnavailable` when no process could
        start. A sample that times out or whose process dies is a result with an error flag, never an exception."""
        limit = self.sample_timeout_s if sample_timeout_s is None else sample_timeout_s
        encoded = [
            {"output_text": s.output_text, "item": dict(s.item), "model_scores": dict(s.model_scores)}
            | ({"output_tools": [dict(c) for c in s.output_tools]} if s.output_tools else {})
            for s in samples
        ]
        results: list[graders.GradeResult] = []
        seconds: list[float] = []
        timeouts = 0
        with self._slot() as slot:
            while True:
                process = slot.process(self.startup_timeout_s)
                try:
                    validated, stop = self._run_on(process, grader, encoded[len(results) :], limit, results, seconds)
                except graders.GraderError:
                    raise  # the process answered it and waits for the next batch
                except BaseException:
                    slot.discard()  # a batch left half read: its process may still be answering it
                    raise
                if stop is None:
                    return GradedBatch(validated, results, seconds)
                # The last result is the sample that timed out or lost its process: go on after it, in a new one.
                slot.discard()
                timeouts += stop == "timeout"
                if timeouts >= self.max_timeouts:
                    skipped = graders.GradeError(
                        f"not graded: {timeouts} samples of this batch took longer than {limit:g} s; scored 0.0",
                        "timeout",
                    )
                    results += [graders.GradeResult(0.0, {}, (skipped,))] * (len(samples) - len(results))
                    seconds += [0.0] * (len(samples) - len(seconds))
                if len(results) == len(samples):
                    return GradedBatch(validated, results, seconds)

    @staticmethod
    def _run_on(
        process: GradingProcess,
        grader: Mapping[str, Any],
        samples: list[dict[str, Any]],
        limit: float,
        results: list[graders.GradeResult],
        seconds: list[float],
    ) -> tuple[dict[str, Any], str | None]:
        """Send one batch and read its replies into `results` and `seconds`: (the validated grader, None) when every
        sample was read, else (…, "timeout" or "failed"), the last result appended being the sample that stopped it."""
        validate_limit = limit + (PREPARE_TIMEOUT_S if _library_metrics(grader) else 0.0)
        try:
            process.send({"grader": grader, "samples": samples})
            reply = process.receive(validate_limit)
        except _Exited:
            raise GradingTimeout(f"the grading process {process.describe_exit()} while validating the grader") from None
        if reply is None:
            raise GradingTimeout(f"validating the grader took longer than {validate_limit:g} s")
        validated = _validated_grader(reply)
        for _ in samples:
            start = time.monotonic()
            result, stop = _next_result(process, limit)
            results.append(result)
            seconds.append(time.monotonic() - start)
            if stop is not None:
                return validated, stop
        return validated, None

    def close(self) -> None:
        """Kill the idle processes; a process grading a batch is killed when its batch ends. A `run` after this, or
        waiting for a process, raises GradingUnavailable."""
        with self._lock:
            self._closed = True
        idle: list[_Slot] = []
        while True:
            try:
                idle.append(self._idle.get_nowait())
            except queue.Empty:
                break
        for slot in idle:
            slot.discard(restart=False)
            self._idle.put(slot)  # wakes a run waiting for it, which then sees the pool closed


def _library_metrics(grader: Any) -> set[str]:
    """The text_similarity metrics of a grader in its JSON form (validated or not) that `trainer.grading.similarity`
    computes with libraries a process loads on first use."""
    if not isinstance(grader, Mapping):
        return set()
    if grader.get("type") == "text_similarity":
        metric = grader.get("evaluation_metric")
        return {metric} if isinstance(metric, str) and metric in similarity.METRICS else set()
    children = grader.get("graders") if grader.get("type") == "multi" else None
    if not isinstance(children, Mapping):
        return set()
    return set().union(*(_library_metrics(child) for child in children.values()))


def _next_result(process: GradingProcess, limit: float) -> tuple[graders.GradeResult, str | None]:
    """The next sample's result and None; or a result with an error flag and why the batch stops there: "timeout"
    (the sample took longer than `limit`) or "failed" (its process died, or answered something else)."""
    try:
        reply = process.receive(limit)
    except _Exited:
        return _unfinished(
            f"the grading process {process.describe_exit()} while grading this sample", "other"
        ), "failed"
    if reply is None:
        return _unfinished(f"grading this sample took longer than {limit:g} s", "timeout"), "timeout"
    result = _result(reply)
    if result is None:
        return _unfinished("the grading process answered something that is not a result", "other"), "failed"
    return result, None


def _unfinished(problem: str, kind: graders.GradeErrorKind) -> graders.GradeResult:
    return graders.GradeResult(0.0, {}, (graders.GradeError(f"{problem}; scored 0.0", kind),))


def _validated_grader(reply: dict[str, Any]) -> dict[str, Any]:
    if isinstance(error := reply.get("grader_error"), dict):
        raise graders.GraderError(str(error.get("message", "invalid grader")), param=str(error.get("param", "grader")))
    validated = reply.get("grader")
    if not isinstance(validated, dict):
        raise GradingTimeout("the grading process answered something that is not a grader")
    return validated


def _result(reply: dict[str, Any]) -> graders.GradeResult | None:
    """The result a reply holds; None when it is malformed. A `grader_error` reply raises GraderError."""
    if isinstance(error := reply.get("grader_error"), dict):
        raise graders.GraderError(str(error.get("message", "invalid grader")), param=str(error.get("param", "grader")))
    score, sub_scores, errors = _number(reply.get("score")), reply.get("sub_scores"), reply.get("errors")
    if score is None or not isinstance(sub_scores, dict) or not isinstance(errors, list):
        return None
    numbers = {str(k): _number(v) for k, v in sub_scores.items()}
    if not all(isinstance(e, list) and len(e) == 2 and isinstance(e[0], str) and e[1] in _KINDS for e in errors):
        return None
    if None in numbers.values():
        return None
    return graders.GradeResult(
        score=score,
        sub_scores={k: v for k, v in numbers.items() if v is not None},
        errors=tuple(graders.GradeError(message, kind) for message, kind in errors),
    )


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


_default: tuple[int, GradingPool] | None = None
_default_lock = threading.Lock()


def default_pool() -> GradingPool:
    """This process's pool of one grading process (the trainer's), closed when the process exits. A forked child
    gets a pool of its own: the processes of its parent's are not its to use."""
    global _default
    with _default_lock:
        if _default is None or _default[0] != os.getpid():
            pool = GradingPool(size=1)
            atexit.register(pool.close)
            _default = (os.getpid(), pool)
        return _default[1]


# ----------------------------------------------------------------------------------------------------
# The grading process


def serve() -> None:
    """Serve the protocol on stdin/stdout until stdin closes (the parent gone or done)."""
    channel = os.fdopen(os.dup(1), "wb")  # the protocol's own copy of stdout ...
    os.dup2(2, 1)  # ... and anything else printed goes to stderr, never into a reply
    _limit_memory()

    def reply(message: Mapping[str, Any]) -> None:
        channel.write(json.dumps(message).encode() + b"\n")
        channel.flush()

    try:
        reply({"ready": True})
        for line in sys.stdin.buffer:
            request = json.loads(line)
            _serve_batch(request["grader"], request["samples"], reply)
    except BrokenPipeError:  # the parent has gone (killed, say) while a sample was graded: nobody to answer
        pass


def _limit_memory() -> None:
    import resource  # POSIX only, as the pool is (it selects on pipes)

    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    limit = PROCESS_MEMORY_BYTES if hard == resource.RLIM_INFINITY else min(PROCESS_MEMORY_BYTES, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))


def _serve_batch(grader_json: Any, samples: list[dict[str, Any]], reply: Any) -> None:
    try:
        grader = _parse(json.dumps(grader_json))  # key order kept: errors are reported in field order
    except graders.GraderError as err:
        reply({"grader_error": {"message": str(err), "param": err.param}})
        return
    validated = grader.model_dump(mode="json", exclude_none=True)
    for metric in sorted(_library_metrics(validated)):  # loaded before the samples' clocks start (PREPARE_TIMEOUT_S)
        _prepare(metric)
    reply({"grader": validated})
    for sample in samples:
        try:
            result = scoring.grade(  # looked up at each call: tests substitute a misbehaving grade
                grader,
                output_text=sample["output_text"],
                item=sample["item"],
                model_scores=sample["model_scores"],
                output_tools=sample.get("output_tools", ()),
            )
        except graders.GraderError as err:  # a reward_model leaf without its scores: the batch cannot be graded
            reply({"grader_error": {"message": str(err), "param": err.param}})
            return
        except Exception as exc:  # a bug (or MemoryError): this sample is an error, the next ones are graded
            problem = graders.GradeError(f"grading failed ({type(exc).__name__}: {exc}); scored 0.0", "other")
            result = graders.GradeResult(0.0, {}, (problem,))
        reply(
            {
                "score": result.score,
                "sub_scores": result.sub_scores,
                "errors": [[str(error), error.kind] for error in result.errors],
            }
        )


@functools.cache  # once per process and metric: what it loads stays loaded
def _prepare(metric: str) -> None:
    similarity.prepare(metric)


@functools.lru_cache(maxsize=8)  # the grader of the batches to come is most often the same one
def _parse(grader_json: str) -> graders.Grader:
    return graders.parse_grader(json.loads(grader_json))

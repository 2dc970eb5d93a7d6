"""The protocol between a worker (``worker.tasks``) and the trainer process it starts (``worker.runner``).

stdout of the trainer carries :data:`RunnerMessage` objects, one JSON object a line, told apart by ``kind``; the
runner writes them with :func:`encode` and the worker reads each line once with :func:`decode`, so both sides hold
the same typed shapes and a message that does not fit is refused where it arrives rather than misread later. stdin
carries control: a :data:`STOP` line; end of file means the worker died.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

from worker.errors import ErrorCode

STOP = "stop"
"""The control line asking the trainer to stop after a final checkpoint (cancel or pause), within one step."""
PARENT_PID_ENV = "PROXIMA_WORKER_PID"
"""The environment variable giving the trainer its worker's process id (to find out whether the worker died before the
trainer asked the kernel to be told of it)."""

Level = Literal["info", "warn", "error"]


class _Message(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Started(_Message):
    """The trainer is built: the run's length in optimiser steps."""

    kind: Literal["started"] = "started"
    total_steps: int


class Event(_Message):
    """A line for the job's event list."""

    kind: Literal["event"] = "event"
    level: Level
    message: str
    data: dict[str, Any] = Field(default_factory=dict)


class Metrics(_Message):
    """One step's metrics (step 0: the base policy's validation, before training); a value JSON cannot hold
    (NaN, infinity) is None."""

    kind: Literal["metrics"] = "metrics"
    step: int
    metrics: dict[str, float | None]


class Rollouts(_Message):
    """Sampled prompts, completions and rewards of one step."""

    kind: Literal["rollouts"] = "rollouts"
    step: int
    rollouts: list[dict[str, Any]]


class Checkpoint(_Message):
    """A checkpoint folder the trainer finished writing, for the worker to upload."""

    kind: Literal["checkpoint"] = "checkpoint"
    step: int
    path: str
    metrics: dict[str, float | None]


class Stopping(_Message):
    """A stop request arrived after ``completed_step``: the trainer stops at the next step boundary."""

    kind: Literal["stopping"] = "stopping"
    completed_step: int


class Done(_Message):
    """The run ended normally: trained to the end, or stopped early on request (``stopped``)."""

    kind: Literal["done"] = "done"
    stopped: bool
    last_step: int
    total_steps: int
    adapter_dir: str | None


class Error(_Message):
    """The run ended with an error: one of the trainer's typed errors (its code and message), or an unexpected one
    (``trainer_error``, the message naming the exception's class and its first line; the traceback goes to stderr
    only). ``path``, ``line`` and ``detail`` come with a dataset error: the local file, its line and the problem
    without the location, so the worker can name the user's file instead. ``step``: the last step whose metrics were
    sent."""

    kind: Literal["error"] = "error"
    code: ErrorCode
    message: str
    param: str | None = None
    path: str | None = None
    line: int | None = None
    detail: str | None = None
    step: int = 0


RunnerMessage = Annotated[
    Started | Event | Metrics | Rollouts | Checkpoint | Stopping | Done | Error, Field(discriminator="kind")
]
_ADAPTER: TypeAdapter[RunnerMessage] = TypeAdapter(RunnerMessage)


def encode(message: RunnerMessage) -> str:
    """One line of the protocol (without the newline); NaN and infinity become null (JSON has neither, and
    PostgreSQL's json type refuses them)."""
    return message.model_dump_json(fallback=str)  # an odd value in an event's data is sent as its text


def decode(line: str | bytes) -> RunnerMessage:
    """Parse one line; ``pydantic.ValidationError`` when it is not JSON or not a known message of the right shape."""
    return _ADAPTER.validate_json(line)

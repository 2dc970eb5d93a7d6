"""The trainer's process: ``python -m worker.runner RUN_DIR``, started by the worker for one attempt at one job.

It runs in a child process so that a crash or an out-of-memory kill fails the job and not the worker. The protocol
with the parent (``worker.tasks``) is ``worker.messages``: typed messages, one JSON object a line, over the standard
streams:

- stdout carries messages: ``started``, ``event``, ``metrics``, ``rollouts``, ``checkpoint`` (with the folder's
  path), then ``done`` or ``error`` (a typed trainer error with its code). Anything libraries print is sent to stderr
  instead, which the parent keeps in a file for the error message.
- stdin carries control: a ``stop`` line asks the trainer to stop after a final checkpoint (cancel, pause, within one
  step); end of file means the parent died, and the trainer exits at once rather than train for nobody.

The trainer also dies with its worker when it cannot read its stdin (a step stuck in native code holding the GIL): on
Linux it asks the kernel to kill it when its parent dies (``PR_SET_PDEATHSIG``). A worker that does not see the
trainer stop within its grace period terminates it, then kills it (``worker.trainer_process``).

An unexpected error is reported as ``trainer_error`` with the exception's class and first line; its traceback goes to
stderr, which the worker writes to its own log, never to the job.

``RUN_DIR/spec.json`` holds the spec with local paths; ``RUN_DIR/checkpoints/`` may hold the checkpoint to resume.
The deployment's remote graders (judge, embeddings, endpoint URL policy:
``trainer.grading.remote_graders.RemoteConfig``, API keys included) come as JSON in the environment variable
``REMOTE_GRADERS_ENV``, which the runner removes from its environment as it starts, so that no process it starts
(grading processes, sandboxes) inherits the keys. The deployment's sandbox of python graders and environments (its
packages folder, memory bound and limits: ``trainer.grading.sandbox.SandboxConfig``) is ``RUN_DIR/sandbox.json``
(SANDBOX_FILE), which the worker writes with the spec; a run folder without it grades with the standard library only.

Test-only: ``PROXIMA_TEST_TRAINER_HANG=start`` in its environment makes the trainer stuck from its start, as a step
stuck in native code would be: it ignores SIGTERM and blocks holding the GIL, so that neither a stop request nor its
stdin's end reach it. The worker fault tests set it on the workers they start; nothing else does.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import json
import os
import signal
import sys
import threading
import traceback
import warnings
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from worker import messages as msg
from worker.errors import ErrorCode, code_for

if TYPE_CHECKING:  # the trainer's modules are imported once the message channel is open (see _train)
    from trainer.grading.sandbox import SandboxConfig

# Exit code of a run that ended with a typed error message (the parent reads the message, not the code).
EXIT_ERROR = 1
EXIT_ORPHANED = 3
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
HANG_ENV = "PROXIMA_TEST_TRAINER_HANG"
REMOTE_GRADERS_ENV = "PROXIMA_RUNNER_REMOTE_GRADERS"
SANDBOX_FILE = "sandbox.json"
SUMMARY_CHARS = 300


@functools.cache
def trainer_error_codes() -> dict[type[BaseException], ErrorCode]:
    """The job error code of each of the trainer's typed errors. Imported when first asked for: this module must
    start (and open its message channel) before the trainer's imports, whose own failures it reports."""
    import torch

    from trainer.agents.tools import EnvironmentFailed
    from trainer.generation.models import ModelError
    from trainer.grading.sandbox import SandboxUnavailable
    from trainer.spec.config import SpecError
    from trainer.spec.data import DatasetError
    from trainer.spec.graders import GraderError, GraderFailed

    return {
        MemoryError: ErrorCode.OUT_OF_MEMORY,
        torch.OutOfMemoryError: ErrorCode.OUT_OF_MEMORY,  # the accelerator's (torch.cuda.OutOfMemoryError)
        DatasetError: ErrorCode.INVALID_FILE,
        ModelError: ErrorCode.MODEL_NOT_AVAILABLE,
        GraderError: ErrorCode.INVALID_GRADER,
        GraderFailed: ErrorCode.GRADER_FAILED,
        EnvironmentFailed: ErrorCode.ENVIRONMENT_FAILED,
        SandboxUnavailable: ErrorCode.ENVIRONMENT_FAILED,  # graders turn theirs into GraderFailed: an environment's
        SpecError: ErrorCode.INVALID_HYPERPARAMETERS,
    }


def error_code(err: BaseException) -> ErrorCode | None:
    """The job error code for the trainer's typed errors (None: an unexpected error, i.e. a trainer bug)."""
    return code_for(err, trainer_error_codes())


def _safe_error_code(err: BaseException) -> ErrorCode | None:
    """:func:`error_code`, or None when the trainer's modules cannot even be imported (that is the error then)."""
    try:
        return error_code(err)
    except Exception:
        return None


class Pipe:
    """The message channel to the parent (a private copy of the original stdout)."""

    def __init__(self, out: IO[str]) -> None:
        self.out = out
        self.lock = threading.Lock()

    def send(self, message: msg.RunnerMessage) -> None:
        line = msg.encode(message)
        with self.lock:
            self.out.write(line + "\n")
            self.out.flush()


class Progress:
    """The last step whose metrics were sent, read by the control thread when a stop arrives."""

    last_step = 0


def die_with_parent() -> None:
    """Have the kernel SIGKILL this process when the worker that started it dies (Linux); exit now if it already
    has. Elsewhere the stdin watcher's end of file is the only signal."""
    parent = os.environ.get(msg.PARENT_PID_ENV)
    if sys.platform == "linux":
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            print(f"prctl(PR_SET_PDEATHSIG) failed: errno {ctypes.get_errno()}", file=sys.stderr)
    if parent is not None and os.getppid() != int(parent):  # it died before the kernel was asked to tell us
        os._exit(EXIT_ORPHANED)


def _hang_as_if_stuck() -> None:
    """The test hook's fault (``HANG_ENV``): deaf to SIGTERM and blocked in native code that holds the GIL (so no
    other thread of this process runs either, the stdin watcher included)."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    while True:
        ctypes.PyDLL(None).sleep(3600)  # PyDLL keeps the GIL during the call


def summary(err: BaseException) -> str:
    """An unexpected error in one line: its class and its message's first line, shortened."""
    first = next(iter(str(err).strip().splitlines()), "")
    text = f"{type(err).__name__}: {first}" if first else type(err).__name__
    return text if len(text) <= SUMMARY_CHARS else text[: SUMMARY_CHARS - 1] + "…"


def _make_callback(pipe: Pipe, stop: threading.Event, progress: Progress, world: Any) -> Any:
    """Rank 0's callback talks to the parent; another rank's says nothing. Every rank asks rank 0 whether to stop, at
    the same step boundary (a collective: they stop together)."""
    from trainer.spec.callbacks import BaseCallback, Level

    if not world.main:

        class QuietRank(BaseCallback):
            def should_stop(self) -> bool:
                return bool(world.broadcast(False))

        return QuietRank()

    class ParentCallback(BaseCallback):
        def on_event(self, level: Level, message: str, data: dict[str, Any] | None = None) -> None:
            pipe.send(msg.Event(level=level, message=message, data=data or {}))

        def on_metrics(self, step: int, metrics: dict[str, float]) -> None:
            pipe.send(msg.Metrics(step=step, metrics=dict(metrics)))
            progress.last_step = step

        def on_rollouts(self, step: int, rollouts: list[dict[str, Any]]) -> None:
            pipe.send(msg.Rollouts(step=step, rollouts=rollouts))

        def on_checkpoint(self, step: int, path: Path, metrics: dict[str, float]) -> None:
            pipe.send(msg.Checkpoint(step=step, path=str(path), metrics=dict(metrics)))

        def should_stop(self) -> bool:
            return bool(world.broadcast(stop.is_set()))

    return ParentCallback()


def _watch_stdin(stop: threading.Event, pipe: Pipe, progress: Progress) -> None:
    for line in sys.stdin:
        if line.strip() == msg.STOP and not stop.is_set():
            stop.set()
            # Steps up to this one are done; the trainer checks `should_stop` before the next, so at most the step
            # in progress is still trained: the parent records where the request landed.
            pipe.send(msg.Stopping(completed_step=progress.last_step))
    os._exit(EXIT_ORPHANED)  # the parent is gone: nobody would record what we train


def peer_failed(err: BaseException) -> bool:
    """Whether ``err`` is a collective that failed because another rank died (gloo: its connection reset or closed):
    that rank's failure, or the launcher's account of it, is the job's error, not this one."""
    import torch.distributed as dist

    text = str(err)
    return isinstance(err, dist.DistError) or (
        isinstance(err, RuntimeError) and "gloo" in text and ("by peer" in text or "Connection" in text)
    )


def _message_channel() -> Pipe:
    """Messages get a private copy of stdout; fd 1 then points at stderr so stray prints cannot corrupt them."""
    pipe = Pipe(os.fdopen(os.dup(1), "w", encoding="utf-8"))
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return pipe


def _train(run_dir: Path, callback: Any, remote_graders: str | None, *, main_rank: bool, pipe: Pipe) -> Any:
    """Build the trainer from ``RUN_DIR/spec.json`` and run it (resuming from the run folder's checkpoint); its
    result. The trainer's modules are imported here, after the message channel is open, so that their own
    failures are reported."""
    from transformers.utils import logging as hf_logging

    from trainer.generation import distributed
    from trainer.generation.models import ModelError
    from trainer.grading.remote_graders import RemoteConfig
    from trainer.grading.remote_process import configure_remote
    from trainer.spec.config import parse_spec
    from trainer.train import build_trainer

    hf_logging.disable_progress_bar()
    if remote_graders is not None:
        configure_remote(RemoteConfig.model_validate_json(remote_graders))
    configure_sandbox_of(run_dir)
    spec = parse_spec(json.loads((run_dir / "spec.json").read_text()))
    world = distributed.from_environment()
    distributed.initialise(world)
    try:
        trainer = build_trainer(spec, output_dir=run_dir, callback=callback(world), world=world)
    except OSError as err:  # the datasets are local files the worker wrote: this is the model or its tokenizer
        raise ModelError(f"cannot load model {spec.model!r}: {err}") from err
    if main_rank:
        pipe.send(msg.Started(total_steps=trainer.total_steps))
    return trainer.run(resume=True)


def write_sandbox_file(run_dir: Path, config: SandboxConfig) -> None:
    """Hand the deployment's sandbox (`api.services.graders.sandbox_config`) to the run folder's trainer."""
    (run_dir / SANDBOX_FILE).write_text(json.dumps(config.to_json(), indent=2))


def configure_sandbox_of(run_dir: Path) -> None:
    """This process's python sandboxes as its worker set them up (`write_sandbox_file`); a run folder without the
    file leaves SandboxConfig's defaults (the standard library only)."""
    from trainer.grading.sandbox import SandboxConfig, configure_sandbox

    if (path := run_dir / SANDBOX_FILE).is_file():
        configure_sandbox(SandboxConfig.from_json(json.loads(path.read_text())))


def _report_failure(err: BaseException, pipe: Pipe, progress: Progress) -> int:
    """Send the run's error to the parent (its traceback to stderr); the exit code."""
    traceback.print_exc()
    sys.stderr.flush()
    if "WORLD_SIZE" in os.environ:
        with contextlib.suppress(Exception):
            if peer_failed(err):  # another rank's death: the launcher reports it
                return EXIT_ERROR
    code = _safe_error_code(err)
    if code is None:  # not one of the trainer's typed errors: a bug, or a value the trainer did not expect
        pipe.send(msg.Error(code=ErrorCode.TRAINER_ERROR, message=summary(err), step=progress.last_step))
    else:
        pipe.send(
            msg.Error(
                code=code,
                message=str(err),
                param=getattr(err, "param", None),
                path=getattr(err, "path", None),
                line=getattr(err, "line", None),
                detail=getattr(err, "detail", None),
                step=progress.last_step,
            )
        )
    return EXIT_ERROR


def main(run_dir: Path) -> int:
    die_with_parent()
    rank = int(os.environ.get("RANK", "0"))  # set by the launcher (worker.launch) for a job on several devices
    remote_graders = os.environ.pop(REMOTE_GRADERS_ENV, None)
    if os.environ.get(HANG_ENV) == "start":
        _hang_as_if_stuck()
    pipe = _message_channel()
    stop, progress = threading.Event(), Progress()
    if rank == 0:  # the parent's control channel is rank 0's; the other ranks hear of a stop from it
        threading.Thread(target=_watch_stdin, args=(stop, pipe, progress), daemon=True, name="control").start()
    warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
    try:
        result = _train(
            run_dir,
            lambda world: _make_callback(pipe, stop, progress, world),
            remote_graders,
            main_rank=rank == 0,
            pipe=pipe,
        )
    except BaseException as err:
        return _report_failure(err, pipe, progress)
    if rank != 0:
        return 0
    pipe.send(
        msg.Done(
            stopped=result.stopped,
            last_step=result.last_step,
            total_steps=result.total_steps,
            adapter_dir=str(result.adapter_dir) if result.adapter_dir else None,
        )
    )
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 2:
        print("usage: python -m worker.runner RUN_DIR", file=sys.stderr)
        sys.exit(2)
    code = main(Path(sys.argv[1]))
    sys.stderr.flush()
    os._exit(code)  # skip interpreter teardown (library atexit hooks) and the stdin watcher

"""Following one run of the trainer: start its process, relay what it reports to the database (metrics, events,
rollouts and checkpoints, through an outage in order: ``worker.outbox``) and to the job's experiment trackers, pass on
the cancel and pause requests read from the database, and terminate a trainer that does not stop within the grace
period. A checkpoint's objects are uploaded before its row is written, so a row always names a complete checkpoint.

What the run ended with is a :class:`TrainerRun`, judged by ``worker.job_finish``; a worker that lost its lease kills
its trainer and writes nothing more (``"lost"``)."""

from __future__ import annotations

import logging
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from api.db import session_scope
from api.repositories import runs
from api.services import graders as graders_service
from api.storage import StoreFull
from trainer.spec import metrics as M
from worker import messages as msg
from worker import trackers
from worker.estimate import StepTime, estimated_finish, ran_validation
from worker.job_context import ClaimedJob, JobContext, Progress, step_tokens
from worker.lease import Heartbeat
from worker.outbox import DatabaseUnavailable, Outbox, Write, is_transient
from worker.redact import Redactor
from worker.runner import REMOTE_GRADERS_ENV
from worker.trainer_process import Ended, TrainerProcess

log = logging.getLogger("proxima.worker")

CONTROL_POLL_S = 1.0  # how often the database is read for cancel and pause requests

Lost = Literal["lost"]
"""The outcome of an attempt whose lease another worker took: it writes nothing more."""


def checkpoint_prefix(job_id: str, step: int) -> str:
    return f"jobs/{job_id}/checkpoints/step-{step:06d}"


@dataclass(frozen=True)
class TrainerRun:
    """How one run of the trainer ended: its final message (None: it reported none), its exit code, the reason it
    was told to stop for, whether a cancel was set once it had ended, and its process (for its output and how it
    died)."""

    final: msg.Done | msg.Error | None
    rc: int
    stop_reason: str | None
    cancel_now: bool
    trainer: TrainerProcess


class Relay:
    """The trainer's progress messages → the database's writes (in an :class:`Outbox`) and the trackers' exports."""

    def __init__(
        self,
        ctx: JobContext,
        job: ClaimedJob,
        progress: Progress,
        redactor: Redactor,
        exporter: trackers.Exporter,
    ) -> None:
        self.ctx, self.job, self.progress, self.redactor, self.trackers = ctx, job, progress, redactor, exporter

    def on_message(self, message: msg.RunnerMessage, outbox: Outbox, stop_reason: str | None) -> None:
        for warning in self.trackers.events():  # export failures, as the job's warnings
            outbox.add(self.ctx.event_write("warn", warning.message, data=warning.data))
        p = self.progress
        match message:
            case msg.Stopping(completed_step=done):
                what = "Cancellation" if stop_reason == "cancel" else "Pause"
                text = f"{what} requested: the trainer stops after step {done + 1} at the latest"
                outbox.add(self.ctx.event_write("info", text, data={"completed_step": done}))
            case msg.Checkpoint():
                if (arrived := p.metrics_at.get(message.step)) is not None:  # saved after its step's metrics
                    p.checkpoint_seconds.append(time.monotonic() - arrived)
                self._checkpoint_writes(message.step, Path(message.path), message.metrics, outbox)
            case msg.Started():
                p.total_steps = message.total_steps
                self.trackers.config({"total_steps": message.total_steps})
                outbox.add(self._progress_write(p.resume_step, eta=None))
            case msg.Event():
                text, data = self.redactor.text(message.message), self.redactor.value(message.data)
                outbox.add(self.ctx.event_write(message.level, text, data=data))
            case msg.Rollouts(step=step, rollouts=rollouts):
                outbox.add(Write(f"rollouts of step {step}", lambda: self._write_rollouts(step, rollouts)))
                self.trackers.rollouts(step, rollouts)
            case msg.Metrics():
                self._metrics_writes(message.step, message.metrics, outbox)
                self.trackers.metrics(message.step, message.metrics)
            case msg.Done() | msg.Error():  # the run's outcome: the follower keeps it
                raise AssertionError(f"{message.kind} is not a progress message")

    def _write_rollouts(self, step: int, rollouts: list[dict[str, Any]]) -> None:
        with session_scope(self.ctx.url) as s:
            runs.add_rollouts(s, job_id=self.ctx.job_id, step=step, rollouts=rollouts)

    def _progress_write(self, step: int, *, eta: int | None) -> Write:
        total, tokens = self.progress.total_steps, self.progress.trained_tokens()

        def run() -> None:
            with session_scope(self.ctx.url) as s:
                runs.update_progress(
                    s,
                    job_id=self.ctx.job_id,
                    current_step=step,
                    total_steps=total,
                    trained_tokens=tokens,
                    estimated_finish=eta,
                )

        return Write(f"progress at step {step}", run)

    def _metrics_writes(self, step: int, values: dict[str, float | None], outbox: Outbox) -> None:
        def upsert() -> None:
            with session_scope(self.ctx.url) as s:
                runs.upsert_metrics(s, job_id=self.ctx.job_id, step=step, values=values)

        outbox.add(Write(f"metrics of step {step}", upsert))
        if step == 0:  # the base policy's validation point, before any training
            return
        p = self.progress
        data = {"step": step, "total_steps": p.total_steps, **values}
        outbox.add(self.ctx.event_write("info", f"Step {step}/{p.total_steps}", data=data, type="metrics"))
        p.tokens_by_step[step] = step_tokens(values)
        p.metrics_at[step] = time.monotonic()
        secs = values.get(M.STEP_SECONDS)
        if secs is not None:
            p.step_times.append(StepTime(step=step, seconds=secs, evaluated=ran_validation(values)))
        eta = None
        if p.total_steps:
            cadence = p.cadence(self.job)
            eta = estimated_finish(p.step_times, p.checkpoint_seconds, done=step, cadence=cadence, now=time.time())
        outbox.add(self._progress_write(step, eta=eta))

    def _checkpoint_writes(self, step: int, path: Path, metrics: dict[str, float | None], outbox: Outbox) -> None:
        """Upload the checkpoint's objects, then (a write of its own, so an outage does not upload them again) record
        its row: a row always names a complete checkpoint. A full store removes what was uploaded of it."""
        ctx = self.ctx
        prefix = checkpoint_prefix(ctx.job_id, step)

        def upload() -> None:
            from trainer.loops.checkpoint import archive_adapter

            try:
                for f in sorted(p for p in path.rglob("*") if p.is_file()):
                    ctx.store.put_file(f"{prefix}/{f.relative_to(path).as_posix()}", f)
                archives = ctx.run_dir / "archives"
                archives.mkdir(exist_ok=True)
                archive = archive_adapter(path / "adapter", archives / f"step-{step:06d}.tar.gz")
                ctx.store.put_file(f"{prefix}/adapter.tar.gz", archive)
                archive.unlink()
            except StoreFull:
                ctx.store.delete_prefix(prefix)
                raise

        record_event = ctx.event_write("info", f"Checkpoint created at step {step}", data={"step": step})

        def record() -> None:
            with session_scope(ctx.url) as s:
                runs.add_checkpoint(s, job_id=ctx.job_id, step=step, metrics=metrics, storage_key=prefix)
            record_event.run()

        outbox.add(Write(f"upload the checkpoint of step {step}", upload))
        outbox.add(Write(f"record the checkpoint of step {step}", record))


class Follower:
    """Runs the trainer and follows it to its end, once per start (an out-of-memory kill starts it again); the stop
    it was asked for (``cancel`` or ``pause``) holds across starts."""

    def __init__(self, ctx: JobContext, relay: Relay, *, stop_grace_s: float, ranks: int | None) -> None:
        self.ctx, self.relay, self.stop_grace_s, self.ranks = ctx, relay, stop_grace_s, ranks
        self.stop_reason: str | None = None

    def follow(self, heartbeat: Heartbeat) -> TrainerRun | Lost:
        """One run of the trainer, its progress written; a full store kills it and raises :class:`StoreFull`."""
        remote = graders_service.remote_config(self.ctx.settings).model_dump_json()  # judge and embeddings keys too
        trainer = TrainerProcess(
            self.ctx.run_dir, stop_grace_s=self.stop_grace_s, env={REMOTE_GRADERS_ENV: remote}, ranks=self.ranks
        )
        outbox = Outbox(may_write=heartbeat.holds)
        try:
            final = self._relay_until_ended(trainer, outbox, heartbeat)
            if isinstance(final, str):  # the lease was lost
                return "lost"
            rc = trainer.close()
            if not outbox.drain(give_up=heartbeat.lost.is_set):
                if heartbeat.lost.is_set():
                    return "lost"
                raise DatabaseUnavailable("write the trainer's progress")
        except BaseException:
            trainer.kill()
            raise
        cancel_now = self.ctx.db("read the control flags", self.ctx.read_flags)[0]
        if heartbeat.lost.is_set():
            return "lost"
        return TrainerRun(final=final, rc=rc, stop_reason=self.stop_reason, cancel_now=cancel_now, trainer=trainer)

    def _relay_until_ended(
        self, trainer: TrainerProcess, outbox: Outbox, heartbeat: Heartbeat
    ) -> msg.Done | msg.Error | Lost | None:
        """Relay the trainer's messages until its output ends; its final message (None: none came)."""
        final: msg.Done | msg.Error | None = None
        next_poll = 0.0
        while True:
            if heartbeat.lost.is_set():
                trainer.kill()
                return "lost"
            if self.stop_reason is None and time.monotonic() >= next_poll:
                next_poll = time.monotonic() + CONTROL_POLL_S
                self._pass_on_stop(trainer)
            if (sig := trainer.enforce_stop()) is not None:
                outbox.add(self._forced_stop_event(sig))
            try:
                message = trainer.get(timeout=0.2)
            except Ended:
                return final
            if isinstance(message, msg.Done | msg.Error):
                final = message
            elif message is not None:
                self.relay.on_message(message, outbox, self.stop_reason)
            outbox.flush()

    def _pass_on_stop(self, trainer: TrainerProcess) -> None:
        """Ask the trainer to stop when the job's cancel or pause flag is set (a database that cannot be read now is
        read again at the next poll)."""
        try:
            cancel, pause = self.ctx.read_flags()
        except Exception as err:
            if not is_transient(err):
                raise
            return
        if cancel or pause:
            self.stop_reason = "cancel" if cancel else "pause"
            trainer.stop()

    def _forced_stop_event(self, sig: int) -> Write:
        what = "cancel" if self.stop_reason == "cancel" else "pause"
        if sig == signal.SIGTERM:
            text = f"The trainer did not stop within {self.stop_grace_s:g} s of the {what}: terminating it"
        else:
            text = "The trainer did not exit after it was terminated: killing it"
        log.warning("job %s: %s", self.ctx.job_id, text)
        return self.ctx.event_write("warn", text)

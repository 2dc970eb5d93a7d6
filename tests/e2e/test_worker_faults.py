"""Faults, with real worker processes: a trainer that does not stop when asked, a worker that dies (its trainer goes
with it; a cancel or pause asked meanwhile still ends the job), a trainer killed by SIGKILL (retried once from its
checkpoint, then ``out_of_memory``), a trainer's crash (a message without traceback or path), the broker's queue
(kept first in, first out; only a lost message sent again), PostgreSQL reset and restarted under a running job, and
a full artifact store.

A stuck trainer is the runner's test hook (``worker.runner.HANG_ENV``): it ignores SIGTERM and blocks in native code
holding the GIL from its start, so that neither its stop request nor its stdin's end reach it. It costs no
torch import: the tests of what the worker does to a trainer use it, and those of what the worker does with a
trainer's output (progress through an outage, a crash, a full store) train the tiny random model for real.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis

from api import ids
from api.db import dispose_engines, session_scope
from api.orm import Checkpoint
from worker.broker import job_id_of
from worker.runner import HANG_ENV

from .conftest import Service, create_pg_database, drop_pg_database, grpo_spec, redis_url

STORE_MODEL = "tiny-random"  # the random model, by name, in the workers' model store


def start_worker(
    svc: Service, name: str, *, env: dict[str, str] | None = None, args: tuple[str, ...] = ()
) -> subprocess.Popen[bytes]:
    """A worker with extra environment and options (``Service.start_worker`` takes none)."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("PROXIMA_")} | svc.env | (env or {})
    log = (svc.root / f"worker-{name}.log").open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "worker.main", "--hostname", name, "--sweep-interval", "1", *args],
        env=full_env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    svc.workers.append(proc)
    return proc


def trainer_pid(job_id: str) -> int | None:
    for proc in Path("/proc").iterdir():
        try:
            cmd = (proc / "cmdline").read_bytes()
        except OSError:
            continue
        if b"worker.runner" in cmd and job_id.encode() in cmd and alive(int(proc.name)):
            return int(proc.name)
    return None


def alive(pid: int) -> bool:
    """Running (a zombie waiting for its reaper is dead)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def messages(svc: Service, job_id: str) -> list[str]:
    return [e.message for e in svc.events(job_id)]


def queued_in_order(svc: Service) -> list[str | None]:
    """The job ids of the messages waiting in the broker's queue, first to be delivered first (LPUSH, BRPOP)."""
    assert svc.settings.broker_url is not None
    client = redis.Redis.from_url(svc.settings.broker_url, decode_responses=True)
    return [job_id_of(raw) for raw in reversed(client.lrange("celery", 0, -1))]


def add_model_to_store(svc: Service, model: Path) -> None:
    shutil.copytree(model, svc.settings.model_store / STORE_MODEL)


# -- a stuck trainer, a dead worker ---------------------------------------------------------------------------------


def stored_checkpoint(svc: Service, job_id: str, step: int) -> None:
    """A checkpoint row, as an earlier attempt that trained to ``step`` left it (the trainer never reads it here)."""
    with session_scope(svc.url) as s:
        prefix = f"jobs/{job_id}/checkpoints/step-{step:06d}"
        s.add(Checkpoint(id=ids.checkpoint_id(), job_id=job_id, step_number=step, metrics={}, storage_key=prefix))


def wait_for_trainer(svc: Service, job_id: str) -> int:
    pid: int = svc.wait_for(f"{job_id}'s trainer", lambda: trainer_pid(job_id))
    return pid


def test_a_trainer_that_does_not_stop_is_terminated_then_killed_and_the_job_ends_paused_or_cancelled(
    make_service: Callable[..., Service], random_model_dir: Path, arithmetic_data: Path
) -> None:
    svc = make_service()
    start_worker(svc, "stuck", env={HANG_ENV: "start", "PROXIMA_STOP_GRACE_S": "1"})  # the deployment's setting
    spec = grpo_spec(str(random_model_dir), steps=50)
    paused, cancelled = svc.create_job(spec, arithmetic_data), svc.create_job(spec, arithmetic_data)
    stored_checkpoint(svc, paused, 2)
    for job_id, request, what, ends in (
        (paused, "pause_requested", "pause", "paused"),
        (cancelled, "cancel_requested", "cancel", "cancelled"),
    ):
        svc.send(job_id)
        pid = wait_for_trainer(svc, job_id)
        svc.set_flag(job_id, **{request: True})
        job = svc.wait_status(job_id, ends, "paused", "cancelled", "failed", "succeeded", timeout=30)
        assert job.status == ends and job.lease_owner is None, job.error
        assert not alive(pid)
        said = messages(svc, job_id)
        assert f"The trainer did not stop within 1 s of the {what}: terminating it" in said
        assert "The trainer did not exit after it was terminated: killing it" in said  # it ignores SIGTERM
    assert messages(svc, paused)[-1] == "The job was paused at step 2: resume continues there"
    assert not svc.job(paused).pause_requested and svc.job(paused).finished_at is None
    assert messages(svc, cancelled)[-1] == "The job was cancelled" and svc.job(cancelled).finished_at is not None


def test_waiting_jobs_keep_their_order_a_lost_message_is_sent_again_and_a_dead_workers_job_ends_when_cancelled(
    make_service: Callable[..., Service], random_model_dir: Path, arithmetic_data: Path
) -> None:
    svc = make_service()
    busy_worker = start_worker(svc, "busy", env={HANG_ENV: "start"}, args=("--queued-grace", "1"))
    busy = svc.create_job(grpo_spec(str(random_model_dir), steps=50), arithmetic_data)
    svc.send(busy)
    pid = wait_for_trainer(svc, busy)

    # Four jobs wait behind the busy worker, sweep after sweep; none is sent again, the queue keeps order.
    waiting = [svc.create_job(grpo_spec(str(random_model_dir), steps=2), arithmetic_data) for _ in range(4)]
    for job_id in waiting:
        svc.send(job_id)
    sent_at = {job_id: svc.job(job_id).enqueued_at for job_id in waiting}
    assert queued_in_order(svc) == waiting

    assert svc.settings.broker_url is not None
    client = redis.Redis.from_url(svc.settings.broker_url, decode_responses=True)
    lost = waiting[2]

    def lose_its_message() -> None:
        before = svc.job(lost).enqueued_at
        (raw,) = [m for m in client.lrange("celery", 0, -1) if job_id_of(m) == lost]
        assert isinstance(raw, str) and client.lrem("celery", 1, raw) == 1
        svc.wait_for("the lost message to be sent again", lambda: svc.job(lost).enqueued_at != before, timeout=30)

    # The broker loses that one's message, twice: each re-send is a sweep that found it waiting past the grace
    # period (1 s); the second comes a grace period after the first, when all four have waited past it.
    lose_its_message()
    lose_its_message()
    assert queued_in_order(svc) == [waiting[0], waiting[1], waiting[3], lost]  # once, at the end
    assert {j: svc.job(j).enqueued_at for j in waiting if j != lost} == {j: sent_at[j] for j in waiting if j != lost}
    for job_id in waiting:
        svc.set_flag(job_id, status="cancelled", cancel_requested=True)

    # The trainer (stuck: it cannot even read its stdin) dies with its worker.
    os.kill(busy_worker.pid, signal.SIGKILL)  # the worker alone, not its process group
    busy_worker.wait()
    svc.wait_for("the trainer to die with its worker", lambda: not alive(pid), timeout=15)

    # Cancelled after its worker died; and another job whose worker died after a pause request.
    svc.set_flag(busy, cancel_requested=True)  # what the API's cancel does for a running job
    abandoned = svc.create_job(grpo_spec(str(random_model_dir), steps=2), arithmetic_data)
    svc.set_flag(
        abandoned, status="running", lease_owner="dead", lease_expires_at=time.time() - 60, pause_requested=True
    )
    stored_checkpoint(svc, abandoned, 3)
    start_worker(svc, "next")

    job = svc.wait_status(busy, "cancelled", "failed", "succeeded", timeout=60)
    assert job.status == "cancelled" and job.lease_owner is None and job.finished_at is not None
    assert messages(svc, busy)[-1] == "The job was cancelled (its worker had stopped)"
    job = svc.wait_status(abandoned, "paused", "cancelled", "failed", timeout=30)
    assert job.status == "paused" and not job.pause_requested and job.lease_owner is None
    assert messages(svc, abandoned)[-1] == (
        "The job was paused (its worker had stopped): resume continues from its checkpoint at step 3"
    )
    assert [svc.job(j).status for j in waiting] == ["cancelled"] * 4  # their messages were consumed and skipped


# -- a trainer killed, a trainer crashed ----------------------------------------------------------------------------


def test_a_trainer_killed_by_sigkill_starts_again_from_its_checkpoint_once_then_the_job_fails_out_of_memory(
    make_service: Callable[..., Service], random_model_dir: Path, arithmetic_data: Path
) -> None:
    svc = make_service()
    worker = start_worker(svc, "w", env={HANG_ENV: "start"})
    job_id = svc.create_job(grpo_spec(str(random_model_dir), steps=50), arithmetic_data)
    stored_checkpoint(svc, job_id, 2)
    svc.send(job_id)
    first = wait_for_trainer(svc, job_id)
    os.kill(first, signal.SIGKILL)  # what the kernel's out-of-memory killer does

    retried = "; training again from the checkpoint at step 2, once before the job fails"
    svc.wait_for("the retry", lambda: [m for m in messages(svc, job_id) if m.endswith(retried)])
    second = wait_for_trainer(svc, job_id)
    assert second != first
    os.kill(second, signal.SIGKILL)

    job = svc.wait_status(job_id, "failed", "succeeded", "cancelled", timeout=30)
    assert job.error is not None and job.error["code"] == "out_of_memory", job.error
    assert "out of memory" in job.error["message"] and "batch_size" in job.error["message"]
    assert job.attempts == 1 and job.lease_owner is None
    assert len([m for m in messages(svc, job_id) if m.endswith(retried)]) == 1
    assert worker.poll() is None


def test_a_trainer_crash_fails_the_job_with_a_message_and_no_traceback_which_goes_to_the_workers_log(
    make_service: Callable[..., Service], random_model_dir: Path, arithmetic_data: Path
) -> None:
    svc = make_service()
    start_worker(svc, "w")
    job_id = svc.create_job(grpo_spec(str(random_model_dir), steps=2), arithmetic_data)
    prefix = f"jobs/{job_id}/checkpoints/step-000001"
    svc.store.put_bytes(f"{prefix}/trainer_state.pt", b"not a torch file")  # the trainer fails to load it
    with session_scope(svc.url) as s:
        s.add(Checkpoint(id=ids.checkpoint_id(), job_id=job_id, step_number=1, metrics={}, storage_key=prefix))
    svc.send(job_id)

    job = svc.wait_status(job_id, "failed", "succeeded", timeout=90)
    assert job.error is not None and job.error["code"] == "trainer_error", job.error
    message = job.error["message"]
    assert message.startswith("the trainer failed with an unexpected error (UnpicklingError: "), message
    assert "worker's log" in message
    assert "Traceback" not in message and "File " not in message and "/" not in message and "\n" not in message
    assert messages(svc, job_id)[-1] == f"The job failed: {message}"
    assert "Traceback (most recent call last)" in svc.worker_logs()


# -- backends in trouble --------------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def pg_binary(name: str) -> str | None:
    return shutil.which(name) or next(iter(sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"))[-1:]), None)


class PostgresCluster:
    """A PostgreSQL server of the test's own (never the machine's shared one), on a free port, stopped and started
    at will. As root it runs as the ``postgres`` user (initdb refuses root)."""

    def __init__(self) -> None:
        initdb, self.pg_ctl = pg_binary("initdb"), pg_binary("pg_ctl")
        if initdb is None or self.pg_ctl is None:
            pytest.skip("PostgreSQL's initdb and pg_ctl are not installed")
        self.root = Path(tempfile.mkdtemp(prefix="proxima-pg-"))
        self.as_user: list[str] = []
        if os.geteuid() == 0:
            self.as_user = ["runuser", "-u", "postgres", "--"]
            shutil.chown(self.root, "postgres")
        self.data, self.port = self.root / "data", free_port()
        self._run(initdb, "-D", str(self.data), "-A", "trust", "-U", "postgres", "--no-sync")
        self.url = f"postgresql+psycopg2://postgres@127.0.0.1:{self.port}/postgres"

    def _run(self, *cmd: str) -> None:
        subprocess.run([*self.as_user, *cmd], check=True, capture_output=True, timeout=120)

    def start(self) -> None:
        options = f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1 -c fsync=off"
        assert self.pg_ctl is not None
        self._run(self.pg_ctl, "-D", str(self.data), "-l", str(self.root / "log"), "-o", options, "-w", "start")

    def stop(self) -> None:
        assert self.pg_ctl is not None
        self._run(self.pg_ctl, "-D", str(self.data), "-m", "fast", "-w", "stop")

    def terminate_connections(self) -> int:
        """Every client connection but this one, cut (a connection reset, as a proxy or a failover does)."""
        import psycopg2  # type: ignore[import-untyped]

        conn = psycopg2.connect(host="127.0.0.1", port=self.port, user="postgres", dbname="postgres")
        conn.autocommit = True
        with conn.cursor() as cur:
            cur.execute(
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity"
                " WHERE pid <> pg_backend_pid() AND backend_type = 'client backend'"
            )
            (n,) = cur.fetchone()
        conn.close()
        return int(n)

    def remove(self) -> None:
        with contextlib.suppress(subprocess.CalledProcessError, subprocess.TimeoutExpired):
            assert self.pg_ctl is not None
            self._run(self.pg_ctl, "-D", str(self.data), "-m", "immediate", "-w", "stop")
        shutil.rmtree(self.root, ignore_errors=True)


@pytest.fixture
def own_postgres() -> Iterator[PostgresCluster]:
    pg = PostgresCluster()
    try:
        pg.start()
        yield pg
    finally:
        dispose_engines(pg.url)
        pg.remove()


def test_a_running_job_rides_out_a_connection_reset_and_a_database_restart_recording_everything_once(
    own_postgres: PostgresCluster, tmp_path: Path, random_model_dir: Path, arithmetic_data: Path
) -> None:
    steps = 8
    svc = Service(tmp_path / "service", database_url=own_postgres.url, broker_url=redis_url())
    try:
        add_model_to_store(svc, random_model_dir)
        start_worker(svc, "w")
        job_id = svc.create_job(grpo_spec(STORE_MODEL, steps=steps), arithmetic_data)
        svc.send(job_id)
        svc.wait_for("step 2", lambda: max(svc.metric_steps(job_id), default=0) >= 2)
        assert own_postgres.terminate_connections() >= 1  # the worker's connections are reset under it
        svc.wait_for("step 4", lambda: max(svc.metric_steps(job_id), default=0) >= 4)
        own_postgres.stop()  # down for twice the lease (3 s): the trainer trains on, its progress buffered
        time.sleep(6)
        own_postgres.start()

        job = svc.wait_status(job_id, "succeeded", "failed", "cancelled", timeout=180)
        assert job.status == "succeeded" and job.attempts == 1, job.error
        assert svc.metric_steps(job_id) == list(range(1, steps + 1))
        assert [c.step_number for c in svc.checkpoints(job_id)] == list(range(1, steps + 1))
        said = messages(svc, job_id)
        assert [m for m in said if m.startswith("Step ")] == [f"Step {n}/{steps}" for n in range(1, steps + 1)]
        assert [m for m in said if m.startswith("Checkpoint created")] == [
            f"Checkpoint created at step {n}" for n in range(1, steps + 1)
        ]
        assert said.count("Fine-tuning job started") == 1 and said[-1] == "The job has successfully completed"
        assert not [m for m in said if "failed" in m.lower() or m.startswith("Resuming")]
        # The events name the model as the job does, never the worker's folder for it.
        assert f"training grpo on {STORE_MODEL} for {steps} steps" in said
        home = str(svc.settings.home)
        assert not [e.message for e in svc.events(job_id) if home in e.message or home in json.dumps(e.data)]
    finally:
        svc.close()


@contextlib.contextmanager
def tmpfs(path: Path, size: str) -> Iterator[None]:
    path.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        yield
    finally:
        subprocess.run(["umount", "-l", str(path)], check=True)


def fill(path: Path, *, leave: int) -> Path:
    stat = os.statvfs(path)
    filler = path / f"filler-{uuid.uuid4().hex}"
    filler.write_bytes(b"\0" * max(stat.f_bavail * stat.f_frsize - leave, 0))
    return filler


def test_a_full_artifact_store_fails_the_job_as_storage_full_leaving_nothing_half_written_and_the_worker_serves_on(
    tmp_path: Path, random_model_dir: Path, arithmetic_data: Path
) -> None:
    root = tmp_path / "service"
    with tmpfs(root / "artifacts", "4m"):
        db = create_pg_database()
        svc = Service(root, database_url=db, broker_url=redis_url())
        try:
            worker = start_worker(svc, "w")
            job_id = svc.create_job(grpo_spec(str(random_model_dir), steps=3), arithmetic_data)
            filler = fill(root / "artifacts", leave=16 * 1024)  # room for less than one checkpoint
            svc.send(job_id)

            job = svc.wait_status(job_id, "failed", "succeeded", timeout=90)
            assert job.error is not None and job.error["code"] == "storage_full", job.error
            assert job.error["message"].startswith("the artifact store is full: a checkpoint of this job")
            assert svc.checkpoints(job_id) == [] and svc.store.list(f"jobs/{job_id}") == []
            assert messages(svc, job_id)[-1] == f"The job failed: {job.error['message']}"

            filler.unlink()  # space freed: the same worker takes the next job
            following = svc.create_job(grpo_spec(str(random_model_dir), steps=1), arithmetic_data)
            svc.send(following)
            assert svc.wait_status(following, "running", "succeeded", "failed", timeout=30).attempts == 1
            assert worker.poll() is None
        finally:
            svc.close()
            drop_pg_database(db)

"""Real worker processes against real backends: a fresh PostgreSQL database, a Redis database, a folder artifact store.

:class:`Service` creates rows directly through the ORM (tenant, uploaded files, a queued job), sends the broker
message the API would send, starts and kills ``python -m worker.main`` processes and waits on the database.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from celery import Celery  # type: ignore[import-untyped]
from sqlalchemy import select

from api import ids
from api.db import session_scope
from api.migrate import upgrade
from api.orm import Checkpoint, File, Job, JobEvent, JobMetric, Tenant
from api.settings import Settings
from api.status import JobStatus
from api.storage import store_from_url
from api.tasks import RUN_JOB
from tests.redis_dbs import claim_redis_url, release_redis_url
from trainer.spec.config import parse_spec

PG_ADMIN = "postgresql+psycopg2://postgres@127.0.0.1:5432/postgres"
LEASE_SECONDS = 3.0
SIM = {
    "type": "text_similarity",
    "name": "sim",
    "input": "{{sample.output_text}}",
    "reference": "{{item.answer}}",
    "evaluation_metric": "fuzzy_match",
}


def grpo_spec(model: str, *, steps: int = 6, **hp: Any) -> dict[str, Any]:
    """The job spec as the API stores it: validated, file ids in place of paths."""
    hyper = {
        "max_steps": steps,
        "batch_size": 4,
        "group_size": 4,
        "max_completion_tokens": 6,
        "checkpoint_interval": 1,
        "eval_prompts": 4,
        "precision": "fp32",
        "learning_rate": 1e-2,
        **hp,
    }
    raw = {
        "model": model,
        "training_file": "file-placeholder",
        "validation_file": "file-placeholder",
        "seed": 3,
        "method": {"type": "grpo", "grpo": {"grader": SIM, "hyperparameters": hyper}},
    }
    return parse_spec(raw).to_json()


def create_pg_database() -> str:
    import psycopg2  # type: ignore[import-untyped]

    name = f"proxima_worker_{uuid.uuid4().hex[:12]}"
    conn = psycopg2.connect(host="127.0.0.1", port=5432, user="postgres", dbname="postgres")
    conn.autocommit = True
    with conn.cursor() as cur:
        cur.execute(f'CREATE DATABASE "{name}"')
    conn.close()
    return f"postgresql+psycopg2://postgres@127.0.0.1:5432/{name}"


def drop_pg_database(url: str) -> None:
    import psycopg2  # type: ignore[import-untyped]

    from api.db import dispose_engines

    dispose_engines(url)
    name = url.rsplit("/", 1)[1]
    conn = psycopg2.connect(host="127.0.0.1", port=5432, user="postgres", dbname="postgres")
    conn.autocommit = True
    with conn.cursor() as cur:
        cur.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    conn.close()


class Service:
    def __init__(self, root: Path, *, database_url: str | None, broker_url: str | None) -> None:
        self.root = root
        self.env = {
            "PROXIMA_HOME": str(root / "home"),
            "PROXIMA_ARTIFACTS": str(root / "artifacts"),
            "PROXIMA_LEASE_SECONDS": str(LEASE_SECONDS),
        }
        if database_url:
            self.env["PROXIMA_DATABASE_URL"] = database_url
        if broker_url:
            self.env["PROXIMA_BROKER_URL"] = broker_url
        self.settings = Settings(  # type: ignore[call-arg]
            home=root / "home",
            database_url=database_url,
            broker_url=broker_url,
            artifacts=str(root / "artifacts"),
            lease_seconds=LEASE_SECONDS,
        )
        self.settings.home.mkdir(parents=True, exist_ok=True)
        self.url = self.settings.db_url
        upgrade(self.url)
        self.store = store_from_url(self.settings.artifacts_url)
        self.celery = Celery("proxima-tests", broker=self.settings.celery_broker_url)
        self.workers: list[subprocess.Popen[bytes]] = []
        self.tenant = ids.tenant_id()
        with session_scope(self.url) as s:
            s.add(Tenant(id=self.tenant, name=f"tenant-{secrets.token_hex(4)}"))

    # -- workers -------------------------------------------------------------------------------------------------

    def start_worker(self, name: str) -> subprocess.Popen[bytes]:
        # Not this process's W&B service (WANDB_SERVICE, set where a test ran W&B here): a worker starts its own.
        env = {k: v for k, v in os.environ.items() if not k.startswith("PROXIMA_") and k != "WANDB_SERVICE"}
        env |= self.env
        log = (self.root / f"worker-{name}.log").open("wb")
        proc = subprocess.Popen(
            [sys.executable, "-m", "worker.main", "--hostname", name, "--sweep-interval", "1"],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: killing it kills its trainer too, like a dead machine
        )
        self.workers.append(proc)
        return proc

    def kill_worker(self, proc: subprocess.Popen[bytes]) -> None:
        with _suppress_lookup():
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()

    def stop_workers(self) -> None:
        for proc in self.workers:  # the worker, and any trainer it left behind: the test's outcome is recorded
            self.kill_worker(proc)

    def worker_logs(self) -> str:
        return "\n".join(
            f"--- {p.name}\n{p.read_text(errors='replace')[-4000:]}" for p in self.root.glob("worker-*.log")
        )

    # -- rows ----------------------------------------------------------------------------------------------------

    def upload(self, path: Path) -> str:
        file_id = ids.file_id()
        key = f"files/{self.tenant}/{file_id}.jsonl"
        size = self.store.put_file(key, path)
        with session_scope(self.url) as s:
            s.add(
                File(
                    id=file_id,
                    tenant_id=self.tenant,
                    filename=path.name,
                    purpose="fine-tune",
                    bytes=size,
                    lines=len(path.read_text().splitlines()),
                    storage_key=key,
                )
            )
        return file_id

    def create_job(self, spec: dict[str, Any], data: Path, *, enqueued_at: float | None = None, **flags: Any) -> str:
        """Insert a job row directly (no message sent); `flags` set further columns in the same insert, so that a
        sweeper running meanwhile never sees the row without them."""
        train, val = self.upload(data / "train.jsonl"), self.upload(data / "validation.jsonl")
        spec = {**spec, "training_file": train, "validation_file": val}
        job_id = ids.job_id()
        with session_scope(self.url) as s:
            s.add(
                Job(
                    id=job_id,
                    tenant_id=self.tenant,
                    model=spec["model"],
                    training_file=train,
                    validation_file=val,
                    status=flags.pop("status", JobStatus.QUEUED),
                    spec=spec,
                    seed=spec.get("seed", 0),
                    suffix="e2e",
                    enqueued_at=time.time() if enqueued_at is None else enqueued_at,
                    **flags,
                )
            )
        return job_id

    def send(self, job_id: str) -> None:
        self.celery.send_task(RUN_JOB, args=[job_id])

    def job(self, job_id: str) -> Job:
        with session_scope(self.url) as s:
            job = s.get(Job, job_id)
            assert job is not None
            return job

    def metric_steps(self, job_id: str) -> list[int]:
        with session_scope(self.url) as s:
            return list(s.scalars(select(JobMetric.step).where(JobMetric.job_id == job_id).order_by(JobMetric.step)))

    def metrics(self, job_id: str) -> dict[int, dict[str, Any]]:
        with session_scope(self.url) as s:
            return {m.step: m.values for m in s.scalars(select(JobMetric).where(JobMetric.job_id == job_id))}

    def checkpoints(self, job_id: str) -> list[Checkpoint]:
        with session_scope(self.url) as s:
            q = select(Checkpoint).where(Checkpoint.job_id == job_id).order_by(Checkpoint.step_number)
            return list(s.scalars(q))

    def events(self, job_id: str) -> list[JobEvent]:
        with session_scope(self.url) as s:
            return list(s.scalars(select(JobEvent).where(JobEvent.job_id == job_id).order_by(JobEvent.seq)))

    def file(self, file_id: str) -> File:
        with session_scope(self.url) as s:
            f = s.get(File, file_id)
            assert f is not None
            return f

    def set_flag(self, job_id: str, **values: Any) -> None:
        with session_scope(self.url) as s:
            job = s.get(Job, job_id)
            assert job is not None
            for k, v in values.items():
                setattr(job, k, v)

    def wait_for(self, what: str, check: Callable[[], Any], timeout: float = 90.0) -> Any:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if value := check():
                return value
            dead = [p for p in self.workers if p.poll() not in (None, -signal.SIGKILL)]
            assert not dead, f"a worker exited while waiting for {what}:\n{self.worker_logs()}"
            time.sleep(0.2)
        raise AssertionError(f"timed out waiting for {what}\n{self.worker_logs()}")

    def wait_status(self, job_id: str, *statuses: str, timeout: float = 90.0) -> Job:
        return self.wait_for(
            f"{job_id} to be {'/'.join(statuses)}",
            lambda: (j := self.job(job_id)).status in statuses and j,
            timeout,
        )

    def close(self) -> None:
        self.stop_workers()
        self.celery.close()
        release_redis_url(self.settings.broker_url)


class _suppress_lookup:
    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, *_: object) -> bool:
        return kind is not None and issubclass(kind, ProcessLookupError)


def redis_url() -> str:
    """A Redis database of its own for a deployment (see tests/redis_dbs.py); :meth:`Service.close` gives a
    Service's back, other users call :func:`release_redis_url`."""
    return claim_redis_url()


@contextlib.contextmanager
def service_factory(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., Service]]:
    made: list[tuple[Service, str | None]] = []

    def make(*, embedded: bool = False) -> Service:
        root = tmp_path_factory.mktemp("service")
        db = None if embedded else create_pg_database()
        svc = Service(root, database_url=db, broker_url=None if embedded else redis_url())
        made.append((svc, db))
        return svc

    try:
        yield make
    finally:
        for svc, db in made:
            svc.close()
            if db is not None:
                drop_pg_database(db)


@pytest.fixture
def make_service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., Service]]:
    """``make_service()`` → a Service on PostgreSQL + Redis; ``make_service(embedded=True)`` → SQLite + the embedded
    broker. Workers are stopped and the database dropped afterwards."""
    with service_factory(tmp_path_factory) as make:
        yield make


@pytest.fixture
def model_copy(random_model_dir: Path, tmp_path: Path) -> Path:
    """A job's own copy of the tiny random model (a test may delete it)."""
    out = tmp_path / "model"
    shutil.copytree(random_model_dir, out)
    return out


# -- the browser (Playwright driving Debian's Chromium) --------------------------------------------------------------


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    from playwright.sync_api import sync_playwright

    from tests.e2e.dashboard_support import CHROMIUM

    if not CHROMIUM.exists():
        pytest.fail(
            f"{CHROMIUM} is missing: the browser tests drive Debian's Chromium. "
            "`make test` installs it (`make system-tools` alone), or `apt-get install -y chromium`."
        )
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=str(CHROMIUM))
        yield browser
        browser.close()


@pytest.fixture
def page(browser: Any) -> Iterator[Any]:
    """A fresh browser profile at 1280×800; a script error in the page fails the test."""
    context = browser.new_context(viewport={"width": 1280, "height": 800}, accept_downloads=True)
    page = context.new_page()
    page.set_default_timeout(20_000)
    errors: list[str] = []
    page.on("pageerror", lambda err: errors.append(str(err)))
    yield page
    context.close()
    assert not errors, f"script errors in the page: {errors}"


# -- the built-in calculator tool server (agent jobs) -------------------------------------------------------------


@pytest.fixture(scope="session")
def calculator() -> Iterator[str]:
    """The calculator tool server (`trainer.agents.calculator_server`) over real HTTP on a free port: its URL."""
    import threading
    import time

    from trainer.agents import calculator_server

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    server = calculator_server.make_server("127.0.0.1", port)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline, "the calculator server did not start"
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}/"
    server.should_exit = True
    thread.join(10)

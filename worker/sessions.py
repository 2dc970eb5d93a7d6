"""Tinker training sessions on a worker (issue 17): lease a session with waiting requests, hold its model in a child
process (``worker.session_process``), run its requests in the SDK's order, write their results.

A worker holds at most ``PROXIMA_WORKER_SESSIONS`` sessions at once, beside its jobs (Celery's ``--concurrency``):
the :class:`SessionHost` thread claims a session when it has room, and each claimed session gets a
:class:`SessionServer` thread. The database decides everything, as for jobs: a claim is one conditional UPDATE on the
session's lease, renewed while it serves.

What a session survives:

- **idle**: without a request for ``session_idle_s`` its state is saved to the artifact store (if it changed since
  the last save), its model unloaded and its lease released; the next request makes it claimable, and whichever
  worker claims it loads the saved state.
- **its worker's death**: the lease runs out; the next owner fails the request that was running (the client gets
  an error naming the saved state the session continues from) and loads the last saved state: the state is saved
  every ``session_autosave_steps`` optimiser steps (default: every step), and at every explicit save.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import IO, Any

from sqlalchemy.exc import SQLAlchemyError

from api import notify
from api.db import session_scope
from api.orm import Sampler, SessionRequest, TrainingSession
from api.repositories import tinker as repo
from api.services.tinker import TINKER_SCHEME, storage_prefix
from api.settings import Settings
from api.storage import ArtifactStore
from worker import messages as msg
from worker.errors import JobError
from worker.frames import read_frame, write_frame
from worker.tasks import resolve_model, store_for

log = logging.getLogger("proxima.worker.sessions")

CLAIM_POLL_S = 0.25  # how often a worker with room looks for a session to claim
OUTAGE_RETRY_S = 1.0  # how often a database write is tried again while the database does not answer
CLOCK_MARGIN = 0.1  # the share of a lease held back for clock differences between machines
REQUEST_POLL_S = (0.005, 0.01, 0.02, 0.05)  # how often a serving session looks for its next request
NOTIFIED_POLL_S = 0.5  # ... and where the API's notifications wake it (PostgreSQL)
SAMPLE_BATCH_ROWS = 64  # sample requests waiting together are sampled together, up to this many completions


class SessionFailed(Exception):
    """The child reported a failure: ``category`` user (the request's content) or server."""

    def __init__(self, message: str, category: str) -> None:
        super().__init__(message)
        self.category = category


class Child:
    """The child process holding the model, spoken to in frames."""

    def __init__(self, env: dict[str, str]) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "worker.session_process"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
        )
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.inp: IO[bytes] = self.proc.stdin
        self.out: IO[bytes] = self.proc.stdout

    def call(self, op: str, **fields: Any) -> dict[str, Any]:
        try:
            write_frame(self.inp, {"op": op, **fields})
            answer: dict[str, Any] = read_frame(self.out)
        except (EOFError, BrokenPipeError, OSError):
            code = self.proc.poll()
            raise SessionFailed(f"the session's process ended (exit status {code})", "server") from None
        if not answer.get("ok"):
            raise SessionFailed(str(answer.get("error")), str(answer.get("category", "server")))
        return answer

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


def _upload_folder(store: ArtifactStore, folder: Path, prefix: str) -> int:
    total = 0
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        total += store.put_file(f"{prefix}/{path.relative_to(folder).as_posix()}", path)
    return total


def _download_folder(store: ArtifactStore, prefix: str, folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for key in store.list(prefix):
        dest = folder / key.removeprefix(prefix + "/")
        dest.parent.mkdir(parents=True, exist_ok=True)
        store.get_to_path(key, dest)
    return folder


class SessionServer(threading.Thread):
    """Serves one leased session until it is idle, closed and drained, or its lease is lost."""

    def __init__(
        self, settings: Settings, session_id: str, worker_id: str, *, listener: notify.Listener | None = None
    ) -> None:
        super().__init__(daemon=True, name=f"session-{session_id}")
        self.settings, self.id, self.worker_id = settings, session_id, worker_id
        self.listener = listener  # wakes the server when a request for it is queued (PostgreSQL)
        self.queued = threading.Event()
        self.store = store_for(settings)
        self.stopping = threading.Event()
        self.child: Child | None = None
        self.scratch = Path(tempfile.mkdtemp(prefix="proxima-session-"))
        self.steps = 0  # optimiser steps of the state in memory
        self.saved_steps = 0  # ... and of the last saved state
        self.gradients = False  # gradients wait in the child for an optimiser step
        self.next_seq_id = 1
        self.last_renewal = time.time()

    # -- life cycle ----------------------------------------------------------------------------------------------

    def run(self) -> None:
        if self.listener is not None:
            self.listener.add(self.id, self.queued.set)
        try:
            row = self._take_over()
            if row is None:
                return
            self._load(row)
            self._serve()
        except Exception:
            log.exception("session %s: serving failed", self.id)
        finally:
            if self.listener is not None:
                self.listener.discard(self.id, self.queued.set)
            if self.child is not None:
                self.child.stop()
            with session_scope(self.settings.db_url) as s:
                repo.release(s, id=self.id, worker_id=self.worker_id)
            shutil.rmtree(self.scratch, ignore_errors=True)

    def _take_over(self) -> TrainingSession | None:
        """Fail what a lost owner was running; read the session."""
        with session_scope(self.settings.db_url) as s:
            row = s.get(TrainingSession, self.id)
            if row is None:
                return None
            steps = row.saved_steps
            failed = repo.fail_in_flight(
                s,
                id=self.id,
                message=f"the worker serving this session was lost while it ran this request; the session continues "
                f"from its last saved state (after {steps} optimiser steps) on another worker: repeat the requests "
                "made since then",
            )
            if failed:
                log.warning("session %s: %d request(s) of a lost worker failed", self.id, failed)
                s.flush()
                s.refresh(row)  # its order moved past them
            s.expunge(row)
            return row

    def _load(self, row: TrainingSession) -> None:
        env = os.environ | {msg.PARENT_PID_ENV: str(os.getpid())}
        try:
            model_path = resolve_model(row.base_model, self.settings.home / "models")
        except JobError as err:
            self._fail_waiting(err.message)
            raise
        state_dir = None
        if row.saved_state_key:
            state_dir = _download_folder(self.store, row.saved_state_key, self.scratch / "state")
        self.child = Child(env)
        loaded = self.child.call(
            "load",
            model_path=model_path,
            lora=row.lora,
            state_dir=str(state_dir) if state_dir else None,
            optimizer=row.saved_state_optimizer,
            precision=self.settings.session_precision,
        )
        self.gradients = bool(loaded.get("gradients"))  # kept by an idle unload
        self.steps = self.saved_steps = row.saved_steps if row.saved_state_key else 0
        self.next_seq_id = row.next_seq_id
        with session_scope(self.settings.db_url) as s:
            repo.mark_loaded(s, id=self.id, worker_id=self.worker_id, restored=row.loaded_on is not None)
            if self.steps != row.optimizer_steps:
                repo.set_steps(s, id=self.id, optimizer_steps=self.steps)

    def _fail_waiting(self, message: str) -> None:
        with session_scope(self.settings.db_url) as s:
            for req in repo.pending_requests(s, id=self.id):
                repo.finish_request(
                    s, request_id=req.id, result=None, result_format=None, error={"error": message, "category": "user"}
                )

    def _serve(self) -> None:
        idle_from, attempt = time.time(), 0
        while not self.stopping.is_set():
            if not self._renew():
                log.warning("session %s: lease lost; unloading", self.id)
                return
            self.queued.clear()  # before the read: a request queued after it wakes the wait below
            try:
                req = self._next()
            except SQLAlchemyError as err:  # the database away a moment: the lease decides how long we wait
                log.warning("session %s: reading its requests failed (%s)", self.id, type(err).__name__)
                time.sleep(OUTAGE_RETRY_S)
                continue
            if req is not None:
                if req.kind == "sample":
                    self._run_samples(req)
                else:
                    self._run(req)
                idle_from, attempt = time.time(), 0
                continue
            if time.time() - idle_from >= self.settings.session_idle_s or self._closed_and_drained():
                self._unload()
                return
            backoff = REQUEST_POLL_S[min(attempt, len(REQUEST_POLL_S) - 1)]
            self.queued.wait(NOTIFIED_POLL_S if self.listener is not None else backoff)
            attempt += 1

    def _next(self) -> SessionRequest | None:
        with session_scope(self.settings.db_url) as s:
            req = repo.next_request(s, id=self.id, next_seq_id=self.next_seq_id)
            if req is not None:
                repo.start_request(s, request_id=req.id)
                s.expunge(req)
            return req

    def _closed_and_drained(self) -> bool:
        with session_scope(self.settings.db_url) as s:
            return repo.closed(s, id=self.id) and repo.waiting_requests(s, id=self.id) == 0

    def _renew(self) -> bool:
        """Renew the lease every third of its length; False once it is lost. A renewal the database does not answer
        is tried again at the next turn, while the last one's lease has not run out (less a margin for clocks)."""
        lease = self.settings.lease_seconds
        if time.time() - self.last_renewal < lease / 3:
            return True
        try:
            with session_scope(self.settings.db_url) as s:
                ok = repo.renew(s, id=self.id, worker_id=self.worker_id, lease_seconds=lease)
        except SQLAlchemyError as err:
            log.warning("session %s: lease renewal failed (%s); retrying", self.id, type(err).__name__)
            return time.time() - self.last_renewal < lease * (1 - CLOCK_MARGIN)
        self.last_renewal = time.time()
        return ok

    def _unload(self) -> None:
        if self.steps != self.saved_steps or self.gradients:
            self._autosave(gradients=self.gradients)
        log.info("session %s: idle, unloaded", self.id)

    # -- requests --------------------------------------------------------------------------------------------------

    def _run(self, req: SessionRequest) -> None:
        try:
            result, fmt, loss = getattr(self, f"_do_{req.kind}")(req)
            error = None
        except SessionFailed as err:
            result, fmt, loss, error = None, None, None, {"error": str(err), "category": err.category}
            if err.category == "server":
                log.error("session %s: request %s (%s) failed: %s", self.id, req.id, req.kind, err)
        self._write_outcome(req, result, fmt, error, loss)
        if req.seq_id is not None:
            self.next_seq_id = max(self.next_seq_id, req.seq_id + 1)
        if error is not None and error["category"] == "server":
            self._check_child(error["error"])

    def _check_child(self, error: str) -> None:
        if self.child and self.child.proc.poll() is not None:
            raise RuntimeError(f"the session's process died: {error}")

    def _write_outcome(
        self,
        req: SessionRequest,
        result: bytes | None,
        fmt: str | None,
        error: dict[str, Any] | None,
        loss: float | None,
    ) -> None:
        """The request's outcome, written again while the database is away and the lease may still be ours."""
        while True:
            try:
                with session_scope(self.settings.db_url) as s:
                    repo.finish_request(s, request_id=req.id, result=result, result_format=fmt, error=error, loss=loss)
                    repo.advance(s, id=self.id, seq_id=req.seq_id, optimizer_steps=self.steps, loss=loss)
                return
            except SQLAlchemyError as err:
                if not self._renew():
                    raise
                log.warning("session %s: writing request %s failed (%s); retrying", self.id, req.id, err)
                time.sleep(OUTAGE_RETRY_S)

    def _call(self, op: str, **fields: Any) -> dict[str, Any]:
        assert self.child is not None
        return self.child.call(op, **fields)

    def _do_forward_backward(self, req: SessionRequest) -> tuple[bytes, str, float | None]:
        answer = self._call(req.kind, payload=req.payload)
        self.gradients |= req.kind == "forward_backward"
        return answer["result"], answer["format"], answer.get("loss")

    _do_forward = _do_forward_backward

    def _do_optim_step(self, req: SessionRequest) -> tuple[bytes, str, None]:
        answer = self._call("optim_step", payload=req.payload)
        self.steps, self.gradients = self.steps + 1, False
        if self.steps - self.saved_steps >= self.settings.session_autosave_steps:
            self._autosave()
        return answer["result"], answer["format"], None

    def _save_state_to(self, key: str, *, gradients: bool = False) -> int:
        folder = self.scratch / "save"
        shutil.rmtree(folder, ignore_errors=True)
        self._call("save_state", dir=str(folder), gradients=gradients)
        return _upload_folder(self.store, folder, key)

    def _autosave(self, *, gradients: bool = False) -> None:
        key = f"{self._prefix()}/autosave/{self.steps:08d}-{int(time.time() * 1000)}"
        self._save_state_to(key, gradients=gradients)
        with session_scope(self.settings.db_url) as s:
            previous = repo.set_saved_state(s, id=self.id, key=key, steps=self.steps)
        self.saved_steps = self.steps
        if previous and "/autosave/" in previous:
            self.store.delete_prefix(previous)

    def _prefix(self) -> str:
        with session_scope(self.settings.db_url) as s:
            tenant = repo.tenant_of(s, id=self.id)
        assert tenant is not None
        return storage_prefix(tenant, self.id)

    def _checkpoint(self, req: SessionRequest, kind: str, name: str, key: str, size: int, ttl: int | None) -> None:
        with session_scope(self.settings.db_url) as s:
            repo.record_checkpoint(
                s,
                tenant_id=req.tenant_id,
                session_id=self.id,
                kind=kind,
                name=name,
                storage_key=key,
                size_bytes=size,
                optimizer_steps=self.steps,
                ttl_seconds=ttl,
            )

    def _do_save_weights(self, req: SessionRequest) -> tuple[bytes, str, None]:
        body = json.loads(req.payload)
        key = f"{self._prefix()}/weights/{body['name']}-{int(time.time() * 1000)}"
        size = self._save_state_to(key)
        self._checkpoint(req, "weights", body["name"], key, size, body.get("ttl_seconds"))
        with session_scope(self.settings.db_url) as s:
            previous = repo.set_saved_state(s, id=self.id, key=key, steps=self.steps)
        self.saved_steps = self.steps
        if previous and "/autosave/" in previous:
            self.store.delete_prefix(previous)
        path = f"{TINKER_SCHEME}{self.id}/weights/{body['name']}"
        return json.dumps({"path": path, "type": "save_weights"}).encode(), "json", None

    def _save_adapter(self, kind: str, name: str, *, snapshot: bool) -> tuple[str, int]:
        folder = self.scratch / "adapter"
        shutil.rmtree(folder, ignore_errors=True)
        key = f"{self._prefix()}/{kind}/{name}-{int(time.time() * 1000)}"
        self._call("save_adapter", dir=str(folder), snapshot_key=key if snapshot else None)
        return key, _upload_folder(self.store, folder, key)

    def _do_save_weights_external(self, req: SessionRequest) -> tuple[bytes, str, None]:
        body = json.loads(req.payload)
        key, size = self._save_adapter("external_weights", body["name"], snapshot=False)
        self._checkpoint(req, "external_weights", body["name"], key, size, body.get("ttl_seconds"))
        path = f"{TINKER_SCHEME}{self.id}/external_weights/{body['name']}"
        return json.dumps({"path": path, "size_bytes": size, "type": "save_weights_external"}).encode(), "json", None

    def _do_save_weights_for_sampler(self, req: SessionRequest) -> tuple[bytes, str, None]:
        body = json.loads(req.payload)
        key, size = self._save_adapter("sampler_weights", body["name"], snapshot=True)
        self._checkpoint(req, "sampler_weights", body["name"], key, size, body.get("ttl_seconds"))
        if body.get("sampler_id"):
            with session_scope(self.settings.db_url) as s:
                row = s.get(TrainingSession, self.id)
                assert row is not None
                repo.add_sampler(
                    s,
                    Sampler(
                        id=body["sampler_id"],
                        tenant_id=req.tenant_id,
                        client_session_id=row.client_session_id,
                        serving_id=self.id,
                        base_model=row.base_model,
                        model_path=f"{TINKER_SCHEME}{self.id}/sampler_weights/{body['name']}",
                        weights_key=key,
                    ),
                )
            result = {"sampling_session_id": body["sampler_id"], "type": "save_weights_for_sampler"}
        else:
            path = f"{TINKER_SCHEME}{self.id}/sampler_weights/{body['name']}"
            result = {"path": path, "type": "save_weights_for_sampler"}
        return json.dumps(result).encode(), "json", None

    def _do_load_weights(self, req: SessionRequest) -> tuple[bytes, str, None]:
        body = json.loads(req.payload)
        folder = _download_folder(self.store, body["storage_key"], self.scratch / "load")
        self._call("load_state", dir=str(folder), optimizer=body["optimizer"])
        self.gradients = False  # a load drops them
        shutil.rmtree(folder, ignore_errors=True)
        with session_scope(self.settings.db_url) as s:
            if body["optimizer"]:
                self.steps = repo.checkpoint_steps(s, storage_key=body["storage_key"])
            repo.set_saved_state(s, id=self.id, key=body["storage_key"], steps=self.steps, optimizer=body["optimizer"])
        self.saved_steps = self.steps
        return json.dumps({"path": body["path"], "type": "load_weights"}).encode(), "json", None

    def _run_samples(self, first: SessionRequest) -> None:
        """``first`` and the sample requests waiting behind it (up to :data:`SAMPLE_BATCH_ROWS` completions), in
        one child call per set of weights; the child samples those whose settings agree in one generation."""
        batch = [first, *self._waiting_samples(after=first, rows=SAMPLE_BATCH_ROWS - _num_samples(first))]
        by_weights: dict[str | None, list[SessionRequest]] = {}
        for req in batch:
            by_weights.setdefault(json.loads(req.payload).get("weights_key"), []).append(req)
        failure = None
        for key, reqs in by_weights.items():
            payloads = [r.payload for r in reqs]
            try:
                if key is None:
                    answer = self._call("sample_many", payloads=payloads, weights="base")
                else:
                    folder = self.scratch / "snapshots" / key.replace("/", "_")
                    if not folder.is_dir():
                        _download_folder(self.store, key, folder)
                    answer = self._call("sample_many", payloads=payloads, snapshot_key=key, dir=str(folder))
                answers = answer["answers"]
            except SessionFailed as err:
                log.error("session %s: %d sample request(s) failed: %s", self.id, len(reqs), err)
                failure = str(err) if err.category == "server" else failure
                answers = [{"ok": False, "error": str(err), "category": err.category}] * len(reqs)
            for req, out in zip(reqs, answers, strict=True):
                if out["ok"]:
                    self._write_outcome(req, out["result"], out["format"], None, None)
                else:
                    self._write_outcome(req, None, None, {"error": out["error"], "category": out["category"]}, None)
        if failure is not None:
            self._check_child(failure)

    def _waiting_samples(self, *, after: SessionRequest, rows: int) -> list[SessionRequest]:
        """Sample requests that arrived after ``after`` and wait, marked running, while their completions fit in
        ``rows``."""
        taken: list[SessionRequest] = []
        with session_scope(self.settings.db_url) as s:
            for req in repo.pending_samples(s, id=self.id, after_seq=after.seq, limit=SAMPLE_BATCH_ROWS):
                rows -= _num_samples(req)
                if rows < 0:
                    break
                repo.start_request(s, request_id=req.id)
                s.expunge(req)
                taken.append(req)
        return taken


def _num_samples(req: SessionRequest) -> int:
    try:
        return max(1, int(json.loads(req.payload).get("num_samples", 1)))
    except (ValueError, TypeError, AttributeError):
        return 1


class SessionHost(threading.Thread):
    """Claims sessions while this worker has room for one more, and serves each in a :class:`SessionServer`."""

    def __init__(self, settings: Settings, worker_id: str, *, capacity: int, poll_s: float = CLAIM_POLL_S) -> None:
        super().__init__(daemon=True, name="session-host")
        self.settings, self.worker_id, self.capacity, self.poll_s = settings, worker_id, capacity, poll_s
        self.servers: dict[str, SessionServer] = {}
        self.done = threading.Event()
        self.listener: notify.Listener | None = None

    def run(self) -> None:
        if notify.supported(self.settings.db_url):
            self.listener = notify.Listener(self.settings.db_url, notify.QUEUED_CHANNEL).start()
        while not self.done.wait(self.poll_s):
            self.servers = {k: v for k, v in self.servers.items() if v.is_alive()}
            if len(self.servers) >= self.capacity:
                continue
            try:
                claimed = self._claim()
            except Exception:  # the database down: try again at the next poll
                log.warning("session host: claim failed", exc_info=True)
                continue
            if claimed is not None:
                server = SessionServer(self.settings, claimed, self.worker_id, listener=self.listener)
                self.servers[claimed] = server
                server.start()

    def _claim(self) -> str | None:
        at = time.time()
        with session_scope(self.settings.db_url) as s:
            for candidate in repo.claimable(s, at=at):
                if candidate in self.servers:
                    continue
                if repo.claim(
                    s, id=candidate, worker_id=self.worker_id, lease_seconds=self.settings.lease_seconds, at=at
                ):
                    return candidate
        return None

    def stop(self) -> None:
        self.done.set()
        for server in list(self.servers.values()):
            server.stopping.set()
        for server in list(self.servers.values()):
            server.queued.set()
            server.join(timeout=30)
        if self.listener is not None:
            self.listener.stop()

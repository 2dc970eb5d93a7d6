"""A Tinker session's requests, run in the SDK's order against the model in its child: forward and backward passes,
optimiser steps, saves and loads of weights, and sampling (requests waiting together sampled together). Each
request's outcome is written back to its row, again while the database is away and the lease may still be ours."""

from __future__ import annotations

import json
import logging
import time
from typing import Any

from sqlalchemy.exc import SQLAlchemyError

from api.db import session_scope
from api.orm import Sampler, SessionRequest, TrainingSession
from api.repositories import tinker as repo
from api.services.tinker import TINKER_SCHEME
from api.settings import Settings
from worker.session_child import SessionFailed, download_folder
from worker.session_lease import SessionLease
from worker.session_state import SessionState

log = logging.getLogger("proxima.worker.sessions")

OUTAGE_RETRY_S = 1.0  # how often a database write is tried again while the database does not answer
SAMPLE_BATCH_ROWS = 64  # sample requests waiting together are sampled together, up to this many completions

Outcome = tuple[bytes, str, float | None]
"""A request's result, its format and the loss it measured (None: none)."""


def num_samples(req: SessionRequest) -> int:
    try:
        return max(1, int(json.loads(req.payload).get("num_samples", 1)))
    except (ValueError, TypeError, AttributeError):
        return 1


class RequestHandler:
    """Runs session ``session_id``'s requests on its :class:`SessionState`; ``next_seq_id`` is the SDK order's
    next request."""

    def __init__(self, settings: Settings, session_id: str, state: SessionState, lease: SessionLease) -> None:
        self.settings, self.id, self.state, self.lease = settings, session_id, state, lease
        self.next_seq_id = 1

    def handle(self, req: SessionRequest) -> None:
        if req.kind == "sample":
            self._run_samples(req)
        else:
            self._run(req)

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
        if self.state.child_died():
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
                    repo.advance(s, id=self.id, seq_id=req.seq_id, optimizer_steps=self.state.steps, loss=loss)
                return
            except SQLAlchemyError as err:
                if not self.lease.renew():
                    raise
                log.warning("session %s: writing request %s failed (%s); retrying", self.id, req.id, err)
                time.sleep(OUTAGE_RETRY_S)

    # -- one request of each kind (``_do_`` + its kind) --------------------------------------------------------------

    def _do_forward_backward(self, req: SessionRequest) -> Outcome:
        answer = self.state.call(req.kind, payload=req.payload)
        self.state.gradients |= req.kind == "forward_backward"
        return answer["result"], answer["format"], answer.get("loss")

    _do_forward = _do_forward_backward

    def _do_optim_step(self, req: SessionRequest) -> Outcome:
        answer = self.state.call("optim_step", payload=req.payload)
        self.state.stepped()
        return answer["result"], answer["format"], None

    def _do_save_weights(self, req: SessionRequest) -> Outcome:
        body = json.loads(req.payload)
        key = f"{self.state.prefix()}/weights/{body['name']}-{int(time.time() * 1000)}"
        size = self.state.save_state_to(key)
        self.state.record_checkpoint(req, "weights", body["name"], key, size, body.get("ttl_seconds"))
        self.state.saved_as(key)
        path = f"{TINKER_SCHEME}{self.id}/weights/{body['name']}"
        return json.dumps({"path": path, "type": "save_weights"}).encode(), "json", None

    def _do_save_weights_external(self, req: SessionRequest) -> Outcome:
        body = json.loads(req.payload)
        key, size = self.state.save_adapter("external_weights", body["name"], snapshot=False)
        self.state.record_checkpoint(req, "external_weights", body["name"], key, size, body.get("ttl_seconds"))
        path = f"{TINKER_SCHEME}{self.id}/external_weights/{body['name']}"
        return json.dumps({"path": path, "size_bytes": size, "type": "save_weights_external"}).encode(), "json", None

    def _do_save_weights_for_sampler(self, req: SessionRequest) -> Outcome:
        body = json.loads(req.payload)
        key, size = self.state.save_adapter("sampler_weights", body["name"], snapshot=True)
        self.state.record_checkpoint(req, "sampler_weights", body["name"], key, size, body.get("ttl_seconds"))
        if body.get("sampler_id"):
            self._add_sampler(req, body["sampler_id"], body["name"], key)
            result = {"sampling_session_id": body["sampler_id"], "type": "save_weights_for_sampler"}
        else:
            path = f"{TINKER_SCHEME}{self.id}/sampler_weights/{body['name']}"
            result = {"path": path, "type": "save_weights_for_sampler"}
        return json.dumps(result).encode(), "json", None

    def _add_sampler(self, req: SessionRequest, sampler_id: str, name: str, key: str) -> None:
        with session_scope(self.settings.db_url) as s:
            row = s.get(TrainingSession, self.id)
            assert row is not None
            repo.add_sampler(
                s,
                Sampler(
                    id=sampler_id,
                    tenant_id=req.tenant_id,
                    client_session_id=row.client_session_id,
                    serving_id=self.id,
                    base_model=row.base_model,
                    model_path=f"{TINKER_SCHEME}{self.id}/sampler_weights/{name}",
                    weights_key=key,
                ),
            )

    def _do_load_weights(self, req: SessionRequest) -> Outcome:
        body = json.loads(req.payload)
        self.state.load_from(body["storage_key"], optimizer=body["optimizer"])
        return json.dumps({"path": body["path"], "type": "load_weights"}).encode(), "json", None

    # -- sampling --------------------------------------------------------------------------------------------------

    def _run_samples(self, first: SessionRequest) -> None:
        """``first`` and the sample requests waiting behind it (up to :data:`SAMPLE_BATCH_ROWS` completions), in
        one child call per set of weights; the child samples those whose settings agree in one generation."""
        batch = [first, *self._waiting_samples(after=first, rows=SAMPLE_BATCH_ROWS - num_samples(first))]
        by_weights: dict[str | None, list[SessionRequest]] = {}
        for req in batch:
            by_weights.setdefault(json.loads(req.payload).get("weights_key"), []).append(req)
        failure = None
        for key, reqs in by_weights.items():
            try:
                answers = self._sample(key, [r.payload for r in reqs])
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

    def _sample(self, weights_key: str | None, payloads: list[Any]) -> list[dict[str, Any]]:
        """One child call for the payloads sampled with the same weights (None: the base model's)."""
        if weights_key is None:
            answer = self.state.call("sample_many", payloads=payloads, weights="base")
        else:
            folder = self.state.scratch / "snapshots" / weights_key.replace("/", "_")
            if not folder.is_dir():
                download_folder(self.state.store, weights_key, folder)
            answer = self.state.call("sample_many", payloads=payloads, snapshot_key=weights_key, dir=str(folder))
        answers: list[dict[str, Any]] = answer["answers"]
        return answers

    def _waiting_samples(self, *, after: SessionRequest, rows: int) -> list[SessionRequest]:
        """Sample requests that arrived after ``after`` and wait, marked running, while their completions fit in
        ``rows``."""
        taken: list[SessionRequest] = []
        with session_scope(self.settings.db_url) as s:
            for req in repo.pending_samples(s, id=self.id, after_seq=after.seq, limit=SAMPLE_BATCH_ROWS):
                rows -= num_samples(req)
                if rows < 0:
                    break
                repo.start_request(s, request_id=req.id)
                s.expunge(req)
                taken.append(req)
        return taken

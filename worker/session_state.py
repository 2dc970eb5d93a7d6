"""The model state a Tinker session holds in its child process, and its saves: how many optimiser steps it has made
(and had at its last save), whether gradients wait for a step, the autosaves that let another worker continue it,
and the checkpoints its requests name."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path
from typing import Any

from api.db import session_scope
from api.orm import SessionRequest, TrainingSession
from api.repositories import tinker as repo
from api.services.tinker import storage_prefix
from api.settings import Settings
from api.storage import ArtifactStore
from worker import messages as msg
from worker.session_child import Child, download_folder, upload_folder


class SessionState:
    """Session ``session_id``'s state in its child, saved to ``store`` through the folder ``scratch``."""

    def __init__(self, settings: Settings, session_id: str, store: ArtifactStore, scratch: Path) -> None:
        self.settings, self.id, self.store, self.scratch = settings, session_id, store, scratch
        self.child: Child | None = None
        self.steps = 0  # optimiser steps of the state in memory
        self.saved_steps = 0  # ... and of the last saved state
        self.gradients = False  # gradients wait in the child for an optimiser step

    def load(self, row: TrainingSession, model_path: str) -> None:
        """Start the child with the session's model and its last saved state (if any)."""
        env = os.environ | {msg.PARENT_PID_ENV: str(os.getpid())}
        state_dir = None
        if row.saved_state_key:
            state_dir = download_folder(self.store, row.saved_state_key, self.scratch / "state")
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

    def call(self, op: str, **fields: Any) -> dict[str, Any]:
        assert self.child is not None
        return self.child.call(op, **fields)

    def child_died(self) -> bool:
        return self.child is not None and self.child.proc.poll() is not None

    def stop(self) -> None:
        if self.child is not None:
            self.child.stop()

    def unload(self) -> None:
        """Save what changed since the last save (gradients included), before the model is let go."""
        if self.steps != self.saved_steps or self.gradients:
            self.autosave(gradients=self.gradients)

    def stepped(self) -> None:
        """An optimiser step was made: the gradients are spent; autosaved every ``session_autosave_steps``."""
        self.steps, self.gradients = self.steps + 1, False
        if self.steps - self.saved_steps >= self.settings.session_autosave_steps:
            self.autosave()

    def prefix(self) -> str:
        with session_scope(self.settings.db_url) as s:
            tenant = repo.tenant_of(s, id=self.id)
        assert tenant is not None
        return storage_prefix(tenant, self.id)

    def save_state_to(self, key: str, *, gradients: bool = False) -> int:
        folder = self.scratch / "save"
        shutil.rmtree(folder, ignore_errors=True)
        self.call("save_state", dir=str(folder), gradients=gradients)
        return upload_folder(self.store, folder, key)

    def autosave(self, *, gradients: bool = False) -> None:
        key = f"{self.prefix()}/autosave/{self.steps:08d}-{int(time.time() * 1000)}"
        self.save_state_to(key, gradients=gradients)
        self.saved_as(key)

    def saved_as(self, key: str) -> None:
        """The state saved at ``key`` is the one the session continues from; the autosave it replaces is deleted."""
        with session_scope(self.settings.db_url) as s:
            previous = repo.set_saved_state(s, id=self.id, key=key, steps=self.steps)
        self.saved_steps = self.steps
        if previous and "/autosave/" in previous:
            self.store.delete_prefix(previous)

    def save_adapter(self, kind: str, name: str, *, snapshot: bool) -> tuple[str, int]:
        """The adapter alone (``kind`` external or sampler weights) stored under a new key; its key and size."""
        folder = self.scratch / "adapter"
        shutil.rmtree(folder, ignore_errors=True)
        key = f"{self.prefix()}/{kind}/{name}-{int(time.time() * 1000)}"
        self.call("save_adapter", dir=str(folder), snapshot_key=key if snapshot else None)
        return key, upload_folder(self.store, folder, key)

    def record_checkpoint(
        self, req: SessionRequest, kind: str, name: str, key: str, size: int, ttl: int | None
    ) -> None:
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

    def load_from(self, storage_key: str, *, optimizer: bool) -> None:
        """Load a stored checkpoint (its optimiser state and step count too when ``optimizer``); it becomes the
        saved state the session continues from."""
        folder = download_folder(self.store, storage_key, self.scratch / "load")
        self.call("load_state", dir=str(folder), optimizer=optimizer)
        self.gradients = False  # a load drops them
        shutil.rmtree(folder, ignore_errors=True)
        with session_scope(self.settings.db_url) as s:
            if optimizer:
                self.steps = repo.checkpoint_steps(s, storage_key=storage_key)
            repo.set_saved_state(s, id=self.id, key=storage_key, steps=self.steps, optimizer=optimizer)
        self.saved_steps = self.steps

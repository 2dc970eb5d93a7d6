"""How a run reports: the trainer calls a :class:`Callback`; the CLI writes files, the worker writes the database."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal, Protocol

Level = Literal["info", "warn", "error"]


class Callback(Protocol):
    def on_event(self, level: Level, message: str, data: dict[str, Any] | None = None) -> None: ...

    def on_metrics(self, step: int, metrics: dict[str, float]) -> None: ...

    def on_rollouts(self, step: int, rollouts: list[dict[str, Any]]) -> None: ...

    def on_checkpoint(self, step: int, path: Path, metrics: dict[str, float]) -> None: ...

    def should_stop(self) -> bool:
        """Checked between steps: True stops the run cleanly after a final checkpoint (cancel, pause)."""
        ...


class BaseCallback:
    """No-op implementation to inherit from."""

    def on_event(self, level: Level, message: str, data: dict[str, Any] | None = None) -> None:
        return None

    def on_metrics(self, step: int, metrics: dict[str, float]) -> None:
        return None

    def on_rollouts(self, step: int, rollouts: list[dict[str, Any]]) -> None:
        return None

    def on_checkpoint(self, step: int, path: Path, metrics: dict[str, float]) -> None:
        return None

    def should_stop(self) -> bool:
        return False


class Callbacks(BaseCallback):
    """Fan-out to several callbacks; stops when any asks to."""

    def __init__(self, *cbs: Callback) -> None:
        self.cbs = list(cbs)

    def on_event(self, level: Level, message: str, data: dict[str, Any] | None = None) -> None:
        for cb in self.cbs:
            cb.on_event(level, message, data)

    def on_metrics(self, step: int, metrics: dict[str, float]) -> None:
        for cb in self.cbs:
            cb.on_metrics(step, metrics)

    def on_rollouts(self, step: int, rollouts: list[dict[str, Any]]) -> None:
        for cb in self.cbs:
            cb.on_rollouts(step, rollouts)

    def on_checkpoint(self, step: int, path: Path, metrics: dict[str, float]) -> None:
        for cb in self.cbs:
            cb.on_checkpoint(step, path, metrics)

    def should_stop(self) -> bool:
        return any(cb.should_stop() for cb in self.cbs)


def _truncate_jsonl(path: Path, *, after_step: int) -> None:
    """Drop lines whose step is beyond ``after_step`` (a resumed run rewrites them)."""
    if not path.exists():
        return
    keep = [ln for ln in path.read_text().splitlines() if ln.strip() and json.loads(ln)["step"] <= after_step]
    path.write_text("".join(ln + "\n" for ln in keep))


class JsonlFiles(BaseCallback):
    """``metrics.jsonl``, ``rollouts.jsonl`` and ``events.jsonl`` in the run folder, one object per line."""

    def __init__(self, run_dir: Path, *, resume_step: int | None = None) -> None:
        run_dir.mkdir(parents=True, exist_ok=True)
        self.metrics = run_dir / "metrics.jsonl"
        self.rollouts = run_dir / "rollouts.jsonl"
        self.events = run_dir / "events.jsonl"
        if resume_step is None:
            for p in (self.metrics, self.rollouts):
                p.unlink(missing_ok=True)
        else:
            for p in (self.metrics, self.rollouts):
                _truncate_jsonl(p, after_step=resume_step)

    @staticmethod
    def _append(path: Path, obj: dict[str, Any]) -> None:
        with path.open("a", encoding="utf-8") as f:
            f.write(json.dumps(obj) + "\n")

    def on_event(self, level: Level, message: str, data: dict[str, Any] | None = None) -> None:
        self._append(self.events, {"level": level, "message": message, "data": data or {}})

    def on_metrics(self, step: int, metrics: dict[str, float]) -> None:
        self._append(self.metrics, {"step": step, **metrics})

    def on_rollouts(self, step: int, rollouts: list[dict[str, Any]]) -> None:
        for r in rollouts:
            self._append(self.rollouts, {"step": step, **r})

"""The dashboard's view of Tinker training sessions (issue 17): ``GET /v1/training_sessions`` (an extension of the
OpenAI-shaped API, with its keys and envelope; the SDK's own protocol is under ``/api/v1``)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel

from api.orm import SessionCheckpoint, SessionRequest, TrainingSession


class SavedStateObject(BaseModel):
    """A saved state, sampler weights or exported weights: its ``tinker://`` path and when it was saved."""

    path: str
    kind: Literal["weights", "sampler_weights", "external_weights"]
    name: str
    optimizer_steps: int
    size_bytes: int
    created_at: int
    expires_at: int | None

    @classmethod
    def from_row(cls, session_id: str, row: SessionCheckpoint) -> SavedStateObject:
        return cls(
            path=f"tinker://{session_id}/{row.kind}/{row.name}",
            kind=row.kind,  # type: ignore[arg-type]
            name=row.name,
            optimizer_steps=row.optimizer_steps,
            size_bytes=row.size_bytes,
            created_at=row.created_at,
            expires_at=row.expires_at,
        )


class SessionRequestObject(BaseModel):
    """One request of the session: its kind (forward_backward, optim_step, sample, ...), outcome and loss."""

    id: str
    kind: str
    status: Literal["pending", "running", "done", "failed"]
    loss: float | None
    error: str | None
    created_at: float
    finished_at: float | None

    @classmethod
    def from_row(cls, row: SessionRequest) -> SessionRequestObject:
        return cls(
            id=row.id,
            kind=row.kind,
            status=row.status,  # type: ignore[arg-type]
            loss=row.loss,
            error=(row.error or {}).get("error"),
            created_at=row.created_at,
            finished_at=row.finished_at,
        )


class TrainingSessionObject(BaseModel):
    object: Literal["training_session"] = "training_session"
    id: str
    client_session_id: str
    base_model: str
    lora_rank: int | None
    status: Literal["loaded", "unloaded", "closed"]
    worker: str | None  # the worker holding it in memory
    created_at: int
    last_request_at: int | None
    request_count: int
    optimizer_steps: int
    last_loss: float | None
    restores: int  # times it continued from its saved state after its worker was lost
    saved_steps: int  # optimiser steps in the state it would continue from
    saved_states: list[SavedStateObject]
    recent_requests: list[SessionRequestObject] | None = None

    @classmethod
    def from_row(
        cls,
        row: TrainingSession,
        checkpoints: list[SessionCheckpoint],
        requests: list[SessionRequest] | None = None,
    ) -> TrainingSessionObject:
        status: Literal["loaded", "unloaded", "closed"] = (
            "loaded" if row.loaded_on is not None else "closed" if row.closed_at is not None else "unloaded"
        )
        return cls(
            id=row.id,
            client_session_id=row.client_session_id,
            base_model=row.base_model,
            lora_rank=row.lora.get("rank"),
            status=status,
            worker=row.loaded_on,
            created_at=row.created_at,
            last_request_at=row.last_request_at,
            request_count=row.request_count,
            optimizer_steps=row.optimizer_steps,
            last_loss=row.last_loss,
            restores=row.restores,
            saved_steps=row.saved_steps,
            saved_states=[SavedStateObject.from_row(row.id, c) for c in checkpoints],
            recent_requests=None if requests is None else [SessionRequestObject.from_row(r) for r in requests],
        )

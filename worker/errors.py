"""Errors a worker records as a job's ``error``: a code a client can branch on and a message a user can act on."""

from __future__ import annotations


class JobError(Exception):
    """A failure to record as the job's ``error`` (``param``: the request field it concerns, if any)."""

    def __init__(self, code: str, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.code, self.message, self.param = code, message, param

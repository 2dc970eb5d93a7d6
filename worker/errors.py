"""Errors a worker records as a job's ``error``: a code a client can branch on and a message a user can act on.

A failure is classified by its exception's class (:func:`code_for` over a mapping from class to code), never by
its message's text.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import StrEnum


class ErrorCode(StrEnum):
    """``error.code`` of a failed job."""

    INVALID_FILE = "invalid_file"  # a dataset that does not fit the method, or is gone
    INVALID_GRADER = "invalid_grader"
    GRADER_FAILED = "grader_failed"  # the grader produced no score for most samples of consecutive steps
    ENVIRONMENT_FAILED = "environment_failed"  # an agent job's python environment did not load or reset, or no sandbox
    INVALID_HYPERPARAMETERS = "invalid_hyperparameters"
    INVALID_REWARD_MODEL = "invalid_reward_model"  # a reward_model grader's model is gone
    MODEL_NOT_AVAILABLE = "model_not_available"
    OUT_OF_MEMORY = "out_of_memory"
    STORAGE_FULL = "storage_full"  # the artifact store had no room for a checkpoint or the results
    TRAINER_ERROR = "trainer_error"  # the trainer crashed with an error it has no type for (a trainer bug)
    INTERNAL_ERROR = "internal_error"  # the worker itself failed (a service bug)


class JobError(Exception):
    """A failure to record as the job's ``error`` (``param``: the request field it concerns, if any)."""

    def __init__(self, code: ErrorCode, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.code, self.message, self.param = code, message, param


def code_for(err: BaseException, codes: Mapping[type[BaseException], ErrorCode]) -> ErrorCode | None:
    """The code of the most specific class of ``err`` (its MRO, in order) that ``codes`` names; None when none is."""
    for cls in type(err).__mro__:
        if cls in codes:
            return codes[cls]
    return None

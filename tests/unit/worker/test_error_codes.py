"""Failures are classified by their exception's class, never by their message's text."""

from __future__ import annotations

import pytest
import torch

from trainer.agents.tools import EnvironmentFailed
from trainer.generation.models import ModelError
from trainer.grading.sandbox import SandboxUnavailable
from trainer.spec.config import SpecError
from trainer.spec.data import DatasetError
from trainer.spec.graders import GraderError, GraderFailed
from worker.errors import ErrorCode, code_for
from worker.runner import error_code


class Base(Exception):
    pass


class Child(Base):
    pass


class Grandchild(Child):
    pass


def test_the_most_specific_mapped_class_gives_the_code() -> None:
    codes = {Base: ErrorCode.TRAINER_ERROR, Child: ErrorCode.INVALID_FILE}
    assert code_for(Base(), codes) == ErrorCode.TRAINER_ERROR
    assert code_for(Child(), codes) == ErrorCode.INVALID_FILE
    assert code_for(Grandchild(), codes) == ErrorCode.INVALID_FILE  # inherited from its nearest mapped class
    assert code_for(ValueError(), codes) is None


@pytest.mark.parametrize(
    ("err", "code"),
    [
        (DatasetError("no prompt", line=3, path="train.jsonl"), ErrorCode.INVALID_FILE),
        (ModelError("cannot load model 'x'"), ErrorCode.MODEL_NOT_AVAILABLE),
        (GraderError("unknown grader type"), ErrorCode.INVALID_GRADER),
        (GraderFailed("grader 'py' produced no score for most samples"), ErrorCode.GRADER_FAILED),
        (EnvironmentFailed("the environment 'env' could not reset: KeyError"), ErrorCode.ENVIRONMENT_FAILED),
        (SandboxUnavailable("bwrap is not installed"), ErrorCode.ENVIRONMENT_FAILED),
        (SpecError("must be at least 2", param="group_size"), ErrorCode.INVALID_HYPERPARAMETERS),
        (torch.OutOfMemoryError("CUDA out of memory"), ErrorCode.OUT_OF_MEMORY),
        (MemoryError(), ErrorCode.OUT_OF_MEMORY),
    ],
)
def test_each_trainer_error_class_maps_to_its_code(err: BaseException, code: ErrorCode) -> None:
    assert error_code(err) == code


def test_a_message_or_a_class_name_that_looks_like_a_known_error_is_not_classified() -> None:
    class OutOfMemoryError(RuntimeError):  # torch's name, not torch's class
        pass

    assert error_code(OutOfMemoryError("CUDA out of memory")) is None
    assert error_code(RuntimeError("CUDA out of memory")) is None
    assert error_code(ValueError("line 3: not valid JSON")) is None


def test_a_dataset_error_carries_its_file_line_and_problem_apart() -> None:
    err = DatasetError("no prompt", line=3, path="/runs/j/data/train.jsonl")
    assert (err.path, err.line, err.detail) == ("/runs/j/data/train.jsonl", 3, "no prompt")
    assert str(err) == "/runs/j/data/train.jsonl:3: no prompt"

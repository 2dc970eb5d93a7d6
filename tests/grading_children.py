"""Grading processes that misbehave on purpose, for the tests of trainer.grading.pool and the API's dry-runs: the real
protocol (`trainer.grading.pool.serve`) with a `graders.grade` that, for some outputs, hangs in a C call holding the
GIL or kills its own process."""

from __future__ import annotations

import sys

_MISBEHAVING = """
import os, re
from trainer.grading import graders
from trainer.grading import pool as grading_pool

_grade = graders.grade


def grade(grader, *, output_text, item, model_scores=None, output_tools=()):
    if output_text.startswith("hang"):
        re.match(r"(a+)+$", "a" * 64 + "b")  # exponential backtracking inside one C call that holds the GIL
    if output_text.startswith("crash"):
        os._exit(3)
    return _grade(grader, output_text=output_text, item=item, model_scores=model_scores, output_tools=output_tools)


graders.grade = grade
grading_pool.serve()
"""


def misbehaving_command() -> list[str]:
    """A grading process that hangs on an output starting with "hang" and exits on one starting with "crash"."""
    return [sys.executable, "-c", _MISBEHAVING]

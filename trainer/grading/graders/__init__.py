"""Scoring graders: `grade` scores one sample with a grader of the contract (`trainer.spec.graders`, which says what
each type computes); the python leaves of a batch are graded in a sandbox (`grade_python_leaves`) and the remote ones
by `trainer.grading.remote_graders`, both with the helpers here (`render`, `sample_object`).

The submodules hold the scoring by kind: render (templates), text (string_check, text_similarity, regex,
length_penalty), numeric (numeric_match), batched (reward_model, python and remote leaves inside `grade`), python (the
sandbox's batches), score (one leaf by its type) and multi (`grade`, and multi graders' formulas).
"""

from trainer.grading.graders.batched import reward_model_prompt
from trainer.grading.graders.multi import grade
from trainer.grading.graders.numeric import numbers_match, parse_last_number
from trainer.grading.graders.python import PythonScores, grade_python_leaves, python_grade_error, sample_object
from trainer.grading.graders.render import render
from trainer.grading.graders.text import fuzzy_match, length_penalty

__all__ = [
    "PythonScores",
    "fuzzy_match",
    "grade",
    "grade_python_leaves",
    "length_penalty",
    "numbers_match",
    "parse_last_number",
    "python_grade_error",
    "render",
    "reward_model_prompt",
    "sample_object",
]

"""The grader union (`Grader`), multi graders, and `parse_grader`: a grader object's JSON checked for its size, then
validated, with every problem named by its field's path."""

import keyword
from typing import Annotated, Any, Literal

from pydantic import Field, TypeAdapter, ValidationError, ValidationInfo, field_validator
from pydantic_core import ErrorDetails

from trainer.spec.graders.errors import GraderError
from trainer.spec.graders.formulas import FORMULA_FUNCTIONS, compile_formula, formula_names
from trainer.spec.graders.judges import EndpointGrader, LabelModelGrader, ScoreModelGrader
from trainer.spec.graders.leaves import (
    GraderBase,
    LengthPenaltyGrader,
    NumericMatchGrader,
    PythonGrader,
    RegexGrader,
    RewardModelGrader,
    StringCheckGrader,
    TextSimilarityGrader,
)
from trainer.spec.graders.limits import MAX_GRADER_DEPTH, MAX_GRADERS, MAX_NAME_CHARS

GRADER_TYPES: tuple[str, ...] = (
    "string_check",
    "text_similarity",
    "multi",
    "numeric_match",
    "regex",
    "length_penalty",
    "reward_model",
    "python",
    "score_model",
    "label_model",
    "endpoint",
)


class MultiGrader(GraderBase):
    """`calculate_output` evaluated over the scores of `graders`, each bound to its key.

    The formula may use + - * / ** (or ^), unary ±, parentheses, numbers, abs ceil exp floor log max min sqrt.
    A division by zero or another undefined/non-finite result scores 0.0 with an error flag.
    """

    type: Literal["multi"]
    graders: dict[str, "Grader"]
    calculate_output: str

    @field_validator("graders")
    @classmethod
    def _valid_keys(cls, value: dict[str, "Grader"]) -> dict[str, "Grader"]:
        if not value:
            raise ValueError("at least one sub-grader is required")
        for key in value:
            if len(key) > MAX_NAME_CHARS:
                raise ValueError(f"key {key[:20]!r}… is longer than {MAX_NAME_CHARS} characters")
            if not key.isidentifier() or not key.isascii() or keyword.iskeyword(key):
                raise ValueError(f"key {key!r} is not a valid formula variable (letters, digits, _; not a digit first)")
            if key in FORMULA_FUNCTIONS:
                raise ValueError(f"key {key!r} is the name of a formula function")
        return value

    @field_validator("calculate_output")
    @classmethod
    def _valid_formula(cls, value: str, info: ValidationInfo) -> str:
        tree = compile_formula(value)
        graders = info.data.get("graders")
        if graders is not None:  # else the graders failed validation and are reported on their own
            for name in formula_names(tree):
                if name not in graders:
                    raise ValueError(f"unknown name {name!r}; sub-grader keys: {', '.join(graders)}")
        return value


Grader = Annotated[
    StringCheckGrader
    | TextSimilarityGrader
    | MultiGrader
    | NumericMatchGrader
    | RegexGrader
    | LengthPenaltyGrader
    | RewardModelGrader
    | PythonGrader
    | ScoreModelGrader
    | LabelModelGrader
    | EndpointGrader,
    Field(discriminator="type"),
]
LeafGrader = (
    StringCheckGrader
    | TextSimilarityGrader
    | NumericMatchGrader
    | RegexGrader
    | LengthPenaltyGrader
    | RewardModelGrader
    | PythonGrader
    | ScoreModelGrader
    | LabelModelGrader
    | EndpointGrader
)
RemoteGrader = ScoreModelGrader | LabelModelGrader | EndpointGrader | TextSimilarityGrader
"""The leaves `remote_graders` scores (a text_similarity only with a metric of REMOTE_SIMILARITY_METRICS)."""

MultiGrader.model_rebuild()
_GRADER_ADAPTER: TypeAdapter[Grader] = TypeAdapter(Grader)


def parse_grader(obj: dict[str, Any]) -> Grader:
    """Validate a grader object (parsed JSON); GraderError names every offending field, `;`-separated."""
    if not isinstance(obj, dict):
        raise GraderError(f"grader: expected an object, got {type(obj).__name__}")
    _check_tree(obj)
    try:
        return _GRADER_ADAPTER.validate_python(obj)
    except ValidationError as exc:
        problems = [_format_error(error) for error in exc.errors()]
        raise GraderError(
            "; ".join(f"{field}: {problem}" for field, problem in problems), param=problems[0][0]
        ) from exc


def _check_tree(obj: dict[str, Any]) -> None:
    """GraderError naming the first grader, in depth-first order, that nests multi graders deeper than
    MAX_GRADER_DEPTH or goes beyond MAX_GRADERS in all; checked on the JSON before any validation, so a deep or wide
    object costs no more than its first MAX_GRADERS graders."""
    todo: list[tuple[str, Any, int]] = [("grader", obj, 0)]  # (path, object, multi graders above it)
    seen = 0
    while todo:
        path, node, above = todo.pop()
        seen += 1
        if seen > MAX_GRADERS:
            raise GraderError(f"{path}: a grader holds at most {MAX_GRADERS} graders in all", param=path)
        if not isinstance(node, dict) or node.get("type") != "multi":
            continue
        if above + 1 > MAX_GRADER_DEPTH:
            raise GraderError(f"{path}: multi graders nest at most {MAX_GRADER_DEPTH} levels deep", param=path)
        children = node.get("graders")
        if isinstance(children, dict):  # else validation names the field
            todo.extend((f"{path}.graders.{key}", child, above + 1) for key, child in reversed(children.items()))


def _error_path(loc: tuple[int | str, ...]) -> str:
    """`grader.graders.acc.operation` from pydantic's loc, which interleaves union tags: (multi, graders,
    acc, string_check, operation). A tag follows the root and each key of a multi's `graders` the loc enters.
    """
    parts = ["grader"]
    tag: int | str | None = None
    expect_tag = True
    i = 0
    while i < len(loc):
        if expect_tag:
            tag, expect_tag = loc[i], False
            i += 1
            continue
        parts.append(str(loc[i]))
        if tag == "multi" and loc[i] == "graders" and i + 1 < len(loc):
            parts.append(str(loc[i + 1]))
            expect_tag = True
            i += 1
        i += 1
    return ".".join(parts)


def _format_error(error: ErrorDetails) -> tuple[str, str]:
    """(the offending field's path, the problem) of one of pydantic's errors."""
    path = _error_path(error["loc"])
    ctx = error.get("ctx", {})
    valid = ", ".join(GRADER_TYPES)
    match error["type"]:
        case "union_tag_invalid":
            return f"{path}.type", f"unknown grader type {ctx.get('tag')!r}; valid types: {valid}"
        case "union_tag_not_found":
            return f"{path}.type", f"field required; valid types: {valid}"
        case "extra_forbidden":
            return path, f"unknown field {path.rsplit('.', 1)[-1]!r} is not permitted"
        case "missing":
            return path, "field required"
        case "value_error":
            return path, str(ctx.get("error", error["msg"]))
        case _:
            return path, error["msg"]

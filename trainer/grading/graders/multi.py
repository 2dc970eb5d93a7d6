"""`grade`: one sample scored by a grader, a multi grader combining its sub-graders' scores by its formula."""

import ast
import math
from collections.abc import Mapping, Sequence
from typing import Any

from trainer.grading.graders.render import Context
from trainer.grading.graders.score import score_leaf
from trainer.spec.graders import GradeError, Grader, GradeResult, MultiGrader
from trainer.spec.graders.formulas import BINARY_OPERATORS, UNARY_FUNCTIONS, VARIADIC_FUNCTIONS, compile_formula


def _evaluate(node: ast.expr, values: Mapping[str, float]) -> float:
    """Evaluate a checked formula; raises ArithmeticError/ValueError on a non-finite or undefined result."""
    if isinstance(node, ast.Constant) and isinstance(node.value, int | float):
        return float(node.value)
    if isinstance(node, ast.Name):
        return values[node.id]
    if isinstance(node, ast.UnaryOp):
        operand = _evaluate(node.operand, values)
        return -operand if isinstance(node.op, ast.USub) else operand
    if isinstance(node, ast.BinOp):
        left, right = _evaluate(node.left, values), _evaluate(node.right, values)
        result = BINARY_OPERATORS[type(node.op)](left, right)
    elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
        args = [_evaluate(arg, values) for arg in node.args]
        name = node.func.id
        result = float(UNARY_FUNCTIONS[name](args[0]) if name in UNARY_FUNCTIONS else VARIADIC_FUNCTIONS[name](args))
    else:  # unreachable for a formula that passed _check_formula_node
        raise ValueError(f"unexpected {type(node).__name__}")
    if not math.isfinite(result):
        raise OverflowError(f"{ast.unparse(node)} is not finite")
    return result


def grade(
    grader: Grader,
    *,
    output_text: str,
    item: Mapping[str, Any],
    model_scores: Mapping[str, float] | None = None,
    output_tools: Sequence[Mapping[str, Any]] = (),
) -> GradeResult:
    """Score one sample. sub_scores: {grader.name: score} for a single grader; for a multi, {key: score} of
    each sub-grader, a nested multi adding its own key and its children as `key.child`.

    `model_scores`: the scores of the grader's reward_model leaves, keyed as `model_graders` names them (computed
    in batches by `trainer.loops.evaluate.grade_batch`); a reward_model leaf without one raises `GraderError`.
    `output_tools`: an agent episode's tool calls (OpenAI's `sample.output_tools`), empty for a single reply."""
    ctx = Context(
        output_text=output_text, item=item, errors=[], model_scores=model_scores or {}, output_tools=output_tools
    )
    if isinstance(grader, MultiGrader):
        score, sub_scores = _grade_multi(grader, ctx)
    else:
        score = score_leaf(grader, ctx, grader.name)
        sub_scores = {grader.name: score}
    return GradeResult(score=score, sub_scores=sub_scores, errors=tuple(dict.fromkeys(ctx.errors)))


def _grade_multi(grader: MultiGrader, ctx: Context, prefix: str = "") -> tuple[float, dict[str, float]]:
    sub_scores: dict[str, float] = {}
    values: dict[str, float] = {}
    for key, child in grader.graders.items():
        if isinstance(child, MultiGrader):
            values[key], nested = _grade_multi(child, ctx, f"{prefix}{key}.")
            sub_scores[key] = values[key]
            sub_scores.update({f"{key}.{name}": score for name, score in nested.items()})
        else:
            values[key] = sub_scores[key] = score_leaf(child, ctx, prefix + key)
    try:
        score = _evaluate(compile_formula(grader.calculate_output), values)
    except (ArithmeticError, ValueError) as exc:
        ctx.errors.append(
            GradeError(
                f"grader {grader.name!r}: calculate_output {grader.calculate_output!r} failed ({exc}); scored 0.0",
                "formula",
            )
        )
        score = 0.0
    return score, sub_scores

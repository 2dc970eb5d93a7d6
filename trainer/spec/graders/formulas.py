"""Formulas of multi graders (`calculate_output`): parsed with `ast` and checked against a whitelist here; evaluated by
a small interpreter over the same whitelist (trainer.grading.graders.multi)."""

import ast
import functools
import math
import operator
from collections.abc import Callable

from trainer.spec.graders.limits import MAX_FORMULA_CHARS, MAX_FORMULA_DEPTH

BINARY_OPERATORS: dict[type[ast.operator], Callable[[float, float], float]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.Pow: math.pow,  # math.pow raises on a complex result or overflow, where float ** float would not
}
UNARY_FUNCTIONS: dict[str, Callable[[float], float]] = {
    "abs": abs,
    "ceil": math.ceil,
    "exp": math.exp,
    "floor": math.floor,
    "log": math.log,  # natural logarithm
    "sqrt": math.sqrt,
}
VARIADIC_FUNCTIONS: dict[str, Callable[[list[float]], float]] = {"max": max, "min": min}
FORMULA_FUNCTIONS: tuple[str, ...] = tuple(sorted([*UNARY_FUNCTIONS, *VARIADIC_FUNCTIONS]))


@functools.lru_cache(maxsize=256)
def compile_formula(formula: str) -> ast.expr:
    """Parse `calculate_output`; ValueError names the first construct outside the whitelist.

    Grammar: numbers, sub-grader keys, + - * / ** (OpenAI's `^` is read as `**`), unary ±, parentheses and the
    calls in FORMULA_FUNCTIONS.
    """
    if len(formula) > MAX_FORMULA_CHARS:
        raise ValueError(f"longer than {MAX_FORMULA_CHARS} characters")
    try:
        tree = ast.parse(formula.replace("^", "**").strip(), mode="eval")
    except SyntaxError as exc:
        raise ValueError(f"not a valid arithmetic expression ({exc.msg})") from exc
    except (ValueError, RecursionError, MemoryError) as exc:
        raise ValueError("not a valid arithmetic expression") from exc
    _check_formula_node(tree.body, depth=0)
    return tree.body


def _check_formula_node(node: ast.expr, *, depth: int) -> None:
    if depth > MAX_FORMULA_DEPTH:
        raise ValueError(f"nested deeper than {MAX_FORMULA_DEPTH} levels")
    if isinstance(node, ast.Constant):
        if isinstance(node.value, bool) or not isinstance(node.value, int | float):
            raise ValueError(f"only numeric constants are allowed, not {node.value!r}")
        try:
            finite = math.isfinite(float(node.value))
        except OverflowError:
            finite = False
        if not finite:
            raise ValueError(f"constant {ast.unparse(node)} is not a finite number")
    elif isinstance(node, ast.Name):
        pass  # checked against the sub-grader keys by MultiGrader
    elif isinstance(node, ast.UnaryOp):
        if not isinstance(node.op, ast.UAdd | ast.USub):
            raise ValueError(f"operator {ast.unparse(node)!r} is not allowed; use + - * / ** only")
        _check_formula_node(node.operand, depth=depth + 1)
    elif isinstance(node, ast.BinOp):
        if type(node.op) not in BINARY_OPERATORS:
            raise ValueError(f"operator in {ast.unparse(node)!r} is not allowed; use + - * / ** only")
        _check_formula_node(node.left, depth=depth + 1)
        _check_formula_node(node.right, depth=depth + 1)
    elif isinstance(node, ast.Call):
        allowed = ", ".join(FORMULA_FUNCTIONS)
        if not isinstance(node.func, ast.Name):
            raise ValueError(f"call of {ast.unparse(node.func)!r} is not allowed; allowed functions: {allowed}")
        name = node.func.id
        if name not in UNARY_FUNCTIONS and name not in VARIADIC_FUNCTIONS:
            raise ValueError(f"function {name!r} is not allowed; allowed functions: {allowed}")
        if node.keywords or any(isinstance(arg, ast.Starred) for arg in node.args):
            raise ValueError(f"{name}() takes positional arguments only")
        if name in UNARY_FUNCTIONS and len(node.args) != 1:
            raise ValueError(f"{name}() takes exactly one argument")
        if not node.args:
            raise ValueError(f"{name}() takes at least one argument")
        for arg in node.args:
            _check_formula_node(arg, depth=depth + 1)
    elif isinstance(node, ast.Attribute):
        raise ValueError(f"attribute access {ast.unparse(node)!r} is not allowed")
    else:
        raise ValueError(f"{ast.unparse(node)!r} ({type(node).__name__}) is not allowed")


def formula_names(node: ast.expr) -> list[str]:
    """Variable names of a checked formula, in order of appearance (function names excluded)."""
    if isinstance(node, ast.Name):
        return [node.id]
    if isinstance(node, ast.UnaryOp):
        return formula_names(node.operand)
    if isinstance(node, ast.BinOp):
        return formula_names(node.left) + formula_names(node.right)
    if isinstance(node, ast.Call):
        return [name for arg in node.args for name in formula_names(arg)]
    return []

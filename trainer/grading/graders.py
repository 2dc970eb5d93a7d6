"""Graders: the rewards of RL fine-tuning, shaped like OpenAI's grader objects (design §5).

A grader is a pydantic model parsed from JSON (`parse_grader`) and scored by a pure function of one sample
and its dataset row (`grade`). Strings may hold templates: `{{sample.output_text}}` is the model's completion,
`{{item.<path>}}` a field of the row (dotted path for nesting; a digit indexes a list: `{{item.a.0}}`).
Strings render verbatim; any other value renders as compact JSON (`3`, `true`, `null`, `{"a": 1}`).

OpenAI's types: `string_check`, `text_similarity`, `multi`, `python`, `score_model`, `label_model` and `endpoint`.
Ours: `numeric_match`, `regex`, `length_penalty`, and `reward_model` (the score of a reward model trained by a
`reward_model` job). Every score is a float. Problems found at grading time (a missing item field, a division by zero
in a formula) never raise: they are listed in `GradeResult.errors`, each a `GradeError` that says its kind.

A `reward_model` grader needs a model, a `python` grader a sandbox, and the remote graders (`score_model` and
`label_model`: a judge model behind an HTTP endpoint; `endpoint`: the tenant's own grading service; `text_similarity`
with the `cosine` metric: an embeddings endpoint) the network, so this module scores none of them:
`trainer.loops.evaluate.grade_batch` scores every reward-model leaf of a batch in batched forward passes
(`trainer.loops.reward_model`), every python leaf in one sandbox per batch (`trainer.grading.sandbox`, with the `sample`
object of `sample_object`) and every remote leaf over the whole batch, concurrently (`trainer.grading.remote_graders`),
and hands the scores to `grade` as `model_scores`; `grade` without them raises `GraderError`.

Graders are user input, parsed on the API's request threads: parsing is linear in the grader's size and the size is
capped (the MAX_* bounds below, each a `GraderError` naming the field), regular expressions run on RE2 (linear-time
matching), and `grade` itself runs in a grading process with a hard time limit per sample (`trainer.grading.pool`).
"""

import ast
import functools
import json
import keyword
import math
import operator
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any, Literal, Self, assert_never, get_args

import re2
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    PlainSerializer,
    PlainValidator,
    StringConstraints,
    TypeAdapter,
    ValidationError,
    ValidationInfo,
    field_validator,
)
from pydantic_core import ErrorDetails
from rapidfuzz.distance import Indel

from trainer.grading import similarity, url_policy

if TYPE_CHECKING:
    from trainer.grading.sandbox import PythonSandbox, Result

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

# Bounds on user input. A grader is parsed where it arrives (the API's request threads, the trainer's config) and
# graded in a process of its own (trainer.grading.pool), so both its size and the cost of grading one sample are
# bounded: every check below is linear in its input, and the caps keep that input small.
MAX_GRADER_DEPTH = 8  # multi graders nested in one another: a multi is depth 1, a multi inside it depth 2, ...
MAX_GRADERS = 32  # graders in one grader object, multi graders and their leaves counted alike
MAX_NAME_CHARS = 128  # a grader's `name` and a multi's keys (they name metrics: `reward/<key>/mean`)
MAX_TEMPLATE_CHARS = 10_000  # each string field that may hold `{{...}}` references
MAX_FORMULA_CHARS = 1_000
MAX_FORMULA_DEPTH = 32
MAX_PATTERN_CHARS = 1_000  # a regex grader's pattern
# Regular expressions run on RE2 (linear time in the text; no backreferences or lookarounds). RE2 refuses a pattern
# whose compiled program is larger than about 2/3 of this memory budget ("pattern too large"), which also bounds the
# time to compile one (a few tens of milliseconds at most, with the GIL released).
RE2_MAX_MEM = 1 << 20
MAX_REGEX_INPUT_CHARS = 10_000  # a regex grader searches the first this many characters of its rendered input
# text_similarity compares texts of at most this many characters each (a C implementation, O(n·m/64) word operations:
# about 15 ms at the cap); a longer rendered input or reference scores 0.0 with an error flag.
MAX_SIMILARITY_CHARS = 20_000


class GraderError(ValueError):
    """An invalid grader object; the message names the offending field: `grader.graders.acc.operation: …`, and
    `param` is that field's path (the first one's, when there are several; `grader` when no field is to blame)."""

    def __init__(self, message: str, *, param: str = "grader") -> None:
        super().__init__(message)
        self.param = param


GradeErrorKind = Literal[
    "invalid_variable",
    "formula",
    "timeout",
    "other",
    "python_runtime",
    "python_server",
    "model_grader_parse",
    "model_grader_refusal",
    "model_grader_server",
    "endpoint_parse",
    "endpoint_server",
    "embeddings",
]
"""What went wrong while grading (OpenAI's grader-run error flags): a template named an item field the row lacks, a
multi grader's `calculate_output` failed, grading one sample took longer than its time limit (trainer.grading.pool),
anything else; a python grader's code failed (`python_runtime`: it raised, returned something that is not a finite
number, or its source defines no usable `grade`) or its sandbox stopped it (`python_server`: timeout, CPU limit,
output limit, crash; the sandbox's kind is the error's `cause`); a score_model or label_model grader's judge answered
something that does not parse as its result (`model_grader_parse`: not the JSON asked for, a score outside `range`, a
label not in `labels`), refused (`model_grader_refusal`) or did not answer (`model_grader_server`: a timeout, a
connection error or an HTTP error after the retries); an endpoint grader's service answered no `{"score": number}`
(`endpoint_parse`) or did not answer (`endpoint_server`, or its URL is not allowed); the embeddings of a `cosine`
text_similarity could not be had (`embeddings`). The remote kinds' `cause` says more (`timeout`, `http_503`, ...)."""

FAILURE_KINDS: frozenset[str] = frozenset(get_args(GradeErrorKind)) - {"invalid_variable", "formula", "other"}
"""The kinds of error that mean the grader produced no score for the sample (scored 0.0): what a job counts as the
grader failing (`grader/error_rate`, and the job fails when most samples of consecutive steps fail)."""


class GradeError(str):
    """A problem met while grading one sample: its message (it is a `str`, so it reads and compares as one), its
    `kind`, so that callers tell problems apart by what they are, not by their wording, and for a python grader the
    sandbox's result kind as `cause` (`exception`, `timeout`, ...: `trainer.grading.sandbox.ResultKind`)."""

    kind: GradeErrorKind
    cause: str | None

    def __new__(cls, message: str, kind: GradeErrorKind, cause: str | None = None) -> Self:
        error = super().__new__(cls, message)
        error.kind = kind
        error.cause = cause
        return error

    def __getnewargs__(self) -> tuple[str, GradeErrorKind, str | None]:  # type: ignore[override]
        return str(self), self.kind, self.cause  # pickling (a result sent to another process) keeps the kind


class GraderFailed(GraderError):
    """The grader failed on most samples of a run (trainer.loops.evaluate.GraderMonitor): the job fails with it."""


@dataclass(frozen=True)
class GradeResult:
    """The reward of one sample: `score`, per-grader `sub_scores` and the problems met while grading."""

    score: float
    sub_scores: dict[str, float]
    errors: tuple[GradeError, ...]


# ----------------------------------------------------------------------------------------------------
# Templates


@dataclass(frozen=True)
class _Ref:
    """One `{{namespace.path}}` reference inside a template."""

    namespace: Literal["sample", "item"]
    path: tuple[str, ...]

    @property
    def dotted(self) -> str:
        return ".".join(self.path)

    @property
    def text(self) -> str:
        return "{{" + self.namespace + "." + self.dotted + "}}"


_PATH_SEGMENT_RE = re.compile(r"[^\s.{}]+")
_SAMPLE_FIELDS = ("output_text", "output_tools")


@functools.lru_cache(maxsize=256)  # keys are at most MAX_TEMPLATE_CHARS long: the cache holds a few MB at most
def _parse_template(template: str) -> tuple[str | _Ref, ...]:
    r"""Split a template into literal text and references; ValueError names a bad reference.

    A reference runs from a `{{` to the first `}}` after it, and the next one starts after that `}}` (what the
    regular expression `\{\{(.*?)\}\}` finds), found with two `str.find` scans that never go back: linear time.
    With no `}}` after a `{{`, the rest of the template is literal text."""
    if len(template) > MAX_TEMPLATE_CHARS:
        raise ValueError(f"longer than {MAX_TEMPLATE_CHARS} characters")
    parts: list[str | _Ref] = []
    end = 0
    while (start := template.find("{{", end)) != -1 and (close := template.find("}}", start + 2)) != -1:
        if start > end:
            parts.append(template[end:start])
        parts.append(_parse_ref(template[start + 2 : close].strip(), template[start : close + 2]))
        end = close + 2
    if end < len(template):
        parts.append(template[end:])
    return tuple(parts)


def _parse_ref(inner: str, raw: str) -> _Ref:
    namespace, _, rest = inner.partition(".")
    path = tuple(rest.split(".")) if rest else ()
    if namespace not in ("sample", "item"):
        raise ValueError(f"unknown namespace {namespace!r} in {raw}; only 'sample' and 'item' exist")
    if not path or not all(_PATH_SEGMENT_RE.fullmatch(segment) for segment in path):
        raise ValueError(f"invalid reference {raw}; expected {{{{{namespace}.<field>}}}}")
    if namespace == "sample":
        if len(path) != 1 or path[0] not in _SAMPLE_FIELDS:
            valid = ", ".join("{{sample." + f + "}}" for f in _SAMPLE_FIELDS)
            raise ValueError(f"unsupported sample field in {raw}; supported: {valid}")
        return _Ref("sample", path)
    return _Ref("item", path)


def _validate_template(value: str) -> str:
    _parse_template(value)
    return value


Template = Annotated[str, StringConstraints(max_length=MAX_TEMPLATE_CHARS), AfterValidator(_validate_template)]
"""A string that may contain `{{sample.output_text}}`, `{{sample.output_tools}}` (an agent episode's tool calls as
JSON) and `{{item.<path>}}`; at most MAX_TEMPLATE_CHARS long."""


def _lookup(item: Mapping[str, Any], path: tuple[str, ...]) -> tuple[bool, Any]:
    """(found, value) of a dotted path: mapping keys, or list indices for all-digit segments."""
    current: Any = item
    for segment in path:
        if isinstance(current, Mapping) and segment in current:
            current = current[segment]
        elif isinstance(current, list) and segment.isascii() and segment.isdigit() and int(segment) < len(current):
            current = current[int(segment)]
        else:
            return False, None
    return True, current


def _missing_field_message(grader_name: str, ref: _Ref) -> str:
    return f"grader {grader_name!r} references {ref.text} but the item has no field {ref.dotted!r}"


@dataclass
class _Context:
    output_text: str
    item: Mapping[str, Any]
    errors: list[GradeError]
    model_scores: Mapping[str, float]
    output_tools: Sequence[Mapping[str, Any]] = ()


def _render(template: str, grader_name: str, ctx: _Context) -> str:
    """Fill a template; a missing item field renders as '' and adds an error flag."""
    out: list[str] = []
    for part in _parse_template(template):
        if isinstance(part, str):
            out.append(part)
        elif part.namespace == "sample":
            if part.path == ("output_tools",):
                out.append(json.dumps(list(ctx.output_tools), ensure_ascii=False))
            else:
                out.append(ctx.output_text)
        else:
            found, value = _lookup(ctx.item, part.path)
            if not found:
                ctx.errors.append(
                    GradeError(_missing_field_message(grader_name, part) + "; rendered as ''", "invalid_variable")
                )
                out.append("")
            elif isinstance(value, str):
                out.append(value)
            else:
                out.append(json.dumps(value, ensure_ascii=False, default=str))
    return "".join(out)


# ----------------------------------------------------------------------------------------------------
# Scoring functions (pure)


def _contains_ci(text: str, reference: str) -> bool:
    return reference.lower() in text.lower()


# OpenAI's string_check: eq/ne compare exactly (nothing stripped); like/ilike: input contains reference.
_STRING_OPERATIONS: dict[str, Callable[[str, str], bool]] = {
    "eq": operator.eq,
    "ne": operator.ne,
    "like": lambda text, reference: reference in text,
    "ilike": _contains_ci,
}


def fuzzy_match(a: str, b: str) -> float:
    """Similarity ratio in [0, 1]: 2·LCS(a, b) / (len(a) + len(b)), LCS the length of a longest common
    subsequence of characters; two empty strings score 1.0.

    This is RapidFuzz's normalised InDel similarity (`fuzz.ratio` / 100), which OpenAI cites for `fuzzy_match`,
    computed by RapidFuzz in C (bit-parallel, O(len(a)·len(b)/64)). It equals `difflib.SequenceMatcher`'s `ratio()`,
    which this function computed before, whenever difflib's greedy matching blocks form a longest common subsequence
    (they do on ordinary text); where they do not, difflib scored lower ('bbabaa' and 'aaaabbba': 3/7 by difflib's
    blocks, 4/7 by the LCS 'bbba').
    """
    total = len(a) + len(b)
    # Indel.similarity is len(a) + len(b) − distance = 2·LCS, an integer: the ratio is rounded once, as difflib's
    # 2.0 * matches / total is, so ordinary inputs score bit for bit what they scored with difflib.
    return Indel.similarity(a, b) / total if total else 1.0


_SIMILARITY_METRICS: dict[str, Callable[[str, str], float]] = {"fuzzy_match": fuzzy_match, **similarity.METRICS}
REMOTE_SIMILARITY_METRICS: tuple[str, ...] = ("cosine",)
"""text_similarity metrics that need the network (an embeddings endpoint): scored by `remote_graders`."""

# The last number of a text: optional sign (not when it is a binary minus as in "10-12"), digits with optional
# thousands separators ("1,234"), optional decimals and exponent. U+2212 (−) counts as a minus sign.
_NUMBER_RE = re.compile(
    r"(?:(?<![\w)])[-+\u2212])?"
    r"(?:(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?|\.\d+)"
    r"(?:[eE][-+]?\d+)?"
)


def parse_last_number(text: str) -> float | None:
    """The last number written in `text` ("-1,234.5", "0.25", "3e-2"), or None when there is none."""
    last = None
    for last in _NUMBER_RE.finditer(text):  # noqa: B007 — only the final match is wanted
        pass
    if last is None:
        return None
    return float(last.group(0).replace(",", "").replace("\u2212", "-"))


def numbers_match(value: float, reference: float, *, tolerance: float, relative_tolerance: float) -> bool:
    """|value − reference| ≤ max(tolerance, relative_tolerance · |reference|)."""
    return abs(value - reference) <= max(tolerance, relative_tolerance * abs(reference))


def length_penalty(n_chars: int, *, max_chars: int, penalty_per_char: float, min_score: float | None) -> float:
    """−max(0, n_chars − max_chars) · penalty_per_char, clipped below at min_score (None: unclipped)."""
    excess = n_chars - max_chars
    if excess <= 0:
        return 0.0
    score = -excess * penalty_per_char
    return score if min_score is None else max(score, min_score)


# ----------------------------------------------------------------------------------------------------
# Formulas of multi graders: parsed with `ast`, checked against a whitelist, evaluated by a small interpreter.

_BINARY_OPERATORS: dict[type[ast.operator], Callable[[float, float], float]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.Pow: math.pow,  # math.pow raises on a complex result or overflow, where float ** float would not
}
_UNARY_FUNCTIONS: dict[str, Callable[[float], float]] = {
    "abs": abs,
    "ceil": math.ceil,
    "exp": math.exp,
    "floor": math.floor,
    "log": math.log,  # natural logarithm
    "sqrt": math.sqrt,
}
_VARIADIC_FUNCTIONS: dict[str, Callable[[list[float]], float]] = {"max": max, "min": min}
FORMULA_FUNCTIONS: tuple[str, ...] = tuple(sorted([*_UNARY_FUNCTIONS, *_VARIADIC_FUNCTIONS]))


@functools.lru_cache(maxsize=256)
def _compile_formula(formula: str) -> ast.expr:
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
        if type(node.op) not in _BINARY_OPERATORS:
            raise ValueError(f"operator in {ast.unparse(node)!r} is not allowed; use + - * / ** only")
        _check_formula_node(node.left, depth=depth + 1)
        _check_formula_node(node.right, depth=depth + 1)
    elif isinstance(node, ast.Call):
        allowed = ", ".join(FORMULA_FUNCTIONS)
        if not isinstance(node.func, ast.Name):
            raise ValueError(f"call of {ast.unparse(node.func)!r} is not allowed; allowed functions: {allowed}")
        name = node.func.id
        if name not in _UNARY_FUNCTIONS and name not in _VARIADIC_FUNCTIONS:
            raise ValueError(f"function {name!r} is not allowed; allowed functions: {allowed}")
        if node.keywords or any(isinstance(arg, ast.Starred) for arg in node.args):
            raise ValueError(f"{name}() takes positional arguments only")
        if name in _UNARY_FUNCTIONS and len(node.args) != 1:
            raise ValueError(f"{name}() takes exactly one argument")
        if not node.args:
            raise ValueError(f"{name}() takes at least one argument")
        for arg in node.args:
            _check_formula_node(arg, depth=depth + 1)
    elif isinstance(node, ast.Attribute):
        raise ValueError(f"attribute access {ast.unparse(node)!r} is not allowed")
    else:
        raise ValueError(f"{ast.unparse(node)!r} ({type(node).__name__}) is not allowed")


def _formula_names(node: ast.expr) -> list[str]:
    """Variable names of a checked formula, in order of appearance (function names excluded)."""
    if isinstance(node, ast.Name):
        return [node.id]
    if isinstance(node, ast.UnaryOp):
        return _formula_names(node.operand)
    if isinstance(node, ast.BinOp):
        return _formula_names(node.left) + _formula_names(node.right)
    if isinstance(node, ast.Call):
        return [name for arg in node.args for name in _formula_names(arg)]
    return []


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
        result = _BINARY_OPERATORS[type(node.op)](left, right)
    elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
        args = [_evaluate(arg, values) for arg in node.args]
        name = node.func.id
        result = float(_UNARY_FUNCTIONS[name](args[0]) if name in _UNARY_FUNCTIONS else _VARIADIC_FUNCTIONS[name](args))
    else:  # unreachable for a formula that passed _check_formula_node
        raise ValueError(f"unexpected {type(node).__name__}")
    if not math.isfinite(result):
        raise OverflowError(f"{ast.unparse(node)} is not finite")
    return result


# ----------------------------------------------------------------------------------------------------
# Regular expressions: RE2, whose matching time is linear in the text whatever the pattern (no backtracking).


def _re2_options() -> re2.Options:
    options = re2.Options()
    options.max_mem = RE2_MAX_MEM
    options.log_errors = False  # a refused pattern is the user's error, reported to them, not logged by RE2
    return options


_RE2_OPTIONS = _re2_options()


def _check_pattern(pattern: str) -> None:
    """ValueError saying why RE2 refuses `pattern` (RE2 syntax: no backreferences, no lookarounds)."""
    try:
        re2.compile(pattern, _RE2_OPTIONS)
    except re2.error as exc:
        detail = exc.args[0].decode(errors="replace") if exc.args and isinstance(exc.args[0], bytes) else str(exc)
        raise ValueError(
            f"invalid regular expression: {detail} (patterns use RE2 syntax: no backreferences like \\1, no "
            "lookarounds like (?=...) or (?<=...), no atomic groups or possessive repeats)"
        ) from None
    finally:
        # re2.compile keeps the last 128 patterns it compiled; a check has no use for them, and each may hold up to
        # RE2_MAX_MEM, so the process that validates (the API) keeps none. Grading keeps its own (_compile_pattern).
        re2.purge()


# OpenAI's regex flags map onto RE2's inline flags, the same letters.
_REGEX_FLAGS = ("i", "m", "s")


@functools.lru_cache(maxsize=32)  # keys are at most MAX_PATTERN_CHARS long; values at most RE2_MAX_MEM each
def _compile_pattern(pattern: str, flags: tuple[str, ...]) -> Any:
    """The compiled RE2 pattern (`re2._Regexp`) with `flags` as a leading inline group: `(?is)pattern`."""
    if len(pattern) > MAX_PATTERN_CHARS:
        raise ValueError(f"longer than {MAX_PATTERN_CHARS} characters")
    inline = "".join(flag for flag in _REGEX_FLAGS if flag in flags)
    return re2.compile(f"(?{inline}){pattern}" if inline else pattern, _RE2_OPTIONS)


# ----------------------------------------------------------------------------------------------------
# Grader models


class _GraderBase(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True, allow_inf_nan=False)

    name: str = Field(min_length=1, max_length=MAX_NAME_CHARS)


class StringCheckGrader(_GraderBase):
    """1.0 when `operation` holds between rendered input and reference, else 0.0.

    eq: input == reference; ne: input != reference; like: reference is a substring of input; ilike: the same
    after lower-casing both. No whitespace is stripped.
    """

    type: Literal["string_check"]
    input: Template
    reference: Template
    operation: Literal["eq", "ne", "like", "ilike"]


class TextSimilarityGrader(_GraderBase):
    """The `evaluation_metric` of rendered input and reference: `fuzzy_match` (fuzzy_match()); `bleu`, `gleu`,
    `meteor`, `rouge_1` … `rouge_5`, `rouge_l`, in [0, 1] (trainer.grading.similarity, which says how each is computed
    with nltk and rouge-score); and `cosine`: the cosine similarity of the two texts' embeddings from the deployment's
    embeddings endpoint (in [-1, 1]; scored over the batch by `trainer.grading.remote_graders`, not here).

    Each rendered text may be at most MAX_SIMILARITY_CHARS long, or `similarity.MAX_CHARS[metric]` (meteor: 10,000):
    a sample whose input or reference is longer scores 0.0 with an error flag. `pass_threshold` is accepted as OpenAI
    has it and does not change the score.
    """

    type: Literal["text_similarity"]
    input: Template
    reference: Template
    evaluation_metric: str
    pass_threshold: float | None = Field(default=None, allow_inf_nan=False)

    @field_validator("evaluation_metric")
    @classmethod
    def _known_metric(cls, value: str) -> str:
        if value in similarity.UNAVAILABLE:
            raise ValueError(f"evaluation_metric {value!r} is not available here: {similarity.UNAVAILABLE[value]}")
        if value not in _SIMILARITY_METRICS and value not in REMOTE_SIMILARITY_METRICS:
            valid = ", ".join([*_SIMILARITY_METRICS, *REMOTE_SIMILARITY_METRICS])
            raise ValueError(f"unsupported evaluation_metric {value!r}; valid: {valid}")
        return value


class NumericMatchGrader(_GraderBase):
    """1.0 when a, the last number of the rendered input, and b, the last number of the rendered reference,
    satisfy |a − b| ≤ max(tolerance, relative_tolerance · |b|), else 0.0. An input with no number
    scores 0.0; a reference with none scores 0.0 and adds an error flag. parse_last_number says what counts.
    """

    type: Literal["numeric_match"]
    input: Template
    reference: Template
    tolerance: float = Field(default=0.0, ge=0.0, allow_inf_nan=False)
    relative_tolerance: float = Field(default=0.0, ge=0.0, allow_inf_nan=False)


class RegexGrader(_GraderBase):
    """1.0 when `pattern` matches somewhere in the first MAX_REGEX_INPUT_CHARS characters of the rendered input,
    else 0.0.

    `pattern` is a literal regular expression, not a template, in RE2 syntax (https://github.com/google/re2/wiki/Syntax),
    which matches in time linear in the text: Python's `re` syntax less backreferences (`\\1`), lookarounds
    (`(?=`, `(?!`, `(?<=`, `(?<!`), atomic groups and possessive repeats; a pattern RE2 refuses is an error naming
    this field. As in RE2, `\\d`, `\\w`, `\\s` and `\\b` are ASCII (use `\\pN`, `\\pL` for Unicode), and without `m`
    `$` matches only at the very end of the text. Flags: i (case-insensitive), m (`^`/`$` at line breaks),
    s (`.` matches a newline).
    """

    type: Literal["regex"]
    input: Template
    pattern: str = Field(max_length=MAX_PATTERN_CHARS)
    flags: list[Literal["i", "m", "s"]] = Field(default_factory=list, max_length=len(_REGEX_FLAGS))

    @field_validator("pattern")
    @classmethod
    def _valid_pattern(cls, value: str) -> str:
        _check_pattern(value)
        return value


class LengthPenaltyGrader(_GraderBase):
    """−max(0, len(rendered input) − max_chars) · penalty_per_char, clipped below at min_score.

    Length counts characters (code points). penalty_per_char defaults to 1 / max_chars, so with the default
    min_score of −1.0 the score falls linearly from 0 at max_chars to −1 at 2 · max_chars. None: no clip.
    """

    type: Literal["length_penalty"]
    input: Template
    max_chars: int = Field(ge=1)
    penalty_per_char: float | None = Field(default=None, ge=0.0, allow_inf_nan=False)
    min_score: float | None = Field(default=-1.0, le=0.0, allow_inf_nan=False)

    @property
    def effective_penalty_per_char(self) -> float:
        return self.penalty_per_char if self.penalty_per_char is not None else 1.0 / self.max_chars


class PromptMessage(BaseModel):
    """One message of a reward_model grader's prompt; its content is a template."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    role: Literal["system", "developer", "user", "assistant"]
    content: Template


class RewardModelGrader(_GraderBase):
    """The scalar score a reward model gives the conversation `prompt` + the sample as the assistant's reply.

    `model`: the output folder of a `reward_model` job (the service rewrites a job id or model name to it);
    `prompt`: the conversation the sample answers, templates allowed; default: the item's own `messages` (or its
    `prompt` string as a user turn), i.e. the prompt the policy was given. `normalize`: standardise the score with
    the mean and standard deviation of the reward model's scores on its own preference data (stored with it).
    `batch_size`: samples per forward pass.
    """

    type: Literal["reward_model"]
    model: str = Field(min_length=1)
    prompt: list[PromptMessage] | None = Field(default=None, min_length=1)
    normalize: bool = False
    batch_size: int = Field(default=32, ge=1, le=4096)

    @field_validator("prompt")
    @classmethod
    def _no_sample_in_prompt(cls, value: list[PromptMessage] | None) -> list[PromptMessage] | None:
        for i, m in enumerate(value or ()):
            if any(isinstance(p, _Ref) and p.namespace == "sample" for p in _parse_template(m.content)):
                raise ValueError(
                    f"prompt[{i}].content: the sample is the reply the model scores, not part of the prompt"
                )
        return value


PYTHON_IMAGE_TAGS: tuple[str, ...] = ("2025-05-08",)
"""The `image_tag`s a python grader may name: OpenAI's. Here the image is the sandbox's interpreter and its standard
library only (OpenAI's image also holds numpy, scipy, pandas, ...: a grader importing them fails its samples)."""
MAX_PYTHON_SOURCE_BYTES = 256 * 1024
"""OpenAI's bound on a python grader's `source` ("< 256 kB"), in UTF-8 bytes (the sandbox's runner checks it too)."""


class PythonGrader(_GraderBase):
    """OpenAI's `python` grader: `source` defines `grade(sample, item) -> float`, run in a sandbox
    (trainer.grading.sandbox).

    `sample` is OpenAI's sample object (`sample_object`: output_text, output_json, output_tools, choices,
    output_audio), `item` the dataset row. The score is what float() makes of grade's result when it is a finite
    number (not clipped); anything else (an exception, a value that is not a number, NaN) scores 0.0 with an error
    flag. `name` is optional, as in OpenAI's guide (default "python"). Whether `grade` is defined is checked in a
    sandbox (`trainer.grading.sandbox.check_source`) where the grader arrives, never by parsing the source here.
    """

    type: Literal["python"]
    name: str = Field(default="python", min_length=1, max_length=MAX_NAME_CHARS)
    source: str
    image_tag: str | None = None

    @field_validator("source")
    @classmethod
    def _source_size(cls, value: str) -> str:
        size = len(value.encode("utf-8", errors="surrogatepass"))
        if size > MAX_PYTHON_SOURCE_BYTES:
            raise ValueError(f"source is {size} bytes long; at most {MAX_PYTHON_SOURCE_BYTES} bytes are allowed")
        return value

    @field_validator("image_tag")
    @classmethod
    def _known_image(cls, value: str | None) -> str | None:
        if value is not None and value not in PYTHON_IMAGE_TAGS:
            raise ValueError(f"unknown image_tag {value!r}; valid: {', '.join(PYTHON_IMAGE_TAGS)}")
        return value


# ----------------------------------------------------------------------------------------------------
# Remote graders: a judge model (score_model, label_model) and the tenant's grading service (endpoint). They are
# shaped here and scored over whole batches by trainer.grading.remote_graders.

MAX_JUDGE_MESSAGES = 32
MAX_CONTENT_PARTS = 16
MAX_JUDGE_MODEL_CHARS = 256
MAX_LABELS = 64
MAX_LABEL_CHARS = 256
MAX_JUDGE_TOKENS = 65_536
MAX_ENDPOINT_HEADERS = 32
MAX_HEADER_NAME_CHARS = 256
MAX_HEADER_VALUE_CHARS = 8_192
MAX_RATE_LIMIT = 10_000
_HEADER_NAME_RE = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")  # RFC 9110's token
# Headers the HTTP client writes itself (framing, the connection, the pinned Host: trainer.grading.url_policy) or that
# would route the request elsewhere: a tenant's value for them could break the request or the pinning.
_RESERVED_HEADERS = frozenset(
    {
        "host",
        "content-length",
        "content-type",
        "transfer-encoding",
        "connection",
        "keep-alive",
        "upgrade",
        "te",
        "trailer",
        "expect",
        "proxy-authorization",
        "proxy-connection",
    }
)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True, allow_inf_nan=False)


class TextPart(_Strict):
    """A text content block of a judge's input message (OpenAI's `input_text`, or `output_text` for an assistant's
    turn); its text is a template."""

    type: Literal["input_text", "output_text"]
    text: Template


_TEXT_PART_TYPES = ("input_text", "output_text")


def _content(value: Any) -> "str | TextPart | list[TextPart]":
    """A message's content, checked one way by its form (so that an error names one problem, not every form's):
    a template string, a text block, or a list of 1 to MAX_CONTENT_PARTS text blocks. The content blocks OpenAI also
    takes (input_image, input_audio) are refused: the judge here takes text."""
    if isinstance(value, str):
        if len(value) > MAX_TEMPLATE_CHARS:
            raise ValueError(f"longer than {MAX_TEMPLATE_CHARS} characters")
        return _validate_template(value)
    if isinstance(value, TextPart):
        return value
    single = isinstance(value, dict)
    parts = [value] if single else value
    if not isinstance(parts, list) or not parts or len(parts) > MAX_CONTENT_PARTS:
        raise ValueError(f"expected a string, a text block or a list of 1 to {MAX_CONTENT_PARTS} text blocks")
    out: list[TextPart] = []
    for i, part in enumerate(parts):
        where = "" if single else f"[{i}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if isinstance(kind, str) and kind not in _TEXT_PART_TYPES:
            prefix = f"{where}: " if where else ""
            raise ValueError(
                f"{prefix}content blocks of type {kind!r} are not supported: this deployment's judge takes text "
                f"({', '.join(_TEXT_PART_TYPES)} blocks, or a string)"
            )
        try:
            out.append(TextPart.model_validate(part))
        except ValidationError as exc:
            first = exc.errors()[0]
            field = ".".join(str(x) for x in first["loc"])
            problem = str(first.get("ctx", {}).get("error", first["msg"]))
            raise ValueError(f"{where}{'.' if where and field else ''}{field}: {problem}") from None
    return out[0] if single else out


def _content_json(value: "str | TextPart | list[TextPart]") -> Any:
    if isinstance(value, str):
        return value
    if isinstance(value, TextPart):
        return value.model_dump()
    return [part.model_dump() for part in value]


class JudgeMessage(_Strict):
    """One message of a score_model or label_model grader's `input` (OpenAI's EvalItem): a role and a content that is
    a template string, a text block or a list of text blocks. `{{sample.output_text}}` is the sample to judge."""

    role: Literal["user", "assistant", "system", "developer"]
    content: Annotated[str | TextPart | list[TextPart], PlainValidator(_content), PlainSerializer(_content_json)]
    type: Literal["message"] | None = None

    @property
    def templates(self) -> tuple[str, ...]:
        if isinstance(self.content, str):
            return (self.content,)
        if isinstance(self.content, TextPart):
            return (self.content.text,)
        return tuple(part.text for part in self.content)


class SamplingParams(_Strict):
    """OpenAI's `sampling_params` of a score_model grader, sent to the judge as chat-completions parameters
    (`max_completions_tokens`, OpenAI's spelling, as `max_completion_tokens`)."""

    max_completions_tokens: int | None = Field(default=None, ge=1, le=MAX_JUDGE_TOKENS)
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    seed: int | None = Field(default=None, ge=-(2**63), lt=2**63)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)


def _model_name(value: str) -> str:
    if not value.strip():
        raise ValueError("the judge model's name is empty")
    return value


JudgeModelName = Annotated[str, StringConstraints(min_length=1, max_length=MAX_JUDGE_MODEL_CHARS)]


class ScoreModelGrader(_GraderBase):
    """OpenAI's `score_model`: a judge model reads `input` (templates rendered against the sample and the item) and
    answers OpenAI's structured result `{"steps": [{"description", "conclusion"}, ...], "result": <number>}`; the
    score is `result`, which must lie in `range` (default [0, 1]).

    `model` names one of the judge models the deployment offers (`PROXIMA_JUDGE_MODELS`); the judge's URL is the
    deployment's, never the tenant's. An answer that does not parse, or a result outside `range`, scores 0.0 with a
    `model_grader_parse` error; a refusal `model_grader_refusal`; no answer after the retries `model_grader_server`.
    `pass_threshold` is accepted (OpenAI's evals have it) and does not change the score.
    """

    type: Literal["score_model"]
    model: JudgeModelName
    input: list[JudgeMessage] = Field(min_length=1, max_length=MAX_JUDGE_MESSAGES)
    range: list[float] = Field(default_factory=lambda: [0.0, 1.0])
    sampling_params: SamplingParams | None = None
    pass_threshold: float | None = Field(default=None, allow_inf_nan=False)

    @field_validator("model")
    @classmethod
    def _named(cls, value: str) -> str:
        return _model_name(value)

    @field_validator("range")
    @classmethod
    def _valid_range(cls, value: list[float]) -> list[float]:
        if len(value) != 2 or not value[0] < value[1]:
            raise ValueError(f"expected [low, high] with low < high, got {value}")
        return [float(v) for v in value]


class LabelModelGrader(_GraderBase):
    """OpenAI's `label_model`: a judge model reads `input` and answers one of `labels` (structured output
    `{"steps": [...], "result": "<label>"}`); the score is 1.0 when that label is one of `passing_labels`, else 0.0.
    An answer that is not one of `labels` scores 0.0 with a `model_grader_parse` error."""

    type: Literal["label_model"]
    model: JudgeModelName
    input: list[JudgeMessage] = Field(min_length=1, max_length=MAX_JUDGE_MESSAGES)
    labels: list[Annotated[str, StringConstraints(min_length=1, max_length=MAX_LABEL_CHARS)]] = Field(
        min_length=1, max_length=MAX_LABELS
    )
    passing_labels: list[str] = Field(min_length=1, max_length=MAX_LABELS)

    @field_validator("model")
    @classmethod
    def _named(cls, value: str) -> str:
        return _model_name(value)

    @field_validator("labels")
    @classmethod
    def _distinct(cls, value: list[str]) -> list[str]:
        repeated = sorted({label for label in value if value.count(label) > 1})
        if repeated:
            raise ValueError(f"labels must be distinct; repeated: {repeated}")
        return value

    @field_validator("passing_labels")
    @classmethod
    def _subset(cls, value: list[str], info: ValidationInfo) -> list[str]:
        labels = info.data.get("labels")
        if labels is not None:  # else the labels failed validation and are reported on their own
            unknown = [label for label in value if label not in labels]
            if unknown:
                raise ValueError(f"{unknown} not among labels {labels}; passing_labels must be a subset of labels")
        return value


def _check_headers(value: dict[str, str] | None) -> dict[str, str] | None:
    if value is None:
        return value
    if len(value) > MAX_ENDPOINT_HEADERS:
        raise ValueError(f"at most {MAX_ENDPOINT_HEADERS} headers are allowed")
    for name, text in value.items():
        if len(name) > MAX_HEADER_NAME_CHARS or not _HEADER_NAME_RE.fullmatch(name):
            raise ValueError(f"{name[:40]!r} is not a valid header name")
        if name.lower() in _RESERVED_HEADERS or name.lower().startswith("proxy-"):
            raise ValueError(f"header {name!r} is set by the service and cannot be given")
        if len(text) > MAX_HEADER_VALUE_CHARS:
            raise ValueError(f"header {name!r}: its value is longer than {MAX_HEADER_VALUE_CHARS} characters")
        if not all(c == "\t" or " " <= c <= "~" for c in text):
            raise ValueError(f"header {name!r}: its value may hold printable ASCII characters only")
    return value


class EndpointGrader(_GraderBase):
    """The `endpoint` grader of OpenAI's agent-RFT preview: the tenant's own grading service at `url`.

    Each sample is one `POST url` with JSON `{"sample": <OpenAI's sample object>, "item": <the dataset row>,
    "trace_id": "trace_<hex>"}` and `headers`, answered by `{"score": <number>}` (the score, not clipped). Requests
    start at most `rate_limit` per second (none: no limit beyond the deployment's concurrency). A sample whose request
    fails (timeout, connection error, HTTP 5xx or 429) is retried with backoff; after the retries, or on another HTTP
    error, it is discarded: scored 0.0 with an `endpoint_server` error; an answer that is not `{"score": number}` is an
    `endpoint_parse` error. `pass_threshold` is accepted as OpenAI has it and does not change the score.

    The URL must be `http(s)://`, without credentials or fragment; whether this deployment allows it (its scheme and
    the addresses its host resolves to: no internal addresses by default) is checked where the grader arrives and
    again at every batch (trainer.grading.url_policy).
    """

    type: Literal["endpoint"]
    url: str
    headers: dict[str, str] | None = None
    rate_limit: int | None = Field(default=None, ge=1, le=MAX_RATE_LIMIT)
    pass_threshold: float | None = Field(default=None, allow_inf_nan=False)

    @field_validator("url")
    @classmethod
    def _url_form(cls, value: str) -> str:
        try:
            url_policy.parse_url(value)
        except url_policy.UrlRefused as err:
            raise ValueError(str(err)) from None
        return value

    @field_validator("headers")
    @classmethod
    def _valid_headers(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        return _check_headers(value)


class MultiGrader(_GraderBase):
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
        tree = _compile_formula(value)
        graders = info.data.get("graders")
        if graders is not None:  # else the graders failed validation and are reported on their own
            for name in _formula_names(tree):
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
_LeafGrader = (
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


# ----------------------------------------------------------------------------------------------------
# Parsing


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


# ----------------------------------------------------------------------------------------------------
# Grading


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
    ctx = _Context(
        output_text=output_text, item=item, errors=[], model_scores=model_scores or {}, output_tools=output_tools
    )
    if isinstance(grader, MultiGrader):
        score, sub_scores = _grade_multi(grader, ctx)
    else:
        score = _score_leaf(grader, ctx, grader.name)
        sub_scores = {grader.name: score}
    return GradeResult(score=score, sub_scores=sub_scores, errors=tuple(dict.fromkeys(ctx.errors)))


def _grade_multi(grader: MultiGrader, ctx: _Context, prefix: str = "") -> tuple[float, dict[str, float]]:
    sub_scores: dict[str, float] = {}
    values: dict[str, float] = {}
    for key, child in grader.graders.items():
        if isinstance(child, MultiGrader):
            values[key], nested = _grade_multi(child, ctx, f"{prefix}{key}.")
            sub_scores[key] = values[key]
            sub_scores.update({f"{key}.{name}": score for name, score in nested.items()})
        else:
            values[key] = sub_scores[key] = _score_leaf(child, ctx, prefix + key)
    try:
        score = _evaluate(_compile_formula(grader.calculate_output), values)
    except (ArithmeticError, ValueError) as exc:
        ctx.errors.append(
            GradeError(
                f"grader {grader.name!r}: calculate_output {grader.calculate_output!r} failed ({exc}); scored 0.0",
                "formula",
            )
        )
        score = 0.0
    return score, sub_scores


def _score_leaf(grader: _LeafGrader, ctx: _Context, path: str) -> float:
    def render(template: str) -> str:
        return _render(template, grader.name, ctx)

    match grader:
        case StringCheckGrader():
            return float(_STRING_OPERATIONS[grader.operation](render(grader.input), render(grader.reference)))
        case TextSimilarityGrader():
            if grader.evaluation_metric in REMOTE_SIMILARITY_METRICS:
                return _batched_score(grader, ctx, path, "embeddings endpoint")
            texts = {"input": render(grader.input), "reference": render(grader.reference)}
            max_chars = similarity.MAX_CHARS.get(grader.evaluation_metric, MAX_SIMILARITY_CHARS)
            for field, text in texts.items():
                if len(text) > max_chars:
                    ctx.errors.append(
                        GradeError(
                            f"grader {grader.name!r}: the rendered {field} is {len(text)} characters long; "
                            f"{grader.evaluation_metric} compares texts of at most {max_chars}; scored 0.0",
                            "other",
                        )
                    )
                    return 0.0
            metric = _SIMILARITY_METRICS[grader.evaluation_metric]
            return float(metric(texts["input"], texts["reference"]))
        case NumericMatchGrader():
            value, reference_text = parse_last_number(render(grader.input)), render(grader.reference)
            reference = parse_last_number(reference_text)
            if reference is None:
                ctx.errors.append(
                    GradeError(
                        f"grader {grader.name!r}: no number in the rendered reference {reference_text[:80]!r}", "other"
                    )
                )
                return 0.0
            if value is None:
                return 0.0
            matched = numbers_match(
                value, reference, tolerance=grader.tolerance, relative_tolerance=grader.relative_tolerance
            )
            return float(matched)
        case RegexGrader():
            pattern = _compile_pattern(grader.pattern, tuple(grader.flags))
            return float(pattern.search(render(grader.input)[:MAX_REGEX_INPUT_CHARS]) is not None)
        case LengthPenaltyGrader():
            return length_penalty(
                len(render(grader.input)),
                max_chars=grader.max_chars,
                penalty_per_char=grader.effective_penalty_per_char,
                min_score=grader.min_score,
            )
        case RewardModelGrader():
            if path not in ctx.model_scores:
                raise GraderError(
                    f"grader {grader.name!r}: reward_model graders run a model over batches of samples; they are "
                    "scored during training and evaluation, and cannot be run on a single sample here"
                )
            return float(ctx.model_scores[path])
        case PythonGrader():
            if path not in ctx.model_scores:
                raise GraderError(
                    f"grader {grader.name!r}: python graders run in a sandbox over batches of samples "
                    "(trainer.loops.evaluate.grade_batch), not here"
                )
            return float(ctx.model_scores[path])
        case ScoreModelGrader() | LabelModelGrader():
            return _batched_score(grader, ctx, path, "judge model")
        case EndpointGrader():
            return _batched_score(grader, ctx, path, "grading service")
        case _:
            assert_never(grader)


def _batched_score(grader: RemoteGrader, ctx: _Context, path: str, what: str) -> float:
    """A remote leaf's score, computed over the batch by `remote_graders`; GraderError when it is missing."""
    if path not in ctx.model_scores:
        raise GraderError(
            f"grader {grader.name!r}: {grader.type} graders call a {what} over batches of samples "
            "(trainer.grading.remote_graders), not here"
        )
    return float(ctx.model_scores[path])


# ----------------------------------------------------------------------------------------------------
# Introspection


def _templates(grader: _LeafGrader) -> tuple[str, ...]:
    match grader:
        case StringCheckGrader() | TextSimilarityGrader() | NumericMatchGrader():
            return (grader.input, grader.reference)
        case RegexGrader() | LengthPenaltyGrader():
            return (grader.input,)
        case RewardModelGrader():
            return tuple(m.content for m in grader.prompt or ())
        case PythonGrader() | EndpointGrader():
            return ()
        case ScoreModelGrader() | LabelModelGrader():
            return tuple(t for m in grader.input for t in m.templates)
        case _:
            assert_never(grader)


def _leaves(grader: Grader) -> list[_LeafGrader]:
    if isinstance(grader, MultiGrader):
        return [leaf for child in grader.graders.values() for leaf in _leaves(child)]
    return [grader]


def _item_refs(grader: Grader) -> list[tuple[str, _Ref]]:
    """(leaf grader name, reference) of every `{{item.*}}` reference, depth first, in field order."""
    return [
        (leaf.name, part)
        for leaf in _leaves(grader)
        for template in _templates(leaf)
        for part in _parse_template(template)
        if isinstance(part, _Ref) and part.namespace == "item"
    ]


def template_fields(grader: Grader) -> set[str]:
    """Dotted `item` paths referenced by the grader's templates: `{{item.meta.answer}}` → 'meta.answer'."""
    return {ref.dotted for _, ref in _item_refs(grader)}


def check_item(grader: Grader, item: Mapping[str, Any]) -> str | None:
    """None when each `{{item.*}}` of the grader is in `item`, else a message naming the first missing one."""
    for name, ref in _item_refs(grader):
        if not _lookup(item, ref.path)[0]:
            return _missing_field_message(name, ref)
    for _, leaf in model_graders(grader):
        if leaf.prompt is None and reward_model_prompt(leaf, item) is None:
            return f"grader {leaf.name!r} takes its prompt from the item's 'messages' or 'prompt', and it has neither"
    return None


def held_out_keys(grader: Grader) -> tuple[str, ...]:
    """The sub-graders of a top-level `multi` that its `calculate_output` does not read: scored and reported
    (reward/{key}/mean, val/reward/{key}/mean) but not trained on, e.g. the true answer beside a reward model."""
    if not isinstance(grader, MultiGrader):
        return ()
    used = set(_formula_names(_compile_formula(grader.calculate_output)))
    return tuple(k for k in grader.graders if k not in used)


def model_graders(grader: Grader) -> list[tuple[str, RewardModelGrader]]:
    """(key, grader) of every reward_model leaf, keyed as `grade` keys sub_scores (`rm`, `quality.rm`)."""
    if isinstance(grader, RewardModelGrader):
        return [(grader.name, grader)]
    if not isinstance(grader, MultiGrader):
        return []
    out: list[tuple[str, RewardModelGrader]] = []
    for key, child in grader.graders.items():
        if isinstance(child, RewardModelGrader):
            out.append((key, child))
        elif isinstance(child, MultiGrader):
            out.extend((f"{key}.{path}", leaf) for path, leaf in model_graders(child))
    return out


def keyed_leaves(grader: Grader, param: str = "grader") -> list[tuple[str, str, _LeafGrader]]:
    """(key, param path, leaf) of every leaf, depth first: the key as `grade` keys sub_scores and reads
    `model_scores` (`judge`, `quality.judge`; a lone leaf is keyed by its name), the param path as the API names the
    leaf's fields (`grader`, `grader.graders.quality.graders.judge`)."""
    if not isinstance(grader, MultiGrader):
        return [(grader.name, param, grader)]
    out: list[tuple[str, str, _LeafGrader]] = []
    for key, child in grader.graders.items():
        child_param = f"{param}.graders.{key}"
        if isinstance(child, MultiGrader):
            out.extend((f"{key}.{path}", p, leaf) for path, p, leaf in keyed_leaves(child, child_param))
        else:
            out.append((key, child_param, child))
    return out


def is_remote(leaf: _LeafGrader) -> bool:
    """Whether `remote_graders` scores the leaf (it calls a judge, an endpoint or an embeddings endpoint)."""
    if isinstance(leaf, TextSimilarityGrader):
        return leaf.evaluation_metric in REMOTE_SIMILARITY_METRICS
    return isinstance(leaf, ScoreModelGrader | LabelModelGrader | EndpointGrader)


def remote_graders(grader: Grader, param: str = "grader") -> list[tuple[str, str, RemoteGrader]]:
    """(key, param path, leaf) of every remote leaf (`is_remote`), as `keyed_leaves` gives them."""
    out: list[tuple[str, str, RemoteGrader]] = []
    for key, path, leaf in keyed_leaves(grader, param):
        if is_remote(leaf):
            assert isinstance(leaf, ScoreModelGrader | LabelModelGrader | EndpointGrader | TextSimilarityGrader)
            out.append((key, path, leaf))
    return out


def is_batched(grader: Grader) -> bool:
    """Whether the whole grader is one leaf scored over batches outside the grading process (python or remote): its
    batch scores are its results, with nothing left for `grade` to combine."""
    return not isinstance(grader, MultiGrader) and (isinstance(grader, PythonGrader) or is_remote(grader))


def render(
    template: str,
    grader_name: str,
    *,
    output_text: str,
    item: Mapping[str, Any],
    output_tools: Sequence[Mapping[str, Any]] = (),
) -> tuple[str, list[GradeError]]:
    """A template filled with the sample and the item, and the problems met (a missing item field renders as '' and
    adds an `invalid_variable` error), as every grader renders its templates."""
    ctx = _Context(output_text=output_text, item=item, errors=[], model_scores={}, output_tools=output_tools)
    return _render(template, grader_name, ctx), ctx.errors


def python_graders(grader: Grader) -> list[tuple[str, PythonGrader]]:
    """(key, grader) of every python leaf, keyed as `grade` keys sub_scores and reads `model_scores` (`py`,
    `quality.py`)."""
    if isinstance(grader, PythonGrader):
        return [(grader.name, grader)]
    if not isinstance(grader, MultiGrader):
        return []
    out: list[tuple[str, PythonGrader]] = []
    for key, child in grader.graders.items():
        if isinstance(child, PythonGrader):
            out.append((key, child))
        elif isinstance(child, MultiGrader):
            out.extend((f"{key}.{path}", leaf) for path, leaf in python_graders(child))
    return out


def python_grader_params(grader: dict[str, Any], path: str = "grader") -> list[tuple[str, str]]:
    """(param path of its `source`, source) of every python leaf of a grader in its JSON form (validated or not:
    what is not a python leaf with a string source is skipped), e.g. `grader.graders.py.source`."""
    if grader.get("type") == "python":
        source = grader.get("source")
        return [(f"{path}.source", source)] if isinstance(source, str) else []
    if grader.get("type") != "multi" or not isinstance(grader.get("graders"), dict):
        return []
    out: list[tuple[str, str]] = []
    for key, child in grader["graders"].items():
        if isinstance(child, dict):
            out.extend(python_grader_params(child, f"{path}.graders.{key}"))
    return out


def batched_leaf_params(grader: dict[str, Any], path: str = "grader") -> list[str]:
    """The param paths of the leaves of a grader in its JSON form (validated or not) that are scored over batches
    outside the grading process: python and remote leaves (`is_batched`, `is_remote`), found by their `type` (and a
    text_similarity's `evaluation_metric`) alone."""
    kind = grader.get("type")
    if kind in ("python", "score_model", "label_model", "endpoint") or (
        kind == "text_similarity" and grader.get("evaluation_metric") in REMOTE_SIMILARITY_METRICS
    ):
        return [path]
    if kind != "multi" or not isinstance(grader.get("graders"), dict):
        return []
    out: list[str] = []
    for key, child in grader["graders"].items():
        if isinstance(child, dict):
            out.extend(batched_leaf_params(child, f"{path}.graders.{key}"))
    return out


_PYTHON_RUNTIME_CAUSES = frozenset({"exception", "not_a_number", "non_finite", "invalid_source"})


def python_grade_error(grader_name: str, cause: str, error: str | None) -> GradeError:
    """The GradeError of a python grader's sample that scored no number, from the sandbox's result kind (`cause`):
    the grader's own failure (`python_runtime`: it raised, returned no finite number, or its source is unusable) or
    the sandbox's (`python_server`: timeout, cpu_limit, output_limit, crash)."""
    kind: GradeErrorKind = "python_runtime" if cause in _PYTHON_RUNTIME_CAUSES else "python_server"
    return GradeError(f"python grader {grader_name!r} ({cause}): {error or cause}; scored 0.0", kind, cause)


@dataclass(frozen=True)
class PythonScores:
    """The scores of a grader's python leaves over a batch: `scores[key][i]` for sample i, keyed as `model_scores`
    is, and `errors[i]`, the problems of sample i (a leaf that scored no number adds one)."""

    scores: dict[str, list[float]]
    errors: list[list[GradeError]]


FinishReason = Literal["stop", "length"]
"""Why a sampled completion ended, as OpenAI's chat completions say it: `stop` (the model's end of sequence) or
`length` (cut at the token limit)."""


def grade_python_leaves(
    grader: Grader,
    sandbox: "PythonSandbox",
    output_texts: Sequence[str],
    items: Sequence[Mapping[str, Any]],
    finish_reasons: Sequence[FinishReason] | None = None,
    output_tools: Sequence[Sequence[Mapping[str, Any]]] | None = None,
) -> PythonScores:
    """Grade every python leaf of `grader` over the batch, one sandbox per leaf (leaves with the same source share
    it), with OpenAI's `sample` object (`sample_object`, with each sample's `finish_reason`: `stop` where none is
    given) and the item. Raises `trainer.grading.sandbox.SandboxUnavailable` when no sandbox could start."""
    errors: list[list[GradeError]] = [[] for _ in output_texts]
    scores: dict[str, list[float]] = {}
    leaves = python_graders(grader)
    if not leaves or not output_texts:
        return PythonScores({key: [] for key, _ in leaves}, errors)
    reasons = finish_reasons or ["stop"] * len(output_texts)
    tools = output_tools or [()] * len(output_texts)
    samples = [
        sample_object(text, finish_reason=reason, output_tools=calls)
        for text, reason, calls in zip(output_texts, reasons, tools, strict=True)
    ]
    by_source: dict[str, list[Result]] = {}
    for key, leaf in leaves:
        if leaf.source not in by_source:
            by_source[leaf.source] = sandbox.grade_batch(leaf.source, samples, items)
        results = by_source[leaf.source]
        scores[key] = [r.score if r.kind is None else 0.0 for r in results]
        for i, r in enumerate(results):
            if r.kind is not None:
                errors[i].append(python_grade_error(leaf.name, r.kind, r.error))
    return PythonScores(scores, errors)


def sample_object(
    output_text: str,
    *,
    finish_reason: FinishReason = "stop",
    output_tools: Sequence[Mapping[str, Any]] = (),
) -> dict[str, Any]:
    """OpenAI's `sample` of a python grader (and of the graders guide's `{{sample.*}}`) for a chat completion:
    `output_text`; `output_json`, the text parsed as JSON when it is JSON (else None; NaN and infinities are not);
    `output_tools`, the tool calls of an agent episode in chat-completions shape (`{"id", "type": "function",
    "function": {"name", "arguments"}}`; none for a single reply); `choices`, the one chat-completions choice (its
    message the final answer, which calls no tool); `output_audio` None."""
    return {
        "output_text": output_text,
        "output_json": _parse_json(output_text),
        "output_tools": [dict(c) for c in output_tools],
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": output_text, "tool_calls": []},
                "finish_reason": finish_reason,
            }
        ],
        "output_audio": None,
    }


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _parse_json(text: str) -> Any:
    try:
        return json.loads(text, parse_constant=_refuse_constant)
    except (ValueError, RecursionError):  # JSONDecodeError is a ValueError; RecursionError: nested too deep
        return None


def reward_model_prompt(grader: RewardModelGrader, item: Mapping[str, Any]) -> list[dict[str, str]] | None:
    """The conversation a reward_model grader scores the sample as the reply to: its `prompt` rendered against
    the item, or the item's own `messages` / `prompt`; None when the item has neither."""
    if grader.prompt is not None:
        ctx = _Context(output_text="", item=item, errors=[], model_scores={})
        return [{"role": m.role, "content": _render(m.content, grader.name, ctx)} for m in grader.prompt]
    messages = item.get("messages")
    if isinstance(messages, list) and messages and all(isinstance(m, Mapping) for m in messages):
        return [{"role": str(m.get("role", "user")), "content": str(m.get("content", ""))} for m in messages]
    prompt = item.get("prompt")
    if isinstance(prompt, str) and prompt:
        return [{"role": "user", "content": prompt}]
    return None


def grader_names(grader: Grader) -> list[str]:
    """The keys `grade` puts in sub_scores, in the same order."""
    if not isinstance(grader, MultiGrader):
        return [grader.name]
    names: list[str] = []
    for key, child in grader.graders.items():
        names.append(key)
        if isinstance(child, MultiGrader):
            names.extend(f"{key}.{name}" for name in grader_names(child))
    return names

"""The bounds of trainer.grading.graders: templates parsed in linear time and capped,
regular expressions on RE2, text_similarity in C and capped, multi graders nested and counted within bounds.

Timings are generous (a shared machine): each bound is far below what the code before the fix took."""

from __future__ import annotations

import difflib
import random
import re
import time
from typing import Any

import pytest

from trainer.grading.graders import fuzzy_match, grade
from trainer.spec import graders
from trainer.spec.graders import (
    MAX_GRADER_DEPTH,
    MAX_GRADERS,
    MAX_SIMILARITY_CHARS,
    MAX_TEMPLATE_CHARS,
    GraderError,
    parse_grader,
)
from trainer.spec.graders.templates import Ref, parse_template

pytestmark = pytest.mark.alone  # time limits and latencies: under pytest-xdist, no other test beside them

OUTPUT = "{{sample.output_text}}"
EXACT = {"type": "string_check", "name": "exact", "input": OUTPUT, "reference": "x", "operation": "eq"}


def regex(pattern: str, **extra: Any) -> dict[str, Any]:
    return {"type": "regex", "name": "fmt", "input": OUTPUT, "pattern": pattern, **extra}


def similarity(reference: str = "{{item.answer}}") -> dict[str, Any]:
    return {
        "type": "text_similarity",
        "name": "sim",
        "input": OUTPUT,
        "reference": reference,
        "evaluation_metric": "fuzzy_match",
    }


def nested(depth: int) -> dict[str, Any]:
    """`depth` multi graders, each the only child of the one above, around one string_check."""
    obj: dict[str, Any] = EXACT
    for level in range(depth):
        obj = {"type": "multi", "name": f"m{level}", "graders": {"a": obj}, "calculate_output": "a"}
    return obj


def parse_error(obj: dict[str, Any]) -> GraderError:
    with pytest.raises(GraderError) as err:
        parse_grader(obj)
    return err.value


def timed(fn: Any, *args: Any, **kwargs: Any) -> tuple[Any, float]:
    start = time.perf_counter()
    out = fn(*args, **kwargs)
    return out, time.perf_counter() - start


class TestTemplates:
    def test_an_80kb_template_is_refused_at_once_naming_the_field(self) -> None:
        # Before: `\{\{(.*?)\}\}` rescanned to the end for every `{{`: 23-88 s of a held GIL for this one string.
        err, seconds = timed(parse_error, {**EXACT, "input": "{{" * 40_000})
        assert str(err) == f"grader.input: String should have at most {MAX_TEMPLATE_CHARS} characters"
        assert err.param == "grader.input"
        assert seconds < 1.0

    def test_the_worst_template_under_the_cap_parses_in_linear_time(self) -> None:
        # 5,000 `{{` and no `}}`: the old pattern scanned 12.5 M characters; two `find`s scan 10,000.
        parts, seconds = timed(parse_template.__wrapped__, "{{" * (MAX_TEMPLATE_CHARS // 2))
        assert parts == ("{{" * (MAX_TEMPLATE_CHARS // 2),) and seconds < 0.05
        refs, seconds = timed(parse_template.__wrapped__, "{{item.a}}" * (MAX_TEMPLATE_CHARS // 10))
        assert len(refs) == MAX_TEMPLATE_CHARS // 10 and seconds < 0.5

    def test_the_parse_finds_what_the_old_regular_expression_found(self) -> None:
        old = re.compile(r"\{\{(.*?)\}\}", re.DOTALL)
        rng = random.Random(0)
        for _ in range(2_000):
            text = "".join(rng.choice(["{", "}", "{{", "}}", "x", " ", "item.a", "\n"]) for _ in range(12))
            expected: list[str | tuple[str, str]] = []
            end = 0
            for m in old.finditer(text):
                expected += [text[end : m.start()]] if m.start() > end else []
                expected.append(("ref", m.group(1).strip()))
                end = m.end()
            expected += [text[end:]] if end < len(text) else []
            try:
                parts = parse_template.__wrapped__(text)
            except ValueError:
                assert any(isinstance(e, tuple) and e[1] != "item.a" for e in expected), text
                continue
            assert [p if isinstance(p, str) else ("ref", ".".join((p.namespace, *p.path))) for p in parts] == expected

    def test_a_template_over_the_cap_never_enters_the_cache(self) -> None:
        before = parse_template.cache_info().currsize
        with pytest.raises(ValueError, match=f"longer than {MAX_TEMPLATE_CHARS} characters"):
            parse_template("x" * (MAX_TEMPLATE_CHARS + 1))
        assert parse_template.cache_info().currsize == before
        assert parse_template.cache_info().maxsize == 256  # at most 256 × 10,000 characters

    def test_a_template_at_the_cap_is_accepted(self) -> None:
        obj = {**EXACT, "reference": "y" * (MAX_TEMPLATE_CHARS - len("{{item.a}}")) + "{{item.a}}"}
        assert parse_grader(obj).reference.endswith("{{item.a}}")
        assert parse_template(obj["reference"])[-1] == Ref("item", ("a",))


class TestRegex:
    @pytest.mark.parametrize(
        ("pattern", "text"),
        [
            (r"^(a|aa)*c", "a" * 10_000),  # before: accepted, 1.1 s at 35 characters and ×1.46 per character
            (r"(.*a){8}$", "a" * 9_999 + "b"),  # before: accepted, O(n⁸)
            (r"(a+)+$", "a" * 9_999 + "b"),  # before: refused by the heuristic
            (r"^(\w+\s?)*$", "word " * 1_999 + "!"),
        ],
    )
    def test_catastrophic_patterns_grade_in_milliseconds(self, pattern: str, text: str) -> None:
        grader = parse_grader(regex(pattern))
        result, seconds = timed(grade, grader, output_text=text, item={})
        assert result.score == 0.0 and result.errors == ()
        assert seconds < 0.5

    def test_a_pattern_over_the_cap_is_refused_naming_the_field(self) -> None:
        err = parse_error(regex("a" * 1_001))
        assert str(err) == "grader.pattern: String should have at most 1000 characters"
        assert err.param == "grader.pattern"

    def test_a_pattern_too_large_to_compile_is_refused_quickly(self) -> None:
        err, seconds = timed(parse_error, regex(r"\pL{1000}"))
        assert str(err).startswith("grader.pattern: invalid regular expression: pattern too large - compile failed")
        assert seconds < 2.0

    def test_the_validation_compile_is_not_kept(self) -> None:
        import re2

        parse_grader(regex(r"kept? (no|yes)"))
        assert re2._Regexp._make.cache_info().currsize == 0

    def test_flags_apply_as_inline_flags(self) -> None:
        obj = regex(r"^b.c$", flags=["i", "m", "s"])
        assert grade(parse_grader(obj), output_text="a\nB\nC", item={}).score == 1.0
        assert grade(parse_grader(regex(r"^b.c$")), output_text="a\nB\nC", item={}).score == 0.0


class TestTextSimilarity:
    @pytest.mark.parametrize(
        ("a", "b", "expected"),
        [
            ("abcd", "abce", 2 * 3 / 8),  # LCS "abc"
            ("kitten", "sitting", 2 * 4 / 13),  # LCS "ittn"
            ("ab", "abcd", 2 * 2 / 6),
            ("", "", 1.0),
            ("", "abc", 0.0),
            ("héllo wörld", "hello world", 2 * 9 / 22),  # code points, not bytes
            ("bbabaa", "aaaabbba", 2 * 4 / 14),  # LCS "bbba"; difflib's greedy blocks found 3
        ],
    )
    def test_the_ratio_is_twice_the_lcs_over_the_total_length(self, a: str, b: str, expected: float) -> None:
        assert fuzzy_match(a, b) == expected

    def test_ordinary_text_scores_bit_for_bit_what_difflib_scored(self) -> None:
        pairs = [
            ("The answer is 42.", "the answer is 42"),
            ("Paris is the capital of France", "The capital of France is Paris"),
            ("def f(x):\n    return x + 1", "def f(y):\n    return y+1"),
            ("fuzzy matching of strings", "fuzzy match of a string"),
        ]
        for a, b in pairs:
            assert fuzzy_match(a, b) == difflib.SequenceMatcher(None, a, b, autojunk=False).ratio(), (a, b)

    def test_100k_characters_return_at_once_as_an_error_flag(self) -> None:
        # Before: O(n·m) pure Python, tens of minutes for this pair.
        grader = parse_grader(similarity())
        text = "lorem ipsum " * 8_500
        result, seconds = timed(grade, grader, output_text=text, item={"answer": text[::-1]})
        assert result.score == 0.0 and seconds < 0.5
        [error] = result.errors
        assert error.kind == "other"
        assert error == (
            f"grader 'sim': the rendered input is {len(text)} characters long; fuzzy_match compares texts of "
            f"at most {MAX_SIMILARITY_CHARS}; scored 0.0"
        )

    def test_texts_at_the_cap_are_compared_quickly(self) -> None:
        rng = random.Random(0)
        a = "".join(rng.choice("abcdefgh ") for _ in range(MAX_SIMILARITY_CHARS))
        b = "".join(rng.choice("abcdefgh ") for _ in range(MAX_SIMILARITY_CHARS))
        result, seconds = timed(grade, parse_grader(similarity()), output_text=a, item={"answer": b})
        assert 0.0 < result.score < 1.0 and result.errors == () and seconds < 1.0


class TestNesting:
    def test_the_deepest_allowed_multi_grades(self) -> None:
        grader = parse_grader(nested(MAX_GRADER_DEPTH))
        assert grade(grader, output_text="x", item={}).score == 1.0

    def test_one_level_deeper_is_refused_naming_the_path(self) -> None:
        err = parse_error(nested(MAX_GRADER_DEPTH + 1))
        path = "grader" + ".graders.a" * MAX_GRADER_DEPTH
        assert str(err) == f"{path}: multi graders nest at most {MAX_GRADER_DEPTH} levels deep"
        assert err.param == path

    def test_200_deep_is_refused_before_validation(self) -> None:
        # Before: accepted, then "Maximum serialization depth exceeded" when the job was written out (a 500).
        err, seconds = timed(parse_error, nested(200))
        assert err.param == "grader" + ".graders.a" * MAX_GRADER_DEPTH and seconds < 0.5

    def test_more_graders_than_the_bound_are_refused(self) -> None:
        wide = {
            "type": "multi",
            "name": "wide",
            "graders": {f"g{i}": EXACT for i in range(MAX_GRADERS)},  # with the multi itself: one too many
            "calculate_output": "g0",
        }
        err = parse_error(wide)
        assert str(err) == f"grader.graders.g{MAX_GRADERS - 1}: a grader holds at most {MAX_GRADERS} graders in all"
        del wide["graders"][f"g{MAX_GRADERS - 1}"]
        assert parse_grader(wide).type == "multi"

    def test_names_and_keys_are_bounded(self) -> None:
        assert parse_error({**EXACT, "name": "n" * 129}).param == "grader.name"
        obj = {"type": "multi", "name": "m", "graders": {"k" * 129: EXACT}, "calculate_output": "1"}
        assert str(parse_error(obj)).startswith("grader.graders: key 'kkkkkkkkkkkkkkkkkkkk'… is longer than 128")


def test_every_error_kind_has_a_name_the_pool_and_the_api_know() -> None:
    from typing import get_args

    assert set(get_args(graders.GradeErrorKind)) == {
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
    }


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_a_non_finite_number_in_a_grader_is_refused_naming_the_field(bad: float) -> None:
    # YAML's .nan/.inf reach the grader models through `proxima train` without the API's JSON check
    raw = {"type": "numeric_match", "name": "n", "input": "{{sample.output_text}}", "reference": "1", "tolerance": bad}
    with pytest.raises(GraderError, match="tolerance"):
        parse_grader(raw)

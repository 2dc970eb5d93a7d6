"""trainer.spec.graders and trainer.grading.graders: hand-computed scores for every grader type, templates, formulas,
parse errors."""

import json
from typing import Any

import pytest

from trainer.grading.graders import fuzzy_match, grade, parse_last_number
from trainer.spec.graders import (
    GRADER_TYPES,
    MAX_FORMULA_CHARS,
    MAX_REGEX_INPUT_CHARS,
    EndpointGrader,
    GraderError,
    GradeResult,
    LabelModelGrader,
    LengthPenaltyGrader,
    MultiGrader,
    NumericMatchGrader,
    PythonGrader,
    RegexGrader,
    RewardModelGrader,
    ScoreModelGrader,
    StringCheckGrader,
    TextSimilarityGrader,
    check_item,
    grader_names,
    parse_grader,
    template_fields,
)

OUTPUT = "{{sample.output_text}}"


def string_check(name: str = "acc", *, reference: str = "{{item.answer}}", operation: str = "eq") -> dict[str, Any]:
    return {
        "type": "string_check",
        "name": name,
        "input": OUTPUT,
        "reference": reference,
        "operation": operation,
    }


def regex(name: str = "fmt", *, pattern: str = r"^\d+$", **extra: Any) -> dict[str, Any]:
    return {"type": "regex", "name": name, "input": OUTPUT, "pattern": pattern, **extra}


def numeric(**extra: Any) -> dict[str, Any]:
    return {"type": "numeric_match", "name": "num", "input": OUTPUT, "reference": "{{item.answer}}", **extra}


def length(**extra: Any) -> dict[str, Any]:
    return {"type": "length_penalty", "name": "len", "input": OUTPUT, **extra}


def similarity(**extra: Any) -> dict[str, Any]:
    return {
        "type": "text_similarity",
        "name": "sim",
        "input": OUTPUT,
        "reference": "{{item.answer}}",
        "evaluation_metric": "fuzzy_match",
        **extra,
    }


def multi(formula: str, graders: dict[str, Any] | None = None, name: str = "total") -> dict[str, Any]:
    if graders is None:
        graders = {"acc": string_check("acc"), "fmt": regex("fmt")}
    return {"type": "multi", "name": name, "graders": graders, "calculate_output": formula}


def score(obj: dict[str, Any], output_text: str, item: dict[str, Any] | None = None) -> float:
    return grade(parse_grader(obj), output_text=output_text, item=item or {}).score


def parse_error(obj: Any) -> str:
    with pytest.raises(GraderError) as info:
        parse_grader(obj)
    return str(info.value)


class TestParse:
    def test_every_grader_type_parses_to_its_model(self) -> None:
        examples = {
            "string_check": (string_check(), StringCheckGrader),
            "text_similarity": (similarity(), TextSimilarityGrader),
            "multi": (multi("acc"), MultiGrader),
            "numeric_match": (numeric(), NumericMatchGrader),
            "regex": (regex(), RegexGrader),
            "length_penalty": (length(max_chars=10), LengthPenaltyGrader),
            "reward_model": ({"type": "reward_model", "name": "rm", "model": "runs/rm"}, RewardModelGrader),
            "python": ({"type": "python", "name": "py", "source": "def grade(s, i):\n    return 1.0\n"}, PythonGrader),
            "score_model": (
                {"type": "score_model", "name": "j", "model": "judge", "input": [{"role": "user", "content": "x"}]},
                ScoreModelGrader,
            ),
            "label_model": (
                {
                    "type": "label_model",
                    "name": "l",
                    "model": "judge",
                    "input": [{"role": "user", "content": "x"}],
                    "labels": ["yes", "no"],
                    "passing_labels": ["yes"],
                },
                LabelModelGrader,
            ),
            "endpoint": ({"type": "endpoint", "name": "e", "url": "https://grader.example.com/"}, EndpointGrader),
        }
        assert set(examples) == set(GRADER_TYPES)
        for grader_type, (obj, model) in examples.items():
            grader = parse_grader(obj)
            assert type(grader) is model
            assert grader.type == grader_type

    def test_grader_error_is_a_value_error(self) -> None:
        assert issubclass(GraderError, ValueError)

    def test_unknown_type_lists_valid_types(self) -> None:
        assert parse_error({"type": "lua", "name": "x", "source": "..."}) == (
            "grader.type: unknown grader type 'lua'; valid types: "
            "string_check, text_similarity, multi, numeric_match, regex, length_penalty, reward_model, python, "
            "score_model, label_model, endpoint"
        )

    def test_missing_type_is_named(self) -> None:
        assert parse_error({"name": "x"}).startswith("grader.type: field required; valid types: string_check")

    def test_not_an_object(self) -> None:
        assert parse_error([1, 2]) == "grader: expected an object, got list"

    def test_extra_key_is_rejected_with_its_name(self) -> None:
        assert parse_error({**string_check(), "weight": 2}) == "grader.weight: unknown field 'weight' is not permitted"

    def test_missing_field_is_named(self) -> None:
        obj = string_check()
        del obj["name"]
        assert parse_error(obj) == "grader.name: field required"

    def test_bad_operation_inside_multi_names_the_path(self) -> None:
        obj = multi("acc", {"acc": string_check(operation="contains")})
        assert parse_error(obj) == "grader.graders.acc.operation: Input should be 'eq', 'ne', 'like' or 'ilike'"

    def test_extra_key_inside_nested_multi_names_the_path(self) -> None:
        inner = multi("x", {"x": {**regex("x"), "bogus": True}}, name="inner")
        message = parse_error(multi("acc + inner", {"acc": string_check(), "inner": inner}))
        assert message == "grader.graders.inner.graders.x.bogus: unknown field 'bogus' is not permitted"

    def test_unknown_type_inside_multi_names_the_key(self) -> None:
        message = parse_error(multi("acc", {"acc": {"type": "lua_model", "name": "judge"}}))
        assert message.startswith("grader.graders.acc.type: unknown grader type 'lua_model'; valid types: ")

    def test_several_errors_are_all_reported(self) -> None:
        obj = {**string_check(operation="contains"), "zz": 1}
        assert parse_error(obj) == (
            "grader.operation: Input should be 'eq', 'ne', 'like' or 'ilike'; "
            "grader.zz: unknown field 'zz' is not permitted"
        )

    def test_strings_are_not_coerced_to_numbers(self) -> None:
        assert parse_error(numeric(tolerance="0.5")) == "grader.tolerance: Input should be a valid number"

    def test_integers_are_accepted_for_float_fields(self) -> None:
        grader = parse_grader(numeric(tolerance=1))
        assert isinstance(grader, NumericMatchGrader)
        assert grader.tolerance == 1.0

    def test_empty_name_is_rejected(self) -> None:
        assert parse_error(string_check(name="")).startswith("grader.name: String should have at least 1 character")


class TestTemplates:
    def test_nested_item_field_and_whitespace_inside_braces(self) -> None:
        obj = string_check(reference="{{ item.meta.answer }}")
        assert score(obj, "42", {"meta": {"answer": "42"}}) == 1.0
        assert score(obj, "41", {"meta": {"answer": "42"}}) == 0.0

    def test_literal_text_around_references(self) -> None:
        obj = string_check(reference="Answer: {{item.answer}}!")
        assert score(obj, "Answer: 7!", {"answer": "7"}) == 1.0
        assert score(obj, "7", {"answer": "7"}) == 0.0

    def test_sample_reference_in_reference_field(self) -> None:
        obj = {**string_check(reference="{{sample.output_text}}"), "input": "{{item.answer}}"}
        assert score(obj, "same", {"answer": "same"}) == 1.0

    def test_non_string_values_render_as_json(self) -> None:
        item = {"n": 3, "flag": True, "nothing": None, "obj": {"a": 1}, "answers": ["x", "y"]}
        cases = {
            "{{item.n}}": "3",
            "{{item.flag}}": "true",
            "{{item.nothing}}": "null",
            "{{item.obj}}": '{"a": 1}',
        }
        for reference, rendered in cases.items():
            assert score(string_check(reference=reference), rendered, item) == 1.0, reference
        assert score(string_check(reference="{{item.answers.1}}"), "y", item) == 1.0

    def test_templates_in_the_output_or_item_values_are_not_expanded(self) -> None:
        obj = string_check(reference="{{item.answer}}")
        assert score(obj, "{{item.secret}}", {"answer": "{{item.secret}}", "secret": "s"}) == 1.0

    def test_unknown_namespace_is_a_parse_error_naming_the_field(self) -> None:
        assert parse_error(string_check(reference="{{foo.bar}}")) == (
            "grader.reference: unknown namespace 'foo' in {{foo.bar}}; only 'sample' and 'item' exist"
        )

    def test_unknown_namespace_inside_multi_names_the_path(self) -> None:
        obj = multi("acc", {"acc": {**string_check(), "input": "{{ output_text }}"}})
        assert parse_error(obj) == (
            "grader.graders.acc.input: unknown namespace 'output_text' in {{ output_text }}; "
            "only 'sample' and 'item' exist"
        )

    def test_other_sample_fields_are_rejected(self) -> None:
        assert parse_error(string_check(reference="{{sample.choices}}")) == (
            "grader.reference: unsupported sample field in {{sample.choices}}; supported: {{sample.output_text}}, "
            "{{sample.output_json}}, {{sample.output_tools}}"
        )
        assert parse_error(string_check(reference="{{sample.output_text.x}}")).startswith(
            "grader.reference: unsupported sample field in {{sample.output_text.x}}"
        )

    def test_output_json_renders_the_parsed_output_or_a_path_into_it(self) -> None:
        answer = parse_grader({**string_check(reference="{{item.answer}}"), "input": "{{sample.output_json.answer}}"})
        whole = parse_grader({**string_check(reference='{"a": [1, 2]}'), "input": "{{sample.output_json}}"})
        first = parse_grader({**string_check(reference="2"), "input": "{{sample.output_json.a.1}}"})
        assert grade(answer, output_text='{"answer": "152", "work": "x"}', item={"answer": "152"}).score == 1.0
        assert grade(whole, output_text='{ "a" : [1,2] }', item={}).score == 1.0  # re-serialised, compact keys
        assert grade(first, output_text='{"a": [1, 2]}', item={}).score == 1.0
        for text, problem in (("152", "has no field 'answer'"), ("not json", "has no field 'answer'")):
            result = grade(answer, output_text=text, item={"answer": "152"})
            assert result.score == 0.0
            [error] = result.errors
            assert error.kind == "invalid_variable" and problem in error
        [error] = grade(whole, output_text="{cut", item={}).errors
        assert "{{sample.output_json}} but the sample's output is not JSON" in error

    def test_output_tools_renders_an_episodes_tool_calls_as_json(self) -> None:
        calls = [{"id": "call_1", "type": "function", "function": {"name": "calculator", "arguments": '{"e": "1+2"}'}}]
        grader = parse_grader({**string_check(reference="{{item.calls}}"), "input": "{{sample.output_tools}}"})
        item = {"calls": json.dumps(calls)}
        assert grade(grader, output_text="3", item=item, output_tools=calls).score == 1.0
        assert grade(grader, output_text="3", item=item).score == 0.0  # no calls: "[]"
        assert grade(grader, output_text="3", item={"calls": "[]"}).score == 1.0

    def test_item_without_a_field_is_rejected(self) -> None:
        assert parse_error(string_check(reference="{{item}}")).startswith(
            "grader.reference: invalid reference {{item}}"
        )
        assert parse_error(string_check(reference="{{item..a}}")).startswith("grader.reference: invalid reference")

    def test_missing_item_field_renders_empty_and_flags_an_error(self) -> None:
        result = grade(parse_grader(string_check(operation="ne")), output_text="x", item={"other": 1})
        assert result == GradeResult(
            score=1.0,
            sub_scores={"acc": 1.0},
            errors=("grader 'acc' references {{item.answer}} but the item has no field 'answer'; rendered as ''",),
        )

    def test_repeated_missing_field_is_flagged_once(self) -> None:
        obj = string_check(reference="{{item.answer}} {{item.answer}}")
        result = grade(parse_grader(obj), output_text=" ", item={})
        assert result.score == 1.0
        assert len(result.errors) == 1

    def test_template_fields_collects_item_paths_recursively(self) -> None:
        inner = multi("n", {"n": {**numeric(), "reference": "{{item.meta.value}} {{item.meta.unit}}"}}, name="inner")
        grader = parse_grader(multi("acc + inner", {"acc": string_check(), "inner": inner}))
        assert template_fields(grader) == {"answer", "meta.value", "meta.unit"}

    def test_template_fields_of_a_grader_without_item_references_is_empty(self) -> None:
        assert template_fields(parse_grader(regex())) == set()


class TestCheckItem:
    def test_none_when_all_fields_exist(self) -> None:
        grader = parse_grader(string_check(reference="{{item.meta.answers.0}}"))
        assert check_item(grader, {"meta": {"answers": ["a"]}}) is None

    def test_missing_top_level_field_message(self) -> None:
        assert check_item(parse_grader(string_check()), {"solution": "4"}) == (
            "grader 'acc' references {{item.answer}} but the item has no field 'answer'"
        )

    def test_missing_nested_field_names_the_sub_grader(self) -> None:
        obj = multi("acc + fmt", {"acc": regex("fmt_check"), "fmt": string_check("exact", reference="{{item.m.a}}")})
        assert check_item(parse_grader(obj), {"m": {"b": 1}}) == (
            "grader 'exact' references {{item.m.a}} but the item has no field 'm.a'"
        )

    def test_list_index_out_of_range_is_missing(self) -> None:
        grader = parse_grader(string_check(reference="{{item.answers.2}}"))
        assert check_item(grader, {"answers": ["a", "b"]}) == (
            "grader 'acc' references {{item.answers.2}} but the item has no field 'answers.2'"
        )

    def test_path_through_a_string_is_missing(self) -> None:
        grader = parse_grader(string_check(reference="{{item.answer.value}}"))
        assert check_item(grader, {"answer": "4"}) is not None


class TestStringCheck:
    @pytest.mark.parametrize(
        ("operation", "output", "reference", "expected"),
        [
            ("eq", "Paris", "Paris", 1.0),
            ("eq", "Paris ", "Paris", 0.0),
            ("eq", "paris", "Paris", 0.0),
            ("ne", "Lyon", "Paris", 1.0),
            ("ne", "Paris", "Paris", 0.0),
            ("like", "The capital is Paris.", "Paris", 1.0),
            ("like", "The capital is paris.", "Paris", 0.0),
            ("like", "Par", "Paris", 0.0),
            ("ilike", "THE CAPITAL IS PARIS.", "paris", 1.0),
            ("ilike", "Lyon", "paris", 0.0),
        ],
    )
    def test_operation(self, operation: str, output: str, reference: str, expected: float) -> None:
        assert score(string_check(operation=operation), output, {"answer": reference}) == expected

    def test_single_grader_sub_scores_are_keyed_by_name(self) -> None:
        result = grade(parse_grader(string_check("exact")), output_text="4", item={"answer": "4"})
        assert result == GradeResult(score=1.0, sub_scores={"exact": 1.0}, errors=())
        assert grader_names(parse_grader(string_check("exact"))) == ["exact"]


class TestTextSimilarity:
    def test_identical_strings_score_one(self) -> None:
        assert score(similarity(), "the same text", {"answer": "the same text"}) == 1.0

    def test_disjoint_strings_score_zero(self) -> None:
        assert score(similarity(), "abc", {"answer": "xyz"}) == 0.0

    def test_ratio_is_twice_matches_over_total_length(self) -> None:
        # "abcd" vs "abce": 3 matching characters, 2·3 / 8
        assert score(similarity(), "abcd", {"answer": "abce"}) == 0.75
        assert fuzzy_match("ab", "abcd") == 2 * 2 / 6

    def test_two_empty_strings_score_one(self) -> None:
        assert fuzzy_match("", "") == 1.0

    def test_pass_threshold_is_accepted_and_does_not_change_the_score(self) -> None:
        assert score(similarity(pass_threshold=0.9), "abcd", {"answer": "abce"}) == 0.75

    def test_unknown_metric_lists_valid_ones(self) -> None:
        message = parse_error(similarity(evaluation_metric="jaccard"))
        assert message.startswith("grader.evaluation_metric: unsupported evaluation_metric 'jaccard'; valid: fuzzy_")
        assert message.endswith(", cosine")  # the metric scored with the deployment's embeddings, last


class TestNumericMatch:
    @pytest.mark.parametrize(
        ("text", "expected"),
        [
            ("The answer is 42.", 42.0),
            ("-3.5", -3.5),
            ("x = \u22127", -7.0),
            ("answer:-4", -4.0),
            ("1,234,567", 1234567.0),
            ("$1,234.50 total", 1234.5),
            ("pages 10-12", 12.0),
            ("1, 2, 3", 3.0),
            ("12,3456", 3456.0),
            ("first 5, then 7", 7.0),
            (".5", 0.5),
            ("2e3", 2000.0),
            ("#### 72", 72.0),
            ("no digits here", None),
            ("", None),
        ],
    )
    def test_parse_last_number(self, text: str, expected: float | None) -> None:
        assert parse_last_number(text) == expected

    def test_exact_match_without_tolerance(self) -> None:
        assert score(numeric(), "so the total is 42", {"answer": "42"}) == 1.0
        assert score(numeric(), "so the total is 41", {"answer": "42"}) == 0.0

    def test_last_number_of_the_output_is_compared(self) -> None:
        assert score(numeric(), "I tried 5 then 7", {"answer": "7"}) == 1.0
        assert score(numeric(), "I tried 5 then 7", {"answer": "5"}) == 0.0

    def test_numeric_item_value_as_reference(self) -> None:
        assert score(numeric(), "1,000", {"answer": 1000}) == 1.0

    @pytest.mark.parametrize(
        ("output", "expected"), [("10.5", 1.0), ("9.5", 1.0), ("10.75", 0.0), ("9.25", 0.0), ("-10", 0.0)]
    )
    def test_absolute_tolerance_boundary_is_inclusive(self, output: str, expected: float) -> None:
        assert score(numeric(tolerance=0.5), output, {"answer": "10"}) == expected

    @pytest.mark.parametrize(
        ("output", "reference", "expected"),
        [("10", "8", 1.0), ("6", "8", 1.0), ("10.5", "8", 0.0), ("-6", "-8", 1.0), ("-10.5", "-8", 0.0)],
    )
    def test_relative_tolerance_uses_the_reference_magnitude(
        self, output: str, reference: str, expected: float
    ) -> None:
        # 0.25 · |±8| = 2
        assert score(numeric(relative_tolerance=0.25), output, {"answer": reference}) == expected

    def test_larger_of_the_two_tolerances_applies(self) -> None:
        obj = numeric(tolerance=3, relative_tolerance=0.25)  # max(3, 0.25 · 8) = 3
        assert score(obj, "11", {"answer": "8"}) == 1.0
        assert score(obj, "11.5", {"answer": "8"}) == 0.0

    def test_no_number_in_output_scores_zero_without_error(self) -> None:
        result = grade(parse_grader(numeric()), output_text="I don't know", item={"answer": "3"})
        assert result == GradeResult(score=0.0, sub_scores={"num": 0.0}, errors=())

    def test_no_number_in_reference_scores_zero_with_error(self) -> None:
        result = grade(parse_grader(numeric()), output_text="3", item={"answer": "three"})
        assert result.score == 0.0
        assert result.errors == ("grader 'num': no number in the rendered reference 'three'",)

    def test_negative_tolerance_is_rejected(self) -> None:
        assert parse_error(numeric(tolerance=-1)) == "grader.tolerance: Input should be greater than or equal to 0"


class TestRegex:
    def test_match_and_no_match(self) -> None:
        assert score(regex(pattern=r"\bParis\b"), "It is Paris.") == 1.0
        assert score(regex(pattern=r"\bParis\b"), "It is Parisian.") == 0.0

    @pytest.mark.parametrize(
        ("pattern", "text", "flag"),
        [("answer", "ANSWER", "i"), ("^b$", "a\nb", "m"), ("a.b", "a\nb", "s")],
    )
    def test_flag_changes_the_result(self, pattern: str, text: str, flag: str) -> None:
        assert score(regex(pattern=pattern), text) == 0.0
        assert score(regex(pattern=pattern, flags=[flag]), text) == 1.0

    def test_pattern_is_not_a_template(self) -> None:
        assert score(regex(pattern=r"\{\{item.x\}\}"), "{{item.x}}", {}) == 1.0

    def test_input_template_with_item_field(self) -> None:
        obj = {**regex(pattern="^yes: 4$"), "input": "{{sample.output_text}}: {{item.answer}}"}
        assert score(obj, "yes", {"answer": 4}) == 1.0

    def test_invalid_regex_names_the_field(self) -> None:
        assert parse_error(regex(pattern="(unclosed")).startswith(
            "grader.pattern: invalid regular expression: missing ): (unclosed (patterns use RE2 syntax"
        )

    def test_unknown_flag_names_the_field(self) -> None:
        assert parse_error(regex(flags=["i", "x"])) == "grader.flags.1: Input should be 'i', 'm' or 's'"

    @pytest.mark.parametrize("pattern", [r"(a)\1", r"foo(?=bar)", r"(?<!x)y", r"(?>a+)b", r"a++b", r"(?P<x>a)(?P=x)"])
    def test_what_re2_refuses_is_rejected_naming_its_syntax(self, pattern: str) -> None:
        message = parse_error(regex(pattern=pattern))
        assert message.startswith("grader.pattern: invalid regular expression: ")
        assert "patterns use RE2 syntax" in message

    @pytest.mark.parametrize("pattern", [r"(a+)+$", r"(\w+\s?)*$", r"(?:x*y?)*", r"(a+b?){1,100}", r"^(a|aa)*c"])
    def test_nested_repeats_are_accepted_as_re2_matches_them_in_linear_time(self, pattern: str) -> None:
        assert parse_grader(regex(pattern=pattern)).type == "regex"

    @pytest.mark.parametrize(
        ("pattern", "text", "expected"),
        [(r"^\d+$", "42\n", 0.0), (r"(?m)^\d+$", "42\n", 1.0), (r"\d", "\u0663", 0.0), (r"\pN", "\u0663", 1.0)],
    )
    def test_re2_semantics_dollar_at_the_very_end_and_ascii_classes(
        self, pattern: str, text: str, expected: float
    ) -> None:
        assert score(regex(pattern=pattern), text) == expected

    def test_only_the_first_max_chars_are_searched(self) -> None:
        padding = "x" * MAX_REGEX_INPUT_CHARS
        assert score(regex(pattern="needle"), padding + "needle") == 0.0
        assert score(regex(pattern="needle"), "needle" + padding) == 1.0
        assert score(regex(pattern="needle"), padding[6:] + "needle") == 1.0


class TestLengthPenalty:
    @pytest.mark.parametrize(
        ("n_chars", "expected"), [(0, 0.0), (4, 0.0), (5, -0.25), (6, -0.5), (8, -1.0), (20, -1.0)]
    )
    def test_default_penalty_is_one_over_max_chars_clipped_at_minus_one(self, n_chars: int, expected: float) -> None:
        assert score(length(max_chars=4), "x" * n_chars) == expected

    def test_custom_penalty_without_clip(self) -> None:
        # −(14 − 4) · 0.5
        assert score(length(max_chars=4, penalty_per_char=0.5, min_score=None), "x" * 14) == -5.0

    def test_custom_clip(self) -> None:
        assert score(length(max_chars=4, penalty_per_char=0.5, min_score=-0.75), "x" * 14) == -0.75

    def test_length_counts_characters_not_bytes(self) -> None:
        assert score(length(max_chars=4), "éééé") == 0.0

    def test_length_of_the_rendered_template(self) -> None:
        obj = length(max_chars=4, input="{{sample.output_text}}{{item.suffix}}")
        assert score(obj, "ab", {"suffix": "cdef"}) == -0.5

    def test_invalid_settings_are_rejected(self) -> None:
        assert parse_error(length(max_chars=0)) == "grader.max_chars: Input should be greater than or equal to 1"
        assert parse_error(length(max_chars=4, min_score=0.5)) == (
            "grader.min_score: Input should be less than or equal to 0"
        )
        assert parse_error(length()) == "grader.max_chars: field required"


class TestMulti:
    @pytest.mark.parametrize(
        ("output", "answer", "expected"),
        [("42", "42", 1.0), ("x42", "x42", 0.7), ("41", "42", 0.3), ("x", "y", 0.0)],
    )
    def test_weighted_sum(self, output: str, answer: str, expected: float) -> None:
        assert score(multi("0.7*acc + 0.3*fmt"), output, {"answer": answer}) == expected

    def test_sub_scores_and_names(self) -> None:
        grader = parse_grader(multi("0.7*acc + 0.3*fmt"))
        result = grade(grader, output_text="x42", item={"answer": "x42"})
        assert result == GradeResult(score=0.7, sub_scores={"acc": 1.0, "fmt": 0.0}, errors=())
        assert grader_names(grader) == ["acc", "fmt"]

    def test_functions(self) -> None:
        # acc = 1, fmt = 0: 1 + 0·2 − 1 + 1 + 1 + 2 + 1 + 0 = 5
        formula = "max(acc, fmt) + min(acc, fmt) * 2 - abs(-1) + floor(1.5) + ceil(0.2) + sqrt(4) + exp(0) + log(1)"
        assert score(multi(formula), "x", {"answer": "x"}) == 5.0

    def test_variadic_min_max(self) -> None:
        assert score(multi("max(acc, fmt, 0.5) + min(acc, 3, 2)"), "x", {"answer": "x"}) == 2.0

    def test_power_and_caret(self) -> None:
        assert score(multi("2 ** 3 * acc"), "x", {"answer": "x"}) == 8.0
        assert score(multi("2 * 3 ^ 2 * acc"), "x", {"answer": "x"}) == 18.0

    def test_unary_minus_and_parentheses(self) -> None:
        assert score(multi("-(acc + 1) * 2"), "x", {"answer": "x"}) == -4.0

    @pytest.mark.parametrize(
        ("formula", "reason"),
        [
            ("acc / fmt", "float division by zero"),
            ("log(fmt)", "math domain error"),
            ("sqrt(fmt - 1)", "math domain error"),
            ("exp(1000 * acc)", "math range error"),
            ("(fmt - 1) ** 0.5", "math domain error"),
        ],
    )
    def test_arithmetic_error_scores_zero_with_error(self, formula: str, reason: str) -> None:
        result = grade(parse_grader(multi(formula)), output_text="x", item={"answer": "x"})
        assert result == GradeResult(
            score=0.0,
            sub_scores={"acc": 1.0, "fmt": 0.0},
            errors=(f"grader 'total': calculate_output {formula!r} failed ({reason}); scored 0.0",),
        )

    def test_overflow_to_infinity_is_an_error(self) -> None:
        result = grade(parse_grader(multi("1e308 * 10 * acc")), output_text="x", item={"answer": "x"})
        assert result.score == 0.0
        assert result.errors == (
            "grader 'total': calculate_output '1e308 * 10 * acc' failed (1e+308 * 10 is not finite); scored 0.0",
        )

    def test_nested_multi_flattens_sub_scores_with_dotted_keys(self) -> None:
        inner = multi("(a + b) / 2", {"a": string_check("a"), "b": regex("b")}, name="inner")
        grader = parse_grader(multi("0.5 * acc + inner", {"acc": string_check(), "inner": inner}))
        result = grade(grader, output_text="x", item={"answer": "x"})
        assert result == GradeResult(
            score=1.0, sub_scores={"acc": 1.0, "inner": 0.5, "inner.a": 1.0, "inner.b": 0.0}, errors=()
        )
        assert grader_names(grader) == list(result.sub_scores)

    def test_missing_field_in_sub_grader_is_flagged(self) -> None:
        result = grade(parse_grader(multi("acc + fmt")), output_text="7", item={})
        assert result.score == 1.0
        assert result.errors == (
            "grader 'acc' references {{item.answer}} but the item has no field 'answer'; rendered as ''",
        )

    @pytest.mark.parametrize(
        ("formula", "message"),
        [
            (
                "__import__('os')",
                "function '__import__' is not allowed; allowed functions: abs, ceil, exp, floor, log, max, min, sqrt",
            ),
            ("acc.real", "attribute access 'acc.real' is not allowed"),
            ("acc.__class__.__bases__", "attribute access 'acc.__class__.__bases__' is not allowed"),
            ("open('x')", "function 'open' is not allowed"),
            ("round(acc)", "function 'round' is not allowed"),
            ("(lambda: 1)()", "call of 'lambda: 1' is not allowed"),
            ("[acc][0]", "'[acc][0]' (Subscript) is not allowed"),
            ("'text'", "only numeric constants are allowed, not 'text'"),
            ("True + acc", "only numeric constants are allowed, not True"),
            ("acc if fmt else 0", "'acc if fmt else 0' (IfExp) is not allowed"),
            ("acc > fmt", "'acc > fmt' (Compare) is not allowed"),
            ("acc % 2", "operator in 'acc % 2' is not allowed"),
            ("acc // 2", "operator in 'acc // 2' is not allowed"),
            ("~acc", "operator '~acc' is not allowed"),
            ("max(acc, key=fmt)", "max() takes positional arguments only"),
            ("sqrt(acc, fmt)", "sqrt() takes exactly one argument"),
            ("min()", "min() takes at least one argument"),
            ("1e999 * acc", "constant 1e309 is not a finite number"),
            ("acc +", "not a valid arithmetic expression (invalid syntax)"),
            ("import os", "not a valid arithmetic expression (invalid syntax)"),
            ("bogus + acc", "unknown name 'bogus'; sub-grader keys: acc, fmt"),
            ("max", "unknown name 'max'; sub-grader keys: acc, fmt"),
        ],
    )
    def test_unsafe_or_invalid_formula_is_rejected(self, formula: str, message: str) -> None:
        assert parse_error(multi(formula)).startswith(f"grader.calculate_output: {message}")

    def test_too_long_formula_is_rejected(self) -> None:
        formula = "+".join(["acc"] * (MAX_FORMULA_CHARS // 4 + 1))
        assert parse_error(multi(formula)) == f"grader.calculate_output: longer than {MAX_FORMULA_CHARS} characters"

    def test_too_deep_formula_is_rejected(self) -> None:
        assert parse_error(multi("-" * 40 + "acc")) == "grader.calculate_output: nested deeper than 32 levels"

    def test_nested_formula_names_its_path(self) -> None:
        inner = multi("a + z", {"a": string_check("a")}, name="inner")
        assert parse_error(multi("inner", {"inner": inner})) == (
            "grader.graders.inner.calculate_output: unknown name 'z'; sub-grader keys: a"
        )

    @pytest.mark.parametrize(
        ("key", "message"),
        [
            ("a-b", "key 'a-b' is not a valid formula variable"),
            ("1a", "key '1a' is not a valid formula variable"),
            ("lambda", "key 'lambda' is not a valid formula variable"),
            ("max", "key 'max' is the name of a formula function"),
        ],
    )
    def test_invalid_keys_are_rejected(self, key: str, message: str) -> None:
        assert parse_error(multi("1", {key: string_check()})).startswith(f"grader.graders: {message}")

    def test_empty_graders_are_rejected(self) -> None:
        assert parse_error(multi("1", {})) == "grader.graders: at least one sub-grader is required"

"""trainer.spec.json_values: the values every JSON input is checked for (NUL, lone surrogates, non-finite numbers, deep
nesting, huge integers), each reported with where it is and never echoed."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest

from trainer.spec.json_values import MAX_DEPTH, JsonValueError, check, format_path, loads


def nested(depth: int) -> Any:
    value: Any = 0
    for _ in range(depth):
        value = [value]
    return value


@pytest.mark.parametrize(
    ("value", "path", "detail"),
    [
        ({"a": "x\x00y"}, ("a",), "NUL"),
        ({"a": ["ok", "\ud800"]}, ("a", 1), "surrogate (\\ud800)"),
        ({"a": {"b": "\udfff tail"}}, ("a", "b"), "surrogate (\\udfff)"),
        ({"a": {"k\x00": 1}}, ("a",), "a key contains a NUL"),
        ({"a": {"\ud800": 1}}, ("a",), "a key contains an unpaired"),
        ({"a": [1.5, math.nan]}, ("a", 1), "finite"),
        ({"a": -math.inf}, ("a",), "finite"),
        ({"a": nested(MAX_DEPTH)}, ("a",), f"nested more than {MAX_DEPTH} levels"),
    ],
)
def test_check_names_the_path_of_the_bad_value(value: Any, path: tuple[Any, ...], detail: str) -> None:
    with pytest.raises(JsonValueError) as err:
        check(value)
    assert err.value.path == path
    assert detail in err.value.detail


def test_check_reports_the_first_problem_in_document_order() -> None:
    with pytest.raises(JsonValueError) as err:
        check({"a": [{"b": "fine"}, {"c": "\x00"}], "d": math.nan})
    assert err.value.path == ("a", 1, "c")


def test_check_accepts_what_json_can_hold() -> None:
    check({"text": "é 😀 \t\n", "n": [0, -1, 2**200, 1.5e300, True, None], "deep": nested(MAX_DEPTH - 1)})


def test_check_has_no_recursion_limit_of_its_own() -> None:
    check(nested(2000), max_depth=3000)


def test_format_path_writes_indices_in_brackets() -> None:
    assert format_path(("messages", 0, "content")) == "messages[0].content"
    assert format_path((2, "a")) == "[2].a"
    assert format_path(()) == ""


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('{"a": NaN}', "NaN: must be a finite number"),
        ('{"a": -Infinity}', "-Infinity: must be a finite number"),
        ('{"a": 1e400}', "1e400: must be a finite number"),
        ('{"a": ' + "9" * 400 + ".0}", "must be a finite number"),
        ('{"a": ' + "1" * 4301 + "}", "a number has more than 4300 digits"),
        ("[" * 3000 + "]" * 3000, f"not valid JSON: nested more than {MAX_DEPTH} levels deep"),
        ("[" * (MAX_DEPTH + 1) + "]" * (MAX_DEPTH + 1), f"[0]: nested more than {MAX_DEPTH} levels deep"),
        ('{"a": "\\u0000"}', "a: contains a NUL character"),
        ('{"a": ["\\uD83D"]}', "a[0]: contains an unpaired UTF-16 surrogate (\\ud83d)"),
        ('{"a": 1,}', "not valid JSON (Expecting property name enclosed in double quotes at column 9)"),
    ],
)
def test_loads_reports_every_problem_as_a_json_value_error(text: str, message: str) -> None:
    with pytest.raises(JsonValueError) as err:
        loads(text)
    assert message in str(err.value)


@pytest.mark.parametrize(
    "text",
    [
        '{"a": "\\\\u0000 is how JSON writes a NUL"}',  # an escaped backslash, then the letters
        '{"a": "\\ud83d\\ude00"}',  # a surrogate pair: one astral character
        '{"a": 1e308, "b": -2.5e-300, "c": ' + "1" * 4300 + "}",
        "[" * MAX_DEPTH + "]" * MAX_DEPTH,
    ],
)
def test_loads_accepts_valid_values_and_parses_them_as_json_does(text: str) -> None:
    assert loads(text) == json.loads(text)


def test_long_keys_are_shortened_in_the_path() -> None:
    with pytest.raises(JsonValueError) as err:
        check({"k" * 10_000: {"x": "\x00"}})
    assert err.value.path == ("k" * 63 + "…", "x")
    assert len(str(err.value)) < 200

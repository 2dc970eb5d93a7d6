"""An online RL job's ``response_format`` (OpenAI's ``method.reinforcement.response_format``) in the job spec: parsed
for every online method and kept through the stored spec; refused, naming the field, where it cannot apply."""

from typing import Any

import pytest

from trainer.agents.calculator_server import calculator_tool
from trainer.spec.config import JobSpec, SpecError, parse_spec
from trainer.spec.response_format import JsonObjectFormat, JsonSchemaFormat, TextFormat

GRADER = {
    "type": "string_check",
    "name": "acc",
    "input": "{{sample.output_text}}",
    "reference": "{{item.answer}}",
    "operation": "eq",
}
SCHEMA = {
    "type": "object",
    "properties": {"answer": {"type": "integer"}},
    "required": ["answer"],
    "additionalProperties": False,
}
JSON_SCHEMA = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA, "strict": True}}


def spec(method: str, grader: bool = True, **block: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"grader": GRADER, **block} if grader else dict(block)
    return {"model": "tiny", "training_file": "train.jsonl", "method": {"type": method, method: body}}


def spec_error(raw: Any) -> SpecError:
    with pytest.raises(SpecError) as exc:
        parse_spec(raw)
    return exc.value


@pytest.mark.parametrize("method", ["reinforcement", "grpo", "dr_grpo", "dapo", "rloo", "reinforce", "ppo"])
def test_every_online_method_takes_a_json_schema_and_keeps_it_in_the_stored_spec(method: str) -> None:
    parsed = parse_spec(spec(method, response_format=JSON_SCHEMA))
    fmt = parsed.method.response_format
    assert isinstance(fmt, JsonSchemaFormat) and fmt.json_schema.schema_ == SCHEMA and fmt.json_schema.strict
    stored = parsed.to_json()
    assert stored["method"][method]["response_format"] == JSON_SCHEMA  # by its alias: `schema`
    assert JobSpec.from_stored(stored).method.response_format == fmt


def test_text_json_object_and_no_format_parse_as_given() -> None:
    assert parse_spec(spec("grpo")).method.response_format is None
    assert "response_format" not in parse_spec(spec("grpo")).to_json()["method"]["grpo"]
    assert isinstance(parse_spec(spec("grpo", response_format={"type": "text"})).method.response_format, TextFormat)
    fmt = parse_spec(spec("grpo", response_format={"type": "json_object"})).method.response_format
    assert isinstance(fmt, JsonObjectFormat)


@pytest.mark.parametrize("method", ["dpo", "supervised", "reward_model"])
def test_a_method_that_samples_no_answers_refuses_it_naming_the_field(method: str) -> None:
    err = spec_error(spec(method, grader=False, response_format=JSON_SCHEMA))
    assert err.param == f"method.{method}.response_format"
    assert str(err) == (
        f"method.{method}.response_format: {method} samples no answers: response_format is for the online RL methods"
    )


@pytest.mark.parametrize(
    ("fmt", "param", "message"),
    [
        ({"type": "yaml"}, "method.reinforcement.response_format", "response_format.type must be one of"),
        (
            {"type": "json_schema", "json_schema": {"name": "a", "schema": {"not": {}}}},
            "method.reinforcement.response_format.json_schema.schema",
            "the keyword 'not' cannot be enforced",
        ),
        (
            {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "object"}, "strict": True}},
            "method.reinforcement.response_format.json_schema.schema",
            "strict mode needs additionalProperties: false on every object (at additionalProperties)",
        ),
        (
            {"type": "json_schema", "json_schema": {"name": "a b", "schema": SCHEMA}},
            "method.reinforcement.response_format.json_schema.name",
            "String should match pattern",
        ),
        ({"type": "json_object", "strict": True}, "method.reinforcement.response_format.strict", "unknown field"),
    ],
)
def test_a_bad_format_is_refused_naming_where(fmt: dict[str, Any], param: str, message: str) -> None:
    err = spec_error(spec("reinforcement", response_format=fmt))
    assert err.param == param and message in str(err)


def test_a_format_with_tools_is_refused_as_chat_completions_refuse_it() -> None:
    tools = [calculator_tool("http://127.0.0.1:9/calc")]
    err = spec_error(spec("reinforcement", response_format=JSON_SCHEMA, tools=tools))
    assert err.param == "method.reinforcement.response_format"
    assert "cannot be combined with tools or an environment" in str(err)
    # plain text constrains nothing: it goes with tools
    assert parse_spec(spec("reinforcement", response_format={"type": "text"}, tools=tools)).method.agent is not None


def test_min_completion_tokens_is_refused_with_a_json_format() -> None:
    raw = spec("grpo", response_format={"type": "json_object"}, hyperparameters={"min_completion_tokens": 2})
    err = spec_error(raw)
    assert err.param == "method.grpo.hyperparameters.min_completion_tokens"

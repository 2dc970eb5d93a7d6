"""Constrained decoding (trainer.generation.constrained), response formats (trainer.spec.response_format) and the
forced tool-call grammar (trainer.agents.tool_calls.call_grammar), on the built-in models' own tokenizers.

The masks are checked token by token against sets computed by hand; the samplers (``rollout.generate`` and
transformers' ``generate``) under a JSON schema write JSON that validates on every sample at temperature 1.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import llguidance
import pydantic
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

from trainer.agents.calculator_server import FUNCTION
from trainer.agents.tool_calls import (
    HermesParser,
    Llama3JsonParser,
    ToolChoiceUnsupported,
    call_grammar,
    call_markers,
)
from trainer.generation.constrained import (
    Grammar,
    GrammarError,
    GrammarLogitsProcessor,
    RowConstraints,
    constraints,
    json_grammar,
    response_grammar,
)
from trainer.generation.rollout import generate, left_pad
from trainer.spec.response_format import (
    ANNOTATIONS,
    ENFORCED_KEYWORDS,
    FORMATS,
    JsonObjectFormat,
    JsonSchemaFormat,
    SchemaError,
    TextFormat,
    check_schema,
    check_strict,
    parse_response_format,
    parsed_output,
)

SUM = {"type": "integer", "minimum": 0, "maximum": 198}  # every answer tiny-arith can give, as JSON
DIGITS = [str(d) for d in range(10)]


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


@pytest.fixture(scope="module")
def arith_tok(tiny_arith_dir: Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(str(tiny_arith_dir))


@pytest.fixture(scope="module")
def calc_tok(tiny_calc_dir: Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(str(tiny_calc_dir))


def allowed(tok: PreTrainedTokenizerBase, c: Any) -> set[str]:
    return set(tok.convert_ids_to_tokens(c.allowed(len(tok)).nonzero().flatten().tolist()))


def feed(tok: PreTrainedTokenizerBase, c: Any, *tokens: str) -> None:
    for t in tokens:
        c.advance(tok.convert_tokens_to_ids(t))


# -- schemas ---------------------------------------------------------------------------------------------------

# One schema per enforced keyword (and the annotations), each compiled by the decoder: the list and llguidance agree.
KEYWORD_SCHEMAS: dict[str, dict[str, Any]] = {
    "type": {"type": "integer"},
    "enum": {"enum": [1, "a"]},
    "const": {"const": 3},
    "anyOf": {"anyOf": [{"type": "integer"}, {"type": "string"}]},
    "oneOf": {"oneOf": [{"type": "integer"}, {"type": "string"}]},
    "allOf": {"allOf": [{"type": "object"}, {"required": ["a"]}]},
    "$ref": {"$defs": {"n": {"type": "integer"}}, "$ref": "#/$defs/n"},
    "$defs": {"$defs": {"n": {"type": "integer"}}, "type": "integer"},
    "definitions": {"definitions": {"n": {"type": "integer"}}, "$ref": "#/definitions/n"},
    "properties": {"type": "object", "properties": {"a": {"type": "integer"}}},
    "required": {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
    "additionalProperties": {"type": "object", "additionalProperties": False},
    "patternProperties": {"type": "object", "patternProperties": {"^a": {"type": "integer"}}},
    "minProperties": {"type": "object", "minProperties": 1},
    "maxProperties": {"type": "object", "maxProperties": 2},
    "items": {"type": "array", "items": {"type": "integer"}},
    "prefixItems": {"type": "array", "prefixItems": [{"type": "integer"}], "items": False},
    "minItems": {"type": "array", "minItems": 1},
    "maxItems": {"type": "array", "maxItems": 3},
    "minLength": {"type": "string", "minLength": 2},
    "maxLength": {"type": "string", "maxLength": 5},
    "pattern": {"type": "string", "pattern": "^[a-z]+$"},
    "format": {"type": "string", "format": "date"},
    "minimum": {"type": "number", "minimum": 0},
    "maximum": {"type": "number", "maximum": 9},
    "exclusiveMinimum": {"type": "integer", "exclusiveMinimum": 0},
    "exclusiveMaximum": {"type": "integer", "exclusiveMaximum": 9},
    "multipleOf": {"type": "integer", "multipleOf": 3},
}


def test_every_enforced_keyword_compiles_in_the_decoder() -> None:
    assert set(KEYWORD_SCHEMAS) == ENFORCED_KEYWORDS
    for schema in KEYWORD_SCHEMAS.values():
        check_schema(schema)
        json_grammar(schema)  # raises GrammarError if llguidance does not implement it
    flags = {"deprecated": False, "readOnly": False, "writeOnly": False, "examples": [1], "default": 1}
    texts = {k: "x" for k in ANNOTATIONS - set(flags) - {"$schema", "$id"}}
    assert set(texts) | set(flags) | {"$schema", "$id"} == ANNOTATIONS
    json_grammar(check_schema({"type": "integer", **texts, **flags}))
    for fmt in FORMATS:
        json_grammar(check_schema({"type": "string", "format": fmt}))


@pytest.mark.parametrize(
    ("schema", "path"),
    [
        ({"type": "object", "properties": {"a": {"not": {"type": "string"}}}}, "properties.a.not"),
        ({"if": {"type": "string"}, "then": {"minLength": 1}}, "if"),
        ({"type": "array", "items": {"uniqueItems": True}}, "items.uniqueItems"),
        ({"anyOf": [{"type": "array", "contains": {"type": "integer"}}]}, "anyOf.0.contains"),
        ({"$ref": "https://example.com/s.json"}, ""),
        ({"type": "string", "format": "iri"}, ""),
        ({"type": "thing"}, "type"),
        ({"type": "integer", "minimum": "0"}, "minimum"),
    ],
)
def test_schemas_the_decoder_cannot_enforce_are_refused_naming_where(schema: dict[str, Any], path: str) -> None:
    with pytest.raises(SchemaError) as err:
        check_schema(schema)
    assert err.value.path == path
    unenforced = {"not", "if", "uniqueItems", "contains"} & set(json.dumps(schema).replace('"', " ").split())
    for key in unenforced:  # what the list refuses, llguidance would refuse too: the list is not stricter
        source = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema))
        assert llguidance.LLMatcher.validate_grammar_with_warnings(source, None)[0], key


def test_a_schema_that_is_not_an_object_is_refused() -> None:
    with pytest.raises(SchemaError):
        check_schema([{"type": "integer"}])


def test_response_formats_parse_by_type_and_give_their_json() -> None:
    fmt = parse_response_format({"type": "json_schema", "json_schema": {"name": "s", "schema": SUM, "strict": True}})
    assert isinstance(fmt, JsonSchemaFormat) and fmt.json_schema.schema_ == SUM and fmt.json_schema.strict
    assert fmt.model_dump(by_alias=True, exclude_none=True) == {
        "type": "json_schema",
        "json_schema": {"name": "s", "schema": SUM, "strict": True},
    }
    assert isinstance(parse_response_format({"type": "json_object"}), JsonObjectFormat)
    assert response_grammar(TextFormat(type="text")) is None and response_grammar(None) is None
    with pytest.raises(ValueError, match="must be one of"):
        parse_response_format({"type": "yaml"})
    assert parsed_output(fmt, "81") == 81 and parsed_output(fmt, "8") == 8
    assert parsed_output(fmt, '{"a": ') is None and parsed_output(fmt, "NaN") is None
    assert parsed_output(TextFormat(type="text"), "81") is None


# OpenAI's strict-mode rules, each object wherever it is: every property required, additionalProperties false
STRICT_OK = {
    "type": "object",
    "properties": {"a": {"type": "integer"}, "b": {"$ref": "#/$defs/b"}},
    "required": ["b", "a"],
    "additionalProperties": False,
    "$defs": {"b": {"type": "object", "properties": {}, "additionalProperties": False}},
}


@pytest.mark.parametrize(
    ("schema", "where"),
    [
        ({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}, "additionalProperties"),
        (
            {"type": "object", "properties": {"a": {}, "b": {}}, "required": ["a"], "additionalProperties": False},
            "required",
        ),
        (
            {**STRICT_OK, "$defs": {"b": {"type": "object", "properties": {"c": {}}, "additionalProperties": False}}},
            "$defs.b.required",
        ),
        ({"type": "array", "items": {"properties": {"c": {}}, "required": ["c"]}}, "items.additionalProperties"),
        ({"anyOf": [{"type": "null"}, {"type": "object"}]}, "anyOf.1.additionalProperties"),
    ],
)
def test_a_strict_schema_breaking_openais_rules_is_refused_naming_where(schema: dict[str, Any], where: str) -> None:
    with pytest.raises(SchemaError, match="strict mode") as err:
        check_strict(schema)
    assert err.value.path == where
    bad = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema, "strict": True}}
    with pytest.raises(ValueError, match=rf"json_schema\.schema\n.*strict mode.*\(at {re.escape(where)}\)"):
        parse_response_format(bad)
    bad["json_schema"]["strict"] = False  # type: ignore[index]  # not strict: enforced as given, OpenAI's rules aside
    assert parse_response_format(bad).json_schema.schema_ == schema  # type: ignore[union-attr]


def test_a_strict_schema_keeping_openais_rules_parses() -> None:
    assert check_strict(STRICT_OK) is STRICT_OK and check_strict(SUM) is SUM  # no object: nothing to check
    fmt = parse_response_format({"type": "json_schema", "json_schema": {"name": "s", "schema": STRICT_OK, "strict": 1}})
    assert isinstance(fmt, JsonSchemaFormat) and fmt.json_schema.strict is True


# -- the masks, token by token -----------------------------------------------------------------------------------


def test_an_integer_schema_allows_digits_then_eos_only_when_whole(arith_tok: PreTrainedTokenizerBase) -> None:
    [c] = constraints(json_grammar(SUM), arith_tok, 1)
    assert allowed(arith_tok, c) == set(DIGITS) - {"0"} | {"0"}  # a number starts with a digit, not with EOS
    feed(arith_tok, c, "1")
    assert allowed(arith_tok, c) == set(DIGITS) | {"<eos>"}  # 1, or 10..19, 100..198 on
    feed(arith_tok, c, "9")
    assert allowed(arith_tok, c) == set(DIGITS) - {"9"} | {"<eos>"}  # 19 or 190..198, not 199
    feed(arith_tok, c, "8")
    assert allowed(arith_tok, c) == {"<eos>"} and c.complete  # 198: the number is whole
    [c] = constraints(json_grammar(SUM), arith_tok, 1)
    feed(arith_tok, c, "0")
    assert allowed(arith_tok, c) == {"<eos>"}  # JSON has no leading zeros


def test_a_format_the_vocabulary_cannot_write_is_not_writable(arith_tok: PreTrainedTokenizerBase) -> None:
    [c] = constraints(json_grammar({"type": "object"}), arith_tok, 1)  # tiny-arith has no "{"
    assert not c.writable(len(arith_tok))
    assert allowed(arith_tok, c) == {"<eos>"} and c.dead and not c.complete


# tiny-calc's JSON: its one token with "{" opens the calculator call whole, and '"}}' closes it
CALL_OBJECT = {
    "type": "object",
    "properties": {
        "name": {"const": "calculator"},
        "arguments": {
            "type": "object",
            "properties": {"expression": {"type": "string", "maxLength": 4}},
            "required": ["expression"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "arguments"],
    "additionalProperties": False,
}


def test_bytes_forced_that_no_token_spells_alone_allow_the_tokens_that_begin_with_them(
    calc_tok: PreTrainedTokenizerBase,
) -> None:
    # The object's "{" and the string's closing quote at maxLength are forced, and tiny-calc has no token for either
    # alone: its encoder writes <unk> for them, which must not become the only token allowed
    head = '{"name": "calculator", "arguments": {"expression": "'
    [c] = constraints(json_grammar(CALL_OBJECT), calc_tok, 1)
    assert c.writable(len(calc_tok)) and allowed(calc_tok, c) == {head}
    feed(calc_tok, c, head, "2", "3")
    # what fits the two characters left, or the close (not ' + ', three; not EOS inside the string)
    assert allowed(calc_tok, c) == set(DIGITS) | {"+", "?", '"}}'}
    feed(calc_tok, c, "+", "5")  # four characters: the string must close
    assert allowed(calc_tok, c) == {'"}}'}
    feed(calc_tok, c, '"}}')
    assert allowed(calc_tok, c) == {"<eos>"} and c.complete


def test_the_matchers_virtual_tokens_are_never_allowed(calc_tok: PreTrainedTokenizerBase) -> None:
    [c] = constraints(json_grammar({"type": "boolean"}), calc_tok, 1)  # "t"/"f": only virtual tokens begin it
    assert not c.writable(len(calc_tok)) and not bool(c.allowed(len(calc_tok) + 8)[len(calc_tok) :].any())


def test_a_forced_call_is_the_call_syntax_then_eos_or_another_call(calc_tok: PreTrainedTokenizerBase) -> None:
    head = '{"name": "calculator", "arguments": {"expression": "'
    for parallel, after in ((True, {"<eos>", "<tool_call>"}), (False, {"<eos>"})):
        [c] = constraints(call_grammar(HermesParser(), [FUNCTION], name=None, parallel=parallel), calc_tok, 1)
        assert allowed(calc_tok, c) == {"<tool_call>"}
        feed(calc_tok, c, "<tool_call>")
        assert allowed(calc_tok, c) == {head}  # the tool's name is the only one: the whole head is forced
        feed(calc_tok, c, head, "2", "+", "3")
        assert "<eos>" not in allowed(calc_tok, c)  # inside the arguments' string: no end yet
        feed(calc_tok, c, '"}}')
        assert allowed(calc_tok, c) == {"</tool_call>"}
        feed(calc_tok, c, "</tool_call>")
        assert allowed(calc_tok, c) == after and c.complete


def test_a_call_that_cannot_be_forced_is_refused() -> None:
    with pytest.raises(ToolChoiceUnsupported, match="Llama3JsonParser"):
        call_grammar(Llama3JsonParser(), [FUNCTION], name=None, parallel=True)
    with pytest.raises(ToolChoiceUnsupported, match="'other'"):
        call_grammar(HermesParser(), [FUNCTION], name="other", parallel=True)
    with pytest.raises(GrammarError):
        json_grammar({"type": "object", "properties": {"a": {"not": {}}}})


def test_tool_choice_none_bans_the_token_that_opens_a_call(calc_tok: PreTrainedTokenizerBase) -> None:
    [c] = constraints(Grammar(banned=call_markers(HermesParser())), calc_tok, 1)
    everything = set(calc_tok.convert_ids_to_tokens(list(range(len(calc_tok)))))
    assert allowed(calc_tok, c) == everything - {"<tool_call>"}


# -- the samplers ---------------------------------------------------------------------------------------------------


def test_the_rollouts_samples_under_a_schema_all_validate(tiny_arith_dir: Path, arith_tok: Any) -> None:
    model = AutoModelForCausalLM.from_pretrained(str(tiny_arith_dir))
    prompts = [arith_tok("What is 57 + 68?", add_special_tokens=False)["input_ids"]] * 64
    ids, mask = left_pad(prompts, arith_tok.pad_token_id)
    eos = arith_tok.eos_token_id
    rollout = generate(
        model,
        ids,
        mask,
        max_new_tokens=5,
        eos_id=eos,
        pad_id=arith_tok.pad_token_id,
        temperature=1.0,
        generator=torch.Generator().manual_seed(0),
        constraint=RowConstraints(json_grammar(SUM), arith_tok, 64),
    )
    assert not bool(rollout.truncated.any())  # every row ended with EOS
    for row, n in zip(rollout.completion_ids.tolist(), rollout.lengths.tolist(), strict=True):
        assert row[n - 1] == eos
        jsonschema.validate(json.loads(arith_tok.decode(row[: n - 1])), SUM)


def test_transformers_generate_with_the_logits_processor_validates(tiny_arith_dir: Path, arith_tok: Any) -> None:
    model = AutoModelForCausalLM.from_pretrained(str(tiny_arith_dir))
    schema = {"type": "integer", "minimum": 100}  # tiny-arith answers 57 + 68 with 15 mostly (the dropped carry)
    prompt = torch.tensor([arith_tok("What is 57 + 68?", add_special_tokens=False)["input_ids"]])
    out = model.generate(
        prompt,
        attention_mask=torch.ones_like(prompt),
        do_sample=True,
        num_return_sequences=16,
        max_new_tokens=6,
        logits_processor=[GrammarLogitsProcessor(json_grammar(schema), arith_tok)],
        pad_token_id=arith_tok.pad_token_id,
        eos_token_id=arith_tok.eos_token_id,
    )
    for row in out[:, prompt.shape[1] :].tolist():
        assert arith_tok.eos_token_id in row  # it ended, whole
        jsonschema.validate(json.loads(arith_tok.decode(row, skip_special_tokens=True)), schema)


def test_a_forced_call_of_a_pydantic_tool_resolves_its_nested_definitions(calc_tok: PreTrainedTokenizerBase) -> None:
    class Point(pydantic.BaseModel):
        x: int

    class Move(pydantic.BaseModel):
        to: Point

    schema = Move.model_json_schema()
    assert "$defs" in schema  # the nested model is a $ref from the parameters' root
    tools = [{"type": "function", "function": {"name": "move", "parameters": schema}}, FUNCTION]
    grammar = call_grammar(HermesParser(), tools, name=None, parallel=False)
    [c] = constraints(grammar, calc_tok, 1)  # compiles: the refs resolve from the wrapper's root
    assert allowed(calc_tok, c) == {"<tool_call>"}


def test_a_rollout_row_whose_grammar_went_dead_is_truncated(tiny_arith_dir: Path, arith_tok: Any) -> None:
    model = AutoModelForCausalLM.from_pretrained(str(tiny_arith_dir))
    ids, mask = left_pad(
        [arith_tok("What is 57 + 68?", add_special_tokens=False)["input_ids"]] * 2, arith_tok.pad_token_id
    )
    eos = arith_tok.eos_token_id
    for schema, dead in (({"type": "object"}, True), (SUM, False)):  # tiny-arith has no "{": only EOS is left
        constraint = RowConstraints(json_grammar(schema), arith_tok, 2)
        rollout = generate(
            model,
            ids,
            mask,
            max_new_tokens=5,
            eos_id=eos,
            pad_id=arith_tok.pad_token_id,
            temperature=0.0,
            constraint=constraint,
        )
        assert not isinstance(rollout, tuple)
        assert constraint.dead().tolist() == [dead, dead]
        assert rollout.truncated.tolist() == [dead, dead]  # ended on EOS, yet cut: the grader's finish is length
        assert all(eos in row for row in rollout.completion_ids.tolist())


def test_the_logits_processor_can_be_reused_across_generate_calls(tiny_arith_dir: Path, arith_tok: Any) -> None:
    model = AutoModelForCausalLM.from_pretrained(str(tiny_arith_dir))
    schema = {"type": "integer", "minimum": 100}
    processor = GrammarLogitsProcessor(json_grammar(schema), arith_tok)
    prompt = torch.tensor([arith_tok("What is 57 + 68?", add_special_tokens=False)["input_ids"]])
    for n in (8, 8, 4):  # the same prompt again, then another batch size: each call starts fresh matchers
        out = model.generate(
            prompt,
            attention_mask=torch.ones_like(prompt),
            do_sample=True,
            num_return_sequences=n,
            max_new_tokens=6,
            logits_processor=[processor],
            pad_token_id=arith_tok.pad_token_id,
            eos_token_id=arith_tok.eos_token_id,
        )
        for row in out[:, prompt.shape[1] :].tolist():
            assert arith_tok.eos_token_id in row
            jsonschema.validate(json.loads(arith_tok.decode(row, skip_special_tokens=True)), schema)


def test_the_logits_processor_leaves_rows_that_ended_alone(arith_tok: Any) -> None:
    processor = GrammarLogitsProcessor(json_grammar(SUM), arith_tok)
    v, eos, pad = len(arith_tok), arith_tok.eos_token_id, arith_tok.pad_token_id
    one, two = arith_tok.convert_tokens_to_ids("1"), arith_tok.convert_tokens_to_ids("2")
    ids = torch.tensor([[one, two], [one, two]])  # the prompts
    for step in ([one, eos], [two, pad]):  # row 1 ends on EOS, then generate pads it
        ids = torch.cat([ids, torch.tensor(step).unsqueeze(-1)], dim=-1)
        out = processor(ids, torch.zeros(2, v))
    assert processor.ended == [False, True]
    assert bool(out[1].isfinite().all())  # an ended row is not masked (nor its matcher fed the pad)
    allowed_0 = {arith_tok.convert_ids_to_tokens(i) for i in out[0].isfinite().nonzero().flatten().tolist()}
    assert allowed_0 == set(DIGITS) | {"<eos>"}  # row 0 wrote 12: 12, or 120..129

"""OpenAI's ``response_format`` as a typed model: plain text, any JSON object, or JSON that a JSON schema admits.

Chat completions take it (``api.schemas_inference``) and reinforcement fine-tuning will (a job's
``method.reinforcement.response_format``): the sampler then writes only what the format admits
(``trainer.generation.constrained``), and graders read the parsed answer as ``sample.output_json``.

A schema is checked here, without the decoder: it must be a valid JSON schema (Draft 2020-12's meta-schema) and use
only the keywords that constrained decoding enforces (:data:`ENFORCED_KEYWORDS`, with the annotations that change
nothing); ``$ref`` must point inside the schema and ``format`` must be one of :data:`FORMATS`. Anything else
(``not``, ``if``/``then``, ``uniqueItems``, ``contains``, remote references...) would be accepted and silently not
enforced, so it is refused, naming where it is. vLLM and OpenAI's strict mode enforce the same subset or a smaller one.
The schema is enforced whether ``strict`` is true or false (as vLLM does). ``strict: true`` also asks for OpenAI's
strict-mode rules, which OpenAI refuses a schema for breaking (:func:`check_strict`): every object lists all its
properties in ``required`` and sets ``additionalProperties: false``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Annotated, Any, Literal

import jsonschema
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    ValidatorFunctionWrapHandler,
    WrapValidator,
    field_validator,
)

from trainer.spec.json_values import refuse_constant

MAX_SCHEMA_CHARS = 100_000  # as JSON text: bounds the grammar compiled from it

ANNOTATIONS = frozenset(
    {
        "$schema",
        "$id",
        "$comment",
        "$anchor",
        "title",
        "description",
        "default",
        "examples",
        "deprecated",
        "readOnly",
        "writeOnly",
        "contentEncoding",
        "contentMediaType",
    }
)
"""Keywords that constrain nothing: accepted and ignored by validators and decoders alike."""

ENFORCED_KEYWORDS = frozenset(
    {
        "type",
        "enum",
        "const",
        "anyOf",
        "oneOf",
        "allOf",
        "$ref",
        "$defs",
        "definitions",
        "properties",
        "required",
        "additionalProperties",
        "patternProperties",
        "minProperties",
        "maxProperties",
        "items",
        "prefixItems",
        "minItems",
        "maxItems",
        "minLength",
        "maxLength",
        "pattern",
        "format",
        "minimum",
        "maximum",
        "exclusiveMinimum",
        "exclusiveMaximum",
        "multipleOf",
    }
)
"""The keywords constrained decoding enforces (llguidance's JSON schema support; tests check it accepts each)."""

FORMATS = frozenset({"date-time", "time", "date", "duration", "email", "hostname", "ipv4", "ipv6", "uuid", "uri"})
"""String formats the decoder enforces (OpenAI's strict mode supports the same, less ``uri``)."""

# Keywords whose value is a schema, a list of schemas or a map of names to schemas.
_ONE_SCHEMA = ("additionalProperties", "items")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")


class SchemaError(ValueError):
    """A schema refused: ``path`` is where in it (``properties.a.not``), '' for the schema itself."""

    def __init__(self, message: str, path: str = "") -> None:
        super().__init__(f"{message} (at {path})" if path else message)
        self.path = path


def _subschemas(node: dict[str, Any], path: str) -> Iterator[tuple[Any, str]]:
    """The schemas directly inside ``node`` with their paths."""
    for key in _ONE_SCHEMA:
        if key in node:
            yield node[key], f"{path}.{key}" if path else key
    for key in _SCHEMA_LISTS:
        for i, sub in enumerate(node.get(key) or []):
            yield sub, f"{path}.{key}.{i}" if path else f"{key}.{i}"
    for key in _SCHEMA_MAPS:
        for name, sub in (node.get(key) or {}).items():
            yield sub, f"{path}.{key}.{name}" if path else f"{key}.{name}"


def _check_enforceable(node: Any, path: str) -> None:
    if isinstance(node, bool):
        return
    assert isinstance(node, dict)  # the meta-schema was checked first: a schema is an object or a boolean
    for key in node:
        if key not in ENFORCED_KEYWORDS and key not in ANNOTATIONS:
            where = f"{path}.{key}" if path else key
            raise SchemaError(f"the keyword {key!r} cannot be enforced by constrained decoding", where)
    ref = node.get("$ref")
    if ref is not None and not ref.startswith("#"):
        raise SchemaError(f"only references inside the schema ('#/...') are supported, not {ref!r}", path)
    fmt = node.get("format")
    if fmt is not None and fmt not in FORMATS:
        raise SchemaError(f"the format {fmt!r} cannot be enforced; supported: {', '.join(sorted(FORMATS))}", path)
    for sub, sub_path in _subschemas(node, path):
        _check_enforceable(sub, sub_path)


def check_schema(schema: Any) -> dict[str, Any]:
    """``schema`` if it is a JSON schema object that constrained decoding can enforce; else :class:`SchemaError`."""
    if not isinstance(schema, dict):
        raise SchemaError("a JSON schema must be an object")
    if len(json.dumps(schema)) > MAX_SCHEMA_CHARS:
        raise SchemaError(f"the schema is longer than {MAX_SCHEMA_CHARS} characters as JSON")
    try:
        jsonschema.Draft202012Validator.check_schema(schema)
    except jsonschema.SchemaError as err:
        raise SchemaError(f"not a valid JSON schema: {err.message}", ".".join(str(p) for p in err.path)) from None
    _check_enforceable(schema, "")
    return schema


def _is_object(node: dict[str, Any]) -> bool:
    kind = node.get("type")
    return kind == "object" or (isinstance(kind, list) and "object" in kind) or "properties" in node


def _check_strict_node(node: Any, path: str) -> None:
    if not isinstance(node, dict):
        return
    if _is_object(node):
        where = f"{path}.additionalProperties" if path else "additionalProperties"
        if node.get("additionalProperties") is not False:
            raise SchemaError("strict mode needs additionalProperties: false on every object", where)
        missing = [name for name in node.get("properties") or {} if name not in (node.get("required") or [])]
        if missing:
            where = f"{path}.required" if path else "required"
            raise SchemaError(f"strict mode needs every property required; missing: {', '.join(missing)}", where)
    for sub, sub_path in _subschemas(node, path):
        _check_strict_node(sub, sub_path)


def check_strict(schema: dict[str, Any]) -> dict[str, Any]:
    """``schema`` (already :func:`check_schema`'s) if it keeps OpenAI's strict-mode rules, which OpenAI answers a
    400 for breaking: every object (``type: object`` or with ``properties``), wherever it is, has
    ``additionalProperties: false`` and lists each of its properties in ``required`` (an optional field is a union
    with null). Else :class:`SchemaError` naming where."""
    _check_strict_node(schema, "")
    return schema


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)


class JsonSchemaSpec(_Strict):
    """``response_format.json_schema``: the schema the answer must satisfy, named as OpenAI names it."""

    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: str | None = None
    # ``strict`` before ``schema``: the schema's validator reads it, so that its errors are located at ``schema``
    strict: bool | None = None
    schema_: dict[str, Any] = Field(alias="schema", description="a JSON schema object")

    @field_validator("schema_")
    @classmethod
    def _enforceable(cls, value: dict[str, Any], info: ValidationInfo) -> dict[str, Any]:
        check_schema(value)
        return check_strict(value) if info.data.get("strict") else value


class TextFormat(_Strict):
    type: Literal["text"]


class JsonObjectFormat(_Strict):
    """Any JSON object (OpenAI's JSON mode)."""

    type: Literal["json_object"]


class JsonSchemaFormat(_Strict):
    type: Literal["json_schema"]
    json_schema: JsonSchemaSpec


Format = TextFormat | JsonObjectFormat | JsonSchemaFormat

ANY_OBJECT: dict[str, Any] = {"type": "object"}
_FORMATS: dict[str, type[Format]] = {
    "text": TextFormat,
    "json_object": JsonObjectFormat,
    "json_schema": JsonSchemaFormat,
}


def parse_response_format(value: Any) -> Format:
    """A response format from its JSON, dispatched on ``type`` by hand: a validation error is located inside the
    format (``json_schema.schema``), not under the name of the union's branch."""
    if isinstance(value, TextFormat | JsonObjectFormat | JsonSchemaFormat):
        return value
    kind = value.get("type") if isinstance(value, dict) else None
    model = _FORMATS.get(kind) if isinstance(kind, str) else None
    if model is None:
        raise ValueError(f"response_format.type must be one of {', '.join(_FORMATS)}")
    return model.model_validate(value)


def _validated(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
    return None if value is None else parse_response_format(value)


ResponseFormat = Annotated[Format | None, WrapValidator(_validated)]
"""A field's type: a response format or None (``response_format: ResponseFormat = None``), its errors located
inside the format (``response_format.json_schema.schema``)."""


def json_schema_of(fmt: Format | None) -> dict[str, Any] | None:
    """The schema an answer in ``fmt`` satisfies: None for plain text, any object for ``json_object``."""
    if isinstance(fmt, JsonSchemaFormat):
        return fmt.json_schema.schema_
    if isinstance(fmt, JsonObjectFormat):
        return ANY_OBJECT
    return None


def parsed_output(fmt: Format | None, text: str) -> Any:
    """The answer as JSON when ``fmt`` asks for JSON (what graders read as ``sample.output_json``); None for plain
    text or an answer that does not parse (cut short by its token budget)."""
    if json_schema_of(fmt) is None:
        return None
    try:
        return json.loads(text, parse_constant=refuse_constant)
    except (ValueError, RecursionError):  # JsonValueError (NaN, Infinity) is a ValueError; nested too deep
        return None

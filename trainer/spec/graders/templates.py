"""Templates: strings with `{{sample.<field>}}` and `{{item.<path>}}` references, parsed in linear time and checked
where a grader arrives; rendering them is `trainer.grading.graders.render`'s."""

import functools
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, StringConstraints

from trainer.spec.graders.limits import MAX_TEMPLATE_CHARS


@dataclass(frozen=True)
class Ref:
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
SAMPLE_FIELDS = ("output_text", "output_json", "output_tools")
"""What `{{sample.<field>}}` may name; `output_json` also takes a path into it (`{{sample.output_json.answer}}`)."""


@functools.lru_cache(maxsize=256)  # keys are at most MAX_TEMPLATE_CHARS long: the cache holds a few MB at most
def parse_template(template: str) -> tuple[str | Ref, ...]:
    r"""Split a template into literal text and references; ValueError names a bad reference.

    A reference runs from a `{{` to the first `}}` after it, and the next one starts after that `}}` (what the
    regular expression `\{\{(.*?)\}\}` finds), found with two `str.find` scans that never go back: linear time.
    With no `}}` after a `{{`, the rest of the template is literal text."""
    if len(template) > MAX_TEMPLATE_CHARS:
        raise ValueError(f"longer than {MAX_TEMPLATE_CHARS} characters")
    parts: list[str | Ref] = []
    end = 0
    while (start := template.find("{{", end)) != -1 and (close := template.find("}}", start + 2)) != -1:
        if start > end:
            parts.append(template[end:start])
        parts.append(_parse_ref(template[start + 2 : close].strip(), template[start : close + 2]))
        end = close + 2
    if end < len(template):
        parts.append(template[end:])
    return tuple(parts)


def _parse_ref(inner: str, raw: str) -> Ref:
    namespace, _, rest = inner.partition(".")
    path = tuple(rest.split(".")) if rest else ()
    if namespace not in ("sample", "item"):
        raise ValueError(f"unknown namespace {namespace!r} in {raw}; only 'sample' and 'item' exist")
    if not path or not all(_PATH_SEGMENT_RE.fullmatch(segment) for segment in path):
        raise ValueError(f"invalid reference {raw}; expected {{{{{namespace}.<field>}}}}")
    if namespace == "sample":
        if path[0] == "output_json":
            return Ref("sample", path)
        if len(path) != 1 or path[0] not in SAMPLE_FIELDS:
            valid = ", ".join("{{sample." + f + "}}" for f in SAMPLE_FIELDS)
            raise ValueError(f"unsupported sample field in {raw}; supported: {valid}")
        return Ref("sample", path)
    return Ref("item", path)


def validate_template(value: str) -> str:
    parse_template(value)
    return value


Template = Annotated[str, StringConstraints(max_length=MAX_TEMPLATE_CHARS), AfterValidator(validate_template)]
"""A string that may contain `{{sample.output_text}}`, `{{sample.output_json}}` (the output parsed as JSON, or a path
into it: `{{sample.output_json.answer}}`; what structured outputs guarantee), `{{sample.output_tools}}` (an agent
episode's tool calls as JSON) and `{{item.<path>}}`; at most MAX_TEMPLATE_CHARS long."""


def lookup(item: Mapping[str, Any], path: tuple[str, ...]) -> tuple[bool, Any]:
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


def missing_field_message(grader_name: str, ref: Ref) -> str:
    return f"grader {grader_name!r} references {ref.text} but the item has no field {ref.dotted!r}"

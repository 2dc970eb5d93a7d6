"""Tool calls in a model's own syntax: parsing a generated turn into calls, and the tokens the chat
template inserts after them.

A model writes tool calls the way its chat template taught it, and each family has its own syntax:

- Hermes / Qwen (the default): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, several per turn.
- Llama 3.1+: the turn is a JSON object ``{"name": ..., "parameters": {...}}`` (optionally after ``<|python_tag|>``,
  several separated by ``;``).
- Mistral: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]``, or the v11 tokenizer's
  ``[TOOL_CALLS]name[ARGS]{...}``.
- Any tokenizer that declares a ``response_template`` (transformers 5.x declarative response parsing): transformers'
  own ``parse_response``.

:func:`parser_for` picks one per tokenizer. A turn that tries to call a tool and fails to (a ``<tool_call>`` whose
body is not a JSON object, a call without a name, arguments that are not a JSON object) is a
:class:`ToolCallFormatError`: the episode runner ends the episode there and counts a format error. Arguments are kept
as the JSON text the model wrote (the tool server receives them verbatim, as OpenAI's ``function_call.arguments``);
only transformers' parser, which decodes them itself, has them re-serialised.

:func:`environment_segment` gives the token ids the chat template puts between the end of a generated assistant turn
and the next generated content (the tool messages and the generation prompt), rendered as a text delta and tokenised
alone, so that an episode's transcript is never re-tokenised: the policy's tokens stay exactly as sampled.
"""

from __future__ import annotations

import json
import re
import secrets
import string
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from jinja2 import TemplateError
from transformers import PreTrainedTokenizerBase

from trainer.generation.constrained import Grammar, lark_grammar
from trainer.spec.json_values import refuse_constant


class ToolCallFormatError(ValueError):
    """A turn that tries to call a tool but whose call does not parse."""


@dataclass(frozen=True)
class ToolCall:
    """One call: ``id`` (``call_<hex>``, generated: models do not write ids), the tool's ``name`` and its
    ``arguments`` as JSON text (always a JSON object)."""

    id: str
    name: str
    arguments: str

    def chat_completions(self) -> dict[str, Any]:
        """The call as chat completions' ``tool_calls`` entry (and OpenAI's ``sample.output_tools``)."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class ParsedTurn:
    """A generated turn: its text besides the calls (the whole text when it makes none) and its calls in order."""

    content: str
    calls: list[ToolCall] = field(default_factory=list)


class ToolCallParser(Protocol):
    """Parses one generated assistant turn (decoded with its special tokens, without its end-of-turn token)."""

    def parse(self, text: str) -> ParsedTurn:
        """The turn's content and calls; raises :class:`ToolCallFormatError` for a call that does not parse."""
        ...


def new_call_id() -> str:
    """``call_`` and 24 hex digits, the shape of OpenAI's call ids."""
    return "call_" + secrets.token_hex(12)


# --- JSON with the raw text of each member ----------------------------------------------------------------------

_WS = re.compile(r"[ \t\n\r]*")


_DECODER = json.JSONDecoder(parse_constant=refuse_constant)


def _skip_ws(s: str, i: int) -> int:
    m = _WS.match(s, i)
    assert m is not None  # the pattern matches the empty string
    return m.end()


def _scan_value(s: str, i: int) -> tuple[Any, int]:
    """One JSON value starting at ``s[i]`` → (value, end). Raises ToolCallFormatError."""
    try:
        return _DECODER.raw_decode(s, i)
    except ValueError as err:  # json.JSONDecodeError, and NaN/Infinity
        raise ToolCallFormatError(f"invalid JSON: {err}") from None


def _scan_object(s: str, i: int) -> tuple[dict[str, tuple[Any, str]], int]:
    """A JSON object starting at ``s[i]`` (whitespace skipped) → ({key: (value, raw text)}, end), so that a member
    can be passed on exactly as written. A repeated key keeps its last value, as ``json.loads`` does."""
    i = _skip_ws(s, i)
    if not s.startswith("{", i):
        raise ToolCallFormatError(f"expected a JSON object at {s[i : i + 20]!r}")
    members: dict[str, tuple[Any, str]] = {}
    i = _skip_ws(s, i + 1)
    if s.startswith("}", i):
        return members, i + 1
    while True:
        if not s.startswith('"', i):
            raise ToolCallFormatError(f"expected a member name at {s[i : i + 20]!r}")
        key, i = _scan_value(s, i)
        i = _skip_ws(s, i)
        if not s.startswith(":", i):
            raise ToolCallFormatError(f"expected ':' after {key!r}")
        start = _skip_ws(s, i + 1)
        value, i = _scan_value(s, start)
        members[key] = (value, s[start:i])
        i = _skip_ws(s, i)
        if s.startswith("}", i):
            return members, i + 1
        if not s.startswith(",", i):
            raise ToolCallFormatError(f"expected ',' or '}}' at {s[i : i + 20]!r}")
        i = _skip_ws(s, i + 1)


def _whole_object(text: str) -> dict[str, tuple[Any, str]]:
    """``text`` is exactly one JSON object (whitespace around it allowed)."""
    members, end = _scan_object(text, 0)
    if _skip_ws(text, end) != len(text):
        raise ToolCallFormatError(f"unexpected text after the JSON object: {text[end : end + 20]!r}")
    return members


def _call(
    members: Mapping[str, tuple[Any, str]], *, argument_keys: Sequence[str], make_id: Callable[[], str]
) -> ToolCall:
    """A call from a JSON object's members: a non-empty string ``name`` and an object under the first of
    ``argument_keys`` present (none present: no arguments, ``{}``)."""
    name = members.get("name", (None, ""))[0]
    if not isinstance(name, str) or not name.strip():
        raise ToolCallFormatError("a tool call needs a non-empty string 'name'")
    raw = "{}"
    for key in argument_keys:
        if key in members:
            value, raw = members[key]
            if not isinstance(value, dict):
                raise ToolCallFormatError(f"the arguments of {name!r} are not a JSON object")
            break
    return ToolCall(id=make_id(), name=name.strip(), arguments=raw)


# --- the parsers ------------------------------------------------------------------------------------------------


class HermesParser:
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks (Hermes, Qwen 2.5/3, and this project's
    tiny models), any number per turn. The content is the text outside the blocks. The last block may lack its
    closing tag (the turn's end closes it), as models trained on this syntax sometimes stop there."""

    open_tag = "<tool_call>"
    close_tag = "</tool_call>"

    def parse(self, text: str) -> ParsedTurn:
        if self.open_tag not in text and self.close_tag not in text:
            return ParsedTurn(text)
        outside: list[str] = []
        calls: list[ToolCall] = []
        pos = 0
        while pos < len(text):
            start = text.find(self.open_tag, pos)
            outside.append(text[pos : start if start >= 0 else len(text)])
            if start < 0:
                break
            body_start = start + len(self.open_tag)
            end = text.find(self.close_tag, body_start)
            body = text[body_start : end if end >= 0 else len(text)]
            calls.append(_call(_whole_object(body), argument_keys=("arguments",), make_id=new_call_id))
            pos = end + len(self.close_tag) if end >= 0 else len(text)
        if any(self.close_tag in part for part in outside):
            raise ToolCallFormatError(f"{self.close_tag} without {self.open_tag}")
        return ParsedTurn("".join(outside).strip(), calls)


_LLAMA_CALL_START = re.compile(r'\s*\{\s*"name"\s*:')


class Llama3JsonParser:
    """Llama 3.1+'s JSON tool calls: the turn is ``{"name": ..., "parameters": {...}}`` (``arguments`` accepted
    too), several separated by ``;``, optionally after ``<|python_tag|>`` (text before the tag is content). A turn
    is a call when it has the tag or opens with ``{"name":``; any other text, a JSON answer included, is content."""

    python_tag = "<|python_tag|>"

    def parse(self, text: str) -> ParsedTurn:
        tag = text.find(self.python_tag)
        if tag >= 0:
            content, body = text[:tag].strip(), text[tag + len(self.python_tag) :]
        elif _LLAMA_CALL_START.match(text):
            content, body = "", text
        else:
            return ParsedTurn(text)
        calls: list[ToolCall] = []
        i = 0
        while True:
            members, i = _scan_object(body, i)
            calls.append(_call(members, argument_keys=("parameters", "arguments"), make_id=new_call_id))
            i = _skip_ws(body, i)
            if i == len(body):
                return ParsedTurn(content, calls)
            if not body.startswith(";", i):
                raise ToolCallFormatError(f"unexpected text after a tool call: {body[i : i + 20]!r}")
            i += 1


_MISTRAL_ID_ALPHABET = string.ascii_letters + string.digits


def new_mistral_call_id() -> str:
    """Nine letters and digits: Mistral's chat templates refuse any other tool-call id."""
    return "".join(secrets.choice(_MISTRAL_ID_ALPHABET) for _ in range(9))


class MistralParser:
    """Mistral's ``[TOOL_CALLS]``: a JSON list ``[{"name", "arguments"}, ...]`` (tokenizers up to v7), or
    ``name[ARGS]{...}`` after each ``[TOOL_CALLS]`` (v11+, where ``[CALL_ID]id`` may follow the name). Text before
    the first ``[TOOL_CALLS]`` is content. Ids are generated in Mistral's shape (its templates refuse others)."""

    marker = "[TOOL_CALLS]"
    args_marker = "[ARGS]"
    id_marker = "[CALL_ID]"

    def parse(self, text: str) -> ParsedTurn:
        first = text.find(self.marker)
        if first < 0:
            return ParsedTurn(text)
        content, rest = text[:first].strip(), text[first + len(self.marker) :]
        if rest.lstrip().startswith("["):
            return ParsedTurn(content, self._json_list(rest))
        calls: list[ToolCall] = []
        for chunk in rest.split(self.marker):
            head, sep, args = chunk.partition(self.args_marker)
            if not sep:
                raise ToolCallFormatError(f"{self.marker} without {self.args_marker}")
            name = head.partition(self.id_marker)[0]
            start = _skip_ws(args, 0)
            value, end = _scan_value(args, start)
            if _skip_ws(args, end) != len(args):
                raise ToolCallFormatError(f"unexpected text after the arguments of {name.strip()!r}")
            members = {"name": (name, ""), "arguments": (value, args[start:end])}
            calls.append(_call(members, argument_keys=("arguments",), make_id=new_mistral_call_id))
        return ParsedTurn(content, calls)

    def _json_list(self, rest: str) -> list[ToolCall]:
        i = _skip_ws(rest, 0) + 1  # past "["
        calls: list[ToolCall] = []
        while True:
            members, i = _scan_object(rest, i)
            calls.append(_call(members, argument_keys=("arguments",), make_id=new_mistral_call_id))
            i = _skip_ws(rest, i)
            if rest.startswith("]", i):
                if _skip_ws(rest, i + 1) != len(rest):
                    raise ToolCallFormatError(f"unexpected text after {self.marker}[...]")
                return calls
            if not rest.startswith(",", i):
                raise ToolCallFormatError(f"expected ',' or ']' in {self.marker}[...]")
            i += 1


class ResponseTemplateParser:
    """transformers' declarative response parsing (``tokenizer.parse_response`` with the tokenizer's
    ``response_template``), for tokenizers that ship one. Its ``tool_calls`` entries are
    ``{"type": "function", "function": {"name", "arguments"}}``. It decodes the arguments itself, so an object is
    re-serialised here (``json.dumps``, non-ASCII kept as written); arguments left as text must hold an object."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer

    def parse(self, text: str) -> ParsedTurn:
        try:
            # prefix="": the text is the model's output alone, already cut at the start of its turn.
            message = self.tokenizer.parse_response(text, prefix="")
        except (ValueError, KeyError) as err:  # a region that is not valid JSON, a transform that does not apply
            raise ToolCallFormatError(f"the response does not parse: {err}") from None
        raw_calls = message.get("tool_calls") or []
        if not isinstance(raw_calls, list):
            raise ToolCallFormatError("the parsed tool_calls are not a list")
        calls: list[ToolCall] = []
        for entry in raw_calls:
            fn = entry.get("function", entry) if isinstance(entry, dict) else None
            if not isinstance(fn, dict):
                raise ToolCallFormatError("a parsed tool call is not an object")
            members: dict[str, tuple[Any, str]] = {"name": (fn.get("name"), "")}
            arguments = fn.get("arguments", {})
            if isinstance(arguments, str):
                _whole_object(arguments)  # raises unless the text is exactly one JSON object
                members["arguments"] = ({}, arguments.strip())
            else:
                members["arguments"] = (arguments, json.dumps(arguments, ensure_ascii=False))
            calls.append(_call(members, argument_keys=("arguments",), make_id=new_call_id))
        content = message.get("content")
        return ParsedTurn(content if isinstance(content, str) else "", calls)


PARSERS: dict[str, Callable[[], ToolCallParser]] = {
    "hermes": HermesParser,
    "llama3_json": Llama3JsonParser,
    "mistral": MistralParser,
}
"""The syntax parsers by name (transformers' response parsing needs its tokenizer: :class:`ResponseTemplateParser`)."""


def template_source(tokenizer: PreTrainedTokenizerBase) -> str:
    """The tokenizer's chat template source ('' without one; a dict of named templates joined)."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        return "\n".join(str(t) for t in template.values())
    return template if isinstance(template, str) else ""


def parser_for(tokenizer: PreTrainedTokenizerBase) -> ToolCallParser:
    """The parser for this tokenizer's model family.

    transformers' own response parsing when the tokenizer ships a ``response_template`` (transformers 5.x; the
    earlier ``response_schema`` format is dropped by transformers itself when a tokenizer is loaded); else by the
    markers of the chat template: ``[TOOL_CALLS]`` → Mistral, ``<tool_call>`` → Hermes, ``<|python_tag|>`` or a
    Llama-3 header template that writes ``"parameters"`` → Llama 3 JSON; Hermes when none is found (the syntax most
    open models are trained on, and this project's tiny models)."""
    if getattr(tokenizer, "response_template", None) is not None and callable(
        getattr(tokenizer, "parse_response", None)
    ):
        return ResponseTemplateParser(tokenizer)
    source = template_source(tokenizer)
    if "[TOOL_CALLS]" in source:
        return MistralParser()
    if "<tool_call>" in source:
        return HermesParser()
    if "<|python_tag|>" in source or ('"parameters"' in source and "<|start_header_id|>" in source):
        return Llama3JsonParser()
    return HermesParser()


# --- constraining the calls -------------------------------------------------------------------------------------


class ToolChoiceUnsupported(ValueError):
    """A ``tool_choice`` that cannot be enforced in this model family's syntax."""


_CALL_WS = "/[ \\t\\n]*/"


def _call_schema(tool: Mapping[str, Any], k: int, defs: dict[str, Any]) -> dict[str, Any]:
    """A Hermes call's JSON object for one function tool: its name, then arguments its parameters admit. The
    parameters' definitions (``$defs``, ``definitions``) move into ``defs``, the wrapper's root ones, renamed for
    tool ``k``: nested under ``arguments`` their ``$ref`` pointers from the root would no longer resolve."""
    fn = tool.get("function", tool)
    parameters = _hoisted(dict(fn.get("parameters") or {"type": "object"}), f"tool{k}_", defs)
    return {
        "type": "object",
        "properties": {"name": {"const": fn["name"]}, "arguments": parameters},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def _hoisted(schema: dict[str, Any], prefix: str, defs: dict[str, Any]) -> dict[str, Any]:
    """``schema`` without its root definitions, which go into ``defs`` as ``prefix`` + name, every ``$ref`` to one
    rewritten to ``#/$defs/<prefix><name>``."""
    renames: dict[str, str] = {}
    local: dict[str, Any] = {}
    for key in ("$defs", "definitions"):
        for name, sub in (schema.pop(key, None) or {}).items():
            renames[f"#/{key}/{name}"] = f"#/$defs/{prefix}{name}"
            local[f"{prefix}{name}"] = sub

    def rewrite(node: Any) -> Any:
        if isinstance(node, dict):
            out = {k: rewrite(v) for k, v in node.items()}
            ref = out.get("$ref")
            if isinstance(ref, str):
                head = next((r for r in renames if ref == r or ref.startswith(r + "/")), None)
                if head is not None:
                    out["$ref"] = renames[head] + ref[len(head) :]
            return out
        if isinstance(node, list):
            return [rewrite(v) for v in node]
        return node

    defs.update({name: rewrite(sub) for name, sub in local.items()})
    rewritten: dict[str, Any] = rewrite(schema)
    return rewritten


def call_grammar(
    parser: ToolCallParser, tools: Sequence[Mapping[str, Any]], *, name: str | None, parallel: bool
) -> Grammar:
    """The turn when a call is required: one call (``parallel`` false) or several, of the tool ``name`` (None: any
    of ``tools``), in the parser's syntax and nothing else. Only the Hermes syntax is supported
    (:class:`ToolChoiceUnsupported` otherwise): its calls are self-delimited blocks that a grammar can require."""
    if not isinstance(parser, HermesParser):
        raise ToolChoiceUnsupported(f"forcing a tool call is not supported in the {type(parser).__name__} syntax")
    chosen = [t for t in tools if name is None or t.get("function", t).get("name") == name]
    if not chosen:
        raise ToolChoiceUnsupported(f"no tool is named {name!r}")
    defs: dict[str, Any] = {}
    wrapper: dict[str, Any] = {"anyOf": [_call_schema(t, k, defs) for k, t in enumerate(chosen)]}
    if defs:
        wrapper["$defs"] = defs
    schema = json.dumps(wrapper)
    call = f'"{parser.open_tag}" {_CALL_WS} %json {schema} {_CALL_WS} "{parser.close_tag}"'
    start = f"call ({_CALL_WS} call)*" if parallel else "call"
    return lark_grammar(f"start: {start}\ncall: {call}\n")


def call_markers(parser: ToolCallParser) -> tuple[str, ...]:
    """The text that opens a call in the parser's syntax (banned to forbid calls: ``tool_choice: none``); none for
    syntaxes without one (Llama's bare JSON calls, transformers' response templates)."""
    if isinstance(parser, HermesParser):
        return (parser.open_tag,)
    if isinstance(parser, MistralParser):
        return (parser.marker,)
    if isinstance(parser, Llama3JsonParser):
        return (parser.python_tag,)
    return ()


# --- the environment's tokens -----------------------------------------------------------------------------------

_PLACEHOLDER_USER = "Proxima placeholder question 5f2d"
_PLACEHOLDER_TURN = "Proxima placeholder answer 9c41"


def environment_segment(
    tokenizer: PreTrainedTokenizerBase,
    tool_messages: Sequence[Mapping[str, Any]],
    *,
    template_kwargs: Mapping[str, Any] | None = None,
    turn_end: str | None = None,
) -> list[int]:
    """The token ids the chat template puts after a generated assistant turn: the tool messages and the generation
    prompt of the next turn, tokenised alone (``add_special_tokens=False``).

    Rendered as a delta around a fixed placeholder conversation (a user turn, an assistant turn): the text after
    the placeholder answer with ``tool_messages`` and the generation prompt, less the text after it without them
    (the assistant turn's end, e.g. ``<|im_end|>\\n``). Of that turn end, the part up to and including
    ``turn_end`` (the text of the token that ended the generated turn; by default the tokenizer's EOS) was
    generated by the model; the rest (ChatML's ``\\n``) is the environment's and starts the segment. Comparing
    only what follows the placeholder keeps templates that render a last assistant turn differently (Qwen 3's empty
    ``<think>`` block) out of the delta.

    The placeholder assistant turn is rendered without tool calls; a template that refuses tool messages after such
    a turn (``raise_exception``) gets it with one call per tool message. Raises ``ValueError`` when the template
    does not render the assistant turn the same way whether or not tool messages follow it."""
    if not template_source(tokenizer):
        # No chat template: a conversation is its contents joined by newlines (trainer.generation.encoding.prompt_text).
        text = "".join("\n" + str(m.get("content", "")) for m in tool_messages)
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
    end_text = turn_end if turn_end is not None else tokenizer.eos_token
    kwargs = dict(template_kwargs or {})
    base: list[dict[str, Any]] = [{"role": "user", "content": _PLACEHOLDER_USER}]
    assistant: dict[str, Any] = {"role": "assistant", "content": _PLACEHOLDER_TURN}
    try:
        turn_suffix, after = _after_turn(tokenizer, [*base, assistant], tool_messages, kwargs)
    except TemplateError:
        calls = [
            {
                "id": m.get("tool_call_id", ""),
                "type": "function",
                "function": {"name": m.get("name", "tool"), "arguments": {}},
            }
            for m in tool_messages
        ]
        turn_suffix, after = _after_turn(tokenizer, [*base, assistant | {"tool_calls": calls}], tool_messages, kwargs)
    cut = turn_suffix.rfind(end_text) + len(end_text) if end_text and end_text in turn_suffix else 0
    return list(tokenizer(after[cut:], add_special_tokens=False)["input_ids"])


def _after_turn(
    tokenizer: PreTrainedTokenizerBase,
    conversation: Sequence[Mapping[str, Any]],
    tool_messages: Sequence[Mapping[str, Any]],
    kwargs: dict[str, Any],
) -> tuple[str, str]:
    """What the template writes after the placeholder answer: (when it is the last message, when the tool messages
    and the generation prompt follow it); the first is a prefix of the second."""
    closed = _text_after_placeholder(tokenizer, conversation, kwargs, add_generation_prompt=False)
    extended = _text_after_placeholder(tokenizer, [*conversation, *tool_messages], kwargs, add_generation_prompt=True)
    if not extended.startswith(closed):
        raise ValueError(
            "the chat template ends an assistant turn differently when tool messages follow it "
            f"({closed!r}, then {extended[: len(closed) + 20]!r}); cannot compute the environment's tokens"
        )
    return closed, extended


def _text_after_placeholder(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[Mapping[str, Any]],
    kwargs: dict[str, Any],
    *,
    add_generation_prompt: bool,
) -> str:
    text = tokenizer.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, tokenize=False, **kwargs
    )
    assert isinstance(text, str)
    at = text.rfind(_PLACEHOLDER_TURN)
    if at < 0:
        raise ValueError("the chat template does not render the assistant turn's content")
    return text[at + len(_PLACEHOLDER_TURN) :]

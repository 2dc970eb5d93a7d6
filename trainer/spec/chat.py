"""OpenAI chat conversations with tools, as the supervised and DPO datasets carry them, checked strictly.

A conversation is a list of messages in chat completions' shape (``openai.types.chat``'s message params):

- ``system``, ``developer``, ``user``: ``content`` (a string or a list of text parts), optional ``name``;
- ``assistant``: ``content`` (a string, text parts, or null when the turn calls tools), optional ``name`` and
  ``tool_calls`` ``[{"id", "type": "function", "function": {"name", "arguments"}}]`` whose ``arguments`` is the JSON
  text of an object; a supervised line's assistant messages may carry ``weight`` 0 or 1;
- ``tool``: ``content`` and ``tool_call_id``, which must answer a call of an earlier assistant message.

The line's ``tools`` are OpenAI's function tools ``[{"type": "function", "function": {"name", "description",
"parameters", "strict"}}]``; ``parallel_tool_calls: false`` allows at most one call per assistant turn.

Everything is kept; what cannot be trained on (an image or audio part, a refusal, the deprecated ``function_call``)
and every unknown field is a ``ValueError`` naming the field. A message comes out normalised: text parts joined into
one string (in order, with nothing between them), every other field as given. Torch-free: the API and the worker's
validation use it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from trainer.spec import json_values
from trainer.spec.agent_spec import MAX_TOOLS, TOOL_NAME_PATTERN

CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
_NAME = re.compile(TOOL_NAME_PATTERN)
# The fields of each role's message (openai.types.chat.ChatCompletion*MessageParam) that a dataset may hold.
_FIELDS = {
    "system": {"role", "content", "name"},
    "developer": {"role", "content", "name"},
    "user": {"role", "content", "name"},
    "assistant": {"role", "content", "name", "tool_calls"},
    "tool": {"role", "content", "tool_call_id"},
}
# Fields OpenAI's message params have that a training example cannot honour, and why.
_REFUSED = {
    "function_call": "is deprecated and not supported: use 'tool_calls'",
    "refusal": "is not supported: put the refusal text in 'content'",
    "audio": "is not supported: only text can be trained on",
}
_FUNCTION_KEYS = {"name", "description", "parameters", "strict"}

Message = dict[str, Any]


@dataclass(frozen=True)
class ToolsContext:
    """What a line's ``tools`` and ``parallel_tool_calls`` allow its messages: the function names (None: no
    ``tools``, any name) and whether a turn may make more than one call."""

    names: frozenset[str] | None = None
    parallel: bool = True
    parallel_key: str = "parallel_tool_calls"


def _unknown(m: Mapping[str, Any], allowed: set[str], where: str, what: str) -> None:
    for key in m:
        if key in allowed:
            continue
        if key in _REFUSED:
            raise ValueError(f"{where}.{key} {_REFUSED[key]}")
        raise ValueError(f"{where}.{key} is not a field of {what} (allowed: {', '.join(sorted(allowed))})")


def text_content(value: Any, where: str) -> str:
    """A message's content: a string, or a non-empty list of ``{"type": "text", "text": ...}`` parts (joined)."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list) or not value:
        raise ValueError(f"{where} must be a string or a non-empty list of text parts")
    texts = []
    for j, part in enumerate(value):
        at = f"{where}[{j}]"
        if not isinstance(part, dict):
            raise ValueError(f"{at} must be an object {{'type': 'text', 'text': ...}}")
        if part.get("type") != "text":
            raise ValueError(f"{at}.type {part.get('type')!r} is not supported: only 'text' parts can be trained on")
        for key in part:
            if key not in ("type", "text"):
                raise ValueError(f"{at}.{key} is not a field of a text part (allowed: text, type)")
        if not isinstance(part.get("text"), str):
            raise ValueError(f"{at}.text must be a string")
        texts.append(part["text"])
    return "".join(texts)


def _tool_call(value: Any, where: str, ctx: ToolsContext) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ValueError(f"{where} must be an object {{'id', 'type': 'function', 'function'}}")
    _unknown(value, {"id", "type", "function"}, where, "a tool call")
    if not isinstance(value.get("id"), str) or not value["id"]:
        raise ValueError(f"{where}.id must be a non-empty string")
    if value.get("type") != "function":
        raise ValueError(f"{where}.type must be 'function'")
    fn = value.get("function")
    if not isinstance(fn, dict):
        raise ValueError(f"{where}.function must be an object {{'name', 'arguments'}}")
    _unknown(fn, {"name", "arguments"}, f"{where}.function", "a tool call's function")
    name, arguments = fn.get("name"), fn.get("arguments")
    if not isinstance(name, str) or not _NAME.match(name):
        raise ValueError(f"{where}.function.name must be 1 to 64 letters, digits, '_' or '-'")
    if ctx.names is not None and name not in ctx.names:
        raise ValueError(
            f"{where}.function.name {name!r} is not one of the line's tools ({', '.join(sorted(ctx.names))})"
        )
    if not isinstance(arguments, str):
        raise ValueError(f"{where}.function.arguments must be a string holding a JSON object")
    try:
        decoded = json_values.loads(arguments)
    except json_values.JsonValueError as err:
        raise ValueError(f"{where}.function.arguments is not JSON: {err}") from None
    if not isinstance(decoded, dict):
        raise ValueError(f"{where}.function.arguments must be a JSON object, not {type(decoded).__name__}")
    return {"id": value["id"], "type": "function", "function": {"name": name, "arguments": arguments}}


def _assistant(m: Mapping[str, Any], where: str, ctx: ToolsContext, out: Message) -> None:
    """The assistant-only fields of ``m`` into ``out``: its calls, and its content (null only beside calls)."""
    calls = m.get("tool_calls")
    if calls is not None:
        if not isinstance(calls, list) or not calls:
            raise ValueError(f"{where}.tool_calls must be a non-empty list of tool calls")
        if len(calls) > 1 and not ctx.parallel:
            raise ValueError(f"{where}.tool_calls holds {len(calls)} calls but {ctx.parallel_key} is false")
        out["tool_calls"] = [_tool_call(c, f"{where}.tool_calls[{j}]", ctx) for j, c in enumerate(calls)]
    content = m.get("content")
    if content is None:
        if calls is None:
            raise ValueError(f"{where}.content must be a string unless the message has tool_calls")
        out["content"] = None
    else:
        out["content"] = text_content(content, f"{where}.content")


def chat_message(m: Any, where: str, ctx: ToolsContext, *, extra: frozenset[str] = frozenset()) -> Message:
    """One message checked and normalised; ``extra``: more fields the caller reads itself (e.g. ``weight``)."""
    if not isinstance(m, dict):
        raise ValueError(f"{where} must be an object with 'role' and 'content'")
    role = m.get("role")
    if role not in CHAT_ROLES:
        raise ValueError(f"{where}.role must be one of {', '.join(CHAT_ROLES)}")
    article = "an" if role == "assistant" else "a"
    _unknown(m, _FIELDS[role] | (extra if role == "assistant" else set()), where, f"{article} {role} message")
    out: Message = {"role": role}
    if role == "assistant":
        _assistant(m, where, ctx, out)
    else:
        out["content"] = text_content(m.get("content"), f"{where}.content")
    if "name" in m:
        if not isinstance(m["name"], str) or not m["name"]:
            raise ValueError(f"{where}.name must be a non-empty string")
        out["name"] = m["name"]
    if role == "tool":
        if not isinstance(m.get("tool_call_id"), str) or not m["tool_call_id"]:
            raise ValueError(f"{where}.tool_call_id must be a non-empty string")
        out["tool_call_id"] = m["tool_call_id"]
    return out


# Where a fine-tuning line of any method holds messages: supervised and RL lines' `messages`, OpenAI's DPO `input`
# and outputs, TRL's `prompt`, `chosen` and `rejected` when they are lists.
_MESSAGE_LISTS = (
    ("messages",),
    ("input", "messages"),
    ("preferred_output",),
    ("non_preferred_output",),
    ("prompt",),
    ("chosen",),
    ("rejected",),
)


def check_line_messages(obj: Mapping[str, Any]) -> None:
    """Every message of a fine-tuning line is one this module keeps whole, whatever the job's method: an upload does
    not know it, and what no method can honour (an unknown field, an image part, a ``refusal``, arguments that are
    not a JSON object) is refused there rather than when a job reads the file. The line's ``tools`` are left to the
    method's parser (an RL line names the job's tools in the job's shape)."""
    for path in _MESSAGE_LISTS:
        value: Any = obj
        for key in path:
            value = value.get(key) if isinstance(value, dict) else None
        if isinstance(value, list):
            label = ".".join(path)
            for i, m in enumerate(value):
                chat_message(m, f"{label}[{i}]", ToolsContext(), extra=frozenset({"weight"}))


def check_call_ids(messages: Sequence[Message], key: str, *, pending: dict[str, int] | None = None) -> dict[str, int]:
    """Every tool message answers a call of an earlier assistant message that no tool message answered yet, and an
    assistant turn's calls are all answered before the next non-tool message; call ids are unique. Returns the calls
    still unanswered at the end (id → message index), which only a conversation's last turn may leave."""
    pending = dict(pending or {})
    seen: set[str] = set(pending)
    for i, m in enumerate(messages):
        if m["role"] == "tool":
            if m["tool_call_id"] not in pending:
                raise ValueError(
                    f"{key}[{i}].tool_call_id {m['tool_call_id']!r} answers no earlier unanswered tool call"
                )
            del pending[m["tool_call_id"]]
            continue
        if pending:
            k = min(pending.values())
            missing = ", ".join(sorted(c for c, at in pending.items() if at == k))
            raise ValueError(
                f"{key}[{i}]: the tool calls of {key}[{k}] ({missing}) have no tool message answering them"
            )
        for j, call in enumerate(m.get("tool_calls") or ()):
            if call["id"] in seen:
                raise ValueError(f"{key}[{i}].tool_calls[{j}].id {call['id']!r} is used by an earlier call")
            seen.add(call["id"])
            pending[call["id"]] = i
    return pending


def function_tools(value: Any, key: str) -> list[dict[str, Any]]:
    """A line's ``tools``: OpenAI's function tools, checked and kept as given."""
    if not isinstance(value, list):
        raise ValueError(f"'{key}' must be a list of function tools")
    if len(value) > MAX_TOOLS:
        raise ValueError(f"'{key}' holds {len(value)} tools; at most {MAX_TOOLS}")
    out, names = [], set()
    for i, tool in enumerate(value):
        at = f"{key}[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise ValueError(f"{at} must be a function tool {{'type': 'function', 'function': {{...}}}}")
        _unknown(tool, {"type", "function"}, at, "a function tool")
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise ValueError(f"{at}.function must be an object {{'name', 'description', 'parameters'}}")
        for k in fn:
            if k not in _FUNCTION_KEYS:
                raise ValueError(
                    f"{at}.function.{k} is not a field of a function (allowed: {', '.join(sorted(_FUNCTION_KEYS))})"
                )
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise ValueError(f"{at}.function.name must be 1 to 64 letters, digits, '_' or '-'")
        if name in names:
            raise ValueError(f"{at}.function.name {name!r} is defined twice")
        names.add(name)
        if "description" in fn and not isinstance(fn["description"], str):
            raise ValueError(f"{at}.function.description must be a string")
        params = fn.get("parameters")
        if params is not None and (not isinstance(params, dict) or params.get("type", "object") != "object"):
            raise ValueError(f"{at}.function.parameters must be a JSON schema of type 'object'")
        if fn.get("strict") is not None and not isinstance(fn["strict"], bool):
            raise ValueError(f"{at}.function.strict must be a boolean")
        out.append({"type": "function", "function": dict(fn)})
    return out


def tools_context(obj: Mapping[str, Any], where: str = "") -> tuple[list[dict[str, Any]] | None, ToolsContext]:
    """A line's (or a DPO line's ``input``'s) ``tools`` and ``parallel_tool_calls``; ``where`` prefixes the keys in
    messages (``input.``)."""
    if "functions" in obj or "function_call" in obj:
        key = "functions" if "functions" in obj else "function_call"
        raise ValueError(f"'{where}{key}' is deprecated and not supported: use 'tools'")
    tools = function_tools(obj["tools"], f"{where}tools") if "tools" in obj else None
    parallel = obj.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise ValueError(f"'{where}parallel_tool_calls' must be a boolean")
    names = frozenset(t["function"]["name"] for t in tools) if tools is not None else None
    return tools, ToolsContext(names, parallel, f"{where}parallel_tool_calls")

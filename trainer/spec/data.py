"""Datasets: JSONL files validated line by line, every error naming its line.

RL prompts: ``{"messages": [{"role": "user", "content": "..."}], ...extra}`` or ``{"prompt": "...", ...extra}``;
the whole object is the ``item`` that graders reference.

Parsing only: this module imports no torch and no tokenizer, so that the service can validate a dataset without
loading the training stack. Tokenising, batching and sampling orders live in ``trainer.generation.encoding``.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from trainer.spec import chat, graders, json_values
from trainer.spec.agent_spec import AgentSpec, ToolSpec, parse_line_tools

ROLES = ("system", "developer", "user", "assistant")
KIND_PATTERN = re.compile(r"[A-Za-z0-9_.-]{1,64}")  # a preference line's optional "kind"


class DatasetError(ValueError):
    """A bad dataset line. ``line`` is 1-based (None for file-level problems); ``path`` the file, ``detail`` the
    problem without its location (a service names the user's file instead of its local copy)."""

    def __init__(self, message: str, *, line: int | None = None, path: str | None = None) -> None:
        where = ":".join(p for p in (path, str(line) if line else None) if p)
        super().__init__(f"{where}: {message}" if where else message)
        self.line = line
        self.path = path
        self.detail = message


@dataclass(frozen=True)
class PromptItem:
    messages: list[dict[str, str]]
    item: dict[str, Any] = field(default_factory=dict)
    line: int = 0  # 1-based line in its file, for error messages
    tools: list[ToolSpec] | None = None  # an agent job's tools offered for this item (None: all the job's)


def iter_jsonl(path: Path) -> Iterator[tuple[int, Any]]:
    """(line number, parsed object) for every non-blank line. A line that is not UTF-8 or not JSON, or holds a
    value the service cannot store (``trainer.spec.json_values``: a NUL, a lone surrogate, a number that is not finite
    or has over 4,300 digits, nesting over 64 levels) is a :class:`DatasetError` naming the line."""
    with path.open("rb") as f:
        for n, raw in enumerate(f, start=1):
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:
                raise DatasetError("not valid UTF-8", line=n, path=str(path)) from None
            if not text.strip():
                continue
            try:
                value = json_values.loads(text)
            except json_values.JsonValueError as err:
                raise DatasetError(str(err), line=n, path=str(path)) from None
            yield n, value


def _messages(obj: Mapping[str, Any], key: str = "messages") -> list[dict[str, str]]:
    msgs = obj[key]
    if not isinstance(msgs, list) or not msgs:
        raise ValueError(f"'{key}' must be a non-empty list of messages")
    out: list[dict[str, str]] = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise ValueError(f"{key}[{i}] must be an object with 'role' and 'content'")
        role, content = m.get("role"), m.get("content")
        if role not in ROLES:
            raise ValueError(f"{key}[{i}].role must be one of {', '.join(ROLES)}")
        if not isinstance(content, str):
            raise ValueError(f"{key}[{i}].content must be a string")
        for field_name in m:  # what the prompt would lose: the online methods render a message's role and content
            if field_name not in ("role", "content"):
                raise ValueError(f"{key}[{i}].{field_name} is not kept in an RL prompt (only role and content are)")
        out.append({"role": role, "content": content})
    return out


def parse_prompt_line(obj: Any, line: int = 0) -> PromptItem:
    """One RL prompt line → :class:`PromptItem`; raises ``ValueError`` with the problem."""
    if not isinstance(obj, dict):
        raise ValueError("each line must be a JSON object")
    if "messages" in obj:
        return PromptItem(_messages(obj), dict(obj), line)
    if "prompt" in obj:
        if not isinstance(obj["prompt"], str) or not obj["prompt"]:
            raise ValueError("'prompt' must be a non-empty string")
        return PromptItem([{"role": "user", "content": obj["prompt"]}], dict(obj), line)
    raise ValueError("no prompt: expected a 'messages' list or a 'prompt' string")


def load_prompts(
    path: Path, *, grader: graders.Grader | None = None, agent: AgentSpec | None = None
) -> list[PromptItem]:
    """Read and validate an RL prompt file; with a grader, every item must hold the fields its templates name. With an
    agent spec, a line's ``tools`` (``trainer.spec.agent_spec.parse_line_tools``) are the tools offered for that
    item."""
    if not path.is_file():
        raise DatasetError("file not found", path=str(path))
    items: list[PromptItem] = []
    for n, obj in iter_jsonl(path):
        try:
            item = parse_prompt_line(obj, n)
        except ValueError as err:
            raise DatasetError(str(err), line=n, path=str(path)) from None
        if grader is not None and (problem := graders.check_item(grader, item.item)):
            raise DatasetError(problem, line=n, path=str(path))
        if agent is not None and "tools" in item.item:
            try:
                item = replace(item, tools=parse_line_tools(item.item["tools"], agent))
            except ValueError as err:
                raise DatasetError(str(err), line=n, path=str(path)) from None
        items.append(item)
    if not items:
        raise DatasetError("the file holds no examples", path=str(path))
    return items


def offered_functions(items: Sequence[PromptItem], agent: AgentSpec | None) -> list[list[dict[str, Any]]] | None:
    """The function definitions an agent job shows the model with each item (the chat template's ``tools``): the
    line's own tools, else the job's; None for a job without tools."""
    if agent is None:
        return None
    return [[t.function() for t in (it.tools if it.tools is not None else agent.tools)] for it in items]


# ---------------------------------------------------------------------------------------------------------------
# Preference pairs (reward_model, dpo) and supervised conversations; their tokenisation is
# ``trainer.generation.encoding``'s.
# ---------------------------------------------------------------------------------------------------------------

PREFERENCE_FORMATS = (
    "OpenAI's {'input': {'messages': [...]}, 'preferred_output': [...], 'non_preferred_output': [...]} "
    "or TRL's {'prompt', 'chosen', 'rejected'}"
)


@dataclass(frozen=True)
class PreferenceItem:
    """One preference pair: the conversation ``prompt`` and two assistant replies to it, each its ``content`` and its
    tool calls (chat completions' ``tool_calls`` entries, arguments as JSON text); ``tools`` are shown with the
    prompt."""

    prompt: list[dict[str, Any]]
    chosen: str
    rejected: str
    margin: float = 0.0  # the line's own Bradley–Terry margin, added to the hyperparameter's
    line: int = 0
    kind: str | None = None  # the line's own label of the pair's kind; pairwise accuracy is also reported by kind
    tools: list[dict[str, Any]] | None = None  # OpenAI's function tools offered in the prompt
    parallel_tool_calls: bool = True
    chosen_tool_calls: tuple[dict[str, Any], ...] = ()
    rejected_tool_calls: tuple[dict[str, Any], ...] = ()

    def chosen_message(self) -> dict[str, Any]:
        return _assistant_message(self.chosen, self.chosen_tool_calls)

    def rejected_message(self) -> dict[str, Any]:
        return _assistant_message(self.rejected, self.rejected_tool_calls)


def _assistant_message(content: str, calls: Sequence[dict[str, Any]]) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = list(calls)
    return message


def _rendered_as(reply: tuple[str, tuple[dict[str, Any], ...]]) -> tuple[str, list[tuple[str, Any]]]:
    """What of a reply a chat template shows: its content and each call's name and arguments (not the call ids)."""
    return reply[0], [(c["function"]["name"], json_values.loads(c["function"]["arguments"])) for c in reply[1]]


@dataclass(frozen=True)
class SupervisedItem:
    """One conversation ending with an assistant turn; ``trained[i]`` says whether message i is a target. Messages
    are ``trainer.spec.chat``'s (tool calls and tool messages included); ``tools`` are shown with the
    conversation."""

    messages: list[dict[str, Any]]
    trained: tuple[bool, ...]
    line: int = 0
    tools: list[dict[str, Any]] | None = None  # OpenAI's function tools
    parallel_tool_calls: bool = True


def _conversation(
    obj: Mapping[str, Any],
    key: str,
    ctx: chat.ToolsContext,
    *,
    extra: frozenset[str] = frozenset(),
    label: str | None = None,
) -> list[dict[str, Any]]:
    """``obj[key]``: a non-empty list of ``trainer.spec.chat`` messages, their call ids consistent; errors name the
    field as ``label`` (default ``key``)."""
    label = label or key
    msgs = obj[key]
    if not isinstance(msgs, list) or not msgs:
        raise ValueError(f"'{label}' must be a non-empty list of messages")
    out = [chat.chat_message(m, f"{label}[{i}]", ctx, extra=extra) for i, m in enumerate(msgs)]
    chat.check_call_ids(out, label)
    return out


def _reply(value: Any, key: str, ctx: chat.ToolsContext) -> tuple[str, tuple[dict[str, Any], ...]]:
    """The assistant reply of a completion field, (content, tool calls): a string (TRL's standard format) or a list
    holding one assistant message (OpenAI's ``preferred_output``, TRL's conversational format)."""
    if isinstance(value, str):
        return value, ()
    if not isinstance(value, list) or not value:
        raise ValueError(f"'{key}' must be a string or a non-empty list of assistant messages")
    msgs = [chat.chat_message(m, f"{key}[{i}]", ctx) for i, m in enumerate(value)]
    for i, m in enumerate(msgs):
        if m["role"] != "assistant":
            raise ValueError(f"{key}[{i}].role must be 'assistant', not {m['role']!r}")
    if len(msgs) != 1:
        raise ValueError(f"'{key}' must hold exactly one assistant message, not {len(msgs)}")
    if "name" in msgs[0]:
        raise ValueError(f"{key}[0].name is not supported on a reply: the policy does not write names")
    return msgs[0]["content"] or "", tuple(msgs[0].get("tool_calls", ()))


def _check_prompt(prompt: list[dict[str, Any]], key: str) -> list[dict[str, Any]]:
    if prompt[-1]["role"] == "assistant":
        raise ValueError(f"the last message of '{key}' is an assistant turn: the prompt must end before the reply")
    return prompt


Reply = tuple[str, tuple[dict[str, Any], ...]]


def _implicit_prompt(obj: Mapping[str, Any], ctx: chat.ToolsContext) -> tuple[list[dict[str, Any]], Reply, Reply]:
    """TRL's implicit-prompt format: ``chosen`` and ``rejected`` are whole conversations sharing a prompt prefix."""
    chosen, rejected = _conversation(obj, "chosen", ctx), _conversation(obj, "rejected", ctx)
    n = 0
    while n < min(len(chosen), len(rejected)) - 1 and chosen[n] == rejected[n]:
        n += 1
    if n == 0:
        raise ValueError("'chosen' and 'rejected' share no prompt messages and there is no 'prompt'")
    prompt = _check_prompt(chosen[:n], "chosen")
    return prompt, _reply(obj["chosen"][n:], "chosen", ctx), _reply(obj["rejected"][n:], "rejected", ctx)


def _openai_pair(obj: Mapping[str, Any]) -> tuple[list[dict[str, Any]], Reply, Reply, Any, chat.ToolsContext]:
    for key in ("input", "preferred_output", "non_preferred_output"):
        if key not in obj:
            raise ValueError(f"missing field '{key}'")
    inp = obj["input"]
    if not isinstance(inp, dict) or "messages" not in inp:
        raise ValueError("'input' must be an object with a 'messages' list")
    tools, ctx = chat.tools_context(inp, "input.")
    for key in inp:
        if key not in ("messages", "tools", "parallel_tool_calls"):
            raise ValueError(
                f"input.{key} is not a field of a DPO input (allowed: messages, parallel_tool_calls, tools)"
            )
    prompt = _check_prompt(_conversation(inp, "messages", ctx, label="input.messages"), "input.messages")
    chosen = _reply(obj["preferred_output"], "preferred_output", ctx)
    rejected = _reply(obj["non_preferred_output"], "non_preferred_output", ctx)
    return prompt, chosen, rejected, tools, ctx


def _trl_pair(obj: Mapping[str, Any]) -> tuple[list[dict[str, Any]], Reply, Reply, Any, chat.ToolsContext]:
    for key in ("chosen", "rejected"):
        if key not in obj:
            raise ValueError(f"missing field '{key}'")
    tools, ctx = chat.tools_context(obj)
    if "prompt" not in obj:
        if isinstance(obj["chosen"], str) or isinstance(obj["rejected"], str):
            raise ValueError("missing field 'prompt' (string completions need one)")
        return (*_implicit_prompt(obj, ctx), tools, ctx)
    raw = obj["prompt"]
    if isinstance(raw, str):
        if not raw:
            raise ValueError("'prompt' must be a non-empty string or a list of messages")
        prompt: list[dict[str, Any]] = [{"role": "user", "content": raw}]
    else:
        prompt = _check_prompt(_conversation(obj, "prompt", ctx), "prompt")
    return prompt, _reply(obj["chosen"], "chosen", ctx), _reply(obj["rejected"], "rejected", ctx), tools, ctx


def _answers_prompt(prompt: list[dict[str, Any]], reply: Reply, key: str) -> None:
    """A reply's calls are new ids, and a prompt that ends with unanswered calls cannot be replied to."""
    pending = chat.check_call_ids(prompt, "messages")
    if pending:
        k = min(pending.values())
        raise ValueError(f"the tool calls of the prompt's message {k} have no tool message answering them")
    chat.check_call_ids([_assistant_message(*reply)], key, pending={})
    ids = {c["id"] for m in prompt for c in m.get("tool_calls", ())}
    for j, call in enumerate(reply[1]):
        if call["id"] in ids:
            raise ValueError(f"{key}[0].tool_calls[{j}].id {call['id']!r} is used by a call of the prompt")


def parse_preference_line(obj: Any, line: int = 0) -> PreferenceItem:
    """One preference line (either of ``PREFERENCE_FORMATS``) → :class:`PreferenceItem`; ``ValueError`` names the
    problem. OpenAI's ``input`` may hold ``tools`` and ``parallel_tool_calls`` (TRL's lines: at the top level), the
    replies tool calls."""
    if not isinstance(obj, dict):
        raise ValueError("each line must be a JSON object")
    if "input" in obj or "preferred_output" in obj or "non_preferred_output" in obj:
        prompt, chosen, rejected, tools, ctx = _openai_pair(obj)
        keys = ("preferred_output", "non_preferred_output")
    elif "chosen" in obj or "rejected" in obj:
        prompt, chosen, rejected, tools, ctx = _trl_pair(obj)
        keys = ("chosen", "rejected")
    else:
        raise ValueError(f"not a preference pair: expected {PREFERENCE_FORMATS}")
    _answers_prompt(prompt, chosen, keys[0])
    _answers_prompt(prompt, rejected, keys[1])
    if _rendered_as(chosen) == _rendered_as(rejected):
        raise ValueError("the chosen and rejected completions are identical")
    margin = obj.get("margin", 0.0)
    if isinstance(margin, bool) or not isinstance(margin, int | float) or margin != margin:
        raise ValueError("'margin' must be a number")
    kind = obj.get("kind")
    if kind is not None and (not isinstance(kind, str) or not KIND_PATTERN.fullmatch(kind)):
        raise ValueError("'kind' must be 1 to 64 letters, digits, '_', '-' or '.'")
    return PreferenceItem(
        prompt, chosen[0], rejected[0], float(margin), line, kind, tools, ctx.parallel, chosen[1], rejected[1]
    )


def parse_supervised_line(obj: Any, line: int = 0) -> SupervisedItem:
    """One supervised line ``{"messages": [...], "tools"?: [...], "parallel_tool_calls"?: bool}`` ending with an
    assistant turn → :class:`SupervisedItem`.

    An assistant message may carry OpenAI's ``"weight": 0`` to be kept as context but not trained on."""
    if not isinstance(obj, dict):
        raise ValueError("each line must be a JSON object")
    if "messages" not in obj:
        raise ValueError("missing field 'messages'")
    tools, ctx = chat.tools_context(obj)
    raw = obj["messages"]
    if isinstance(raw, list):
        for i, m in enumerate(raw):
            if isinstance(m, dict) and "weight" in m and m.get("role") != "assistant":
                raise ValueError(f"messages[{i}].weight is only allowed on assistant messages")
    msgs = _conversation(obj, "messages", ctx, extra=frozenset({"weight"}))
    if msgs[-1]["role"] != "assistant":
        raise ValueError("the last message must be an assistant turn (the reply to learn)")
    trained = []
    for i, m in enumerate(raw):
        weight = m.get("weight", 1)
        if weight not in (0, 1) or isinstance(weight, bool):
            raise ValueError(f"messages[{i}].weight must be 0 or 1")
        trained.append(m["role"] == "assistant" and weight == 1)
    if not any(trained):
        raise ValueError("no assistant message is trained on (every one has weight 0)")
    return SupervisedItem(msgs, tuple(trained), line, tools, ctx.parallel)


def _load_lines(path: Path, parse: Any) -> list[Any]:
    if not path.is_file():
        raise DatasetError("file not found", path=str(path))
    items = []
    for n, obj in iter_jsonl(path):
        try:
            items.append(parse(obj, n))
        except ValueError as err:
            raise DatasetError(str(err), line=n, path=str(path)) from None
    if not items:
        raise DatasetError("the file holds no examples", path=str(path))
    return items


def load_preferences(path: Path) -> list[PreferenceItem]:
    """Read and validate a preference file line by line (no tokenizer needed); :class:`DatasetError` names the line
    and the problem."""
    items: list[PreferenceItem] = _load_lines(path, parse_preference_line)
    return items


def load_supervised(path: Path) -> list[SupervisedItem]:
    """Read and validate a supervised file line by line (no tokenizer needed); :class:`DatasetError` names the line
    and the problem."""
    items: list[SupervisedItem] = _load_lines(path, parse_supervised_line)
    return items

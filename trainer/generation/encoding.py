"""Tokenising datasets and the order the loops draw them in; the parsing is ``trainer.spec.data``'s.

A completion is tokenised exactly as the online RL loop samples one: the prompt through the tokenizer's chat template
with the generation prompt (:func:`prompt_text`), then the reply's tokens and one EOS. The reward model is trained and
scored on that same layout (EOS appended both times, rl-algorithms §4.6), DPO and supervised fine-tuning teach the
policy the replies it will later sample. A dataset's tools are shown through the template's ``tools``, and a turn that
calls tools is the template's own rendering of its calls (the model's tool-call syntax), so that it too is what the
policy would write.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from jinja2 import TemplateError
from transformers import PreTrainedTokenizerBase

from trainer.generation.rollout import Rollout, left_pad
from trainer.spec.data import DatasetError, PreferenceItem, PromptItem, SupervisedItem


class ExampleTooLongError(DatasetError):
    """A pair or a conversation longer than ``max_length`` tokens (the other :class:`DatasetError` s of encoding are
    examples the chat template cannot render faithfully, which no length fixes)."""


class PromptTooLongError(ValueError):
    def __init__(self, item: PromptItem, n_tokens: int, limit: int) -> None:
        super().__init__(f"the prompt has {n_tokens} tokens, more than max_prompt_tokens = {limit}")
        self.item = item


def prompt_text(
    tokenizer: PreTrainedTokenizerBase,
    messages: list[dict[str, str]],
    template_kwargs: Mapping[str, Any] | None = None,
) -> str:
    """The tokenizer's chat template when it has one (rendered with `template_kwargs`, e.g. `thinking_kwargs`'s),
    else the contents joined by newlines."""
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False, **(template_kwargs or {})
        )
        assert isinstance(text, str)
        return text
    return "\n".join(m["content"] for m in messages)


# How chat templates switch thinking on and off: gpt-oss's takes OpenAI's levels as `reasoning_effort`; Qwen3's
# (`enable_thinking`) and DeepSeek-V3.1's (`thinking`) take a boolean. Checked in this order (enable_thinking
# contains the word thinking only as part of itself: the pattern matches whole variable names).
_EFFORT_VARIABLE = re.compile(r"\breasoning_effort\b")
_THINKING_SWITCHES = tuple((name, re.compile(rf"\b{name}\b")) for name in ("enable_thinking", "thinking"))


def thinking_kwargs(tokenizer: PreTrainedTokenizerBase, effort: str) -> dict[str, Any] | None:
    """The chat-template arguments that select OpenAI's `reasoning_effort` (default, low, medium, high) for this
    tokenizer's template, or None when the template has no thinking mode (the effort then has no effect).

    A template with a `reasoning_effort` variable gets the level itself; one with a boolean switch gets thinking off
    for `low` and on for `medium` and `high`; `default` passes nothing (the template's own default)."""
    template = getattr(tokenizer, "chat_template", None)
    source = "\n".join(template.values()) if isinstance(template, dict) else template
    if not isinstance(source, str):
        return None
    if _EFFORT_VARIABLE.search(source):
        return {} if effort == "default" else {"reasoning_effort": effort}
    for name, pattern in _THINKING_SWITCHES:
        if pattern.search(source):
            return {} if effort == "default" else {name: effort != "low"}
    return None


def encode_prompts(
    tokenizer: PreTrainedTokenizerBase,
    items: Sequence[PromptItem],
    *,
    max_prompt_tokens: int,
    template_kwargs: Mapping[str, Any] | None = None,
    tools: Sequence[Sequence[Mapping[str, Any]]] | None = None,
) -> list[list[int]]:
    """Token ids of each prompt (special tokens come from the chat template, none are added again). ``tools``: the
    function definitions offered with each item (an agent job), passed to the chat template as ``tools``."""
    out: list[list[int]] = []
    for i, item in enumerate(items):
        kwargs = dict(template_kwargs or {})
        if tools is not None:
            kwargs["tools"] = [dict(t) for t in tools[i]]
        ids = tokenizer(prompt_text(tokenizer, item.messages, kwargs), add_special_tokens=False)["input_ids"]
        if len(ids) > max_prompt_tokens:
            raise PromptTooLongError(item, len(ids), max_prompt_tokens)
        out.append(list(ids))
    return out


class PromptSampler:
    """Epoch-wise shuffled order over a dataset, deterministic in (seed, epoch), resumable from (epoch, cursor)."""

    def __init__(self, n: int, *, seed: int) -> None:
        self.n, self.seed = n, seed
        self.epoch, self.cursor = 0, 0
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> list[int]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(self.n, generator=g).tolist()

    def next(self, k: int) -> list[int]:
        out: list[int] = []
        while len(out) < k:
            if self.cursor == self.n:
                self.epoch, self.cursor = self.epoch + 1, 0
                self._order = self._permutation(self.epoch)
            take = min(k - len(out), self.n - self.cursor)
            out += self._order[self.cursor : self.cursor + take]
            self.cursor += take
        return out

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "cursor": self.cursor}

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        self.epoch, self.cursor = int(state["epoch"]), int(state["cursor"])
        self._order = self._permutation(self.epoch)


@dataclass(frozen=True)
class EncodedPair:
    prompt_ids: list[int]
    chosen_ids: list[int]  # the reply's tokens, EOS last
    rejected_ids: list[int]
    margin: float
    line: int
    kind: str | None = None


@dataclass(frozen=True)
class EncodedExample:
    ids: list[int]
    targets: list[bool]  # targets[j]: token j is predicted and trained on (never the first token)
    line: int


def encode_completion(tokenizer: Any, prompt: list[dict[str, str]], reply: str) -> tuple[list[int], list[int]]:
    """(prompt ids, reply ids + [EOS]): the prompt as the RL loop encodes it, the reply as the policy samples it."""
    prompt_ids = tokenizer(prompt_text(tokenizer, prompt), add_special_tokens=False)["input_ids"]
    return list(prompt_ids), _reply_ids(tokenizer, reply)


def _reply_ids(tokenizer: Any, reply: str) -> list[int]:
    """The reply's tokens and one EOS, as the policy emits a reply (``generate`` stops at EOS)."""
    ids = tokenizer(reply, add_special_tokens=False)["input_ids"] if reply else []
    return [*ids, tokenizer.eos_token_id]


# --- conversations with tools ----------------------------------------------------------------------------------
# A dataset's messages are OpenAI's (``trainer.spec.chat``); Hugging Face chat templates take a call's arguments as
# an object (Qwen's and Hermes' templates write ``arguments | tojson``; tiny-calc's takes either) and a content string.
# A turn that calls tools is the template's rendering of it, from the end of its generation prompt to the EOS that
# ends it: exactly what the policy writes (``trainer.agents.tool_calls`` parses that text back into calls).


def template_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI messages in the shape chat templates read: each call's ``arguments`` decoded, a null content ``""``."""
    out = []
    for m in messages:
        t = dict(m)
        if t.get("content") is None:
            t["content"] = ""
        if "tool_calls" in t:
            t["tool_calls"] = [
                {
                    "id": c["id"],
                    "type": "function",
                    "function": {"name": c["function"]["name"], "arguments": json.loads(c["function"]["arguments"])},
                }
                for c in m["tool_calls"]
            ]
        out.append(t)
    return out


def _tools_kwargs(tools: Sequence[Mapping[str, Any]] | None) -> dict[str, Any]:
    return {"tools": [dict(t) for t in tools]} if tools else {}


def _render(tokenizer: Any, messages: Sequence[Mapping[str, Any]], kwargs: Mapping[str, Any]) -> str:
    """A whole conversation through the chat template, without a generation prompt."""
    text = tokenizer.apply_chat_template(list(messages), add_generation_prompt=False, tokenize=False, **kwargs)
    assert isinstance(text, str)
    return text


_PLACEHOLDER = "Proxima placeholder reply 7e31"


def _turn_text(tokenizer: Any, before: list[dict[str, Any]], message: dict[str, Any], kwargs: dict[str, Any]) -> str:
    """The assistant turn ``message`` after ``before`` as the template renders it, from its generation prompt up to
    the EOS text that ends it (the whole rest when the template writes no EOS).

    What the template writes before a last turn's content (Qwen 3's empty ``<think>`` block, which it leaves out of
    earlier turns) is left out, as a reply without calls is its content alone: the turn then reads the same as the
    last message and inside a longer conversation."""
    prefix = prompt_text(tokenizer, before, kwargs)
    full = _render(tokenizer, [*before, message], kwargs)
    probe = _render(tokenizer, [*before, {"role": "assistant", "content": _PLACEHOLDER}], kwargs)
    if not full.startswith(prefix) or not probe.startswith(prefix):
        raise ValueError(
            "the chat template renders the conversation before this turn differently once the turn follows, so the "
            "turn's tokens cannot be told apart"
        )
    suffix = full[len(prefix) :]
    lead = probe[len(prefix) :].split(_PLACEHOLDER)[0] if _PLACEHOLDER in probe else ""
    if lead and suffix.startswith(lead):
        suffix = suffix[len(lead) :]
    eos = tokenizer.eos_token or ""
    at = suffix.find(eos) if eos else -1
    return suffix if at < 0 else suffix[:at]


def _calls_turn(
    tokenizer: Any, before: list[dict[str, Any]], message: dict[str, Any], kwargs: dict[str, Any], where: str
) -> str:
    """:func:`_turn_text` of a turn that calls tools; a template that renders no calls is an error naming the
    field."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"{where}.tool_calls: the model has no chat template to write tool calls with")
    try:
        text = _turn_text(tokenizer, before, message, kwargs)
        without = _turn_text(tokenizer, before, {**message, "tool_calls": []}, kwargs)
    except ValueError as err:
        raise ValueError(f"{where}: {err}") from None
    if text == without:
        raise ValueError(f"{where}.tool_calls: the model's chat template does not render tool calls")
    return text


def _reply_text(
    tokenizer: Any, before: list[dict[str, Any]], message: dict[str, Any], kwargs: dict[str, Any], where: str
) -> str:
    """The text of a reply the policy is trained to write: its content, or the rendered turn when it calls tools."""
    if message.get("tool_calls"):
        return _calls_turn(tokenizer, before, message, kwargs, where)
    return str(message["content"])


def check_rendered(
    tokenizer: Any, messages: list[dict[str, Any]], tools: Sequence[Mapping[str, Any]] | None, key: str
) -> None:
    """Nothing of a conversation is lost in rendering: its ``tools``, every message's ``name`` and every tool message
    appear in the chat template's text; a ``ValueError`` names the field the template drops."""
    kwargs = _tools_kwargs(tools)
    if not getattr(tokenizer, "chat_template", None):
        if tools:
            raise ValueError("tools: the model has no chat template to show tools with")
        for k, m in enumerate(messages):
            if "name" in m or m["role"] == "tool":
                field = "name" if "name" in m else "role"
                raise ValueError(f"{key}[{k}].{field}: the model has no chat template to render it with")
        return
    full = _render(tokenizer, messages, kwargs)
    if tools and full == _render(tokenizer, messages, {}):
        raise ValueError("tools: the model's chat template does not render tools, so the model would never see them")
    for k, m in enumerate(messages):
        if "name" in m:
            unnamed = [*messages[:k], {f: v for f, v in m.items() if f != "name"}, *messages[k + 1 :]]
            if _render(tokenizer, unnamed, kwargs) == full:
                raise ValueError(f"{key}[{k}].name: the model's chat template does not render names; remove it")
        if m["role"] == "tool" and m["content"]:
            before = _render(tokenizer, messages[:k], kwargs) if k else ""
            upto = _render(tokenizer, messages[: k + 1], kwargs)
            if upto.startswith(before) and m["content"] not in upto[len(before) :]:
                raise ValueError(f"{key}[{k}]: the model's chat template does not render tool messages")


def _problem(err: Exception) -> str:
    """A template's own refusal (``raise_exception`` in Jinja, e.g. roles that must alternate) is the line's problem."""
    return f"the model's chat template refuses this conversation: {err}" if isinstance(err, TemplateError) else str(err)


def encode_preferences(
    tokenizer: Any, items: list[PreferenceItem], *, max_length: int, path: str = ""
) -> list[EncodedPair]:
    """Tokenise every pair: the prompt (its ``tools`` shown) through the chat template, each reply as the policy
    writes it (a turn with tool calls in the template's syntax) and EOS. A prompt plus a reply longer than
    ``max_length`` tokens is a :class:`DatasetError` (a pair is never truncated: a cut reply would train on a
    different text, rl-algorithms §4.8)."""
    out = []
    for it in items:
        try:
            prompt_ids, chosen, rejected = _pair_tokens(tokenizer, it)
        except (ValueError, TemplateError) as err:
            raise DatasetError(_problem(err), line=it.line, path=path) from None
        n = len(prompt_ids) + max(len(chosen), len(rejected))
        if n > max_length:
            raise ExampleTooLongError(
                f"the prompt and its longer reply are {n} tokens, more than max_length = {max_length}",
                line=it.line,
                path=path,
            )
        out.append(EncodedPair(prompt_ids, chosen, rejected, it.margin, it.line, it.kind))
    return out


def _pair_tokens(tokenizer: Any, it: PreferenceItem) -> tuple[list[int], list[int], list[int]]:
    if not it.tools and not it.chosen_tool_calls and not it.rejected_tool_calls and _plain(it.prompt):
        prompt_ids, chosen = encode_completion(tokenizer, it.prompt, it.chosen)
        return prompt_ids, chosen, _reply_ids(tokenizer, it.rejected)
    msgs, kwargs = template_messages(it.prompt), _tools_kwargs(it.tools)
    check_rendered(tokenizer, msgs, it.tools, "the prompt's messages")
    prompt_ids = list(tokenizer(prompt_text(tokenizer, msgs, kwargs), add_special_tokens=False)["input_ids"])
    replies = [
        _reply_text(tokenizer, msgs, template_messages([m])[0], kwargs, key)
        for m, key in ((it.chosen_message(), "preferred_output[0]"), (it.rejected_message(), "non_preferred_output[0]"))
    ]
    return prompt_ids, _reply_ids(tokenizer, replies[0]), _reply_ids(tokenizer, replies[1])


def _plain(messages: Sequence[Mapping[str, Any]]) -> bool:
    """Messages of role and content only, which every template (and none) renders."""
    return all(set(m) == {"role", "content"} and m["role"] != "tool" for m in messages)


def encode_supervised(
    tokenizer: Any, items: list[SupervisedItem], *, max_length: int, last_turn_only: bool = False, path: str = ""
) -> list[EncodedExample]:
    """Tokenise every conversation (its ``tools`` shown): the context of the final assistant turn through the chat
    template, then that reply (a turn with tool calls as the template writes it) and EOS. Earlier trained assistant
    turns are found in the rendered context by their text, with the EOS that ends them, and their tokens become
    targets too (unless ``last_turn_only``). Longer than ``max_length`` tokens is a :class:`DatasetError`."""
    out = []
    for it in items:
        try:
            ids, targets = _conversation_tokens(tokenizer, it, last_turn_only=last_turn_only)
        except (ValueError, TemplateError) as err:
            raise DatasetError(_problem(err), line=it.line, path=path) from None
        targets[0] = False  # the first token is predicted by nothing
        if len(ids) > max_length:
            raise ExampleTooLongError(
                f"the conversation is {len(ids)} tokens, more than max_length = {max_length}", line=it.line, path=path
            )
        if not any(targets):
            raise DatasetError("no token to train on", line=it.line, path=path)
        out.append(EncodedExample(ids, targets, it.line))
    return out


def _conversation_tokens(tokenizer: Any, it: SupervisedItem, *, last_turn_only: bool) -> tuple[list[int], list[bool]]:
    """(ids, targets) of one conversation; ``ValueError`` names the message that cannot be encoded."""
    msgs, kwargs = template_messages(it.messages), _tools_kwargs(it.tools)
    if it.tools or not _plain(it.messages):
        check_rendered(tokenizer, msgs, it.tools, "messages")
    k_last = len(msgs) - 1
    context = prompt_text(tokenizer, msgs[:k_last], kwargs)
    spans = []
    for k in range(k_last):
        if it.trained[k] and not last_turn_only and (span := _turn_span(tokenizer, msgs, k, context, kwargs)):
            spans.append(span)
    if spans:
        if not getattr(tokenizer, "is_fast", False):
            raise ValueError("training on earlier assistant turns needs a fast tokenizer; set assistant_turns: last")
        enc = tokenizer(context, add_special_tokens=False, return_offsets_mapping=True)
        ctx_ids = list(enc["input_ids"])
        ctx_targets = [any(s < e_span and e > s_span for s_span, e_span in spans) for s, e in enc["offset_mapping"]]
    else:
        ctx_ids = list(tokenizer(context, add_special_tokens=False)["input_ids"])
        ctx_targets = [False] * len(ctx_ids)
    reply = _reply_text(tokenizer, msgs[:k_last], msgs[k_last], kwargs, f"messages[{k_last}]")
    reply_ids = _reply_ids(tokenizer, reply)
    return ctx_ids + reply_ids, ctx_targets + [it.trained[k_last]] * len(reply_ids)


def _turn_span(
    tokenizer: Any, msgs: list[dict[str, Any]], k: int, context: str, kwargs: dict[str, Any]
) -> tuple[int, int] | None:
    """Where the earlier assistant turn ``k`` lies in the rendered ``context`` (characters), its ending EOS included
    when the template writes one right after it; None for an empty turn."""
    m, eos = msgs[k], tokenizer.eos_token or ""
    text = _calls_turn(tokenizer, msgs[:k], m, kwargs, f"messages[{k}]") if m.get("tool_calls") else m["content"]
    if not text:
        return None
    before = prompt_text(tokenizer, msgs[:k], kwargs)
    start = context.find(text, len(before)) if context.startswith(before) else -1
    if start < 0:
        raise ValueError(
            f"messages[{k}]: the chat template does not render this assistant turn verbatim, so its tokens "
            "cannot be found; set assistant_turns: last or give it weight 0"
        )
    stop = start + len(text)
    return start, stop + len(eos) if eos and context.startswith(eos, stop) else stop


def pack_examples(lengths: list[int], max_length: int) -> list[list[int]]:
    """Indices of examples packed into rows of at most ``max_length`` tokens, first-fit by decreasing length
    (deterministic: ties keep their order). Every length must be ≤ max_length."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    rows: list[list[int]] = []
    free: list[int] = []
    for i in order:
        assert lengths[i] <= max_length, "encode_supervised refuses longer examples"
        for r, room in enumerate(free):
            if lengths[i] <= room:
                rows[r].append(i)
                free[r] -= lengths[i]
                break
        else:
            rows.append([i])
            free.append(max_length - lengths[i])
    return rows


class LengthGroupedSampler(PromptSampler):
    """:class:`PromptSampler`'s epoch order, regrouped so that consecutive examples have similar lengths: each
    mega-batch of ``group`` examples of the shuffled order is sorted by decreasing length (HF's
    ``LengthGroupedSampler``), so a batch drawn from it pads little. Deterministic in (seed, epoch), resumable."""

    def __init__(self, lengths: list[int], *, seed: int, group: int) -> None:
        self.lengths, self.group = lengths, group
        super().__init__(len(lengths), seed=seed)

    def _permutation(self, epoch: int) -> list[int]:
        order = super()._permutation(epoch)
        chunks = [order[s : s + self.group] for s in range(0, len(order), self.group)]
        return [i for c in chunks for i in sorted(c, key=lambda i: -self.lengths[i])]


def completion_batch(prompts: list[list[int]], completions: list[list[int]], pad_id: int) -> Rollout:
    """Rows of prompt + completion in the rollout layout (``trainer.generation.rollout.Rollout``): prompts left-padded,
    completions right-padded, the masks from the lengths, so the RL loop's log-prob function applies as is."""
    prompt_ids, prompt_mask = left_pad(prompts, pad_id)
    width = max(len(c) for c in completions)
    ids = torch.full((len(completions), width), pad_id, dtype=torch.long)
    for i, c in enumerate(completions):
        ids[i, : len(c)] = torch.tensor(c, dtype=torch.long)
    lengths = torch.tensor([len(c) for c in completions], dtype=torch.long)
    mask = (torch.arange(width).unsqueeze(0) < lengths.unsqueeze(-1)).long()
    return Rollout(prompt_ids, prompt_mask, ids, mask, lengths, torch.zeros(len(completions), dtype=torch.bool))

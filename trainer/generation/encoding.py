"""Tokenising datasets and the order the loops draw them in; the parsing is ``trainer.spec.data``'s.

A completion is tokenised exactly as the online RL loop samples one: the prompt through the tokenizer's chat template
with the generation prompt (:func:`prompt_text`), then the reply's tokens and one EOS. The reward model is trained and
scored on that same layout (EOS appended both times, rl-algorithms §4.6), DPO and supervised fine-tuning teach the
policy the replies it will later sample.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

from trainer.generation.rollout import Rollout, left_pad
from trainer.spec.data import DatasetError, PreferenceItem, PromptItem, SupervisedItem


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


def encode_preferences(
    tokenizer: Any, items: list[PreferenceItem], *, max_length: int, path: str = ""
) -> list[EncodedPair]:
    """Tokenise every pair; a prompt plus a reply longer than ``max_length`` tokens is a :class:`DatasetError` (a
    pair is never truncated: a cut reply would train on a different text, rl-algorithms §4.8)."""
    out = []
    for it in items:
        prompt_ids, chosen = encode_completion(tokenizer, it.prompt, it.chosen)
        _, rejected = encode_completion(tokenizer, it.prompt, it.rejected)
        n = len(prompt_ids) + max(len(chosen), len(rejected))
        if n > max_length:
            raise DatasetError(
                f"the prompt and its longer reply are {n} tokens, more than max_length = {max_length}",
                line=it.line,
                path=path,
            )
        out.append(EncodedPair(prompt_ids, chosen, rejected, it.margin, it.line, it.kind))
    return out


def encode_supervised(
    tokenizer: Any, items: list[SupervisedItem], *, max_length: int, last_turn_only: bool = False, path: str = ""
) -> list[EncodedExample]:
    """Tokenise every conversation: the context of the final assistant turn through the chat template, then that
    reply and EOS. Earlier trained assistant turns are found in the rendered context by their text and their tokens
    become targets too (unless ``last_turn_only``). Longer than ``max_length`` tokens is a :class:`DatasetError`."""
    out = []
    for it in items:
        k_last = len(it.messages) - 1
        context = prompt_text(tokenizer, it.messages[:k_last])
        spans = []
        for k, m in enumerate(it.messages[:k_last]):
            if not it.trained[k] or last_turn_only or not m["content"]:
                continue
            before = prompt_text(tokenizer, it.messages[:k])
            start = context.find(m["content"], len(before)) if context.startswith(before) else -1
            if start < 0:
                raise DatasetError(
                    f"messages[{k}]: the chat template does not render this assistant turn verbatim, so its tokens "
                    "cannot be found; set assistant_turns: last or give it weight 0",
                    line=it.line,
                    path=path,
                )
            spans.append((start, start + len(m["content"])))
        if spans:
            if not getattr(tokenizer, "is_fast", False):
                raise DatasetError(
                    "training on earlier assistant turns needs a fast tokenizer; set assistant_turns: last",
                    line=it.line,
                    path=path,
                )
            enc = tokenizer(context, add_special_tokens=False, return_offsets_mapping=True)
            ctx_ids = list(enc["input_ids"])
            ctx_targets = [any(s < e_span and e > s_span for s_span, e_span in spans) for s, e in enc["offset_mapping"]]
        else:
            ctx_ids = list(tokenizer(context, add_special_tokens=False)["input_ids"])
            ctx_targets = [False] * len(ctx_ids)
        reply = it.messages[k_last]["content"]
        reply_ids = _reply_ids(tokenizer, reply)
        ids = ctx_ids + reply_ids
        targets = ctx_targets + [it.trained[k_last]] * len(reply_ids)
        targets[0] = False  # the first token is predicted by nothing
        if len(ids) > max_length:
            raise DatasetError(
                f"the conversation is {len(ids)} tokens, more than max_length = {max_length}", line=it.line, path=path
            )
        if not any(targets):
            raise DatasetError("no token to train on", line=it.line, path=path)
        out.append(EncodedExample(ids, targets, it.line))
    return out


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

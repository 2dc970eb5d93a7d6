"""Datasets (design §4): JSONL files validated line by line, every error naming its line.

RL prompts: ``{"messages": [{"role": "user", "content": "..."}], ...extra}`` or ``{"prompt": "...", ...extra}``;
the whole object is the ``item`` that graders reference.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from trainer import graders

if TYPE_CHECKING:
    from trainer.rollout import Rollout

ROLES = ("system", "developer", "user", "assistant")


class DatasetError(ValueError):
    """A bad dataset line. ``line`` is 1-based (None for file-level problems)."""

    def __init__(self, message: str, *, line: int | None = None, path: str | None = None) -> None:
        where = ":".join(p for p in (path, str(line) if line else None) if p)
        super().__init__(f"{where}: {message}" if where else message)
        self.line = line
        self.detail = message


@dataclass(frozen=True)
class PromptItem:
    messages: list[dict[str, str]]
    item: dict[str, Any] = field(default_factory=dict)
    line: int = 0  # 1-based line in its file, for error messages


def iter_jsonl(path: Path) -> Iterator[tuple[int, Any]]:
    """(line number, parsed object) for every non-blank line; a line that is not JSON is a :class:`DatasetError`."""
    with path.open("r", encoding="utf-8") as f:
        for n, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            try:
                yield n, json.loads(raw)
            except json.JSONDecodeError as err:
                raise DatasetError(
                    f"not valid JSON ({err.msg} at column {err.colno})", line=n, path=str(path)
                ) from None


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


def load_prompts(path: Path, *, grader: graders.Grader | None = None) -> list[PromptItem]:
    """Read and validate an RL prompt file; with a grader, every item must hold the fields its templates name."""
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
        items.append(item)
    if not items:
        raise DatasetError("the file holds no examples", path=str(path))
    return items


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


# ---------------------------------------------------------------------------------------------------------------
# Preference pairs (reward_model, dpo) and supervised conversations (design §4)
#
# A completion is tokenised exactly as the online RL loop samples one: the prompt through the tokenizer's chat
# template with the generation prompt (``trainer.rollout.prompt_text``), then the reply's tokens and one EOS. The
# reward model is trained and scored on that same layout (EOS appended both times, rl-algorithms §4.6), DPO and
# supervised fine-tuning teach the policy the replies it will later sample.
# ---------------------------------------------------------------------------------------------------------------

PREFERENCE_FORMATS = (
    "OpenAI's {'input': {'messages': [...]}, 'preferred_output': [...], 'non_preferred_output': [...]} "
    "or TRL's {'prompt', 'chosen', 'rejected'}"
)


@dataclass(frozen=True)
class PreferenceItem:
    """One preference pair: the conversation ``prompt`` and two assistant replies to it."""

    prompt: list[dict[str, str]]
    chosen: str
    rejected: str
    margin: float = 0.0  # the line's own Bradley–Terry margin, added to the hyperparameter's
    line: int = 0


@dataclass(frozen=True)
class SupervisedItem:
    """One conversation ending with an assistant turn; ``trained[i]`` says whether message i is a target."""

    messages: list[dict[str, str]]
    trained: tuple[bool, ...]
    line: int = 0


def _reply(value: Any, key: str) -> str:
    """The assistant reply of a completion field: a string (TRL's standard format) or a list holding one
    assistant message (OpenAI's ``preferred_output``, TRL's conversational format)."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list) or not value:
        raise ValueError(f"'{key}' must be a string or a non-empty list of assistant messages")
    msgs = _messages({key: value}, key)
    for i, m in enumerate(msgs):
        if m["role"] != "assistant":
            raise ValueError(f"{key}[{i}].role must be 'assistant', not {m['role']!r}")
    if len(msgs) != 1:
        raise ValueError(f"'{key}' must hold exactly one assistant message, not {len(msgs)}")
    return msgs[0]["content"]


def _check_prompt(prompt: list[dict[str, str]], key: str) -> list[dict[str, str]]:
    if prompt[-1]["role"] == "assistant":
        raise ValueError(f"the last message of '{key}' is an assistant turn: the prompt must end before the reply")
    return prompt


def _implicit_prompt(obj: Mapping[str, Any]) -> tuple[list[dict[str, str]], str, str]:
    """TRL's implicit-prompt format: ``chosen`` and ``rejected`` are whole conversations sharing a prompt prefix."""
    chosen, rejected = _messages(obj, "chosen"), _messages(obj, "rejected")
    n = 0
    while n < min(len(chosen), len(rejected)) - 1 and chosen[n] == rejected[n]:
        n += 1
    if n == 0:
        raise ValueError("'chosen' and 'rejected' share no prompt messages and there is no 'prompt'")
    return _check_prompt(chosen[:n], "chosen"), _reply(chosen[n:], "chosen"), _reply(rejected[n:], "rejected")


def parse_preference_line(obj: Any, line: int = 0) -> PreferenceItem:
    """One preference line (either format of design §4) → :class:`PreferenceItem`; ``ValueError`` names the
    problem."""
    if not isinstance(obj, dict):
        raise ValueError("each line must be a JSON object")
    if "input" in obj or "preferred_output" in obj or "non_preferred_output" in obj:
        for key in ("input", "preferred_output", "non_preferred_output"):
            if key not in obj:
                raise ValueError(f"missing field '{key}'")
        if not isinstance(obj["input"], dict) or "messages" not in obj["input"]:
            raise ValueError("'input' must be an object with a 'messages' list")
        prompt = _check_prompt(_messages(obj["input"]), "input.messages")
        chosen = _reply(obj["preferred_output"], "preferred_output")
        rejected = _reply(obj["non_preferred_output"], "non_preferred_output")
    elif "chosen" in obj or "rejected" in obj:
        for key in ("chosen", "rejected"):
            if key not in obj:
                raise ValueError(f"missing field '{key}'")
        if "prompt" not in obj:
            if isinstance(obj["chosen"], str) or isinstance(obj["rejected"], str):
                raise ValueError("missing field 'prompt' (string completions need one)")
            prompt, chosen, rejected = _implicit_prompt(obj)
        else:
            raw = obj["prompt"]
            if isinstance(raw, str):
                if not raw:
                    raise ValueError("'prompt' must be a non-empty string or a list of messages")
                prompt = [{"role": "user", "content": raw}]
            else:
                prompt = _check_prompt(_messages(obj, "prompt"), "prompt")
            chosen, rejected = _reply(obj["chosen"], "chosen"), _reply(obj["rejected"], "rejected")
    else:
        raise ValueError(f"not a preference pair: expected {PREFERENCE_FORMATS}")
    if chosen == rejected:
        raise ValueError("the chosen and rejected completions are identical")
    margin = obj.get("margin", 0.0)
    if isinstance(margin, bool) or not isinstance(margin, int | float) or margin != margin:
        raise ValueError("'margin' must be a number")
    return PreferenceItem(prompt, chosen, rejected, float(margin), line)


def parse_supervised_line(obj: Any, line: int = 0) -> SupervisedItem:
    """One supervised line ``{"messages": [...]}`` ending with an assistant turn → :class:`SupervisedItem`.

    An assistant message may carry OpenAI's ``"weight": 0`` to be kept as context but not trained on."""
    if not isinstance(obj, dict):
        raise ValueError("each line must be a JSON object")
    if "messages" not in obj:
        raise ValueError("missing field 'messages'")
    msgs = _messages(obj)
    if msgs[-1]["role"] != "assistant":
        raise ValueError("the last message must be an assistant turn (the reply to learn)")
    trained = []
    for i, m in enumerate(obj["messages"]):
        weight = m.get("weight", 1)
        if weight not in (0, 1) or isinstance(weight, bool):
            raise ValueError(f"messages[{i}].weight must be 0 or 1")
        if "weight" in m and m["role"] != "assistant":
            raise ValueError(f"messages[{i}].weight is only allowed on assistant messages")
        trained.append(m["role"] == "assistant" and weight == 1)
    if not any(trained):
        raise ValueError("no assistant message is trained on (every one has weight 0)")
    return SupervisedItem(msgs, tuple(trained), line)


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


@dataclass(frozen=True)
class EncodedPair:
    prompt_ids: list[int]
    chosen_ids: list[int]  # the reply's tokens, EOS last
    rejected_ids: list[int]
    margin: float
    line: int


@dataclass(frozen=True)
class EncodedExample:
    ids: list[int]
    targets: list[bool]  # targets[j]: token j is predicted and trained on (never the first token)
    line: int


def encode_completion(tokenizer: Any, prompt: list[dict[str, str]], reply: str) -> tuple[list[int], list[int]]:
    """(prompt ids, reply ids + [EOS]): the prompt as the RL loop encodes it, the reply as the policy samples it."""
    from trainer.rollout import prompt_text  # rollout imports this module

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
        out.append(EncodedPair(prompt_ids, chosen, rejected, it.margin, it.line))
    return out


def encode_supervised(
    tokenizer: Any, items: list[SupervisedItem], *, max_length: int, last_turn_only: bool = False, path: str = ""
) -> list[EncodedExample]:
    """Tokenise every conversation: the context of the final assistant turn through the chat template, then that
    reply and EOS. Earlier trained assistant turns are found in the rendered context by their text and their tokens
    become targets too (unless ``last_turn_only``). Longer than ``max_length`` tokens is a :class:`DatasetError`."""
    from trainer.rollout import prompt_text  # rollout imports this module

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
    """Rows of prompt + completion in the rollout layout (``trainer.rollout.Rollout``): prompts left-padded,
    completions right-padded, the masks from the lengths, so the RL loop's log-prob function applies as is."""
    from trainer.rollout import Rollout, left_pad  # rollout imports this module (the type is only for checkers)

    prompt_ids, prompt_mask = left_pad(prompts, pad_id)
    width = max(len(c) for c in completions)
    ids = torch.full((len(completions), width), pad_id, dtype=torch.long)
    for i, c in enumerate(completions):
        ids[i, : len(c)] = torch.tensor(c, dtype=torch.long)
    lengths = torch.tensor([len(c) for c in completions], dtype=torch.long)
    mask = (torch.arange(width).unsqueeze(0) < lengths.unsqueeze(-1)).long()
    return Rollout(prompt_ids, prompt_mask, ids, mask, lengths, torch.zeros(len(completions), dtype=torch.bool))

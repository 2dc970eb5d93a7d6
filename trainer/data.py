"""Datasets (design §4): JSONL files validated line by line, every error naming its line.

RL prompts: ``{"messages": [{"role": "user", "content": "..."}], ...extra}`` or ``{"prompt": "...", ...extra}``;
the whole object is the ``item`` that graders reference.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from trainer import graders

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

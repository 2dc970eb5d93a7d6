"""What a job's owner sees of the worker's machine: nothing. The trainer runs on local copies (the model resolved to
a folder in the worker's model store, the datasets downloaded into a run folder, reward models unpacked beside them),
so its events and error messages name local paths; before they are recorded, each local path is replaced by the
name the user knows it by (the model's name, the file's id), and any other absolute path by its last component.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

# An absolute path of two or more components, not inside a word or a relative path ("a/b", "1/2" are left alone).
_ABSOLUTE_PATH = re.compile(r"(?<![\w/.~-])/(?:[\w.@+~-]+/)+[\w.@+~-]*")


class Redactor:
    """``names``: a local path → what the user calls it. A path inside one of them keeps its part below it."""

    def __init__(self, names: Mapping[str, str]) -> None:
        self.names = sorted(((p.rstrip("/"), n) for p, n in names.items() if p.startswith("/")), reverse=True)

    def _path(self, match: re.Match[str]) -> str:
        path = match.group(0)
        for local, name in self.names:  # sorted in reverse: a longer path before its prefix
            if path == local or path.startswith(local + "/"):
                return name + path[len(local) :]
        tail = path.rstrip("/").rsplit("/", 1)[-1]
        return tail or path

    def text(self, text: str) -> str:
        return _ABSOLUTE_PATH.sub(self._path, text)

    def value(self, value: Any) -> Any:
        """Strings redacted wherever they are in a JSON-like value (an event's data)."""
        if isinstance(value, str):
            return self.text(value)
        if isinstance(value, dict):
            return {k: self.value(v) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return [self.value(v) for v in value]
        return value

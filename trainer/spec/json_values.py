"""JSON values the service can store and send back: the one check every JSON input passes (request bodies, dataset
lines) before anything is stored, trained on or answered.

Python's ``json`` module accepts more than JSON, and more than the rest of the service can handle:

- ``NaN``, ``Infinity`` and numbers such as ``1e400`` (which overflow to infinity): not JSON numbers, so
  PostgreSQL's ``json`` columns refuse them and a trainer given one trains on garbage;
- ``"\\ud800"``, a lone UTF-16 surrogate: a Python string that cannot be encoded as UTF-8, so neither the database
  driver nor the response's JSON encoder can write it;
- ``"\\u0000"``: PostgreSQL's text types cannot hold a NUL at all, and its ``json`` type stores one but cannot
  extract it again (``metadata ->> 'k'`` fails for good);
- nesting as deep as the parser's recursion limit, which every recursive consumer further on (the JSON encoders of
  the database driver and the response, the graders) may then exceed;
- integers of more than 4,300 digits, which ``json.loads`` refuses with a ``ValueError`` that is not a
  ``JSONDecodeError`` (Python's limit on int-from-str conversion, CVE-2020-10735).

:func:`check` finds the first such value (iteratively: it has no recursion limit of its own) and names where it is;
:func:`loads` parses one JSON text with every problem above reported as :class:`JsonValueError`.
"""

from __future__ import annotations

import json
import math
import re
import sys
from collections.abc import Iterator
from typing import Any

MAX_DEPTH = 64
"""Most levels of arrays and objects a value may nest (a chat dataset line needs about five)."""

_SURROGATE = re.compile("[\ud800-\udfff]")
# The escapes of a NUL and of a surrogate: a JSON text (decoded from UTF-8) holds neither character any other way.
_BAD_ESCAPE = re.compile(r"\\u(?:0000|[dD][89a-fA-F])")

NOT_FINITE = "must be a finite number (NaN, Infinity and numbers beyond ±1.8e308 are not JSON numbers)"

Path = tuple[str | int, ...]


class JsonValueError(ValueError):
    """A value the service cannot take. ``path`` locates it (object keys and array indices from the root; empty
    for the root itself or a text that does not parse); ``detail`` says what is wrong."""

    def __init__(self, detail: str, *, path: Path = ()) -> None:
        path = tuple(_short(part) for part in path)
        where = format_path(path)
        super().__init__(f"{where}: {detail}" if where else detail)
        self.detail = detail
        self.path = path


MAX_KEY_SHOWN = 64
"""Characters of a key a path shows: an error message stays short whatever the keys of the input."""


def _short(part: str | int) -> str | int:
    return part if isinstance(part, int) or len(part) <= MAX_KEY_SHOWN else part[: MAX_KEY_SHOWN - 1] + "…"


def format_path(path: Path) -> str:
    """``messages[0].content``: keys joined with dots, array indices in brackets."""
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else part)
    return out


def string_problem(text: str) -> str | None:
    """What makes ``text`` impossible to store or send, or None when it is fine."""
    if "\x00" in text:
        return "contains a NUL character (\\u0000)"
    if not text.isascii() and (m := _SURROGATE.search(text)):
        return f"contains an unpaired UTF-16 surrogate (\\u{ord(m.group()):04x}): not valid Unicode"
    return None


def check(value: Any, *, max_depth: int = MAX_DEPTH) -> None:
    """Raise :class:`JsonValueError` at the first string (object key or value) with a NUL or a lone surrogate, the
    first float that is not finite, or the first array or object nested more than ``max_depth`` levels deep, in
    document order.

    A bad key is reported at the object that holds it, never in the path: a path must itself be safe to send back.
    The walk is iterative and keeps one iterator per open level: no recursion limit of its own, and a cost of about
    one ``json.loads`` of the same value (it runs on every request body), paths being built only for an error.
    """
    if not isinstance(value, dict | list):
        _check_leaf(value, ())
        return
    # One frame per open array or object: its (key, child) iterator and its own key in its parent.
    frames: list[tuple[Iterator[tuple[Any, Any]], str | int | None]] = []
    _enter(frames, value, None, max_depth)
    while frames:
        for key, child in frames[-1][0]:
            cls = child.__class__
            if cls is str:
                if "\x00" in child or (not child.isascii() and _SURROGATE.search(child)):
                    _check_leaf(child, _path(frames, key))
            elif cls is float:
                if child - child != 0.0:  # NaN or ±inf (inf - inf is NaN)
                    _check_leaf(child, _path(frames, key))
            elif cls is list and len(frames) < max_depth:
                frames.append((enumerate(child), key))
                break
            elif cls is dict and len(frames) < max_depth:
                try:
                    keys = "".join(child)  # one check for all the keys (JSON's keys are strings)
                except TypeError:
                    keys = "\x00"  # not all strings: _enter checks them one by one
                if "\x00" in keys or not keys.isascii():
                    _enter(frames, child, key, max_depth)
                else:
                    frames.append((iter(child.items()), key))
                break
            elif cls is dict or cls is list:
                _enter(frames, child, key, max_depth)  # raises: too deep
            elif not (cls is int or cls is bool or child is None):  # subclasses and other objects: the slow way
                if isinstance(child, dict | list):
                    _enter(frames, child, key, max_depth)
                    break
                _check_leaf(child, _path(frames, key))
        else:
            frames.pop()


def _enter(
    frames: list[tuple[Iterator[tuple[Any, Any]], str | int | None]],
    node: dict[Any, Any] | list[Any],
    key: str | int | None,
    max_depth: int,
) -> None:
    if len(frames) >= max_depth:  # named by its top-level field: the whole path is as long as the nesting
        raise JsonValueError(f"nested more than {max_depth} levels deep", path=_path(frames, key)[:1])
    if isinstance(node, list):
        frames.append((enumerate(node), key))
        return
    try:
        keys = "".join(node)  # one check for all the keys (JSON's keys are strings)
    except TypeError:
        keys = "\x00"  # not all strings: check them one by one
    if "\x00" in keys or not keys.isascii():
        for k in node:
            if isinstance(k, str) and (problem := string_problem(k)):
                raise JsonValueError(f"a key {problem}", path=_path(frames, key))
    frames.append((iter(node.items()), key))


def _path(frames: list[tuple[Iterator[tuple[Any, Any]], str | int | None]], key: str | int | None) -> Path:
    """The path of ``key`` in the innermost open frame (or of the frame being opened)."""
    keys = [k for _, k in frames[1:] if k is not None]  # the root's own key is None
    return (*keys, key) if key is not None else tuple(keys)


def _check_leaf(value: Any, path: Path) -> None:
    if isinstance(value, str):
        if problem := string_problem(value):
            raise JsonValueError(problem, path=path)
    elif isinstance(value, float) and not math.isfinite(value):
        raise JsonValueError(NOT_FINITE, path=path)


def refuse_constant(name: str) -> float:
    """``json.loads``' ``parse_constant``: Python's parser takes NaN and ±Infinity, which are not JSON."""
    raise JsonValueError(f"{name}: {NOT_FINITE}")


def _finite_float(literal: str) -> float:
    value = float(literal)
    if not math.isfinite(value):
        raise JsonValueError(f"{literal[:20]}{'…' if len(literal) > 20 else ''}: {NOT_FINITE}")
    return value


# Built once: ``json.loads`` with any hook builds a decoder per call, which costs more than parsing a short line.
_DECODER = json.JSONDecoder(parse_constant=refuse_constant, parse_float=_finite_float)


def loads(text: str, *, max_depth: int = MAX_DEPTH) -> Any:
    """``json.loads`` and :func:`check`, every failure a :class:`JsonValueError`. Non-finite numbers are refused as
    they are parsed (so without a path)."""
    try:
        value = _DECODER.decode(text)
    except JsonValueError:
        raise
    except json.JSONDecodeError as err:
        raise JsonValueError(f"not valid JSON ({err.msg} at column {err.colno})") from None
    except RecursionError:
        raise JsonValueError(f"not valid JSON: nested more than {max_depth} levels deep") from None
    except ValueError:  # int-from-str's digit limit; the message tells Python users how to lift it, not ours
        raise JsonValueError(
            f"a number has more than {sys.get_int_max_str_digits()} digits: write it as a string or a float"
        ) from None
    # Most texts need no walk: without those escapes and with fewer brackets than max_depth, no value is refused.
    if ("\\u" in text and _BAD_ESCAPE.search(text)) or text.count("[") + text.count("{") > max_depth:
        check(value, max_depth=max_depth)
    return value

"""The program that runs a python grader's code inside its sandbox (`trainer.grading.sandbox` starts it under
bubblewrap).

Standard library only, and nothing of this project: the sandbox holds the interpreter's `/usr`, this file (bound
read-only at `/sandbox/runner.py`), a scratch `/tmp` and, when the deployment has one, a read-only folder of
packages. The protocol is JSON lines on private copies of the original stdin and stdout; fd 0 then reads /dev/null
and fd 1 writes where fd 2 does, so nothing the grader prints or reads can reach the protocol by accident (code that
means to can, but it can only lie about its own scores, which it could do by returning them):

    runner → parent, once started:    {"started": true}
    parent → runner, first:           {"check": source}  → {"problem": str | null}, and the runner exits; or
                                      {"source": source} → {"ready": true} | {"fatal": message}
    parent → runner, per sample:      {"i": n, "sample": {...}, "item": {...}}
    runner → parent:                  {"i": n, "score": float} | {"i": n, "kind": kind, "error": message}

`kind` is one of SAMPLE_ERROR_KINDS. Every check of the source (`source_problem`) is here too, so that the parent
can run it under the sandbox's limits: parsing hostile source is not bounded enough to run on a service's thread
(a 256 kB f-string of placeholders takes seconds to parse).
"""

from __future__ import annotations

import ast
import contextlib
import json
import linecache
import math
import os
import signal
import sys
import traceback
from collections.abc import Callable
from typing import Any

MAX_SOURCE_BYTES = 256 * 1024
"""The largest source accepted, in UTF-8 bytes (OpenAI: "source < 256 kB")."""
MAX_ERROR_CHARS = 4000
"""The longest error message a sample reply carries (the end of a traceback is kept: it names the exception)."""
SAMPLE_ERROR_KINDS = ("exception", "not_a_number", "non_finite")
"""What the runner itself reports for a sample: grade raised, returned something that is not a number, or returned
NaN or an infinity."""
FILENAME = "grader.py"
"""The source's file name in tracebacks."""


def source_problem(source: str) -> str | None:
    """What is wrong with a grader's source, or None: at most MAX_SOURCE_BYTES, Python that parses, and a top-level
    `def grade(sample, item)` that can be called with two positional arguments. Nothing of the source runs."""
    try:
        size = len(source.encode("utf-8"))
    except UnicodeEncodeError:
        return "source is not valid UTF-8 text"
    if size > MAX_SOURCE_BYTES:
        return f"source is {size} bytes long; at most {MAX_SOURCE_BYTES} bytes are allowed"
    try:
        tree = ast.parse(source, filename=FILENAME)
    except SyntaxError as err:
        return f"source does not parse: {err.msg} (line {err.lineno})"
    except (RecursionError, MemoryError, ValueError) as err:  # ValueError: a NUL byte; the others: deep nesting
        return f"source does not parse ({type(err).__name__}: it is nested too deeply or holds a NUL byte)"
    defined = [node for node in tree.body if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)]
    grades = [node for node in defined if node.name == "grade"]
    if not grades:
        return "source does not define a top-level function grade(sample, item)"
    grade = grades[-1]  # the one that stands once the module has run
    if isinstance(grade, ast.AsyncFunctionDef):
        return "grade must be a plain function (def grade(sample, item)), not async"
    return _signature_problem(grade.args)


def _signature_problem(args: ast.arguments) -> str | None:
    positional = len(args.posonlyargs) + len(args.args)
    required = positional - len(args.defaults)
    keyword_required = [a.arg for a, default in zip(args.kwonlyargs, args.kw_defaults, strict=True) if default is None]
    if required > 2 or (positional < 2 and args.vararg is None) or keyword_required:
        return "grade must take two positional arguments: def grade(sample, item)"
    return None


def _load(source: str) -> Callable[..., Any] | str:
    """The grade function the source defines, or why there is none."""
    problem = source_problem(source)
    if problem is not None:
        return problem
    linecache.cache[FILENAME] = (len(source), None, source.splitlines(keepends=True), FILENAME)  # traceback lines
    namespace: dict[str, Any] = {"__name__": "grader", "__file__": FILENAME}
    try:
        exec(compile(source, FILENAME, "exec"), namespace)
    except BaseException as exc:  # the module's top-level code failed (SystemExit included)
        return "the grader's top-level code raised " + _describe(exc)
    grade = namespace.get("grade")
    if not callable(grade):
        return "after the grader's top-level code ran, grade is not a function"
    return grade


def _describe(exc: BaseException) -> str:
    """The traceback of `exc` without the runner's own frame, its end kept when too long."""
    try:
        tb = exc.__traceback__.tb_next if exc.__traceback__ is not None else None
        text = "".join(traceback.format_exception(type(exc), exc, tb)).rstrip()
    except BaseException:  # an exception whose str() raises
        text = type(exc).__name__
    return text if len(text) <= MAX_ERROR_CHARS else "…" + text[-(MAX_ERROR_CHARS - 1) :]


def grade_one(grade: Callable[..., Any], sample: Any, item: Any) -> dict[str, Any]:
    """A sample's reply without its index: {"score"} or {"kind", "error"}. A score is what float() makes of a
    number (bool, int, float, numpy scalars, anything with __float__ except text); it must be finite."""
    try:
        value = grade(sample, item)
    except BaseException as exc:  # SystemExit and KeyboardInterrupt from the grader's code too
        return {"kind": "exception", "error": _describe(exc)}
    if isinstance(value, str | bytes | bytearray) or not hasattr(type(value), "__float__"):
        return {"kind": "not_a_number", "error": f"grade returned {type(value).__name__}, not a number"}
    try:
        score = float(value)
    except OverflowError:
        return {"kind": "non_finite", "error": "grade returned a number too large for a float"}
    except BaseException as exc:
        return {
            "kind": "not_a_number",
            "error": f"grade's {type(value).__name__} result is not a number: " + _describe(exc),
        }
    if not math.isfinite(score):
        return {"kind": "non_finite", "error": f"grade returned {score!r}; a score must be finite"}
    return {"score": score}


def main(argv: list[str]) -> None:
    # Private copies of the protocol's pipes; the grader's code gets /dev/null and the output pipe in their place.
    requests = os.fdopen(os.dup(0), "rb")
    replies = os.fdopen(os.dup(1), "wb")
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    os.dup2(2, 1)
    dumps, loads, write, flush = json.dumps, json.loads, replies.write, replies.flush  # before the grader's code runs

    def reply(message: dict[str, Any]) -> None:
        write(dumps(message).encode() + b"\n")
        flush()

    # The runner is its pid namespace's pid 1, to which the kernel delivers no signal it has no handler for: the
    # CPU limit's SIGXCPU needs one (its SIGKILL a second later, should the grader's code replace it, needs none).
    signal.signal(signal.SIGXCPU, lambda signum, frame: os._exit(128 + signal.SIGXCPU))
    reply({"started": True})
    first = loads(requests.readline())
    if "check" in first:
        reply({"problem": source_problem(first["check"])})
        return
    if len(argv) == 2 and argv[0] == "--site":  # the deployment's packages (-I -S left them off sys.path)
        import site

        site.addsitedir(argv[1])
    grade = _load(first["source"])
    if isinstance(grade, str):
        reply({"fatal": grade})
        return
    reply({"ready": True})
    for line in requests:
        request = loads(line)
        result = grade_one(grade, request["sample"], request["item"])
        for stream in (sys.stdout, sys.stderr):  # what it printed reaches the parent (and its count) now
            with contextlib.suppress(BaseException):
                stream.flush()
        reply({"i": request["i"], **result})


if __name__ == "__main__":
    main(sys.argv[1:])
    os._exit(0)  # threads the grader started do not keep the sandbox alive

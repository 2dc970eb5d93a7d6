"""The program that runs a python environment's code inside its sandbox, for one agent episode.

`trainer.agents.tools.PythonEnvironmentExecutor` starts it with `trainer.grading.sandbox.SandboxSession`: the python
grader's bubblewrap, limits and uid slots, one sandbox per episode, so the environment's state (its module's globals)
lives for one episode and nothing of it reaches the next. Standard library only, and nothing of this project: the
sandbox holds the interpreter's `/usr`, this file (bound read-only at `/sandbox/runner.py`), a scratch `/tmp` and,
when the deployment has one, the python graders' read-only folder of packages (`--site DIR`), importable by the
environment's code as by a grader's.

The protocol is JSON lines on private copies of the original stdin and stdout; fd 0 then reads /dev/null and fd 1
writes where fd 2 does, so nothing the environment prints or reads can reach the protocol by accident:

    runner → parent, once started:  {"started": true}
    parent → runner, first:         {"source": source}  → {"ready": true} | {"fatal": message}
    parent → runner, once:          {"reset": item}     → {"messages": [{"role", "content", ...}, ...] | null}
                                                        | {"error": message}
    parent → runner, per tool call: {"step": {"id", "name", "arguments"}} → {"content": str, "done": bool}
                                                                          | {"error": message}

`reset(item)` returns the episode's opening messages (None or [] keeps the dataset line's prompt); `step(tool_call)`
returns `(content, done)`: the tool message's text and whether the episode ends. Anything else they return, or an
exception they raise, is an `error` reply, whose message (the end of the traceback) the model is shown.
"""

from __future__ import annotations

import ast
import contextlib
import json
import linecache
import os
import signal
import sys
import traceback
from collections.abc import Callable
from typing import Any

MAX_SOURCE_BYTES = 256 * 1024
"""The largest source accepted, in UTF-8 bytes (as a python grader's)."""
MAX_CONTENT_BYTES = 1 << 20
"""The longest tool message a step may return, in UTF-8 bytes: the bound of a tool server's answer."""
MAX_REPLY_BYTES = 8 << 20
"""The longest reply line (a step's content, JSON-escaped, fits: at most 6 bytes per byte of control characters)."""
MAX_ERROR_CHARS = 4000
"""The longest error message a reply carries (the end of a traceback is kept: it names the exception)."""
FILENAME = "environment.py"
"""The source's file name in tracebacks."""
FUNCTIONS = ("reset", "step")


def source_problem(source: str) -> str | None:
    """What is wrong with an environment's source, or None: at most MAX_SOURCE_BYTES, Python that parses, and
    top-level plain functions `reset` and `step` taking one positional argument. Nothing of the source runs."""
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
    for name in FUNCTIONS:
        argument = "item" if name == "reset" else "tool_call"
        defined = [n for n in tree.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef) and n.name == name]
        if not defined:
            return f"source does not define a top-level function {name}({argument})"
        function = defined[-1]  # the one that stands once the module has run
        if isinstance(function, ast.AsyncFunctionDef):
            return f"{name} must be a plain function (def {name}({argument})), not async"
        args = function.args
        positional = len(args.posonlyargs) + len(args.args)
        required = positional - len(args.defaults)
        keyword_required = [a for a, d in zip(args.kwonlyargs, args.kw_defaults, strict=True) if d is None]
        if required > 1 or (positional < 1 and args.vararg is None) or keyword_required:
            return f"{name} must take one positional argument: def {name}({argument})"
    return None


def _describe(exc: BaseException) -> str:
    """The traceback of `exc` without the runner's own frame, its end kept when too long."""
    try:
        tb = exc.__traceback__.tb_next if exc.__traceback__ is not None else None
        text = "".join(traceback.format_exception(type(exc), exc, tb)).rstrip()
    except BaseException:  # an exception whose str() raises
        text = type(exc).__name__
    return _tail(text)


def _tail(text: str) -> str:
    return text if len(text) <= MAX_ERROR_CHARS else "…" + text[-(MAX_ERROR_CHARS - 1) :]


def _load(source: str) -> tuple[Callable[..., Any], Callable[..., Any]] | str:
    """(reset, step) as the source defines them, or why there are none."""
    problem = source_problem(source)
    if problem is not None:
        return problem
    linecache.cache[FILENAME] = (len(source), None, source.splitlines(keepends=True), FILENAME)  # traceback lines
    namespace: dict[str, Any] = {"__name__": "environment", "__file__": FILENAME}
    try:
        exec(compile(source, FILENAME, "exec"), namespace)
    except BaseException as exc:  # the module's top-level code failed (SystemExit included)
        return "the environment's top-level code raised " + _describe(exc)
    reset, step = namespace.get("reset"), namespace.get("step")
    if not callable(reset) or not callable(step):
        return "after the environment's top-level code ran, reset or step is not a function"
    return reset, step


def reset_reply(reset: Callable[..., Any], item: Any) -> dict[str, Any]:
    """{"messages": list | None} or {"error": message}: the messages must be a list of objects, each with a string
    `role` and a string `content`."""
    try:
        value = reset(item)
    except BaseException as exc:  # SystemExit and KeyboardInterrupt from the environment's code too
        return {"error": "reset raised " + _describe(exc)}
    if value is None or (isinstance(value, list | tuple) and not value):
        return {"messages": None}
    shape = "reset must return None or a list of {'role': str, 'content': str} messages"
    if not isinstance(value, list | tuple):
        return {"error": f"{shape}, not {type(value).__name__}"}
    messages = []
    for i, message in enumerate(value):
        if not isinstance(message, dict):
            return {"error": f"{shape}; message {i} is {type(message).__name__}"}
        if not isinstance(message.get("role"), str) or not isinstance(message.get("content"), str):
            return {"error": f"{shape}; message {i} has no string role or content"}
        messages.append(message)
    return {"messages": messages}


def step_reply(step: Callable[..., Any], tool_call: dict[str, Any]) -> dict[str, Any]:
    """{"content": str, "done": bool} or {"error": message}: step must return a (str, bool) pair, its text at most
    MAX_CONTENT_BYTES."""
    try:
        value = step(tool_call)
    except BaseException as exc:
        return {"error": "step raised " + _describe(exc)}
    if not (isinstance(value, tuple | list) and len(value) == 2):
        return {"error": f"step must return (content: str, done: bool), not {type(value).__name__}"}
    content, done = value
    if not isinstance(content, str) or not isinstance(done, bool):
        kinds = f"({type(content).__name__}, {type(done).__name__})"
        return {"error": f"step must return (content: str, done: bool), not {kinds}"}
    try:
        size = len(content.encode("utf-8"))
    except UnicodeEncodeError:
        return {"error": "step returned content that is not valid UTF-8 text (a lone surrogate)"}
    if size > MAX_CONTENT_BYTES:
        return {"error": f"step returned {size} bytes of content; at most {MAX_CONTENT_BYTES} are allowed"}
    return {"content": content, "done": done}


def encode(message: dict[str, Any]) -> bytes:
    """The reply's JSON line, or an error reply's when it cannot be sent (not JSON, too long)."""
    try:
        line = json.dumps(message, ensure_ascii=False, allow_nan=False).encode("utf-8")
    except (ValueError, TypeError, RecursionError) as err:  # UnicodeEncodeError is a ValueError
        return json.dumps({"error": _tail(f"the reply cannot be sent as JSON ({type(err).__name__}: {err})")}).encode()
    if len(line) >= MAX_REPLY_BYTES:
        return json.dumps(
            {"error": f"the reply is {len(line)} bytes long; at most {MAX_REPLY_BYTES} are sent"}
        ).encode()
    return line


def main(argv: list[str]) -> None:
    # Private copies of the protocol's pipes; the environment's code gets /dev/null and the output pipe in their place.
    requests = os.fdopen(os.dup(0), "rb")
    replies = os.fdopen(os.dup(1), "wb")
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    os.dup2(2, 1)
    loads, write, flush = json.loads, replies.write, replies.flush  # bound before the environment's code runs

    def reply(message: dict[str, Any]) -> None:
        for stream in (sys.stdout, sys.stderr):  # what it printed reaches the parent (and its count) first
            with contextlib.suppress(BaseException):
                stream.flush()
        write(encode(message) + b"\n")
        flush()

    # The runner is its pid namespace's pid 1, to which the kernel delivers no signal it has no handler for: the
    # CPU limit's SIGXCPU needs one (its SIGKILL a second later, should the environment's code replace it, needs none).
    signal.signal(signal.SIGXCPU, lambda signum, frame: os._exit(128 + signal.SIGXCPU))
    reply({"started": True})
    first = loads(requests.readline())
    if "check" in first:  # parse only (nothing of the source runs): what is wrong with it, or None
        reply({"problem": source_problem(first["check"])})
        return
    if len(argv) == 2 and argv[0] == "--site":  # the deployment's packages (-I -S left them off sys.path)
        import site

        site.addsitedir(argv[1])
    loaded = _load(first["source"])
    if isinstance(loaded, str):
        reply({"fatal": loaded})
        return
    reply({"ready": True})
    reset, step = loaded
    for line in requests:
        request = loads(line)
        if "reset" in request:
            reply(reset_reply(reset, request["reset"]))
        else:
            reply(step_reply(step, request["step"]))


if __name__ == "__main__":
    main(sys.argv[1:])
    os._exit(0)  # threads the environment started do not keep the sandbox alive

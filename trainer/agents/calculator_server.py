"""The built-in calculator tool server: one tool, `calculator`, over OpenAI's agent-RFT tool wire shape.

A tool call arrives as ``POST /`` with a Responses ``function_call`` item as its body::

    {"type": "function_call", "id": "fc_…", "call_id": "call_…", "name": "calculator",
     "arguments": "{\\"expression\\": \\"23+58+71\\"}", "trace_id": "trace_…", "item": {…}}

and is answered ``{"type": "function_call_output", "call_id": …, "id": …, "output": "152"}`` (``call_id`` and ``id``
echo the call's). Anything the tool cannot answer (an unknown tool, arguments that are not a JSON object with a string
``expression``, an expression that does not parse) is HTTP 400 with ``{"error": "…"}`` and no ``output``: the trainer
shows that payload to the model as the tool message and counts a tool error.

Expressions are integers with ``+``, ``-``, ``*``, unary minus and parentheses, read by a small recursive-descent
parser (never ``eval``); their length is bounded, so neither parsing depth nor the size of a product can run away.
``latency_s`` delays every answer (an ``asyncio`` sleep, so concurrent calls wait together) for the agent benchmark.
Torch-free: the tiny-calc build imports :func:`answer_call` to simulate this server exactly.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

TOOL_NAME = "calculator"
DESCRIPTION = "Evaluate an integer arithmetic expression with +, -, * and parentheses; returns the integer result."
PARAMETERS: dict[str, Any] = {
    "type": "object",
    "properties": {
        "expression": {"type": "string", "description": "the expression, for example 23+58+71"},
    },
    "required": ["expression"],
    "additionalProperties": False,
}
FUNCTION: dict[str, Any] = {
    "type": "function",
    "function": {"name": TOOL_NAME, "description": DESCRIPTION, "parameters": PARAMETERS},
}
"""The tool as chat templates and OpenAI's function tools take it (``tools=[FUNCTION]``)."""

MAX_EXPRESSION_CHARS = 256
"""Longest expression answered. Bounds the parser's recursion (one level per character at most) and the result
(a product of at most 256 characters of digits has at most 256 digits)."""
MAX_BODY_BYTES = 1024 * 1024
"""The agent-RFT payload limit (1 MB each way); larger bodies are answered 413."""
MAX_LATENCY_S = 60.0

log = logging.getLogger(__name__)


def calculator_tool(server_url: str, *, headers: dict[str, str] | None = None) -> dict[str, Any]:
    """The job-spec entry for this tool (OpenAI agent RFT: ``{"name", "server_url", "headers"}`` plus the function
    definition the model is shown), ready for ``method.<type>.tools``."""
    return {
        "name": TOOL_NAME,
        "server_url": server_url,
        "headers": dict(headers or {}),
        "description": DESCRIPTION,
        "parameters": PARAMETERS,
    }


# --- the expression language --------------------------------------------------------------------------------


class CalculatorError(ValueError):
    """An expression the calculator does not answer; the message says why (it is what the model sees)."""


_TOKEN = re.compile(r"\s*(?:([0-9]+)|(.))", re.DOTALL)


def _tokens(expression: str) -> list[str]:
    out: list[str] = []
    for match in _TOKEN.finditer(expression):
        number, symbol = match.groups()
        if number is not None:
            out.append(number)
        elif symbol is not None and not symbol.isspace():
            if symbol not in "+-*()":
                raise CalculatorError(f"unexpected character {symbol!r}: only integers, +, -, * and ( ) are allowed")
            out.append(symbol)
    return out


class _Parser:
    """expr := term (("+" | "-") term)* ; term := factor ("*" factor)* ; factor := ("-" | "+") factor | INT |
    "(" expr ")". Standard precedence, left-associative."""

    def __init__(self, tokens: list[str]) -> None:
        self.tokens, self.pos = tokens, 0

    def _peek(self) -> str | None:
        return self.tokens[self.pos] if self.pos < len(self.tokens) else None

    def _take(self) -> str:
        token = self._peek()
        if token is None:
            raise CalculatorError("the expression ends too early")
        self.pos += 1
        return token

    def parse(self) -> int:
        value = self._expr()
        if self._peek() is not None:
            raise CalculatorError(f"unexpected {self._peek()!r} after a complete expression")
        return value

    def _expr(self) -> int:
        value = self._term()
        while self._peek() in ("+", "-"):
            value = value + self._term() if self._take() == "+" else value - self._term()
        return value

    def _term(self) -> int:
        value = self._factor()
        while self._peek() == "*":
            self._take()
            value *= self._factor()
        return value

    def _factor(self) -> int:
        token = self._take()
        if token == "-":
            return -self._factor()
        if token == "+":
            return self._factor()
        if token == "(":
            value = self._expr()
            if self._take() != ")":
                raise CalculatorError("a '(' is not closed")
            return value
        if token[0] in "0123456789":
            return int(token)
        raise CalculatorError(f"unexpected {token!r}")


def evaluate_expression(expression: str) -> int:
    """The value of an integer expression with ``+ - *``, unary signs and parentheses: ``"23+58+71"`` → 152.

    Raises :class:`CalculatorError` for anything else (empty, too long, other characters, unbalanced)."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise CalculatorError(f"the expression is longer than {MAX_EXPRESSION_CHARS} characters")
    tokens = _tokens(expression)
    if not tokens:
        raise CalculatorError("the expression is empty")
    return _Parser(tokens).parse()


def answer_call(name: str, arguments: str) -> str:
    """The calculator's output for one call: the result as decimal text. Raises :class:`CalculatorError` for an
    unknown tool or arguments that are not ``{"expression": "<string>"}``."""
    if name != TOOL_NAME:
        raise CalculatorError(f"unknown tool {name!r}; this server has {TOOL_NAME!r}")
    try:
        args = json.loads(arguments)
    except json.JSONDecodeError as err:
        raise CalculatorError(f"arguments are not JSON: {err.msg}") from None
    if not isinstance(args, dict) or set(args) != {"expression"} or not isinstance(args["expression"], str):
        raise CalculatorError('arguments must be {"expression": "<string>"}')
    return str(evaluate_expression(args["expression"]))


# --- the server ---------------------------------------------------------------------------------------------


class FunctionCall(BaseModel):
    """A Responses ``function_call`` item as agent RFT posts it; fields it may add are ignored."""

    model_config = ConfigDict(extra="ignore")

    type: str
    id: str | None = Field(None, max_length=256)
    call_id: str = Field(max_length=256)
    name: str = Field(max_length=256)
    arguments: str


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status)


def create_app(latency_s: float = 0.0) -> FastAPI:
    """The calculator server; every answer (errors included) waits ``latency_s`` seconds first."""
    if not 0.0 <= latency_s <= MAX_LATENCY_S:
        raise ValueError(f"latency_s must be in 0..{MAX_LATENCY_S}, got {latency_s}")
    app = FastAPI(title="proxima calculator tool", openapi_url=None, docs_url=None, redoc_url=None)

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok", "tool": TOOL_NAME}

    @app.post("/", response_model=None)
    async def call(request: Request) -> JSONResponse | dict[str, Any]:
        too_large = _error(413, f"the body is larger than {MAX_BODY_BYTES} bytes")
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > MAX_BODY_BYTES:
            return too_large
        # Read in chunks up to the limit: a chunked body declares no length.
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > MAX_BODY_BYTES:
                return too_large
        if latency_s:
            await asyncio.sleep(latency_s)
        # Parsed here rather than as a typed parameter: FastAPI would answer 422 {"detail"}, the wire shape is 400.
        try:
            item = FunctionCall.model_validate_json(body)
        except ValidationError as err:
            first = err.errors()[0]
            where = ".".join(str(p) for p in first["loc"]) or "body"
            return _error(400, f"bad function_call body: {where}: {first['msg']}")
        if item.type != "function_call":
            return _error(400, f"type must be 'function_call', got {item.type!r}")
        try:
            output = answer_call(item.name, item.arguments)
        except CalculatorError as err:
            return _error(400, str(err))
        return {"type": "function_call_output", "call_id": item.call_id, "id": item.id, "output": output}

    return app


def make_server(host: str = "127.0.0.1", port: int = 8765, latency_s: float = 0.0) -> uvicorn.Server:
    """A uvicorn server for the calculator, not started: ``serve`` runs it in the foreground; tests run it in a
    thread and stop it with ``should_exit``. Port 0 binds a free port (read it from ``server.servers`` once
    started)."""
    config = uvicorn.Config(create_app(latency_s), host=host, port=port, log_level="warning", access_log=False)
    return uvicorn.Server(config)


def serve(host: str = "127.0.0.1", port: int = 8765, latency_s: float = 0.0) -> None:
    """Run the calculator server in the foreground until interrupted (one process, uvicorn)."""
    log.info("calculator tool at http://%s:%d/ (latency %.3f s)", host, port, latency_s)
    make_server(host, port, latency_s).run()

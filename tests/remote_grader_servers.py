"""Real HTTP services for the remote graders' tests, served by uvicorn on a free port of 127.0.0.1 in a thread of the
test process (the trainer, the API and a worker reach them over TCP like any other service):

- an OpenAI-compatible judge, `/judge/<mode>/v1/chat/completions`, which grades an addition by a fixed rule
  (`sum_score`): it reads `Question: What is A + B?` and `Answer: <text>` from the prompt. Modes: `sum` (answers
  OpenAI's structured result), `fenced` (the same JSON in a ```json block, as a server that ignores
  `response_format` does), `slow` (answers after SLOW_S), `flaky` (HTTP 503 to the first FLAKY_FAILURES requests of
  each distinct prompt, then answers), `prose` (an unstructured sentence), `outside` (a result of 7, outside [0, 1]),
  `html` (HTTP 200 with a body that is not JSON), `refuse` (a refusal), `down` (always HTTP 502);
- an endpoint grader, `/grade/<mode>`: `{"score": 1.0}` when the sample's text is the item's answer, else 0.0;
  modes `sum`, `slow`, `flaky` (503 to the first FLAKY_FAILURES requests of each trace_id), `garbage`
  (`{"score": "high"}`), `html`, `forbidden` (HTTP 403);
- an OpenAI-compatible embeddings endpoint, `/emb/<mode>/v1/embeddings` (`letters`: each text's counts of a-z and
  0-9, `letter_vector`; `down`: HTTP 503).

Every request is recorded in `State` (JSON body, headers, arrival time), so tests check what was sent.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
import re
import socket
import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

SLOW_S = 1.5
FLAKY_FAILURES = 2
_QUESTION_RE = re.compile(r"What is (\d+) \+ (\d+)\?")
_ANSWER_RE = re.compile(r"Answer: (.*)", re.DOTALL)
ALPHABET = "abcdefghijklmnopqrstuvwxyz0123456789"


def sum_score(question: str, answer: str) -> float:
    """The judge's rule: 1.0 when the answer is the sum exactly, else the share of the sum's digits that appear in
    the answer (`What is 23 + 58?`: `81` → 1.0, `71` → 0.5, `x` → 0.0)."""
    a, b = (int(x) for x in _QUESTION_RE.search(question).groups())  # type: ignore[union-attr]
    expected = str(a + b)
    if answer.strip() == expected:
        return 1.0
    return sum(digit in answer for digit in expected) / len(expected)


def letter_vector(text: str) -> list[float]:
    """The embeddings server's vector of a text: its counts of each character of ALPHABET (case-folded)."""
    counts = Counter(text.lower())
    return [float(counts[c]) for c in ALPHABET]


def letter_cosine(a: str, b: str) -> float:
    """The cosine of two texts' letter vectors, as the graders should compute it from the server's embeddings."""
    u, v = letter_vector(a), letter_vector(b)
    return math.fsum(x * y for x, y in zip(u, v, strict=True)) / (
        math.sqrt(math.fsum(x * x for x in u)) * math.sqrt(math.fsum(y * y for y in v))
    )


@dataclass
class Received:
    path: str
    body: Any
    headers: dict[str, str]
    at: float


@dataclass
class State:
    requests: list[Received] = field(default_factory=list)
    attempts: Counter[str] = field(default_factory=Counter)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def to(self, prefix: str) -> list[Received]:
        with self.lock:
            return [r for r in self.requests if r.path.startswith(prefix)]

    def clear(self) -> None:
        with self.lock:
            self.requests.clear()
            self.attempts.clear()

    def record(self, path: str, body: Any, headers: dict[str, str]) -> int:
        """Record a request; how many times this path has seen this key (the body's hash) so far, this one included."""
        with self.lock:
            self.requests.append(Received(path, body, headers, time.monotonic()))
            key = path + hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()
            if isinstance(body, dict) and "trace_id" in body:
                key = path + str(body["trace_id"])
            self.attempts[key] += 1
            return self.attempts[key]


def _prompt(body: dict[str, Any]) -> str:
    parts = []
    for message in body["messages"]:
        content = message["content"]
        parts.append(content if isinstance(content, str) else "".join(p["text"] for p in content))
    return "\n".join(parts)


def _completion(content: str | None, *, refusal: str | None = None) -> dict[str, Any]:
    return {
        "id": "chatcmpl-test",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": "judge",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": content, "refusal": refusal},
                "finish_reason": "stop",
            }
        ],
        "usage": {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15},
    }


def make_app(state: State) -> FastAPI:
    app = FastAPI()

    async def body_of(request: Request) -> Any:
        raw = await request.body()
        try:
            return json.loads(raw)
        except ValueError:
            return raw.decode(errors="replace")

    @app.post("/judge/{mode}/v1/chat/completions")
    async def judge(mode: str, request: Request) -> Response:
        body = await body_of(request)
        seen = state.record(request.url.path, body, dict(request.headers))
        if mode == "down" or (mode == "flaky" and seen <= FLAKY_FAILURES):
            return JSONResponse({"error": {"message": "overloaded"}}, status_code=503 if mode == "flaky" else 502)
        if mode == "slow":
            await asyncio.sleep(SLOW_S)
        if mode == "html":
            return PlainTextResponse("<html>gateway</html>")
        if mode == "refuse":
            return JSONResponse(_completion(None, refusal="I can't grade this."))
        prompt = _prompt(body)
        question, answer = _QUESTION_RE.search(prompt), _ANSWER_RE.search(prompt)
        score = sum_score(question.group(0), answer.group(1)) if question and answer else 0.0
        schema = body.get("response_format", {}).get("json_schema", {}).get("schema", {})
        labels = schema.get("properties", {}).get("result", {}).get("enum")
        result: Any = score if labels is None else labels[0] if score == 1.0 else labels[-1]
        structured = json.dumps({"steps": [{"description": "add", "conclusion": f"{score}"}], "result": result})
        content = {
            "prose": f"I would say about {score}.",
            "outside": json.dumps({"steps": [], "result": 7}),
            "fenced": f"```json\n{structured}\n```",
        }.get(mode, structured)
        return JSONResponse(_completion(content))

    @app.post("/grade/{mode}")
    async def grade(mode: str, request: Request) -> Response:
        body = await body_of(request)
        seen = state.record(request.url.path, body, dict(request.headers))
        if mode == "flaky" and seen <= FLAKY_FAILURES:
            return JSONResponse({"error": "busy"}, status_code=503)
        if mode == "forbidden":
            return JSONResponse({"error": "no"}, status_code=403)
        if mode == "slow":
            await asyncio.sleep(SLOW_S)
        if mode == "html":
            return PlainTextResponse("<html>oops</html>")
        if mode == "garbage":
            return JSONResponse({"score": "high"})
        score = float(body["sample"]["output_text"].strip() == str(body["item"].get("answer")))
        return JSONResponse({"score": score, "trace_id": body["trace_id"]})

    @app.post("/emb/{mode}/v1/embeddings")
    async def embeddings(mode: str, request: Request) -> Response:
        body = await body_of(request)
        state.record(request.url.path, body, dict(request.headers))
        if mode == "down":
            return JSONResponse({"error": {"message": "down"}}, status_code=503)
        data = [{"object": "embedding", "index": i, "embedding": letter_vector(t)} for i, t in enumerate(body["input"])]
        data.reverse()  # out of order on purpose: the client must place them by index
        return JSONResponse({"object": "list", "data": data, "model": body["model"]})

    return app


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Servers:
    url: str  # http://127.0.0.1:<port>
    state: State
    port: int

    def judge(self, mode: str = "sum") -> str:
        return f"{self.url}/judge/{mode}/v1"

    def grader(self, mode: str = "sum") -> str:
        return f"{self.url}/grade/{mode}"

    def embeddings(self, mode: str = "letters") -> str:
        return f"{self.url}/emb/{mode}/v1"


@contextmanager
def serve_remote_graders() -> Iterator[Servers]:
    """The three services on one free port, for as long as the context lasts."""
    state = State()
    port = free_port()
    config = uvicorn.Config(make_app(state), host="127.0.0.1", port=port, log_level="warning", lifespan="off")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name=f"remote-graders-{port}", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the remote grader servers did not start")
        time.sleep(0.02)
    try:
        yield Servers(f"http://127.0.0.1:{port}", state, port)
    finally:
        server.should_exit = True
        thread.join(timeout=10)

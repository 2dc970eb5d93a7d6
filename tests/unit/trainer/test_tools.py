"""trainer.agents.tools.HttpToolExecutor against real HTTP servers on this machine (http.server in a thread): the
request it sends, the answers it accepts, and every way a tool server can fail (slow, down, 5xx, garbage, too large,
4xx, refused by the URL policy), each a ToolResult within the time limits, never an exception or a hang."""

from __future__ import annotations

import asyncio
import json
import re
import socket
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from tests.waiting import wait_until
from trainer.agents.tools import MAX_TOOL_BYTES, HttpToolExecutor, ToolResult
from trainer.grading.remote_graders import RemoteConfig
from trainer.spec.agent_spec import ToolSpec

pytestmark = pytest.mark.alone  # time limits and latencies: under pytest-xdist, no other test beside them

TRACE = "trace_0123456789abcdef0123456789abcdef"
ITEM = {"question": "What is 2 + 40?", "answer": "42", "tags": ["sum", 1.5, None]}
LOOPBACK = RemoteConfig(
    url_schemes=("http",), allow_networks=("127.0.0.0/8",), timeout_s=5.0, max_retries=2, backoff_s=0.01
)


@dataclass(frozen=True)
class Call:
    id: str = "call_7f3a"
    name: str = "calculator"
    arguments: str = '{"expression": "2 + 40"}'


@dataclass
class Seen:
    path: str
    headers: dict[str, str]  # names in lower case
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


Body = bytes | Iterable[bytes]
"""A whole answer (sent with its Content-Length), or chunks sent until the client hangs up (no length: HTTP/1.0)."""
Responder = Callable[["ToolServer", int], tuple[int, Body]]
"""(the server, the index of this request) → (status, body)."""


def answer(output: Any, call_id: str = Call.id) -> bytes:
    return json.dumps({"type": "function_call_output", "call_id": call_id, "id": "fco_1", "output": output}).encode()


@dataclass
class ToolServer:
    """An HTTP server on 127.0.0.1 that records every request and answers with `respond`; counts the requests in
    flight (and the most at once) and the bytes of answer it managed to send."""

    respond: Responder
    requests: list[Seen] = field(default_factory=list)
    in_flight: int = 0
    max_in_flight: int = 0
    sent_bytes: int = 0
    stop: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                with server.lock:
                    n = len(server.requests)
                    server.requests.append(Seen(self.path, {k.lower(): v for k, v in self.headers.items()}, body))
                    server.in_flight += 1
                    server.max_in_flight = max(server.max_in_flight, server.in_flight)
                try:
                    status, content = server.respond(server, n)
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    if isinstance(content, bytes):
                        self.send_header("Content-Length", str(len(content)))
                        self.end_headers()
                        self.wfile.write(content)
                    else:
                        self.end_headers()
                        for chunk in content:
                            self.wfile.write(chunk)
                            server.sent_bytes += len(chunk)
                except (BrokenPipeError, ConnectionResetError):  # the client gave up: what these tests provoke
                    pass
                finally:
                    with server.lock:
                        server.in_flight -= 1

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.httpd.block_on_close = False
        self.port = self.httpd.server_address[1]
        threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/tool"

    def close(self) -> None:
        self.stop.set()
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def serve() -> Iterator[Callable[[Responder], ToolServer]]:
    servers: list[ToolServer] = []

    def start(respond: Responder) -> ToolServer:
        servers.append(ToolServer(respond))
        return servers[-1]

    yield start
    for server in servers:
        server.close()


def tool(url: str, **overrides: Any) -> ToolSpec:
    values: dict[str, Any] = {"name": "calculator", "server_url": url, "headers": {"Authorization": "Bearer t-1"}}
    return ToolSpec(**{**values, **overrides})


def call_once(config: RemoteConfig, spec: ToolSpec | None, call: Call = Call(), **kw: Any) -> ToolResult:
    with HttpToolExecutor(config, **kw) as executor:
        return executor.call(call, spec, item=ITEM, trace_id=TRACE)


def ok(output: str = "42") -> Responder:
    """Answers `output` to every call, for the call id it was sent."""
    return lambda server, n: (200, answer(output, call_id=server.requests[n].json()["call_id"]))


def closed_port() -> int:
    """A port on 127.0.0.1 where nothing listens (bound, then released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class TestCall:
    def test_posts_a_function_call_item_with_the_tools_headers_and_returns_the_output(self, serve: Any) -> None:
        server = serve(ok("42"))
        with HttpToolExecutor(LOOPBACK) as executor:
            first = executor.call(Call(), tool(server.url), item=ITEM, trace_id=TRACE)
            second = executor.call(Call(id="call_2"), tool(server.url), item=ITEM, trace_id=TRACE)
        assert first.output == "42" and first.error is None and first.done is False
        assert 0 < first.seconds < 5
        assert (second.output, second.error) == ("42", None)
        [one, two] = server.requests
        assert one.path == "/tool"
        body = one.json()
        assert re.fullmatch(r"fc_[0-9a-f]{32}", body.pop("id"))
        assert body == {
            "type": "function_call",
            "call_id": "call_7f3a",
            "name": "calculator",
            "arguments": '{"expression": "2 + 40"}',
            "trace_id": TRACE,
            "item": ITEM,
        }
        assert one.headers["authorization"] == "Bearer t-1"
        assert one.headers["content-type"] == "application/json"
        assert one.headers["host"] == f"127.0.0.1:{server.port}"
        assert two.json()["id"] != one.json()["id"] and two.json()["trace_id"] == TRACE
        assert two.json()["call_id"] == "call_2"

    def test_an_answer_for_another_call_id_is_a_bad_answer(self, serve: Any) -> None:
        server = serve(lambda s, n: (200, answer("42", call_id="call_other")))
        result = call_once(LOOPBACK, tool(server.url))
        assert result.error == "bad_answer" and "not a function_call_output" in result.output

    def test_a_non_string_output_is_shown_as_its_json(self, serve: Any) -> None:
        server = serve(lambda s, n: (200, answer({"sum": 42, "exact": True})))
        assert call_once(LOOPBACK, tool(server.url)).output == '{"sum": 42, "exact": true}'

    def test_an_answer_of_only_an_output_is_accepted(self, serve: Any) -> None:
        server = serve(lambda s, n: (200, b'{"output": "7"}'))
        result = call_once(LOOPBACK, tool(server.url))
        assert (result.output, result.error) == ("7", None)

    def test_a_host_name_is_resolved_once_and_the_request_pinned_to_its_checked_address(self, serve: Any) -> None:
        server = serve(ok())
        asked: list[tuple[str, int]] = []

        async def resolver(host: str, port: int) -> list[str]:
            asked.append((host, port))
            return ["127.0.0.1"]

        result = call_once(LOOPBACK, tool(f"http://tools.test:{server.port}/tool"), resolver=resolver)
        assert result.error is None
        assert asked == [("tools.test", server.port)]
        assert server.requests[0].headers["host"] == f"tools.test:{server.port}"  # connected to 127.0.0.1 itself

    def test_a_tools_own_host_header_cannot_undo_the_pinning(self, serve: Any) -> None:
        server = serve(ok())
        headers = {"host": "metadata.internal", "Content-Type": "text/plain", "X-Key": "k-1"}
        assert call_once(LOOPBACK, tool(server.url, headers=headers)).error is None
        seen = server.requests[0].headers
        assert (seen["host"], seen["content-type"], seen["x-key"]) == (
            f"127.0.0.1:{server.port}",
            "application/json",
            "k-1",
        )

    def test_a_host_that_does_not_resolve_in_time_is_a_timeout(self) -> None:
        async def resolver(host: str, port: int) -> list[str]:
            await asyncio.sleep(30)
            return ["127.0.0.1"]

        config = LOOPBACK.model_copy(update={"timeout_s": 0.3})
        result = call_once(config, tool("http://tools.test/tool"), resolver=resolver)
        assert result.error == "timeout" and "did not resolve" in result.output
        assert 0.3 <= result.seconds < 0.3 + 1.0


class TestRefused:
    def test_loopback_is_refused_under_a_policy_that_does_not_allow_it(self, serve: Any) -> None:
        server = serve(ok())
        result = call_once(RemoteConfig(url_schemes=("http",)), tool(server.url))
        assert result.error == "refused_url"
        assert "127.0.0.1 is a loopback address" in result.output
        assert server.requests == []

    def test_a_name_that_resolves_to_loopback_is_refused(self, serve: Any) -> None:
        server = serve(ok())

        async def resolver(host: str, port: int) -> list[str]:
            return ["127.0.0.1"]

        url = f"http://tools.test:{server.port}/tool"
        result = call_once(RemoteConfig(url_schemes=("http",)), tool(url), resolver=resolver)
        assert result.error == "refused_url" and "resolves to 127.0.0.1" in result.output
        assert server.requests == []

    def test_a_scheme_the_deployment_does_not_allow_is_refused(self, serve: Any) -> None:
        server = serve(ok())
        result = call_once(LOOPBACK.model_copy(update={"url_schemes": ("https",)}), tool(server.url))
        assert result.error == "refused_url" and "https://" in result.output
        assert server.requests == []

    def test_no_tool_or_a_tool_without_a_server_is_an_unknown_tool(self) -> None:
        assert call_once(LOOPBACK, None).error == "unknown_tool"
        assert call_once(LOOPBACK, tool("http://127.0.0.1:1/", name="other")).error == "unknown_tool"
        result = call_once(LOOPBACK, tool("x", server_url=None))
        assert result.error == "unknown_tool" and "no server" in result.output


class TestFailures:
    def test_a_slow_server_is_cut_at_the_timeout(self, serve: Any) -> None:
        server = serve(lambda s, n: (s.stop.wait(30), (200, answer("late")))[1])
        config = LOOPBACK.model_copy(update={"timeout_s": 0.5, "max_retries": 0})
        start = time.monotonic()
        result = call_once(config, tool(server.url))
        wall = time.monotonic() - start
        assert result.error == "timeout" and "after 1 try" in result.output
        assert 0.5 <= result.seconds <= wall < 0.5 + 1.0

    def test_each_retry_of_a_slow_server_has_its_own_timeout(self, serve: Any) -> None:
        server = serve(lambda s, n: (s.stop.wait(30), (200, answer("late")))[1])
        config = LOOPBACK.model_copy(update={"timeout_s": 0.4, "max_retries": 1})
        result = call_once(config, tool(server.url))
        assert result.error == "timeout" and "after 2 tries" in result.output
        assert 0.8 <= result.seconds < 0.8 + 1.0
        assert len(server.requests) == 2

    def test_a_server_that_is_down_is_a_connection_error_after_the_retries(self) -> None:
        result = call_once(LOOPBACK, tool(f"http://127.0.0.1:{closed_port()}/tool"))
        assert result.error == "connection" and "after 3 tries" in result.output
        assert result.seconds < 2.0

    @pytest.mark.parametrize("status", [500, 503, 429])
    def test_a_5xx_or_429_is_retried_until_the_server_answers(self, serve: Any, status: int) -> None:
        server = serve(lambda s, n: (status, b'{"error": "busy"}') if n < 2 else (200, answer("42")))
        result = call_once(LOOPBACK, tool(server.url))
        assert (result.output, result.error) == ("42", None)
        assert len(server.requests) == 3
        assert len({r.json()["id"] for r in server.requests}) == 1  # the same call, retried

    def test_a_server_failing_every_try_is_an_http_status_error_with_the_status(self, serve: Any) -> None:
        server = serve(lambda s, n: (503, b"down for maintenance"))
        result = call_once(LOOPBACK, tool(server.url))
        assert result.error == "http_status" and result.done is False
        assert "HTTP 503: down for maintenance (after 3 tries)" in result.output
        assert len(server.requests) == 3

    @pytest.mark.parametrize(
        "body",
        [
            b"the answer is 42",
            b"",
            b"[1, 2]",
            b'{"result": 42}',
            b'{"type": "message", "output": "42"}',
            b'{"output": NaN}',
            b"\xff\xfe{",
        ],
    )
    def test_an_answer_that_is_not_a_function_call_output_is_a_bad_answer(self, serve: Any, body: bytes) -> None:
        server = serve(lambda s, n: (200, body))
        result = call_once(LOOPBACK, tool(server.url))
        assert result.error == "bad_answer" and result.output.startswith("Error: ")
        assert len(server.requests) == 1  # not retried

    def test_a_4xx_without_output_shows_its_payload_as_it_came(self, serve: Any) -> None:
        payload = b'{"error": {"message": "no city named Atlantis", "code": 404}}'
        server = serve(lambda s, n: (404, payload))
        result = call_once(LOOPBACK, tool(server.url))
        assert (result.output, result.error) == (payload.decode(), "http_status")
        assert len(server.requests) == 1

    def test_a_4xx_with_an_output_shows_the_output(self, serve: Any) -> None:
        server = serve(lambda s, n: (400, answer("expression is missing")))
        result = call_once(LOOPBACK, tool(server.url))
        assert (result.output, result.error) == ("expression is missing", "http_status")

    def test_an_empty_4xx_names_its_status(self, serve: Any) -> None:
        server = serve(lambda s, n: (403, b""))
        result = call_once(LOOPBACK, tool(server.url))
        assert result.error == "http_status" and "HTTP 403" in result.output

    def test_a_redirect_is_not_followed(self, serve: Any) -> None:
        server = serve(lambda s, n: (302, b""))
        result = call_once(LOOPBACK, tool(server.url))
        assert result.error == "http_status" and "redirect" in result.output
        assert len(server.requests) == 1


class TestSizes:
    def test_an_answer_of_exactly_the_bound_is_read_and_one_byte_more_is_too_large(self, serve: Any) -> None:
        def sized(n: int) -> bytes:
            body = answer("")
            return answer("x" * (n - len(body)))

        server = serve(lambda s, i: (200, sized(1000 + i)))
        with HttpToolExecutor(LOOPBACK, max_bytes=1000) as executor:
            fits = executor.call(Call(), tool(server.url), item=ITEM, trace_id=TRACE)
            over = executor.call(Call(), tool(server.url), item={}, trace_id=TRACE)
        assert fits.error is None and len(answer(fits.output)) == 1000
        assert over.error == "too_large" and "larger than 1000 bytes" in over.output

    def test_an_endless_answer_is_cut_at_the_bound_without_reading_the_rest(self, serve: Any) -> None:
        chunk = b"x" * (64 << 10)
        total = 256 << 20

        def endless(server: ToolServer, n: int) -> tuple[int, Body]:
            return 200, (chunk for _ in range(total // len(chunk)) if not server.stop.is_set())

        server = serve(endless)
        result = call_once(LOOPBACK, tool(server.url))
        assert result.error == "too_large" and f"larger than {MAX_TOOL_BYTES} bytes" in result.output
        assert result.seconds < 3.0
        wait_until(lambda: server.in_flight == 0, "the server's last write to fail", timeout=30)
        assert server.sent_bytes < 32 << 20  # socket buffers hold some; reading it all would have taken 256 MiB
        assert len(server.requests) == 1  # not retried

    def test_a_request_over_the_bound_is_not_sent(self, serve: Any) -> None:
        server = serve(ok())
        with HttpToolExecutor(LOOPBACK) as executor:
            result = executor.call(Call(), tool(server.url), item={"text": "x" * MAX_TOOL_BYTES}, trace_id=TRACE)
        assert result.error == "too_large" and f"at most {MAX_TOOL_BYTES} are sent" in result.output
        assert server.requests == []


class TestConcurrency:
    def test_at_most_concurrency_requests_are_in_flight_per_server(self, serve: Any) -> None:
        def slow(server: ToolServer, n: int) -> tuple[int, Body]:
            time.sleep(0.3)
            return 200, answer(str(n))

        server = serve(slow)
        config = LOOPBACK.model_copy(update={"concurrency": 2})
        start = time.monotonic()
        with HttpToolExecutor(config) as executor, ThreadPoolExecutor(8) as pool:
            results = list(
                pool.map(lambda i: executor.call(Call(), tool(server.url), item={"i": i}, trace_id=TRACE), range(8))
            )
        elapsed = time.monotonic() - start
        assert all(r.error is None for r in results)
        assert sorted(int(r.output) for r in results) == list(range(8))
        assert server.max_in_flight == 2
        assert elapsed >= 4 * 0.3 - 0.05  # 8 calls, 2 at a time

    def test_the_bound_is_per_server_so_two_servers_are_called_at_once(self, serve: Any) -> None:
        def slow(server: ToolServer, n: int) -> tuple[int, Body]:
            time.sleep(0.3)
            return 200, answer("ok")

        servers = [serve(slow), serve(slow)]
        config = LOOPBACK.model_copy(update={"concurrency": 1})
        start = time.monotonic()
        with HttpToolExecutor(config) as executor, ThreadPoolExecutor(4) as pool:
            urls = [s.url for s in servers for _ in range(2)]
            results = list(pool.map(lambda u: executor.call(Call(), tool(u), item={}, trace_id=TRACE), urls))
        elapsed = time.monotonic() - start
        assert [r.error for r in results] == [None] * 4
        assert [s.max_in_flight for s in servers] == [1, 1]
        assert [len(s.requests) for s in servers] == [2, 2]
        assert elapsed < 4 * 0.3  # the servers' queues ran side by side: about 2 × 0.3 s


class TestLifecycle:
    def test_start_keeps_the_prompt_and_finish_and_close_are_idempotent(self) -> None:
        executor = HttpToolExecutor(LOOPBACK)
        assert executor.start(ITEM, TRACE, [{"role": "user", "content": "hi"}]) is None
        executor.finish(TRACE)
        executor.close()
        executor.close()
        with pytest.raises(RuntimeError, match="closed"):
            executor.call(Call(), tool("http://127.0.0.1:1/"), item=ITEM, trace_id=TRACE)

    def test_close_ends_a_call_in_flight_with_an_error(self, serve: Any) -> None:
        server = serve(lambda s, n: (s.stop.wait(30), (200, answer("late")))[1])
        executor = HttpToolExecutor(LOOPBACK.model_copy(update={"timeout_s": 30.0}))
        with ThreadPoolExecutor(1) as pool:
            pending = pool.submit(executor.call, Call(), tool(server.url), item=ITEM, trace_id=TRACE)
            wait_until(lambda: server.requests, "the call to reach the server", timeout=10)
            start = time.monotonic()
            executor.close()
            result = pending.result(timeout=5)
        assert result.error == "connection" and time.monotonic() - start < 5

"""Tests for trainer/agents/calculator_server.py: the expression language, the agent-RFT wire shape over HTTP (ASGI, and
one real socket for the latency overlap)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from fastapi.testclient import TestClient

from trainer.agents.calculator_server import (
    FUNCTION,
    MAX_BODY_BYTES,
    MAX_EXPRESSION_CHARS,
    TOOL_NAME,
    CalculatorError,
    answer_call,
    calculator_tool,
    create_app,
    evaluate_expression,
    make_server,
)
from trainer.spec.agent_spec import AgentSpec, ToolSpec


def _call(arguments: str, **fields: object) -> dict[str, object]:
    body: dict[str, object] = {
        "type": "function_call",
        "id": "fc_1a2b",
        "call_id": "call_3c4d",
        "name": TOOL_NAME,
        "arguments": arguments,
        "trace_id": "trace_5e6f",
        "item": {"messages": [{"role": "user", "content": "What is 23 + 58 + 71?"}], "answer": "152"},
    }
    body.update(fields)
    return body


@pytest.fixture(scope="module")
def client() -> Iterator[TestClient]:
    with TestClient(create_app()) as c:
        yield c


# --- the expression language --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("expression", "value"),
    [
        ("23+58+71", 152),
        ("2+3*4", 14),
        ("(2+3)*4", 20),
        ("10-4-3", 3),
        ("-5", -5),
        ("-5--3", -2),
        ("+7", 7),
        ("2*-3", -6),
        (" 12 + 30 ", 42),
        ("((1))", 1),
        ("0", 0),
        ("123456789*987654321", 121932631112635269),
    ],
)
def test_evaluate_expression_computes_integer_arithmetic_with_precedence(expression: str, value: int) -> None:
    assert evaluate_expression(expression) == value


@pytest.mark.parametrize(
    ("expression", "message"),
    [
        ("", "empty"),
        ("   ", "empty"),
        ("1+", "ends too early"),
        ("(1+2", "ends too early"),
        ("1)", "unexpected '\\)'"),
        ("1 2", "unexpected '2'"),
        ("2**3", "unexpected '\\*'"),
        ("7/2", "unexpected character '/'"),
        ("1.5", "unexpected character '\\.'"),
        ("0x1f", "unexpected character 'x'"),
        ("__import__('os')", "unexpected character '_'"),
        ("٣+1", "unexpected character"),  # only ASCII digits are numbers
    ],
)
def test_evaluate_expression_rejects_anything_else_with_a_reason(expression: str, message: str) -> None:
    with pytest.raises(CalculatorError, match=message):
        evaluate_expression(expression)


def test_evaluate_expression_bounds_the_expression_length() -> None:
    longest = "1" + "+1" * ((MAX_EXPRESSION_CHARS - 1) // 2)
    assert len(longest) <= MAX_EXPRESSION_CHARS
    assert evaluate_expression(longest) == (MAX_EXPRESSION_CHARS - 1) // 2 + 1
    with pytest.raises(CalculatorError, match="longer than"):
        evaluate_expression("1" * (MAX_EXPRESSION_CHARS + 1))
    # Nesting as deep as the length allows parses without exhausting the stack.
    depth = MAX_EXPRESSION_CHARS // 2 - 1
    assert evaluate_expression("(" * depth + "7" + ")" * depth) == 7
    assert evaluate_expression("-" * (MAX_EXPRESSION_CHARS - 1) + "7") == -7


def test_answer_call_reads_the_expression_argument() -> None:
    assert answer_call(TOOL_NAME, '{"expression": "23+58+71"}') == "152"
    assert answer_call(TOOL_NAME, '{"expression":"2*-3"}') == "-6"


@pytest.mark.parametrize(
    ("name", "arguments", "message"),
    [
        ("search", '{"expression": "1+1"}', "unknown tool 'search'"),
        (TOOL_NAME, "{expression: 1}", "not JSON"),
        (TOOL_NAME, '"1+1"', "must be"),
        (TOOL_NAME, '{"expression": 2}', "must be"),
        (TOOL_NAME, '{"expression": "1+1", "precision": 2}', "must be"),
        (TOOL_NAME, "{}", "must be"),
    ],
)
def test_answer_call_rejects_bad_tools_and_arguments(name: str, arguments: str, message: str) -> None:
    with pytest.raises(CalculatorError, match=message):
        answer_call(name, arguments)


def test_calculator_tool_is_a_valid_job_tool_whose_definition_is_the_function() -> None:
    entry = calculator_tool("http://127.0.0.1:8765/", headers={"Authorization": "Bearer k"})
    spec = ToolSpec.model_validate(entry)
    assert spec.function() == FUNCTION
    assert AgentSpec(tools=[spec]).by_name() == {TOOL_NAME: spec}
    assert spec.headers == {"Authorization": "Bearer k"}


# --- the wire shape (ASGI) ----------------------------------------------------------------------------------


def test_a_call_is_answered_with_a_function_call_output(client: TestClient) -> None:
    response = client.post("/", json=_call('{"expression": "23+58+71"}'))
    assert response.status_code == 200
    assert response.json() == {
        "type": "function_call_output",
        "call_id": "call_3c4d",
        "id": "fc_1a2b",
        "output": "152",
    }


def test_a_call_without_an_id_echoes_null(client: TestClient) -> None:
    body = _call('{"expression": "2*3"}')
    del body["id"]
    assert client.post("/", json=body).json() == {
        "type": "function_call_output",
        "call_id": "call_3c4d",
        "id": None,
        "output": "6",
    }


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (_call('{"expression": "1+"}'), "ends too early"),
        (_call("not json"), "arguments are not JSON"),
        (_call('{"expr": "1+1"}'), "must be"),
        (_call('{"expression": "1+1"}', name="search"), "unknown tool"),
        (_call('{"expression": "1+1"}', type="message"), "type must be 'function_call'"),
        ({k: v for k, v in _call('{"expression": "1"}').items() if k != "call_id"}, "call_id: Field required"),
        (_call({"expression": "1+1"}), "arguments: Input should be a valid string"),  # type: ignore[arg-type]
    ],
)
def test_a_bad_call_is_a_400_with_an_error_and_no_output(
    client: TestClient, body: dict[str, object], message: str
) -> None:
    response = client.post("/", json=body)
    assert response.status_code == 400
    payload = response.json()
    assert set(payload) == {"error"}
    assert message in payload["error"]


def test_a_body_that_is_not_json_is_a_400(client: TestClient) -> None:
    response = client.post("/", content=b"{not json", headers={"content-type": "application/json"})
    assert response.status_code == 400
    assert set(response.json()) == {"error"}


def test_a_body_over_one_megabyte_is_a_413(client: TestClient) -> None:
    padding = "x" * MAX_BODY_BYTES
    response = client.post("/", json=_call('{"expression": "1"}', item={"padding": padding}))
    assert response.status_code == 413
    assert set(response.json()) == {"error"}


def test_a_chunked_body_over_one_megabyte_is_a_413(client: TestClient) -> None:
    def chunks() -> Iterator[bytes]:
        for _ in range(MAX_BODY_BYTES // 65536 + 2):
            yield b" " * 65536

    response = client.post("/", content=chunks(), headers={"content-type": "application/json"})
    assert response.request.headers.get("transfer-encoding") == "chunked"
    assert "content-length" not in response.request.headers
    assert response.status_code == 413


def test_health_names_the_tool(client: TestClient) -> None:
    assert client.get("/health").json() == {"status": "ok", "tool": TOOL_NAME}


def test_latency_delays_every_answer_errors_included() -> None:
    with TestClient(create_app(latency_s=0.2)) as slow:
        for arguments, status in (('{"expression": "1+1"}', 200), ("{", 400)):
            started = time.monotonic()
            assert slow.post("/", json=_call(arguments)).status_code == status
            assert time.monotonic() - started >= 0.2


@pytest.mark.parametrize("latency_s", [-0.1, 61.0])
def test_create_app_rejects_a_latency_out_of_range(latency_s: float) -> None:
    with pytest.raises(ValueError, match="latency_s"):
        create_app(latency_s)


# --- a real socket ------------------------------------------------------------------------------------------


@pytest.mark.alone
def test_real_server_overlaps_the_latency_of_concurrent_calls() -> None:
    """Eight calls at 0.5 s each, sent at once, finish in well under 8 × 0.5 s: the waits overlap."""
    server = make_server("127.0.0.1", 0, latency_s=0.5)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 10
        while not server.started:
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.02)
        port = server.servers[0].sockets[0].getsockname()[1]
        url = f"http://127.0.0.1:{port}/"

        def post(i: int) -> httpx.Response:
            return httpx.post(url, json=_call(json.dumps({"expression": f"{i}*{i}"}), call_id=f"call_{i}"), timeout=10)

        started = time.monotonic()
        with ThreadPoolExecutor(8) as pool:
            responses = list(pool.map(post, range(8)))
        elapsed = time.monotonic() - started
        assert [r.json()["output"] for r in responses] == [str(i * i) for i in range(8)]
        assert [r.json()["call_id"] for r in responses] == [f"call_{i}" for i in range(8)]
        assert 0.5 <= elapsed < 2.0
    finally:
        server.should_exit = True
        thread.join(timeout=10)
    assert not thread.is_alive()

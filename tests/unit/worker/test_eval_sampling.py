"""worker.evals' completions: an inference server that refuses for now (429, 5xx) is retried within the deadline,
and one that keeps refusing fails the run ``inference_unavailable`` rather than erroring every item; a 200 that is
not a chat completion errors the item (``invalid_response``) rather than the whole run."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import anyio
import pytest
from fastapi.responses import Response

from api.services import inference as inference_service
from worker import evals

TARGET = inference_service.Target(model="tiny-arith", served="tiny-arith", adapter=None)
SOURCE = {"input_messages": {"type": "template", "template": [{"role": "user", "content": "{{item.q}}"}]}}
COMPLETION = {"choices": [{"message": {"role": "assistant", "content": "4"}, "finish_reason": "stop"}]}


def _sample(monkeypatch: pytest.MonkeyPatch, answers: list[Response], *, timeout_s: float = 5.0) -> Any:
    """What sample_one makes of the server's ``answers`` (one per try; the last repeats); and the tries."""
    tries: list[int] = []

    async def forward(**kw: Any) -> Response:
        tries.append(1)
        return answers[min(len(tries), len(answers)) - 1]

    monkeypatch.setattr(evals.inference_service, "forward", forward)
    monkeypatch.setattr(evals, "RETRY_FIRST_S", 0.01)
    settings: Any = SimpleNamespace(inference_timeout_s=timeout_s)
    sampled = anyio.run(evals.sample_one, settings, TARGET, SOURCE, {"q": "2 + 2"})
    return sampled, len(tries)


def _json(status: int, body: Any) -> Response:
    return Response(json.dumps(body).encode(), status_code=status, media_type="application/json")


def test_a_server_refusing_for_now_is_retried_until_it_answers(monkeypatch: pytest.MonkeyPatch) -> None:
    busy = _json(429, {"error": {"message": "overloaded"}})
    restarting = _json(503, {"error": {"message": "loading"}})
    sampled, tries = _sample(monkeypatch, [busy, restarting, _json(200, COMPLETION)])
    assert (sampled.error, sampled.text, tries) == (None, "4", 3)


def test_a_server_that_keeps_refusing_fails_the_run_not_the_items(monkeypatch: pytest.MonkeyPatch) -> None:
    sampled, tries = _sample(monkeypatch, [_json(503, {"error": {"message": "down"}})], timeout_s=0.2)
    assert sampled.error["code"] == "inference_unavailable" and tries > 1
    assert "answered 503 to every try within 0.2 s" in sampled.error["message"]
    with pytest.raises(evals.RunFailed) as failed:
        evals.check_available([evals.Sampled(text="4"), sampled])
    assert failed.value.code == "inference_unavailable"
    evals.check_available([evals.Sampled(text="", error={"code": "invalid_input", "message": "no q"})])  # an item's


def test_a_client_error_is_the_items_and_not_retried(monkeypatch: pytest.MonkeyPatch) -> None:
    sampled, tries = _sample(monkeypatch, [_json(400, {"error": {"code": "context_length", "message": "long"}})])
    assert (sampled.error, tries) == ({"code": "context_length", "message": "long"}, 1)


@pytest.mark.parametrize(
    "answer",
    [
        Response(b"<html>proxy error</html>", status_code=200),
        _json(200, {"choices": []}),
        _json(200, {"choices": [{"message": None}]}),
        _json(200, {"choices": ["text"]}),
        _json(200, ["not", "an", "object"]),
    ],
)
def test_a_200_that_is_not_a_chat_completion_errors_the_item(monkeypatch: pytest.MonkeyPatch, answer: Response) -> None:
    sampled, _ = _sample(monkeypatch, [answer])
    assert sampled.error["code"] == "invalid_response" and sampled.sample["error"] == sampled.error
    evals.check_available([sampled])  # the item's, not the run's

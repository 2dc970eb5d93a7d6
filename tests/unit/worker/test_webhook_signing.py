"""Webhooks as OpenAI sends them: the payload and Standard Webhooks signature (``api.webhook_events``) verified by
the official client's ``webhooks.unwrap``, and one delivery attempt (``worker.webhooks.post``) against a real local
HTTP receiver, pinned to the address the SSRF policy checked."""

from __future__ import annotations

import http.server
import json
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from openai import InvalidWebhookSignatureError, OpenAI

from api import webhook_events
from api.repositories.webhooks import DueDelivery
from api.settings import Settings
from api.status import JobStatus
from trainer.grading.url_policy import CLIENT_OPTIONS, UrlPolicy
from worker.webhooks import post, retry_delay

CLIENT = OpenAI(api_key="unused", base_url="http://127.0.0.1:9/v1")
JOB = "ftjob-abc123"


def signed(
    *, secret: str, event_type: str = "fine_tuning.job.succeeded", timestamp: int | None = None, secrets: Any = None
) -> tuple[bytes, dict[str, str]]:
    body = webhook_events.payload(event_id="evt_1", event_type=event_type, created_at=1_700_000_000, subject_id=JOB)
    ts = int(time.time()) if timestamp is None else timestamp
    return body, webhook_events.headers(secrets=secrets or [secret], msg_id="evt_1", timestamp=ts, body=body)


class TestSignature:
    @pytest.mark.parametrize(
        ("status", "event_type"),
        [
            (JobStatus.SUCCEEDED, "fine_tuning.job.succeeded"),
            (JobStatus.FAILED, "fine_tuning.job.failed"),
            (JobStatus.CANCELLED, "fine_tuning.job.cancelled"),
        ],
    )
    def test_the_official_client_unwraps_each_of_openais_job_events(self, status: JobStatus, event_type: str) -> None:
        secret = webhook_events.new_secret()
        assert webhook_events.event_type_for(status) == event_type
        body, headers = signed(secret=secret, event_type=event_type)
        event = CLIENT.webhooks.unwrap(body, headers, secret=secret)
        assert event.type == event_type
        assert event.id == "evt_1" and event.object == "event" and event.created_at == 1_700_000_000
        assert event.data.id == JOB  # type: ignore[union-attr]

    def test_the_payload_is_openais_event_object_exactly(self) -> None:
        body, _ = signed(secret=webhook_events.new_secret())
        assert json.loads(body) == {
            "id": "evt_1",
            "object": "event",
            "created_at": 1_700_000_000,
            "type": "fine_tuning.job.succeeded",
            "data": {"id": JOB},
        }

    def test_our_paused_event_verifies_with_the_official_client(self) -> None:
        secret = webhook_events.new_secret()
        assert webhook_events.event_type_for(JobStatus.PAUSED) == "fine_tuning.job.paused"
        body, headers = signed(secret=secret, event_type="fine_tuning.job.paused")
        CLIENT.webhooks.verify_signature(body, headers, secret=secret)  # raises when it does not verify
        assert json.loads(body)["type"] == "fine_tuning.job.paused"

    def test_statuses_that_are_not_an_end_or_a_pause_send_no_event(self) -> None:
        for status in (JobStatus.VALIDATING_FILES, JobStatus.QUEUED, JobStatus.RUNNING):
            assert webhook_events.event_type_for(status) is None

    def test_a_tampered_body_is_rejected(self) -> None:
        secret = webhook_events.new_secret()
        body, headers = signed(secret=secret)
        tampered = body.replace(JOB.encode(), b"ftjob-other")
        with pytest.raises(InvalidWebhookSignatureError):
            CLIENT.webhooks.unwrap(tampered, headers, secret=secret)

    def test_a_timestamp_older_than_five_minutes_is_rejected(self) -> None:
        secret = webhook_events.new_secret()
        body, headers = signed(secret=secret, timestamp=int(time.time()) - 301)
        with pytest.raises(InvalidWebhookSignatureError, match="too old"):
            CLIENT.webhooks.unwrap(body, headers, secret=secret)

    def test_another_secret_is_rejected(self) -> None:
        body, headers = signed(secret=webhook_events.new_secret())
        with pytest.raises(InvalidWebhookSignatureError):
            CLIENT.webhooks.unwrap(body, headers, secret=webhook_events.new_secret())

    def test_while_an_old_secret_is_kept_both_verify(self) -> None:
        new, old = webhook_events.new_secret(), webhook_events.new_secret()
        body, headers = signed(secret=new, secrets=[new, old])
        assert len(headers["webhook-signature"].split()) == 2
        for secret in (new, old):
            assert CLIENT.webhooks.unwrap(body, headers, secret=secret).data.id == JOB  # type: ignore[union-attr]

    def test_a_secret_is_whsec_and_32_random_bytes_in_base64(self) -> None:
        import base64

        a, b = webhook_events.new_secret(), webhook_events.new_secret()
        assert a.startswith("whsec_") and a != b
        assert len(base64.b64decode(a.removeprefix("whsec_"))) == 32
        assert webhook_events.secret_hint(a) == f"whsec_…{a[-4:]}"


def test_retries_wait_twice_as_long_each_time_up_to_the_cap() -> None:
    settings = Settings(webhook_retry_base_s=10, webhook_retry_max_delay_s=3600)
    assert [retry_delay(settings, n) for n in range(1, 11)] == [
        10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0, 1280.0, 2560.0, 3600.0,
    ]  # fmt: skip
    assert retry_delay(settings, 500) == 3600.0


# -- one delivery attempt ---------------------------------------------------------------------------------------


class Receiver(http.server.ThreadingHTTPServer):
    status = 200
    received: list[tuple[bytes, dict[str, str]]]


class _Handler(http.server.BaseHTTPRequestHandler):
    server: Receiver

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["content-length"]))
        self.server.received.append((body, {k.lower(): v for k, v in self.headers.items()}))
        self.send_response(self.server.status)
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, *_: Any) -> None:
        pass


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    server = Receiver(("127.0.0.1", 0), _Handler)
    server.received = []
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


LOOPBACK = UrlPolicy(schemes=("http", "https"), allow_networks=("127.0.0.0/8",))


def due(url: str, secret: str) -> DueDelivery:
    return DueDelivery(
        delivery_id=1,
        attempt=1,
        event_id="evt_9",
        event_type="fine_tuning.job.failed",
        event_created_at=1_700_000_000,
        subject_id=JOB,
        endpoint_id="whep_1",
        url=url,
        secrets=(secret,),
    )


class TestPost:
    def test_a_2xx_is_delivered_and_the_receiver_verifies_it_with_the_official_client(self, receiver: Receiver) -> None:
        secret = webhook_events.new_secret()
        url = f"http://127.0.0.1:{receiver.server_address[1]}/hooks?x=1"
        with httpx.Client(**CLIENT_OPTIONS) as client:
            outcome = post(client, LOOPBACK, due(url, secret), timeout=5)
        assert (outcome.status_code, outcome.error, outcome.delivered) == (200, None, True)
        [(body, headers)] = receiver.received
        assert headers["host"] == f"127.0.0.1:{receiver.server_address[1]}"
        event = CLIENT.webhooks.unwrap(body, headers, secret=secret)
        assert (event.id, event.type, event.data.id) == ("evt_9", "fine_tuning.job.failed", JOB)  # type: ignore[union-attr]
        assert headers["webhook-id"] == "evt_9"

    def test_a_5xx_is_a_failure_with_its_status(self, receiver: Receiver) -> None:
        receiver.status = 503
        with httpx.Client(**CLIENT_OPTIONS) as client:
            outcome = post(
                client, LOOPBACK, due(f"http://127.0.0.1:{receiver.server_address[1]}/", "whsec_AAAA"), timeout=5
            )
        assert (outcome.status_code, outcome.error, outcome.delivered) == (503, "HTTP 503", False)

    def test_a_redirect_is_not_followed(self, receiver: Receiver) -> None:
        receiver.status = 307
        with httpx.Client(**CLIENT_OPTIONS) as client:
            outcome = post(
                client, LOOPBACK, due(f"http://127.0.0.1:{receiver.server_address[1]}/", "whsec_AAAA"), timeout=5
            )
        assert (outcome.status_code, outcome.error) == (307, "HTTP 307")
        assert len(receiver.received) == 1

    def test_a_refused_connection_is_a_failure_without_status(self) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]  # closed again: nothing listens there
        with httpx.Client(**CLIENT_OPTIONS) as client:
            outcome = post(client, LOOPBACK, due(f"http://127.0.0.1:{port}/", "whsec_AAAA"), timeout=5)
        assert outcome.status_code is None and outcome.error is not None and "ConnectError" in outcome.error

    def test_an_address_the_policy_refuses_is_never_connected_to(self, receiver: Receiver) -> None:
        url = f"http://localhost:{receiver.server_address[1]}/"  # loopback: refused by the default policy
        with httpx.Client(**CLIENT_OPTIONS) as client:
            outcome = post(client, UrlPolicy(schemes=("http", "https")), due(url, "whsec_AAAA"), timeout=5)
        assert outcome.status_code is None
        assert (
            outcome.error is not None and "loopback" in outcome.error and outcome.error.startswith("the URL is refused")
        )
        assert receiver.received == []

"""Webhooks end to end: a real worker process runs a real job on PostgreSQL + Redis, and a real
local HTTP receiver, verifying each POST with the official client's ``webhooks.unwrap``, gets the job's event.

- a job that succeeds: exactly one verified ``fine_tuning.job.succeeded`` whose ``data.id`` is the job;
- a job cancelled through the API while it trains: ``fine_tuning.job.cancelled``;
- a receiver that is down (connection refused), then answers 500, then comes back: the event arrives after the
  retries, and the endpoint's delivery log shows each failed attempt.

The endpoint is made through the API with the official client; the deployment allows loopback URLs (as
``grader_url_allow_networks`` would for an in-house receiver) and retries fast.
"""

from __future__ import annotations

import http.server
import itertools
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai import OpenAI

from api.auth import create_key
from api.db import session_scope
from tests.integration.conftest import serve

from .conftest import Service, grpo_spec, service_factory

WEBHOOK_ENV = {
    "PROXIMA_GRADER_URL_SCHEMES": '["http", "https"]',
    "PROXIMA_GRADER_URL_ALLOW_NETWORKS": '["127.0.0.0/8"]',
    "PROXIMA_WEBHOOK_POLL_INTERVAL_S": "0.2",
    "PROXIMA_WEBHOOK_TIMEOUT_S": "2",
    "PROXIMA_WEBHOOK_RETRY_BASE_S": "0.5",
    "PROXIMA_WEBHOOK_RETRY_MAX_DELAY_S": "1",
}
VERIFIER = OpenAI(api_key="unused", base_url="http://127.0.0.1:9/v1")


@dataclass
class Deployment:
    service: Service
    api_url: str


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    """One worker and the API on the same PostgreSQL, Redis and store."""
    from api.app import create_app

    with service_factory(tmp_path_factory) as make:
        svc = make()
        svc.env.update(WEBHOOK_ENV)
        svc.start_worker("hooks")
        settings = svc.settings.model_copy(
            update={"grader_url_schemes": ["http", "https"], "grader_url_allow_networks": ["127.0.0.0/8"]}
        )
        with serve(create_app(settings)) as url:
            yield Deployment(svc, url)


class Receiver(http.server.ThreadingHTTPServer):
    """A webhook receiver: answers ``statuses`` in turn (the last from then on), and keeps each event it verified."""

    allow_reuse_address = True
    secret: str
    statuses: list[int]
    verified: list[Any]
    requests: int

    def verify(self, body: bytes, headers: dict[str, str]) -> None:
        self.verified.append(VERIFIER.webhooks.unwrap(body, headers, secret=self.secret))


class _Handler(http.server.BaseHTTPRequestHandler):
    server: Receiver

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["content-length"]))
        self.server.requests += 1
        status = self.server.statuses.pop(0) if len(self.server.statuses) > 1 else self.server.statuses[0]
        if 200 <= status < 300:
            self.server.verify(body, {k: v for k, v in self.headers.items()})  # raises (a 500) when it does not verify
        self.send_response(status)
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, *_: Any) -> None:
        pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def receiving(port: int, secret: str, statuses: list[int]) -> Iterator[Receiver]:
    """A receiver listening on ``port`` until the block ends."""
    server = Receiver(("127.0.0.1", port), _Handler)
    server.secret, server.statuses, server.verified, server.requests = secret, list(statuses), [], 0
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


@dataclass
class TenantClient:
    tenant_id: str
    openai: OpenAI
    http: httpx.Client


@contextmanager
def new_tenant(deployment: Deployment) -> Iterator[TenantClient]:
    """A tenant of its own (its endpoints get only its jobs' events), with a key for the API."""
    with session_scope(deployment.service.url) as s:
        row, key = create_key(s, tenant_name=f"hooks-{time.time_ns()}")
        tenant_id = row.id
    with httpx.Client(base_url=deployment.api_url, headers={"authorization": f"Bearer {key}"}, timeout=30) as c:
        yield TenantClient(tenant_id, OpenAI(api_key=key, base_url=f"{deployment.api_url}/v1", max_retries=0), c)


@pytest.fixture
def tenant(deployment: Deployment) -> Iterator[TenantClient]:
    """A tenant of its own per test."""
    with new_tenant(deployment) as t:
        yield t


def run_job(deployment: Deployment, tenant: TenantClient, data: Path, model: Path, **hp: Any) -> str:
    svc = deployment.service
    svc.tenant = tenant.tenant_id  # the job is the tenant's
    job_id = svc.create_job(grpo_spec(str(model), **hp), data)
    svc.send(job_id)
    return job_id


def deliveries(tenant: TenantClient, endpoint_id: str) -> list[dict[str, Any]]:
    r = tenant.http.get(f"/v1/webhook_endpoints/{endpoint_id}/deliveries", params={"limit": 100})
    assert r.status_code == 200, r.text
    return list(reversed(r.json()["data"]))  # oldest first


def a_later_event_delivered(deployment: Deployment, data: Path, model: Path) -> None:
    """Wait until an event made now, another tenant's, is delivered. The delivery loop has then had a round after
    every delivery so far, and a round POSTs its deliveries oldest first: a delivery left due (sent twice, say) would
    have been POSTed again by then."""
    svc = deployment.service
    with new_tenant(deployment) as probe:
        port = free_port()
        endpoint = probe.openai.webhooks.create(
            name="probe", url=f"http://127.0.0.1:{port}/", event_types=["fine_tuning.job.cancelled"]
        )
        with receiving(port, endpoint.signing_secret, [200]) as receiver:
            owner, svc.tenant = svc.tenant, probe.tenant_id
            try:
                job_id = svc.create_job(grpo_spec(str(model), steps=2), data)  # never sent: cancelled at once
            finally:
                svc.tenant = owner
            assert probe.openai.fine_tuning.jobs.cancel(job_id).status == "cancelled"
            svc.wait_for("a later event's delivery", lambda: receiver.verified, timeout=30)


def test_a_job_that_succeeds_is_delivered_once_verified_by_the_official_client(
    deployment: Deployment, tenant: TenantClient, random_model_dir: Path, arithmetic_data: Path
) -> None:
    port = free_port()
    endpoint = tenant.openai.webhooks.create(
        name="ci", url=f"http://127.0.0.1:{port}/hooks", event_types=["fine_tuning.job.succeeded"]
    )
    with receiving(port, endpoint.signing_secret, [200]) as receiver:
        job_id = run_job(deployment, tenant, arithmetic_data, random_model_dir, steps=2)
        job = deployment.service.wait_status(job_id, "succeeded", "failed", timeout=180)
        assert job.status == "succeeded", job.error
        deployment.service.wait_for("the webhook", lambda: receiver.verified, timeout=30)
        a_later_event_delivered(deployment, arithmetic_data, random_model_dir)  # rounds later: still one
        [event] = receiver.verified
        assert receiver.requests == 1
    assert (event.type, event.object, event.data.id) == ("fine_tuning.job.succeeded", "event", job_id)
    assert event.id.startswith("evt_") and abs(event.created_at - (job.finished_at or 0)) <= 1
    [line] = deliveries(tenant, endpoint.id)
    assert (line["event_id"], line["attempt"], line["status"], line["status_code"]) == (event.id, 1, "delivered", 200)


def test_a_job_cancelled_through_the_api_while_training_sends_cancelled(
    deployment: Deployment, tenant: TenantClient, random_model_dir: Path, arithmetic_data: Path
) -> None:
    port = free_port()
    endpoint = tenant.openai.webhooks.create(
        name="ci",
        url=f"http://127.0.0.1:{port}/",
        event_types=["fine_tuning.job.succeeded", "fine_tuning.job.failed", "fine_tuning.job.cancelled"],
    )
    svc = deployment.service
    with receiving(port, endpoint.signing_secret, [200]) as receiver:
        job_id = run_job(deployment, tenant, arithmetic_data, random_model_dir, steps=500, checkpoint_interval=100)
        svc.wait_for("step 1", lambda: max(svc.metric_steps(job_id), default=0) >= 1, timeout=180)
        assert tenant.openai.fine_tuning.jobs.cancel(job_id).status == "running"  # asked; the worker stops it
        assert svc.wait_status(job_id, "cancelled", "failed", "succeeded", timeout=60).status == "cancelled"
        svc.wait_for("the webhook", lambda: receiver.verified, timeout=30)
        a_later_event_delivered(deployment, arithmetic_data, random_model_dir)
        assert [(e.type, e.data.id) for e in receiver.verified] == [("fine_tuning.job.cancelled", job_id)]
    assert [(d["status"], d["status_code"]) for d in deliveries(tenant, endpoint.id)] == [("delivered", 200)]


def test_a_receiver_down_then_failing_gets_the_event_when_it_comes_back_and_the_log_shows_each_failure(
    deployment: Deployment, tenant: TenantClient, random_model_dir: Path, arithmetic_data: Path
) -> None:
    port = free_port()  # nothing listens there yet: connections are refused
    endpoint = tenant.openai.webhooks.create(
        name="flaky", url=f"http://127.0.0.1:{port}/", event_types=["fine_tuning.job.cancelled"]
    )
    svc = deployment.service
    svc.tenant = tenant.tenant_id
    job_id = svc.create_job(grpo_spec(str(random_model_dir), steps=2), arithmetic_data)  # never sent: no trainer
    assert tenant.openai.fine_tuning.jobs.cancel(job_id).status == "cancelled"
    svc.wait_for("two refused attempts", lambda: len(deliveries(tenant, endpoint.id)) >= 2, timeout=30)
    with receiving(port, endpoint.signing_secret, [500, 500, 200]) as receiver:
        svc.wait_for("the webhook", lambda: receiver.verified, timeout=30)
        [event] = receiver.verified
        assert receiver.requests == 3
    assert (event.type, event.data.id) == ("fine_tuning.job.cancelled", job_id)
    log = deliveries(tenant, endpoint.id)
    refused = [d for d in log if d["status_code"] is None]
    assert len(refused) >= 2 and all("ConnectError" in d["error"] for d in refused)
    assert [(d["status"], d["status_code"]) for d in log[len(refused) :]] == [
        ("retrying", 500),
        ("retrying", 500),
        ("delivered", 200),
    ]
    assert [d["attempt"] for d in log] == list(range(1, len(log) + 1))
    assert {d["event_id"] for d in log} == {event.id}
    for failed, after in itertools.pairwise(log):  # each retry waited for its backoff (0.5 s, then 1 s)
        assert failed["status"] == "retrying" and failed["next_retry_at"] is not None
        assert after["created_at"] >= failed["next_retry_at"] - 1
    assert log[-1]["next_retry_at"] is None

"""Webhook endpoints through the real API, in OpenAI's shape (``client.webhooks.*``): create (the
secret shown once), list, retrieve, update, delete, rotate; 401 without a key, 404 for another tenant's endpoint, 400
naming the field for a bad URL (the endpoint graders' SSRF policy) or event type. The outbox: each path that ends or
pauses a job records its event and one delivery per subscribed endpoint in the same transaction; a worker's delivery
round (``worker.webhooks.deliver_due``, run here in-process) POSTs it to a real local receiver, retries and gives up.

The session's app refuses loopback (its default policy); a second app on the same database allows it, as a
deployment's ``grader_url_allow_networks`` would. Each test uses tenants of its own module, so that no other test's
jobs make deliveries, and deletes what it made."""

from __future__ import annotations

import http.server
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
from openai import OpenAI
from sqlalchemy import select, text

from api.orm import WebhookDelivery, WebhookEvent
from api.repositories import runs
from tests.integration.conftest import (
    Tenant,
    assert_error,
    http_client,
    job_body,
    jsonl,
    make_tenant,
    prompts,
    serve,
    upload,
    validate,
)

ENDPOINTS = "/v1/webhook_endpoints"
PUBLIC_URL = "https://93.184.216.34/hooks"  # a global address as a literal: allowed without any DNS lookup
ALL = [
    "fine_tuning.job.succeeded",
    "fine_tuning.job.failed",
    "fine_tuning.job.cancelled",
    "fine_tuning.job.paused",
    "eval.run.succeeded",
    "eval.run.failed",
    "eval.run.canceled",
]


@pytest.fixture(scope="module")
def owner(settings: Any, base_url: str) -> Tenant:
    return make_tenant(settings, f"hooks-a-{time.time_ns()}")


@pytest.fixture(scope="module")
def other(settings: Any, base_url: str) -> Tenant:
    return make_tenant(settings, f"hooks-b-{time.time_ns()}")


@pytest.fixture
def client(base_url: str, owner: Tenant) -> Iterator[httpx.Client]:
    with http_client(base_url, owner.key) as c:
        yield c
        for endpoint in c.get(ENDPOINTS, params={"limit": 100}).json()["data"]:
            c.delete(f"{ENDPOINTS}/{endpoint['id']}")


@pytest.fixture
def client_b(base_url: str, other: Tenant) -> Iterator[httpx.Client]:
    with http_client(base_url, other.key) as c:
        yield c
        for endpoint in c.get(ENDPOINTS, params={"limit": 100}).json()["data"]:
            c.delete(f"{ENDPOINTS}/{endpoint['id']}")


def create(c: httpx.Client, **overrides: Any) -> dict[str, Any]:
    body = {"name": "ci", "url": PUBLIC_URL, "event_types": ALL, **overrides}
    r = c.post(ENDPOINTS, json=body)
    assert r.status_code == 200, r.text
    return r.json()


class TestCreate:
    def test_without_a_key_is_401(self, anon: httpx.Client) -> None:
        assert_error(anon.post(ENDPOINTS, json={"name": "x", "url": PUBLIC_URL, "event_types": ALL}), 401)
        assert_error(anon.get(ENDPOINTS), 401)
        assert_error(anon.get("/v1/webhook_event_types"), 401)

    def test_the_answer_is_the_endpoint_with_its_secret_and_later_reads_never_show_it(
        self, client: httpx.Client
    ) -> None:
        made = create(client, name="deploys", event_types=["fine_tuning.job.succeeded"])
        assert set(made) == {
            "id", "object", "name", "url", "event_types", "created_at", "updated_at", "signing_secret_hint",
            "signing_secret",
        }  # fmt: skip
        assert made["id"].startswith("whep_") and made["object"] == "webhook_endpoint"
        assert (made["name"], made["url"], made["event_types"]) == (
            "deploys",
            PUBLIC_URL,
            ["fine_tuning.job.succeeded"],
        )
        assert made["signing_secret"].startswith("whsec_")
        assert made["signing_secret_hint"] == f"whsec_…{made['signing_secret'][-4:]}"
        assert abs(made["created_at"] - time.time()) < 60 and made["updated_at"] == made["created_at"]
        read = client.get(f"{ENDPOINTS}/{made['id']}").json()
        assert read == {k: v for k, v in made.items() if k != "signing_secret"}
        listed = client.get(ENDPOINTS).json()
        assert listed["data"] == [read]
        assert made["signing_secret"] not in client.get(ENDPOINTS).text

    def test_the_official_client_creates_lists_retrieves_updates_and_deletes(
        self, base_url: str, owner: Tenant, client: httpx.Client
    ) -> None:
        oa = OpenAI(api_key=owner.key, base_url=f"{base_url}/v1", max_retries=0)
        made = oa.webhooks.create(name="oa", url=PUBLIC_URL, event_types=["fine_tuning.job.failed"])
        assert made.signing_secret.startswith("whsec_") and made.event_types == ["fine_tuning.job.failed"]
        assert [e.id for e in oa.webhooks.list()] == [made.id]
        assert oa.webhooks.retrieve(made.id).name == "oa"
        updated = oa.webhooks.update(made.id, name="renamed", event_types=["fine_tuning.job.cancelled"])
        assert (updated.name, updated.event_types, updated.url) == (
            "renamed",
            ["fine_tuning.job.cancelled"],
            PUBLIC_URL,
        )
        assert oa.webhooks.event_types.list().data == ALL
        deleted = oa.webhooks.delete(made.id)
        assert (deleted.id, deleted.object, deleted.deleted) == (made.id, "webhook_endpoint.deleted", True)
        assert oa.webhooks.list().data == []

    @pytest.mark.parametrize(
        ("url", "why"),
        [
            ("https://127.0.0.1/hook", "loopback"),
            ("https://169.254.169.254/latest/meta-data", "link-local"),
            ("https://10.0.0.7/hook", "private"),
            ("http://93.184.216.34/hook", "https://"),
            ("ftp://93.184.216.34/hook", "https://"),
            ("https://user:pw@93.184.216.34/hook", "user name"),
            ("not a url", "must start with"),
            ("https://localhost/hook", "loopback"),  # a name is resolved, and judged by its addresses
        ],
    )
    def test_a_url_the_policy_refuses_is_a_400_naming_url(self, client: httpx.Client, url: str, why: str) -> None:
        r = client.post(ENDPOINTS, json={"name": "x", "url": url, "event_types": ALL})
        assert_error(r, 400, param="url", code="url_not_allowed", message_contains=why)
        assert client.get(ENDPOINTS).json()["data"] == []

    @pytest.mark.parametrize(
        ("body", "param"),
        [
            ({"name": "x", "url": PUBLIC_URL, "event_types": ["batch.completed"]}, "event_types"),
            ({"name": "x", "url": PUBLIC_URL, "event_types": []}, "event_types"),
            ({"name": "x", "url": PUBLIC_URL, "event_types": "fine_tuning.job.failed"}, "event_types"),
            ({"name": "x", "url": PUBLIC_URL}, "event_types"),
            ({"url": PUBLIC_URL, "event_types": ALL}, "name"),
            ({"name": "", "url": PUBLIC_URL, "event_types": ALL}, "name"),
            ({"name": "x", "event_types": ALL}, "url"),
            ({"name": "x", "url": PUBLIC_URL, "event_types": ALL, "enabled": True}, "enabled"),
        ],
    )
    def test_a_bad_body_is_a_400_naming_the_field(self, client: httpx.Client, body: dict[str, Any], param: str) -> None:
        assert_error(client.post(ENDPOINTS, json=body), 400, param=param)

    def test_an_unknown_event_type_is_named_with_the_valid_ones(self, client: httpx.Client) -> None:
        r = client.post(
            ENDPOINTS,
            json={"name": "x", "url": PUBLIC_URL, "event_types": ["fine_tuning.job.failed", "batch.completed"]},
        )
        error = assert_error(r, 400, param="event_types", code="invalid_event_type")
        assert "event_types[1]: 'batch.completed'" in error["message"]
        assert all(t in error["message"] for t in ALL)

    def test_repeated_event_types_are_kept_once(self, client: httpx.Client) -> None:
        made = create(client, event_types=["fine_tuning.job.failed", "fine_tuning.job.failed"])
        assert made["event_types"] == ["fine_tuning.job.failed"]


class TestTenancy:
    def test_another_tenants_endpoint_is_404_everywhere_and_not_listed(
        self, client: httpx.Client, client_b: httpx.Client
    ) -> None:
        made = create(client)
        path = f"{ENDPOINTS}/{made['id']}"
        assert_error(client_b.get(path), 404, param="webhook_endpoint_id", code="not_found")
        assert_error(client_b.post(path, json={"name": "mine"}), 404)
        assert_error(client_b.delete(path), 404)
        assert_error(client_b.post(f"{path}/rotate_secret"), 404)
        assert_error(client_b.get(f"{path}/deliveries"), 404)
        assert client_b.get(ENDPOINTS).json()["data"] == []
        assert_error(client_b.get(ENDPOINTS, params={"after": made["id"]}), 400, param="after")
        assert client.get(path).json()["name"] == "ci"  # untouched

    def test_an_unknown_endpoint_is_404(self, client: httpx.Client) -> None:
        assert_error(client.get(f"{ENDPOINTS}/whep_nope"), 404, param="webhook_endpoint_id")


class TestListAndDelete:
    def test_pages_newest_first_with_after_and_limit(self, client: httpx.Client) -> None:
        made = [create(client, name=f"e{i}")["id"] for i in range(3)]
        first = client.get(ENDPOINTS, params={"limit": 2}).json()
        ids = [e["id"] for e in first["data"]]
        assert set(ids) <= set(made) and len(ids) == 2 and first["has_more"] is True
        assert (first["first_id"], first["last_id"]) == (ids[0], ids[1])
        second = client.get(ENDPOINTS, params={"limit": 2, "after": ids[-1]}).json()
        assert second["has_more"] is False and len(second["data"]) == 1
        assert sorted([*ids, second["data"][0]["id"]]) == sorted(made)
        assert_error(client.get(ENDPOINTS, params={"limit": 0}), 400, param="limit")
        assert_error(client.get(ENDPOINTS, params={"limit": 101}), 400, param="limit")

    def test_delete_answers_the_deleted_object_and_the_endpoint_is_gone(self, client: httpx.Client) -> None:
        made = create(client)
        r = client.delete(f"{ENDPOINTS}/{made['id']}")
        assert r.status_code == 200 and r.json() == {
            "id": made["id"],
            "object": "webhook_endpoint.deleted",
            "deleted": True,
        }
        assert_error(client.get(f"{ENDPOINTS}/{made['id']}"), 404)
        assert_error(client.delete(f"{ENDPOINTS}/{made['id']}"), 404)


class TestUpdate:
    def test_a_new_url_is_checked_by_the_policy(self, client: httpx.Client) -> None:
        made = create(client)
        r = client.post(f"{ENDPOINTS}/{made['id']}", json={"url": "https://192.168.1.1/x"})
        assert_error(r, 400, param="url", code="url_not_allowed")
        assert client.get(f"{ENDPOINTS}/{made['id']}").json()["url"] == PUBLIC_URL

    def test_an_empty_update_changes_nothing(self, client: httpx.Client) -> None:
        made = create(client)
        r = client.post(f"{ENDPOINTS}/{made['id']}", json={})
        assert r.status_code == 200 and r.json()["updated_at"] == made["updated_at"]


class TestRotate:
    def test_rotate_shows_a_new_secret_once(self, client: httpx.Client, db: Callable[[], Any]) -> None:
        made = create(client)
        r = client.post(f"{ENDPOINTS}/{made['id']}/rotate_secret")
        assert r.status_code == 200, r.text
        rotated = r.json()
        assert rotated["signing_secret"].startswith("whsec_") and rotated["signing_secret"] != made["signing_secret"]
        assert rotated["signing_secret_hint"] == f"whsec_…{rotated['signing_secret'][-4:]}"
        assert "signing_secret" not in client.get(f"{ENDPOINTS}/{made['id']}").json()
        from api.orm import WebhookEndpoint

        with db() as s:
            row = s.get(WebhookEndpoint, made["id"])
            assert (row.secret, row.previous_secret) == (rotated["signing_secret"], None)

    def test_keeping_the_old_secret_keeps_it_for_24_hours(
        self, base_url: str, owner: Tenant, client: httpx.Client, db: Callable[[], Any]
    ) -> None:
        made = create(client)
        oa = OpenAI(api_key=owner.key, base_url=f"{base_url}/v1", max_retries=0)
        rotated = oa.webhooks.rotate_secret(made["id"], keep_old_secret_active_for_24_hours=True)
        from api.orm import WebhookEndpoint

        with db() as s:
            row = s.get(WebhookEndpoint, made["id"])
            assert (row.secret, row.previous_secret) == (rotated.signing_secret, made["signing_secret"])
            assert abs(row.previous_secret_expires_at - (time.time() + 86_400)) < 60


# -- the outbox and its delivery ----------------------------------------------------------------------------------


def new_job(c: httpx.Client) -> str:
    file_id = upload(c, jsonl(prompts())).json()["id"]
    r = c.post("/v1/fine_tuning/jobs", json=job_body(file_id))
    assert r.status_code == 200, r.text
    return str(r.json()["id"])


def events_of(db: Callable[[], Any], job_id: str) -> list[tuple[str, list[str]]]:
    """(type, [endpoint ids]) of each event recorded for the job, oldest first."""
    with db() as s:
        events = s.scalars(
            select(WebhookEvent).where(WebhookEvent.subject_id == job_id).order_by(WebhookEvent.created_at)
        )
        return [
            (
                e.type,
                sorted(s.scalars(select(WebhookDelivery.endpoint_id).where(WebhookDelivery.event_id == e.id))),
            )
            for e in events
        ]


class TestOutbox:
    def test_a_cancel_before_start_records_one_event_for_each_subscribed_endpoint_only(
        self, client: httpx.Client, client_b: httpx.Client, db: Callable[[], Any]
    ) -> None:
        wants = create(client, event_types=["fine_tuning.job.cancelled"])["id"]
        also = create(client, event_types=ALL)["id"]
        create(client, event_types=["fine_tuning.job.succeeded"])  # not subscribed to cancellations
        create(client_b, event_types=ALL)  # another tenant's
        job_id = new_job(client)
        assert events_of(db, job_id) == []
        assert client.post(f"/v1/fine_tuning/jobs/{job_id}/cancel").json()["status"] == "cancelled"
        assert events_of(db, job_id) == [("fine_tuning.job.cancelled", sorted([wants, also]))]

    def test_a_pause_of_a_waiting_job_records_paused(self, client: httpx.Client, db: Callable[[], Any]) -> None:
        endpoint = create(client, event_types=["fine_tuning.job.paused"])["id"]
        job_id = new_job(client)
        assert client.post(f"/v1/fine_tuning/jobs/{job_id}/pause").json()["status"] == "paused"
        assert client.post(f"/v1/fine_tuning/jobs/{job_id}/resume").json()["status"] == "queued"  # no event
        assert events_of(db, job_id) == [("fine_tuning.job.paused", [endpoint])]

    def test_a_worker_finishing_a_job_records_succeeded_once(
        self, client: httpx.Client, settings: Any, db: Callable[[], Any]
    ) -> None:
        from api.status import JobStatus

        endpoint = create(client, event_types=["fine_tuning.job.succeeded"])["id"]
        job_id = new_job(client)
        assert validate(settings, job_id) == "queued"
        with db() as s:
            assert runs.claim(s, job_id=job_id, worker_id="w1", lease_seconds=30)
        with db() as s:
            assert runs.finish(s, job_id=job_id, worker_id="w1", status=JobStatus.SUCCEEDED)
        with db() as s:  # the same unit of work again (a COMMIT the worker could not confirm): no second event
            assert not runs.finish(s, job_id=job_id, worker_id="w1", status=JobStatus.SUCCEEDED)
        assert events_of(db, job_id) == [("fine_tuning.job.succeeded", [endpoint])]

    def test_a_job_whose_file_is_bad_records_failed(
        self, client: httpx.Client, settings: Any, db: Callable[[], Any]
    ) -> None:
        endpoint = create(client, event_types=["fine_tuning.job.failed"])["id"]
        bad = upload(client, jsonl([{"text": "no prompt here"}])).json()["id"]
        r = client.post("/v1/fine_tuning/jobs", json=job_body(bad))
        assert r.status_code == 200, r.text
        assert validate(settings, r.json()["id"]) == "failed"
        assert events_of(db, r.json()["id"]) == [("fine_tuning.job.failed", [endpoint])]

    def test_a_status_change_rolled_back_leaves_no_event(
        self, client: httpx.Client, settings: Any, db: Callable[[], Any]
    ) -> None:
        from api.status import JobStatus

        create(client, event_types=ALL)
        job_id = new_job(client)
        assert validate(settings, job_id) == "queued"
        with db() as s:
            assert runs.claim(s, job_id=job_id, worker_id="w1", lease_seconds=30)
        with pytest.raises(RuntimeError), db() as s:
            assert runs.finish(s, job_id=job_id, worker_id="w1", status=JobStatus.FAILED)
            raise RuntimeError("the worker crashed before its COMMIT")
        assert events_of(db, job_id) == []


class Receiver(http.server.ThreadingHTTPServer):
    statuses: list[int]  # answered in turn; the last one from then on
    received: list[tuple[bytes, dict[str, str]]]
    on_post: Callable[[], None] | None = None  # called while the POST waits for its answer


class _Handler(http.server.BaseHTTPRequestHandler):
    server: Receiver

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["content-length"]))
        self.server.received.append((body, {k.lower(): v for k, v in self.headers.items()}))
        if self.server.on_post is not None:
            self.server.on_post()
        status = self.server.statuses.pop(0) if len(self.server.statuses) > 1 else self.server.statuses[0]
        self.send_response(status)
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, *_: Any) -> None:
        pass


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    server = Receiver(("127.0.0.1", 0), _Handler)
    server.statuses, server.received = [200], []
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
def loopback(settings: Any) -> Any:
    """The session's settings with loopback allowed (http too), as a test deployment's would be."""
    return settings.model_copy(
        update={
            "grader_url_schemes": ["http", "https"],
            "grader_url_allow_networks": ["127.0.0.0/8"],
            "webhook_retry_base_s": 60.0,
            "webhook_timeout_s": 5.0,
        }
    )


@pytest.fixture
def loopback_client(loopback: Any, owner: Tenant) -> Iterator[httpx.Client]:
    from api.app import create_app

    with serve(create_app(loopback)) as url, http_client(url, owner.key) as c:
        yield c
        for endpoint in c.get(ENDPOINTS, params={"limit": 100}).json()["data"]:
            c.delete(f"{ENDPOINTS}/{endpoint['id']}")


def deliver(settings: Any) -> int:
    from trainer.grading.url_policy import CLIENT_OPTIONS
    from worker.webhooks import deliver_due

    with httpx.Client(**CLIENT_OPTIONS) as c:
        return deliver_due(settings, c)


def make_due(db: Callable[[], Any], endpoint_id: str) -> None:
    """Bring the endpoint's next retry forward to now (instead of waiting out the backoff)."""
    from sqlalchemy import update

    with db() as s:
        s.execute(
            update(WebhookDelivery)
            .where(WebhookDelivery.endpoint_id == endpoint_id, WebhookDelivery.status == "pending")
            .values(next_attempt_at=time.time())
        )


class TestDelivery:
    def test_a_round_posts_a_verified_event_and_logs_it(
        self, loopback_client: httpx.Client, loopback: Any, receiver: Receiver
    ) -> None:
        url = f"http://127.0.0.1:{receiver.server_address[1]}/hooks"
        made = create(loopback_client, url=url, event_types=["fine_tuning.job.cancelled"])
        job_id = new_job(loopback_client)
        loopback_client.post(f"/v1/fine_tuning/jobs/{job_id}/cancel")
        assert deliver(loopback) == 1
        assert deliver(loopback) == 0  # delivered: nothing is due any more
        [(body, headers)] = receiver.received
        event = OpenAI(api_key="x").webhooks.unwrap(body, headers, secret=made["signing_secret"])
        assert (event.type, event.data.id, event.object) == ("fine_tuning.job.cancelled", job_id, "event")  # type: ignore[union-attr]
        log = loopback_client.get(f"{ENDPOINTS}/{made['id']}/deliveries").json()
        [line] = log["data"]
        assert line["id"].startswith("whdel_") and line["object"] == "webhook_endpoint.delivery"
        assert {k: line[k] for k in ("webhook_endpoint_id", "event_id", "event_type", "job_id", "attempt")} == {
            "webhook_endpoint_id": made["id"],
            "event_id": event.id,
            "event_type": "fine_tuning.job.cancelled",
            "job_id": job_id,
            "attempt": 1,
        }
        assert (line["status"], line["status_code"], line["error"], line["next_retry_at"]) == (
            "delivered",
            200,
            None,
            None,
        )

    def test_a_failing_receiver_is_retried_with_backoff_until_it_accepts(
        self, loopback_client: httpx.Client, loopback: Any, receiver: Receiver, db: Callable[[], Any]
    ) -> None:
        receiver.statuses = [500, 404, 200]
        made = create(loopback_client, url=f"http://127.0.0.1:{receiver.server_address[1]}/", event_types=ALL)
        job_id = new_job(loopback_client)
        loopback_client.post(f"/v1/fine_tuning/jobs/{job_id}/pause")
        before = time.time()
        assert deliver(loopback) == 1
        assert deliver(loopback) == 0  # not due before its backoff
        make_due(db, made["id"])
        assert deliver(loopback) == 1
        make_due(db, made["id"])
        assert deliver(loopback) == 1
        assert len(receiver.received) == 3
        assert len({h["webhook-id"] for _, h in receiver.received}) == 1  # the same event each time
        log = loopback_client.get(f"{ENDPOINTS}/{made['id']}/deliveries").json()["data"]
        assert [(d["attempt"], d["status"], d["status_code"], d["error"]) for d in log] == [
            (3, "delivered", 200, None),
            (2, "retrying", 404, "HTTP 404"),
            (1, "retrying", 500, "HTTP 500"),
        ]
        assert int(before) + 60 <= log[2]["next_retry_at"] <= time.time() + 61  # webhook_retry_base_s
        assert log[1]["next_retry_at"] >= log[1]["created_at"] + 120 - 1  # twice as long
        page = loopback_client.get(f"{ENDPOINTS}/{made['id']}/deliveries", params={"limit": 2}).json()
        assert page["has_more"] is True and [d["attempt"] for d in page["data"]] == [3, 2]
        rest = loopback_client.get(
            f"{ENDPOINTS}/{made['id']}/deliveries", params={"limit": 2, "after": page["last_id"]}
        ).json()
        assert rest["has_more"] is False and [d["attempt"] for d in rest["data"]] == [1]

    def test_past_the_horizon_a_delivery_is_given_up_and_the_log_says_so(
        self, loopback_client: httpx.Client, loopback: Any, receiver: Receiver
    ) -> None:
        receiver.statuses = [503]
        made = create(loopback_client, url=f"http://127.0.0.1:{receiver.server_address[1]}/", event_types=ALL)
        job_id = new_job(loopback_client)
        loopback_client.post(f"/v1/fine_tuning/jobs/{job_id}/cancel")
        assert deliver(loopback.model_copy(update={"webhook_retry_horizon_s": 30.0})) == 1  # the next retry: past it
        [line] = loopback_client.get(f"{ENDPOINTS}/{made['id']}/deliveries").json()["data"]
        assert (line["status"], line["status_code"], line["next_retry_at"]) == ("failed", 503, None)
        assert deliver(loopback) == 0

    def test_a_deleted_endpoint_gets_no_more_deliveries(
        self, loopback_client: httpx.Client, loopback: Any, receiver: Receiver
    ) -> None:
        made = create(loopback_client, url=f"http://127.0.0.1:{receiver.server_address[1]}/", event_types=ALL)
        job_id = new_job(loopback_client)
        loopback_client.post(f"/v1/fine_tuning/jobs/{job_id}/cancel")
        loopback_client.delete(f"{ENDPOINTS}/{made['id']}")
        assert deliver(loopback) == 0
        assert receiver.received == []

    def test_a_url_refused_at_delivery_is_not_connected_to(
        self, loopback_client: httpx.Client, settings: Any, receiver: Receiver
    ) -> None:
        """The URL was allowed when set; the deployment's policy (here: the session's, loopback refused) is applied
        again at every delivery, so an address that became internal is never reached."""
        made = create(loopback_client, url=f"http://127.0.0.1:{receiver.server_address[1]}/", event_types=ALL)
        job_id = new_job(loopback_client)
        loopback_client.post(f"/v1/fine_tuning/jobs/{job_id}/cancel")
        assert deliver(settings) == 1
        assert receiver.received == []
        [line] = loopback_client.get(f"{ENDPOINTS}/{made['id']}/deliveries").json()["data"]
        assert line["status"] == "retrying" and line["status_code"] is None
        assert line["error"].startswith("the URL is refused")


class TestTestEvent:
    """``client.webhooks.test``: a signed sample event of the type asked, now, once; OpenAI's answer."""

    def test_a_sample_event_is_sent_now_verified_and_answered_as_openai_does(
        self, loopback_client: httpx.Client, loopback: Any, receiver: Receiver, owner: Tenant
    ) -> None:
        made = create(loopback_client, url=f"http://127.0.0.1:{receiver.server_address[1]}/t", event_types=ALL)
        sdk = OpenAI(base_url=str(loopback_client.base_url).rstrip("/") + "/v1", api_key=owner.key, max_retries=0)
        result = sdk.webhooks.test(made["id"], event_type="eval.run.succeeded")
        assert result.to_dict() == {
            "object": "webhook_endpoint.test",
            "webhook_endpoint_id": made["id"],
            "event_type": "eval.run.succeeded",
            "status_code": 200,
            "success": True,
        }
        [(body, headers)] = receiver.received
        event = OpenAI(api_key="x").webhooks.unwrap(body, headers, secret=made["signing_secret"])
        assert (event.type, event.data.id) == ("eval.run.succeeded", made["id"])  # type: ignore[union-attr]
        [line] = loopback_client.get(f"{ENDPOINTS}/{made['id']}/deliveries").json()["data"]
        assert {k: line[k] for k in ("event_id", "event_type", "subject_type", "subject_id", "job_id")} == {
            "event_id": event.id,
            "event_type": "eval.run.succeeded",
            "subject_type": "webhook_endpoint",
            "subject_id": made["id"],
            "job_id": None,
        }
        assert (line["status"], line["status_code"], line["attempt"], line["next_retry_at"]) == (
            "delivered",
            200,
            1,
            None,
        )
        assert deliver(loopback) == 0  # sent already: nothing is owed

    def test_a_failing_receiver_is_its_status_and_a_failed_attempt_not_retried(
        self, loopback_client: httpx.Client, loopback: Any, receiver: Receiver
    ) -> None:
        receiver.statuses = [500]
        made = create(loopback_client, url=f"http://127.0.0.1:{receiver.server_address[1]}/t", event_types=ALL)
        r = loopback_client.post(f"{ENDPOINTS}/{made['id']}/test", json={"event_type": "fine_tuning.job.failed"})
        assert (r.status_code, r.json()["status_code"]) == (200, 500)
        [line] = loopback_client.get(f"{ENDPOINTS}/{made['id']}/deliveries").json()["data"]
        assert (line["status"], line["status_code"], line["error"]) == ("failed", 500, "HTTP 500")
        assert deliver(loopback) == 0 and len(receiver.received) == 1

    def test_an_unreachable_endpoint_is_a_400_and_an_unknown_event_type_a_400_naming_it(
        self, loopback_client: httpx.Client
    ) -> None:
        with socket.socket() as s:  # a port nothing listens on
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        made = create(loopback_client, url=f"http://127.0.0.1:{port}/t", event_types=ALL)
        r = loopback_client.post(f"{ENDPOINTS}/{made['id']}/test", json={"event_type": "fine_tuning.job.failed"})
        assert_error(r, 400, param="url", code="endpoint_unreachable")
        [line] = loopback_client.get(f"{ENDPOINTS}/{made['id']}/deliveries").json()["data"]
        assert line["status"] == "failed"  # in the log all the same
        r = loopback_client.post(f"{ENDPOINTS}/{made['id']}/test", json={"event_type": "batch.completed"})
        assert_error(r, 400, param="event_type", code="invalid_event_type")
        assert_error(loopback_client.post(f"{ENDPOINTS}/{made['id']}/test", json={}), 400, param="event_type")

    def test_the_post_is_made_with_no_database_transaction_open(
        self, loopback_client: httpx.Client, receiver: Receiver, db: Callable[[], Any]
    ) -> None:
        open_transactions: list[int] = []

        def count_open() -> None:  # this test database's other connections inside a transaction, as the POST waits
            with db() as s:
                open_transactions.append(
                    s.execute(
                        text(
                            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
                            " AND state LIKE 'idle in transaction%' AND pid != pg_backend_pid()"
                        )
                    ).scalar_one()
                )

        receiver.on_post = count_open
        made = create(loopback_client, url=f"http://127.0.0.1:{receiver.server_address[1]}/t", event_types=ALL)
        r = loopback_client.post(f"{ENDPOINTS}/{made['id']}/test", json={"event_type": "fine_tuning.job.succeeded"})
        assert (r.json()["status_code"], open_transactions) == (200, [0])
        [line] = loopback_client.get(f"{ENDPOINTS}/{made['id']}/deliveries").json()["data"]
        assert line["status"] == "delivered"

    def test_another_tenants_endpoint_is_a_404_and_no_key_a_401(
        self, client: httpx.Client, client_b: httpx.Client, anon: httpx.Client
    ) -> None:
        made = create(client)
        body = {"event_type": "fine_tuning.job.succeeded"}
        assert_error(client_b.post(f"{ENDPOINTS}/{made['id']}/test", json=body), 404)
        assert_error(anon.post(f"{ENDPOINTS}/{made['id']}/test", json=body), 401)

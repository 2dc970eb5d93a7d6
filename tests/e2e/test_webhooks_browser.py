"""The dashboard's webhooks page in a real browser (Playwright, Debian's Chromium) against ``proxima serve`` (API and
one worker) on PostgreSQL and Redis: a refused URL is named at its field; an endpoint is created and its secret
shown once; a job's event reaches a real local receiver (verified with the official client) and the page's delivery
log shows it; the secret is rotated (shown once again) and the endpoint deleted."""

from __future__ import annotations

import http.server
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from openai import OpenAI
from playwright.sync_api import Page, expect

from .dashboard_support import DashboardServer, upload

VERIFIER = OpenAI(api_key="unused", base_url="http://127.0.0.1:9/v1")


class Receiver(http.server.ThreadingHTTPServer):
    received: list[tuple[bytes, dict[str, str]]]


class _Handler(http.server.BaseHTTPRequestHandler):
    server: Receiver

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["content-length"]))
        self.server.received.append((body, dict(self.headers.items())))
        self.send_response(200)
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, *_: Any) -> None:
        pass


@pytest.fixture(scope="module")
def receiver() -> Iterator[Receiver]:
    server = Receiver(("127.0.0.1", 0), _Handler)
    server.received = []
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, random_model_dir: Path) -> Iterator[DashboardServer]:
    s = DashboardServer(tmp_path_factory.mktemp("webhooks-dashboard"), model_dir=random_model_dir)
    s.env.update(
        {
            "PROXIMA_GRADER_URL_SCHEMES": '["http", "https"]',
            "PROXIMA_GRADER_URL_ALLOW_NETWORKS": '["127.0.0.0/8"]',
            "PROXIMA_WEBHOOK_POLL_INTERVAL_S": "0.2",
        }
    )
    try:
        s.start()
        yield s
    finally:
        s.close()


def test_create_see_the_secret_once_get_a_delivery_rotate_and_delete(
    page: Page, server: DashboardServer, receiver: Receiver, arithmetic_data: Path
) -> None:
    key = server.api_key("hooks-team")
    page.goto(f"{server.base}/dashboard/")
    page.get_by_label("API key").fill(key)
    page.get_by_role("button", name="Sign in").click()
    expect(page.get_by_role("heading", name="Fine-tuning jobs")).to_be_visible()
    page.get_by_role("navigation", name="Main").get_by_role("link", name="Webhooks").click()
    expect(page.get_by_role("heading", name="Webhooks", exact=True)).to_be_visible()
    expect(page.get_by_text("No webhook endpoints yet.")).to_be_visible()

    # A URL the deployment's policy refuses: the server's message next to the URL field; nothing is made.
    page.get_by_label("Name").fill("ci")
    page.get_by_label("URL").fill("https://10.1.2.3/hooks")
    page.get_by_role("button", name="Create endpoint").click()
    expect(page.locator("#webhook-url-error")).to_contain_text("10.1.2.3 is a private address")
    expect(page.get_by_text("No webhook endpoints yet.")).to_be_visible()

    # Created: the secret shown once, the endpoint listed with the secret's hint only.
    url = f"http://127.0.0.1:{receiver.server_address[1]}/hooks"
    page.get_by_label("URL").fill(url)
    page.get_by_label("fine_tuning.job.succeeded").uncheck()
    page.get_by_role("button", name="Create endpoint").click()
    secret = page.locator("#webhook-secret").inner_text()
    assert secret.startswith("whsec_")
    expect(page.get_by_text("Copy it now: it is not shown again.")).to_be_visible()
    row = page.locator("tr[data-endpoint]")
    expect(row).to_have_count(1)
    expect(row).to_contain_text(url)
    expect(row).to_contain_text("fine_tuning.job.failed, fine_tuning.job.cancelled, fine_tuning.job.paused")
    expect(row).to_contain_text(f"whsec_…{secret[-4:]}")
    page.reload()
    expect(page.locator("tr[data-endpoint]")).to_have_count(1)
    assert secret not in page.content()  # never shown again

    # A job cancelled before it starts: its event reaches the receiver, verified; the page's log shows it.
    with server.client(key) as api:
        train = upload(api, arithmetic_data / "train.jsonl")
        job = api.post(
            "/fine_tuning/jobs",
            json={
                "model": "tiny-random",
                "training_file": train,
                "method": {"type": "supervised", "supervised": {"hyperparameters": {"n_epochs": 1}}},
            },
        )
        assert job.status_code == 200, job.text
        job_id = job.json()["id"]
        assert api.post(f"/fine_tuning/jobs/{job_id}/cancel").json()["status"] == "cancelled"  # not started yet
    page.locator("tr[data-endpoint]").get_by_role("button", name="Deliveries").click()
    delivered = page.locator("tr[data-delivery]")
    expect(delivered.first).to_contain_text("delivered", timeout=30_000)
    expect(delivered.first).to_contain_text("fine_tuning.job.cancelled")
    expect(delivered.first.get_by_role("link", name=job_id)).to_have_attribute("href", f"#/jobs/{job_id}")
    expect(delivered.first).to_contain_text("HTTP 200")
    [(body, headers)] = receiver.received
    event = VERIFIER.webhooks.unwrap(body, headers, secret=secret)
    assert (event.type, event.data.id) == ("fine_tuning.job.cancelled", job_id)  # type: ignore[union-attr]

    # Rotate: a new secret, shown once.
    page.once("dialog", lambda dialog: dialog.accept())
    page.locator("tr[data-endpoint]").get_by_role("button", name="Rotate secret").click()
    expect(page.locator("#webhook-secret")).not_to_have_text(secret)
    rotated = page.locator("#webhook-secret").inner_text()
    assert rotated.startswith("whsec_") and rotated != secret
    expect(page.locator("tr[data-endpoint]")).to_contain_text(f"whsec_…{rotated[-4:]}")

    # Delete: gone from the list, its log closed.
    page.once("dialog", lambda dialog: dialog.accept())
    page.locator("tr[data-endpoint]").get_by_role("button", name="Delete").click()
    expect(page.get_by_text("No webhook endpoints yet.")).to_be_visible()
    expect(page.locator("tr[data-delivery]")).to_have_count(0)

"""The dashboard's Sessions pages in a real browser (Playwright, Debian's Chromium) against the app on PostgreSQL with
no worker: the Tinker training sessions are rows written into the database as the Tinker API and its workers write
them (tests/e2e/test_tinker_sessions.py makes real ones)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from playwright.sync_api import Page, expect
from sqlalchemy.orm import Session

from api import ids
from api.auth import create_key
from api.db import session_scope
from api.migrate import upgrade
from api.orm import SessionCheckpoint, SessionRequest, TinkerClientSession, TrainingSession
from api.settings import Settings
from tests.e2e.conftest import create_pg_database, drop_pg_database
from tests.integration.conftest import serve
from tests.redis_dbs import claim_redis_url, release_redis_url

T0 = 1_767_000_000
OLDER = 20  # closed sessions older than the one looked at: with it, one more than the list's first page
ERROR = "target_tokens: 3 tokens for 4 inputs"


@dataclass
class Deployment:
    base: str
    key: str
    session_id: str  # loaded, with a saved state and a failed request
    oldest_id: str


def add_session(s: Session, tenant_id: str, *, created_at: int, **values: Any) -> str:
    """A training session of a new client session, as the Tinker API creates it."""
    client_id = ids.tinker_session_id()
    s.add(TinkerClientSession(id=client_id, tenant_id=tenant_id, created_at=created_at))
    s.flush()
    row = TrainingSession(
        id=f"{client_id}:train:0",
        tenant_id=tenant_id,
        client_session_id=client_id,
        kind="training",
        base_model="tiny-arith",
        lora={"rank": 8},
        created_at=created_at,
        **values,
    )
    s.add(row)
    s.flush()
    return row.id


def add_rows(database_url: str, tenant_id: str) -> tuple[str, str]:
    """``OLDER`` closed sessions and, newest, the one looked at; returns the ids of the newest and the oldest."""
    with session_scope(database_url) as s:
        oldest_id = add_session(s, tenant_id, created_at=T0, closed_at=T0 + 60)
        for i in range(1, OLDER):
            add_session(s, tenant_id, created_at=T0 + i, closed_at=T0 + i + 60)
        session_id = add_session(
            s,
            tenant_id,
            created_at=T0 + OLDER,
            loaded_on="worker-7",
            request_count=4,
            optimizer_steps=1,
            saved_steps=1,
            last_loss=0.6931,
            last_request_at=T0 + 100,
        )
        s.add(
            SessionCheckpoint(
                tenant_id=tenant_id,
                session_id=session_id,
                kind="weights",
                name="step-1",
                storage_key=f"tinker/{session_id}/weights/step-1",
                size_bytes=3 * 1024 * 1024,
                optimizer_steps=1,
                created_at=T0 + 95,
            )
        )
        calls = [
            ("forward_backward", "done", 0.9, None),
            ("optim_step", "done", None, None),
            ("forward_backward", "done", 0.6931, None),
            ("forward_backward", "failed", None, {"error": ERROR, "category": "user"}),
        ]
        for n, (kind, status, loss, error) in enumerate(calls):
            request_id = ids.tinker_request_id()
            s.add(
                SessionRequest(
                    id=request_id,
                    tenant_id=tenant_id,
                    session_id=session_id,
                    kind=kind,
                    dedupe_key=request_id,
                    payload=b"",
                    status=status,
                    loss=loss,
                    error=error,
                    created_at=T0 + 90 + n,
                    finished_at=T0 + 90.5 + n,
                )
            )
            s.flush()  # one at a time: their seq is the order of the calls
    return session_id, oldest_id


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    from api.app import create_app

    root = tmp_path_factory.mktemp("sessions-dashboard")
    database_url = create_pg_database()
    broker = claim_redis_url()
    try:
        upgrade(database_url)
        settings = Settings(
            home=root / "home", database_url=database_url, broker_url=broker, artifacts=str(root / "artifacts")
        )
        with session_scope(database_url) as s:
            tenant, key = create_key(s, tenant_name="sessions-team")
            tenant_id = tenant.id
        session_id, oldest_id = add_rows(database_url, tenant_id)
        with serve(create_app(settings)) as url:
            yield Deployment(url, key, session_id, oldest_id)
    finally:
        release_redis_url(broker)
        drop_pg_database(database_url)


def sign_in(page: Page, d: Deployment) -> None:
    page.goto(f"{d.base}/dashboard/")
    page.get_by_label("API key").fill(d.key)
    page.get_by_role("button", name="Sign in").click()
    expect(page.get_by_role("heading", name="Fine-tuning jobs")).to_be_visible()


def test_the_sessions_nav_lists_the_session_with_its_numbers_and_loads_more(page: Page, deployment: Deployment) -> None:
    d = deployment
    sign_in(page, d)
    page.get_by_role("navigation", name="Main").get_by_role("link", name="Sessions").click()
    expect(page.get_by_role("heading", name="Training sessions")).to_be_visible()
    expect(page.locator('[data-nav="sessions"]')).to_have_attribute("aria-current", "page")

    row = page.locator(f'tr[data-session-id="{d.session_id}"]')
    # Session, status, base model, LoRA rank, requests, steps, last loss, restores, saved states, last request.
    expect(row.locator("td")).to_have_text(
        [d.session_id, "loaded", "tiny-arith", "8", "4", "1", "0.6931", "0", "1", re.compile(r"\d{4}-\d\d-\d\d ")]
    )
    rows = page.locator("table.sessions-table tbody tr")
    expect(rows).to_have_count(OLDER)  # the first page, the newest first
    expect(rows.first).to_have_attribute("data-session-id", d.session_id)
    expect(page.locator(f'tr[data-session-id="{d.oldest_id}"]')).to_have_count(0)

    page.get_by_role("button", name="Load more").click()
    expect(rows).to_have_count(OLDER + 1)
    expect(page.locator(f'tr[data-session-id="{d.oldest_id}"] td').nth(1)).to_have_text("closed")
    expect(page.get_by_role("button", name="Load more")).to_be_hidden()


def test_a_session_shows_its_saved_state_path_its_failed_request_and_its_loss(
    page: Page, deployment: Deployment
) -> None:
    d = deployment
    sign_in(page, d)
    page.goto(f"{d.base}/dashboard/#/sessions")
    page.get_by_role("link", name=d.session_id).click()
    expect(page.get_by_role("heading", name=d.session_id)).to_be_visible()
    assert page.url.endswith(f"#/sessions/{d.session_id}")

    expect(page.locator("table.saved-states tbody tr td").first).to_have_text(f"tinker://{d.session_id}/weights/step-1")
    failed = page.locator("table.session-requests tbody tr").first  # the newest first
    expect(failed.locator("td")).to_have_text(
        ["forward_backward", "failed", "–", ERROR, re.compile(r"\d\d:\d\d"), "500 ms"]
    )
    expect(page.locator("table.session-requests tbody tr")).to_have_count(4)
    expect(page.locator('figure[data-chart="loss"]')).to_have_attribute("data-points", "2")

    page.goto(f"{d.base}/dashboard/#/sessions/sess-unknown:train:0")
    expect(page.get_by_role("heading", name="Session not found")).to_be_visible()

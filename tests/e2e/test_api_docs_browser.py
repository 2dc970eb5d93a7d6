"""``/docs`` and ``/redoc`` in Chromium: under their Content-Security-Policy both render every
operation with no script error, and nothing is fetched from any other origin. The one thing the policy has to
block is ReDoc's own logo, an image its bundle always asks its CDN for (api/routes/docs.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from playwright.sync_api import Browser

from tests.e2e.dashboard_support import free_port
from tests.waiting import wait_until

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    home = tmp_path_factory.mktemp("docs-home")
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("PROXIMA_")} | {"PROXIMA_HOME": str(home)}
    log = (home / "server.log").open("w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "proxima.cli", "serve", "--no-worker", "--no-inference", "--port", str(port)],
        cwd=REPO,
        env=env,
        stdout=log,
        stderr=log,
    )
    url = f"http://127.0.0.1:{port}"

    def up() -> bool:
        try:
            return proc.poll() is not None or httpx.get(f"{url}/healthz", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        wait_until(up, timeout=60, what="the API")
        assert proc.poll() is None, (home / "server.log").read_text()
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=15)
        log.close()


@pytest.mark.parametrize(
    ("page_path", "rendered"), [("/docs", ".opblock"), ("/redoc", "[data-section-id^='operation/']")]
)
def test_the_docs_render_every_operation_under_their_policy(
    base: str, browser: Browser, page_path: str, rendered: str
) -> None:
    operations = sum(len(item) for item in httpx.get(f"{base}/openapi.json").json()["paths"].values())
    context = browser.new_context()
    page = context.new_page()
    violations: list[str] = []
    errors: list[str] = []
    elsewhere: list[str] = []  # requests to another origin that the browser did not block
    page.on("console", lambda m: violations.append(m.text) if "Content Security Policy" in m.text else None)
    page.on("pageerror", lambda err: errors.append(str(err)))
    page.on("response", lambda r: None if r.url.startswith((base, "data:", "blob:")) else elsewhere.append(r.url))
    page.on(
        "requestfailed",
        lambda r: None if (r.failure or "").lower() in ("csp", "net::err_blocked_by_csp") else elsewhere.append(r.url),
    )
    try:
        page.goto(f"{base}{page_path}")
        # ReDoc renders 31 operations in well under 30 s on an idle machine; a loaded 2-core CI machine needs more
        # (a locator's wait, not wait_for_function: a predicate still false at its first check is polled through
        # eval, which the page's CSP refuses: the test failed whenever the machine was slow enough)
        page.locator(rendered).nth(operations - 1).wait_for(state="attached", timeout=90_000)
        assert page.locator(rendered).count() == operations
    finally:
        context.close()
    blocked_logo = "Loading the image 'https://cdn.redoc.ly/redoc/logo-mini.svg' violates"
    assert [v for v in violations if not (page_path == "/redoc" and v.startswith(blocked_logo))] == [], violations
    assert errors == [], errors
    assert elsewhere == [], elsewhere

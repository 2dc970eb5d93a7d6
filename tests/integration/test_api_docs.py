"""``/docs`` and ``/redoc``: the pages load their scripts and styles from this server only (the
assets of the pinned fastapi-offline wheel), run no inline script, and carry a Content-Security-Policy that forbids
any other origin; the dashboard, whose page keeps the API key in this origin's localStorage, carries one too.
(tests/e2e/test_api_docs_browser.py renders both pages in Chromium under that policy.)"""

from __future__ import annotations

from html.parser import HTMLParser

import httpx
import pytest


class Refs(HTMLParser):
    """Every URL a page refers to (src, href, spec-url) and the scripts written inline."""

    def __init__(self) -> None:
        super().__init__()
        self.urls: list[str] = []
        self.inline_scripts = 0
        self._in_script_without_src = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        values = dict(attrs)
        self.urls += [v for k, v in values.items() if k in ("src", "href", "spec-url", "data-openapi-url") and v]
        self._in_script_without_src = tag == "script" and not values.get("src")

    def handle_data(self, data: str) -> None:
        if self._in_script_without_src and data.strip():
            self.inline_scripts += 1

    def handle_endtag(self, tag: str) -> None:
        self._in_script_without_src = False


def policy(response: httpx.Response) -> dict[str, list[str]]:
    header = response.headers["content-security-policy"]
    return {d.split()[0]: d.split()[1:] for d in (part.strip() for part in header.split(";")) if d}


@pytest.mark.parametrize("page", ["/docs", "/redoc"])
def test_docs_pages_load_only_from_this_server_under_a_csp(anon: httpx.Client, page: str) -> None:
    response = anon.get(page)
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/html")
    csp = policy(response)
    assert csp["default-src"] == ["'none'"]
    assert csp["script-src"] == ["'self'"]  # no inline script, no eval, no other origin
    assert csp["connect-src"] == ["'self'"]
    assert csp["frame-ancestors"] == ["'none'"] and csp["base-uri"] == ["'none'"]
    assert all("http" not in value and "*" not in value for values in csp.values() for value in values), csp
    refs = Refs()
    refs.feed(response.text)
    assert refs.inline_scripts == 0
    assert refs.urls, response.text
    for url in refs.urls:
        assert url.startswith("/") and not url.startswith("//"), url  # this origin
        asset = anon.get(url)
        assert asset.status_code == 200, url
        if url.startswith("/docs/"):
            assert asset.headers["x-content-type-options"] == "nosniff"
    assert "cdn" not in response.text.lower()


def test_docs_scripts_are_the_packaged_assets(anon: httpx.Client) -> None:
    from importlib.resources import files

    packaged = files("fastapi_offline") / "static"
    for name in ("swagger-ui-bundle.js", "swagger-ui.css", "redoc.standalone.js"):
        served = anon.get(f"/docs/assets/{name}")
        assert served.status_code == 200
        assert served.content == (packaged / name).read_bytes(), name


def test_fastapis_cdn_pages_are_gone(anon: httpx.Client) -> None:
    assert anon.get("/docs/oauth2-redirect").status_code == 404
    for page in ("/docs", "/redoc"):
        assert "jsdelivr" not in anon.get(page).text


def test_the_dashboard_page_carries_a_csp(anon: httpx.Client) -> None:
    response = anon.get("/dashboard/")
    assert response.status_code == 200
    csp = policy(response)
    assert csp["script-src"] == ["'self'"] and csp["connect-src"] == ["'self'"]

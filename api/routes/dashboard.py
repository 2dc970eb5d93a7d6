"""The browser dashboard: static files (plain ES modules, a vendored uPlot) served under ``/dashboard/``.

The page talks to the same JSON API as any client, with the API key the user signs in with; nothing here reads the
database. ``/`` redirects to the dashboard, so opening the server's address in a browser lands on it.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter, FastAPI
from fastapi.responses import RedirectResponse
from starlette.responses import Response
from starlette.staticfiles import StaticFiles
from starlette.types import Scope

STATIC_DIR = Path(__file__).resolve().parent.parent / "static"
PREFIX = "/dashboard"

# The API key lives in the page's localStorage, so the page must never run script from anywhere but here: no
# inline script, no other origin. uPlot sets element styles from script (CSSOM), which style-src does not restrict.
SECURITY_HEADERS = {
    "content-security-policy": (
        "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data: blob:; "
        "connect-src 'self'; object-src 'none'; base-uri 'none'; frame-ancestors 'none'; form-action 'self'"
    ),
    "x-content-type-options": "nosniff",
    "referrer-policy": "no-referrer",
    # Revalidate on every load (cheap: ETag/Last-Modified give a 304), so an upgraded server never mixes old and
    # new modules in one page.
    "cache-control": "no-cache",
}

router = APIRouter(include_in_schema=False)


@router.get("/")
def root() -> RedirectResponse:
    return RedirectResponse(f"{PREFIX}/")


@router.get(PREFIX)
def dashboard_without_slash() -> RedirectResponse:
    return RedirectResponse(f"{PREFIX}/")


class DashboardFiles(StaticFiles):
    """Static files with the security headers above."""

    async def get_response(self, path: str, scope: Scope) -> Response:
        response = await super().get_response(path, scope)
        response.headers.update(SECURITY_HEADERS)
        return response


def install(app: FastAPI) -> None:
    """Add the redirects and mount the static files (a mount cannot travel inside an ``APIRouter``)."""
    app.include_router(router)
    app.mount(PREFIX, DashboardFiles(directory=STATIC_DIR, html=True), name="dashboard")

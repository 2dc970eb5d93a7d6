"""``/docs`` (Swagger UI) and ``/redoc`` (ReDoc), served from the package under a Content-Security-Policy.

The dashboard keeps the API key in this origin's localStorage, so no page here may run a script from anywhere else.
FastAPI's own pages load unpinned scripts from a CDN and start Swagger UI from an inline script; these pages load
the scripts and styles the pinned ``fastapi-offline`` wheel ships (``ASSETS``, served at ``/docs/assets/``), start
Swagger UI from ``/docs/swagger-init.js`` (no inline script), and their policy lets them load nothing from another
origin. Styles may be inline: both renderers set them from script, and a style cannot read the key. (ReDoc's
bundle always asks its CDN for its logo image; the policy blocks it, and the page renders without it.)
"""

from __future__ import annotations

import html
from importlib.resources import files
from pathlib import Path

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import HTMLResponse, Response
from starlette.staticfiles import StaticFiles
from starlette.types import Scope

ASSETS = Path(str(files("fastapi_offline") / "static"))
ASSETS_PREFIX = "/docs/assets"

SECURITY_HEADERS = {
    "content-security-policy": (
        "default-src 'none'; script-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data:; "
        "font-src 'self' data:; connect-src 'self'; worker-src 'self' blob:; object-src 'none'; base-uri 'none'; "
        "frame-ancestors 'none'; form-action 'none'"
    ),
    "x-content-type-options": "nosniff",
    "referrer-policy": "no-referrer",
}

# Swagger UI's start-up, as FastAPI's page has it inline; the page says where the document is (data-openapi-url).
SWAGGER_INIT = """\
const root = document.getElementById("swagger-ui");
window.ui = SwaggerUIBundle({
  url: root.dataset.openapiUrl,
  dom_id: "#swagger-ui",
  layout: "BaseLayout",
  deepLinking: true,
  showExtensions: true,
  showCommonExtensions: true,
  validatorUrl: null,
  presets: [SwaggerUIBundle.presets.apis, SwaggerUIBundle.SwaggerUIStandalonePreset],
});
"""

router = APIRouter(include_in_schema=False)


def _root(request: Request) -> str:
    return html.escape(str(request.scope.get("root_path", "")), quote=True)


def _page(title: str, head: str, body: str) -> HTMLResponse:
    page = (
        '<!doctype html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
        f"<title>{html.escape(title)}</title>\n{head}</head>\n<body>\n{body}</body>\n</html>\n"
    )
    return HTMLResponse(page, headers=SECURITY_HEADERS)


@router.get("/docs")
def swagger_ui(request: Request) -> HTMLResponse:
    root = _root(request)
    return _page(
        f"{request.app.title} - Swagger UI",
        f'<link rel="icon" href="{root}{ASSETS_PREFIX}/favicon.png">\n'
        f'<link rel="stylesheet" href="{root}{ASSETS_PREFIX}/swagger-ui.css">\n',
        f'<div id="swagger-ui" data-openapi-url="{root}{request.app.openapi_url}"></div>\n'
        f'<script src="{root}{ASSETS_PREFIX}/swagger-ui-bundle.js"></script>\n'
        f'<script src="{root}/docs/swagger-init.js"></script>\n',
    )


@router.get("/docs/swagger-init.js")
def swagger_init() -> Response:
    return Response(SWAGGER_INIT, media_type="text/javascript; charset=utf-8", headers=SECURITY_HEADERS)


@router.get("/redoc")
def redoc(request: Request) -> HTMLResponse:
    root = _root(request)
    return _page(
        f"{request.app.title} - ReDoc",
        f'<link rel="icon" href="{root}{ASSETS_PREFIX}/favicon.png">\n',
        f'<redoc spec-url="{root}{request.app.openapi_url}"></redoc>\n'
        f'<script src="{root}{ASSETS_PREFIX}/redoc.standalone.js"></script>\n',
    )


class DocsAssets(StaticFiles):
    async def get_response(self, path: str, scope: Scope) -> Response:
        response = await super().get_response(path, scope)
        response.headers.update(SECURITY_HEADERS)
        return response


def install(app: FastAPI) -> None:
    """The pages and their assets; the app is built with ``docs_url=None, redoc_url=None`` (FastAPI's CDN pages)."""
    app.include_router(router)
    app.mount(ASSETS_PREFIX, DocsAssets(directory=ASSETS), name="docs-assets")

"""The request guard: what every request passes before any route sees it.

1. Its path and query string are UTF-8 text without NUL characters (PostgreSQL cannot store a NUL, and a string
   that does not decode would be read as something the client did not send): else a 400 naming the parameter.
2. A request that carries a body to ``/v1/`` is authenticated from its headers first: without a valid key it gets
   its 401 before a byte of the body is read (nothing is buffered, spooled or parsed for anonymous clients).
3. Every body is bounded: the file upload by ``max_upload_bytes`` (plus the multipart framing), any other by
   ``max_request_bytes``. A declared ``Content-Length`` over the limit is refused at once; a body without one
   (chunked) is counted as it streams in and refused with a 413 as soon as the count passes the limit. The route
   then sees the client gone; the upload it was streaming to the store (``api.multipart``) leaves nothing stored.

An early answer closes the connection (``connection: close``): the server reads nothing more of that body. So does
any answer a route gives before the body it was sent has ended (an upload's own limit, a line that does not parse):
otherwise the server would keep the connection for the next request and read the rest of this one to reach it.
"""

from __future__ import annotations

from collections.abc import Sequence
from urllib.parse import unquote_to_bytes

from fastapi import Request
from starlette.datastructures import Headers
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api.deps import get_tenant, get_tinker_tenant
from api.errors import error_json, error_response
from api.settings import Settings

# Multipart framing around the uploaded file: boundaries, part headers and the `purpose` field.
MULTIPART_SLACK_BYTES = 16 * 1024
UPLOAD_PATH = "/v1/files"
TINKER_PATH = "/api/v1/"  # the Tinker SDK's requests: `X-API-Key` and a limit of their own


def _text(raw: bytes) -> str | None:
    """``raw`` percent-decoded as UTF-8, or None when it does not decode or holds a NUL."""
    try:
        text = unquote_to_bytes(raw).decode("utf-8")
    except UnicodeDecodeError:
        return None
    return None if "\x00" in text else text


def _shown(raw: bytes) -> str:
    return unquote_to_bytes(raw).decode("utf-8", "backslashreplace").replace("\x00", "\\x00")


def _bad_query_parameter(query: bytes) -> str | None:
    """The name of the first query parameter whose name or value is not storable text, or None."""
    for pair in query.split(b"&"):
        name, _, value = pair.replace(b"+", b" ").partition(b"=")
        if _text(name) is None or _text(value) is None:
            return _shown(name)
    return None


def _bad_path_parameter(routes: Sequence[BaseRoute], scope: Scope) -> str | None:
    """The name of the path parameter that holds the bad text (from the route the path matches), or None when no
    route names it."""
    for route in routes:
        match, child = route.matches(scope)
        if match == Match.NONE:
            continue
        for name, value in child.get("path_params", {}).items():
            if isinstance(value, str) and ("\x00" in value or "\ufffd" in value):
                return str(name)
    return None


class RequestGuard:
    """Pure ASGI (a ``BaseHTTPMiddleware`` would buffer what this must not read). ``routes``: the app's routes and
    mounts, flat, to name a bad path parameter."""

    def __init__(self, app: ASGIApp, *, settings: Settings, routes: Sequence[BaseRoute]) -> None:
        self.app = app
        self.settings = settings
        self.routes = routes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        refusal = self._url_refusal(scope)
        if refusal is not None:
            await refusal(scope, receive, send)
            return
        headers = Headers(scope=scope)
        length = headers.get("content-length")
        has_body = "transfer-encoding" in headers or (length is not None and length.strip() not in ("", "0"))
        if not has_body:
            await self.app(scope, receive, send)
            return
        tinker = scope["path"].startswith(TINKER_PATH)
        if scope["path"].startswith("/v1/") or tinker:
            refusal = await self._auth_refusal(scope, tinker=tinker)
            if refusal is not None:
                await refusal(scope, receive, send)
                return
        upload = scope["method"] == "POST" and scope["path"].rstrip("/") == UPLOAD_PATH
        limit = self.settings.max_upload_bytes + MULTIPART_SLACK_BYTES if upload else self.settings.max_request_bytes
        limit = self.settings.tinker_max_request_bytes if tinker else limit
        if length is not None and length.strip().isdigit() and int(length) > limit:
            await self._too_large(upload)(scope, receive, send)
            return
        await self._bounded(scope, receive, send, limit=limit, upload=upload)

    def _url_refusal(self, scope: Scope) -> Response | None:
        query: bytes = scope.get("query_string", b"")
        if query:
            name = _bad_query_parameter(query)
            if name is not None:
                return _refusal(400, f"{name}: must be UTF-8 text without NUL characters", param=name)
        raw_path: bytes = scope.get("raw_path") or scope["path"].encode()
        if _text(raw_path) is None:
            name = _bad_path_parameter(self.routes, scope)
            what = name or "the path"
            return _refusal(400, f"{what}: must be UTF-8 text without NUL characters", param=name)
        return None

    async def _auth_refusal(self, scope: Scope, *, tinker: bool) -> Response | None:
        request = Request(scope)  # headers only: no receive channel, so nothing here can read the body
        authenticate = get_tinker_tenant if tinker else get_tenant
        try:
            scope.setdefault("state", {})["tenant"] = await authenticate(request, self.settings)
        except Exception as err:
            response = error_response(request, err)
            if response is None:
                raise
            response.headers["connection"] = "close"
            return response
        return None

    def _too_large(self, upload: bool) -> Response:
        if upload:
            return _refusal(
                413,
                f"the upload exceeds the limit of {self.settings.max_upload_bytes} bytes",
                param="file",
                code="file_too_large",
            )
        return _refusal(
            413,
            f"the request body exceeds the limit of {self.settings.max_request_bytes} bytes",
            code="request_too_large",
        )

    async def _bounded(self, scope: Scope, receive: Receive, send: Send, *, limit: int, upload: bool) -> None:
        received = 0
        started = refused = ended = False

        async def counting_receive() -> Message:
            nonlocal received, refused, ended
            if refused:
                return {"type": "http.disconnect"}
            message = await receive()
            ended = ended or message["type"] != "http.request" or not message.get("more_body", False)
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    # Answer now, if the app has not; the app sees the client gone and gives up on the body.
                    if not started:
                        refused = True
                        await self._too_large(upload)(scope, receive, send)
                    return {"type": "http.disconnect"}
            return message

        async def guarded_send(message: Message) -> None:
            nonlocal started
            if refused:
                return  # the 413 went out: the app's own answer to the cut body is dropped
            if message["type"] == "http.response.start":
                started = True
                if not ended:  # an answer before the body's end (the route's own 413): the rest is never read
                    message = {**message, "headers": [*_without_connection(message.get("headers", [])), CLOSE]}
            await send(message)

        await self.app(scope, counting_receive, guarded_send)


CLOSE = (b"connection", b"close")


def _without_connection(headers: Sequence[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    return [(name, value) for name, value in headers if name.lower() != b"connection"]


def _refusal(status: int, message: str, *, param: str | None = None, code: str | None = None) -> JSONResponse:
    response = error_json(status, message, "invalid_request_error", param=param, code=code)
    response.headers["connection"] = "close"
    return response

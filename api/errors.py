"""Typed errors, rendered once in OpenAI's envelope ``{"error": {"message", "type", "param", "code"}}``.

A client error never surfaces as a 500: domain errors carry their status; a 500 is always a bug.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from sqlalchemy.exc import TimeoutError as SATimeoutError
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger("proxima.api")


class ApiError(Exception):
    status = 400
    type = "invalid_request_error"

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message, self.param, self.code = message, param, code


class InvalidRequest(ApiError):
    status = 400


class Unauthorized(ApiError):
    status = 401
    type = "authentication_error"


class NotFound(ApiError):
    status = 404

    def __init__(self, kind: str, ident: str, *, param: str | None = None) -> None:
        super().__init__(f"No such {kind}: '{ident}'", param=param, code="not_found")


class Conflict(ApiError):
    status = 409


class PayloadTooLarge(ApiError):
    status = 413


class Unavailable(ApiError):
    status = 503
    type = "server_error"


def envelope(message: str, type_: str, param: str | None, code: str | None) -> dict[str, object]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def install(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(_: Request, err: ApiError) -> JSONResponse:
        return JSONResponse(envelope(err.message, err.type, err.param, err.code), status_code=err.status)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, err: RequestValidationError) -> JSONResponse:
        first = err.errors()[0]
        loc = [str(p) for p in first.get("loc", ()) if p not in ("body", "query", "path", "form")]
        param = ".".join(loc) or None
        msg = "unknown field" if first.get("type") == "extra_forbidden" else first.get("msg", "invalid request")
        return JSONResponse(
            envelope(f"{param}: {msg}" if param else msg, "invalid_request_error", param, None), status_code=400
        )

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, err: StarletteHTTPException) -> JSONResponse:
        type_ = "invalid_request_error" if err.status_code < 500 else "server_error"
        return JSONResponse(envelope(str(err.detail), type_, None, None), status_code=err.status_code)

    @app.exception_handler(SATimeoutError)
    async def _busy(request: Request, err: SATimeoutError) -> JSONResponse:
        # Every database connection stayed busy past the pool's timeout: overload, not a bug; clients may retry.
        log.warning("database pool exhausted on %s %s", request.method, request.url.path)
        return JSONResponse(
            envelope("the server is overloaded; retry later", "server_error", None, "overloaded"),
            status_code=503,
            headers={"retry-after": "1"},
        )

    @app.exception_handler(Exception)
    async def _bug(request: Request, err: Exception) -> JSONResponse:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return JSONResponse(envelope("internal error", "server_error", None, None), status_code=500)

"""Typed errors, rendered once in OpenAI's envelope ``{"error": {"message", "type", "param", "code"}}``.

A client error never surfaces as a 500: domain errors carry their status; a backend that is down or too slow (the
database, the artifact store) is a 503 with ``Retry-After`` and a full store a 507, each logged here with the
driver's own words, which never reach the client; a 500 is always a bug.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from sqlalchemy.exc import DBAPIError, DisconnectionError, InterfaceError, OperationalError, SQLAlchemyError
from sqlalchemy.exc import TimeoutError as SATimeoutError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

from api.storage import StorageError, StoreFull

log = logging.getLogger("proxima.api")

RETRY_AFTER_S = 2
"""What a 503 tells clients to wait before trying again (OpenAI's clients honour ``Retry-After``)."""


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


class Forbidden(ApiError):
    """The caller may see the object but not do this to it (OpenAI's 403 on deleting a model it does not own)."""

    status = 403


class NotFound(ApiError):
    status = 404

    def __init__(self, kind: str, ident: str, *, param: str | None = None) -> None:
        super().__init__(f"No such {kind}: '{ident}'", param=param, code="not_found")


class Conflict(ApiError):
    status = 409


class PayloadTooLarge(ApiError):
    status = 413


class ModelNotFound(ApiError):
    """OpenAI's answer to a model that does not exist (or, from the API, one the caller may not use: the two are not
    told apart)."""

    status = 404

    def __init__(self, message: str, *, param: str | None = "model") -> None:
        super().__init__(message, param=param, code="model_not_found")


class Unavailable(ApiError):
    status = 503
    type = "server_error"


class Internal(ApiError):
    """A failure the server knows to be its own (a bug) but caught where it can still answer in the envelope."""

    status = 500
    type = "server_error"


def envelope(message: str, type_: str, param: str | None, code: str | None) -> dict[str, object]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


# -- the envelope in the OpenAPI document ---------------------------------------------------------------------


class ErrorObject(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """OpenAI's error envelope: every 4xx and 5xx answer of the API."""

    error: ErrorObject


ERROR_DESCRIPTIONS = {
    400: "Invalid request: `error.param` names the parameter or field",
    401: "Missing or incorrect API key",
    403: "The object may be used but not changed this way (a base model or a checkpoint is not deletable)",
    404: "No such object (another tenant's object is not found either)",
    409: "The object's state does not allow this",
    413: "The request body is over its size limit",
    429: "Too many requests in flight (grader dry-runs): retry after `Retry-After` seconds, or later",
    503: "A backend (database or artifact store) is unavailable or too slow: retry after `Retry-After` seconds",
    507: "The artifact store is full: nothing was stored",
}

_RETRY_AFTER_HEADER = {"Retry-After": {"description": "seconds to wait before retrying", "schema": {"type": "integer"}}}


def responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI ``responses`` entries for these error statuses, each with the envelope's schema."""
    out: dict[int | str, dict[str, Any]] = {}
    for status in statuses:
        out[status] = {"model": ErrorResponse, "description": ERROR_DESCRIPTIONS[status]}
        if status == 503:
            out[status]["headers"] = _RETRY_AFTER_HEADER
    return out


# -- rendering -------------------------------------------------------------------------------------------------


def error_json(
    status: int, message: str, type_: str, *, param: str | None = None, code: str | None = None, **headers: str
) -> JSONResponse:
    return JSONResponse(envelope(message, type_, param, code), status_code=status, headers=headers or None)


def database_unavailable(err: SQLAlchemyError) -> bool:
    """Whether ``err`` says the database cannot be reached or did not answer in time (down, restarting, frozen, a
    connection reset, a statement or socket timeout: ``api.db``), rather than a bug in a statement."""
    if isinstance(err, OperationalError | InterfaceError | DisconnectionError):
        return True
    return isinstance(err, DBAPIError) and err.connection_invalidated


def unavailable(what: str) -> JSONResponse:
    return error_json(
        503,
        f"the {what} is unavailable; retry later",
        "server_error",
        code="service_unavailable",
        **{"retry-after": str(RETRY_AFTER_S)},
    )


def backend_error_response(request: Request, err: Exception) -> JSONResponse | None:
    """The answer to a backend's failure: a 503 (database or store unavailable, the pool exhausted) or a 507 (a
    full store), logged with its detail; None when ``err`` is none of these (a bug)."""
    where = f"{request.method} {request.url.path}"
    if isinstance(err, SATimeoutError):
        # Every database connection stayed busy past the pool's timeout: overload, not a bug; clients may retry.
        log.warning("database pool exhausted on %s", where)
        return error_json(
            503, "the server is overloaded; retry later", "server_error", code="overloaded", **{"retry-after": "1"}
        )
    if isinstance(err, SQLAlchemyError) and database_unavailable(err):
        log.warning("database unavailable on %s: %s", where, str(err).splitlines()[0] if str(err) else type(err))
        return unavailable("database")
    if isinstance(err, StoreFull):
        log.error("artifact store full on %s: %s", where, err)
        return error_json(
            507,
            "the artifact store is full: nothing was stored; retry once the operator has freed space",
            "server_error",
            code="store_full",
        )
    if isinstance(err, StorageError):
        log.error("artifact store failed on %s: %s", where, err)
        return unavailable("artifact store")
    return None


def error_response(request: Request, err: Exception) -> JSONResponse | None:
    """What the handlers below answer for ``err``, for code that runs outside them (an ASGI middleware)."""
    if isinstance(err, ApiError):
        return error_json(err.status, err.message, err.type, param=err.param, code=err.code)
    return backend_error_response(request, err)


def allowed_methods(request: Request) -> list[str]:
    """Every method some route serves at the request's path (Starlette's 405 names only the first route's).
    ``app.state.routes``: the app's routes, flat (``api.app``)."""
    routes = getattr(request.app.state, "routes", None) or request.app.router.routes
    methods: set[str] = set()
    for route in routes:
        match, _ = route.matches(request.scope)
        if match != Match.NONE:
            methods |= set(getattr(route, "methods", None) or ())
    return sorted(methods)


def validation_error(err: RequestValidationError) -> JSONResponse:
    """The API's 400 for a body or query that does not validate: ``param`` the field's dotted path, the message
    pydantic's (``unknown field`` for one the schema lacks)."""
    first = err.errors()[0]
    # FastAPI puts where the value came from first ("body", "query", ...); only that element is not the field's
    # path (a metadata key may itself be called "body").
    loc = [str(p) for p in first.get("loc", ())]
    if loc and loc[0] in ("body", "query", "path", "form", "header", "cookie"):
        loc = loc[1:]
    param = ".".join(loc) or None
    msg = "unknown field" if first.get("type") == "extra_forbidden" else first.get("msg", "invalid request")
    return error_json(400, f"{param}: {msg}" if param else msg, "invalid_request_error", param=param)


def _openai_param(loc: tuple[Any, ...]) -> str | None:
    """A pydantic location as OpenAI names a parameter: ``messages[0].content``."""
    out = ""
    for p in loc:
        if p in ("body", "query"):
            continue
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out or None


def openai_validation_error(err: RequestValidationError) -> JSONResponse:
    """The same 400 in OpenAI's own words, as OpenAI-compatible servers (vLLM) answer it: an unknown top-level
    parameter is "Unrecognized request argument supplied: NAME" (``param`` null), a missing one "Missing required
    parameter", a body that is not JSON OpenAI's hint about it."""
    first = err.errors()[0]
    loc = tuple(first.get("loc", ()))
    if first.get("type") == "extra_forbidden":
        # OpenAI's own words for an unknown top-level parameter (a nested one is named by its path)
        name = _openai_param(loc) or "?"
        return error_json(400, f"Unrecognized request argument supplied: {name}", "invalid_request_error")
    if first.get("type") == "json_invalid":
        message = "We could not parse the JSON body of your request. (HINT: This likely means you aren't using your "
        message += "HTTP library correctly. The OpenAI API expects a JSON payload.)"
        return error_json(400, message, "invalid_request_error")
    param = _openai_param(loc)
    msg = str(first.get("msg", "invalid value"))
    if first.get("type") == "missing":
        return error_json(400, f"Missing required parameter: '{param}'.", "invalid_request_error", param=param)
    return error_json(400, f"Invalid value for '{param}': {msg}", "invalid_request_error", param=param)


def _http_message(request: Request, err: StarletteHTTPException, *, openai_wording: bool) -> str:
    if openai_wording and err.status_code == 404:
        return f"Invalid URL ({request.method} {request.url.path})"
    if openai_wording and err.status_code == 405:
        return f"Method not allowed ({request.method} {request.url.path})"
    return str(err.detail)


def install(app: FastAPI, *, openai_wording: bool = False) -> None:
    """Every error of ``app`` rendered in the envelope. ``openai_wording``: invalid requests and unknown URLs or
    methods in OpenAI's own words (:func:`openai_validation_error`), for the inference server, whose clients are
    OpenAI's and vLLM's; the API names the invalid field instead (:func:`validation_error`)."""
    invalid = openai_validation_error if openai_wording else validation_error

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, err: ApiError) -> JSONResponse:
        return error_json(err.status, err.message, err.type, param=err.param, code=err.code)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, err: RequestValidationError) -> JSONResponse:
        return invalid(err)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, err: StarletteHTTPException) -> JSONResponse:
        type_ = "invalid_request_error" if err.status_code < 500 else "server_error"
        headers = dict(err.headers or {})
        if err.status_code == 405:
            headers["Allow"] = ", ".join(allowed_methods(request))
        response = error_json(err.status_code, _http_message(request, err, openai_wording=openai_wording), type_)
        response.headers.update(headers)
        return response

    @app.exception_handler(SQLAlchemyError)
    @app.exception_handler(StorageError)
    async def _backend(request: Request, err: Exception) -> JSONResponse:
        return backend_error_response(request, err) or _internal(request)

    @app.exception_handler(Exception)
    async def _bug(request: Request, err: Exception) -> JSONResponse:
        return _internal(request)


def _internal(request: Request) -> JSONResponse:
    log.exception("unhandled error on %s %s", request.method, request.url.path)
    return error_json(500, "internal error", "server_error")

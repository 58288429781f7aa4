"""Domain errors of the registry and the one place they become HTTP responses.

Data-access code raises these (never HTTPException); `install_handlers` maps them, pydantic
validation errors, database errors and Starlette's own HTTP errors (unknown path, wrong method, an
unreadable body) to status codes with one body shape, `api.schemas.ErrorResponse`:
{"detail": "<field>: <problem>; ...", "errors": [{"field", "message", "type"}]}.
`error_responses(...)` declares that shape in the OpenAPI document for the codes a route can send,
so the published schema and the responses agree.
"""
from __future__ import annotations

import logging
from typing import Any
from urllib.parse import quote

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, RedirectResponse
from sqlalchemy.exc import DataError, IntegrityError, OperationalError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

from api.schemas import MAX_BATCH_ITEMS, ErrorResponse

__all__ = ["RegistryError", "NotFoundError", "InvalidInputError", "AuthError", "LoginRequired",
           "BodyTooLarge", "error_body", "error_responses", "read_responses", "write_responses",
           "registry_error_response",
           "http_error_response", "unavailable_response", "install_handlers", "LOGIN_PATH"]

_log = logging.getLogger(__name__)

LOGIN_PATH = "/login"


class RegistryError(Exception):
    """Base of the registry's domain errors; `status_code` is the HTTP mapping."""

    status_code = 400

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.field = field


class NotFoundError(RegistryError, LookupError):
    status_code = 404


class InvalidInputError(RegistryError, ValueError):
    status_code = 422


class AuthError(RegistryError):
    status_code = 401


class LoginRequired(AuthError):
    """A browser asked for an HTML page without a valid session: answered with a redirect to the
    login page, which comes back to `next_path` afterwards."""

    def __init__(self, next_path: str) -> None:
        super().__init__("sign in first", field="cookie")
        self.next_path = next_path


class BodyTooLarge(StarletteHTTPException):
    """Raised from the body stream the moment a request body passes its endpoint's limit (an
    HTTPException, so FastAPI's body parsing lets it through instead of calling it a 400)."""

    def __init__(self, limit: int) -> None:
        super().__init__(413, f"request body exceeds this endpoint's limit of {limit} bytes; "
                              "send smaller batches")
        self.limit = limit


def error_body(message: str, errors: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """An `ErrorResponse` as a dict (for code that answers without FastAPI, e.g. middleware)."""
    return {"detail": message, "errors": errors or []}


_DESCRIPTIONS = {
    400: "the body could not be read as JSON text (e.g. it is not UTF-8)",
    401: "missing, invalid, revoked or expired token (send 'Authorization: Bearer <token>')",
    404: "the sweep or run does not exist",
    409: "the request conflicts with stored data (e.g. its run was deleted meanwhile)",
    413: "the body is over this endpoint's byte limit, or a batch has more than "
         f"{MAX_BATCH_ITEMS:,} items; nothing was stored",
    422: "a value is invalid; `errors` names each field",
    503: "the database is unavailable; retry later",
}


def error_responses(*codes: int, notes: dict[int, str] | None = None
                    ) -> dict[int | str, dict[str, Any]]:
    """OpenAPI `responses` entries: `ErrorResponse` for each of `codes`, with the standard
    description unless `notes` gives another."""
    notes = notes or {}
    return {code: {"model": ErrorResponse, "description": notes.get(code, _DESCRIPTIONS[code])}
            for code in sorted(set(codes))}


_READS_CLOSED = ("reads require a token (CRUCIBLE_READS_REQUIRE_TOKEN) and neither a valid "
                 "bearer token nor a session cookie was sent")


def read_responses(*codes: int) -> dict[int | str, dict[str, Any]]:
    """Error responses of a read: 401 (closed mode only), 422, 503, and `codes`."""
    return error_responses(401, 422, 503, *codes, notes={401: _READS_CLOSED})


def write_responses(*codes: int) -> dict[int | str, dict[str, Any]]:
    """Error responses of a write with a JSON body: 400, 401, 413, 422, 503, and `codes`."""
    return error_responses(400, 401, 413, 422, 503, *codes)


def _field(loc: tuple[Any, ...]) -> str:
    return ".".join(str(part) for part in loc)


def registry_error_response(exc: RegistryError) -> JSONResponse | RedirectResponse:
    """The response to a domain error (also sent by middleware, outside FastAPI's handlers)."""
    if isinstance(exc, LoginRequired):
        return RedirectResponse(f"{LOGIN_PATH}?next={quote(exc.next_path, safe='/')}",
                                status_code=303)
    errors = [{"field": exc.field, "message": exc.message, "type": type(exc).__name__}]
    headers = {"WWW-Authenticate": "Bearer"} if isinstance(exc, AuthError) else None
    return JSONResponse(error_body(exc.message, errors), status_code=exc.status_code,
                        headers=headers)


def http_error_response(exc: StarletteHTTPException) -> JSONResponse:
    """The response to a Starlette HTTP error (404 path, 405 method, 400 body, 413 too large)."""
    errors = ([{"field": "body", "message": "too large", "type": "too_large"}]
              if isinstance(exc, BodyTooLarge) else [])
    return JSONResponse(error_body(str(exc.detail), errors), status_code=exc.status_code,
                        headers=exc.headers)


def unavailable_response() -> JSONResponse:
    """503: the database cannot be reached."""
    return JSONResponse(error_body("the database is unavailable; retry later"), status_code=503)


async def _on_registry_error(_request: Request, exc: Exception
                             ) -> JSONResponse | RedirectResponse:
    assert isinstance(exc, RegistryError)
    return registry_error_response(exc)


async def _on_validation_error(_request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    errors = [{"field": _field(e["loc"]), "message": e["msg"], "type": e["type"]}
              for e in exc.errors()]
    message = "; ".join(f"{e['field']}: {e['message']}" for e in errors[:20])
    # a batch over the item limit is a body too large, refused whole
    too_large = any(e["type"] == "too_long" and e["field"] == "body.items" for e in errors)
    return JSONResponse(error_body(message, errors), status_code=413 if too_large else 422)


_METHODS = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE")


def _allowed_methods(request: Request) -> str:
    """Every method some route serves at this path (Starlette names only the first route's)."""
    routes = request.app.router.routes
    return ", ".join(method for method in _METHODS
                     if any(route.matches({**request.scope, "method": method})[0] is Match.FULL
                            for route in routes))


async def _on_http_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    if exc.status_code == 405:
        exc.headers = {**(exc.headers or {}), "Allow": _allowed_methods(request)}
    return http_error_response(exc)


async def _on_integrity_error(_request: Request, exc: Exception) -> JSONResponse:
    _log.info("integrity error: %s", exc)
    return JSONResponse(error_body("the request conflicts with stored data (a referenced object "
                                   "is missing or a unique key exists)"), status_code=409)


async def _on_data_error(_request: Request, exc: Exception) -> JSONResponse:
    _log.info("data error: %s", exc)
    return JSONResponse(error_body("a value cannot be stored (out of range or malformed)"),
                        status_code=422)


async def _on_operational_error(_request: Request, exc: Exception) -> JSONResponse:
    _log.warning("database unavailable: %s", exc)
    return unavailable_response()


def install_handlers(app: FastAPI) -> None:
    """Register the error-to-response mapping on `app`."""
    app.add_exception_handler(RegistryError, _on_registry_error)
    app.add_exception_handler(RequestValidationError, _on_validation_error)
    app.add_exception_handler(StarletteHTTPException, _on_http_error)
    app.add_exception_handler(IntegrityError, _on_integrity_error)
    app.add_exception_handler(DataError, _on_data_error)
    app.add_exception_handler(OperationalError, _on_operational_error)

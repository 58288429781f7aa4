"""Domain errors of the registry and the one place they become HTTP responses.

Data-access code raises these (never HTTPException); `install_handlers` maps them, pydantic
validation errors and database errors to status codes with bodies that say what was wrong:
{"detail": "<field>: <problem>; ...", "errors": [{"field", "message", "type"}]}.
"""
from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from sqlalchemy.exc import DataError, IntegrityError, OperationalError

__all__ = ["RegistryError", "NotFoundError", "InvalidInputError", "AuthError", "install_handlers"]

_log = logging.getLogger(__name__)


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


def _body(message: str, errors: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {"detail": message, "errors": errors or []}


def _field(loc: tuple[Any, ...]) -> str:
    return ".".join(str(part) for part in loc)


async def _on_registry_error(_request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RegistryError)
    errors = [{"field": exc.field, "message": exc.message, "type": type(exc).__name__}]
    headers = {"WWW-Authenticate": "Bearer"} if isinstance(exc, AuthError) else None
    return JSONResponse(_body(exc.message, errors), status_code=exc.status_code, headers=headers)


async def _on_validation_error(_request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    errors = [{"field": _field(e["loc"]), "message": e["msg"], "type": e["type"]}
              for e in exc.errors()]
    message = "; ".join(f"{e['field']}: {e['message']}" for e in errors[:20])
    # a batch over the item limit is a body too large, refused whole
    too_large = any(e["type"] == "too_long" and e["field"] == "body.items" for e in errors)
    return JSONResponse(_body(message, errors), status_code=413 if too_large else 422)


async def _on_integrity_error(_request: Request, exc: Exception) -> JSONResponse:
    _log.info("integrity error: %s", exc)
    return JSONResponse(_body("the request conflicts with stored data (a referenced object is "
                              "missing or a unique key exists)"), status_code=409)


async def _on_data_error(_request: Request, exc: Exception) -> JSONResponse:
    _log.info("data error: %s", exc)
    return JSONResponse(_body("a value cannot be stored (out of range or malformed)"),
                        status_code=422)


async def _on_operational_error(_request: Request, exc: Exception) -> JSONResponse:
    _log.warning("database unavailable: %s", exc)
    return JSONResponse(_body("the database is unavailable; retry later"), status_code=503)


def install_handlers(app: FastAPI) -> None:
    """Register the error-to-response mapping on `app`."""
    app.add_exception_handler(RegistryError, _on_registry_error)
    app.add_exception_handler(RequestValidationError, _on_validation_error)
    app.add_exception_handler(IntegrityError, _on_integrity_error)
    app.add_exception_handler(DataError, _on_data_error)
    app.add_exception_handler(OperationalError, _on_operational_error)

"""FastAPI dependencies: settings, one database session per request, and token checks."""
from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy.orm import Session

from api.errors import AuthError
from api.security import verify_token
from api.settings import Settings

__all__ = ["SettingsDep", "SessionDep", "WriteAuthDep", "ReadAuthDep", "get_db"]

_bearer = HTTPBearer(auto_error=False, description="an API token from `crucible api token create`")


def _settings(request: Request) -> Settings:
    return request.app.state.settings


SettingsDep = Annotated[Settings, Depends(_settings)]


def get_db(request: Request) -> Iterator[Session]:
    """A session for one request, closed (rolled back if uncommitted) afterwards."""
    with request.app.state.session_factory() as session:
        yield session


SessionDep = Annotated[Session, Depends(get_db)]
Credentials = Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]


def _check(session: Session, settings: Settings, credentials: HTTPAuthorizationCredentials | None
           ) -> None:
    if credentials is None or not credentials.credentials:
        raise AuthError("missing bearer token: send 'Authorization: Bearer <token>' "
                        "(create one with `crucible api token create`)", field="header.Authorization")
    static = settings.api_token.get_secret_value() if settings.api_token else None
    if not verify_token(session, token=credentials.credentials, static_token=static):
        raise AuthError("invalid or revoked token", field="header.Authorization")


def require_write(session: SessionDep, settings: SettingsDep, credentials: Credentials) -> None:
    """Every write needs a valid bearer token."""
    _check(session, settings, credentials)


def require_read(session: SessionDep, settings: SettingsDep, credentials: Credentials) -> None:
    """Reads are open unless `reads_require_token` is set."""
    if settings.reads_require_token:
        _check(session, settings, credentials)


WriteAuthDep = Depends(require_write)
ReadAuthDep = Depends(require_read)

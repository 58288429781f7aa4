"""FastAPI dependencies: settings, one database session per request, and token checks.

Writes need a bearer token (already verified by `api.middleware.RequestGuard` before the body
was read; the dependency re-checks only when that did not happen). Reads are open unless
`reads_require_token`; then a bearer token or a browser session cookie (`api.sessions`) lets
them through, and HTML pages send a browser without either to the login page.
"""
from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import APIKeyCookie, HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy.orm import Session

from api.errors import AuthError, LoginRequired
from api.middleware import INVALID_TOKEN, MISSING_TOKEN, PRINCIPAL_KEY
from api.security import Principal, authenticate, principal_for
from api.sessions import SESSION_COOKIE, read_session
from api.settings import Settings
from db.models import utcnow

__all__ = ["SettingsDep", "SessionDep", "WriteAuthDep", "ReadAuthDep", "PageAuthDep", "get_db",
           "static_token", "session_principal"]

_bearer = HTTPBearer(auto_error=False, description="an API token from `crucible api token create`")
_cookie = APIKeyCookie(name=SESSION_COOKIE, auto_error=False,
                       description="a browser session from /login (reads only)")
_READS_CLOSED = ("reads require a token: send 'Authorization: Bearer <token>', or sign in at "
                 "/login in a browser")


def _settings(request: Request) -> Settings:
    return request.app.state.settings


SettingsDep = Annotated[Settings, Depends(_settings)]


def get_db(request: Request) -> Iterator[Session]:
    """A session for one request, closed (rolled back if uncommitted) afterwards."""
    with request.app.state.session_factory() as session:
        yield session


SessionDep = Annotated[Session, Depends(get_db)]
Credentials = Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]
Cookie = Annotated[str | None, Depends(_cookie)]


def static_token(settings: Settings) -> str | None:
    """The settings token (`CRUCIBLE_API_TOKEN`) in plain text, or None."""
    return settings.token


def _bearer_principal(session: Session, settings: Settings,
                      credentials: HTTPAuthorizationCredentials | None) -> Principal | None:
    if credentials is None or not credentials.credentials:
        return None
    return authenticate(session, token=credentials.credentials, static_token=static_token(settings))


def session_principal(request: Request, session: Session, cookie: str | None) -> Principal | None:
    """The principal of a valid session cookie whose token is still valid, or None."""
    if not cookie:
        return None
    ref = read_session(cookie, secret=request.app.state.session_secret, now=utcnow())
    if ref is None:
        return None
    return principal_for(session, ref=ref, static_token=static_token(request.app.state.settings))


def require_write(request: Request, session: SessionDep, settings: SettingsDep,
                  credentials: Credentials) -> None:
    """Every write needs a valid bearer token (a session cookie never writes)."""
    if request.scope.get("state", {}).get(PRINCIPAL_KEY) is not None:
        return
    if credentials is None or not credentials.credentials:
        raise AuthError(MISSING_TOKEN, field="header.Authorization")
    if _bearer_principal(session, settings, credentials) is None:
        raise AuthError(INVALID_TOKEN, field="header.Authorization")


def _reader(request: Request, session: Session, settings: Settings,
            credentials: HTTPAuthorizationCredentials | None, cookie: str | None
            ) -> Principal | None:
    return (_bearer_principal(session, settings, credentials)
            or session_principal(request, session, cookie))


def require_read(request: Request, session: SessionDep, settings: SettingsDep,
                 credentials: Credentials, cookie: Cookie) -> None:
    """Reads are open unless `reads_require_token` is set; then a bearer token or a session."""
    if settings.reads_require_token and _reader(request, session, settings, credentials,
                                                cookie) is None:
        raise AuthError(_READS_CLOSED, field="header.Authorization")


def require_page(request: Request, session: SessionDep, settings: SettingsDep,
                 credentials: Credentials, cookie: Cookie) -> None:
    """Like `require_read`, for HTML pages: an anonymous browser is sent to /login."""
    if settings.reads_require_token and _reader(request, session, settings, credentials,
                                                cookie) is None:
        query = request.url.query
        raise LoginRequired(request.url.path + (f"?{query}" if query else ""))


WriteAuthDep = Depends(require_write)
ReadAuthDep = Depends(require_read)
PageAuthDep = Depends(require_page)

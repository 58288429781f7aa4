"""Browser sign-in for closed mode (`reads_require_token`): /login and /logout.

GET /login shows a form (or, when signed in, which token the session belongs to); POST /login
takes `token` (and `next`, where to go afterwards) as a url-encoded form, checks the token once
and sets the session cookie of `api.sessions`: HttpOnly, SameSite=Strict, Secure when the request
came over https, never holding the token itself. /logout clears it. Pages are plain HTML with no
script; they are not part of the OpenAPI document (they are for browsers, not API clients).
"""
from __future__ import annotations

import html
import re
from datetime import timedelta
from urllib.parse import parse_qs

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from starlette.concurrency import run_in_threadpool

from api.deps import session_principal, static_token
from api.errors import LOGIN_PATH
from api.security import Principal, authenticate
from api.sessions import SESSION_COOKIE, issue_session
from db.models import utcnow

__all__ = ["router", "LOGOUT_PATH"]

LOGOUT_PATH = "/logout"
router = APIRouter(include_in_schema=False)
_SAFE_NEXT = re.compile(r"^/(?![/\\])[^\s]{0,2000}$")  # a path on this server, not //other.host
_STYLE = ("body{font:16px system-ui,sans-serif;max-width:28rem;margin:4rem auto;padding:0 1rem;"
          "color:#1f2933}input{font:inherit;width:100%;padding:.5rem;margin:.5rem 0 1rem;"
          "box-sizing:border-box}button{font:inherit;padding:.5rem 1rem}"
          ".error{color:#b42318}")


def _next(value: str | None) -> str:
    return value if value and _SAFE_NEXT.match(value) else LOGIN_PATH


def _page(body: str, *, status_code: int = 200) -> HTMLResponse:
    return HTMLResponse(
        f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><meta name="viewport" '
        f'content="width=device-width, initial-scale=1"><link rel="icon" href="data:,">'
        f'<title>Crucible sign-in</title>'
        f'<style>{_STYLE}</style></head><body><h1>Crucible</h1>{body}</body></html>',
        status_code=status_code, headers={"Cache-Control": "no-store"})


def _form(next_path: str, *, error: str | None = None, status_code: int = 200) -> HTMLResponse:
    message = f'<p class="error" role="alert">{html.escape(error)}</p>' if error else ""
    return _page(
        f'{message}<form method="post" action="{LOGIN_PATH}">'
        f'<label for="token">API token</label>'
        f'<input id="token" name="token" type="password" autocomplete="current-password" '
        f'required autofocus>'
        f'<input type="hidden" name="next" value="{html.escape(next_path)}">'
        f'<button type="submit">Sign in</button></form>'
        f'<p>Create a token with <code>crucible api token create</code>. The session lasts until '
        f'you sign out, it expires, or its token is revoked.</p>', status_code=status_code)


@router.get(LOGIN_PATH, response_class=HTMLResponse)
def login_page(request: Request, next: str | None = None) -> HTMLResponse:  # noqa: A002
    """The sign-in form, or who is signed in."""
    with request.app.state.session_factory() as session:
        principal = session_principal(request, session, request.cookies.get(SESSION_COOKIE))
    if principal is None:
        return _form(_next(next))
    return _page(f"<p>Signed in with the token <strong>{html.escape(principal.name)}</strong>."
                 f'</p><form method="post" action="{LOGOUT_PATH}">'
                 f'<button type="submit">Sign out</button></form>')


def _sign_in(request: Request, token: str) -> Principal | None:
    settings = request.app.state.settings
    with request.app.state.session_factory() as session:
        return authenticate(session, token=token, static_token=static_token(settings))


@router.post(LOGIN_PATH)
async def login(request: Request) -> Response:
    """Check the form's token; on success set the session cookie and go to `next`."""
    try:
        form = parse_qs((await request.body()).decode("utf-8", "replace"), max_num_fields=4)
    except ValueError:  # more fields than the form has
        form = {}
    token = (form.get("token") or [""])[0].strip()
    next_path = _next((form.get("next") or [None])[0])
    principal = await run_in_threadpool(_sign_in, request, token) if token else None
    if principal is None:
        return _form(next_path, error="That token is invalid, revoked or expired.",
                     status_code=401)
    settings = request.app.state.settings
    now = utcnow()
    expires_at = now + timedelta(seconds=settings.session_ttl_s)
    if principal.expires_at is not None:
        expires_at = min(expires_at, principal.expires_at)
    response = RedirectResponse(next_path, status_code=303)
    response.set_cookie(
        SESSION_COOKIE, issue_session(ref=principal.ref, expires_at=expires_at,
                                      secret=request.app.state.session_secret),
        max_age=max(1, int((expires_at - now).total_seconds())), path="/", httponly=True,
        samesite="strict", secure=request.url.scheme == "https")
    return response


@router.api_route(LOGOUT_PATH, methods=["GET", "POST"])
def logout(request: Request) -> Response:
    """Forget the session cookie and show the sign-in form."""
    response = RedirectResponse(LOGIN_PATH, status_code=303)
    response.delete_cookie(SESSION_COOKIE, path="/", httponly=True, samesite="strict",
                           secure=request.url.scheme == "https")
    return response

"""ASGI middleware guarding request bodies: a write is authenticated from its headers before one
body byte is read, and every body is counted against its endpoint's byte limit as it streams in.

- Writes (any method but GET/HEAD/OPTIONS under the API prefix) need a valid bearer token. It is
  checked before the app runs, in a worker thread (the lookup is a blocking database query, and
  the event loop must keep serving); without one the answer is 401 and the body is never
  received. The principal is left in `scope["state"]` (`PRINCIPAL_KEY`) so the route's own auth
  dependency does not query again.
- Each endpoint has a byte limit (`BODY_LIMITS`, each capped by `Settings.max_body_bytes`). A
  declared Content-Length over it is refused at once; otherwise the body is counted as the app
  pulls it, and `BodyTooLarge` (413) is raised the moment it passes the limit. Nothing is
  buffered here: the app reads the body once, as it would without this middleware.

The limits leave about 2x headroom over the largest batches a client sends: 10,000 metric items
with every field at its widest are 1,430,011 bytes as `json.dumps` writes them (1,830,019
indented); 10,000 events of the widest kinds the trainer emits at most 2,960,011 (3,920,019
indented), by `python -m benchmarks.body_sizes`. Run and sweep documents are bounded by
`api.schemas.MAX_JSON_BYTES` (1,000,000 bytes) per JSON field.
"""
from __future__ import annotations

import re
from collections.abc import Callable

import anyio
from sqlalchemy.exc import OperationalError
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api.errors import (
    LOGIN_PATH,
    AuthError,
    BodyTooLarge,
    http_error_response,
    registry_error_response,
    unavailable_response,
)
from api.security import Principal

__all__ = ["RequestGuard", "Authenticate", "BODY_LIMITS", "PRINCIPAL_KEY", "MISSING_TOKEN",
           "INVALID_TOKEN"]

MiB = 1024 * 1024
BODY_LIMITS = {
    "metrics": 4 * MiB,    # POST /runs/{id}/metrics:batch
    "events": 8 * MiB,     # POST /runs/{id}/events:batch
    "documents": 2 * MiB,  # run and sweep creation and updates (config, spec, summary)
    "login": 4 * 1024,     # the login form: one token
    "other": 64 * 1024,    # anything else (no other route reads a body)
}
PRINCIPAL_KEY = "crucible.principal"
MISSING_TOKEN = ("missing bearer token: send 'Authorization: Bearer <token>' "
                 "(create one with `crucible api token create`)")
INVALID_TOKEN = "invalid, revoked or expired token"
_HEADER = "header.Authorization"
_READ_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
_BATCH = re.compile(r"/runs/[^/]+/(metrics|events):batch$")

Authenticate = Callable[[str], Principal | None]


def _bearer_token(header: str | None) -> str | None:
    """The token of an `Authorization: Bearer <token>` header value, or None."""
    scheme, _, token = (header or "").partition(" ")
    if scheme.lower() != "bearer":
        return None
    return token.strip() or None


class RequestGuard:
    """Wraps `app`: authenticates writes under `api_prefix` with `authenticate` (a blocking
    callable: token -> Principal or None) and enforces `BODY_LIMITS` capped at `max_bytes`."""

    def __init__(self, app: ASGIApp, *, api_prefix: str, max_bytes: int,
                 authenticate: Authenticate) -> None:
        self.app = app
        self.api_prefix = api_prefix.rstrip("/") + "/"
        self.max_bytes = max_bytes
        self.authenticate = authenticate

    def _limit(self, path: str) -> int:
        if path == LOGIN_PATH:
            kind = "login"
        elif path.startswith(self.api_prefix):
            batch = _BATCH.search(path)
            kind = batch.group(1) if batch else "documents"
        else:
            kind = "other"
        return min(BODY_LIMITS[kind], self.max_bytes)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if scope["method"] not in _READ_METHODS and scope["path"].startswith(self.api_prefix):
            refusal = await self._authenticate(scope)
            if refusal is not None:
                await refusal(scope, receive, send)
                return
        limit = self._limit(scope["path"])
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            await http_error_response(BodyTooLarge(limit))(scope, receive, send)
            return
        await self._limited(scope, receive, send, limit)

    async def _authenticate(self, scope: Scope) -> Response | None:
        """None when the request carries a valid token (recorded in the scope's state); the
        response to send otherwise."""
        header = dict(scope.get("headers") or []).get(b"authorization")
        token = _bearer_token(header.decode("latin-1") if header is not None else None)
        if token is None:
            return registry_error_response(AuthError(MISSING_TOKEN, field=_HEADER))
        try:
            principal = await anyio.to_thread.run_sync(self.authenticate, token)
        except OperationalError:
            return unavailable_response()
        if principal is None:
            return registry_error_response(AuthError(INVALID_TOKEN, field=_HEADER))
        scope.setdefault("state", {})[PRINCIPAL_KEY] = principal
        return None

    async def _limited(self, scope: Scope, receive: Receive, send: Send, limit: int) -> None:
        seen = 0
        started = False

        async def counted_receive() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    raise BodyTooLarge(limit)
            return message

        async def tracked_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counted_receive, tracked_send)
        except BodyTooLarge:
            # FastAPI answers it through api.errors; this covers code that does not
            if started:
                raise
            await http_error_response(BodyTooLarge(limit))(scope, receive, send)

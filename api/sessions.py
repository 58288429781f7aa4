"""Browser sessions for closed-mode reads: a signed, expiring cookie value, never the token.

`/login` checks a token once and sets the cookie `SESSION_COOKIE` to
`base64url("<token ref>|<expiry unix s>") + "." + base64url(HMAC-SHA256(secret, that))`, where
the ref names the token without its secret (`api.security.Principal.ref`). A value is accepted
while its signature matches, it has not expired, and its token is still valid (checked on every
request, so revoking a token ends its sessions). The secret is `CRUCIBLE_SESSION_SECRET`, or a
random one per process (sessions then end when the API restarts). Sessions grant reads only:
writes always need the bearer header, so a cross-site form can never write with a cookie.
"""
from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
from datetime import UTC, datetime

__all__ = ["SESSION_COOKIE", "issue_session", "read_session"]

SESSION_COOKIE = "crucible_session"


def _b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def _sign(secret: bytes, payload: str) -> str:
    return _b64(hmac.new(secret, payload.encode(), hashlib.sha256).digest())


def issue_session(*, ref: str, expires_at: datetime, secret: bytes) -> str:
    """The cookie value for the token `ref`, valid until `expires_at`."""
    payload = _b64(f"{ref}|{int(expires_at.timestamp())}".encode())
    return f"{payload}.{_sign(secret, payload)}"


def read_session(value: str, *, secret: bytes, now: datetime) -> str | None:
    """The token ref of a well-signed, unexpired cookie value; None for anything else
    (including any value that is not ASCII: a value this module issued is base64url)."""
    if not value.isascii():  # and compare_digest refuses non-ASCII text with TypeError
        return None
    payload, _, signature = value.partition(".")
    if not payload or not hmac.compare_digest(_sign(secret, payload).encode(),
                                              signature.encode()):
        return None
    try:
        ref, _, expiry = _unb64(payload).decode().rpartition("|")
        expires_at = datetime.fromtimestamp(int(expiry), UTC)
    except (binascii.Error, UnicodeDecodeError, ValueError, OverflowError, OSError):
        return None
    return ref if ref and expires_at > now else None

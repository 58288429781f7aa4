"""API tokens: generated once, stored only as SHA-256 hashes, checked in constant time.

A token is looked up by its hash (so the database never sees the secret) and the stored hash is
then compared with `hmac.compare_digest`; the token from settings (`CRUCIBLE_API_TOKEN`) is also
accepted, compared the same way, so a single-user deployment needs no database token. A stored
token stops working once revoked or past its optional expiry. Its `last_used_at` is refreshed at
most once per `LAST_USED_RESOLUTION_S`, so a busy client costs one UPDATE a minute, not one per
request.
"""
from __future__ import annotations

import hashlib
import hmac
import secrets
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from db.models import ApiToken, utcnow

__all__ = ["hash_token", "create_token", "authenticate", "principal_for", "list_tokens",
           "revoke_token", "token_state", "as_utc", "Principal", "TokenLookupError",
           "TOKEN_PREFIX", "LAST_USED_RESOLUTION_S"]

TOKEN_PREFIX = "crc_"
LAST_USED_RESOLUTION_S = 60
_STATIC = "static:"


class TokenLookupError(LookupError):
    """No token, or more than one, matches a name or id; the message says which and why."""


@dataclass(frozen=True)
class Principal:
    """Whom a valid token belongs to. `ref` identifies it without its secret: the token row's id,
    or "static:<hash prefix>" for the settings token (so rotating that token ends its sessions)."""

    ref: str
    name: str
    expires_at: datetime | None


def hash_token(token: str) -> str:
    """Hex SHA-256 of a token (tokens are random, so no salt or slow hash is needed)."""
    return hashlib.sha256(token.encode("utf-8", "surrogatepass")).hexdigest()


def as_utc(moment: datetime | None) -> datetime | None:
    """A stored timestamp with its zone: SQLite hands them back naive; they were written in UTC."""
    if moment is None or moment.tzinfo is not None:
        return moment
    return moment.replace(tzinfo=UTC)


def _static_principal(static_token: str) -> Principal:
    return Principal(ref=_STATIC + hash_token(static_token)[:16], name="CRUCIBLE_API_TOKEN",
                     expires_at=None)


def create_token(session: Session, *, name: str = "default",
                 expires_at: datetime | None = None) -> str:
    """Create, store (hashed) and return a new token, valid until `expires_at` (None: until
    revoked); the plaintext is never stored."""
    token = TOKEN_PREFIX + secrets.token_urlsafe(32)
    session.add(ApiToken(name=name, token_hash=hash_token(token), expires_at=expires_at))
    session.commit()
    return token


def token_state(row: ApiToken, *, now: datetime) -> str:
    """"revoked", "expired" or "active"."""
    if row.revoked_at is not None:
        return "revoked"
    expires_at = as_utc(row.expires_at)
    return "expired" if expires_at is not None and expires_at <= now else "active"


def _usable(row: ApiToken, now: datetime) -> bool:
    return token_state(row, now=now) == "active"


def _touch(session: Session, row: ApiToken, now: datetime) -> None:
    last = as_utc(row.last_used_at)
    if last is None or now - last >= timedelta(seconds=LAST_USED_RESOLUTION_S):
        session.execute(update(ApiToken).where(ApiToken.id == row.id).values(last_used_at=now))
        session.commit()


def authenticate(session: Session, *, token: str, static_token: str | None = None,
                 now: datetime | None = None) -> Principal | None:
    """The principal of `token` when it equals `static_token` or a stored token that is neither
    revoked nor expired (refreshing its `last_used_at`); None otherwise."""
    now = now or utcnow()
    digest = hash_token(token)
    if static_token and hmac.compare_digest(digest, hash_token(static_token)):
        return _static_principal(static_token)
    row = session.scalar(select(ApiToken).where(ApiToken.token_hash == digest))
    if row is None or not hmac.compare_digest(row.token_hash, digest) or not _usable(row, now):
        return None
    _touch(session, row, now)
    return Principal(ref=str(row.id), name=row.name, expires_at=as_utc(row.expires_at))


def principal_for(session: Session, *, ref: str, static_token: str | None = None,
                  now: datetime | None = None) -> Principal | None:
    """The principal behind a session's `ref` if its token is still valid (not revoked, not
    expired, or still the settings token); None otherwise."""
    now = now or utcnow()
    if ref.startswith(_STATIC):
        principal = _static_principal(static_token) if static_token else None
        return principal if principal is not None and principal.ref == ref else None
    try:
        token_id = uuid.UUID(ref)
    except ValueError:
        return None
    row = session.get(ApiToken, token_id)
    if row is None or not _usable(row, now):
        return None
    _touch(session, row, now)
    return Principal(ref=str(row.id), name=row.name, expires_at=as_utc(row.expires_at))


def list_tokens(session: Session) -> list[ApiToken]:
    """Every stored token (revoked and expired ones too), oldest first."""
    return list(session.scalars(select(ApiToken).order_by(ApiToken.created_at, ApiToken.id)))


def revoke_token(session: Session, *, name_or_id: str, now: datetime | None = None) -> ApiToken:
    """Revoke the token with this id, or the one unrevoked token with this name, and commit.
    Revoking a revoked token changes nothing. Raises TokenLookupError when nothing matches or a
    name matches several unrevoked tokens."""
    try:
        row = session.get(ApiToken, uuid.UUID(name_or_id))
        matches = [row] if row is not None else []
    except ValueError:
        matches = list(session.scalars(select(ApiToken).where(ApiToken.name == name_or_id,
                                                              ApiToken.revoked_at.is_(None))))
    if not matches:
        raise TokenLookupError(f"no unrevoked token named or with id {name_or_id!r}; "
                               "see `crucible api token list`")
    if len(matches) > 1:
        ids = ", ".join(str(m.id) for m in matches)
        raise TokenLookupError(f"{len(matches)} unrevoked tokens are named {name_or_id!r} "
                               f"({ids}); revoke one by its id")
    (row,) = matches
    if row.revoked_at is None:
        row.revoked_at = now or utcnow()
        session.commit()
    return row

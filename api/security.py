"""API tokens: generated once, stored only as SHA-256 hashes, checked in constant time.

A token is looked up by its hash (so the database never sees the secret) and the stored hash is
then compared with `hmac.compare_digest`; the token from settings (`CRUCIBLE_API_TOKEN`) is also
accepted, compared the same way, so a single-user deployment needs no database token.
"""
from __future__ import annotations

import hashlib
import hmac
import secrets

from sqlalchemy import select
from sqlalchemy.orm import Session

from db.models import ApiToken

__all__ = ["hash_token", "create_token", "verify_token", "TOKEN_PREFIX"]

TOKEN_PREFIX = "crc_"


def hash_token(token: str) -> str:
    """Hex SHA-256 of a token (tokens are random, so no salt or slow hash is needed)."""
    return hashlib.sha256(token.encode("utf-8", "surrogatepass")).hexdigest()


def create_token(session: Session, *, name: str = "default") -> str:
    """Create, store (hashed) and return a new token; the plaintext is never stored."""
    token = TOKEN_PREFIX + secrets.token_urlsafe(32)
    session.add(ApiToken(name=name, token_hash=hash_token(token)))
    session.commit()
    return token


def verify_token(session: Session, *, token: str, static_token: str | None = None) -> bool:
    """True when `token` equals `static_token` or a stored, unrevoked token."""
    digest = hash_token(token)
    if static_token and hmac.compare_digest(digest, hash_token(static_token)):
        return True
    stored = session.scalar(select(ApiToken.token_hash).where(ApiToken.token_hash == digest,
                                                             ApiToken.revoked_at.is_(None)))
    return stored is not None and hmac.compare_digest(stored, digest)

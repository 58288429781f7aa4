"""Engines and sessions for the registry database.

`make_engine` is the one place URLs are normalised: a bare `postgresql://` URL gets the psycopg 3
driver, and SQLite gets foreign keys switched on (off by default there) so cascades behave as on
Postgres.
"""
from __future__ import annotations

from typing import Any

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session, sessionmaker

__all__ = ["normalise_url", "make_engine", "make_session_factory"]


def normalise_url(url: str) -> str:
    """Return `url` with an explicit driver: `postgresql://` and `postgres://` become
    `postgresql+psycopg://`; anything else is returned unchanged."""
    for prefix in ("postgresql://", "postgres://"):
        if url.startswith(prefix):
            return "postgresql+psycopg://" + url[len(prefix):]
    return url


def _sqlite_pragmas(dbapi_connection: Any, _record: Any) -> None:
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.close()


def make_engine(url: str, **kwargs: Any) -> Engine:
    """Create an engine for `url` (Postgres or SQLite). Extra kwargs go to `create_engine`."""
    url = normalise_url(url)
    if make_url(url).get_backend_name() == "sqlite":
        kwargs.setdefault("connect_args", {"check_same_thread": False})
        engine = create_engine(url, **kwargs)
        event.listen(engine, "connect", _sqlite_pragmas)
        return engine
    kwargs.setdefault("pool_pre_ping", True)
    return create_engine(url, **kwargs)


def make_session_factory(engine: Engine) -> sessionmaker[Session]:
    """Sessions that keep loaded objects usable after commit (responses are built after it)."""
    return sessionmaker(engine, expire_on_commit=False)

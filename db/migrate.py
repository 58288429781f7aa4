"""Run the packaged Alembic migrations programmatically (no alembic.ini in the working folder).

`upgrade(url)` brings a database to head, `downgrade(url, revision="base")` takes it back;
`current_revision(url)` / `head_revision()` let the API's readiness probe compare the two.
"""
from __future__ import annotations

import logging
from pathlib import Path

from alembic import command
from alembic.config import Config as AlembicConfig
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Connection

from db.session import make_engine, normalise_url

__all__ = ["alembic_config", "upgrade", "downgrade", "current_revision", "head_revision"]

_log = logging.getLogger(__name__)
_MIGRATIONS = Path(__file__).resolve().parent / "migrations"


def alembic_config(url: str | None = None) -> AlembicConfig:
    """An Alembic config pointing at the packaged migrations (and at `url` if given)."""
    cfg = AlembicConfig()
    cfg.set_main_option("script_location", str(_MIGRATIONS))
    if url is not None:
        # ConfigParser interpolation: a literal % in a password must be doubled
        cfg.set_main_option("sqlalchemy.url", normalise_url(url).replace("%", "%%"))
    return cfg


def upgrade(url: str, revision: str = "head") -> None:
    """Migrate the database at `url` up to `revision` (default: head)."""
    _log.info("migrating database up to %s", revision)
    command.upgrade(alembic_config(url), revision)


def downgrade(url: str, revision: str = "base") -> None:
    """Migrate the database at `url` down to `revision` (default: base, i.e. empty)."""
    _log.info("migrating database down to %s", revision)
    command.downgrade(alembic_config(url), revision)


def head_revision() -> str | None:
    """The newest revision shipped with this package."""
    return ScriptDirectory.from_config(alembic_config()).get_current_head()


def current_revision(url_or_connection: str | Connection) -> str | None:
    """The revision the database is at (None for an unmigrated database)."""
    if isinstance(url_or_connection, Connection):
        return MigrationContext.configure(url_or_connection).get_current_revision()
    engine = make_engine(url_or_connection)
    try:
        with engine.connect() as conn:
            return MigrationContext.configure(conn).get_current_revision()
    finally:
        engine.dispose()

"""Alembic environment for the registry: online migrations against `sqlalchemy.url`.

SQLite cannot ALTER most things in place, so migrations run in batch mode there.
"""
from __future__ import annotations

from alembic import context
from sqlalchemy import pool

from db.models import Base
from db.session import make_engine

config = context.config
target_metadata = Base.metadata


def _run_online() -> None:
    url = config.get_main_option("sqlalchemy.url")
    if not url:
        raise RuntimeError("sqlalchemy.url is not set; call db.migrate.upgrade(url)")
    engine = make_engine(url, poolclass=pool.NullPool)
    try:
        with engine.connect() as connection:
            context.configure(
                connection=connection,
                target_metadata=target_metadata,
                render_as_batch=connection.dialect.name == "sqlite",
                compare_type=True,
            )
            with context.begin_transaction():
                context.run_migrations()
    finally:
        engine.dispose()


if context.is_offline_mode():
    raise RuntimeError("offline (SQL script) migrations are not supported; run them online")
_run_online()

"""The registry's database layer: SQLAlchemy 2 typed models, engines and sessions, and Alembic
migrations shipped inside the package.

Migrations are the only way the schema changes: `db.migrate.upgrade(url)` /
`db.migrate.downgrade(url)` run them without an alembic.ini in the working folder. The same models
and migrations serve Postgres (production, tests) and SQLite (the embedded default).
"""
from db.migrate import current_revision, downgrade, head_revision, upgrade
from db.models import ApiToken, Base, Event, Metric, Run, Sweep
from db.session import make_engine, make_session_factory

__all__ = ["ApiToken", "Base", "Event", "Metric", "Run", "Sweep", "current_revision", "downgrade",
           "head_revision", "make_engine", "make_session_factory", "upgrade"]

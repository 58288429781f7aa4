"""sweeps and runs: tags and notes

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-01

Both tables gain `tags` (a JSON list of strings, de-duplicated and sorted by the API; NOT NULL
with the database default '[]', so existing rows get no tags) and `notes` (free text, nullable).
Downgrade drops both columns, and with them every tag and note.
"""
from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_JSON = sa.JSON().with_variant(JSONB(), "postgresql")
_TABLES = ("sweeps", "runs")


def upgrade() -> None:
    for table in _TABLES:
        with op.batch_alter_table(table) as batch:
            batch.add_column(sa.Column("tags", _JSON, nullable=False,
                                       server_default=sa.text("'[]'")))
            batch.add_column(sa.Column("notes", sa.Text(), nullable=True))


def downgrade() -> None:
    for table in reversed(_TABLES):
        with op.batch_alter_table(table) as batch:
            batch.drop_column("notes")
            batch.drop_column("tags")

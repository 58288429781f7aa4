"""runs.owed_records; api_tokens.expires_at and last_used_at

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-30

`runs.owed_records` counts the metrics and events a run's reporter still holds in its spool (NULL
or 0: owes nothing); a run that owes records is shown as incomplete until they arrive. Tokens gain
an optional expiry and the time they were last used (`crucible api token list`).
"""
from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_TS = sa.DateTime(timezone=True)


def upgrade() -> None:
    with op.batch_alter_table("runs") as batch:
        batch.add_column(sa.Column("owed_records", sa.BigInteger(), nullable=True))
    with op.batch_alter_table("api_tokens") as batch:
        batch.add_column(sa.Column("expires_at", _TS, nullable=True))
        batch.add_column(sa.Column("last_used_at", _TS, nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("api_tokens") as batch:
        batch.drop_column("last_used_at")
        batch.drop_column("expires_at")
    with op.batch_alter_table("runs") as batch:
        batch.drop_column("owed_records")

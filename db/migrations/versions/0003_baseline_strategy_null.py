"""runs.strategy is NULL for a p = 0 baseline

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-30

A baseline (p = 0) belongs to no strategy: nothing fails, so nothing is mitigated, and every view
pairs it with each strategy of its arm. Until now the registry copied the config's
`faults.strategy` (`skip` for a sweep's baselines) into the indexed `runs.strategy`, so a sweep of
only `drop_extend` and `reroute` showed a phantom `skip` arm. The column becomes nullable and the
baselines' value NULL; the run's own config keeps its `faults.strategy` (so its fingerprint, and
a re-run sweep's dedup, do not change). Downgrade writes `skip` back where the column is NULL.
"""
from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_runs = sa.table("runs", sa.column("p", sa.Float()), sa.column("strategy", sa.String(16)))


def upgrade() -> None:
    with op.batch_alter_table("runs") as batch:
        batch.alter_column("strategy", existing_type=sa.String(16), nullable=True)
    op.execute(_runs.update().where(_runs.c.p == 0).values(strategy=None))


def downgrade() -> None:
    op.execute(_runs.update().where(_runs.c.strategy.is_(None)).values(strategy="skip"))
    with op.batch_alter_table("runs") as batch:
        batch.alter_column("strategy", existing_type=sa.String(16), nullable=False)

"""runs: label, the study block a run belongs to

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-02

A study's grid may hold labelled blocks: cells with baseline-neutral overrides (MAPL's decode
variants) at the same arm, strategy and p as unlabelled ones. `label` keeps them apart in the
robustness numbers and the claims ('' for every run of an unlabelled block, which is every run
stored before this revision). Baselines are never labelled: a labelled cell is compared with
its arm's shared p = 0 run.
"""
from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("runs") as batch:
        batch.add_column(sa.Column("label", sa.String(64), nullable=False, server_default=""))


def downgrade() -> None:
    with op.batch_alter_table("runs") as batch:
        batch.drop_column("label")

"""run_costs: what a run would cost on a deployment (`crucible cost`)

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-03

One row per run and deployment name: the cost model's record (crucible.cost.run_cost: wall-clock,
accelerator-hours, money, the loss-against-time curve) with its headline numbers as columns.
A run's costs go with it (ON DELETE CASCADE); putting the same deployment again replaces the row.
"""
from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_JSON = sa.JSON().with_variant(postgresql.JSONB(), "postgresql")
_BIGPK = sa.BigInteger().with_variant(sa.Integer(), "sqlite")
_TS = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "run_costs",
        sa.Column("id", _BIGPK, autoincrement=True, nullable=False),
        sa.Column("run_id", sa.Uuid(), nullable=False),
        sa.Column("deployment", sa.String(length=200), nullable=False),
        sa.Column("model", sa.String(length=64), nullable=False),
        sa.Column("pricing", sa.String(length=16), nullable=False),
        sa.Column("currency", sa.String(length=16), nullable=False),
        sa.Column("wall_s", sa.Float(), nullable=False),
        sa.Column("accelerator_hours", sa.Float(), nullable=False),
        sa.Column("cost", sa.Float(), nullable=False),
        sa.Column("record", _JSON, nullable=False),
        sa.Column("created_at", _TS, nullable=False),
        sa.Column("updated_at", _TS, nullable=False),
        sa.ForeignKeyConstraint(["run_id"], ["runs.id"], name="fk_run_costs_run_id_runs",
                                ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id", name="pk_run_costs"),
    )
    op.create_index("uq_run_costs_run_deployment", "run_costs", ["run_id", "deployment"],
                    unique=True)


def downgrade() -> None:
    op.drop_table("run_costs")

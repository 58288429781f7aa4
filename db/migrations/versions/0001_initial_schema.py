"""initial schema: sweeps, runs, metrics, events, api_tokens

Revision ID: 0001
Revises:
Create Date: 2026-11-30

Written by hand from an autogenerate draft: plain `op.create_table` / `op.create_index` work on
both Postgres and SQLite for a fresh schema. The metrics key index is on an expression
(`coalesce(replica, -1)`), which autogenerate cannot emit, so it is spelled out here.
"""
from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_JSON = sa.JSON().with_variant(postgresql.JSONB(), "postgresql")
_BIGPK = sa.BigInteger().with_variant(sa.Integer(), "sqlite")
_TS = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "api_tokens",
        sa.Column("id", sa.Uuid(), nullable=False),
        sa.Column("name", sa.String(length=200), nullable=False),
        sa.Column("token_hash", sa.String(length=64), nullable=False),
        sa.Column("created_at", _TS, nullable=False),
        sa.Column("revoked_at", _TS, nullable=True),
        sa.PrimaryKeyConstraint("id", name="pk_api_tokens"),
        sa.UniqueConstraint("token_hash", name="uq_api_tokens_token_hash"),
    )
    op.create_table(
        "sweeps",
        sa.Column("id", sa.Uuid(), nullable=False),
        sa.Column("name", sa.String(length=200), nullable=False),
        sa.Column("spec", _JSON, nullable=True),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("prefect_flow_run_id", sa.String(length=64), nullable=True),
        sa.Column("created_at", _TS, nullable=False),
        sa.Column("updated_at", _TS, nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_sweeps"),
    )
    op.create_index("ix_sweeps_created_at_id", "sweeps", ["created_at", "id"])
    _create_runs()
    _create_metrics()
    _create_events()


def _create_runs() -> None:
    op.create_table(
        "runs",
        sa.Column("id", sa.Uuid(), nullable=False),
        sa.Column("sweep_id", sa.Uuid(), nullable=True),
        sa.Column("name", sa.String(length=200), nullable=True),
        sa.Column("config", _JSON, nullable=False),
        sa.Column("config_hash", sa.String(length=128), nullable=True),
        sa.Column("code_version", sa.String(length=128), nullable=True),
        sa.Column("compression", sa.String(length=16), nullable=False),
        sa.Column("strategy", sa.String(length=16), nullable=False),
        sa.Column("p", sa.Float(), nullable=False),
        sa.Column("duration", sa.Integer(), nullable=False),
        sa.Column("seed", sa.BigInteger(), nullable=False),
        sa.Column("preset", sa.String(length=200), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("status_reason", sa.Text(), nullable=True),
        sa.Column("baseline_run_id", sa.Uuid(), nullable=True),
        sa.Column("initial_val_loss", sa.Float(), nullable=True),
        sa.Column("final_val_loss", sa.Float(), nullable=True),
        sa.Column("tokens_budget", sa.BigInteger(), nullable=True),
        sa.Column("tokens_processed", sa.BigInteger(), nullable=True),
        sa.Column("summary", _JSON, nullable=True),
        sa.Column("prefect_flow_run_id", sa.String(length=64), nullable=True),
        sa.Column("created_at", _TS, nullable=False),
        sa.Column("updated_at", _TS, nullable=False),
        sa.ForeignKeyConstraint(["baseline_run_id"], ["runs.id"],
                                name="fk_runs_baseline_run_id_runs", ondelete="SET NULL"),
        sa.ForeignKeyConstraint(["sweep_id"], ["sweeps.id"],
                                name="fk_runs_sweep_id_sweeps", ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id", name="pk_runs"),
    )
    op.create_index("ix_runs_config_hash", "runs", ["config_hash"])
    op.create_index("ix_runs_created_at_id", "runs", ["created_at", "id"])
    op.create_index("ix_runs_status", "runs", ["status"])
    op.create_index("ix_runs_sweep_arm", "runs", ["sweep_id", "compression", "strategy", "p", "seed"])
    op.create_index("ix_runs_sweep_id", "runs", ["sweep_id"])


def _create_metrics() -> None:
    op.create_table(
        "metrics",
        sa.Column("id", _BIGPK, autoincrement=True, nullable=False),
        sa.Column("run_id", sa.Uuid(), nullable=False),
        sa.Column("name", sa.String(length=32), nullable=False),
        sa.Column("global_step", sa.BigInteger(), nullable=False),
        sa.Column("tokens", sa.BigInteger(), nullable=True),
        sa.Column("replica", sa.Integer(), nullable=True),
        sa.Column("value", sa.Float(), nullable=False),
        sa.ForeignKeyConstraint(["run_id"], ["runs.id"], name="fk_metrics_run_id_runs",
                                ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id", name="pk_metrics"),
    )
    op.create_index("ix_metrics_run_step", "metrics", ["run_id", "global_step", "id"])
    # a NULL replica (the global model) must collide with itself, hence the coalesce
    op.create_index("uq_metrics_key", "metrics",
                    ["run_id", "name", "global_step", sa.text("coalesce(replica, -1)")],
                    unique=True)


def _create_events() -> None:
    op.create_table(
        "events",
        sa.Column("pk", _BIGPK, autoincrement=True, nullable=False),
        sa.Column("run_id", sa.Uuid(), nullable=False),
        sa.Column("event_id", sa.String(length=200), nullable=False),
        sa.Column("kind", sa.String(length=32), nullable=False),
        sa.Column("global_step", sa.BigInteger(), nullable=False),
        sa.Column("replica", sa.Integer(), nullable=True),
        sa.Column("stage", sa.Integer(), nullable=True),
        sa.Column("detail", _JSON, nullable=True),
        sa.ForeignKeyConstraint(["run_id"], ["runs.id"], name="fk_events_run_id_runs",
                                ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("pk", name="pk_events"),
    )
    op.create_index("ix_events_run_step", "events", ["run_id", "global_step", "pk"])
    op.create_index("uq_events_run_event", "events", ["run_id", "event_id"], unique=True)


def downgrade() -> None:
    # indexes go with their tables
    for table in ("events", "metrics", "runs", "sweeps", "api_tokens"):
        op.drop_table(table)

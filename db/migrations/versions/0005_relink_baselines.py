"""runs: baseline_run_id re-linked by the one pairing rule

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-02

Data only. Before this revision a failure run was linked to the first *created* p = 0 run of its
sweep, arm, seed and duration, whatever its status; the registry now stores what the one pairing
rule says (`crucible.stats.pairing`: the first usable baseline in creation order, else the
first unfinished one), as REST and the dashboards compute it. This re-links every group once.
A run owing records counts as running, as everywhere. Downgrade leaves the links as they are
(the old rule's choice is not recoverable, and either is a valid link).
"""
from __future__ import annotations

import uuid
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_RUNS = sa.table("runs", sa.column("id", sa.Uuid()), sa.column("sweep_id", sa.Uuid()),
                 sa.column("compression", sa.String()), sa.column("strategy", sa.String()),
                 sa.column("p", sa.Float()), sa.column("duration", sa.Integer()),
                 sa.column("seed", sa.BigInteger()), sa.column("status", sa.String()),
                 sa.column("final_val_loss", sa.Float()), sa.column("owed_records", sa.Integer()),
                 sa.column("baseline_run_id", sa.Uuid()), sa.column("created_at", sa.DateTime()))


def upgrade() -> None:
    from crucible.stats import baseline_ids  # stdlib only: the rule itself, not a copy of it

    bind = op.get_bind()
    rows = bind.execute(sa.select(_RUNS).where(_RUNS.c.sweep_id.is_not(None))
                        .order_by(_RUNS.c.created_at, _RUNS.c.id)).mappings().all()
    groups: dict[tuple[object, ...], list[dict[str, object]]] = {}
    linked: dict[str, str | None] = {}
    for row in rows:
        run = dict(row)
        run["id"] = str(run["id"])
        if run.get("owed_records"):
            run["status"] = "running"
        linked[run["id"]] = None if row["baseline_run_id"] is None else str(row["baseline_run_id"])
        key = (row["sweep_id"], row["compression"], row["seed"], row["duration"])
        groups.setdefault(key, []).append(run)
    for runs in groups.values():
        for run_id, baseline in baseline_ids(runs).items():
            if linked[run_id] != baseline:
                bind.execute(sa.update(_RUNS).where(_RUNS.c.id == uuid.UUID(run_id)).values(
                    baseline_run_id=None if baseline is None else uuid.UUID(baseline)))


def downgrade() -> None:
    pass

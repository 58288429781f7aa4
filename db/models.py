"""Typed SQLAlchemy 2 models of the run registry.

Key choices:
- UUID primary keys for sweeps and runs (clients refer to them across processes); bigint surrogate
  keys for the high-volume `metrics` and `events` tables (cheap keyset pagination).
- Metrics are unique per (run, name, global_step, replica) where a NULL replica (the global model)
  must still collide with itself, so the unique index is on `coalesce(replica, -1)`; bulk inserts
  use ON CONFLICT DO NOTHING against it. Events are unique per (run, client-supplied id).
- Timestamps are timezone-aware UTC; JSON is JSONB on Postgres and JSON text on SQLite.
- Relationships are `lazy="raise"`: every load is explicit in the data-access layer.
- Sweeps and runs carry `tags` (a JSON list of strings, stored de-duplicated and sorted, never
  NULL; filtered by JSONB containment on Postgres) and free-text `notes`.
"""
from __future__ import annotations

import uuid
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Text,
    Uuid,
    func,
    text,
)
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship

from crucible.grid.names import RUN_STATUSES, SWEEP_STATUSES

__all__ = ["Base", "Sweep", "Run", "Metric", "Event", "RunCost", "ApiToken", "RUN_STATUSES", "SWEEP_STATUSES",
           "utcnow"]


# Named constraints so migrations can drop them by name on every backend.
_NAMING = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

JsonType = JSON().with_variant(JSONB(), "postgresql")
# SQLite only auto-increments an INTEGER PRIMARY KEY, not a BIGINT one.
BigIntPk = BigInteger().with_variant(Integer(), "sqlite")


# '[]' as the database's own default too: rows written outside the ORM still get a list
_NO_TAGS = text("'[]'")


def utcnow() -> datetime:
    return datetime.now(UTC)


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=_NAMING)


class Sweep(Base):
    __tablename__ = "sweeps"

    id: Mapped[uuid.UUID] = mapped_column(Uuid, primary_key=True, default=uuid.uuid4)
    name: Mapped[str] = mapped_column(String(200))
    spec: Mapped[dict[str, Any] | None] = mapped_column(JsonType)
    status: Mapped[str] = mapped_column(String(16), default="pending")
    prefect_flow_run_id: Mapped[str | None] = mapped_column(String(64))
    tags: Mapped[list[str]] = mapped_column(JsonType, default=list, server_default=_NO_TAGS)
    notes: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow,
                                                 onupdate=utcnow)

    runs: Mapped[list[Run]] = relationship(back_populates="sweep", lazy="raise")

    __table_args__ = (Index("ix_sweeps_created_at_id", "created_at", "id"),)


class Run(Base):
    __tablename__ = "runs"

    id: Mapped[uuid.UUID] = mapped_column(Uuid, primary_key=True, default=uuid.uuid4)
    sweep_id: Mapped[uuid.UUID | None] = mapped_column(
        ForeignKey("sweeps.id", ondelete="CASCADE"), index=True)
    name: Mapped[str | None] = mapped_column(String(200))
    config: Mapped[dict[str, Any]] = mapped_column(JsonType)
    config_hash: Mapped[str | None] = mapped_column(String(128), index=True)
    code_version: Mapped[str | None] = mapped_column(String(128))
    # indexed copies of the config keys every query filters on
    compression: Mapped[str] = mapped_column(String(16))
    # NULL for a p = 0 baseline: it belongs to no strategy, every view pairs it with each
    # strategy of its arm (its config still names one, irrelevant when nothing fails)
    strategy: Mapped[str | None] = mapped_column(String(16))
    p: Mapped[float] = mapped_column(Float)
    # a study block's label ('' outside labelled blocks; never on a baseline): keeps a block
    # with baseline-neutral overrides apart from the unlabelled cells of its arm, strategy, p
    label: Mapped[str] = mapped_column(String(64), default="", server_default="")
    duration: Mapped[int] = mapped_column(Integer)
    seed: Mapped[int] = mapped_column(BigInteger)
    preset: Mapped[str] = mapped_column(String(200))
    status: Mapped[str] = mapped_column(String(16), default="pending", index=True)
    status_reason: Mapped[str | None] = mapped_column(Text)
    baseline_run_id: Mapped[uuid.UUID | None] = mapped_column(
        ForeignKey("runs.id", ondelete="SET NULL"))
    initial_val_loss: Mapped[float | None] = mapped_column(Float)
    final_val_loss: Mapped[float | None] = mapped_column(Float)
    tokens_budget: Mapped[int | None] = mapped_column(BigInteger)
    tokens_processed: Mapped[int | None] = mapped_column(BigInteger)
    # metrics + events still in the reporter's spool; a run that owes records is incomplete
    owed_records: Mapped[int | None] = mapped_column(BigInteger)
    summary: Mapped[dict[str, Any] | None] = mapped_column(JsonType)
    prefect_flow_run_id: Mapped[str | None] = mapped_column(String(64))
    tags: Mapped[list[str]] = mapped_column(JsonType, default=list, server_default=_NO_TAGS)
    notes: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow,
                                                 onupdate=utcnow)

    sweep: Mapped[Sweep | None] = relationship(back_populates="runs", lazy="raise")

    __table_args__ = (
        Index("ix_runs_sweep_arm", "sweep_id", "compression", "strategy", "p", "seed"),
        Index("ix_runs_created_at_id", "created_at", "id"),
    )


class Metric(Base):
    __tablename__ = "metrics"

    id: Mapped[int] = mapped_column(BigIntPk, primary_key=True, autoincrement=True)
    run_id: Mapped[uuid.UUID] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    name: Mapped[str] = mapped_column(String(32))
    global_step: Mapped[int] = mapped_column(BigInteger)
    tokens: Mapped[int | None] = mapped_column(BigInteger)
    replica: Mapped[int | None] = mapped_column(Integer)
    value: Mapped[float] = mapped_column(Float)

    __table_args__ = (
        Index("uq_metrics_key", "run_id", "name", "global_step",
              func.coalesce(replica, -1), unique=True),
        Index("ix_metrics_run_step", "run_id", "global_step", "id"),
    )


class Event(Base):
    __tablename__ = "events"

    pk: Mapped[int] = mapped_column(BigIntPk, primary_key=True, autoincrement=True)
    run_id: Mapped[uuid.UUID] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    event_id: Mapped[str] = mapped_column(String(200))
    kind: Mapped[str] = mapped_column(String(32))
    global_step: Mapped[int] = mapped_column(BigInteger)
    replica: Mapped[int | None] = mapped_column(Integer)
    stage: Mapped[int | None] = mapped_column(Integer)
    detail: Mapped[dict[str, Any] | None] = mapped_column(JsonType)

    __table_args__ = (
        Index("uq_events_run_event", "run_id", "event_id", unique=True),
        Index("ix_events_run_step", "run_id", "global_step", "pk"),
    )


class RunCost(Base):
    """What a run would cost on one deployment (crucible.pricing.cost): the record, its headline
    numbers as columns; one row per (run, deployment name)."""
    __tablename__ = "run_costs"

    id: Mapped[int] = mapped_column(BigIntPk, primary_key=True, autoincrement=True)
    run_id: Mapped[uuid.UUID] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    deployment: Mapped[str] = mapped_column(String(200))
    model: Mapped[str] = mapped_column(String(64))
    pricing: Mapped[str] = mapped_column(String(16))
    currency: Mapped[str] = mapped_column(String(16))
    wall_s: Mapped[float] = mapped_column(Float)
    accelerator_hours: Mapped[float] = mapped_column(Float)
    cost: Mapped[float] = mapped_column(Float)
    record: Mapped[dict[str, Any]] = mapped_column(JsonType)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow,
                                                 onupdate=utcnow)

    __table_args__ = (Index("uq_run_costs_run_deployment", "run_id", "deployment", unique=True),)


class ApiToken(Base):
    __tablename__ = "api_tokens"

    id: Mapped[uuid.UUID] = mapped_column(Uuid, primary_key=True, default=uuid.uuid4)
    name: Mapped[str] = mapped_column(String(200))
    token_hash: Mapped[str] = mapped_column(String(64), unique=True)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    revoked_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    expires_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    last_used_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))

"""Data access of the registry's sweeps and runs: keyword-only functions over a SQLAlchemy session.

Routes call these and never write SQL; the dashboards import them too. Functions that write
commit their own transaction (one request = one transaction) and raise `NotFoundError` for a
missing sweep or run. Lists use keyset pagination (`api.pagination`), so pages stay stable while
rows are inserted. A run's metrics and events are `api.records`'s; the analysis of a sweep
(robustness, claims, Table 1) is `api.analysis`'s, built on `analysis_rows` here, the one view of
a run that the numbers and the baseline re-link both read.

Tags: `update_run` / `update_sweep` apply `add_tags` / `remove_tags` to the row under a row lock
(SELECT ... FOR UPDATE; on SQLite the database write lock, BEGIN IMMEDIATE) in their one
transaction, so two concurrent edits never lose a tag; the
`tag=` filters use JSONB containment on Postgres (`json_each` on SQLite). A sweep may be named
instead of identified: `resolve_sweep` takes either.
"""
from __future__ import annotations

import hashlib
import uuid
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import func, or_, select, text, type_coerce, update
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.orm import Session

from api.errors import InvalidInputError, NotFoundError, RegistryError
from api.pagination import keyset_page
from api.schemas import MAX_TAGS
from crucible import stats
from crucible.config import Config, ConfigError
from crucible.grid.names import RUNNING
from db.models import Run, Sweep

__all__ = [
    "create_sweep", "get_sweep", "resolve_sweep", "list_sweeps", "update_sweep", "recent_sweeps",
    "sweep_run_counts", "recent_runs", "create_run", "get_run", "TagLimitError", "list_runs",
    "update_run", "is_postgres", "analysis_rows",
]

_MAX_SEED = 2**62
_MAX_DURATION = 2**31 - 1

# ---------------------------------------------------------------- tags

class TagLimitError(RegistryError):
    """`add_tags` would take an object past `MAX_TAGS` tags (a conflict with what it holds)."""

    status_code = 409


def _has_tag(session: Session, column: Any, tag: str) -> Any:
    """WHERE clause: the JSON list `column` holds `tag`."""
    if is_postgres(session):
        return type_coerce(column, JSONB).contains([tag])
    each = func.json_each(column).table_valued("value")
    return select(each.c.value).where(each.c.value == tag).exists()


def _lock_for_edit(session: Session) -> None:
    """Make the read of a read-modify-write (a tag edit) wait for other writers. Postgres: the
    caller's SELECT ... FOR UPDATE. SQLite has no row locks, and pysqlite begins a transaction
    only at the first write, so the read would see tags another edit is about to replace: take
    SQLite's database write lock (BEGIN IMMEDIATE) before reading, unless a transaction is
    already open on this connection."""
    if is_postgres(session):
        return
    connection = session.connection()
    if not connection.connection.dbapi_connection.in_transaction:
        connection.exec_driver_sql("BEGIN IMMEDIATE")


def _apply_changes(target: Run | Sweep, changes: Mapping[str, Any]) -> None:
    """Set `changes` on a locked row; `add_tags` / `remove_tags` edit its tags (removals first);
    None for tags, add_tags or remove_tags leaves them as they are."""
    changes = dict(changes)
    add = changes.pop("add_tags", None) or []
    remove = changes.pop("remove_tags", None) or []
    if changes.get("tags", []) is None:
        del changes["tags"]
    for key, value in changes.items():
        setattr(target, key, value)
    if add or remove:
        tags = (set(target.tags or []) - set(remove)) | set(add)
        if len(tags) > MAX_TAGS:
            raise TagLimitError(f"add_tags would give this object {len(tags)} tags, more than "
                                f"{MAX_TAGS}; remove some first (remove_tags)",
                                field="body.add_tags")
        target.tags = sorted(tags)  # a new list: the JSON column sees the change


# ---------------------------------------------------------------- sweeps

def create_sweep(session: Session, *, name: str, spec: dict[str, Any] | None = None,
                 tags: Sequence[str] | None = None, notes: str | None = None) -> Sweep:
    """Create a pending sweep and commit (`tags` stored de-duplicated and sorted)."""
    sweep = Sweep(name=name, spec=spec, status="pending", tags=sorted(set(tags or [])),
                  notes=notes)
    session.add(sweep)
    session.commit()
    return sweep


def get_sweep(session: Session, *, sweep_id: uuid.UUID) -> Sweep:
    """The sweep `sweep_id`; raises NotFoundError."""
    sweep = session.get(Sweep, sweep_id)
    if sweep is None:
        raise NotFoundError(f"sweep {sweep_id} does not exist", field="sweep_id")
    return sweep


def resolve_sweep(session: Session, ref: str) -> Sweep:
    """The sweep `ref` names: a UUID string -> that sweep; anything else -> the newest sweep whose
    name equals `ref` exactly. Raises NotFoundError naming `ref`."""
    try:
        sweep_id = uuid.UUID(ref)
    except ValueError:
        sweep_id = None
    if sweep_id is not None:
        return get_sweep(session, sweep_id=sweep_id)
    sweep = session.scalar(select(Sweep).where(Sweep.name == ref)
                           .order_by(Sweep.created_at.desc(), Sweep.id.desc()).limit(1))
    if sweep is None:
        raise NotFoundError(f"no sweep is named {ref!r} (names match exactly); pass a sweep's id "
                            "or its exact name", field="sweep_ref")
    return sweep


def list_sweeps(session: Session, *, status: str | None = None, name: str | None = None,
                tag: str | None = None, limit: int = 100,
                cursor: str | None = None) -> tuple[list[Sweep], str | None]:
    """Sweeps oldest first, at most `limit`, and the cursor of the next page (or None).
    `name` keeps sweeps whose name contains it, case-insensitively (% and _ are literal);
    `tag` those that carry that tag."""
    query = select(Sweep)
    if status is not None:
        query = query.where(Sweep.status == status)
    if name:
        query = query.where(_contains(Sweep.name, name))
    if tag is not None:
        query = query.where(_has_tag(session, Sweep.tags, tag))
    return keyset_page(session, query, columns=(Sweep.created_at, Sweep.id),
                       kinds=(datetime, uuid.UUID), limit=limit, cursor=cursor)


def _contains(column: Any, needle: str) -> Any:
    """`column` contains `needle`, case-insensitively, with % and _ taken literally."""
    escaped = needle.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
    return column.ilike(f"%{escaped}%", escape="\\")


def _arm_filters(arm: Mapping[str, Any]) -> list[Any]:
    """WHERE clauses for the run attributes in `arm` (compression, strategy, p, preset)."""
    columns = {"compression": Run.compression, "strategy": Run.strategy, "p": Run.p,
               "preset": Run.preset}
    return [columns[key] == value for key, value in arm.items() if value is not None]


def recent_sweeps(session: Session, *, name: str | None = None, status: str | None = None,
                  arm: Mapping[str, Any] | None = None, tag: str | None = None,
                  limit: int = 200) -> list[Sweep]:
    """Newest sweeps first: name containing `name`, of `status`, carrying `tag`, and having at
    least one run matching `arm` (compression, strategy, p, preset; None values are ignored)."""
    query = select(Sweep)
    if name:
        query = query.where(_contains(Sweep.name, name))
    if status is not None:
        query = query.where(Sweep.status == status)
    if tag is not None:
        query = query.where(_has_tag(session, Sweep.tags, tag))
    clauses = _arm_filters(arm or {})
    if clauses:
        query = query.where(select(Run.id).where(Run.sweep_id == Sweep.id, *clauses).exists())
    return list(session.scalars(query.order_by(Sweep.created_at.desc(), Sweep.id).limit(limit)))


def sweep_run_counts(session: Session, *, sweep_ids: Sequence[uuid.UUID]
                     ) -> dict[uuid.UUID, dict[str, Any]]:
    """sweep id -> {"statuses": {status: runs}, "arms": sorted compressions} for `sweep_ids`."""
    counts: dict[uuid.UUID, dict[str, Any]] = {
        sweep_id: {"statuses": {}, "arms": set()} for sweep_id in sweep_ids}
    if not sweep_ids:
        return counts
    rows = session.execute(
        select(Run.sweep_id, Run.compression, Run.status, func.count())
        .where(Run.sweep_id.in_(list(sweep_ids)))
        .group_by(Run.sweep_id, Run.compression, Run.status))
    for sweep_id, compression, status, n in rows:
        entry = counts[sweep_id]
        entry["statuses"][status] = entry["statuses"].get(status, 0) + n
        entry["arms"].add(compression)
    return {k: {**v, "arms": sorted(v["arms"])} for k, v in counts.items()}


def recent_runs(session: Session, *, name: str | None = None, status: str | None = None,
                arm: Mapping[str, Any] | None = None, tag: str | None = None,
                limit: int = 50) -> list[Run]:
    """Newest runs first: whose own or sweep's name contains `name`, of `status`, carrying
    `tag` (the run's own tags), matching `arm` (compression, strategy, p, preset; None values
    are ignored)."""
    query = select(Run).outerjoin(Sweep, Run.sweep_id == Sweep.id)
    if name:
        query = query.where(or_(_contains(Run.name, name), _contains(Sweep.name, name)))
    if status is not None:
        query = query.where(Run.status == status)
    if tag is not None:
        query = query.where(_has_tag(session, Run.tags, tag))
    query = query.where(*_arm_filters(arm or {}))
    return list(session.scalars(query.order_by(Run.created_at.desc(), Run.id).limit(limit)))


def update_sweep(session: Session, *, sweep_id: uuid.UUID, changes: dict[str, Any]) -> Sweep:
    """Apply `changes` (status, prefect_flow_run_id, tags, add_tags, remove_tags, notes) to a
    sweep under a row lock and commit. Raises NotFoundError, TagLimitError."""
    _lock_for_edit(session)
    sweep = session.get(Sweep, sweep_id, with_for_update=True, populate_existing=True)
    if sweep is None:
        raise NotFoundError(f"sweep {sweep_id} does not exist", field="sweep_id")
    changes = dict(changes)
    annotations = changes.pop("spec_annotations", None)
    if annotations:       # a new dict: the JSON column sees the change
        sweep.spec = {**(sweep.spec or {}), **annotations}
    _apply_changes(sweep, changes)
    session.commit()
    return sweep


# ---------------------------------------------------------------- runs

def _resolve_config(config: dict[str, Any]) -> Config:
    try:
        resolved = Config.from_dict(config)
    except (ConfigError, TypeError, ValueError) as exc:
        raise InvalidInputError(f"config is invalid: {exc}", field="body.config") from None
    if resolved.seed > _MAX_SEED or resolved.faults.duration > _MAX_DURATION:
        raise InvalidInputError(f"config.seed must be <= {_MAX_SEED} and config.faults.duration "
                                f"<= {_MAX_DURATION}", field="body.config")
    return resolved


def _group_lock(session: Session, run: Any) -> None:
    """Serialise re-linking one pairing group (sweep, arm, seed, duration) on Postgres: two
    baselines of one group changing at once would otherwise each link from a stale view. A
    transaction-scoped advisory lock, keyed by a stable 64-bit digest of the group. SQLite
    writers already hold the database lock."""
    if not is_postgres(session):
        return
    name = f"{run.sweep_id}|{run.compression}|{run.seed}|{run.duration}".encode()
    key = int.from_bytes(hashlib.blake2b(name, digest_size=8).digest(), "big", signed=True)
    session.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": key})


def _relink_group(session: Session, run: Run) -> None:
    """Store on every failure run of `run`'s pairing group the baseline that the one pairing
    rule gives (`crucible.stats.pairing`: the first usable p = 0 run of the same sweep, arm,
    seed and duration in creation order, else the first unfinished one), from the same rows
    the robustness numbers are computed from (a run that owes records counts as running)."""
    if run.sweep_id is None:
        return
    _group_lock(session, run)      # re-entrant within a transaction: update_run took it first
    session.flush()
    rows = analysis_rows(session, Run.sweep_id == run.sweep_id,
                         Run.compression == run.compression, Run.seed == run.seed,
                         Run.duration == run.duration, linked=True)
    linked = {row["id"]: row["baseline_run_id"] for row in rows}
    for run_id, baseline in stats.baseline_ids(rows).items():
        if linked[run_id] != baseline:
            session.execute(update(Run).where(Run.id == uuid.UUID(run_id)).values(
                baseline_run_id=None if baseline is None else uuid.UUID(baseline)))
    session.expire_all()


def _indexed_strategy(config: Config) -> str | None:
    """The `runs.strategy` of a run: None for a p = 0 baseline (nothing fails, so its config's
    `faults.strategy` means nothing; the baseline serves every strategy of its arm)."""
    return None if float(config.faults.p) == 0.0 else config.faults.strategy


def create_run(session: Session, *, config: dict[str, Any], sweep_id: uuid.UUID | None = None,
               name: str | None = None, config_hash: str | None = None,
               code_version: str | None = None, tags: Sequence[str] | None = None,
               notes: str | None = None, label: str = "") -> Run:
    """Create a pending run from a (possibly partial) config dict, validated and resolved with
    `crucible.config.Config`; link it to its p = 0 baseline in the same sweep; commit.
    Raises NotFoundError for an unknown sweep, InvalidInputError for a bad config or a
    labelled baseline."""
    if sweep_id is not None:
        get_sweep(session, sweep_id=sweep_id)
    resolved = _resolve_config(config)
    p = float(resolved.faults.p)
    if label and p == 0.0:
        raise InvalidInputError(f"label={label!r} on a p = 0 baseline: a labelled block's cells "
                                "are compared with their arm's shared, unlabelled baseline; "
                                "create the baseline without a label", field="body.label")
    run = Run(id=uuid.uuid4(), sweep_id=sweep_id, name=name, config=resolved.to_dict(),
              config_hash=config_hash, code_version=code_version,
              compression=resolved.pipeline.compression, strategy=_indexed_strategy(resolved),
              p=p, label=label, duration=resolved.faults.duration,
              seed=resolved.seed, preset=resolved.preset, status="pending",
              tags=sorted(set(tags or [])), notes=notes)
    session.add(run)
    session.flush()
    _relink_group(session, run)
    session.commit()
    return run


def get_run(session: Session, *, run_id: uuid.UUID) -> Run:
    """The run `run_id`; raises NotFoundError."""
    run = session.get(Run, run_id)
    if run is None:
        raise NotFoundError(f"run {run_id} does not exist", field="run_id")
    return run


def list_runs(session: Session, *, sweep_id: uuid.UUID | None = None,
              compression: str | None = None, strategy: str | None = None,
              p: float | None = None, seed: int | None = None, status: str | None = None,
              config_hash: str | None = None, code_version: str | None = None,
              tag: str | None = None, limit: int = 100,
              cursor: str | None = None) -> tuple[list[Run], str | None]:
    """Runs matching every given filter (`tag`: carrying that tag), oldest first, with the next
    page's cursor (or None)."""
    query = select(Run)
    filters = {Run.sweep_id: sweep_id, Run.compression: compression, Run.strategy: strategy,
               Run.p: p, Run.seed: seed, Run.status: status, Run.config_hash: config_hash,
               Run.code_version: code_version}
    for column, value in filters.items():
        if value is not None:
            query = query.where(column == value)
    if tag is not None:
        query = query.where(_has_tag(session, Run.tags, tag))
    return keyset_page(session, query, columns=(Run.created_at, Run.id),
                       kinds=(datetime, uuid.UUID), limit=limit, cursor=cursor)


def update_run(session: Session, *, run_id: uuid.UUID, changes: dict[str, Any]) -> Run:
    """Apply `changes` (status, results, summary, tags, add_tags, remove_tags, notes, ...) to a
    run under a row lock and commit. Raises NotFoundError, TagLimitError.

    Lock order, the same as `create_run`'s: a baseline's pairing group (advisory lock) first,
    then the row (FOR NO KEY UPDATE, which leaves the foreign-key checks of other runs that
    point at it free), so a baseline's update and a run created in its group never deadlock.
    The group's columns never change, so reading them before the locks is safe."""
    _lock_for_edit(session)
    group = session.execute(select(Run.sweep_id, Run.compression, Run.seed, Run.duration, Run.p)
                            .where(Run.id == run_id)).one_or_none()
    if group is None:
        raise NotFoundError(f"run {run_id} does not exist", field="run_id")
    if group.sweep_id is not None and group.p == 0.0:
        _group_lock(session, group)
    run = session.get(Run, run_id, with_for_update={"key_share": True}, populate_existing=True)
    if run is None:
        raise NotFoundError(f"run {run_id} does not exist", field="run_id")
    before = _pairing_view(run)
    _apply_changes(run, changes)
    if run.p == 0.0 and _pairing_view(run) != before:
        _relink_group(session, run)
    session.commit()
    return run


def _pairing_view(run: Run) -> tuple[Any, ...]:
    """What the pairing rule reads of a baseline: a change re-links its group."""
    return run.status, run.final_val_loss, bool(run.owed_records)


def is_postgres(session: Session) -> bool:
    """True when `session` is bound to Postgres (else it is SQLite)."""
    return session.get_bind().dialect.name == "postgresql"


# ---------------------------------------------------------------- the analysis view of runs

# The analysis reads these columns only: a Core select of them skips building ORM objects and
# decoding the runs' JSON config and summary (3x faster for a 1,000-run sweep, far less garbage).
_ANALYSIS_COLUMNS = (Run.id, Run.compression, Run.strategy, Run.p, Run.label, Run.duration,
                     Run.seed, Run.status, Run.final_val_loss, Run.initial_val_loss)
_ANALYSIS_KEYS = tuple(column.key for column in _ANALYSIS_COLUMNS)


def analysis_rows(session: Session, *where: Any, linked: bool = False
                  ) -> list[dict[str, Any]]:
    """The analysis view of the runs matching `where`, in creation order (a run that owes
    records has status "running"); with `linked`, each row also holds its stored
    `baseline_run_id` (str or None)."""
    query = (select(*_ANALYSIS_COLUMNS, Run.owed_records, Run.baseline_run_id).where(*where)
             .order_by(Run.created_at, Run.id))
    rows = []
    for *values, owed, baseline in session.execute(query):
        row = dict(zip(_ANALYSIS_KEYS, values, strict=True))
        row["id"] = str(row["id"])
        if linked:
            row["baseline_run_id"] = None if baseline is None else str(baseline)
        if owed:
            row["status"] = RUNNING
        rows.append(row)
    return rows

"""Data access of the registry: keyword-only functions over a SQLAlchemy session.

Routes call these and never write SQL; the dashboards import them too. Functions that write
commit their own transaction (one request = one transaction) and raise `NotFoundError` for a
missing sweep or run. Lists use keyset pagination: an opaque cursor encodes the sort key of the
last item returned, so pages stay stable while rows are inserted.

Tags: `update_run` / `update_sweep` apply `add_tags` / `remove_tags` to the row under a row lock
(SELECT ... FOR UPDATE; on SQLite the database write lock, BEGIN IMMEDIATE) in their one
transaction, so two concurrent edits never lose a tag; the
`tag=` filters use JSONB containment on Postgres (`json_each` on SQLite). A sweep may be named
instead of identified: `resolve_sweep` takes either.
"""
from __future__ import annotations

import hashlib
import json
import re
import uuid
from collections.abc import Iterator, Mapping, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
from sqlalchemy import and_, func, or_, select, text, type_coerce, update
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.exc import DataError, DBAPIError
from sqlalchemy.orm import Session

from api.errors import InvalidInputError, NotFoundError, RegistryError
from api.schemas import MAX_TAGS
from crucible import stats
from crucible.config import Config, ConfigError
from crucible.names import RUNNING
from db.models import Event, Metric, Run, Sweep

__all__ = [
    "create_sweep", "get_sweep", "resolve_sweep", "list_sweeps", "update_sweep", "create_run",
    "get_run", "TagLimitError",
    "list_runs", "update_run", "insert_metrics", "insert_events", "list_metrics", "list_events",
    "sweep_run_rows", "sweep_robustness", "sweep_claims", "sweep_table", "encode_cursor", "decode_cursor",
    "cursor_pattern",
]

_MAX_SEED = 2**62
_MAX_DURATION = 2**31 - 1


# ---------------------------------------------------------------- cursors

# A cursor is the hex of the last item's sort key at a fixed width: 8 bytes per int (signed) or
# timestamp (microseconds since the epoch), 16 per UUID. Every hex string of the right length is
# a position (a timestamp beyond the calendar is clamped), so the routes' `pattern` states
# exactly which cursors are valid, and the published schema and the 422s agree.
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_CURSOR_BYTES = {int: 8, datetime: 8, uuid.UUID: 16}
_MIN_US = (datetime.min.replace(tzinfo=UTC) - _EPOCH) // timedelta(microseconds=1)
_MAX_US = (datetime.max.replace(tzinfo=UTC) - _EPOCH) // timedelta(microseconds=1)


def cursor_pattern(kinds: Sequence[type]) -> str:
    """The regular expression every cursor of a sort key of these `kinds` matches."""
    return f"^[0-9a-fA-F]{{{2 * sum(_CURSOR_BYTES[kind] for kind in kinds)}}}$"


def _cursor_bytes(value: Any) -> bytes:
    if isinstance(value, uuid.UUID):
        return value.bytes
    if isinstance(value, datetime):  # SQLite returns naive timestamps, written in UTC
        moment = value if value.tzinfo else value.replace(tzinfo=UTC)
        value = (moment - _EPOCH) // timedelta(microseconds=1)
    return int(value).to_bytes(8, "big", signed=True)


def encode_cursor(key: Sequence[Any]) -> str:
    """Opaque cursor for a sort key of ints, UTC datetimes and UUIDs."""
    return b"".join(_cursor_bytes(value) for value in key).hex()


def _cursor_part(kind: type, raw: bytes) -> Any:
    if kind is uuid.UUID:
        return uuid.UUID(bytes=raw)
    number = int.from_bytes(raw, "big", signed=True)
    if kind is datetime:
        return _EPOCH + timedelta(microseconds=min(max(number, _MIN_US), _MAX_US))
    return number


def decode_cursor(cursor: str, *, kinds: Sequence[type]) -> list[Any]:
    """Decode a cursor made by `encode_cursor` whose parts have the given `kinds`
    (int, datetime, uuid.UUID). Raises InvalidInputError naming `cursor` otherwise."""
    if not re.fullmatch(cursor_pattern(kinds)[1:-1], cursor):
        raise InvalidInputError("cursor is not one this API returned; pass next_cursor from the "
                                "previous page, or omit it for the first page",
                                field="query.cursor")
    raw = bytes.fromhex(cursor)
    parts, offset = [], 0
    for kind in kinds:
        width = _CURSOR_BYTES[kind]
        parts.append(_cursor_part(kind, raw[offset:offset + width]))
        offset += width
    return parts


def _keyset_page(session: Session, query: Any, *, columns: tuple[Any, Any],
                 kinds: tuple[type, type], limit: int,
                 cursor: str | None) -> tuple[list[Any], str | None]:
    """Run `query` ordered by the two `columns` (the last one unique), starting after `cursor`;
    return at most `limit` rows and the cursor of the next page (None on the last page)."""
    c0, c1 = columns
    if cursor is not None:
        v0, v1 = decode_cursor(cursor, kinds=kinds)
        query = query.where(or_(c0 > v0, and_(c0 == v0, c1 > v1)))  # (c0, c1) > (v0, v1)
    rows = list(session.scalars(query.order_by(c0, c1).limit(limit + 1)))
    if len(rows) <= limit:
        return rows, None
    last = rows[limit - 1]
    key = [getattr(last, c.key) for c in columns]
    return rows[:limit], encode_cursor(key)


# ---------------------------------------------------------------- tags

class TagLimitError(RegistryError):
    """`add_tags` would take an object past `MAX_TAGS` tags (a conflict with what it holds)."""

    status_code = 409


def _has_tag(session: Session, column: Any, tag: str) -> Any:
    """WHERE clause: the JSON list `column` holds `tag`."""
    if _is_postgres(session):
        return type_coerce(column, JSONB).contains([tag])
    each = func.json_each(column).table_valued("value")
    return select(each.c.value).where(each.c.value == tag).exists()


def _lock_for_edit(session: Session) -> None:
    """Make the read of a read-modify-write (a tag edit) wait for other writers. Postgres: the
    caller's SELECT ... FOR UPDATE. SQLite has no row locks, and pysqlite begins a transaction
    only at the first write, so the read would see tags another edit is about to replace: take
    SQLite's database write lock (BEGIN IMMEDIATE) before reading, unless a transaction is
    already open on this connection."""
    if _is_postgres(session):
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
    return _keyset_page(session, query, columns=(Sweep.created_at, Sweep.id),
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
    if not _is_postgres(session):
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
    rows = _analysis_rows(session, Run.sweep_id == run.sweep_id,
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
    return _keyset_page(session, query, columns=(Run.created_at, Run.id),
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


# ---------------------------------------------------------------- metrics and events

# Postgres events: one INSERT ... SELECT FROM unnest(<one array per column>) per batch (a handful
# of parameters instead of 6 x 10,000; about 4x faster than multi-row VALUES here).
_PG_COLUMNS = {
    "events": (("event_id", "varchar[]"), ("kind", "varchar[]"), ("global_step", "bigint[]"),
               ("replica", "integer[]"), ("stage", "integer[]"), ("detail", "jsonb[]")),
}
_KEYS = {"metrics": "id", "events": "pk"}

# Postgres metrics, the high-volume path: a binary COPY of the batch into a temporary staging
# table of this connection, then one INSERT ... SELECT ... ON CONFLICT DO NOTHING into `metrics`,
# all in the request's transaction. The staging table is created once per connection (ON COMMIT
# DELETE ROWS) and emptied by the move itself (DELETE ... RETURNING), so a batch never sees the
# rows of another, even within one transaction. The move costs what a COPY straight into
# `metrics` (which cannot skip duplicates) costs; the unnest() form it replaces was 15-30 % slower
# (building and parsing 5 arrays of 10,000 elements). Every integer column is bigint in the
# staging table: psycopg's binary int4 dumper wraps values beyond 32 bits silently, while the
# int8 one raises and the move's cast to `metrics.replica` (integer) refuses what does not fit.
_METRIC_FIELDS = ("name", "global_step", "tokens", "replica", "value")
_PG_METRICS_STAGE = (
    "CREATE TEMPORARY TABLE IF NOT EXISTS crucible_metrics_in (name varchar(32), "
    "global_step bigint, tokens bigint, replica bigint, value double precision) "
    "ON COMMIT DELETE ROWS")
_PG_METRICS_COPY = ("COPY pg_temp.crucible_metrics_in (name, global_step, tokens, replica, "
                    "value) FROM STDIN (FORMAT BINARY)")
_PG_METRICS_COPY_TYPES = ("varchar", "int8", "int8", "int8", "float8")
_PG_METRICS_MOVE = (
    "WITH batch AS (DELETE FROM pg_temp.crucible_metrics_in RETURNING *) "
    "INSERT INTO metrics (run_id, name, global_step, tokens, replica, value) "
    "SELECT %(run_id)s, name, global_step, tokens, replica, value FROM batch "
    "ON CONFLICT DO NOTHING")


def _metric_rows(items: Sequence[Mapping[str, Any]]) -> Iterator[tuple[Any, ...]]:
    """(name, global_step, tokens, replica, value) of each item; tokens and replica optional."""
    for i in items:
        yield i["name"], i["global_step"], i.get("tokens"), i.get("replica"), i["value"]


def _pg_copy_metrics(session: Session, run_id: uuid.UUID,
                     items: Sequence[Mapping[str, Any]]) -> int:
    connection = session.connection()
    connection.exec_driver_sql(_PG_METRICS_STAGE)
    driver = connection.connection.driver_connection   # psycopg: COPY is not in the DB-API
    try:
        with driver.cursor() as cursor, cursor.copy(_PG_METRICS_COPY) as copy:
            copy.set_types(_PG_METRICS_COPY_TYPES)
            for row in _metric_rows(items):
                copy.write_row(row)
    except psycopg.Error as exc:   # wrapped as SQLAlchemy wraps its own (DataError -> 422, ...)
        raise DBAPIError.instance(_PG_METRICS_COPY, None, exc, psycopg.Error,
                                  dialect=connection.dialect) from exc
    except (OverflowError, TypeError, ValueError) as exc:   # a value the dumpers refuse
        raise DataError(_PG_METRICS_COPY, None, exc) from exc
    return connection.exec_driver_sql(_PG_METRICS_MOVE, {"run_id": run_id}).rowcount


def _pg_bulk_insert(session: Session, table: str, run_id: uuid.UUID,
                    rows: list[dict[str, Any]]) -> int:
    columns = _PG_COLUMNS[table]
    names = ", ".join(name for name, _ in columns)
    arrays = ", ".join(f"CAST(:{name} AS {cast})" for name, cast in columns)
    sql = text(f"INSERT INTO {table} (run_id, {names}) "
               f"SELECT CAST(:run_id AS uuid), * FROM unnest({arrays}) "
               f"ON CONFLICT DO NOTHING RETURNING {_KEYS[table]}")
    params: dict[str, Any] = {name: [row[name] for row in rows] for name, _ in columns}
    if "detail" in params:
        params["detail"] = [None if d is None else json.dumps(d) for d in params["detail"]]
    return len(session.execute(sql, {"run_id": str(run_id), **params}).all())


def _sqlite_insert(session: Session, table: Any, run_id: uuid.UUID,
                   rows: list[dict[str, Any]]) -> int:
    key = table.c[_KEYS[table.name]]
    stmt = sqlite_insert(table).on_conflict_do_nothing().returning(key)
    return len(session.execute(stmt, [{"run_id": run_id, **r} for r in rows]).all())


def _is_postgres(session: Session) -> bool:
    return session.get_bind().dialect.name == "postgresql"


def _require_run(session: Session, run_id: uuid.UUID) -> None:
    """Raise NotFoundError unless the run exists (reads its id only)."""
    if session.scalar(select(Run.id).where(Run.id == run_id)) is None:
        raise NotFoundError(f"run {run_id} does not exist", field="run_id")


def insert_metrics(session: Session, *, run_id: uuid.UUID,
                   items: Sequence[Mapping[str, Any]]) -> int:
    """Store metric items {name, global_step, tokens?, replica?, value} of a run, skipping those
    already stored (key: run, name, global_step, replica; of duplicates within `items` the first
    is kept); commit. Returns how many were new."""
    _require_run(session, run_id)
    if not items:
        return 0
    if _is_postgres(session):
        inserted = _pg_copy_metrics(session, run_id, items)
    else:
        rows = [dict(zip(_METRIC_FIELDS, row, strict=True)) for row in _metric_rows(items)]
        inserted = _sqlite_insert(session, Metric.__table__, run_id, rows)
    session.commit()
    return inserted


def insert_events(session: Session, *, run_id: uuid.UUID, items: Sequence[dict[str, Any]]) -> int:
    """Store event items {id, kind, global_step, replica?, stage?, detail?} of a run, skipping
    ids already stored; commit. Returns how many were new."""
    _require_run(session, run_id)
    rows = [{"event_id": i["id"], "kind": i["kind"], "global_step": i["global_step"],
             "replica": i.get("replica"), "stage": i.get("stage"), "detail": i.get("detail")}
            for i in items]
    if not rows:
        return 0
    if _is_postgres(session):
        inserted = _pg_bulk_insert(session, "events", run_id, rows)
    else:
        inserted = _sqlite_insert(session, Event.__table__, run_id, rows)
    session.commit()
    return inserted


def list_metrics(session: Session, *, run_id: uuid.UUID, name: str | None = None,
                 replica: int | None = None, limit: int = 1000,
                 cursor: str | None = None) -> tuple[list[Metric], str | None]:
    """A run's metrics in global-step order, optionally one name / one replica."""
    get_run(session, run_id=run_id)
    query = select(Metric).where(Metric.run_id == run_id)
    if name is not None:
        query = query.where(Metric.name == name)
    if replica is not None:
        query = query.where(Metric.replica == replica)
    return _keyset_page(session, query, columns=(Metric.global_step, Metric.id),
                        kinds=(int, int), limit=limit, cursor=cursor)


def list_events(session: Session, *, run_id: uuid.UUID, kind: str | None = None,
                limit: int = 1000, cursor: str | None = None) -> tuple[list[Event], str | None]:
    """A run's events in global-step order, optionally one kind."""
    get_run(session, run_id=run_id)
    query = select(Event).where(Event.run_id == run_id)
    if kind is not None:
        query = query.where(Event.kind == kind)
    return _keyset_page(session, query, columns=(Event.global_step, Event.pk),
                        kinds=(int, int), limit=limit, cursor=cursor)


# ---------------------------------------------------------------- analysis

# The analysis reads these columns only: a Core select of them skips building ORM objects and
# decoding the runs' JSON config and summary (3x faster for a 1,000-run sweep, far less garbage).
_ANALYSIS_COLUMNS = (Run.id, Run.compression, Run.strategy, Run.p, Run.label, Run.duration,
                     Run.seed, Run.status, Run.final_val_loss, Run.initial_val_loss)
_ANALYSIS_KEYS = tuple(column.key for column in _ANALYSIS_COLUMNS)


def sweep_run_rows(session: Session, *, sweep_id: uuid.UUID) -> list[dict[str, Any]]:
    """The analysis view of a sweep's runs (creation order): id, compression, strategy, p,
    label, duration, seed, status, final_val_loss, initial_val_loss. A run that still owes records
    (`owed_records` > 0) has status "running" here, whatever its own says: it is not a finished
    data point until they arrive. Raises NotFoundError."""
    if session.scalar(select(Sweep.id).where(Sweep.id == sweep_id)) is None:
        raise NotFoundError(f"sweep {sweep_id} does not exist", field="sweep_id")
    return _analysis_rows(session, Run.sweep_id == sweep_id)


def _analysis_rows(session: Session, *where: Any, linked: bool = False
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


def sweep_robustness(session: Session, *, sweep_id: uuid.UUID) -> dict[str, Any]:
    """`crucible.stats.robustness` of the sweep's runs, with "sweep_id" added."""
    result = stats.robustness(sweep_run_rows(session, sweep_id=sweep_id))
    return {"sweep_id": sweep_id, **result}


def sweep_claims(session: Session, *, sweep_id: uuid.UUID,
                 duration: int | None = None) -> dict[str, Any]:
    """The blog's claims decided on the sweep's runs (`crucible.stats.sweep_claims`), with the
    margins and the target half-width of its spec (0.5 points each where it sets none).
    Raises InvalidInputError (field `duration`) when the runs span several failure durations
    and none is chosen, or the chosen one has no run."""
    sweep = get_sweep(session, sweep_id=sweep_id)
    spec = sweep.spec or {}

    def number(name: str) -> float:
        value = spec.get(name)
        ok = isinstance(value, int | float) and not isinstance(value, bool) and value > 0
        return float(value) if ok else 0.5

    try:
        result = stats.sweep_claims(sweep_run_rows(session, sweep_id=sweep_id),
                                    duration=duration, close_margin=number("close_margin"),
                                    equivalence_margin=number("equivalence_margin"),
                                    target_half_width=number("target_half_width"))
    except ValueError as exc:
        raise InvalidInputError(str(exc), field="duration") from None
    return {"sweep_id": sweep_id, **result}


def sweep_table(session: Session, *, sweep_id: uuid.UUID) -> dict[str, Any]:
    """The Table-1 shape (p rows x arm columns) of the sweep's robustness items."""
    items = sweep_robustness(session, sweep_id=sweep_id)["items"]
    return {"sweep_id": sweep_id, **stats.robustness_table(items)}

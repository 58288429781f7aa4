"""Views for the dashboard pages, read through the registry's data-access functions.

`sweep_view` and `run_view` turn registry rows into the plain dicts that `dashboards.pages`
renders (ORM objects never leave this module). Both the API routes and the offline export call
them, so a served page and an exported file show the same numbers. Paginated registry lists are
read to the end; a missing sweep or run raises the registry's `NotFoundError`. `run_state` and
`sweep_state` are what a live page polls: one small query each, with a version token that
changes whenever the page would. A run view is bounded for a big run (MAX_EVENTS events,
MAX_TRAIN_STEPS train-loss steps per replica; event counts by kind are computed in SQL).
"""
from __future__ import annotations

import hashlib
import math
import re
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar, get_args

from sqlalchemy import func, or_, select
from sqlalchemy.orm import Session

from api import analysis, costs, crud, records
from api.errors import InvalidInputError, NotFoundError
from api.schemas import (
    TAG_PATTERN,
    Compression,
    RunPublic,
    RunStatus,
    Strategy,
    SweepPublic,
    SweepStatus,
)
from crucible.grid.names import UNFINISHED_STATUSES
from db.models import Event, Metric, Run, RunCost, Sweep

__all__ = ["sweep_view", "run_view", "index_view", "compare_view", "run_state", "sweep_state", "INDEX_FILTERS",
           "MAX_EVENTS", "MAX_TRAIN_STEPS", "LIVE_STATUSES"]

MAX_EVENTS = 50_000  # a run's timeline never needs more; keeps a pathological run's page bounded
# per replica, the train-loss figure gets at most this many global steps (every k-th step, plus
# the last): a 100k-step run with 64 replicas still sends ~32k points, not 6.4M
MAX_TRAIN_STEPS = 500
# a run or sweep in one of these may still change: its page polls for news
LIVE_STATUSES = UNFINISHED_STATUSES
_PAGE = 5_000
T = TypeVar("T")


def _all_pages(fetch: Callable[[str | None], tuple[list[T], str | None]], *,
               cap: int | None = None) -> list[T]:
    """Follow a registry list's keyset cursor until the last page (or `cap` items)."""
    items: list[T] = []
    cursor: str | None = None
    while True:
        page, cursor = fetch(cursor)
        items.extend(page)
        if cursor is None or (cap is not None and len(items) >= cap):
            return items if cap is None else items[:cap]


def _run_dict(run: Run) -> dict[str, Any]:
    return RunPublic.model_validate(run).model_dump(mode="json")


def _metric_dict(metric: Metric) -> dict[str, Any]:
    return {"name": metric.name, "global_step": metric.global_step, "tokens": metric.tokens,
            "replica": metric.replica, "value": metric.value}


def _event_dict(event: Event) -> dict[str, Any]:
    return {"id": event.event_id, "kind": event.kind, "global_step": event.global_step,
            "replica": event.replica, "stage": event.stage, "detail": event.detail or {}}


def _val_loss(session: Session, run_id: uuid.UUID) -> list[dict[str, Any]]:
    rows = _all_pages(lambda cursor: records.list_metrics(session, run_id=run_id, name="val_loss",
                                                          limit=_PAGE, cursor=cursor))
    return [_metric_dict(m) for m in rows]


def sweep_view(session: Session, *, sweep_id: uuid.UUID) -> dict[str, Any]:
    """{"sweep", "robustness", "table", "claims", "costs", "runs"} of a sweep, as plain JSON-ready
    dicts (the REST shapes).

    Raises `api.errors.NotFoundError` for an unknown sweep.
    """
    sweep = SweepPublic.model_validate(crud.get_sweep(session, sweep_id=sweep_id))
    runs = _all_pages(lambda cursor: crud.list_runs(session, sweep_id=sweep_id, limit=_PAGE,
                                                    cursor=cursor))
    robustness = analysis.sweep_robustness(session, sweep_id=sweep_id)
    table = analysis.sweep_table(session, sweep_id=sweep_id)
    try:
        claims: dict[str, Any] = {**analysis.sweep_claims(session, sweep_id=sweep_id),
                                  "sweep_id": str(sweep_id)}
    except InvalidInputError as exc:     # several failure durations: no one set of claims
        claims = {"sweep_id": str(sweep_id), "claims": [], "error": str(exc)}
    return {"sweep": sweep.model_dump(mode="json"),
            "robustness": {**robustness, "sweep_id": str(sweep_id)},
            "table": {**table, "sweep_id": str(sweep_id)},
            "claims": claims,
            "costs": _sweep_costs(session, sweep_id),
            "runs": [_run_dict(r) for r in runs]}


def _sweep_costs(session: Session, sweep_id: uuid.UUID) -> list[dict[str, Any]]:
    """The sweep's decisions by cost on each deployment its runs are priced on (none: [])."""
    names = session.scalars(select(RunCost.deployment).join(Run, RunCost.run_id == Run.id)
                            .where(Run.sweep_id == sweep_id).distinct()).all()
    return [costs.sweep_costs(session, sweep_id=sweep_id, deployment=name)
            for name in sorted(names)]


def _train_loss(session: Session, run_id: uuid.UUID) -> list[dict[str, Any]]:
    """The run's `train_loss` rows (one per replica and global step), thinned in SQL to at most
    MAX_TRAIN_STEPS steps per replica: every k-th step from the first, plus the last."""
    named = (Metric.run_id == run_id, Metric.name == "train_loss")
    first, last = session.execute(select(func.min(Metric.global_step),
                                         func.max(Metric.global_step)).where(*named)).one()
    if first is None:
        return []
    stride = max(1, math.ceil((last - first + 1) / MAX_TRAIN_STEPS))
    query = (select(Metric.global_step, Metric.tokens, Metric.replica, Metric.value)
             .where(*named).order_by(Metric.replica, Metric.global_step))
    if stride > 1:
        query = query.where(or_((Metric.global_step - first) % stride == 0,
                                Metric.global_step == last))
    return [{"name": "train_loss", "global_step": step, "tokens": tokens, "replica": replica,
             "value": value} for step, tokens, replica, value in session.execute(query)]


def _event_counts(session: Session, run_id: uuid.UUID) -> dict[str, int]:
    """kind -> number of the run's events of that kind (counted in SQL, all events, uncapped)."""
    rows = session.execute(select(Event.kind, func.count()).where(Event.run_id == run_id)
                           .group_by(Event.kind))
    return {kind: count for kind, count in rows}


def run_view(session: Session, *, run_id: uuid.UUID) -> dict[str, Any]:
    """{"run", "metrics" (val_loss), "train_loss", "events", "event_counts", "baseline",
    "baseline_metrics"} of one run.

    Bounded for a big run: at most MAX_EVENTS events (the timeline's), MAX_TRAIN_STEPS global
    steps of train loss per replica; "event_counts" counts every event by kind. The baseline is
    the run's linked p = 0 run of the same arm and seed (None if there is none).
    Raises `api.errors.NotFoundError` for an unknown run.
    """
    run = crud.get_run(session, run_id=run_id)
    events = _all_pages(lambda cursor: records.list_events(session, run_id=run_id, limit=_PAGE,
                                                           cursor=cursor), cap=MAX_EVENTS)
    baseline, baseline_metrics = None, []
    if run.baseline_run_id is not None and run.baseline_run_id != run.id:
        base = crud.get_run(session, run_id=run.baseline_run_id)
        baseline, baseline_metrics = _run_dict(base), _val_loss(session, base.id)
    return {"run": _run_dict(run), "metrics": _val_loss(session, run_id),
            "train_loss": _train_loss(session, run_id),
            "events": [_event_dict(e) for e in events],
            "event_counts": _event_counts(session, run_id), "baseline": baseline,
            "baseline_metrics": baseline_metrics}


def _version(*parts: Any) -> str:
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:16]


def run_state(session: Session, *, run_id: uuid.UUID) -> dict[str, Any]:
    """What a live run page polls, in one small query: {"id", "status", "updated_at",
    "owed_records", "metrics", "events", "finished", "version"}.

    `version` changes whenever the page would: a PATCH (status, results), or a metric or event
    arriving (their counts and last global steps are in it). `finished`: the status is final and
    no records are owed, so the page stops polling. Raises NotFoundError for an unknown run.
    """
    def per_run(model: type[Metric] | type[Event], column: Any) -> Any:
        return select(column).where(model.run_id == Run.id).scalar_subquery()

    row = session.execute(select(
        Run.status, Run.updated_at, Run.owed_records,
        per_run(Metric, func.count()), per_run(Metric, func.max(Metric.global_step)),
        per_run(Event, func.count()), per_run(Event, func.max(Event.global_step)),
    ).where(Run.id == run_id)).one_or_none()
    if row is None:
        raise NotFoundError(f"run {run_id} does not exist", field="run_id")
    status, updated_at, owed, metrics, _, events, _ = row
    return {"id": str(run_id), "status": status, "updated_at": updated_at.isoformat(),
            "owed_records": owed or 0, "metrics": metrics, "events": events,
            "finished": status not in LIVE_STATUSES and not owed,
            "version": _version(*row)}


def sweep_state(session: Session, *, sweep_id: uuid.UUID) -> dict[str, Any]:
    """What a live sweep page polls, in one small query: {"id", "status", "updated_at", "runs",
    "runs_active", "finished", "version"}.

    `version` changes when the sweep or any of its runs is updated or a run is added;
    `runs_active` counts runs still pending/queued/running or owing records. `finished`: the
    sweep's status is final and no run is active. Raises NotFoundError for an unknown sweep.
    """
    def per_sweep(column: Any, *where: Any) -> Any:
        return select(column).where(Run.sweep_id == Sweep.id, *where).scalar_subquery()

    row = session.execute(select(
        Sweep.status, Sweep.updated_at, per_sweep(func.count()), per_sweep(func.max(Run.updated_at)),
        per_sweep(func.count(), or_(Run.status.in_(LIVE_STATUSES), Run.owed_records > 0)),
    ).where(Sweep.id == sweep_id)).one_or_none()
    if row is None:
        raise NotFoundError(f"sweep {sweep_id} does not exist", field="sweep_id")
    status, updated_at, runs, _, active = row
    return {"id": str(sweep_id), "status": status, "updated_at": updated_at.isoformat(),
            "runs": runs, "runs_active": active,
            "finished": status not in LIVE_STATUSES and not active, "version": _version(*row)}


# The index's filters: query parameter -> allowed values (None: free text / a number).
INDEX_FILTERS: dict[str, tuple[str, ...] | None] = {
    "q": None, "status": get_args(RunStatus), "compression": get_args(Compression),
    "strategy": get_args(Strategy), "p": None, "preset": None, "tag": None}
_MAX_TEXT = 200
_TAG = re.compile(TAG_PATTERN)


def _parse_filters(raw: Mapping[str, str]) -> tuple[dict[str, Any], list[str]]:
    """The index's query parameters as typed filters, and one message per bad one (a bad
    filter is dropped, so the page still lists everything else)."""
    filters: dict[str, Any] = {}
    errors: list[str] = []
    for key, choices in INDEX_FILTERS.items():
        value = (raw.get(key) or "").strip()
        if not value:
            continue
        if choices is not None and value not in choices:
            errors.append(f"{key}: '{value}' is not one of {', '.join(choices)}")
        elif key == "p":
            try:
                p = float(value)
            except ValueError:
                p = math.nan
            if not 0.0 <= p <= 1.0:
                errors.append(f"p: '{value}' is not a number between 0 and 1 (e.g. 0.1)")
                continue
            filters["p"] = p
        elif key == "tag" and not _TAG.fullmatch(value):
            errors.append(f"tag: '{value[:80]}' is not a tag (1-64 characters from "
                          "A-Za-z0-9._:/+=-)")
        elif len(value) > _MAX_TEXT or not value.isprintable():
            errors.append(f"{key}: give at most {_MAX_TEXT} printable characters")
        else:
            filters[key] = value
    unknown = sorted(set(raw) - set(INDEX_FILTERS))
    if unknown:
        errors.append(f"unknown filter {', '.join(unknown)}; allowed: {', '.join(INDEX_FILTERS)}")
    return filters, errors


def index_view(session: Session, *, raw_filters: Mapping[str, str]) -> dict[str, Any]:
    """{"filters", "errors", "sweeps", "runs"} for the index page: the newest sweeps (each with
    "runs_total", "runs_completed", "arms") and runs (each with its "sweep_name") matching the
    filters in `raw_filters` (q = name contains, status, compression, strategy, p, preset, tag =
    carries this tag). Bad filters are reported in "errors" and ignored."""
    filters, errors = _parse_filters(raw_filters)
    arm = {key: filters.get(key) for key in ("compression", "strategy", "p", "preset")}
    name, status, tag = filters.get("q"), filters.get("status"), filters.get("tag")
    sweep_status = status if status in get_args(SweepStatus) else None
    sweeps = ([] if status is not None and sweep_status is None
              else crud.recent_sweeps(session, name=name, status=sweep_status, arm=arm, tag=tag))
    counts = crud.sweep_run_counts(session, sweep_ids=[s.id for s in sweeps])
    sweep_rows = []
    for sweep in sweeps:
        statuses = counts[sweep.id]["statuses"]
        sweep_rows.append({**SweepPublic.model_validate(sweep).model_dump(mode="json"),
                           "runs_total": sum(statuses.values()),
                           "runs_completed": statuses.get("completed", 0),
                           "arms": counts[sweep.id]["arms"]})
    runs = crud.recent_runs(session, name=name, status=status, arm=arm, tag=tag)
    names = {sweep.id: sweep.name for sweep in sweeps}
    for sweep_id in {r.sweep_id for r in runs} - set(names) - {None}:
        names[sweep_id] = crud.get_sweep(session, sweep_id=sweep_id).name
    return {"filters": filters, "errors": errors, "sweeps": sweep_rows,
            "runs": [{**_run_dict(r), "sweep_name": names.get(r.sweep_id)} for r in runs]}


def _parse_run_ids(raw: Sequence[str]) -> tuple[list[uuid.UUID], list[str]]:
    """Run ids from `runs` query values (each may hold several, comma-separated), de-duplicated
    in order, and the pieces that are not UUIDs."""
    ids: list[uuid.UUID] = []
    bad: list[str] = []
    for piece in (p.strip() for value in raw for p in value.split(",")):
        if not piece:
            continue
        try:
            run_id = uuid.UUID(piece)
        except ValueError:
            bad.append(piece[:80])
            continue
        if run_id not in ids:
            ids.append(run_id)
    return ids, bad


def compare_view(session: Session, *, raw_ids: Sequence[str], max_runs: int) -> dict[str, Any]:
    """{"runs", "metrics", "errors"} for the compare page: the runs named in `raw_ids` (the
    `runs` query values, comma-separated UUIDs) in the order given, at most `max_runs`, each with
    its "sweep_name"; "metrics" maps each run id to its val_loss rows. Malformed and unknown ids
    and the ones past `max_runs` are named in "errors" and left out; nothing here raises for bad
    input."""
    ids, bad = _parse_run_ids(raw_ids)
    errors = [f"not a run id: {', '.join(repr(b) for b in bad)}"] if bad else []
    if len(ids) > max_runs:
        errors.append(f"compare at most {max_runs} runs at once; left out: "
                      f"{', '.join(str(i) for i in ids[max_runs:])}")
        ids = ids[:max_runs]
    runs, unknown = [], []
    for run_id in ids:
        try:
            runs.append(_run_dict(crud.get_run(session, run_id=run_id)))
        except NotFoundError:
            unknown.append(str(run_id))
    if unknown:
        errors.append(f"no run with id {', '.join(unknown)}")
    names = {sweep_id: crud.get_sweep(session, sweep_id=uuid.UUID(sweep_id)).name
             for sweep_id in {run["sweep_id"] for run in runs} - {None}}
    for run in runs:
        run["sweep_name"] = names.get(run["sweep_id"])
    return {"runs": runs, "errors": errors,
            "metrics": {run["id"]: _val_loss(session, uuid.UUID(run["id"])) for run in runs}}

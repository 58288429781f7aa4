"""Views for the dashboard pages, read through the registry's data-access functions.

`sweep_view` and `run_view` turn registry rows into the plain dicts that `dashboards.pages`
renders (ORM objects never leave this module). Both the API routes and the offline export call
them, so a served page and an exported file show the same numbers. Paginated registry lists are
read to the end; a missing sweep or run raises the registry's `NotFoundError`.
"""
from __future__ import annotations

import math
import uuid
from collections.abc import Callable, Mapping
from typing import Any, TypeVar, get_args

from sqlalchemy.orm import Session

from api import crud
from api.schemas import Compression, RunPublic, RunStatus, Strategy, SweepPublic, SweepStatus
from db.models import Event, Metric, Run

__all__ = ["sweep_view", "run_view", "index_view", "INDEX_FILTERS", "MAX_EVENTS"]

MAX_EVENTS = 50_000  # a run's timeline never needs more; keeps a pathological run's page bounded
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
    rows = _all_pages(lambda cursor: crud.list_metrics(session, run_id=run_id, name="val_loss",
                                                       limit=_PAGE, cursor=cursor))
    return [_metric_dict(m) for m in rows]


def sweep_view(session: Session, *, sweep_id: uuid.UUID) -> dict[str, Any]:
    """{"sweep", "robustness", "table", "runs"} of a sweep, as plain JSON-ready dicts.

    Raises `api.errors.NotFoundError` for an unknown sweep.
    """
    sweep = SweepPublic.model_validate(crud.get_sweep(session, sweep_id=sweep_id))
    runs = _all_pages(lambda cursor: crud.list_runs(session, sweep_id=sweep_id, limit=_PAGE,
                                                    cursor=cursor))
    robustness = crud.sweep_robustness(session, sweep_id=sweep_id)
    table = crud.sweep_table(session, sweep_id=sweep_id)
    return {"sweep": sweep.model_dump(mode="json"),
            "robustness": {**robustness, "sweep_id": str(sweep_id)},
            "table": {**table, "sweep_id": str(sweep_id)},
            "runs": [_run_dict(r) for r in runs]}


def run_view(session: Session, *, run_id: uuid.UUID) -> dict[str, Any]:
    """{"run", "metrics" (val_loss), "events", "baseline", "baseline_metrics"} of one run.

    The baseline is the run's linked p = 0 run of the same arm and seed (None if there is none).
    Raises `api.errors.NotFoundError` for an unknown run.
    """
    run = crud.get_run(session, run_id=run_id)
    events = _all_pages(lambda cursor: crud.list_events(session, run_id=run_id, limit=_PAGE,
                                                        cursor=cursor), cap=MAX_EVENTS)
    baseline, baseline_metrics = None, []
    if run.baseline_run_id is not None and run.baseline_run_id != run.id:
        base = crud.get_run(session, run_id=run.baseline_run_id)
        baseline, baseline_metrics = _run_dict(base), _val_loss(session, base.id)
    return {"run": _run_dict(run), "metrics": _val_loss(session, run_id),
            "events": [_event_dict(e) for e in events], "baseline": baseline,
            "baseline_metrics": baseline_metrics}


# The index's filters: query parameter -> allowed values (None: free text / a number).
INDEX_FILTERS: dict[str, tuple[str, ...] | None] = {
    "q": None, "status": get_args(RunStatus), "compression": get_args(Compression),
    "strategy": get_args(Strategy), "p": None, "preset": None}
_MAX_TEXT = 200


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
    "runs_total", "runs_completed", "arms") and runs matching the filters in `raw_filters`
    (q = name contains, status, compression, strategy, p, preset). Bad filters are reported in
    "errors" and ignored."""
    filters, errors = _parse_filters(raw_filters)
    arm = {key: filters.get(key) for key in ("compression", "strategy", "p", "preset")}
    name, status = filters.get("q"), filters.get("status")
    sweep_status = status if status in get_args(SweepStatus) else None
    sweeps = ([] if status is not None and sweep_status is None
              else crud.recent_sweeps(session, name=name, status=sweep_status, arm=arm))
    counts = crud.sweep_run_counts(session, sweep_ids=[s.id for s in sweeps])
    sweep_rows = []
    for sweep in sweeps:
        statuses = counts[sweep.id]["statuses"]
        sweep_rows.append({**SweepPublic.model_validate(sweep).model_dump(mode="json"),
                           "runs_total": sum(statuses.values()),
                           "runs_completed": statuses.get("completed", 0),
                           "arms": counts[sweep.id]["arms"]})
    runs = crud.recent_runs(session, name=name, status=status, arm=arm)
    return {"filters": filters, "errors": errors, "sweeps": sweep_rows,
            "runs": [_run_dict(r) for r in runs]}

"""Views for the dashboard pages, read through the registry's data-access functions.

`sweep_view` and `run_view` turn registry rows into the plain dicts that `dashboards.pages`
renders (ORM objects never leave this module). Both the API routes and the offline export call
them, so a served page and an exported file show the same numbers. Paginated registry lists are
read to the end; a missing sweep or run raises the registry's `NotFoundError`.
"""
from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any, TypeVar

from sqlalchemy.orm import Session

from api import crud
from api.schemas import RunPublic, SweepPublic
from db.models import Event, Metric, Run

__all__ = ["sweep_view", "run_view", "MAX_EVENTS"]

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

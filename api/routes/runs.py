"""Run routes: create, list with filters, get, update; metric and event ingestion and reads.

GET /runs takes `tag=` (runs carrying it) and `fields=` (only those fields of each item); PATCH
edits tags with `add_tags`/`remove_tags` atomically (409 past 32 tags).
"""
from __future__ import annotations

import uuid
from datetime import datetime
from typing import Annotated, Any

from fastapi import APIRouter, Query

from api import costs, crud, pagination, records
from api.deps import ReadAuthDep, SessionDep, WriteAuthDep
from api.errors import read_responses, write_responses
from api.routes import FieldsQuery, KnownQueryDep, TagQuery, selected_fields
from api.schemas import (
    EVENT_KIND_HELP,
    BatchResult,
    Compression,
    EventBatch,
    EventKind,
    EventPublic,
    MetricBatch,
    MetricName,
    MetricPublic,
    Page,
    RunCostIn,
    RunCostPublic,
    RunCreate,
    RunFields,
    RunPublic,
    RunStatus,
    RunUpdate,
    Strategy,
)

router = APIRouter(prefix="/runs", tags=["runs"], dependencies=[KnownQueryDep])

_CURSOR_HELP = "next_cursor of the previous page; omit for the first page"
RunCursor = Annotated[str | None, Query(pattern=pagination.cursor_pattern((datetime, uuid.UUID)),
                                        description=_CURSOR_HELP)]
StepCursor = Annotated[str | None, Query(pattern=pagination.cursor_pattern((int, int)),
                                         description=_CURSOR_HELP)]
SafeQuery = Annotated[str | None, Query(max_length=128, pattern=r"^[A-Za-z0-9._:+/=-]*$")]
_NOT_NULLABLE = ("status", "tags")
RunItems = Page[RunPublic | RunFields]  # type: ignore[valid-type]
RunFieldsQuery = FieldsQuery(RunPublic)


@router.post("", status_code=201, response_model=RunPublic, dependencies=[WriteAuthDep],
             responses=write_responses(404, 409))
def create_run(body: RunCreate, session: SessionDep) -> RunPublic:
    """Register a run from its config (status pending); 404 for an unknown sweep_id, 422 for
    a bad config or a labelled p = 0 baseline."""
    run = crud.create_run(session, config=body.config, sweep_id=body.sweep_id, name=body.name,
                          config_hash=body.config_hash, code_version=body.code_version,
                          tags=body.tags, notes=body.notes, label=body.label)
    return RunPublic.model_validate(run)


@router.get("", response_model=RunItems, dependencies=[ReadAuthDep],
            responses=read_responses())
def list_runs(session: SessionDep, sweep_id: uuid.UUID | None = None,
              compression: Compression | None = None, strategy: Strategy | None = None,
              p: Annotated[float | None, Query(ge=0, le=1)] = None,
              seed: Annotated[int | None, Query(ge=0, le=2**62)] = None,
              status: RunStatus | None = None, config_hash: SafeQuery = None,
              code_version: SafeQuery = None, tag: TagQuery = None,
              fields: RunFieldsQuery = None,
              limit: Annotated[int, Query(ge=1, le=1000)] = 100,
              cursor: RunCursor = None) -> Any:
    """Runs matching every given filter, oldest first, keyset-paginated. Items are RunPublic,
    or with `fields=` objects of only those fields (RunFields)."""
    selection = selected_fields(fields, RunPublic)
    rows, next_cursor = crud.list_runs(
        session, sweep_id=sweep_id, compression=compression, strategy=strategy, p=p, seed=seed,
        status=status, config_hash=config_hash, code_version=code_version, tag=tag, limit=limit,
        cursor=cursor)
    runs = [RunPublic.model_validate(r) for r in rows]
    items = runs if selection is None else [r.model_dump(include=selection) for r in runs]
    return RunItems(items=items, next_cursor=next_cursor)


@router.get("/{run_id}", response_model=RunPublic, dependencies=[ReadAuthDep],
            responses=read_responses(404))
def get_run(run_id: uuid.UUID, session: SessionDep) -> RunPublic:
    """One run; 404 when it does not exist."""
    return RunPublic.model_validate(crud.get_run(session, run_id=run_id))


@router.patch("/{run_id}", response_model=RunPublic, dependencies=[WriteAuthDep],
              responses=write_responses(404, 409))
def update_run(run_id: uuid.UUID, body: RunUpdate, session: SessionDep) -> RunPublic:
    """Update a run's status, results, tags and notes (fields left out are unchanged).
    `tags` replaces the list; `add_tags`/`remove_tags` edit it atomically (not with `tags`;
    409 when it would pass 32 tags); `notes: null` clears the notes."""
    changes = body.model_dump(exclude_unset=True)
    for key in _NOT_NULLABLE:
        if key in changes and changes[key] is None:
            del changes[key]
    return RunPublic.model_validate(crud.update_run(session, run_id=run_id, changes=changes))


@router.post("/{run_id}/metrics:batch", response_model=BatchResult, dependencies=[WriteAuthDep],
             responses=write_responses(404, 409))
def ingest_metrics(run_id: uuid.UUID, body: MetricBatch, session: SessionDep) -> BatchResult:
    """Store up to 10,000 metric items idempotently (key: name, global_step, replica)."""
    inserted = records.insert_metrics(session, run_id=run_id, items=body.items)
    return BatchResult(received=len(body.items), inserted=inserted)


@router.post("/{run_id}/events:batch", response_model=BatchResult, dependencies=[WriteAuthDep],
             responses=write_responses(404, 409))
def ingest_events(run_id: uuid.UUID, body: EventBatch, session: SessionDep) -> BatchResult:
    """Store up to 10,000 event items idempotently (key: the event's id)."""
    items = [item.model_dump() for item in body.items]
    inserted = records.insert_events(session, run_id=run_id, items=items)
    return BatchResult(received=len(items), inserted=inserted)


@router.get("/{run_id}/metrics", response_model=Page[MetricPublic], dependencies=[ReadAuthDep],
            responses=read_responses(404))
def read_metrics(run_id: uuid.UUID, session: SessionDep, name: MetricName | None = None,
                 replica: Annotated[int | None, Query(ge=0, le=2**31 - 1)] = None,
                 limit: Annotated[int, Query(ge=1, le=10_000)] = 1000,
                 cursor: StepCursor = None) -> Page[MetricPublic]:
    """A run's metrics in global-step order, keyset-paginated."""
    rows, next_cursor = records.list_metrics(session, run_id=run_id, name=name, replica=replica,
                                             limit=limit, cursor=cursor)
    return Page[MetricPublic](items=[MetricPublic.model_validate(r) for r in rows],
                              next_cursor=next_cursor)


@router.get("/{run_id}/events", response_model=Page[EventPublic], dependencies=[ReadAuthDep],
            responses=read_responses(404))
def read_events(run_id: uuid.UUID, session: SessionDep,
                kind: Annotated[EventKind | None,
                                Query(description="Only events of this kind. " + EVENT_KIND_HELP)
                                ] = None,
                limit: Annotated[int, Query(ge=1, le=10_000)] = 1000,
                cursor: StepCursor = None) -> Page[EventPublic]:
    """A run's events in global-step order, keyset-paginated."""
    rows, next_cursor = records.list_events(session, run_id=run_id, kind=kind, limit=limit,
                                            cursor=cursor)
    items = [EventPublic(id=e.event_id, kind=e.kind, global_step=e.global_step,
                         replica=e.replica, stage=e.stage, detail=e.detail) for e in rows]
    return Page[EventPublic](items=items, next_cursor=next_cursor)


@router.put("/{run_id}/costs", response_model=RunCostPublic, dependencies=[WriteAuthDep],
            responses=write_responses(404))
def put_cost(run_id: uuid.UUID, body: RunCostIn, session: SessionDep) -> RunCostPublic:
    """Store what the run would cost on a deployment: the record `crucible cost` writes as
    cost.json (crucible.pricing.cost.run_cost). One record per deployment name: putting the same
    deployment again replaces it. 422 for a record without its headline fields."""
    record = body.model_dump()
    return RunCostPublic.model_validate(costs.put_run_cost(session, run_id=run_id,
                                                           record=record))


@router.get("/{run_id}/costs", response_model=list[RunCostPublic], dependencies=[ReadAuthDep],
            responses=read_responses(404))
def get_costs(run_id: uuid.UUID, session: SessionDep) -> list[RunCostPublic]:
    """The run's cost records, one per deployment, by deployment name."""
    return [RunCostPublic.model_validate(c) for c in costs.list_run_costs(session, run_id=run_id)]

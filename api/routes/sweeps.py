"""Sweep routes: create, list, get, update, and the robustness summary and table."""
from __future__ import annotations

import uuid
from datetime import datetime
from typing import Annotated

from fastapi import APIRouter, Query

from api import crud
from api.deps import ReadAuthDep, SessionDep, WriteAuthDep
from api.errors import read_responses, write_responses
from api.routes import KnownQueryDep
from api.schemas import (
    Page,
    RobustnessPublic,
    SweepCreate,
    SweepPublic,
    SweepStatus,
    SweepUpdate,
    TablePublic,
)

router = APIRouter(prefix="/sweeps", tags=["sweeps"], dependencies=[KnownQueryDep])

Limit = Annotated[int, Query(ge=1, le=1000)]
Cursor = Annotated[str | None, Query(pattern=crud.cursor_pattern((datetime, uuid.UUID)),
                                     description="next_cursor of the previous page; omit for "
                                                 "the first page")]
NameQuery = Annotated[str | None, Query(max_length=200, pattern=r"^[^\x00-\x1f\x7f]*$",
                                        description="Only sweeps whose name contains this text "
                                                    "(case-insensitive substring match)")]


@router.post("", status_code=201, response_model=SweepPublic, dependencies=[WriteAuthDep],
             responses=write_responses())
def create_sweep(body: SweepCreate, session: SessionDep) -> SweepPublic:
    """Register a sweep (status pending)."""
    sweep = crud.create_sweep(session, name=body.name, spec=body.spec)
    return SweepPublic.model_validate(sweep)


@router.get("", response_model=Page[SweepPublic], dependencies=[ReadAuthDep],
            responses=read_responses())
def list_sweeps(session: SessionDep, status: SweepStatus | None = None, name: NameQuery = None,
                limit: Limit = 100, cursor: Cursor = None) -> Page[SweepPublic]:
    """Sweeps, oldest first, keyset-paginated; `name` keeps those whose name contains it."""
    rows, next_cursor = crud.list_sweeps(session, status=status, name=name, limit=limit,
                                         cursor=cursor)
    return Page[SweepPublic](items=[SweepPublic.model_validate(r) for r in rows],
                             next_cursor=next_cursor)


@router.get("/{sweep_id}", response_model=SweepPublic, dependencies=[ReadAuthDep],
            responses=read_responses(404))
def get_sweep(sweep_id: uuid.UUID, session: SessionDep) -> SweepPublic:
    """One sweep; 404 when it does not exist."""
    return SweepPublic.model_validate(crud.get_sweep(session, sweep_id=sweep_id))


@router.patch("/{sweep_id}", response_model=SweepPublic, dependencies=[WriteAuthDep],
              responses=write_responses(404))
def update_sweep(sweep_id: uuid.UUID, body: SweepUpdate, session: SessionDep) -> SweepPublic:
    """Change a sweep's status or Prefect flow-run id (fields left out are unchanged)."""
    changes = body.model_dump(exclude_unset=True)
    if changes.get("status", "") is None:
        del changes["status"]  # status is not nullable; null means "leave as is"
    sweep = crud.update_sweep(session, sweep_id=sweep_id, changes=changes)
    return SweepPublic.model_validate(sweep)


@router.get("/{sweep_id}/robustness", response_model=RobustnessPublic,
            dependencies=[ReadAuthDep], responses=read_responses(404))
def robustness(sweep_id: uuid.UUID, session: SessionDep) -> RobustnessPublic:
    """Per arm x strategy x p: mean relative final-validation-loss increase over the arm's p = 0
    baseline (paired by seed), its 95% t-interval (null bounds with one seed), the seeds and the
    runs behind it; baselines that are missing; how many runs are still pending or running."""
    return RobustnessPublic.model_validate(crud.sweep_robustness(session, sweep_id=sweep_id))


@router.get("/{sweep_id}/table", response_model=TablePublic, dependencies=[ReadAuthDep],
            responses=read_responses(404))
def table(sweep_id: uuid.UUID, session: SessionDep) -> TablePublic:
    """The robustness summary as the blog's Table 1: one row per p, one column per
    "<compression>/<strategy>"."""
    return TablePublic.model_validate(crud.sweep_table(session, sweep_id=sweep_id))

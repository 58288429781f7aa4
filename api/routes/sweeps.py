"""Sweep routes: create, list, get, update, the robustness summary and table, and the claims.

`/sweeps/{sweep_ref}` takes a sweep's UUID or its exact name (the newest sweep of that name;
`api.crud.resolve_sweep`). GET /sweeps takes `tag=` and `fields=` as GET /runs does.
"""
from __future__ import annotations

import uuid
from datetime import datetime
from typing import Annotated, Any

from fastapi import APIRouter, Path, Query
from pydantic import AfterValidator

from api import analysis, costs, crud, pagination
from api.analysis_schemas import ClaimsPublic, RobustnessPublic, TablePublic
from api.deps import ReadAuthDep, SessionDep, WriteAuthDep
from api.errors import read_responses, write_responses
from api.routes import FieldsQuery, KnownQueryDep, TagQuery, selected_fields
from api.schemas import (
    Page,
    SweepCreate,
    SweepFields,
    SweepPublic,
    SweepStatus,
    SweepUpdate,
    check_text,
)

router = APIRouter(prefix="/sweeps", tags=["sweeps"], dependencies=[KnownQueryDep])

Limit = Annotated[int, Query(ge=1, le=1000)]
Cursor = Annotated[str | None, Query(pattern=pagination.cursor_pattern((datetime, uuid.UUID)),
                                     description="next_cursor of the previous page; omit for "
                                                 "the first page")]
NameQuery = Annotated[str | None, Query(max_length=200, pattern=r"^[^\x00-\x1f\x7f]*$",
                                        description="Only sweeps whose name contains this text "
                                                    "(case-insensitive substring match)")]
SweepRef = Annotated[str, Path(
    min_length=1, max_length=200, pattern=r"^[^\x00]*$",
    description="the sweep's id, or its exact name (the newest sweep of that name); a name "
                "with '/' cannot be given here, use the id"), AfterValidator(check_text)]
SweepItems = Page[SweepPublic | SweepFields]  # type: ignore[valid-type]
SweepFieldsQuery = FieldsQuery(SweepPublic)


@router.post("", status_code=201, response_model=SweepPublic, dependencies=[WriteAuthDep],
             responses=write_responses())
def create_sweep(body: SweepCreate, session: SessionDep) -> SweepPublic:
    """Register a sweep (status pending)."""
    sweep = crud.create_sweep(session, name=body.name, spec=body.spec, tags=body.tags,
                              notes=body.notes)
    return SweepPublic.model_validate(sweep)


@router.get("", response_model=SweepItems, dependencies=[ReadAuthDep],
            responses=read_responses())
def list_sweeps(session: SessionDep, status: SweepStatus | None = None, name: NameQuery = None,
                tag: TagQuery = None, fields: SweepFieldsQuery = None,
                limit: Limit = 100, cursor: Cursor = None) -> Any:
    """Sweeps, oldest first, keyset-paginated; `name` keeps those whose name contains it, `tag`
    those that carry it. Items are SweepPublic, or with `fields=` only those fields."""
    selection = selected_fields(fields, SweepPublic)
    rows, next_cursor = crud.list_sweeps(session, status=status, name=name, tag=tag, limit=limit,
                                         cursor=cursor)
    sweeps = [SweepPublic.model_validate(r) for r in rows]
    items = sweeps if selection is None else [s.model_dump(include=selection) for s in sweeps]
    return SweepItems(items=items, next_cursor=next_cursor)


@router.get("/{sweep_ref}", response_model=SweepPublic, dependencies=[ReadAuthDep],
            responses=read_responses(404))
def get_sweep(sweep_ref: SweepRef, session: SessionDep) -> SweepPublic:
    """One sweep, by id or exact name; 404 when none matches."""
    return SweepPublic.model_validate(crud.resolve_sweep(session, sweep_ref))


@router.patch("/{sweep_ref}", response_model=SweepPublic, dependencies=[WriteAuthDep],
              responses=write_responses(404, 409))
def update_sweep(sweep_ref: SweepRef, body: SweepUpdate, session: SessionDep) -> SweepPublic:
    """Change a sweep's status, Prefect flow-run id, tags or notes (fields left out are
    unchanged). `tags` replaces the list; `add_tags`/`remove_tags` edit it atomically (not with
    `tags`; 409 when it would pass 32 tags); `notes: null` clears the notes."""
    changes = body.model_dump(exclude_unset=True)
    for key in ("status", "tags"):  # not nullable; null means "leave as is"
        if key in changes and changes[key] is None:
            del changes[key]
    sweep_id = crud.resolve_sweep(session, sweep_ref).id
    return SweepPublic.model_validate(crud.update_sweep(session, sweep_id=sweep_id,
                                                       changes=changes))


@router.get("/{sweep_ref}/robustness", response_model=RobustnessPublic,
            dependencies=[ReadAuthDep], responses=read_responses(404))
def robustness(sweep_ref: SweepRef, session: SessionDep) -> RobustnessPublic:
    """Per arm x strategy x p: mean relative final-validation-loss increase over the arm's p = 0
    baseline (paired by seed), its 95% t-interval (null bounds with one seed), the seeds and the
    runs behind it; baselines that are missing; how many runs are still pending or running."""
    sweep_id = crud.resolve_sweep(session, sweep_ref).id
    return RobustnessPublic.model_validate(analysis.sweep_robustness(session, sweep_id=sweep_id))


@router.get("/{sweep_ref}/claims", response_model=ClaimsPublic, dependencies=[ReadAuthDep],
            responses=read_responses(404))
def claims(sweep_ref: SweepRef, session: SessionDep,
           duration: Annotated[int | None, Query(ge=1, le=2**31 - 1, description=(
               "the failure duration to decide at; needed only when the sweep's runs have "
               "several"))] = None) -> ClaimsPublic:
    """The blog's claims (a)-(e) decided on the sweep's runs: per claim its verdict (agrees,
    disagrees, not resolved, not run yet), and per comparison the paired 95% interval, the
    blog's value where it gives one, the half-width against the sweep's target and the seeds
    its measured sd says would settle it. Computed by `crucible.stats`, the module that also
    renders the study document."""
    sweep_id = crud.resolve_sweep(session, sweep_ref).id
    return ClaimsPublic.model_validate(analysis.sweep_claims(session, sweep_id=sweep_id,
                                                             duration=duration))


@router.get("/{sweep_ref}/table", response_model=TablePublic, dependencies=[ReadAuthDep],
            responses=read_responses(404))
def table(sweep_ref: SweepRef, session: SessionDep) -> TablePublic:
    """The robustness summary as the blog's Table 1: one row per p, one column per
    "<compression>/<strategy>"."""
    sweep_id = crud.resolve_sweep(session, sweep_ref).id
    return TablePublic.model_validate(analysis.sweep_table(session, sweep_id=sweep_id))


@router.get("/{sweep_ref}/costs", dependencies=[ReadAuthDep], responses=read_responses(404))
def sweep_costs(sweep_ref: SweepRef, session: SessionDep,
                deployment: Annotated[str | None, Query(
                    max_length=200, pattern=r"^[^\x00-\x1f\x7f]*$",
                    description="the deployment name; needed only when the sweep's runs are "
                                "priced on several")] = None) -> dict[str, Any]:
    """Decisions by cost from the sweep's runs' cost records (`crucible cost ... --api`): per
    cell (arm, strategy, p, label) over its seeds, wall-clock, money and final loss with 95%
    intervals, the time and money to reach the same-seed baseline's final loss (or "not
    reached"), the loss on the baseline's budget, the loss-against-time-and-money curve, and
    the cheapest strategy at each p (crucible.pricing.cost_sweep). 404 when no run is priced."""
    sweep_id = crud.resolve_sweep(session, sweep_ref).id
    return costs.sweep_costs(session, sweep_id=sweep_id, deployment=deployment)

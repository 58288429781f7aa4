"""Dashboard routes: the index (at / and /dashboards), the sweep overview, a run page, their
live state, and the local copy of plotly.js.

Mounted by the registry app (`api.app` includes `router`). Pages read through
`api.dashboards.queries` (the registry's data-access functions) and render with the pure page
builders of `dashboards.pages`.
An unknown or malformed id answers a 404 HTML page (a browser user gets a page, not JSON). A
sweep is named by its UUID or its exact name (`crud.resolve_sweep`); a run by its UUID (runs
have no unique name). `.../state` is the small JSON a page polls while its sweep or run is
unfinished (one query; the page refetches itself when the version changes). With
`reads_require_token`, a browser without a session is sent to /login (303) and comes back after
signing in (`api.routes.login`). plotly.js is served from the installed plotly package, so pages
work on a network with no internet; it is cached by the browser for a day.
"""
from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any
from urllib.parse import quote

from fastapi import APIRouter, Request
from fastapi.responses import FileResponse, HTMLResponse
from pydantic import BaseModel

from api import crud
from api.dashboards import queries
from api.dashboards.routes_compare import router as compare_router
from api.deps import PageAuthDep, ReadAuthDep, SessionDep, SettingsDep
from api.errors import NotFoundError, error_responses, read_responses
from api.routes import KnownQueryDep
from api.routes.sweeps import SweepRef
from dashboards import pages

__all__ = ["router", "INDEX_PATHS", "SWEEP_PATH", "RUN_PATH", "RunState", "SweepState"]

INDEX_PATHS = ("/", "/dashboards")

SWEEP_PATH = "/dashboards/sweeps/{sweep_ref}"
RUN_PATH = "/dashboards/runs/{run_id}"
_MAX_REF = 200  # a sweep name's longest (api.schemas)
LIVE_INTERVAL_S = 5.0  # how often an unfinished sweep's or run's page polls its state

router = APIRouter(tags=["dashboards"])
router.include_router(compare_router)  # /dashboards/compare
_PAGE_RESPONSES: dict[int | str, dict[str, Any]] = {
    303: {"description": "reads require a token and no session was sent: to /login"},
    404: {"description": "unknown or malformed id (an HTML page)", "content": {"text/html": {}}},
    **error_responses(422, 503),
}


class RunState(BaseModel):
    """What a live run page polls: it refetches itself when `version` changes and stops
    polling once `finished` (a final status and no records owed)."""

    id: str
    status: str
    updated_at: str
    owed_records: int
    metrics: int
    events: int
    finished: bool
    version: str


class SweepState(BaseModel):
    """What a live sweep page polls: `version` changes when the sweep or one of its runs
    changes; `runs_active` counts runs still pending/queued/running or owing records."""

    id: str
    status: str
    updated_at: str
    runs: int
    runs_active: int
    finished: bool
    version: str


def _href(request: Request, route: str, param: str) -> Callable[[str], str]:
    return lambda ident: str(request.url_for(route, **{param: ident}).path)


def _prefect_href(settings: Any) -> Callable[[str], str] | None:
    """A flow run's page in the Prefect UI; None when `prefect_ui_url` is not configured."""
    base = settings.prefect_ui_url
    if not base:
        return None
    return lambda flow_run_id: f"{str(base).rstrip('/')}/runs/flow-run/{flow_run_id}"


def _live(request: Request, route: str, state: dict[str, Any], **params: str
          ) -> pages.Live | None:
    """Live refresh for a page whose sweep or run is unfinished (None once it is finished)."""
    if state["finished"]:
        return None
    # url_for does not percent-encode: a sweep name may hold spaces, '#' or '?'
    quoted = {key: quote(value, safe="") for key, value in params.items()}
    return pages.Live(state_url=str(request.url_for(route, **quoted).path),
                      version=state["version"], interval_s=LIVE_INTERVAL_S)


def index(session: SessionDep, request: Request) -> HTMLResponse:
    """Sweeps (name, status, progress, arms, created) and recent runs, filtered by the query
    parameters q (name contains), status, compression, strategy, p and preset; a bad filter is
    named in a banner and ignored."""
    view = queries.index_view(session, raw_filters=dict(request.query_params))
    return HTMLResponse(pages.index_page(
        view, choices=queries.INDEX_FILTERS, action=request.url.path,
        sweep_href=_href(request, "sweep_dashboard", "sweep_ref"),
        run_href=_href(request, "run_dashboard", "run_id")))


for _path in INDEX_PATHS:
    router.add_api_route(_path, index, methods=["GET"], response_class=HTMLResponse,
                         name=f"index{_path.replace('/', '_')}",
                         summary="Index of sweeps and recent runs, with search and filters "
                                 "(HTML)", dependencies=[PageAuthDep],
                         responses={k: v for k, v in _PAGE_RESPONSES.items() if k != 404})


def _not_found(kind: str, ident: str) -> HTMLResponse:
    return HTMLResponse(pages.not_found_page(kind, ident), status_code=404)


@router.get(SWEEP_PATH, response_class=HTMLResponse, name="sweep_dashboard",
            summary="Robustness overview of a sweep, by id or exact name (HTML)",
            dependencies=[PageAuthDep], responses=_PAGE_RESPONSES)
def sweep_dashboard(sweep_ref: str, session: SessionDep, settings: SettingsDep,
                    request: Request) -> HTMLResponse:
    """Curves, Table 1, token and byte panels, and the runs of a sweep (its UUID or its exact
    name: the newest sweep of that name); 404 page if unknown. Refreshes itself while running."""
    if "\x00" in sweep_ref or len(sweep_ref) > _MAX_REF:  # no sweep is named so
        return _not_found("sweep", sweep_ref[:_MAX_REF].replace("\x00", "\ufffd"))
    try:
        sweep_id = crud.resolve_sweep(session, sweep_ref).id
    except NotFoundError:
        return _not_found("sweep", sweep_ref)
    state = queries.sweep_state(session, sweep_id=sweep_id)  # before the view: no change missed
    view = queries.sweep_view(session, sweep_id=sweep_id)
    return HTMLResponse(pages.sweep_page(
        view, plotly_tag=pages.served_plotly_tag(),
        run_href=_href(request, "run_dashboard", "run_id"),
        flow_run_href=_prefect_href(settings),
        live=_live(request, "sweep_state", state, sweep_ref=sweep_ref)))


@router.get(SWEEP_PATH + "/state", response_model=SweepState, name="sweep_state",
            summary="Version of a sweep's page, polled by the live page",
            dependencies=[ReadAuthDep, KnownQueryDep], responses=read_responses(404))
def sweep_state(sweep_ref: SweepRef, session: SessionDep) -> SweepState:
    """One small query: status, run counts and a version token that changes with the page."""
    sweep_id = crud.resolve_sweep(session, sweep_ref).id
    return SweepState(**queries.sweep_state(session, sweep_id=sweep_id))


@router.get(RUN_PATH, response_class=HTMLResponse, name="run_dashboard",
            summary="Loss vs baseline, per-replica loss, fault timeline, counts, bytes, timing "
                    "and config of a run (HTML)",
            dependencies=[PageAuthDep], responses=_PAGE_RESPONSES)
def run_dashboard(run_id: str, session: SessionDep, settings: SettingsDep,
                  request: Request) -> HTMLResponse:
    """One run against its baseline; 404 page if unknown. Refreshes itself while running."""
    try:
        ident = uuid.UUID(run_id)
        state = queries.run_state(session, run_id=ident)  # before the view: no change missed
        view = queries.run_view(session, run_id=ident)
    except (ValueError, NotFoundError):
        return _not_found("run", run_id)
    return HTMLResponse(pages.run_page(
        view, plotly_tag=pages.served_plotly_tag(),
        sweep_href=_href(request, "sweep_dashboard", "sweep_ref"),
        run_href=_href(request, "run_dashboard", "run_id"),
        prefect_href=_prefect_href(settings),
        live=_live(request, "run_state", state, run_id=str(ident))))


@router.get(RUN_PATH + "/state", response_model=RunState, name="run_state",
            summary="Version of a run's page, polled by the live page",
            dependencies=[ReadAuthDep, KnownQueryDep], responses=read_responses(404))
def run_state(run_id: uuid.UUID, session: SessionDep) -> RunState:
    """One small query: status, record counts and a version token that changes with the page."""
    return RunState(**queries.run_state(session, run_id=run_id))


@router.get(pages.PLOTLY_JS_URL, include_in_schema=False, dependencies=[ReadAuthDep])
def plotly_js() -> FileResponse:
    """The installed plotly package's own plotly.min.js (no CDN)."""
    return FileResponse(pages.PLOTLY_JS_PATH, media_type="application/javascript",
                        headers={"Cache-Control": "public, max-age=86400"})

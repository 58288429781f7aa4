"""Dashboard routes: the index (at / and /dashboards), the sweep overview, a run page, and the
local copy of plotly.js.

Mounted by the registry app (`api.app` includes `router`). Pages read through
`dashboards.queries` (the registry's data-access functions) and render with `dashboards.pages`.
An unknown or malformed id answers a 404 HTML page (a browser user gets a page, not JSON).
With `reads_require_token`, a browser without a session is sent to /login (303) and comes back
after signing in (`api.routes.login`). plotly.js is served from the installed plotly package, so
pages work on a network with no internet; it is cached by the browser for a day.
"""
from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import FileResponse, HTMLResponse

from api.deps import PageAuthDep, ReadAuthDep, SessionDep
from api.errors import NotFoundError, error_responses
from dashboards import pages, queries

__all__ = ["router", "INDEX_PATHS", "SWEEP_PATH", "RUN_PATH"]

INDEX_PATHS = ("/", "/dashboards")

SWEEP_PATH = "/dashboards/sweeps/{sweep_id}"
RUN_PATH = "/dashboards/runs/{run_id}"

router = APIRouter(tags=["dashboards"])
_PAGE_RESPONSES: dict[int | str, dict[str, Any]] = {
    303: {"description": "reads require a token and no session was sent: to /login"},
    404: {"description": "unknown or malformed id (an HTML page)", "content": {"text/html": {}}},
    **error_responses(422, 503),
}


def _page(kind: str, ident: str, load: Callable[[uuid.UUID], dict[str, Any]],
          render: Callable[[dict[str, Any]], str]) -> HTMLResponse:
    """Parse the id, load the view, render it; a malformed or unknown id gets the 404 page."""
    try:
        view = load(uuid.UUID(ident))
    except (ValueError, NotFoundError):
        return HTMLResponse(pages.not_found_page(kind, ident), status_code=404)
    return HTMLResponse(render(view))


def _href(request: Request, route: str, param: str) -> Callable[[str], str]:
    return lambda ident: str(request.url_for(route, **{param: ident}).path)


def index(session: SessionDep, request: Request) -> HTMLResponse:
    """Sweeps (name, status, progress, arms, created) and recent runs, filtered by the query
    parameters q (name contains), status, compression, strategy, p and preset; a bad filter is
    named in a banner and ignored."""
    view = queries.index_view(session, raw_filters=dict(request.query_params))
    return HTMLResponse(pages.index_page(
        view, choices=queries.INDEX_FILTERS, action=request.url.path,
        sweep_href=_href(request, "sweep_dashboard", "sweep_id"),
        run_href=_href(request, "run_dashboard", "run_id")))


for _path in INDEX_PATHS:
    router.add_api_route(_path, index, methods=["GET"], response_class=HTMLResponse,
                         name=f"index{_path.replace('/', '_')}",
                         summary="Index of sweeps and recent runs, with search and filters "
                                 "(HTML)", dependencies=[PageAuthDep],
                         responses={k: v for k, v in _PAGE_RESPONSES.items() if k != 404})


@router.get(SWEEP_PATH, response_class=HTMLResponse, name="sweep_dashboard",
            summary="Robustness overview of a sweep (HTML)", dependencies=[PageAuthDep],
            responses=_PAGE_RESPONSES)
def sweep_dashboard(sweep_id: str, session: SessionDep, request: Request) -> HTMLResponse:
    """Curves, Table 1, token and byte panels, and the runs of a sweep; 404 page if unknown."""
    run_href = _href(request, "run_dashboard", "run_id")
    return _page("sweep", sweep_id, lambda ident: queries.sweep_view(session, sweep_id=ident),
                 lambda view: pages.sweep_page(view, plotly_tag=pages.served_plotly_tag(),
                                               run_href=run_href))


@router.get(RUN_PATH, response_class=HTMLResponse, name="run_dashboard",
            summary="Loss vs baseline, fault timeline and config of a run (HTML)",
            dependencies=[PageAuthDep], responses=_PAGE_RESPONSES)
def run_dashboard(run_id: str, session: SessionDep, request: Request) -> HTMLResponse:
    """One run against its baseline; 404 page if unknown."""
    run_href = _href(request, "run_dashboard", "run_id")
    sweep_href = _href(request, "sweep_dashboard", "sweep_id")
    return _page("run", run_id, lambda ident: queries.run_view(session, run_id=ident),
                 lambda view: pages.run_page(view, plotly_tag=pages.served_plotly_tag(),
                                             sweep_href=sweep_href, run_href=run_href))


@router.get(pages.PLOTLY_JS_URL, include_in_schema=False, dependencies=[ReadAuthDep])
def plotly_js() -> FileResponse:
    """The installed plotly package's own plotly.min.js (no CDN)."""
    return FileResponse(pages.PLOTLY_JS_PATH, media_type="application/javascript",
                        headers={"Cache-Control": "public, max-age=86400"})

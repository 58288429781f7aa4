"""The compare page's route: `/dashboards/compare?runs=ID,ID,...` (HTML).

Included by `api.dashboards.routes.router`. Run ids come comma-separated in one `runs` parameter
(the link the "Compare selected" button opens) or as repeated `runs` parameters (the same form
without JavaScript). Bad input never fails the page: malformed or unknown ids, more than
`MAX_COMPARE` runs and unknown parameters are named in a banner and the rest is shown. CSV and
JSON of every table and the figure are built in the browser (`dashboards.datasets`), so there is
no download endpoint.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Annotated

from fastapi import APIRouter, Query, Request
from fastapi.responses import HTMLResponse

from api.dashboards import queries
from api.deps import PageAuthDep, SessionDep
from api.errors import error_responses
from dashboards import pages
from dashboards.pages._widgets import COMPARE_PATH, MAX_COMPARE
from dashboards.pages.compare import compare_page

__all__ = ["router"]

router = APIRouter(tags=["dashboards"])


def _href(request: Request, name: str, param: str) -> Callable[[str], str]:
    """Links to the page route `name` of `api.dashboards.routes`."""
    return lambda ident: str(request.url_for(name, **{param: ident}).path)


@router.get(COMPARE_PATH, response_class=HTMLResponse, name="compare_dashboard",
            summary="Validation loss, facts and config diff of 2-12 runs (HTML)",
            dependencies=[PageAuthDep],
            responses={303: {"description": "reads require a token and no session was sent: "
                                            "to /login"}, **error_responses(422, 503)})
def compare_dashboard(
        session: SessionDep, request: Request,
        runs: Annotated[list[str] | None, Query(
            description=f"run ids, comma-separated (2 to {MAX_COMPARE})")] = None,
) -> HTMLResponse:
    """The selected runs' validation-loss curves overlaid, their facts and their config diff;
    ids that cannot be shown are named in a banner."""
    view = queries.compare_view(session, raw_ids=runs or [], max_runs=MAX_COMPARE)
    unknown = sorted(set(request.query_params) - {"runs"})
    if unknown:
        view["errors"].append(f"unknown parameter {', '.join(unknown)} (only runs is read)")
    return HTMLResponse(compare_page(
        view, plotly_tag=pages.served_plotly_tag(), run_href=_href(request, "run_dashboard", "run_id"),
        sweep_href=_href(request, "sweep_dashboard", "sweep_ref"), index_href=str(request.url_for("index_").path)))

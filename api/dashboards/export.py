"""Offline export: one self-contained HTML file of a sweep's dashboard and every run's page.

The file embeds plotly.js once (inline) and every figure's data, so it opens from disk with no
server and no internet. Its pages are sections chosen by the URL hash: the sweep page (`#sweep`,
shown first) and one page per run (`#run-<id>`, linked from the runs table; each links back).
A run page is kept in an inert `<template>` and mounted into the one visible run section when
its link is followed, so its figures are drawn in a visible box at full width (Plotly sizes a
figure when it is drawn), only one run's figures are live at a time, and the browser back button
walks the pages. Every table and figure keeps its CSV/JSON download links (built in the
browser, `dashboards.datasets`).

Size (measured on the demo-size sweep: `dashboards.sample`, 2 arms x 2 seeds = 20 runs of 20
global steps, 4 replicas, ~28 events each): 6.2 MB in all = plotly.js 4.85 MB once + the sweep
page ~80 kB + ~63 kB per run page. A run page grows with its events (drawn in the timeline and
listed for download: ~130 bytes each) and its per-replica train loss (drawn and listed: ~50
bytes a point), so the report keeps at most `REPORT_MAX_EVENTS` events (the served page:
`queries.MAX_EVENTS`) and about `REPORT_MAX_TRAIN_POINTS` train-loss points per run (every k-th
step), and a capped run's page says so: a run at both caps costs ~0.55 MB.

The file is written atomically: to a temporary file in the target folder, then renamed over the
target, so a reader never sees half a report and a failure leaves any previous report intact.
"""
from __future__ import annotations

import logging
import math
import os
import re
import uuid
from pathlib import Path
from typing import Any

from sqlalchemy.orm import Session

from api import crud
from api.dashboards import queries
from crucible.runfiles import write_text_atomic
from dashboards import pages
from dashboards.pages._common import banner, document, esc
from db.session import make_engine, make_session_factory

__all__ = ["write_report", "render_report", "REPORT_MAX_EVENTS", "REPORT_MAX_TRAIN_POINTS"]

_log = logging.getLogger(__name__)

REPORT_MAX_EVENTS = 1_000
REPORT_MAX_TRAIN_POINTS = 4_000  # all replicas together
_MAIN = re.compile(r"<main>(?P<body>.*)<footer>", re.DOTALL)

# The hash router. A run's template is cloned into #run-view with fresh <script> elements (a
# script parsed inside a <template> never runs; a created one runs when it is inserted, after
# the figure's div it draws into). Sweep figures were drawn while visible at load; they get a
# resize when the sweep is shown again, in case the window changed meanwhile.
_ROUTER_JS = """(function(){
var sweep=document.getElementById('sweep'),view=document.getElementById('run-view');
var title=document.title,shown=null,sweepY=0;
function mount(tpl){
  var frag=document.importNode(tpl.content,true);
  frag.querySelectorAll('script:not([type="application/json"])').forEach(function(old){
    var s=document.createElement('script');s.text=old.text;old.replaceWith(s);});
  view.appendChild(frag);
}
function show(){
  var id;try{id=decodeURIComponent(location.hash.slice(1));}catch(err){id='';}
  if(id.indexOf('run-')===0){
    if(shown===id)return;
    if(shown===null)sweepY=window.scrollY;
    var tpl=document.getElementById(id);
    sweep.hidden=true;view.hidden=false;view.replaceChildren();shown=id;
    if(tpl&&tpl.tagName==='TEMPLATE'){mount(tpl);document.title=tpl.dataset.title;}
    else{view.innerHTML='<div class="banner error" role="status">This run is not in this '
      +'report. <a href="#sweep">Back to the sweep</a></div>';}
    window.scrollTo(0,0);
  }else if(shown!==null||sweep.hidden){
    view.hidden=true;view.replaceChildren();shown=null;sweep.hidden=false;document.title=title;
    sweep.querySelectorAll('.js-plotly-plot').forEach(function(gd){Plotly.Plots.resize(gd);});
    window.scrollTo(0,sweepY);
  }
}
window.addEventListener('hashchange',show);show();
})();"""


def _main(page: str) -> str:
    """The content of a page made by `dashboards.pages` (inside <main>, before the footer)."""
    match = _MAIN.search(page)
    assert match is not None, "dashboards.pages.document() no longer wraps pages in <main>"
    return match.group("body")


def _run_anchor(ident: str) -> str:
    return f"#run-{ident}"


def _thin_train_loss(rows: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], int]:
    """At most about REPORT_MAX_TRAIN_POINTS train-loss rows: every k-th global step (and the
    last) of every replica; returns the rows and k."""
    if len(rows) <= REPORT_MAX_TRAIN_POINTS:
        return rows, 1
    steps = sorted({row["global_step"] for row in rows})
    stride = math.ceil(len(rows) / REPORT_MAX_TRAIN_POINTS)
    kept = set(steps[::stride]) | {steps[-1]}
    return [row for row in rows if row["global_step"] in kept], stride


def _run_section(session: Session, run_id: uuid.UUID) -> str:
    """One run's page as an inert template; events capped at REPORT_MAX_EVENTS and train loss
    thinned to about REPORT_MAX_TRAIN_POINTS points, each with a note on the page."""
    view: dict[str, Any] = queries.run_view(session, run_id=run_id)
    events = view.get("events") or []
    total = max(len(events), sum((view.get("event_counts") or {}).values()))
    notes = []
    if len(events) > REPORT_MAX_EVENTS:
        view["events"] = events[:REPORT_MAX_EVENTS]
        notes.append(f"the fault timeline and the events table show the first "
                     f"{REPORT_MAX_EVENTS:,} of this run's {total:,} events (the counts cover "
                     f"every event; the served run page shows up to {queries.MAX_EVENTS:,})")
    view["train_loss"], stride = _thin_train_loss(list(view.get("train_loss") or []))
    if stride > 1:
        notes.append(f"the training loss per replica shows every {stride}th recorded global step")
    note = (banner("warn", f"<b>Capped.</b> To keep the offline report small, {'; '.join(notes)}.")
            if notes else "")
    page = pages.run_page(view, plotly_tag="", sweep_href=lambda _sweep: "#sweep",
                          run_href=_run_anchor)
    title = f"Crucible run {run_id}"
    return (f'<template id="run-{run_id}" data-title="{esc(title)}">{note}{_main(page)}'
            "</template>")


def render_report(session: Session, sweep_ref: uuid.UUID | str) -> str:
    """The offline report of the sweep `sweep_ref` (its id or exact name) as one HTML string:
    the sweep page and every run's page, plotly.js inlined once.

    Raises `api.errors.NotFoundError` for an unknown sweep.
    """
    sweep = crud.resolve_sweep(session, str(sweep_ref))
    view = queries.sweep_view(session, sweep_id=sweep.id)
    sweep_page = pages.sweep_page(view, plotly_tag="", run_href=_run_anchor, compare_action=None)
    runs = "".join(_run_section(session, uuid.UUID(str(run["id"]))) for run in view["runs"])
    body = (f'<section id="sweep" class="report-page">{_main(sweep_page)}</section>'
            f'<section id="run-view" class="report-page" hidden></section>{runs}'
            f"<script>{_ROUTER_JS}</script>")
    return document(f"Crucible sweep {sweep.name} (report)", body, pages.inline_plotly_tag())


def write_report(sweep_ref: uuid.UUID | str, out_path: str | os.PathLike[str], *,
                 session: Session | None = None, database_url: str | None = None) -> Path:
    """Write the offline report of `sweep_ref` (a sweep's id or exact name) to `out_path`;
    return the written path.

    Reads through `session` when given, else opens `database_url` (default: the registry's
    settings, `CRUCIBLE_DATABASE_URL`). Nothing is written if the sweep does not exist
    (`api.errors.NotFoundError`).
    """
    path = Path(out_path)
    if session is not None:
        text = render_report(session, sweep_ref)
    else:
        if database_url is None:
            from api.settings import Settings  # noqa: PLC0415 - read settings only when needed
            database_url = Settings().database_url
        engine = make_engine(database_url)
        try:
            with make_session_factory(engine)() as own_session:
                text = render_report(own_session, sweep_ref)
        finally:
            engine.dispose()
    write_text_atomic(path, text)
    _log.info("wrote sweep report %s (%.1f MB)", path, len(text.encode()) / 1e6)
    return path

"""The index: the way in to sweeps and runs.

Both tables offer their rows as CSV and JSON (`dashboards.datasets`, REST field names), and the
recent runs can be ticked and compared (`dashboards.pages.compare`).
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from dashboards.datasets import export_links, run_rows
from dashboards.pages._common import (
    RunHref,
    banner,
    document,
    esc,
    fmt_num,
    fmt_pct,
    status_text,
    strategy_text,
)
from dashboards.pages._widgets import (
    COMPARE_PATH,
    compare_form,
    select_cell,
    select_header,
    tag_chips,
)
from dashboards.style import arm_label

__all__ = ["index_page"]


_FILTER_LABELS = {"q": "name contains", "status": "status", "compression": "arm",
                  "strategy": "strategy", "p": "p", "preset": "preset", "tag": "tag"}
_INPUT_SIZE = {"p": 6, "preset": 12, "tag": 14}  # characters; the form fits one line at 1280 px
# SweepPublic's names (the REST API's) plus the index's own counts; the spec stays on its page
_SWEEP_FIELDS = ("id", "name", "status", "tags", "notes", "prefect_flow_run_id", "created_at",
                 "updated_at", "runs_total", "runs_completed", "arms")


def _filter_form(filters: Mapping[str, Any], choices: Mapping[str, Sequence[str] | None],
                 action: str) -> str:
    """A plain GET form: every filter is a query parameter, so a filtered index is a link."""
    fields = []
    for key, label in _FILTER_LABELS.items():
        value = filters.get(key)
        options = choices.get(key)
        if options is None:
            shown = "" if value is None else esc(f"{value:g}" if key == "p" else value)
            control = f'<input name="{key}" value="{shown}" size="{_INPUT_SIZE.get(key, 20)}">'
        else:
            opts = "".join(f'<option value="{esc(o)}"{" selected" if o == value else ""}>'
                           f'{esc(arm_label(o) if key == "compression" else o)}</option>'
                           for o in options)
            control = f'<select name="{key}"><option value="">any</option>{opts}</select>'
        fields.append(f"<label>{label}{control}</label>")
    return (f'<form class="filters" method="get" action="{esc(action)}" role="search">'
            f'{"".join(fields)}<button type="submit">Filter</button>'
            f'<a href="{esc(action)}">clear</a></form>')


def _sweeps_table(sweeps: Sequence[Mapping[str, Any]], sweep_href: Callable[[str], str]) -> str:
    head = ("<tr><th>name</th><th>status</th><th>progress</th><th>arms</th><th>tags</th>"
            "<th>created (UTC)</th></tr>")
    rows = []
    for sweep in sweeps:
        status = esc(sweep.get("status"))
        arms = ", ".join(arm_label(a) for a in sweep.get("arms") or []) or "—"
        rows.append(
            f'<tr><td><a href="{esc(sweep_href(str(sweep["id"])))}">'
            f'{esc(sweep.get("name"))}</a></td><td class="status-{status}">{status}</td>'
            f"<td class=num>{sweep.get('runs_completed', 0)}/{sweep.get('runs_total', 0)} "
            f"completed</td><td>{esc(arms)}</td><td>{tag_chips(sweep.get('tags'))}</td>"
            f"<td class=nowrap>{_when(sweep)}</td></tr>")
    return f'<table class="data" id="sweeps">{head}{"".join(rows)}</table>'


def _when(row: Mapping[str, Any]) -> str:
    """Creation time to the minute, UTC ("2026-12-01 00:55")."""
    return esc(str(row.get("created_at", ""))[:16].replace("T", " "))


def _sweep_cell(run: Mapping[str, Any], sweep_href: Callable[[str], str]) -> str:
    sweep_id = run.get("sweep_id")
    if not sweep_id:
        return '<td class="meta">standalone</td>'
    name = run.get("sweep_name") or str(sweep_id)[:8]
    return f'<td class=nowrap><a href="{esc(sweep_href(str(sweep_id)))}">{esc(name)}</a></td>'


def _recent_runs_table(runs: Sequence[Mapping[str, Any]], run_href: RunHref,
                       sweep_href: Callable[[str], str], selectable: bool) -> str:
    head = (f"<tr>{select_header() if selectable else ''}<th>run</th><th>sweep</th><th>arm</th>"
            "<th>strategy</th><th>p</th><th>seed</th><th>preset</th><th>status</th>"
            "<th>final val loss</th><th>tags</th><th>created (UTC)</th></tr>")
    rows = []
    for run in runs:
        run_id = str(run.get("id"))
        label = run.get("name") or run_id[:8]
        status = esc(run.get("status"))
        rows.append(
            f"<tr>{select_cell(run_id, label) if selectable else ''}"
            f'<td><a href="{esc(run_href(run_id))}">{esc(label)}</a></td>'
            f"{_sweep_cell(run, sweep_href)}<td>{esc(arm_label(str(run.get('compression'))))}</td>"
            f"<td>{esc(strategy_text(run))}</td><td class=num>{fmt_pct(run.get('p'))}</td>"
            f"<td class=num>{esc(run.get('seed'))}</td><td>{esc(run.get('preset'))}</td>"
            f'<td class="status-{status}">{status_text(run)}</td>'
            f"<td class=num>{fmt_num(run.get('final_val_loss'), '.4f')}</td>"
            f"<td>{tag_chips(run.get('tags'))}</td>"
            f"<td class=nowrap>{_when(run)}</td></tr>")
    return f'<table class="data" id="recent-runs">{head}{"".join(rows)}</table>'


def index_page(view: Mapping[str, Any], *, choices: Mapping[str, Sequence[str] | None],
               action: str, sweep_href: Callable[[str], str], run_href: RunHref,
               compare_action: str | None = COMPARE_PATH) -> str:
    """The way in: a filter form, the sweeps (name, status, progress, arms, tags, created) and
    the recent runs (with their sweep and tags), each linking to its page; each table offers
    its rows as CSV and JSON.

    `view` = {"filters", "errors", "sweeps", "runs"} (`api.dashboards.queries.index_view`);
    `choices` maps each filter to its allowed values (None: free text); `action` is the form's
    target (this page); `compare_action` the compare page (None: runs cannot be selected).
    """
    sweeps, runs = list(view.get("sweeps") or []), list(view.get("runs") or [])
    parts = ["<h1>Crucible</h1>",
             '<p class="meta">Sweeps and runs in this registry, newest first. The API is at '
             '<a href="/docs"><code>/docs</code></a>.</p>',
             _filter_form(view.get("filters") or {}, choices, action)]
    parts += [banner("error", f"Filter ignored: {esc(message)}")
              for message in view.get("errors") or []]
    parts += [f"<h2>Sweeps ({len(sweeps)})</h2>",
              _sweeps_table(sweeps, sweep_href) if sweeps
              else banner("info", "No sweeps match."),
              export_links("sweeps", [{k: s.get(k) for k in _SWEEP_FIELDS} for s in sweeps],
                           label="sweeps"),
              f"<h2>Recent runs ({len(runs)})</h2>"]
    if runs:
        table = _recent_runs_table(runs, run_href, sweep_href, compare_action is not None)
        parts.append(compare_form(table, compare_action) if compare_action else table)
    else:
        parts.append(banner("info", "No runs match."))
    parts.append(export_links("recent-runs", run_rows(runs), label="recent runs"))
    return document("Crucible", "".join(parts), "")



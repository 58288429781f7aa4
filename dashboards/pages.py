"""Page assembly: plain view data -> complete HTML strings (the sweep overview, a run, a 404).

A page never fetches anything: the caller passes the view (registry query results as dicts) and
the tag that loads plotly.js, which is a `<script src>` to the API's local copy when served and
the whole library inlined once when exported, so the same function makes both. Every string that
came from a user (sweep names, config values) is HTML-escaped; figure data is JSON-escaped by
Plotly. Empty states are explicit banners, never a blank page.
"""
from __future__ import annotations

import functools
import html
import json
import math
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import plotly
import plotly.graph_objects as go

from dashboards import figures
from dashboards.style import arm_label

__all__ = ["PLOTLY_JS_PATH", "PLOTLY_JS_URL", "served_plotly_tag", "inline_plotly_tag",
           "sweep_page", "run_page", "index_page", "not_found_page", "RunHref"]

PLOTLY_JS_PATH = Path(plotly.__file__).parent / "package_data" / "plotly.min.js"
PLOTLY_JS_URL = "/dashboards/static/plotly.min.js"
RunHref = Callable[[str], str]  # run id -> link target
_DONE = frozenset({"completed", "finished"})  # the registry says "completed"

_FIGURE_CONFIG = {"displaylogo": False, "responsive": True,
                  "modeBarButtonsToRemove": ["lasso2d", "select2d"]}

_CSS = """
:root { --ink:#1f2328; --muted:#59636e; --line:#d0d7de; --accent:#0072B2; }
* { box-sizing: border-box; }
body { font-family: system-ui, -apple-system, 'Segoe UI', Roboto, Helvetica, Arial, sans-serif;
       color: var(--ink); margin: 0; background: #f6f8fa; }
main { max-width: 1240px; margin: 0 auto; padding: 20px 24px 48px; }
h1 { font-size: 24px; margin: 8px 0 4px; } h2 { font-size: 18px; margin: 28px 0 8px; }
.meta { color: var(--muted); margin: 0 0 12px; font-size: 14px; }
.meta code { font-size: 13px; }
.card { background: white; border: 1px solid var(--line); border-radius: 8px; padding: 8px;
        margin: 12px 0; }
/* Fixed tracks: a figure is laid out when its script runs, before later cards exist. */
.grid { display: grid; grid-template-columns: minmax(0, 1fr) minmax(0, 1fr); gap: 12px; }
@media (max-width: 1000px) { .grid { grid-template-columns: minmax(0, 1fr); } }
.grid .card { margin: 0; }
.banner { border-radius: 8px; padding: 10px 14px; margin: 10px 0; font-size: 15px; }
.banner.info { background: #ddf4ff; border: 1px solid #54aeff; }
.banner.warn { background: #fff8c5; border: 1px solid #d4a72c; }
.banner.error { background: #ffebe9; border: 1px solid #ff8182; }
table.data { border-collapse: collapse; width: 100%; background: white; font-size: 14px; }
table.data th, table.data td { border-bottom: 1px solid var(--line); padding: 6px 10px;
        text-align: left; }
table.data th { background: #eef2f6; position: sticky; top: 0; }
table.data#facts { max-width: 640px; }
table.data td.num { text-align: right; font-variant-numeric: tabular-nums; }
.status-completed, .status-finished { color: #1a7f37; } .status-failed { color: #cf222e; }
.status-running, .status-pending, .status-queued { color: #9a6700; }
.status-cancelled { color: #57606a; }
a { color: var(--accent); }
nav { font-size: 14px; margin-bottom: 4px; }
.config-grid { display: grid; grid-template-columns: repeat(auto-fill, minmax(360px, 1fr));
        gap: 2px 16px; background: white; border: 1px solid var(--line); border-radius: 8px;
        padding: 10px 14px; font-size: 13px; }
.config-grid div { padding: 2px 0; border-bottom: 1px solid #eef2f6; }
footer { color: var(--muted); font-size: 12px; margin-top: 32px; }
form.filters { display: flex; flex-wrap: wrap; gap: 8px 12px; align-items: end; font-size: 14px;
        background: white; border: 1px solid var(--line); border-radius: 8px; padding: 10px 14px; }
form.filters label { display: flex; flex-direction: column; gap: 2px; color: var(--muted); }
form.filters input, form.filters select { font: inherit; padding: 4px 6px; }
"""


def served_plotly_tag(url: str = PLOTLY_JS_URL) -> str:
    """The tag that loads the API's local copy of plotly.js (no CDN)."""
    return f'<script src="{html.escape(url)}" charset="utf-8"></script>'


@functools.cache
def inline_plotly_tag() -> str:
    """The whole plotly.js library inlined in one `<script>` (for the offline file; read once)."""
    return f'<script type="text/javascript">{PLOTLY_JS_PATH.read_text(encoding="utf-8")}</script>'


def _esc(value: Any) -> str:
    return html.escape("" if value is None else str(value))


def _figure_html(fig: go.Figure, div_id: str) -> str:
    height = fig.layout.height or 450
    body = fig.to_html(full_html=False, include_plotlyjs=False, div_id=div_id,
                       config=_FIGURE_CONFIG, default_height=f"{height}px")
    return f'<section class="card figure" data-figure="{div_id}">{body}</section>'


def _document(title: str, body: str, plotly_tag: str) -> str:
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
            f'<meta name="viewport" content="width=device-width, initial-scale=1">'
            f'<link rel="icon" href="data:,">'
            f'<title>{_esc(title)}</title><style>{_CSS}</style>{plotly_tag}</head>'
            f'<body><main>{body}<footer>Crucible robustness dashboard</footer></main></body></html>')


def _banner(kind: str, text: str) -> str:
    return f'<div class="banner {kind}" role="status">{text}</div>'


def _owed(run: Mapping[str, Any]) -> int:
    """Records the run's reporter still holds (the registry has not got them): such a run is
    incomplete whatever its status says."""
    owed = run.get("owed_records")
    return owed if isinstance(owed, int) and owed > 0 else 0


def _finished(run: Mapping[str, Any]) -> bool:
    return run.get("status") in _DONE and not _owed(run)


def _status_text(run: Mapping[str, Any]) -> str:
    owed = _owed(run)
    status = _esc(run.get("status"))
    return f"{status} · owes {owed:,} records" if owed else status


def _pct(value: Any) -> str:
    return f"{100.0 * value:g}%" if isinstance(value, (int, float)) else "—"


def _num(value: Any, spec: str) -> str:
    if isinstance(value, (int, float)) and math.isfinite(value):
        return format(value, spec)
    return "—"


# --- sweep page -------------------------------------------------------------------------------

def _sweep_banners(sweep: Mapping[str, Any], robustness: Mapping[str, Any],
                   runs: Sequence[Mapping[str, Any]]) -> list[str]:
    banners = []
    finished = sum(1 for r in runs if _finished(r))
    pending = int(robustness.get("pending_runs") or 0)
    running = sweep.get("status") in {"pending", "running"} or (
        pending > 0 and sweep.get("status") not in {"cancelled", "failed"})
    if not runs:
        banners.append(_banner("info", "This sweep has no runs yet. The page fills in as runs "
                                       "finish; reload to see progress."))
    elif running:
        banners.append(_banner("info", f"This sweep is still running: <b>{finished} of "
                                       f"{len(runs)}</b> runs finished. The figures show what "
                                       "is done so far; reload to see progress."))
    owing = [r for r in runs if _owed(r)]
    if owing:
        banners.append(_banner("warn", f"{len(owing)} run(s) still owe records to the registry "
                                       f"({sum(_owed(r) for r in owing):,} in all: their "
                                       "reporter could not deliver them yet). They count as "
                                       "unfinished and are left out of the numbers until the "
                                       "records arrive (<code>crucible api replay</code>)."))
    failed = [r for r in runs if r.get("status") == "failed"]
    if failed:
        banners.append(_banner("error", f"{len(failed)} run(s) failed and are left out of the "
                                        "numbers; see the runs table below."))
    cancelled = [r for r in runs if r.get("status") == "cancelled"]
    if sweep.get("status") == "cancelled" or cancelled:
        banners.append(_banner("warn", f"<b>Cancelled.</b> This sweep was cancelled; "
                                       f"{len(cancelled)} run(s) did not finish and are left out "
                                       "of the numbers."))
    missing = robustness.get("missing_baselines") or []
    if missing:
        items = ", ".join(f"{_esc(arm_label(str(m.get('compression'))))} seed {_esc(m.get('seed'))}"
                          f" (duration {_esc(m.get('duration'))})" for m in missing)
        banners.append(_banner("warn", "<b>Missing baseline.</b> No finished no-failure run "
                                       f"(p = 0) for: {items}. Runs of those arms and seeds "
                                       "cannot be compared and are left out of the curves and "
                                       "the table."))
    return banners


def _relative(run: Mapping[str, Any], finals: Mapping[str, float]) -> str:
    base = finals.get(str(run.get("baseline_run_id")))
    final = run.get("final_val_loss")
    if base and isinstance(final, (int, float)):
        return f"{100.0 * (final - base) / base:+.2f}%"
    return "—"


def _strategy_text(run: Mapping[str, Any]) -> str:
    """A run's strategy; a baseline (strategy None in the registry) has none of its own."""
    return str(run.get("strategy") or figures.BASELINE_LABEL)


def _runs_table(runs: Sequence[Mapping[str, Any]], run_href: RunHref | None) -> str:
    finals = {str(r["id"]): r["final_val_loss"] for r in runs
              if isinstance(r.get("final_val_loss"), (int, float))}
    ordered = sorted(runs, key=lambda r: (str(r.get("compression")), r.get("strategy") or "",
                                          r.get("p") or 0, r.get("seed") or 0))
    head = ("<tr><th>arm</th><th>strategy</th><th>p</th><th>seed</th><th>status</th>"
            "<th>final val loss</th><th>vs baseline</th><th>tokens (% of budget)</th>"
            "<th>run</th></tr>")
    rows = []
    for run in ordered:
        budget, done = run.get("tokens_budget"), run.get("tokens_processed")
        share = _num(100.0 * done / budget, ".1f") if budget and done is not None else "—"
        run_id = str(run.get("id"))
        link = (f'<a href="{_esc(run_href(run_id))}">{_esc(run_id[:8])}</a>' if run_href
                else f"<code>{_esc(run_id[:8])}</code>")
        status = "running" if _owed(run) else _esc(run.get("status"))
        rows.append(
            f"<tr><td>{_esc(arm_label(str(run.get('compression'))))}</td>"
            f"<td>{_esc(_strategy_text(run))}</td><td class=num>{_pct(run.get('p'))}</td>"
            f"<td class=num>{_esc(run.get('seed'))}</td>"
            f'<td class="status-{status}">{_status_text(run)}</td>'
            f"<td class=num>{_num(run.get('final_val_loss'), '.4f')}</td>"
            f"<td class=num>{_relative(run, finals)}</td><td class=num>{share}</td>"
            f"<td>{link}</td></tr>")
    return f'<table class="data" id="runs">{head}{"".join(rows)}</table>'


def sweep_page(view: Mapping[str, Any], *, plotly_tag: str,
               run_href: RunHref | None = None) -> str:
    """The sweep overview: status banners, robustness curves, Table 1, tokens, bytes, runs.

    `view` = {"sweep": {id, name, status, ...}, "robustness": ..., "table": ..., "runs": [...]}
    in the registry's shapes. `run_href` maps a run id to its page (None: no links, as in the
    offline file). Always returns a full page, whatever is missing.
    """
    sweep, runs = view.get("sweep") or {}, list(view.get("runs") or [])
    robustness = view.get("robustness") or {}
    name = sweep.get("name") or sweep.get("id")
    finished = sum(1 for r in runs if _finished(r))
    parts = [
        f"<h1>Sweep: {_esc(name)}</h1>",
        f'<p class="meta">id <code>{_esc(sweep.get("id"))}</code> · status '
        f'<b>{_esc(sweep.get("status"))}</b> · {finished} of {len(runs)} runs finished</p>',
        *_sweep_banners(sweep, robustness, runs),
        _figure_html(figures.robustness_curves(robustness), "fig-robustness"),
        _figure_html(figures.robustness_table(view.get("table") or {}), "fig-table"),
        '<div class="grid">',
        _figure_html(figures.token_accounting(runs), "fig-tokens"),
        _figure_html(figures.bytes_sent(runs), "fig-bytes"),
        "</div>",
        f"<h2>Runs ({len(runs)})</h2>",
        _runs_table(runs, run_href) if runs else "<p>No runs yet.</p>",
    ]
    return _document(f"Crucible sweep {name}", "".join(parts), plotly_tag)


# --- run page ---------------------------------------------------------------------------------

def _flatten(config: Mapping[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = []
    for key, value in config.items():
        path = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.extend(_flatten(value, path + "."))
        else:
            out.append((path, value))
    return out


def _config_table(config: Mapping[str, Any]) -> str:
    """Every resolved config key, sorted so a component's keys sit together, in a dense grid
    (about 60 keys: a one-column table would be a long scroll)."""
    cells = "".join(f"<div><code>{_esc(k)}</code> = <code>{_esc(json.dumps(v))}</code></div>"
                    for k, v in sorted(_flatten(config)))
    return (f'<div class="config-grid" id="config">{cells}</div>' if cells
            else "<p>No config recorded.</p>")


def _run_title(run: Mapping[str, Any]) -> str:
    return (f"{arm_label(str(run.get('compression')))} · {_strategy_text(run)}, "
            f"p = {_pct(run.get('p'))}, seed {run.get('seed')}")


def _loss_series(view: Mapping[str, Any]) -> list[dict[str, Any]]:
    run, baseline = view["run"], view.get("baseline")
    series = [{"name": f"this run ({_run_title(run)})", "compression": run.get("compression"),
               "strategy": run.get("strategy"),
               "points": figures.val_loss_points(metrics=view.get("metrics"),
                                                 summary=run.get("summary"))}]
    if baseline and baseline.get("id") != run.get("id"):
        series.append({"name": f"baseline ({arm_label(str(baseline.get('compression')))}, p = 0,"
                               f" seed {baseline.get('seed')})", "baseline": True,
                       "points": figures.val_loss_points(metrics=view.get("baseline_metrics"),
                                                         summary=baseline.get("summary"))})
    return series


def _run_facts(run: Mapping[str, Any], baseline: Mapping[str, Any] | None) -> str:
    base_final = (baseline or {}).get("final_val_loss")
    final = run.get("final_val_loss")
    rel = (f"{100.0 * (final - base_final) / base_final:+.2f}%"
           if isinstance(final, (int, float)) and base_final else "—")
    budget, done = run.get("tokens_budget"), run.get("tokens_processed")
    facts = [("status", _status_text(run)),
             ("initial val loss", _num(run.get("initial_val_loss"), ".4f")),
             ("final val loss", _num(final, ".4f")),
             ("baseline final val loss", _num(base_final, ".4f")),
             ("increase vs baseline", rel),
             ("tokens processed / budget", f"{_num(done, ',.0f')} / {_num(budget, ',.0f')}"),
             ("failure duration", f"{_esc(run.get('duration'))} global steps"),
             ("preset", _esc(run.get("preset")))]
    rows = "".join(f"<tr><th>{k}</th><td>{v}</td></tr>" for k, v in facts)
    return f'<table class="data" id="facts">{rows}</table>'


def run_page(view: Mapping[str, Any], *, plotly_tag: str,
             sweep_href: Callable[[str], str] | None = None,
             run_href: RunHref | None = None) -> str:
    """One run: its facts, validation loss against its baseline, fault timeline and config.

    `view` = {"run": run dict, "metrics": rows, "events": rows, "baseline": run dict | None,
    "baseline_metrics": rows}. A run without a baseline or without failures says so.
    """
    run, baseline = view["run"], view.get("baseline")
    config = run.get("config") or {}
    summary = run.get("summary") or {}
    nav = ""
    if sweep_href and run.get("sweep_id"):
        nav = f'<nav><a href="{_esc(sweep_href(str(run["sweep_id"])))}">&larr; sweep</a></nav>'
    parts = [nav, f"<h1>Run: {_esc(_run_title(run))}</h1>",
             f'<p class="meta">id <code>{_esc(run.get("id"))}</code></p>']
    if _owed(run):
        parts.append(_banner("warn", f"<b>Incomplete.</b> This run owes {_owed(run):,} records "
                                     "to the registry: its reporter could not deliver them yet "
                                     "(they wait in its spool). The figures miss them, and the "
                                     "run is not counted as finished until they arrive "
                                     "(<code>crucible api replay</code>)."))
    elif run.get("status") in {"pending", "queued", "running"}:
        parts.append(_banner("info", "This run is still in progress; figures show what has been "
                                     "recorded so far."))
    if baseline is None and (run.get("p") or 0) > 0:
        parts.append(_banner("warn", "<b>Missing baseline.</b> No finished no-failure run (p = 0) "
                                     "of this arm and seed; the loss is shown alone."))
    elif baseline is not None and run_href and baseline.get("id") != run.get("id"):
        parts.append(f'<p class="meta">baseline run: <a href="{_esc(run_href(str(baseline["id"])))}'
                     f'">{_esc(str(baseline["id"])[:8])}</a></p>')
    timeline = figures.fault_timeline(
        faults=summary.get("faults") or [], events=view.get("events") or [],
        strategy=str(run.get("strategy") or (config.get("faults") or {}).get("strategy")),
        replicas=config.get("replicas"),
        global_steps=(config.get("train") or {}).get("global_steps"))
    parts += [_run_facts(run, baseline),
              _figure_html(figures.loss_curves(_loss_series(view)), "fig-loss"),
              _figure_html(timeline, "fig-faults"),
              "<h2>Resolved config</h2>", _config_table(config)]
    return _document(f"Crucible run {run.get('id')}", "".join(parts), plotly_tag)


# --- index -------------------------------------------------------------------------------------

_FILTER_LABELS = {"q": "name contains", "status": "status", "compression": "arm",
                  "strategy": "strategy", "p": "p", "preset": "preset"}


def _filter_form(filters: Mapping[str, Any], choices: Mapping[str, Sequence[str] | None],
                 action: str) -> str:
    """A plain GET form: every filter is a query parameter, so a filtered index is a link."""
    fields = []
    for key, label in _FILTER_LABELS.items():
        value = filters.get(key)
        options = choices.get(key)
        if options is None:
            shown = "" if value is None else _esc(f"{value:g}" if key == "p" else value)
            control = f'<input name="{key}" value="{shown}">'
        else:
            opts = "".join(f'<option value="{_esc(o)}"{" selected" if o == value else ""}>'
                           f'{_esc(arm_label(o) if key == "compression" else o)}</option>'
                           for o in options)
            control = f'<select name="{key}"><option value="">any</option>{opts}</select>'
        fields.append(f"<label>{label}{control}</label>")
    return (f'<form class="filters" method="get" action="{_esc(action)}" role="search">'
            f'{"".join(fields)}<button type="submit">Filter</button>'
            f'<a href="{_esc(action)}">clear</a></form>')


def _sweeps_table(sweeps: Sequence[Mapping[str, Any]], sweep_href: Callable[[str], str]) -> str:
    head = ("<tr><th>name</th><th>status</th><th>progress</th><th>arms</th><th>created</th>"
            "</tr>")
    rows = []
    for sweep in sweeps:
        status = _esc(sweep.get("status"))
        arms = ", ".join(arm_label(a) for a in sweep.get("arms") or []) or "—"
        rows.append(
            f'<tr><td><a href="{_esc(sweep_href(str(sweep["id"])))}">'
            f'{_esc(sweep.get("name"))}</a></td><td class="status-{status}">{status}</td>'
            f"<td class=num>{sweep.get('runs_completed', 0)}/{sweep.get('runs_total', 0)} "
            f"completed</td><td>{_esc(arms)}</td>"
            f"<td>{_esc(str(sweep.get('created_at', ''))[:19].replace('T', ' '))}</td></tr>")
    return f'<table class="data" id="sweeps">{head}{"".join(rows)}</table>'


def _recent_runs_table(runs: Sequence[Mapping[str, Any]], run_href: RunHref) -> str:
    head = ("<tr><th>run</th><th>arm</th><th>strategy</th><th>p</th><th>seed</th>"
            "<th>preset</th><th>status</th><th>final val loss</th><th>created</th></tr>")
    rows = []
    for run in runs:
        run_id = str(run.get("id"))
        status = _esc(run.get("status"))
        rows.append(
            f'<tr><td><a href="{_esc(run_href(run_id))}">{_esc(run.get("name") or run_id[:8])}'
            f"</a></td><td>{_esc(arm_label(str(run.get('compression'))))}</td>"
            f"<td>{_esc(_strategy_text(run))}</td><td class=num>{_pct(run.get('p'))}</td>"
            f"<td class=num>{_esc(run.get('seed'))}</td><td>{_esc(run.get('preset'))}</td>"
            f'<td class="status-{status}">{_status_text(run)}</td>'
            f"<td class=num>{_num(run.get('final_val_loss'), '.4f')}</td>"
            f"<td>{_esc(str(run.get('created_at', ''))[:19].replace('T', ' '))}</td></tr>")
    return f'<table class="data" id="recent-runs">{head}{"".join(rows)}</table>'


def index_page(view: Mapping[str, Any], *, choices: Mapping[str, Sequence[str] | None],
               action: str, sweep_href: Callable[[str], str], run_href: RunHref) -> str:
    """The way in: a filter form, the sweeps (name, status, progress, arms, created) and the
    recent runs, each linking to its page.

    `view` = {"filters", "errors", "sweeps", "runs"} (`dashboards.queries.index_view`);
    `choices` maps each filter to its allowed values (None: free text); `action` is the form's
    target (this page).
    """
    sweeps, runs = list(view.get("sweeps") or []), list(view.get("runs") or [])
    parts = ["<h1>Crucible</h1>",
             '<p class="meta">Sweeps and runs in this registry, newest first. The API is at '
             '<a href="/docs"><code>/docs</code></a>.</p>',
             _filter_form(view.get("filters") or {}, choices, action)]
    parts += [_banner("error", f"Filter ignored: {_esc(message)}")
              for message in view.get("errors") or []]
    parts += [f"<h2>Sweeps ({len(sweeps)})</h2>",
              _sweeps_table(sweeps, sweep_href) if sweeps
              else _banner("info", "No sweeps match."),
              f"<h2>Recent runs ({len(runs)})</h2>",
              _recent_runs_table(runs, run_href) if runs
              else _banner("info", "No runs match.")]
    return _document("Crucible", "".join(parts), "")


def not_found_page(kind: str, ident: str) -> str:
    """A plain 404 page naming what was not found (no plotly needed)."""
    body = (f"<h1>{_esc(kind.capitalize())} not found</h1>"
            + _banner("error", f"There is no {_esc(kind)} with id <code>{_esc(ident)}</code>. "
                               "Check the id in the link, or list sweeps at "
                               "<code>/api/v1/sweeps</code>."))
    return _document(f"{kind} not found", body, "")

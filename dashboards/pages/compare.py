"""The compare page: 2..12 runs side by side (`/dashboards/compare?runs=ID,ID,...`).

Three views of the selected runs: their validation-loss curves overlaid (x = tokens, or global
step through the figure's toggle), a table of each run's facts, and a config diff that lists
only the flattened keys whose values differ, one column per run, and says how many equal keys it
hides. Every table and the figure offer their data as CSV and JSON. Runs that could not be
shown (malformed or unknown ids, too many) are named in a banner; the page never fails on them.
"""
from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import plotly.graph_objects as go

from dashboards import figures
from dashboards.datasets import export_links, run_rows
from dashboards.pages._common import (
    RunHref,
    banner,
    document,
    esc,
    figure_html,
    flatten_config,
    fmt_num,
    fmt_pct,
    status_text,
    strategy_text,
)
from dashboards.pages._widgets import MIN_COMPARE, tag_chips
from dashboards.style import OKABE_ITO, arm_label, base_layout, empty_figure

__all__ = ["compare_page"]

_DASHES = ("solid", "dash", "dot", "dashdot")
_MISSING = object()  # a key a run's config does not have


def run_label(run: Mapping[str, Any]) -> str:
    """A short, unique name for a run in legends and column heads."""
    head = run.get("name") or str(run.get("id"))[:8]
    return (f"{head} · {arm_label(str(run.get('compression')))} · {strategy_text(run)} · "
            f"p {fmt_pct(run.get('p'))} · seed {run.get('seed')}")


def _style(index: int) -> dict[str, str]:
    return {"color": OKABE_ITO[index % len(OKABE_ITO)],
            "dash": _DASHES[(index // len(OKABE_ITO)) % len(_DASHES)]}


def _points(run: Mapping[str, Any], metrics: Sequence[Mapping[str, Any]]
            ) -> list[dict[str, Any]]:
    """The run's val_loss points {global_step, tokens, value} by step (summary evals, which
    have no step, when no metric rows were recorded)."""
    rows = [m for m in metrics if m.get("name") == "val_loss" and m.get("replica") is None]
    if rows:
        return sorted(({"global_step": m.get("global_step"), "tokens": m.get("tokens"),
                        "value": m.get("value")} for m in rows),
                      key=lambda pt: pt["global_step"])
    return [{"global_step": None, "tokens": t, "value": v}
            for t, v in figures.val_loss_points(summary=run.get("summary"))]


def _loss_figure(runs: Sequence[Mapping[str, Any]],
                 points: Mapping[str, list[dict[str, Any]]]) -> go.Figure:
    title = "Validation loss of the selected runs"
    fig = go.Figure()
    by_step: list[list[Any]] = []
    for index, run in enumerate(runs):
        pts = points.get(str(run["id"])) or []
        if not pts:
            continue
        fig.add_trace(go.Scatter(
            x=[pt["tokens"] for pt in pts], y=[pt["value"] for pt in pts], name=run_label(run),
            mode="lines+markers", line={**_style(index), "width": 2.5}, marker={"size": 5},
            hovertemplate="%{x:,.0f}<br>val loss %{y:.4f}<extra>" + esc(run_label(run))
                          + "</extra>"))
        by_step.append([pt["global_step"] for pt in pts])
    if not fig.data:
        return empty_figure(title=title, message="None of these runs recorded a validation loss.")
    base_layout(fig, title=title, x_title="Tokens processed",
                y_title="Validation loss (nats / token)", height=480)
    by_tokens = [list(trace.x) for trace in fig.data]
    fig.update_layout(
        legend={"orientation": "h", "x": 0, "xanchor": "left", "y": 0, "yanchor": "bottom",
                "yref": "container"}, margin={"b": 60 + 22 * len(fig.data)},
        height=480 + 22 * len(fig.data),
        updatemenus=[{"type": "buttons", "direction": "right", "x": 1, "xanchor": "right",
                      "y": 1.0, "yanchor": "bottom", "pad": {"b": 4}, "showactive": True, "buttons": [
                          {"label": "x: tokens", "method": "update",
                           "args": [{"x": by_tokens}, {"xaxis.title.text": "Tokens processed"}]},
                          {"label": "x: global step", "method": "update",
                           "args": [{"x": by_step}, {"xaxis.title.text": "Global step"}]}]}])
    fig.update_xaxes(tickformat="~s")
    return fig


def _facts_table(runs: Sequence[Mapping[str, Any]], run_href: RunHref,
                 sweep_href: Callable[[str], str]) -> str:
    head = ("<tr><th></th><th>run</th><th>sweep</th><th>arm</th><th>strategy</th><th>p</th>"
            "<th>seed</th><th>status</th><th>final val loss</th><th>tokens</th><th>tags</th>"
            "</tr>")
    rows = []
    for index, run in enumerate(runs):
        run_id, sweep_id = str(run["id"]), run.get("sweep_id")
        sweep = (f'<a href="{esc(sweep_href(str(sweep_id)))}">'
                 f'{esc(run.get("sweep_name") or str(sweep_id)[:8])}</a>' if sweep_id else "—")
        status = esc(run.get("status"))
        rows.append(
            f'<tr><td><span class="swatch" style="background:{_style(index)["color"]}">'
            f'</span></td><td><a href="{esc(run_href(run_id))}">'
            f'{esc(run.get("name") or run_id[:8])}</a></td><td>{sweep}</td>'
            f"<td>{esc(arm_label(str(run.get('compression'))))}</td>"
            f"<td>{esc(strategy_text(run))}</td><td class=num>{fmt_pct(run.get('p'))}</td>"
            f"<td class=num>{esc(run.get('seed'))}</td>"
            f'<td class="status-{status}">{status_text(run)}</td>'
            f"<td class=num>{fmt_num(run.get('final_val_loss'), '.4f')}</td>"
            f"<td class=num>{fmt_num(run.get('tokens_processed'), ',.0f')}</td>"
            f"<td>{tag_chips(run.get('tags'))}</td></tr>")
    return f'<table class="data" id="compare-runs">{head}{"".join(rows)}</table>'


def config_diff(runs: Sequence[Mapping[str, Any]]) -> tuple[list[dict[str, Any]], int]:
    """The flattened config keys whose values differ between `runs` (a key one run lacks
    differs), as rows {"key", <run id>: value (None where absent)}, sorted by key; and the
    number of keys equal in every run."""
    flat = [dict(flatten_config(run.get("config") or {})) for run in runs]
    keys = sorted(set().union(*flat)) if flat else []
    rows, equal = [], 0
    for key in keys:
        values = [f.get(key, _MISSING) for f in flat]
        if all(v is not _MISSING for v in values) and all(
                json.dumps(v, sort_keys=True) == json.dumps(values[0], sort_keys=True)
                for v in values):
            equal += 1
            continue
        rows.append({"key": key, **{str(run["id"]): None if v is _MISSING else v
                                    for run, v in zip(runs, values, strict=True)}})
    return rows, equal


def _diff_table(runs: Sequence[Mapping[str, Any]], rows: Sequence[Mapping[str, Any]],
                equal: int) -> str:
    note = (f'<p class="meta" id="config-diff-note">{len(rows)} config key(s) differ; '
            f"{equal} key(s) are equal in every run and hidden.</p>")
    if not rows:
        return note
    head = "".join(f"<th>{esc(run_label(run))}</th>" for run in runs)
    flat = [dict(flatten_config(run.get("config") or {})) for run in runs]
    body = []
    for row in rows:
        # a key a run lacks is "absent"; a key set to null is shown as null
        cells = "".join(
            f"<td><code>{esc(json.dumps(row[str(run['id'])]))}</code></td>"
            if row["key"] in keys else '<td class="meta">absent</td>'
            for run, keys in zip(runs, flat, strict=True))
        body.append(f"<tr><th><code>{esc(row['key'])}</code></th>{cells}</tr>")
    return (f'{note}<div class="scroll-x"><table class="data" id="config-diff"><tr><th>key</th>'
            f'{head}</tr>{"".join(body)}</table></div>')


def compare_page(view: Mapping[str, Any], *, plotly_tag: str, run_href: RunHref,
                 sweep_href: Callable[[str], str], index_href: str = "/") -> str:
    """The selected runs side by side: loss curves, facts, config diff.

    `view` = {"runs": run dicts in the order asked, "metrics": {run id: val_loss rows},
    "errors": [messages]} (`api.dashboards.queries.compare_view`). Fewer than two runs still give
    a page, with a banner saying how to pick them.
    """
    runs = list(view.get("runs") or [])
    metrics = view.get("metrics") or {}
    parts = [f'<nav><a href="{esc(index_href)}">&larr; index</a></nav>',
             f"<h1>Compare {len(runs)} runs</h1>"]
    parts += [banner("error", f"Left out: {esc(message)}") for message in view.get("errors") or []]
    if len(runs) < MIN_COMPARE:
        parts.append(banner("info", "Pick at least two runs to compare: tick them in the "
                                    f'<a href="{esc(index_href)}">index</a>\'s recent runs or a '
                                    "sweep's runs table, then press <b>Compare selected</b>."))
    if not runs:
        return document("Crucible compare", "".join(parts), "")
    points = {str(run["id"]): _points(run, metrics.get(str(run["id"])) or []) for run in runs}
    curve_rows = [{"run_id": run_id, "name": "val_loss", **pt}
                  for run_id, pts in points.items() for pt in pts]
    diff_rows, equal = config_diff(runs)
    parts += [
        figure_html(_loss_figure(runs, points), "fig-compare",
                    extra=export_links("compare-val-loss", curve_rows, label="validation loss")),
        "<h2>Runs</h2>", _facts_table(runs, run_href, sweep_href),
        export_links("compare-runs", run_rows(runs), label="runs"),
        "<h2>Config diff</h2>", _diff_table(runs, diff_rows, equal),
        export_links("compare-config-diff", diff_rows, label="config diff"),
    ]
    return document(f"Crucible compare {len(runs)} runs", "".join(parts), plotly_tag)

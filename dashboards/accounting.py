"""The sweep page's token accounting and bytes sent: what failures cost in tokens and traffic.

Pure functions from plain query results (dicts and lists shaped like the registry's JSON, never
ORM objects) to Plotly figures, as `dashboards.figures`'s: tests build their input by hand, the
offline export and the served pages draw the same figures, sparse data yields a figure that says
what is missing instead of an error, and non-finite numbers are dropped before plotting.

`token_accounting` plots tokens processed against the budget per arm x strategy and failure
rate; `bytes_sent` the megabytes each arm sends, by counter (`BYTE_KINDS`). Runs that still owe
records are left out of both (not finished data points yet).
"""
from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import Any

import plotly.graph_objects as go

from dashboards.style import (
    BASELINE_LABEL,
    P_AXIS_TITLE,
    STRATEGY_DASH,
    STRATEGY_SYMBOL,
    arm_color,
    arm_label,
    base_layout,
    empty_figure,
    finite,
    group_order,
    legend_below,
    series_name,
)

__all__ = ["token_accounting", "bytes_sent", "BYTE_KINDS"]

BYTE_KINDS: tuple[tuple[str, str], ...] = (
    ("boundary_forward", "boundary, forward"),
    ("boundary_backward", "boundary, backward"),
    ("upload", "upload (SparseLoCo)"),
    ("dense_upload_equivalent", "dense upload equivalent"),
)


def _token_share(runs: Sequence[Mapping[str, Any]]) -> dict[tuple[str, str], dict[float, list[float]]]:
    """(arm, strategy) -> p% -> [processed / budget in %]; baselines join every strategy of their arm."""
    shares: dict[tuple[str, str], dict[float, list[float]]] = defaultdict(lambda: defaultdict(list))
    baselines: dict[str, dict[float, list[float]]] = defaultdict(lambda: defaultdict(list))
    for run in runs:
        budget, done, p = run.get("tokens_budget"), run.get("tokens_processed"), run.get("p")
        if run.get("owed_records"):    # records still owed: not a finished data point yet
            continue
        if not (finite(budget) and budget > 0 and finite(done) and finite(p)):
            continue
        share = 100.0 * done / budget
        if p == 0:
            baselines[str(run.get("compression"))][0.0].append(share)
        else:
            shares[(str(run.get("compression")), str(run.get("strategy")))][100.0 * p].append(share)
    for (arm, _strategy), by_p in shares.items():
        for p, values in baselines.get(arm, {}).items():
            by_p[p].extend(values)
    for arm, by_p in baselines.items():  # an arm with only baselines still shows them, as
        if not any(key[0] == arm for key in shares):  # what they are (no strategy of their own)
            shares[(arm, BASELINE_LABEL)].update(by_p)
    return shares


def token_accounting(runs: Sequence[Mapping[str, Any]]) -> go.Figure:
    """Tokens processed as a share of the token budget vs failure rate, per arm x strategy.

    Input: run dicts (compression, strategy, p, tokens_budget, tokens_processed); unfinished runs
    (no tokens, or records still owed) are left out. Mean over seeds; 100% = the no-failure budget.
    """
    title = "Token accounting: tokens processed vs budget"
    shares = _token_share(runs)
    if not shares:
        return empty_figure(title=title, message="No finished runs with token counts yet.")
    fig = go.Figure()
    for key in sorted(shares, key=group_order):
        arm, strategy = key
        name, by_p = series_name(arm, strategy), shares[key]
        xs = sorted(by_p)
        fig.add_trace(go.Scatter(
            x=xs, y=[sum(by_p[x]) / len(by_p[x]) for x in xs], mode="lines+markers", name=name,
            line={"color": arm_color(arm), "dash": STRATEGY_DASH.get(strategy, "solid")},
            marker={"symbol": STRATEGY_SYMBOL.get(strategy, "x"), "size": 8},
            hovertemplate=f"<b>{name}</b><br>p = %{{x:.1f}}%<br>%{{y:.1f}}% of budget<extra></extra>",
        ))
    base_layout(fig, title=title, x_title=P_AXIS_TITLE, y_title="Tokens processed (% of budget)",
                height=400)
    legend_below(fig)
    fig.add_hline(y=100, line={"color": "#999", "dash": "dot", "width": 1})
    fig.update_xaxes(ticksuffix="%", rangemode="tozero")
    fig.update_yaxes(ticksuffix="%")
    return fig


def bytes_sent(runs: Sequence[Mapping[str, Any]]) -> go.Figure:
    """Mean megabytes sent per run and arm: boundary forward/backward, upload, dense equivalent.

    Input: run dicts whose `summary.bytes` holds the byte counters. Log axis, because the
    compressed and dense volumes differ by orders of magnitude; zero counters are not drawn.
    """
    title = "Communication: megabytes sent per run, by compression arm"
    totals: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for run in runs:
        if run.get("owed_records"):    # records still owed: not a finished data point yet
            continue
        counters = (run.get("summary") or {}).get("bytes") or {}
        for kind, _label in BYTE_KINDS:
            if finite(counters.get(kind)):
                totals[str(run.get("compression"))][kind].append(counters[kind] / 1e6)
    if not totals:
        return empty_figure(title=title, message="No finished runs with byte counters yet.")
    arms = sorted(totals, key=lambda arm: group_order((arm, "")))
    fig = go.Figure()
    colors = ("#0072B2", "#56B4E9", "#D55E00", "#999999")
    for (kind, label), color in zip(BYTE_KINDS, colors, strict=True):
        means = [sum(totals[a][kind]) / len(totals[a][kind]) if totals[a][kind] else None
                 for a in arms]
        shown = [m if m is not None and m > 0 else None for m in means]
        if all(m is None for m in shown):
            continue
        fig.add_trace(go.Bar(
            y=[arm_label(a) for a in arms], x=shown, name=label, orientation="h",
            marker={"color": color}, text=[f"{m:.3g} MB" if m else "" for m in shown],
            textposition="outside", cliponaxis=False,
            hovertemplate=f"{label}<br>%{{y}}: %{{x:.4g}} MB<extra></extra>",
        ))
    base_layout(fig, title=title, x_title="MB per run (log scale)", y_title="Compression arm",
                height=max(400, 160 + 90 * len(arms)))
    # Horizontal bars keep the value labels apart; arms read top-down in the usual order.
    fig.update_layout(barmode="group")
    legend_below(fig)
    shown_all = [v for trace in fig.data for v in trace.x if v]
    # log-axis range in decades, padded right so the outside value labels are not clipped
    fig.update_xaxes(type="log", dtick=1, range=[math.log10(min(shown_all)) - 0.3,
                                                math.log10(max(shown_all)) + 0.6])
    fig.update_yaxes(autorange="reversed")
    return fig

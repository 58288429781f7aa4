"""Figure builders: pure functions from the registry's plain query results to Plotly figures.

Every builder takes dicts and lists shaped like the registry's JSON (robustness summary, table,
runs, metric and event rows), never ORM objects, so tests build their input by hand and the
offline export and the served pages draw the same figures. Builders never raise on sparse data:
a sweep still running or an arm without a baseline yields a figure that says what is missing.
Non-finite numbers are dropped before plotting (a NaN would silently break a curve).

This module holds the sweep's robustness curves and Table-1 view, the validation-loss curves and
the training loss per replica; the run's fault timeline is `dashboards.timeline`'s, the sweep's
token accounting and bytes sent `dashboards.accounting`'s, and what they all share (palette,
layout, ordering, the legend under the plot) `dashboards.style`'s.
"""
from __future__ import annotations

import itertools
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import plotly.graph_objects as go

from dashboards.style import (
    OKABE_ITO,
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
    rgba,
    series_name,
)

__all__ = ["robustness_curves", "robustness_table", "loss_curves", "val_loss_points",
           "train_loss_per_replica"]


def _fmt_pct(value: float | None) -> str:
    return "n/a" if value is None else f"{value:+.2f}%"


# --- robustness curves (the blog's Figure 3) -------------------------------------------------

def _curve_points(items: Iterable[Mapping[str, Any]]) -> list[tuple[float, float, float, float, int]]:
    """(p%, mean, low, high, n_seeds) sorted by p, starting at (0, 0, 0, 0).

    A missing interval (one seed) collapses the band onto the mean, and the band is widened to
    contain the mean, so the shaded area is never drawn beside its own curve.
    """
    points: dict[float, tuple[float, float, float, float, int]] = {}
    for item in items:
        p, mean = item.get("p"), item.get("mean_pct")
        if not (finite(p) and finite(mean)):
            continue
        low = item.get("ci_low_pct")
        high = item.get("ci_high_pct")
        low = min(low, mean) if finite(low) else mean
        high = max(high, mean) if finite(high) else mean
        points[100.0 * p] = (100.0 * p, mean, low, high, int(item.get("n_seeds") or 0))
    # The relative increase is 0 at p = 0 by definition; draw it even if the row is absent.
    points.setdefault(0.0, (0.0, 0.0, 0.0, 0.0, 0))
    return [points[x] for x in sorted(points)]


def _band_trace(name: str, color: str, pts: Sequence[tuple[float, float, float, float, int]]
                ) -> go.Scatter:
    xs = [pt[0] for pt in pts]
    return go.Scatter(
        x=xs + xs[::-1], y=[pt[3] for pt in pts] + [pt[2] for pt in pts][::-1],
        fill="toself", fillcolor=rgba(color, 0.16), line={"width": 0}, mode="lines",
        hoverinfo="skip", showlegend=False, legendgroup=name, name=f"{name} (95% interval)",
    )


def _mean_trace(name: str, color: str, strategy: str,
                pts: Sequence[tuple[float, float, float, float, int]]) -> go.Scatter:
    custom = [[f"{pt[2]:+.2f}", f"{pt[3]:+.2f}", pt[4]] for pt in pts]
    return go.Scatter(
        x=[pt[0] for pt in pts], y=[pt[1] for pt in pts], mode="lines+markers", name=name,
        legendgroup=name, customdata=custom,
        line={"color": color, "dash": STRATEGY_DASH.get(strategy, "longdash"), "width": 2.5},
        marker={"symbol": STRATEGY_SYMBOL.get(strategy, "x"), "size": 8, "color": color},
        hovertemplate=(f"<b>{name}</b><br>p = %{{x:.1f}}%<br>loss increase = %{{y:+.2f}}%"
                       "<br>95% interval [%{customdata[0]}, %{customdata[1]}]%"
                       "<br>seeds: %{customdata[2]}<extra></extra>"),
    )


def _robustness_groups(items: Sequence[Mapping[str, Any]]
                       ) -> dict[tuple[str, str, str], list[Mapping[str, Any]]]:
    """(arm, strategy, suffix) -> items; the suffix names a study block's label ("[decode_
    sender]") and, only when the sweep mixes failure durations, the duration (otherwise two
    durations, or a labelled block and the unlabelled cells, would be drawn as one zig-zag
    curve)."""
    several = len({item.get("duration") for item in items}) > 1
    groups: dict[tuple[str, str, str], list[Mapping[str, Any]]] = defaultdict(list)
    for item in items:
        suffix = f" [{item['label']}]" if item.get("label") else ""
        suffix += f", {item.get('duration')}-step failures" if several else ""
        groups[(str(item.get("compression")), str(item.get("strategy")), suffix)].append(item)
    return groups


def robustness_curves(robustness: Mapping[str, Any]) -> go.Figure:
    """Relative validation-loss increase vs failure probability, one curve per arm x strategy.

    Input: the registry's robustness summary (`items` with compression, strategy, p, mean_pct,
    ci_low_pct, ci_high_pct, n_seeds, and duration). Output: per arm x strategy a translucent
    95% band trace followed by its mean trace (colour = arm, dash = strategy); every curve starts
    at (0, 0).
    """
    groups = _robustness_groups(list(robustness.get("items") or []))
    title = "Robustness: loss increase vs failure rate (each arm against its own baseline)"
    if not groups:
        return empty_figure(title=title, message="No robustness numbers yet: no arm has both a "
                            "finished baseline (p = 0) and a finished failure run.")
    fig = go.Figure()
    for key in sorted(groups, key=lambda k: (*group_order(k[:2]), k[2])):
        arm, strategy, suffix = key
        name, color = series_name(arm, strategy) + suffix, arm_color(arm)
        pts = _curve_points(groups[key])
        fig.add_trace(_band_trace(name, color, pts))
        fig.add_trace(_mean_trace(name, color, strategy, pts))
    base_layout(fig, title=title, x_title=P_AXIS_TITLE,
                y_title="Validation-loss increase vs own baseline (%)",
                legend_title="Arm · strategy (band: 95% interval)")
    fig.update_yaxes(zeroline=True, zerolinecolor="#999", ticksuffix="%")
    fig.update_xaxes(ticksuffix="%", rangemode="tozero")
    return fig


# --- the Table-1 view -------------------------------------------------------------------------

def _column_label(column: str) -> str:
    """"ssn/skip" -> "SSN · skip"; "ssn/skip@d6" -> "SSN · skip, 6-step failures";
    "mapl/skip[decode_sender]" -> "MAPL · skip [decode_sender]"."""
    column, _, duration = column.partition("@d")
    column, _, block = column.partition("[")
    arm, _, strategy = column.partition("/")
    label = series_name(arm, strategy) if strategy else arm_label(arm)
    if block:
        label += f" [{block.rstrip(']')}]"
    return f"{label}, {duration}-step failures" if duration else label


def _column_order(column: str) -> tuple[int, str, int, str, str]:
    """Known arms first, then skip before drop (the registry sorts columns alphabetically)."""
    arm, _, strategy = column.partition("@d")[0].partition("[")[0].partition("/")
    return (*group_order((arm, strategy)), column)


def _cell_text(cell: Mapping[str, Any] | None) -> str:
    if not cell or not finite(cell.get("mean_pct")):
        return "—"
    low, high = cell.get("ci_low_pct"), cell.get("ci_high_pct")
    seeds = cell.get("n_seeds") or 0
    interval = (f"[{low:+.2f}, {high:+.2f}]" if finite(low) and finite(high)
                else "(no interval)")
    return f"<b>{cell['mean_pct']:+.2f}%</b> {interval} n={seeds}"


def robustness_table(table: Mapping[str, Any]) -> go.Figure:
    """The blog's Table 1: p rows x arm/strategy columns, mean increase with its 95% interval.

    Input: the registry's table (`columns` like "ssn/skip", `rows` with p and `cells`, a cell
    being None where no number exists). Output: one `go.Table` trace; a missing cell reads "—".
    """
    columns: list[str] = sorted(table.get("columns") or [], key=_column_order)
    # p = 0 rows are 0 by definition (each arm against itself): the blog's table leaves them out.
    rows = [row for row in table.get("rows") or [] if finite(row.get("p")) and row["p"] > 0]
    title = "Table 1: validation-loss increase (%) [95% interval], by failure rate"
    if not columns or not rows:
        return empty_figure(title=title, message="No table yet: waiting for finished runs.",
                            height=220)
    rows.sort(key=lambda row: row["p"])
    values = [[f"{100.0 * row['p']:g}%" for row in rows]]
    for column in columns:
        values.append([_cell_text((row.get("cells") or {}).get(column)) for row in rows])
    shade = [["#f7f7f7" if i % 2 else "white" for i in range(len(rows))]] * len(values)
    fig = go.Figure(go.Table(
        columnwidth=[0.8] + [1.6] * len(columns),
        header={"values": ["<b>failure rate p</b>"]
                + [f"<b>{_column_label(c)}</b>" for c in columns],
                "fill_color": "#e8eef5", "align": "center", "height": 44,
                "font": {"size": 13}},
        cells={"values": values, "fill_color": shade, "align": "center", "height": 32,
               "font": {"size": 13}},
    ))
    fig.update_layout(title={"text": title, "x": 0.0, "xanchor": "left", "font": {"size": 18}},
                      height=80 + 44 + 32 * len(rows), margin={"l": 10, "r": 10, "t": 56, "b": 4},
                      font={"family": "system-ui, sans-serif"})
    return fig


# --- validation loss against the baseline -----------------------------------------------------

def val_loss_points(*, metrics: Sequence[Mapping[str, Any]] | None = None,
                    summary: Mapping[str, Any] | None = None) -> list[tuple[float, float]]:
    """(tokens, val_loss) pairs of a run, from its `val_loss` metric rows, else its summary evals.

    Rows without tokens or with a non-finite value are dropped; the result is sorted by tokens.
    """
    points = [(row.get("tokens"), row.get("value")) for row in metrics or []
              if row.get("name") == "val_loss" and row.get("replica") is None]
    points = [(t, v) for t, v in points if finite(t) and finite(v)]
    if not points and summary:
        points = [(ev.get("tokens"), ev.get("val_loss")) for ev in summary.get("evals") or []]
        points = [(t, v) for t, v in points if finite(t) and finite(v)]
    return sorted((float(t), float(v)) for t, v in points)


def loss_curves(series: Sequence[Mapping[str, Any]]) -> go.Figure:
    """Validation loss over tokens for runs and their baselines.

    Input: items {name, points: [(tokens, val_loss)], compression, strategy, baseline: bool}.
    A run is drawn in its arm colour and strategy dash; a baseline as a black dotted line.
    """
    fig = go.Figure()
    for item in series:
        points = list(item.get("points") or [])
        if not points:
            continue
        is_baseline = bool(item.get("baseline"))
        color = "#000000" if is_baseline else arm_color(str(item.get("compression")))
        dash = "dot" if is_baseline else STRATEGY_DASH.get(str(item.get("strategy")), "solid")
        fig.add_trace(go.Scatter(
            x=[pt[0] for pt in points], y=[pt[1] for pt in points], mode="lines+markers",
            name=str(item.get("name")), line={"color": color, "dash": dash, "width": 2.5},
            marker={"size": 6}, hovertemplate="tokens %{x:,.0f}<br>val loss %{y:.4f}<extra>"
            + str(item.get("name")) + "</extra>",
        ))
    title = "Validation loss vs tokens, against the no-failure baseline"
    if not fig.data:
        return empty_figure(title=title, message="No validation loss recorded yet.")
    base_layout(fig, title=title, x_title="Tokens processed",
                y_title="Validation loss (nats / token)")
    fig.update_xaxes(tickformat="~s")
    legend_below(fig)
    return fig


# --- training loss per replica ----------------------------------------------------------------

def _step_stride(series: Iterable[Sequence[tuple[float, float]]]) -> float:
    """The spacing of reported global steps (1, or k when the registry thinned the rows)."""
    gaps = []
    for points in series:
        steps = sorted(pt[0] for pt in points)
        gaps += [b - a for a, b in itertools.pairwise(steps) if b > a]
    return min(gaps) if gaps else 1.0


def _break_gaps(points: Sequence[tuple[float, float]],
                stride: float) -> tuple[list[float | None], list[float | None]]:
    """x and y of `points` with a None between two steps further apart than `stride`: a replica
    that reported no loss for a while (its stage was down and its tokens dropped) shows a gap,
    not a straight line across the steps it did not train."""
    xs: list[float | None] = []
    ys: list[float | None] = []
    for i, (x, y) in enumerate(points):
        if i and x - points[i - 1][0] > stride * 1.5:
            xs.append(None)
            ys.append(None)
        xs.append(x)
        ys.append(y)
    return xs, ys


def train_loss_per_replica(rows: Sequence[Mapping[str, Any]]) -> go.Figure:
    """Each replica's training loss over global steps, one line per replica that reported one.

    Input: `train_loss` metric rows {global_step, replica, value} (the registry thins a long
    run's rows, see `api.dashboards.queries`). A replica whose loss jumps or flattens while the
    others do not is the one to look at in the fault timeline below.
    """
    by_replica: dict[int, list[tuple[float, float]]] = defaultdict(list)
    for row in rows:
        replica, step, value = row.get("replica"), row.get("global_step"), row.get("value")
        if row.get("name", "train_loss") == "train_loss" and finite(replica) and finite(step) \
                and finite(value):
            by_replica[int(replica)].append((float(step), float(value)))
    title = "Training loss per replica"
    if not by_replica:
        return empty_figure(title=title, message="No training loss recorded yet.")
    fig = go.Figure()
    stride = _step_stride(by_replica.values())
    for replica in sorted(by_replica):
        xs, ys = _break_gaps(sorted(by_replica[replica]), stride)
        fig.add_trace(go.Scatter(
            x=xs, y=ys, mode="lines+markers", connectgaps=False, marker={"size": 3},  # a lone step shows
            name=f"replica {replica}",
            line={"color": OKABE_ITO[replica % len(OKABE_ITO)], "width": 1.8,
                  "dash": ("solid", "dash", "dot")[(replica // len(OKABE_ITO)) % 3]},
            hovertemplate=f"replica {replica}<br>step %{{x}}<br>train loss %{{y:.4f}}"
                          "<extra></extra>"))
    base_layout(fig, title=title, x_title="Global step (outer round)",
                y_title="Training loss (nats / token)", height=420)
    legend_below(fig)
    return fig

"""Figure builders: pure functions from the registry's plain query results to Plotly figures.

Every builder takes dicts and lists shaped like the registry's JSON (robustness summary, table,
runs, metric and event rows), never ORM objects, so tests build their input by hand and the
offline export and the served pages draw the same figures. Builders never raise on sparse data:
a sweep still running or an arm without a baseline yields a figure that says what is missing.
Non-finite numbers are dropped before plotting (a NaN would silently break a curve).
"""
from __future__ import annotations

import itertools
import math
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import plotly.graph_objects as go

from dashboards.style import (
    OKABE_ITO,
    STRATEGY_DASH,
    STRATEGY_ORDER,
    STRATEGY_PATTERN,
    STRATEGY_SYMBOL,
    arm_color,
    arm_label,
    base_layout,
    empty_figure,
    rgba,
    series_name,
)

__all__ = ["robustness_curves", "robustness_table", "loss_curves", "val_loss_points",
           "train_loss_per_replica", "fault_timeline", "token_accounting", "bytes_sent",
           "BYTE_KINDS", "BASELINE_LABEL"]

P_AXIS_TITLE = "Failure probability per replica per global step (%)"
# a baseline (p = 0) has no strategy of its own (the registry stores None); it is drawn with each
# strategy of its arm, and under this name only when its arm has no failure run yet
BASELINE_LABEL = "baseline"
_ARM_ORDER = ("none", "ssn", "mapl")
BYTE_KINDS: tuple[tuple[str, str], ...] = (
    ("boundary_forward", "boundary, forward"),
    ("boundary_backward", "boundary, backward"),
    ("upload", "upload (SparseLoCo)"),
    ("dense_upload_equivalent", "dense upload equivalent"),
)


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _group_order(key: tuple[str, str]) -> tuple[int, str, int, str]:
    """Known arms first in a fixed order, then strategies in the study's order."""
    arm, strategy = key
    arm_rank = _ARM_ORDER.index(arm) if arm in _ARM_ORDER else len(_ARM_ORDER)
    strat_rank = STRATEGY_ORDER.index(strategy) if strategy in STRATEGY_ORDER else len(STRATEGY_ORDER)
    return (arm_rank, arm, strat_rank, strategy)


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
        if not (_finite(p) and _finite(mean)):
            continue
        low = item.get("ci_low_pct")
        high = item.get("ci_high_pct")
        low = min(low, mean) if _finite(low) else mean
        high = max(high, mean) if _finite(high) else mean
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
    for key in sorted(groups, key=lambda k: (*_group_order(k[:2]), k[2])):
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
    return (*_group_order((arm, strategy)), column)


def _cell_text(cell: Mapping[str, Any] | None) -> str:
    if not cell or not _finite(cell.get("mean_pct")):
        return "—"
    low, high = cell.get("ci_low_pct"), cell.get("ci_high_pct")
    seeds = cell.get("n_seeds") or 0
    interval = (f"[{low:+.2f}, {high:+.2f}]" if _finite(low) and _finite(high)
                else "(no interval)")
    return f"<b>{cell['mean_pct']:+.2f}%</b> {interval} n={seeds}"


def robustness_table(table: Mapping[str, Any]) -> go.Figure:
    """The blog's Table 1: p rows x arm/strategy columns, mean increase with its 95% interval.

    Input: the registry's table (`columns` like "ssn/skip", `rows` with p and `cells`, a cell
    being None where no number exists). Output: one `go.Table` trace; a missing cell reads "—".
    """
    columns: list[str] = sorted(table.get("columns") or [], key=_column_order)
    # p = 0 rows are 0 by definition (each arm against itself): the blog's table leaves them out.
    rows = [row for row in table.get("rows") or [] if _finite(row.get("p")) and row["p"] > 0]
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
    points = [(t, v) for t, v in points if _finite(t) and _finite(v)]
    if not points and summary:
        points = [(ev.get("tokens"), ev.get("val_loss")) for ev in summary.get("evals") or []]
        points = [(t, v) for t, v in points if _finite(t) and _finite(v)]
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
    _legend_below(fig)
    return fig


# Room for a legend under the plot: its entries wrap at this width (a figure in the page's
# two-column grid is about this wide; a full-width one just wraps less than planned).
_LEGEND_WIDTH_PX = 560
_LEGEND_ROW_PX = 24
_CHAR_PX = 7.5  # a 13 px system-ui character, generously


def _legend_rows(names: Sequence[str]) -> int:
    """How many rows a horizontal legend of `names` takes at _LEGEND_WIDTH_PX."""
    rows, used = 1, 0.0
    for name in names:
        width = 40 + _CHAR_PX * len(name)  # symbol, gap and text
        if used and used + width > _LEGEND_WIDTH_PX:
            rows, used = rows + 1, 0.0
        used += width
    return rows


def _legend_below(fig: go.Figure) -> None:
    """A horizontal legend under the x-axis title (anchored to the container, not the axes),
    with a bottom margin sized to its entries so it never overlaps the title or is cut off."""
    names = [str(t.name) for t in fig.data if t.showlegend is not False and t.name]
    extra = _LEGEND_ROW_PX * _legend_rows(names)
    fig.update_layout(legend={"orientation": "h", "x": 0, "xanchor": "left", "y": 0,
                              "yanchor": "bottom", "yref": "container"},
                      margin={"b": 64 + extra})
    fig.update_layout(height=(fig.layout.height or 450) + extra)


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
    run's rows, see `dashboards.queries`). A replica whose loss jumps or flattens while the others
    do not is the one to look at in the fault timeline below.
    """
    by_replica: dict[int, list[tuple[float, float]]] = defaultdict(list)
    for row in rows:
        replica, step, value = row.get("replica"), row.get("global_step"), row.get("value")
        if row.get("name", "train_loss") == "train_loss" and _finite(replica) and _finite(step) \
                and _finite(value):
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
    _legend_below(fig)
    return fig


# --- the fault timeline -----------------------------------------------------------------------

# Mitigations are keyed like the strategies: "skip" is a stage that was bypassed (under `skip`, or
# under `reroute` when no healthy donor was left), "drop"/"drop_extend" a replica whose tokens
# were dropped, "reroute" a replica whose micro-batches went through a donor's stage.
_MITIGATION_LABEL = {"skip": "stage skipped (bypass)", "drop": "tokens dropped",
                     "drop_extend": "tokens dropped, run extended",
                     "reroute": "rerouted via donor replica"}
_MITIGATION_COLOR = {"skip": "#0072B2", "drop": "#D55E00", "drop_extend": "#E69F00",
                     "reroute": "#009E73"}
# when one step of a stage-replica has several mitigation events (a registry written before each
# step got exactly one: a reroute was logged as reroute + bypass), the first of these wins
_MITIGATION_RANK = {"reroute": 0, "drop": 1, "drop_extend": 1, "skip": 2}
_EVENT_MARKERS = {  # kind -> (legend label, symbol, colour)
    "contribution_missing": ("contribution missing", "x-thin-open", "#555555"),
    "contribution_rejected": ("contribution rejected", "x", "#CC79A7"),
    "rejoin": ("stage rejoined (state reset)", "triangle-right", "#009E73"),
    "reroute": ("rerouted (donor in hover)", "star", "#56B4E9"),
    # the distributed mode's real faults: a replica's process killed, and back contributing
    "process_killed": ("process killed (SIGKILL)", "x-thin", "#D55E00"),
    "process_rejoined": ("process rejoined", "triangle-up", "#0072B2"),
}
_PROCESS_KINDS = ("process_killed", "process_rejoined")
_MARKER_OFFSET = 0.42  # markers sit just above a replica's bar, clear of its stage label

Done = tuple[str, Any]  # (mitigation, donor replica or None)


def _step_mitigation(event: Mapping[str, Any]) -> Done | None:
    """What one event says was done about a down stage-replica at its step; None for other kinds.

    The trainer logs exactly one per down stage-replica and global step: `bypass` (the stage was
    skipped), `drop` (the replica's tokens were dropped; detail.strategy tells drop_extend) or
    `reroute` (detail.donor's stage carried the replica's micro-batches).
    """
    kind, detail = event.get("kind"), event.get("detail") or {}
    strategy = detail.get("strategy") if isinstance(detail, Mapping) else None
    if kind == "reroute":
        donor = detail.get("donor") if isinstance(detail, Mapping) else None
        return "reroute", donor if _finite(donor) else None
    if kind == "drop":
        return ("drop_extend" if strategy == "drop_extend" else "drop"), None
    if kind == "bypass":
        # registries written before `drop` events existed logged a drop run's down stages as bypass
        return (str(strategy) if strategy in ("drop", "drop_extend") else "skip"), None
    return None


def _mitigations(events: Sequence[Mapping[str, Any]]) -> dict[tuple[Any, Any], dict[Any, Done]]:
    """(replica, stage) -> global step -> what was done, from the run's mitigation events."""
    out: dict[tuple[Any, Any], dict[Any, Done]] = defaultdict(dict)
    for event in events:
        done, step = _step_mitigation(event), event.get("global_step")
        if done is None or event.get("replica") is None or not _finite(step):
            continue
        steps = out[(event["replica"], event.get("stage"))]
        if step not in steps or _MITIGATION_RANK[done[0]] < _MITIGATION_RANK[steps[step][0]]:
            steps[step] = done
    return out


def _fault_segments(fault: Mapping[str, Any],
                    mitigations: Mapping[tuple[Any, Any], dict[Any, Done]],
                    default: str) -> list[dict[str, Any]]:
    """The fault's window cut into runs of steps with the same mitigation and donor.

    Each step takes what its event says was done (an event without a stage matches any stage of
    its replica); steps no event covers (a run still in progress, a registry without events) take
    the run's strategy.
    """
    start, stop = fault["start"], fault["start"] + fault["duration"]
    by_step = {**mitigations.get((fault["replica"], None), {}),
               **mitigations.get((fault["replica"], fault["stage"]), {})}
    pieces: list[tuple[Any, Any, Done]] = []
    cursor = start
    for step in sorted(s for s in by_step if start <= s < stop):
        if step > cursor:
            pieces.append((cursor, step, (default, None)))
        cursor = min(step + 1, stop)
        pieces.append((step, cursor, by_step[step]))
    if cursor < stop or not pieces:
        pieces.append((cursor, stop, (default, None)))
    segments: list[dict[str, Any]] = []
    for begin, end, (mitigation, donor) in pieces:
        last = segments[-1] if segments else None
        if last and last["end"] == begin and (last["mitigation"], last["donor"]) == (
                mitigation, donor):
            last["end"] = end
            continue
        segments.append({"replica": fault["replica"], "stage": fault["stage"], "start": begin,
                         "end": end, "mitigation": mitigation, "donor": donor})
    return segments


def _segment_text(segment: Mapping[str, Any]) -> str:
    text = f"stage {segment['stage']}"
    return text + (f" via replica {segment['donor']}" if segment["donor"] is not None else "")


def _fault_bars(faults: Sequence[Mapping[str, Any]], events: Sequence[Mapping[str, Any]],
                strategy: str) -> list[go.Bar]:
    mitigations = _mitigations(events)
    by_mitigation: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for fault in faults:
        for segment in _fault_segments(fault, mitigations, strategy):
            by_mitigation[segment["mitigation"]].append(segment)
    bars = []
    for mitigation in sorted(by_mitigation, key=lambda m: _group_order(("", m))):
        group = by_mitigation[mitigation]
        bars.append(go.Bar(
            orientation="h", name=f"stage down: {_MITIGATION_LABEL.get(mitigation, mitigation)}",
            y=[g["replica"] for g in group], x=[g["end"] - g["start"] for g in group],
            base=[g["start"] for g in group], width=0.6,
            text=[_segment_text(g) for g in group], textposition="inside",
            insidetextanchor="middle", textfont={"color": "white", "size": 12},
            marker={"color": _MITIGATION_COLOR.get(mitigation, OKABE_ITO[-1]),
                    "pattern": {"shape": STRATEGY_PATTERN.get(mitigation, ""),
                                "fgcolor": "white", "fgopacity": 0.55, "size": 8},
                    "line": {"color": "white", "width": 1}},
            customdata=[[g["stage"], g["start"], g["end"],
                         "" if g["donor"] is None else f"<br>through donor replica {g['donor']}"]
                        for g in group],
            hovertemplate=("replica %{y}, stage %{customdata[0]} down<br>global steps "
                           "%{customdata[1]} to %{customdata[2]}%{customdata[3]}<extra>"
                           + _MITIGATION_LABEL.get(mitigation, mitigation) + "</extra>"),
        ))
    return bars


def _event_markers(events: Sequence[Mapping[str, Any]]) -> list[go.Scatter]:
    markers = []
    for kind, (label, symbol, color) in _EVENT_MARKERS.items():
        rows = [e for e in events if e.get("kind") == kind and e.get("replica") is not None
                and _finite(e.get("global_step"))]
        if not rows:
            continue
        hover = [f"{label}<br>step {e['global_step']}"
                 + (f", stage {e['stage']}" if e.get("stage") is not None else "")
                 + (f", donor replica {(e.get('detail') or {}).get('donor')}"
                    if kind == "reroute" else "")
                 + (f", {(e.get('detail') or {})['seconds_after_kill']} s after the kill"
                    if "seconds_after_kill" in (e.get("detail") or {}) else "") for e in rows]
        markers.append(go.Scatter(
            # a rejoin happens at a step boundary; the others belong to the whole step
            x=[e["global_step"] + (0.0 if kind == "rejoin" else 0.5) for e in rows],
            y=[e["replica"] - _MARKER_OFFSET for e in rows], mode="markers", name=label,
            marker={"symbol": symbol, "size": 9, "color": color, "line": {"width": 1.5, "color": color}},
            hovertext=hover, hoverinfo="text",
        ))
    return markers


def fault_timeline(*, faults: Sequence[Mapping[str, Any]], events: Sequence[Mapping[str, Any]],
                   strategy: str, replicas: int | None = None,
                   global_steps: int | None = None) -> go.Figure:
    """Replica x global step: each failure a horizontal bar on a step axis, labelled by stage.

    Input: the run summary's faults [{replica, stage, start, duration}], the run's events and the
    run's strategy. Each down step's bypass / drop / reroute event says what was done, so a bar is
    cut where that changes (a reroute whose donor fails, then a bypass); colour and fill pattern
    name the mitigation, a rerouted bar names its donor. Steps without such an event take the run's
    strategy. Rejoin, contribution_missing/rejected and reroute events also become markers.
    """
    title = "Fault timeline: which stage was down, when, and how the replica coped"
    valid = [f for f in faults if all(_finite(f.get(k)) for k in ("replica", "stage", "start",
                                                                   "duration"))]
    # a distributed run's real kills are failures too, even with no simulated stage failure
    killed = [e for e in events if e.get("kind") in _PROCESS_KINDS
              and _finite(e.get("replica")) and _finite(e.get("global_step"))]
    if not valid and not killed:
        return empty_figure(title=title, message="No failures in this run.", height=220)
    fig = go.Figure([*_fault_bars(valid, events, strategy), *_event_markers(events)])
    n_replicas = replicas or int(max([f["replica"] for f in valid]
                                     + [e["replica"] for e in killed])) + 1
    last_step = global_steps or int(max([f["start"] + f["duration"] for f in valid]
                                        + [e["global_step"] + 1 for e in killed]))
    base_layout(fig, title=title, x_title="Global step (outer round)", y_title="Replica",
                height=max(300, 120 + 46 * n_replicas))
    fig.update_layout(barmode="overlay", bargap=0.3)
    _legend_below(fig)
    fig.update_xaxes(range=[0, last_step], type="linear", dtick=max(1, last_step // 20))
    # automargin: the left margin grows to the longest replica label, never clipping it
    fig.update_yaxes(tickvals=list(range(n_replicas)), range=[n_replicas - 0.4, -0.8],
                     ticktext=[f"replica {r}" for r in range(n_replicas)], showgrid=False,
                     automargin=True)
    fig.update_xaxes(automargin=True)
    return fig


# --- token accounting and bytes ---------------------------------------------------------------

def _token_share(runs: Sequence[Mapping[str, Any]]) -> dict[tuple[str, str], dict[float, list[float]]]:
    """(arm, strategy) -> p% -> [processed / budget in %]; baselines join every strategy of their arm."""
    shares: dict[tuple[str, str], dict[float, list[float]]] = defaultdict(lambda: defaultdict(list))
    baselines: dict[str, dict[float, list[float]]] = defaultdict(lambda: defaultdict(list))
    for run in runs:
        budget, done, p = run.get("tokens_budget"), run.get("tokens_processed"), run.get("p")
        if run.get("owed_records"):    # records still owed: not a finished data point yet
            continue
        if not (_finite(budget) and budget > 0 and _finite(done) and _finite(p)):
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
    for key in sorted(shares, key=_group_order):
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
    _legend_below(fig)
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
            if _finite(counters.get(kind)):
                totals[str(run.get("compression"))][kind].append(counters[kind] / 1e6)
    if not totals:
        return empty_figure(title=title, message="No finished runs with byte counters yet.")
    arms = sorted(totals, key=lambda arm: _group_order((arm, "")))
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
    _legend_below(fig)
    shown_all = [v for trace in fig.data for v in trace.x if v]
    # log-axis range in decades, padded right so the outside value labels are not clipped
    fig.update_xaxes(type="log", dtick=1, range=[math.log10(min(shown_all)) - 0.3,
                                                math.log10(max(shown_all)) + 0.6])
    fig.update_yaxes(autorange="reversed")
    return fig

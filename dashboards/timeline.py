"""The run page's fault timeline: replica x global step, one bar per failure, cut by mitigation.

Pure functions from plain query results (dicts and lists shaped like the registry's JSON, never
ORM objects) to Plotly figures, as `dashboards.figures`'s: tests build their input by hand, the
offline export and the served pages draw the same figures, sparse data yields a figure that says
what is missing instead of an error, and non-finite numbers are dropped before plotting.

`fault_timeline` reads the run summary's faults and the run's events (bypass, drop and reroute
say what was done about each down stage-replica and step; rejoin, contribution and process
events become markers).
"""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import Any

import plotly.graph_objects as go

from dashboards.style import (
    OKABE_ITO,
    STRATEGY_PATTERN,
    base_layout,
    empty_figure,
    finite,
    group_order,
    legend_below,
)

__all__ = ["fault_timeline"]

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
    "process_lost": ("process lost (never came back)", "square-x-open", "#000000"),
}
_PROCESS_KINDS = ("process_killed", "process_rejoined", "process_lost")
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
        return "reroute", donor if finite(donor) else None
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
        if done is None or event.get("replica") is None or not finite(step):
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
    for mitigation in sorted(by_mitigation, key=lambda m: group_order(("", m))):
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
                and finite(e.get("global_step"))]
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
    valid = [f for f in faults if all(finite(f.get(k)) for k in ("replica", "stage", "start",
                                                                  "duration"))]
    # a distributed run's real kills are failures too, even with no simulated stage failure
    killed = [e for e in events if e.get("kind") in _PROCESS_KINDS
              and finite(e.get("replica")) and finite(e.get("global_step"))]
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
    legend_below(fig)
    fig.update_xaxes(range=[0, last_step], type="linear", dtick=max(1, last_step // 20))
    # automargin: the left margin grows to the longest replica label, never clipping it
    fig.update_yaxes(tickvals=list(range(n_replicas)), range=[n_replicas - 0.4, -0.8],
                     ticktext=[f"replica {r}" for r in range(n_replicas)], showgrid=False,
                     automargin=True)
    fig.update_xaxes(automargin=True)
    return fig

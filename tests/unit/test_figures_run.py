"""The run page's figures: training loss per replica, and legends that list only what occurred."""
from __future__ import annotations

from typing import Any

import pytest

from dashboards import figures, sample, timeline


def _legend(fig: Any) -> list[str]:
    return [t.name for t in fig.data if t.showlegend is not False]


def test_train_loss_has_one_line_per_replica_that_reported() -> None:
    rows = [r for r in sample.train_loss_metrics(steps=10, replicas=4) if r["replica"] != 2]
    rows.append({"name": "train_loss", "global_step": 3, "replica": 0, "value": float("nan")})
    fig = figures.train_loss_per_replica(rows)
    assert _legend(fig) == ["replica 0", "replica 1", "replica 3"]
    first = fig.data[0]
    assert list(first.x) == list(range(10))  # sorted by step, the NaN dropped
    assert list(first.y) == [r["value"] for r in rows if r["replica"] == 0][:10]


def test_train_loss_breaks_the_line_where_a_replica_did_not_train() -> None:
    """Replica 1 was down (tokens dropped) for steps 2-5: its line has a gap there, not a
    straight segment from step 1 to 6; replica 0, which trained every step, has none. With
    rows thinned to every 2nd step, a 2-step spacing is not a gap."""
    rows = ([{"name": "train_loss", "global_step": g, "replica": 0, "value": 5.0 - g / 10}
             for g in range(8)]
            + [{"name": "train_loss", "global_step": g, "replica": 1, "value": 5.0 - g / 10}
               for g in (0, 1, 6, 7)])
    by_name = {t.name: t for t in figures.train_loss_per_replica(rows).data}
    assert list(by_name["replica 0"].x) == list(range(8))
    assert list(by_name["replica 1"].x) == [0, 1, None, 6, 7]
    assert list(by_name["replica 1"].y)[2] is None
    thinned = [{"name": "train_loss", "global_step": g, "replica": 0, "value": 1.0}
               for g in range(0, 10, 2)]
    assert None not in list(figures.train_loss_per_replica(thinned).data[0].x)


def test_train_loss_without_rows_says_so() -> None:
    fig = figures.train_loss_per_replica([])
    assert fig.data == ()
    assert "No training loss recorded yet." in fig.layout.annotations[0].text


@pytest.mark.parametrize(("events", "expected"), [
    ([], ["stage down: stage skipped (bypass)"]),
    ([{"kind": "bypass", "global_step": 3, "replica": 1, "stage": 1},
      {"kind": "contribution_missing", "global_step": 3, "replica": 1, "stage": 1}],
     ["stage down: stage skipped (bypass)", "contribution missing"]),
    ([{"kind": "reroute", "global_step": 3, "replica": 1, "stage": 1, "detail": {"donor": 2}},
      {"kind": "rejoin", "global_step": 5, "replica": 1, "stage": 1}],
     ["stage down: stage skipped (bypass)", "stage down: rerouted via donor replica",
      "stage rejoined (state reset)", "rerouted (donor in hover)"]),
])
def test_fault_timeline_legend_lists_only_what_occurred(
        events: list[dict[str, Any]], expected: list[str]) -> None:
    fig = timeline.fault_timeline(faults=[{"replica": 1, "stage": 1, "start": 3, "duration": 2}],
                                  events=events, strategy="skip", replicas=4, global_steps=10)
    assert _legend(fig) == expected


def test_fault_timeline_makes_room_for_a_long_legend() -> None:
    faults = [{"replica": 0, "stage": 0, "start": 0, "duration": 2}]
    short = timeline.fault_timeline(faults=faults, events=[], strategy="skip")
    long = timeline.fault_timeline(faults=faults, events=[
        {"kind": kind, "global_step": 1, "replica": 0, "stage": 0}
        for kind in ("contribution_missing", "contribution_rejected", "rejoin")],
        strategy="a_very_long_strategy_name_that_needs_its_own_legend_row_or_two")
    assert long.layout.margin.b > short.layout.margin.b
    assert long.layout.height - long.layout.margin.b == short.layout.height - short.layout.margin.b
    assert long.layout.yaxis.automargin is True  # replica labels push the left margin


def test_fault_timeline_shows_real_process_kills_of_the_distributed_mode() -> None:
    """A distributed run's process_killed / process_rejoined events get their own markers, with
    the seconds after the kill in the hover, even in a run with no simulated stage failure (the
    timeline is not "No failures"); a run without them has no such legend entry."""
    events = [{"kind": "process_killed", "global_step": 3, "replica": 1, "stage": None,
               "detail": {"killed_at_step": 3}},
              {"kind": "process_rejoined", "global_step": 4, "replica": 1, "stage": None,
               "detail": {"killed_at_step": 3, "seconds_after_kill": 10.2}}]
    fig = timeline.fault_timeline(faults=[], events=events, strategy="drop", replicas=3,
                                  global_steps=6)
    names = [t.name for t in fig.data]
    assert "process killed (SIGKILL)" in names and "process rejoined" in names
    rejoin = next(t for t in fig.data if t.name == "process rejoined")
    assert "10.2 s after the kill" in rejoin.hovertext[0] and "stage" not in rejoin.hovertext[0]
    quiet = timeline.fault_timeline(faults=[], events=[], strategy="drop", replicas=3,
                                    global_steps=6)
    assert not any((t.name or "").startswith("process") for t in quiet.data)

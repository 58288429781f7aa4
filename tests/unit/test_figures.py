"""Figure builders on hand-built registry-shaped data: traces, names, styles, axes, no NaN."""
from __future__ import annotations

import json
import math
from typing import Any

import plotly.graph_objects as go
import pytest

from dashboards import accounting, figures, sample, timeline
from dashboards.style import arm_color, series_name


def _numbers(fig: go.Figure) -> list[float]:
    out: list[float] = []
    for trace in fig.to_plotly_json()["data"]:
        for key in ("x", "y", "base"):
            values = trace.get(key)
            if values is None:
                continue
            out.extend(v for v in values if isinstance(v, (int, float)))
    return out


def _means(fig: go.Figure) -> list[Any]:
    return [t for t in fig.data if t.mode == "lines+markers"]


def _bands(fig: go.Figure) -> list[Any]:
    return [t for t in fig.data if t.fill == "toself"]


def test_robustness_curves_one_band_and_one_mean_per_arm_and_strategy() -> None:
    fig = figures.robustness_curves(sample.robustness())
    assert len(fig.data) == 2 * len(sample.ARMS) * len(sample.STRATEGIES)
    names = {t.name for t in _means(fig)}
    assert names == {series_name(a, s) for a in sample.ARMS for s in sample.STRATEGIES}
    assert "uncompressed · skip" in names and "SSN · drop" in names
    assert all(not band.showlegend for band in _bands(fig))


def test_robustness_curves_style_colour_is_arm_dash_is_strategy() -> None:
    fig = figures.robustness_curves(sample.robustness())
    for trace in _means(fig):
        arm = "none" if trace.name.startswith("uncompressed") else "ssn"
        assert trace.line.color == arm_color(arm)
        assert trace.line.dash == ("solid" if trace.name.endswith("skip") else "dash")
    assert arm_color("none") != arm_color("ssn")


def test_robustness_curves_axes_have_titles_with_units() -> None:
    fig = figures.robustness_curves(sample.robustness())
    assert "(%)" in fig.layout.xaxis.title.text and "probability" in fig.layout.xaxis.title.text
    assert "(%)" in fig.layout.yaxis.title.text and "baseline" in fig.layout.yaxis.title.text
    assert fig.layout.title.text


def test_robustness_curves_start_at_zero_and_use_percent() -> None:
    fig = figures.robustness_curves(sample.robustness())
    for trace in _means(fig):
        assert trace.x[0] == 0.0 and trace.y[0] == 0.0
        assert list(trace.x) == sorted(trace.x)
        assert max(trace.x) == pytest.approx(100 * max(sample.PS))


def test_robustness_curves_start_at_zero_even_without_a_p0_row() -> None:
    summary = sample.robustness()
    summary["items"] = [i for i in summary["items"] if i["p"] > 0]
    for trace in _means(figures.robustness_curves(summary)):
        assert (trace.x[0], trace.y[0]) == (0.0, 0.0)


def test_robustness_band_contains_the_mean_including_single_seed_points() -> None:
    fig = figures.robustness_curves(sample.robustness())
    for band, mean in zip(_bands(fig), _means(fig), strict=True):
        n = len(mean.x)
        upper, lower = list(band.y[:n]), list(band.y[n:])[::-1]
        assert list(band.x[:n]) == list(mean.x)
        for low, mid, high in zip(lower, mean.y, upper, strict=True):
            assert low <= mid <= high
    one_seed = next(t for t in _means(fig) if t.name == "SSN · drop")
    assert one_seed.customdata[-1][2] == 1  # the hover says one seed


def test_robustness_figures_hold_no_nan() -> None:
    summary = sample.robustness()
    summary["items"].append({"compression": "ssn", "strategy": "skip", "duration": 6,
                             "p": 0.3, "mean_pct": float("nan"), "ci_low_pct": None,
                             "ci_high_pct": None, "n_seeds": 1, "run_ids": []})
    fig = figures.robustness_curves(summary)
    assert all(math.isfinite(v) for v in _numbers(fig))
    assert "NaN" not in fig.to_json()


def test_robustness_curves_separate_failure_durations_when_mixed() -> None:
    summary = sample.robustness()
    extra = [dict(i, duration=3) for i in summary["items"] if i["compression"] == "ssn"]
    summary["items"] += extra
    names = [t.name for t in _means(figures.robustness_curves(summary))]
    assert "SSN · skip, 3-step failures" in names and "SSN · skip, 6-step failures" in names


def test_robustness_curves_empty_state_says_why() -> None:
    fig = figures.robustness_curves({"items": [], "missing_baselines": [], "pending_runs": 3})
    assert len(fig.data) == 0
    assert "baseline" in fig.layout.annotations[0].text


def test_table_has_p_rows_arm_columns_and_marks_missing_cells() -> None:
    fig = figures.robustness_table(sample.table())
    (table,) = fig.data
    header = list(table.header.values)
    assert header[1:] == ["<b>uncompressed · skip</b>", "<b>uncompressed · drop</b>",
                          "<b>SSN · skip</b>", "<b>SSN · drop</b>"]
    columns = list(table.cells.values)
    assert columns[0] == ["10%", "20%"]
    assert columns[1][0] == "<b>+1.00%</b> [+0.70, +1.30] n=2"
    assert columns[2][1] == "—"                      # none/drop at p = 0.2 is missing
    assert "no interval" in columns[4][1]            # ssn/drop at 0.2 has one seed


def test_table_labels_durations_and_empty_state() -> None:
    fig = figures.robustness_table({"columns": ["ssn/skip@d3"], "rows": [
        {"p": 0.1, "cells": {"ssn/skip@d3": None}}]})
    assert fig.data[0].header.values[1] == "<b>SSN · skip, 3-step failures</b>"
    empty = figures.robustness_table({"columns": [], "rows": []})
    assert len(empty.data) == 0 and empty.layout.annotations


def test_val_loss_points_prefer_metrics_and_drop_non_finite() -> None:
    summ = sample.summary(p=0.1, strategy="skip", arm="ssn")
    metrics = sample.val_loss_metrics(summ)
    metrics.append({"name": "val_loss", "global_step": 99, "tokens": 1, "replica": None,
                    "value": float("inf")})
    metrics.append({"name": "train_loss", "global_step": 1, "tokens": 1, "replica": 0,
                    "value": 9.0})
    points = figures.val_loss_points(metrics=metrics, summary=None)
    assert points == [(float(e["tokens"]), e["val_loss"]) for e in summ["evals"]]
    assert figures.val_loss_points(metrics=[], summary=summ) == points


def test_loss_curves_draw_run_in_arm_style_and_baseline_dotted() -> None:
    summ = sample.summary(p=0.1, strategy="drop", arm="ssn")
    base = sample.summary(p=0.0, strategy="skip", arm="ssn")
    fig = figures.loss_curves([
        {"name": "run", "compression": "ssn", "strategy": "drop",
         "points": figures.val_loss_points(summary=summ)},
        {"name": "baseline", "baseline": True, "points": figures.val_loss_points(summary=base)},
    ])
    run, baseline = fig.data
    assert (run.line.color, run.line.dash) == (arm_color("ssn"), "dash")
    assert baseline.line.dash == "dot"
    assert fig.layout.xaxis.title.text == "Tokens processed"
    assert "nats" in fig.layout.yaxis.title.text
    assert len(figures.loss_curves([{"name": "x", "points": []}]).data) == 0


def _timeline(strategy: str, events: list[dict[str, Any]]) -> go.Figure:
    summ = sample.summary(p=0.1, strategy=strategy, arm="ssn")
    return timeline.fault_timeline(faults=summ["faults"], events=events, strategy=strategy,
                                   replicas=4, global_steps=20)


def test_fault_timeline_is_horizontal_bars_on_a_step_axis() -> None:
    fig = _timeline("skip", sample.events(strategy="skip"))
    bars = [t for t in fig.data if isinstance(t, go.Bar)]
    (bar,) = bars
    assert bar.orientation == "h"
    assert list(bar.base) == [3, 10] and list(bar.x) == [6, 6] and list(bar.y) == [1, 3]
    assert list(bar.text) == ["stage 1", "stage 2"]
    assert fig.layout.xaxis.type == "linear"
    assert "Global step" in fig.layout.xaxis.title.text
    assert list(fig.layout.yaxis.ticktext) == [f"replica {r}" for r in range(4)]
    markers = {t.name for t in fig.data if isinstance(t, go.Scatter)}
    assert markers == {"contribution missing", "stage rejoined (state reset)"}


def _bars(fig: go.Figure) -> dict[str, Any]:
    return {t.name: t for t in fig.data if isinstance(t, go.Bar)}


def _mitigation_event(kind: str, step: int, replica: int, stage: int,
                      **detail: Any) -> dict[str, Any]:
    return {"id": f"{kind}:{step}:{replica}:{stage}:0", "kind": kind, "global_step": step,
            "replica": replica, "stage": stage, "detail": detail}


@pytest.mark.parametrize("strategy, kind", [("skip", "bypass"), ("drop", "drop"),
                                            ("drop_extend", "drop"), ("reroute", "reroute")])
def test_sample_events_log_what_each_strategy_did_once_per_down_step(strategy: str,
                                                                     kind: str) -> None:
    events = sample.events(strategy=strategy)
    done = [e for e in events if e["kind"] in ("bypass", "drop", "reroute")]
    assert {e["kind"] for e in done} == {kind}   # a drop run bypassed nothing
    steps = [(e["replica"], e["global_step"]) for e in done]
    assert sorted(steps) == [(1, s) for s in range(3, 9)] + [(3, s) for s in range(10, 16)]
    assert all(("donor" in e["detail"]) == (kind == "reroute") for e in done)


def test_fault_timeline_labels_a_drop_run_by_its_drop_events() -> None:
    drop = _timeline("drop", sample.events(strategy="drop"))
    (bar,) = _bars(drop).values()
    assert bar.name == "stage down: tokens dropped"
    assert list(bar.base) == [3, 10] and list(bar.x) == [6, 6]
    # the events, not the run's strategy argument, say what was done
    events = [e for e in sample.events(strategy="drop") if e["replica"] == 1]
    events += [e for e in sample.events(strategy="skip") if e["replica"] == 3]
    bars = _bars(_timeline("skip", events))
    assert set(bars) == {"stage down: tokens dropped", "stage down: stage skipped (bypass)"}
    assert list(bars["stage down: tokens dropped"].y) == [1]
    assert list(bars["stage down: stage skipped (bypass)"].y) == [3]
    extend = _timeline("drop_extend", sample.events(strategy="drop_extend"))
    assert [t.name for t in extend.data if isinstance(t, go.Bar)] == \
        ["stage down: tokens dropped, run extended"]


def test_fault_timeline_shows_the_donor_and_cuts_where_the_reroute_ran_out_of_donors() -> None:
    events = sample.events(strategy="reroute")
    # replica 3's donor went down too at steps 14-15: nothing left to reroute through, so bypass
    events = [e for e in events if not (e["kind"] == "reroute" and e["replica"] == 3
                                        and e["global_step"] >= 14)]
    events += [_mitigation_event("bypass", s, 3, 2, strategy="reroute") for s in (14, 15)]
    fig = _timeline("reroute", events)
    bars = _bars(fig)
    assert list(bars) == ["stage down: stage skipped (bypass)",
                          "stage down: rerouted via donor replica"]
    skip, reroute = bars["stage down: stage skipped (bypass)"], bars[
        "stage down: rerouted via donor replica"]
    assert list(reroute.y) == [1, 3] and list(reroute.base) == [3, 10] and list(reroute.x) == [6, 4]
    assert list(reroute.text) == ["stage 1 via replica 2", "stage 2 via replica 0"]
    assert "donor replica 0" in reroute.customdata[1][3]
    assert list(skip.y) == [3] and list(skip.base) == [14] and list(skip.x) == [2]
    assert list(skip.text) == ["stage 2"]
    assert skip.marker.color != reroute.marker.color
    assert skip.marker.pattern.shape != reroute.marker.pattern.shape
    star = next(t for t in fig.data if t.name.startswith("rerouted"))
    assert len(star.x) == 10 and "donor replica 2" in star.hovertext[0]


def test_fault_timeline_donor_changes_and_unknown_steps_fall_back_to_the_strategy() -> None:
    faults = [{"replica": 1, "stage": 1, "start": 3, "duration": 6}]
    events = [_mitigation_event("reroute", 3, 1, 1, strategy="reroute", donor=0),
              _mitigation_event("reroute", 4, 1, 1, strategy="reroute", donor=2),
              _mitigation_event("reroute", 5, 1, 1, strategy="reroute", donor=2),
              _mitigation_event("drop", 5, 1, 2, strategy="drop")]  # another stage: not this fault
    fig = timeline.fault_timeline(faults=faults, events=events, strategy="reroute", replicas=4,
                                  global_steps=20)
    (bar,) = _bars(fig).values()
    assert list(bar.base) == [3, 4, 6] and list(bar.x) == [1, 2, 3]
    assert list(bar.text) == ["stage 1 via replica 0", "stage 1 via replica 2", "stage 1"]


def test_fault_timeline_reads_registries_written_before_drop_events() -> None:
    """Old runs logged every down stage as bypass (with the run's strategy) and a reroute as both
    reroute and bypass: they still show what was done."""
    down = [(1, 1, s) for s in range(3, 9)] + [(3, 2, s) for s in range(10, 16)]
    old_drop = [_mitigation_event("bypass", s, r, st, strategy="drop") for r, st, s in down]
    (bar,) = _bars(_timeline("skip", old_drop)).values()
    assert bar.name == "stage down: tokens dropped" and list(bar.base) == [3, 10]
    old_reroute = [e for r, st, s in down for e in (
        _mitigation_event("bypass", s, r, st, strategy="reroute"),
        _mitigation_event("reroute", s, r, st, strategy="reroute", donor=0))]
    (bar,) = _bars(_timeline("reroute", old_reroute)).values()
    assert bar.name == "stage down: rerouted via donor replica"
    assert list(bar.text) == ["stage 1 via replica 0", "stage 2 via replica 0"]


def test_fault_timeline_without_failures_says_so() -> None:
    fig = timeline.fault_timeline(faults=[], events=[], strategy="skip", replicas=4)
    assert len(fig.data) == 0 and "No failures" in fig.layout.annotations[0].text


def test_token_accounting_skip_keeps_budget_drop_loses_tokens() -> None:
    runs = sample.runs()
    runs.append(dict(runs[0], tokens_processed=None, status="running"))  # unfinished: ignored
    fig = accounting.token_accounting(runs)
    by_name = {t.name: t for t in fig.data}
    assert set(by_name) == {series_name(a, s) for a in sample.ARMS for s in sample.STRATEGIES}
    skip, drop = by_name["SSN · skip"], by_name["SSN · drop"]
    assert list(skip.x) == [0.0, 10.0, 20.0] and all(y == 100.0 for y in skip.y)
    assert drop.y[0] == 100.0 and drop.y[1] < 100.0 and drop.y[2] < drop.y[1]
    assert "% of budget" in fig.layout.yaxis.title.text


def test_bytes_sent_groups_counters_per_arm_in_megabytes() -> None:
    fig = accounting.bytes_sent(sample.runs())
    assert [t.name for t in fig.data] == [label for _, label in accounting.BYTE_KINDS]
    forward = fig.data[0]
    assert list(forward.y) == ["uncompressed", "SSN"]
    assert list(forward.x) == pytest.approx([2.0, 0.25])
    assert fig.layout.xaxis.type == "log" and "MB" in fig.layout.xaxis.title.text
    assert len(accounting.bytes_sent([{"compression": "ssn", "summary": {}}]).data) == 0


@pytest.mark.parametrize("builder", ["robustness", "table", "tokens", "bytes", "loss", "faults"])
def test_every_figure_serialises_to_json_without_nan(builder: str) -> None:
    summ = sample.summary(p=0.1, strategy="skip", arm="none")
    fig = {
        "robustness": lambda: figures.robustness_curves(sample.robustness()),
        "table": lambda: figures.robustness_table(sample.table()),
        "tokens": lambda: accounting.token_accounting(sample.runs()),
        "bytes": lambda: accounting.bytes_sent(sample.runs()),
        "loss": lambda: figures.loss_curves([{"name": "r", "compression": "none",
                                              "strategy": "skip",
                                              "points": figures.val_loss_points(summary=summ)}]),
        "faults": lambda: _timeline("skip", sample.events()),
    }[builder]()
    text = fig.to_json()
    assert "NaN" not in text and "Infinity" not in text
    assert json.loads(text)["layout"]["title"]["text"]
    assert all(math.isfinite(v) for v in _numbers(fig))

"""The sweep page's cost figures: loss against wall-clock and against money per cell (arm x
strategy x p x label, mean curve over seeds) on one deployment the sweep's runs are priced on
(`crucible cost ... --api`; the records and the decisions are `api.costs.sweep_costs`, i.e.
crucible.pricing.cost_sweep). The panel around them is `dashboards.pages._costs`.

Pure functions from the REST shape (GET /sweeps/{ref}/costs) to Plotly figures, as the other
figure modules; a record without evaluations gets a figure that says so.
"""
from __future__ import annotations

import html
from collections.abc import Mapping
from typing import Any

import plotly.graph_objects as go

from crucible.grid.key import BASELINE_NAME
from dashboards.style import (
    STRATEGY_DASH,
    STRATEGY_SYMBOL,
    arm_color,
    arm_label,
    base_layout,
    empty_figure,
    finite,
    legend_below,
)

__all__ = ["cost_curves"]

_AXES = {"wall": ("wall_s", "Predicted wall-clock (h)", 1 / 3600.0),
         "money": ("cost", "Money ({currency})", 1.0)}


def _name(cell: Mapping[str, Any]) -> str:
    label = f" {cell['label']}" if cell.get("label") else ""
    if cell["strategy"] == BASELINE_NAME:
        return f"{arm_label(cell['arm'])} · baseline"
    return f"{arm_label(cell['arm'])} · {cell['strategy']}{label} · p = {cell['p']:g}"


def cost_curves(record: Mapping[str, Any], *, axis: str) -> go.Figure:
    """Validation loss against the predicted wall-clock (`axis="wall"`) or money
    (`axis="money"`) per cell, mean curve over its seeds."""
    key, title, scale = _AXES[axis]
    title = title.format(currency=record.get("currency", ""))
    name = record.get("deployment", "")
    heading = f"Loss against {'wall-clock' if axis == 'wall' else 'money'} on {name}"
    cells = [c for c in record.get("cells") or [] if len(c.get("curve") or []) >= 1]
    if not cells:
        return empty_figure(title=heading, message="No priced run has an evaluation yet.")
    fig = go.Figure()
    for cell in cells:
        points = [p for p in cell["curve"] if finite(p.get(key)) and finite(p.get("val_loss"))]
        strategy = cell["strategy"]
        fig.add_trace(go.Scatter(
            x=[p[key] * scale for p in points], y=[p["val_loss"] for p in points],
            mode="lines+markers", name=_name(cell),
            line={"color": arm_color(cell["arm"]), "dash": STRATEGY_DASH.get(strategy, "solid"),
                  "width": 3 if strategy == BASELINE_NAME else 2},
            marker={"symbol": STRATEGY_SYMBOL.get(strategy, "circle"), "size": 7},
            hovertemplate=f"{html.escape(_name(cell))}<br>%{{x:.3g}}<br>val loss %{{y:.4f}}"
                          "<extra></extra>"))
    base_layout(fig, title=heading, x_title=title, y_title="Validation loss", height=480)
    legend_below(fig)
    return fig

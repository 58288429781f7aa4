"""The sweep page's cost panel: loss against wall-clock and against money per cell (arm x
strategy x p x label, mean curve over seeds), and the cheapest strategy at each p, for each
deployment the sweep's runs are priced on (`crucible cost ... --api`; the records and the
decisions are `api.costs.sweep_costs`, i.e. crucible.cost_sweep).

Pure functions from the REST shape (GET /sweeps/{ref}/costs) to Plotly figures and HTML, as the
other figure modules; a sweep without cost records gets a one-line note and no figure.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import plotly.graph_objects as go

from dashboards.pages._common import esc, figure_html
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

__all__ = ["cost_curves", "cost_panel"]

_AXES = {"wall": ("wall_s", "Predicted wall-clock (h)", 1 / 3600.0),
         "money": ("cost", "Money ({currency})", 1.0)}


def _name(cell: Mapping[str, Any]) -> str:
    label = f" {cell['label']}" if cell.get("label") else ""
    if cell["strategy"] == "base":
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
                  "width": 3 if strategy == "base" else 2},
            marker={"symbol": STRATEGY_SYMBOL.get(strategy, "circle"), "size": 7},
            hovertemplate=f"{esc(_name(cell))}<br>%{{x:.3g}}<br>val loss %{{y:.4f}}"
                          "<extra></extra>"))
    base_layout(fig, title=heading, x_title=title, y_title="Validation loss", height=480)
    legend_below(fig)
    return fig


def _money(value: Any, unit: str) -> str:
    return f"{value:,.2f} {esc(unit)}" if finite(value) else "—"


def _cheapest_table(record: Mapping[str, Any]) -> str:
    unit = record.get("currency", "")
    rows = []
    for row in record.get("cheapest") or []:
        if row.get("strategy") is None:
            what = "—"
        elif row.get("by") == "target":
            what = f"{_money(row.get('cost'), unit)} to the baseline's loss"
        else:
            loss = row.get("loss_at_budget")
            what = ("no strategy reaches the baseline's loss in every seed; lowest loss on "
                    f"its budget: {loss:.4f}" if finite(loss) else "—")
        rows.append(f'<tr><td>{esc(arm_label(row["arm"]))}</td><td>{esc(row.get("label") or "—")}'
                    f'</td><td>{row["p"]:g}</td><td data-cheapest="{esc(row.get("strategy"))}">'
                    f'<strong>{esc(row.get("strategy") or "—")}</strong></td><td>{what}</td></tr>')
    head = ("<tr><th>arm</th><th>variant</th><th>p</th><th>cheapest strategy</th>"
            "<th>why</th></tr>")
    return f'<table class="data cheapest">{head}{"".join(rows)}</table>'


def cost_panel(records: Sequence[Mapping[str, Any]]) -> str:
    """The Costs section: per priced deployment, its cheapest-strategy table and two figures."""
    if not records:
        return ('<section id="costs"><h2>Costs</h2><p>No run of this sweep is priced yet: '
                "<code>crucible cost SWEEP_FOLDER --deployment FILE --api URL</code> "
                "(docs/OPERATIONS.md, \"Cost of a run\").</p></section>")
    parts = ['<section id="costs"><h2>Costs</h2>',
             "<p>Predicted by <code>crucible cost</code> from what each run recorded "
             "(crucible/cost.py): every provisioned accelerator is paid for the whole "
             "wall-clock. Target: the same-seed baseline's final loss; budget: the baseline's "
             "money.</p>"]
    for index, record in enumerate(records):
        name = record.get("deployment", "")
        parts += [f'<h3 data-deployment="{esc(name)}">{esc(name)} '
                  f'({esc(str(record.get("pricing", "")).replace("_", " "))})</h3>',
                  _cheapest_table(record), '<div class="grid">',
                  figure_html(cost_curves(record, axis="wall"), f"fig-cost-wall-{index}"),
                  figure_html(cost_curves(record, axis="money"), f"fig-cost-money-{index}"),
                  "</div>"]
    parts.append("</section>")
    return "".join(parts)

"""The sweep page's Costs panel: per deployment the sweep's runs are priced on, the cheapest
strategy at each p and the two figures of `dashboards.costs`; a sweep without cost records gets
a one-line note on how to price it, and no figure.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from dashboards.costs import cost_curves
from dashboards.pages._common import esc, figure_html
from dashboards.style import arm_label, finite

__all__ = ["cost_panel"]


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
             "(crucible/pricing/cost.py): every provisioned accelerator is paid for the whole "
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

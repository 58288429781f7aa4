"""Shared look of every dashboard figure: palette, line styles, labels and the base layout.

Colours come from the Okabe-Ito palette (safe for the common colour-vision deficiencies; its
yellow is left out because it vanishes on white). Compression arms get colours, mitigation
strategies get dash styles and marker symbols, so a curve stays identifiable in greyscale too.

Also what every figure module (`dashboards.figures`, `.timeline`, `.accounting`) shares: the
failure-rate axis title and the baseline's label, the order arms x strategies are drawn in
(`group_order`), the finite-number test applied before plotting (`finite`), and the legend under
the plot (`legend_below`).
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import plotly.graph_objects as go

from crucible.grid.names import ARM_COLOR, ARM_LABEL, ARMS, STRATEGIES, STRATEGY_DASH

__all__ = ["OKABE_ITO", "STRATEGY_DASH", "STRATEGY_SYMBOL", "STRATEGY_PATTERN", "arm_color",
           "arm_label", "series_name", "rgba", "base_layout", "empty_figure",
           "P_AXIS_TITLE", "BASELINE_LABEL", "finite", "group_order", "legend_below"]

# Okabe-Ito without yellow (#F0E442), ordered for contrast between neighbours.
OKABE_ITO: tuple[str, ...] = ("#0072B2", "#D55E00", "#009E73", "#CC79A7", "#E69F00",
                              "#56B4E9", "#000000")
# the arms' order, colours and labels and the strategies' order and dash styles are
# crucible.grid.names's (defined once there); the strategies' marker symbols are the dashboards'
STRATEGY_SYMBOL: dict[str, str] = {"skip": "circle", "drop": "square", "drop_extend": "diamond",
                                   "reroute": "triangle-up"}
# Fill patterns for the fault timeline's bars (empty = solid fill).
STRATEGY_PATTERN: dict[str, str] = {"skip": "", "drop": "/", "drop_extend": "x", "reroute": "."}

FONT_FAMILY = "system-ui, -apple-system, 'Segoe UI', Roboto, Helvetica, Arial, sans-serif"


def arm_color(compression: str) -> str:
    """The colour of a compression arm: fixed for the known arms, stable for any other name."""
    if compression in ARM_COLOR:
        return ARM_COLOR[compression]
    # A stable, process-independent pick (hash() is salted per process).
    index = sum(compression.encode()) % len(OKABE_ITO)
    return OKABE_ITO[index]


def arm_label(compression: str) -> str:
    """The human name of a compression arm (`none` reads as `uncompressed`)."""
    return ARM_LABEL.get(compression, compression)


def series_name(compression: str, strategy: str) -> str:
    """Legend name of one arm x strategy curve, e.g. `SSN · skip`."""
    return f"{arm_label(compression)} · {strategy}"


def rgba(hex_color: str, alpha: float) -> str:
    """`#RRGGBB` -> `rgba(r,g,b,alpha)` (for translucent confidence bands)."""
    value = hex_color.lstrip("#")
    red, green, blue = (int(value[i:i + 2], 16) for i in (0, 2, 4))
    return f"rgba({red},{green},{blue},{alpha})"


def base_layout(fig: go.Figure, *, title: str, x_title: str, y_title: str,
                height: int = 460, legend_title: str | None = None) -> go.Figure:
    """Apply the house layout: white template, readable fonts, legend on the right.

    Width is left to the page (figures are responsive), so they read at laptop width.
    """
    fig.update_layout(
        template="plotly_white",
        title={"text": title, "x": 0.0, "xanchor": "left", "font": {"size": 18}},
        font={"family": FONT_FAMILY, "size": 13},
        height=height,
        margin={"l": 70, "r": 20, "t": 60, "b": 60},
        legend={"title": {"text": legend_title} if legend_title else None,
                "bgcolor": "rgba(255,255,255,0.85)"},
        hoverlabel={"font": {"family": FONT_FAMILY}},
    )
    fig.update_xaxes(title_text=x_title, showline=True, linecolor="#888", ticks="outside",
                     zeroline=False)
    fig.update_yaxes(title_text=y_title, showline=True, linecolor="#888", ticks="outside")
    return fig


def empty_figure(*, title: str, message: str, height: int = 300) -> go.Figure:
    """A figure with no data that says why (used instead of a blank plot)."""
    fig = go.Figure()
    fig.update_layout(
        template="plotly_white", title={"text": title, "x": 0.0, "xanchor": "left"},
        font={"family": FONT_FAMILY, "size": 13}, height=height,
        xaxis={"visible": False}, yaxis={"visible": False},
        annotations=[{"text": message, "showarrow": False, "xref": "paper", "yref": "paper",
                      "x": 0.5, "y": 0.5, "font": {"size": 15, "color": "#555"}}],
    )
    return fig


P_AXIS_TITLE = "Failure probability per replica per global step (%)"
# a baseline (p = 0) has no strategy of its own (the registry stores None); it is drawn with each
# strategy of its arm, and under this name only when its arm has no failure run yet
BASELINE_LABEL = "baseline"


def finite(value: Any) -> bool:
    """True for an int or float that is finite (bools are not numbers here)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def group_order(key: tuple[str, str]) -> tuple[int, str, int, str]:
    """Known arms first in their canonical order (crucible.grid.names.ARMS), then strategies in
    the study's order."""
    arm, strategy = key
    arm_rank = ARMS.index(arm) if arm in ARMS else len(ARMS)
    strat_rank = STRATEGIES.index(strategy) if strategy in STRATEGIES else len(STRATEGIES)
    return (arm_rank, arm, strat_rank, strategy)


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


def legend_below(fig: go.Figure) -> None:
    """A horizontal legend under the x-axis title (anchored to the container, not the axes),
    with a bottom margin sized to its entries so it never overlaps the title or is cut off."""
    names = [str(t.name) for t in fig.data if t.showlegend is not False and t.name]
    extra = _LEGEND_ROW_PX * _legend_rows(names)
    fig.update_layout(legend={"orientation": "h", "x": 0, "xanchor": "left", "y": 0,
                              "yanchor": "bottom", "yref": "container"},
                      margin={"b": 64 + extra})
    fig.update_layout(height=(fig.layout.height or 450) + extra)

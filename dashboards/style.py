"""Shared look of every dashboard figure: palette, line styles, labels and the base layout.

Colours come from the Okabe-Ito palette (safe for the common colour-vision deficiencies; its
yellow is left out because it vanishes on white). Compression arms get colours, mitigation
strategies get dash styles and marker symbols, so a curve stays identifiable in greyscale too.
"""
from __future__ import annotations

import plotly.graph_objects as go

__all__ = ["OKABE_ITO", "STRATEGY_DASH", "STRATEGY_SYMBOL", "STRATEGY_PATTERN", "arm_color",
           "arm_label", "series_name", "rgba", "base_layout", "empty_figure", "STRATEGY_ORDER"]

# Okabe-Ito without yellow (#F0E442), ordered for contrast between neighbours.
OKABE_ITO: tuple[str, ...] = ("#0072B2", "#D55E00", "#009E73", "#CC79A7", "#E69F00",
                              "#56B4E9", "#000000")
_KNOWN_ARMS: dict[str, str] = {"none": "#0072B2", "ssn": "#D55E00", "mapl": "#009E73"}
_ARM_LABELS: dict[str, str] = {"none": "uncompressed", "ssn": "SSN", "mapl": "MAPL"}

STRATEGY_ORDER: tuple[str, ...] = ("skip", "drop", "drop_extend", "reroute")
STRATEGY_DASH: dict[str, str] = {"skip": "solid", "drop": "dash", "drop_extend": "dot",
                                 "reroute": "dashdot"}
STRATEGY_SYMBOL: dict[str, str] = {"skip": "circle", "drop": "square", "drop_extend": "diamond",
                                   "reroute": "triangle-up"}
# Fill patterns for the fault timeline's bars (empty = solid fill).
STRATEGY_PATTERN: dict[str, str] = {"skip": "", "drop": "/", "drop_extend": "x", "reroute": "."}

FONT_FAMILY = "system-ui, -apple-system, 'Segoe UI', Roboto, Helvetica, Arial, sans-serif"


def arm_color(compression: str) -> str:
    """The colour of a compression arm: fixed for the known arms, stable for any other name."""
    if compression in _KNOWN_ARMS:
        return _KNOWN_ARMS[compression]
    # A stable, process-independent pick (hash() is salted per process).
    index = sum(compression.encode()) % len(OKABE_ITO)
    return OKABE_ITO[index]


def arm_label(compression: str) -> str:
    """The human name of a compression arm (`none` reads as `uncompressed`)."""
    return _ARM_LABELS.get(compression, compression)


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


"""The document's figures: `build_figures` makes the Plotly figures (Figure 3, the extras, the
alignment figure of crucible.study.alignment) and `write_figures` renders them to PNG in
headless Chromium through Playwright.
"""
from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from crucible.grid.key import CellKey
from crucible.grid.names import ARM_COLOR, ARM_LABEL, ARMS, STRATEGY_DASH
from crucible.grid.spec import SweepSpec
from crucible.runfiles import write_bytes_atomic
from crucible.stats import BLOG_SKIP, CLAIM_PS, TABLE1_ARMS
from crucible.study.data import StudyData
from crucible.study.spec import FigureError

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--no-sandbox", "--headless", "--disable-gpu", "--disable-background-networking"]


def figure_files(spec: SweepSpec) -> dict[str, Path]:
    return {"figure3": spec.figures_dir / f"{spec.name}-figure3.png",
            "extras": spec.figures_dir / f"{spec.name}-extras.png",
            "alignment": spec.figures_dir / f"{spec.name}-alignment.png"}


_FONT = "DejaVu Sans, Liberation Sans, Arial, sans-serif"


def _rgba(hex_color: str, alpha: float) -> str:
    value = hex_color.lstrip("#")
    r, g, b = (int(value[i:i + 2], 16) for i in (0, 2, 4))
    return f"rgba({r},{g},{b},{alpha})"


def build_figures(data: StudyData) -> dict[str, Any]:
    """Plotly figures: 'figure3' (degradation against p per arm, skip solid and drop dashed,
    95% bands, the blog's skip points) and 'extras' (every cell at the extras' p with its
    interval)."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    arms = [a for a in TABLE1_ARMS if any(k.arm == a for k in data.grid())] or list(TABLE1_ARMS)
    fig = make_subplots(rows=1, cols=len(arms), shared_yaxes=True, horizontal_spacing=0.04,
                        subplot_titles=[ARM_LABEL[a] for a in arms])
    for col, arm in enumerate(arms, start=1):
        color = ARM_COLOR[arm]
        for strategy in ("skip", "drop"):
            points = [(0.0, 0.0, 0.0, 0.0, len(data.baseline(arm)))]
            for p in sorted(k.p for k in data.grid() if k.arm == arm
                            and k.strategy == strategy and not k.label):
                s = data.stat(CellKey(arm, strategy, p))
                if s.mean is not None:
                    points.append((p, s.mean, s.lo if s.lo is not None else s.mean,
                                   s.hi if s.hi is not None else s.mean, s.n))
            if len(points) < 2:
                continue
            xs = [pt[0] for pt in points]
            banded = [pt for pt in points if pt[4] >= 2]
            if len(banded) >= 2:
                fig.add_trace(go.Scatter(
                    x=[pt[0] for pt in banded] + [pt[0] for pt in reversed(banded)],
                    y=[pt[3] for pt in banded] + [pt[2] for pt in reversed(banded)],
                    mode="lines", fill="toself",
                    fillcolor=_rgba(color, 0.18 if strategy == "skip" else 0.10),
                    line={"width": 0}, hoverinfo="skip", showlegend=False), row=1, col=col)
            fig.add_trace(go.Scatter(
                x=xs, y=[pt[1] for pt in points], mode="lines+markers",
                name=f"{strategy} ({'solid' if strategy == 'skip' else 'dashed'})",
                showlegend=col == 1, legendgroup=strategy,
                line={"color": color, "dash": STRATEGY_DASH[strategy], "width": 2.5},
                marker={"size": 8, "color": color,
                        "symbol": ["circle" if pt[4] >= 2 else "circle-open"
                                   for pt in points]}), row=1, col=col)
        blog = [(p, BLOG_SKIP[(arm, p)]) for p in CLAIM_PS]
        fig.add_trace(go.Scatter(x=[b[0] for b in blog], y=[b[1] for b in blog], mode="markers",
                                 name="blog (skip)" if col == 1 else None, showlegend=col == 1,
                                 marker={"symbol": "x-thin", "size": 12, "color": "#000",
                                         "line": {"width": 2, "color": "#000"}}),
                      row=1, col=col)
        fig.add_hline(y=0.0, line={"color": "#999", "width": 1}, row=1, col=col)
        fig.update_xaxes(title_text="failure probability p", row=1, col=col,
                         tickvals=[0.0, *sorted({k.p for k in data.grid()
                                                 if k.p <= 0.5 and not k.label})] or None)
    fig.update_yaxes(title_text="final val loss vs p = 0 (%)", row=1, col=1)
    fig.update_layout(template="plotly_white", font={"family": _FONT, "size": 14},
                      title={"text": "Figure 3: degradation against p (skip solid, drop "
                                     "dashed; 95% bands over seeds)", "x": 0.01},
                      margin={"l": 80, "r": 30, "t": 90, "b": 70}, width=1200, height=480,
                      legend={"x": 0.01, "y": 0.99, "bgcolor": "rgba(255,255,255,0.85)",
                              "bordercolor": "#ccc", "borderwidth": 1})

    # Extras: every cell at each p where an extra strategy or variant was run.
    extra_ps = sorted({k.p for k in data.grid() if k.label or k.strategy not in ("skip", "drop")})
    extras = go.Figure()
    for p in extra_ps:
        for arm in ARMS:
            keys = [k for k in data.grid() if k.arm == arm and k.p == p]
            names, means, plus, minus = [], [], [], []
            for key in keys:
                s = data.stat(key)
                if s.mean is None:
                    continue
                names.append(f"{ARM_LABEL[arm]} {key.strategy}"
                             + (f" {key.label}" if key.label else "")
                             + (f" (p={p:g})" if len(extra_ps) > 1 else ""))
                means.append(s.mean)
                plus.append((s.hi - s.mean) if s.hi is not None else 0.0)
                minus.append((s.mean - s.lo) if s.lo is not None else 0.0)
            if names:
                extras.add_trace(go.Scatter(
                    x=names, y=means, mode="markers", name=ARM_LABEL[arm],
                    marker={"size": 10, "color": ARM_COLOR[arm]},
                    error_y={"type": "data", "array": plus, "arrayminus": minus,
                             "color": ARM_COLOR[arm], "thickness": 2, "width": 6}))
    extras.add_hline(y=0.0, line={"color": "#999", "width": 1})
    extras.update_layout(template="plotly_white", font={"family": _FONT, "size": 14},
                         title={"text": "All strategies and variants at "
                                + ", ".join(f"p = {p:g}" for p in extra_ps)
                                + " (95% intervals over seeds)", "x": 0.01},
                         yaxis_title="final val loss vs p = 0 (%)", width=1200, height=480,
                         margin={"l": 80, "r": 30, "t": 70, "b": 150}, showlegend=True)
    figures = {"figure3": fig, "extras": extras}
    from crucible.study.alignment import alignment_figure

    aligned = alignment_figure(data, ARM_COLOR, ARM_LABEL, _FONT)
    if aligned is not None:
        figures["alignment"] = aligned
    return figures


def write_figures(figures: Mapping[str, Any], paths: Mapping[str, Path], *, scale: int = 2
                  ) -> list[Path]:
    """Render each Plotly figure to PNG in headless Chromium (/usr/bin/chromium, driven by
    Playwright; plotly.js inlined from the plotly package, no network) with Plotly.toImage.
    Raises StudyError when Chromium or Playwright is missing."""
    if not CHROMIUM.exists():
        raise FigureError(f"{CHROMIUM} is missing, so the figures cannot be rendered: install "
                         "Debian's chromium (`make system-deps`), or pass --no-figures")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        raise FigureError("playwright is not installed (`pip install -e .[dev]`); or pass "
                         "--no-figures") from None

    import plotly

    plotly_js = (Path(plotly.__file__).parent / "package_data" / "plotly.min.js").read_text(
        encoding="utf-8")
    page_html = ('<!DOCTYPE html><html><head><meta charset="utf-8"><script>' + plotly_js
                 + '</script></head><body><div id="fig"></div></body></html>')
    script = """async ([spec, scale]) => {
        const fig = JSON.parse(spec);
        const gd = document.getElementById('fig');
        await Plotly.newPlot(gd, fig.data, fig.layout, {staticPlot: true});
        return await Plotly.toImage(gd, {format: 'png', width: fig.layout.width,
                                         height: fig.layout.height, scale: scale});
    }"""
    def shoot() -> list[Path]:
        return _screenshots(sync_playwright, figures, paths, page_html, script, scale)

    # Playwright's sync API refuses to run where an asyncio loop is running in this thread
    # (a Prefect flow, a notebook): render in a thread of its own, which has none
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(shoot).result()


def _screenshots(sync_playwright: Any, figures: Mapping[str, Any], paths: Mapping[str, Path],
                 page_html: str, script: str, scale: int) -> list[Path]:
    import base64

    written = []
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), headless=True,
                                             args=CHROMIUM_ARGS)
        try:
            page = browser.new_page()
            # plotly.js is 4.8 MB inline: parsing it on a loaded 2-core machine can pass
            # Playwright's 30 s default
            page.set_default_timeout(180_000)
            page.set_content(page_html, timeout=180_000)
            for name, fig in figures.items():
                url = page.evaluate(script, [fig.to_json(), scale])
                png = base64.b64decode(url.split(",", 1)[1])
                path = paths[name]
                write_bytes_atomic(path, png)
                written.append(path)
        finally:
            browser.close()
    return written

"""The alignment hypothesis, tested on a study's data: does how compatible an inner stage's
input and output are (crucible.alignment, recorded in every baseline's summary) predict what a model
that trains through skips loses?

For every arm and seed with both a baseline that recorded `alignment` and a result of skip at
the grid's highest failure rate (unlabelled cell), one point: the baseline's alignment numbers
averaged over its inner stages against that seed's trained skip degradation. Correlations are
Pearson's r with a 95% interval from Fisher's z, once pooled over arms and once within arms
(both variables centred on their arm's mean, one degree of freedom spent per arm), because a
pooled correlation can come from the arms alone: SSN differs from uncompressed in many ways at
once. A metric "predicts" when its within-arm interval lies wholly on the side the hypothesis
says. Stdlib only.
"""
from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from statistics import NormalDist
from typing import Any

__all__ = ["METRICS", "AlignmentPoint", "Correlation", "alignment_points", "correlation",
           "alignment_section", "alignment_figure"]

# metric key, label, the sign of the correlation with degradation the hypothesis predicts
METRICS: tuple[tuple[str, str, int], ...] = (
    ("cka", "CKA(stage input, stage output)", -1),
    ("update_ratio", "stage update / input (norms)", +1),
    ("bypass_damage_pct", "instant bypass damage (%)", +1),
    ("angle_mean_deg", "mean principal angle between the stage's bases (deg)", +1),
)
Z95 = NormalDist().inv_cdf(0.975)


@dataclass(frozen=True)
class AlignmentPoint:
    arm: str
    seed: int
    metrics: dict[str, float]
    degradation: float


@dataclass(frozen=True)
class Correlation:
    n: int
    r: float | None
    lo: float | None
    hi: float | None

    def reads_as(self, sign: int) -> str:
        if self.lo is None or self.hi is None:
            return "too few points"
        if (sign > 0 and self.lo > 0) or (sign < 0 and self.hi < 0):
            return "predicts"
        if (sign > 0 and self.hi < 0) or (sign < 0 and self.lo > 0):
            return "contradicts"
        return "not resolved"


def alignment_points(data: Any, p: float | None = None) -> list[AlignmentPoint]:
    """The (arm, seed) points of a StudyData at skip, failure rate `p` (default: the grid's
    highest p of an unlabelled skip cell)."""
    from crucible.grid.names import ARMS

    skip_ps = sorted(k.p for k in data.grid() if k.strategy == "skip" and not k.label)
    if not skip_ps:
        return []
    p = skip_ps[-1] if p is None else p
    points = []
    for arm in ARMS:
        key = data.find(arm, "skip", p)
        if key is None:
            continue
        degradation = data.degradation(key)
        for seed, base in sorted(data.baseline(arm).items()):
            stages = (base.get("alignment") or {}).get("stages") or []
            if seed not in degradation or not stages:
                continue
            metrics = {}
            for name, _, _ in METRICS:
                values = [row[name] for row in stages
                          if isinstance(row.get(name), int | float)
                          and not isinstance(row.get(name), bool) and math.isfinite(row[name])]
                if values:
                    metrics[name] = statistics.fmean(values)
            points.append(AlignmentPoint(arm, seed, metrics, degradation[seed]))
    return points


def correlation(xs: Sequence[float], ys: Sequence[float], *, spent: int = 0) -> Correlation:
    """Pearson's r with a 95% Fisher-z interval; `spent` extra degrees of freedom already used
    (arm means). No interval below 4 effective points or when a variable is constant."""
    n = len(xs)
    if n < 3 or not all(math.isfinite(v) for v in (*xs, *ys)):
        return Correlation(n, None, None, None)
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxy = math.fsum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True))
    sxx = math.fsum((x - mx) ** 2 for x in xs)
    syy = math.fsum((y - my) ** 2 for y in ys)
    if sxx <= 0 or syy <= 0:
        return Correlation(n, None, None, None)
    r = max(-1.0, min(1.0, sxy / math.sqrt(sxx * syy)))
    dof = n - 3 - spent
    if dof < 1 or abs(r) == 1.0:
        return Correlation(n, r, None, None)
    z, se = math.atanh(r), 1.0 / math.sqrt(dof)
    return Correlation(n, r, math.tanh(z - Z95 * se), math.tanh(z + Z95 * se))


def _within(points: Sequence[AlignmentPoint], metric: str) -> Correlation:
    """Within-arm r: an arm whose metric does not vary (SSN's angles are 0 by construction)
    says nothing within itself and is left out, points and degree of freedom alike."""
    by_arm: dict[str, list[AlignmentPoint]] = {}
    for pt in points:
        by_arm.setdefault(pt.arm, []).append(pt)
    by_arm = {arm: group for arm, group in by_arm.items()
              if len({pt.metrics[metric] for pt in group}) > 1}
    xs, ys = [], []
    for group in by_arm.values():
        mx = statistics.fmean(pt.metrics[metric] for pt in group)
        my = statistics.fmean(pt.degradation for pt in group)
        xs += [pt.metrics[metric] - mx for pt in group]
        ys += [pt.degradation - my for pt in group]
    return correlation(xs, ys, spent=max(0, len(by_arm) - 1))


def _fmt(c: Correlation) -> str:
    if c.r is None:
        return f"- (n = {c.n})"
    if c.lo is None or c.hi is None:
        return f"{c.r:+.2f} (n = {c.n}, no interval)"
    return f"{c.r:+.2f} [{c.lo:+.2f}, {c.hi:+.2f}] (n = {c.n})"


# the commit that brought the alignment report (crucible/alignment.py), and recorded commits
# that precede it (`git merge-base --is-ancestor b26d39b 0b95136`): baselines trained from a
# working tree that held the report's code before it was committed
ALIGNMENT_SINCE = "0b95136"
BEFORE_THE_REPORT = ("b26d39b",)


def _which_code(data: Any, points: list[AlignmentPoint]) -> str:
    """Which code computed the baselines' alignment numbers: the commits they record."""
    shas: dict[str, int] = {}
    for pt in points:
        run = data.baseline(pt.arm).get(pt.seed) or {}
        sha = str((run.get("versions") or {}).get("git_sha") or "unknown")[:7]
        shas[sha] = shas.get(sha, 0) + 1
    listed = ", ".join(f"`{sha}` ({n})" for sha, n in sorted(shas.items()))
    early = sum(n for sha, n in shas.items() if sha in BEFORE_THE_REPORT)
    text = (f"Which code computed them: the baselines record the commits {listed}; the report "
            f"entered the code in `{ALIGNMENT_SINCE}`.")
    if early:
        text += (f" {early} baseline{'s' if early != 1 else ''} record a commit before it "
                 f"({', '.join(f'`{s}`' for s in BEFORE_THE_REPORT if s in shas)}): they were "
                 "trained from a working tree that held the report's code before it was "
                 f"committed, so their numbers are that code's, the code `{ALIGNMENT_SINCE}` "
                 "committed, not the recorded commit's (which has no report).")
    return text


def alignment_section(data: Any, labels: Mapping[str, str], figure: str | None
                      ) -> list[str]:
    """The "Alignment" section (Markdown lines); empty when no baseline recorded alignment."""
    points = alignment_points(data)
    if not points:
        return []
    skip_ps = sorted(k.p for k in data.grid() if k.strategy == "skip" and not k.label)
    out = ["## Beyond the blog: does alignment predict the damage of a skip?", "",
           "The third seed text names the thing to watch next: fixed shared projections keep "
           "stage boundaries in one coordinate system, so a bypass hurts less. Every baseline "
           f"recorded, on {_windows_text(data, points)} of its final global model, each inner stage's "
           "compatibility of input and output (crucible/alignment.py: linear CKA, the size of the "
           "stage's update relative to its input, MAPL's principal angles between the stage's "
           "incoming and outgoing bases, SSN's being 0) and the instant damage of skipping it. "
           f"Each point below is one arm and seed: those numbers, averaged over the inner "
           f"stages, against the same seed's trained degradation under skip at p = "
           f"{skip_ps[-1]:g}. Pearson's r with a 95% Fisher-z interval, pooled over arms and "
           "within arms (centred on each arm's means: the pooled r can come from the arms "
           "differing in everything at once); a metric predicts when its within-arm interval "
           "lies wholly on the side the hypothesis says.", ""]
    arms = sorted({pt.arm for pt in points}, key=[pt.arm for pt in points].index)
    out += ["| arm | seeds | " + " | ".join(label for _, label, _ in METRICS)
            + " | skip degradation (%) |",
            "|---|---|" + "---|" * len(METRICS) + "---|"]
    for arm in arms:
        group = [pt for pt in points if pt.arm == arm]
        cells = []
        for name, _, _ in METRICS:
            values = [pt.metrics[name] for pt in group if name in pt.metrics]
            cells.append(f"{statistics.fmean(values):.3g}" if values else "-")
        out.append(f"| {labels.get(arm, arm)} | {len(group)} | " + " | ".join(cells)
                   + f" | {statistics.fmean(pt.degradation for pt in group):+.2f} |")
    out += ["", "| metric | predicted sign | r pooled over arms [95%] | r within arms [95%] | "
            "reads as (within arms) |", "|---|---|---|---|---|"]
    verdicts = []
    for name, label, sign in METRICS:
        usable = [pt for pt in points if name in pt.metrics]
        pooled = correlation([pt.metrics[name] for pt in usable],
                             [pt.degradation for pt in usable])
        within = _within(usable, name) if usable else Correlation(0, None, None, None)
        reads = within.reads_as(sign)
        verdicts.append((label, reads))
        out.append(f"| {label} | {'+' if sign > 0 else '-'} | {_fmt(pooled)} | {_fmt(within)} "
                   f"| {reads} |")
    predicting = [label for label, reads in verdicts if reads == "predicts"]
    against = [label for label, reads in verdicts if reads == "contradicts"]
    caveat = (f" {len(METRICS)} metrics are tested at 95% each, uncorrected: with no effect at "
              f"all, one of them excluding 0 by chance has a probability of about "
              f"{100 * (1 - 0.95 ** len(METRICS)):.0f}%.")
    if predicting or against:
        parts = []
        if predicting:
            parts.append("; ".join(predicting) + " predict" + ("s" if len(predicting) == 1
                                                              else "")
                         + " the trained skip degradation in the direction the hypothesis says")
        if against:
            parts.append("; ".join(against) + " run" + ("s" if len(against) == 1 else "")
                         + " against it")
        verdict = "Verdict: within arms, " + ", and ".join(parts) + "." + caveat
    else:
        verdict = ("Verdict: not resolved: no alignment metric's within-arm interval excludes "
                   "0, so at these seeds alignment does not measurably predict the trained "
                   "skip degradation.")
    out += ["", verdict, "", _which_code(data, points), ""]
    if figure:
        out += [f"![Alignment against trained skip degradation]({figure})", ""]
    return out


def _windows_text(data: Any, points: Sequence[AlignmentPoint]) -> str:
    counts = sorted({(data.baseline(pt.arm)[pt.seed].get("alignment") or {}).get("windows")
                     for pt in points} - {None})
    if not counts:
        return "held-out windows"
    text = f"{counts[0]:,}" if len(counts) == 1 else f"{counts[0]:,}-{counts[-1]:,}"
    return f"{text} held-out windows (evenly spaced over the split)"


def alignment_figure(data: Any, colors: Mapping[str, str], labels: Mapping[str, str],
                     font: str) -> Any | None:
    """Two panels: instant bypass damage and CKA against the trained skip degradation, one
    point per arm and seed; None without points."""
    points = alignment_points(data)
    if not points:
        return None
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    fig = make_subplots(rows=1, cols=2, shared_yaxes=True, horizontal_spacing=0.06,
                        subplot_titles=["instant bypass damage (%)",
                                        "CKA(stage input, stage output)"])
    for arm in sorted({pt.arm for pt in points}, key=[pt.arm for pt in points].index):
        group = [pt for pt in points if pt.arm == arm]
        for col, name in ((1, "bypass_damage_pct"), (2, "cka")):
            fig.add_trace(go.Scatter(
                x=[pt.metrics.get(name) for pt in group], y=[pt.degradation for pt in group],
                mode="markers", name=labels.get(arm, arm), showlegend=col == 1,
                marker={"size": 9, "color": colors.get(arm, "#444")},
                text=[f"seed {pt.seed}" for pt in group]), row=1, col=col)
    fig.update_yaxes(title_text="trained skip degradation (%)", row=1, col=1)
    fig.update_layout(template="plotly_white", font={"family": font, "size": 14}, width=1200,
                      height=480, margin={"l": 80, "r": 30, "t": 60, "b": 60},
                      title={"text": "Alignment of each baseline against its seed's trained "
                             "skip degradation", "x": 0.01})
    return fig

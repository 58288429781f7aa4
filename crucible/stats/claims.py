"""The blog's claims, decided by explicit rules on paired 95% intervals.

Input: per grid cell (`crucible.grid.key.CellKey`: arm, strategy, p, label), the per-seed
degradations in points (100 (L - L0) / L0 against the same seed's baseline,
`crucible.stats.pairing`). A cell that is planned but has no usable run yet maps to an empty
dict, so its comparisons read "missing" rather than vanishing. The same function decides the
claims for the study document, REST (`GET /api/v1/sweeps/{ref}/claims`), the sweep page's
Claims panel and the Prefect artifact.

Claims (a)-(d) are the blog's, (e) the seed texts' reading of it at p = 0.01. Each comparison
supports, contradicts, or leaves its claim unresolved; a claim agrees when all its comparisons
support it, disagrees when any contradicts it. Where the references give a number for a
comparison's quantity, it is carried as `reference`: by default the blog's Table 1 (its skip
column); a spec may give its own (`SweepSpec.references`, {(arm, strategy, p): pct}), and may
decide only some of the claims (`SweepSpec.claims`).
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from crucible.grid.key import CellKey
from crucible.grid.names import ARM_LABEL, ARMS
from crucible.stats.intervals import (
    MAX_SEEDS,
    Stat,
    paired_stat,
    seeds_to_decide,
    slope,
    stat_of,
)

__all__ = ["Comparison", "Claim", "evaluate_claims", "BLOG_REFERENCES", "References", "claims_to_dict", "skip_minus_drop",
           "growth_slopes", "BLOG_SKIP", "BLOG_DROP", "CLAIM_PS", "LOW_P", "TABLE1_ARMS",
           "AGREES", "DISAGREES", "NOT_RESOLVED", "NOT_RUN", "SUPPORTS", "CONTRADICTS",
           "UNRESOLVED", "MISSING", "claim_rows", "CLAIM_COLUMNS"]

# The blog (178M, R = 8, S = 4, failures last 6 global steps): Table 1, skip.
BLOG_SKIP: dict[tuple[str, float], float] = {
    ("ssn", 0.1): 0.6, ("mapl", 0.1): 0.9, ("none", 0.1): 0.9,
    ("ssn", 0.2): 0.9, ("mapl", 0.2): 1.1, ("none", 0.2): 1.2,
}
BLOG_DROP = "+3.4-3.6%"
# the same as references: (arm, strategy, p) -> degradation in % of the loss
References = Mapping[tuple[str, str, float], float]
BLOG_REFERENCES: dict[tuple[str, str, float], float] = {
    (arm, "skip", p): value for (arm, p), value in BLOG_SKIP.items()}
CLAIM_PS: tuple[float, ...] = (0.1, 0.2)                        # Table 1's failure rates
LOW_P = 0.01      # the seed texts' reading of the blog: "at 1% ... stays close to baseline"
TABLE1_ARMS: tuple[str, ...] = ("ssn", "mapl", "none")          # the blog's column order

AGREES, DISAGREES, NOT_RESOLVED, NOT_RUN = "agrees", "disagrees", "not resolved", "not run yet"
SUPPORTS, CONTRADICTS, UNRESOLVED, MISSING = "supports", "contradicts", "unresolved", "missing"

Cells = Mapping[CellKey, Mapping[int, float]]


@dataclass(frozen=True)
class Comparison:
    label: str
    stat: Stat
    status: str          # SUPPORTS, CONTRADICTS, UNRESOLVED or MISSING
    margin: float | None = None     # band rules: the band's half-width; sign rules: None
    reference: float | None = None  # the blog's value of the same quantity, where it gives one
    # what one more seed of it takes: its failure cells (arm, strategy, p) and the arms whose
    # p = 0 baseline each seed also needs (the price of a seed: crucible.study.price)
    cells: tuple[tuple[str, str, float], ...] = ()
    baselines: tuple[str, ...] = ()

    @property
    def seeds_to_decide(self) -> int | None:
        """Seeds its measured mean and sd say would decide it (None: over MAX_SEEDS, or no
        sd yet); only meaningful while it is unresolved."""
        if self.stat.mean is None or self.stat.sd is None:
            return None
        return seeds_to_decide(self.stat.mean, self.stat.sd, margin=self.margin)


@dataclass(frozen=True)
class Claim:
    tag: str
    title: str
    blog: str
    quantity: str
    rule: str
    comparisons: tuple[Comparison, ...]

    @property
    def verdict(self) -> str:
        """NOT_RUN while no comparison has a single seed; a comparison with one seed has no
        interval (MISSING) and leaves its claim NOT_RESOLVED, never decided."""
        statuses = [c.status for c in self.comparisons]
        if all(c.stat.n == 0 for c in self.comparisons):
            return NOT_RUN
        if CONTRADICTS in statuses:
            return DISAGREES
        if all(s == SUPPORTS for s in statuses):
            return AGREES
        return NOT_RESOLVED

    def count(self, status: str) -> int:
        return sum(1 for c in self.comparisons if c.status == status)

    def seeds_to_decide(self) -> tuple[int, int] | None:
        """(seeds, comparisons over MAX_SEEDS) that would decide every unresolved comparison
        if their means and sds stay as measured: the costliest comparison's count, since the
        claim is decided only when all are; None when none is unresolved."""
        open_ = [c for c in self.comparisons if c.status == UNRESOLVED]
        if not open_:
            return None
        needs = [c.seeds_to_decide for c in open_]
        known = [n for n in needs if n is not None]
        return (max(known) if known else 0), sum(1 for n in needs if n is None)

    @property
    def without_sd(self) -> int:
        """Comparisons with fewer than 2 seeds: no sd yet, so no count of the seeds they need
        (a second seed first)."""
        return sum(1 for c in self.comparisons if c.status == MISSING)


def _sign_status(s: Stat, expect: str) -> str:
    """`expect` "below" or "above" 0: supports when the whole interval is on that side,
    contradicts when it is wholly on the other side, unresolved when it contains 0."""
    if s.n < 2 or s.lo is None or s.hi is None:
        return MISSING
    below, above = s.hi < 0.0, s.lo > 0.0
    if (below and expect == "below") or (above and expect == "above"):
        return SUPPORTS
    if below or above:
        return CONTRADICTS
    return UNRESOLVED


def _band_status(s: Stat, margin: float) -> str:
    """Supports when the interval lies inside [-margin, +margin], contradicts when it lies
    wholly outside it, unresolved otherwise."""
    if s.n < 2 or s.lo is None or s.hi is None:
        return MISSING
    if -margin <= s.lo and s.hi <= margin:
        return SUPPORTS
    if s.lo > margin or s.hi < -margin:
        return CONTRADICTS
    return UNRESOLVED


def _find(cells: Cells, arm: str, strategy: str, p: float) -> Mapping[int, float] | None:
    return cells.get(CellKey(arm, strategy, p))


def _core_ps(cells: Cells, arm: str, strategy: str) -> list[float]:
    return sorted(k.p for k in cells if k.arm == arm and k.strategy == strategy
                  and not k.label and k.p > 0)


def skip_minus_drop(cells: Cells) -> list[tuple[str, float, Stat]]:
    """Per (arm, p) present for both skip and drop: the paired difference of degradations,
    skip - drop, over the seeds that have both (points of %)."""
    rows = []
    for arm in ARMS:
        for p in _core_ps(cells, arm, "skip"):
            skip, drop = _find(cells, arm, "skip", p), _find(cells, arm, "drop", p)
            if skip is None or drop is None:
                continue
            rows.append((arm, p, paired_stat(skip, drop)))
    return rows


def growth_slopes(cells: Cells) -> list[tuple[str, str, list[float], Stat]]:
    """Per arm x {skip, drop}: the least-squares slope of degradation over the grid's failure
    rates p > 0 (at least two), per seed with every p present, in points per 0.1 of p. p = 0 is
    left out: its degradation is 0 by definition, and through that point any positive
    degradation would read as growth."""
    rows = []
    for arm in ARMS:
        for strategy in ("skip", "drop"):
            ps = _core_ps(cells, arm, strategy)
            if len(ps) < 2:
                continue
            per_p = {p: cells[CellKey(arm, strategy, p)] for p in ps}
            seeds = set.intersection(*(set(values) for values in per_p.values()))
            slopes = {s: 0.1 * slope([(p, per_p[p][s]) for p in ps]) for s in seeds}
            rows.append((arm, strategy, ps, stat_of(slopes)))
    return rows


def _arm_pairs(cells: Cells, arm: str, others: Sequence[str]) -> list[tuple[str, float, Stat]]:
    rows = []
    for p in CLAIM_PS:
        mine = _find(cells, arm, "skip", p)
        for other in others:
            theirs = _find(cells, other, "skip", p)
            if mine is None or theirs is None:
                continue
            rows.append((other, p, paired_stat(mine, theirs)))
    return rows


def _ref_diff(refs: References, a: tuple[str, str, float],
              b: tuple[str, str, float]) -> float | None:
    x, y = refs.get(a), refs.get(b)
    return None if x is None or y is None else round(x - y, 6)


def _ref_slope(refs: References, arm: str, strategy: str, ps: Sequence[float]) -> float | None:
    """The references' slope per 0.1 of p, where they give a value at every p of the grid's
    (over other p it is another quantity)."""
    values = [refs.get((arm, strategy, p)) for p in ps]
    if len(ps) < 2 or any(v is None for v in values):
        return None
    return round(0.1 * slope(list(zip(ps, values, strict=True))), 6)


def _pct(value: float) -> str:
    return f"{value:+g}%"


def _quote(refs: References, keys: Sequence[tuple[str, str, float]]) -> str:
    """What a spec's own references say of a claim's quantities, listed."""
    given = [f"{ARM_LABEL[arm]} {strategy} at p = {p:g}: {_pct(refs[(arm, strategy, p)])}"
             for arm, strategy, p in keys if (arm, strategy, p) in refs]
    return ("the spec's references: " + "; ".join(given)) if given else \
        "no reference value in the spec's references"


def evaluate_claims(cells: Cells, *, close_margin: float = 0.5,
                    equivalence_margin: float = 0.5, references: References | None = None,
                    only: Sequence[str] | None = None) -> list[Claim]:
    """The blog's four claims (a)-(d) and the seed texts' reading of it at p = 0.01 (e), each
    decided by an explicit rule on paired 95% intervals; `cells` maps each planned cell to its
    per-seed degradations (module docstring). `references` (default the blog's) give the
    comparisons' reference values; `only` keeps those claims (tags), in their order."""
    margin, band = close_margin, equivalence_margin
    refs = BLOG_REFERENCES if references is None else references
    a = tuple(Comparison(f"{ARM_LABEL[arm]}, p = {p:g}", s, _sign_status(s, "below"),
                         reference=_ref_diff(refs, (arm, "skip", p), (arm, "drop", p)),
                         cells=((arm, "skip", p), (arm, "drop", p)), baselines=(arm,))
              for arm, p, s in skip_minus_drop(cells))
    b = tuple(Comparison(f"{ARM_LABEL[arm]}, {strategy}", s, _sign_status(s, "above"),
                         reference=_ref_slope(refs, arm, strategy, ps),
                         cells=tuple((arm, strategy, p) for p in ps), baselines=(arm,))
              for arm, strategy, ps, s in growth_slopes(cells))
    c = tuple(Comparison(f"SSN - {ARM_LABEL[other]}, p = {p:g}", s, _sign_status(s, "below"),
                         reference=_ref_diff(refs, ("ssn", "skip", p), (other, "skip", p)),
                         cells=(("ssn", "skip", p), (other, "skip", p)),
                         baselines=("ssn", other))
              for other, p, s in _arm_pairs(cells, "ssn", ("mapl", "none")))
    d = tuple(Comparison(f"MAPL - uncompressed, p = {p:g}", s, _band_status(s, margin), margin,
                         reference=_ref_diff(refs, ("mapl", "skip", p), ("none", "skip", p)),
                         cells=(("mapl", "skip", p), ("none", "skip", p)),
                         baselines=("mapl", "none"))
              for _, p, s in _arm_pairs(cells, "mapl", ("none",)))
    e = tuple(Comparison(f"{ARM_LABEL[arm]}, skip, p = {LOW_P:g}", s, _band_status(s, band), band,
                         reference=refs.get((arm, "skip", LOW_P)),
                         cells=((arm, "skip", LOW_P),), baselines=(arm,))
              for arm in ARMS for values in [_find(cells, arm, "skip", LOW_P)]
              if values is not None for s in [stat_of(values)])
    quotes = _blog_quotes() if references is None else {
        tag: _quote(refs, keys) for tag, keys in _quoted_keys(cells).items()}
    claims = _claims(quotes, margin, band, (a, b, c, d, e))
    return claims if only is None else [claim for claim in claims if claim.tag in only]


def _quoted_keys(cells: Cells) -> dict[str, list[tuple[str, str, float]]]:
    """Per claim, the (arm, strategy, p) whose references speak to it."""
    ps = sorted({k.p for k in cells if not k.label and k.p > 0} | set(CLAIM_PS))
    both = [(arm, strategy, p) for arm in ARMS for p in ps for strategy in ("skip", "drop")]
    skip_at = [(arm, "skip", p) for p in CLAIM_PS for arm in TABLE1_ARMS]
    return {"a": both, "b": both, "c": skip_at, "d": [k for k in skip_at if k[0] != "ssn"],
            "e": [(arm, "skip", LOW_P) for arm in TABLE1_ARMS]}


def _blog_quotes() -> dict[str, str]:
    """What the blog (and, for (e), the seed texts) say of each claim."""
    blog_b = ", ".join(f"{ARM_LABEL[arm]} +{BLOG_SKIP[(arm, 0.1)]:.1f} -> "
                       f"+{BLOG_SKIP[(arm, 0.2)]:.1f}%" for arm in TABLE1_ARMS)
    blog_c = "; ".join(f"p = {p:g}: SSN +{BLOG_SKIP[('ssn', p)]:.1f}% vs MAPL "
                       f"+{BLOG_SKIP[('mapl', p)]:.1f}%, uncompressed +{BLOG_SKIP[('none', p)]:.1f}%"
                       for p in CLAIM_PS)
    blog_d = "; ".join(f"p = {p:g}: MAPL +{BLOG_SKIP[('mapl', p)]:.1f}% vs uncompressed "
                       f"+{BLOG_SKIP[('none', p)]:.1f}%" for p in CLAIM_PS)
    return {"a": f"drop {BLOG_DROP} vs skip +0.6-0.9%", "b": f"skip: {blog_b}", "c": blog_c,
            "d": blog_d,
            "e": "\"at a 1% failure probability per replica per global step, validation loss "
                 "stays close to baseline\" (two of the three seed texts)"}


def _claims(quotes: Mapping[str, str], margin: float, band: float,
            comparisons: Sequence[tuple[Comparison, ...]]) -> list[Claim]:
    a, b, c, d, e = comparisons
    return [
        Claim("a", "skip costs less than drop at every p",
              quotes["a"], "skip - drop, points (paired by seed)",
              "agrees if, for every arm and every p > 0 of the grid, the 95% interval of the "
              "paired difference skip - drop lies entirely below 0; disagrees if any lies "
              "entirely above 0; not resolved otherwise (an interval contains 0, or a "
              "comparison has fewer than 2 seeds)", a),
        Claim("b", "degradation grows with p", quotes["b"],
              "slope of degradation over the failure rates p > 0, points per 0.1 of p",
              "per arm and strategy (skip, drop), each seed's least-squares slope of "
              "degradation against p over the grid's p values above 0 (p = 0 left out: its "
              "degradation is 0 by definition); agrees if every "
              "slope's 95% interval lies entirely above 0; disagrees if any lies entirely "
              "below 0; not resolved otherwise", b),
        Claim("c", "SSN degrades least at p = 0.1 and 0.2", quotes["c"],
              "SSN - other arm, skip, points (paired by seed)",
              "at p = 0.1 and 0.2 (skip), the paired differences SSN - MAPL and SSN - "
              "uncompressed; agrees if every 95% interval lies entirely below 0; disagrees if "
              "any lies entirely above 0; not resolved otherwise", c),
        Claim("d", "MAPL is close to uncompressed", quotes["d"],
              "MAPL - uncompressed, skip, points (paired by seed)",
              f"close means within ±{margin:g} points (the spec's close_margin); at p = 0.1 "
              f"and 0.2 (skip), agrees if the 95% interval of the paired difference MAPL - "
              f"uncompressed lies inside [-{margin:g}, +{margin:g}]; disagrees if it lies "
              f"entirely outside that band; not resolved otherwise", d),
        Claim("e", f"at p = {LOW_P:g} the loss stays within ±{band:g} points of its baseline "
              "(the seed texts' reading)", quotes["e"],
              "degradation under skip, points",
              f"an equivalence test: per arm at p = {LOW_P:g} (skip), agrees if the 95% interval "
              f"of the degradation lies inside [-{band:g}, +{band:g}] (the spec's "
              "equivalence_margin; stricter than the usual two one-sided tests, which use a 90% "
              "interval); disagrees if it lies entirely outside; not resolved otherwise", e),
    ]


def _finite(value: float | None) -> float | None:
    return None if value is None or not math.isfinite(value) else value


def claims_to_dict(claims: Sequence[Claim], *, target_half_width: float) -> list[dict[str, Any]]:
    """The REST shape of decided claims (`api.analysis_schemas.ClaimOut`): per claim its verdict,
    the seeds that would decide it, and each comparison's interval, reference value, width
    against the target and the seeds a ±target interval needs."""
    out = []
    for claim in claims:
        need = claim.seeds_to_decide()
        if need is not None and need[0] == 0:      # every open comparison beyond MAX_SEEDS
            need = (None, need[1])
        comparisons = []
        for c in claim.comparisons:
            stat = c.stat.to_dict()
            half = c.stat.half
            comparisons.append({
                "label": c.label, "status": c.status, **stat, "margin": c.margin,
                "reference": c.reference,
                "within_target": None if half is None else half <= target_half_width,
                "seeds_for_target": c.stat.seeds_for(target_half_width),
                "seeds_to_decide": c.seeds_to_decide if c.status == UNRESOLVED else None,
            })
        out.append({
            "tag": claim.tag, "title": claim.title, "blog": claim.blog,
            "quantity": claim.quantity, "rule": claim.rule, "verdict": claim.verdict,
            "counts": {s: claim.count(s) for s in (SUPPORTS, UNRESOLVED, CONTRADICTS, MISSING)},
            "seeds_to_decide": None if need is None else need[0],
            "comparisons_beyond_max_seeds": None if need is None else need[1],
            "max_seeds": MAX_SEEDS, "comparisons": comparisons,
        })
    return out


CLAIM_COLUMNS = ("claim", "verdict", "comparison", "status", "mean", "ci_low", "ci_high",
                 "reference", "half_width", "target_half_width", "seeds_for_target",
                 "seeds_to_decide")


def claim_rows(claims: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The body of `GET /api/v1/sweeps/{id}/claims` (`crucible.stats.sweep_claims`) as flat
    table rows (`CLAIM_COLUMNS`) for the Prefect artifact and the CSV download: one per
    comparison, or one per claim without any; values in points rounded to 3 decimals."""
    def pts(value: float | None) -> float | None:
        return None if value is None else round(value, 3)

    rows = []
    target = claims.get("target_half_width")
    for claim in claims.get("claims", []):
        head = {"claim": f"({claim['tag']}) {claim['title']}", "verdict": claim["verdict"]}
        for comparison in claim["comparisons"] or [None]:
            c = comparison or {}
            rows.append({**head, "comparison": c.get("label"), "status": c.get("status"),
                         "mean": pts(c.get("mean")), "ci_low": pts(c.get("ci_low")),
                         "ci_high": pts(c.get("ci_high")), "reference": c.get("reference"),
                         "half_width": pts(c.get("half_width")), "target_half_width": target,
                         "seeds_for_target": c.get("seeds_for_target"),
                         "seeds_to_decide": c.get("seeds_to_decide")})
    return rows

"""How the document writes numbers, intervals, cell names and the claims' verdicts (also used
by the pilot and scale sections, crucible.study.pilot and crucible.study.scale).
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

from crucible.grid.key import CellKey
from crucible.grid.names import ARM_LABEL
from crucible.stats import (
    AGREES,
    DISAGREES,
    MAX_SEEDS,
    NOT_RESOLVED,
    NOT_RUN,
    Claim,
    Comparison,
    Stat,
    seeds_for_half_width,
)


def _pct(s: Stat, unit: str = "%") -> str:
    """'+0.61% [+0.20, +1.02]', '+0.61% (n=1, no interval)' or 'not run yet'."""
    if s.n == 0 or s.mean is None:
        return "not run yet"
    if s.lo is None or s.hi is None:
        return f"{s.mean:+.2f}{unit} (n=1, no interval)"
    return f"{s.mean:+.2f}{unit} [{s.lo:+.2f}, {s.hi:+.2f}]"


def _pts(s: Stat) -> str:
    return _pct(s, unit="")


def _ci(s: Stat) -> str:
    return "-" if s.lo is None or s.hi is None else f"[{s.lo:+.2f}, {s.hi:+.2f}]"


def _num(value: float | None, fmt: str = ".2f") -> str:
    return "-" if value is None else format(value, fmt)


def _table(header: Sequence[str], rows: Iterable[Sequence[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return lines


def _variant(key: CellKey) -> str:
    return key.label or "-"


def _duration(seconds: float) -> str:
    if seconds >= 3600:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 60:.1f} min"


def _verdict_word(claim: Claim) -> str:
    return {AGREES: "reproduced", DISAGREES: "contradicted", NOT_RESOLVED: "not resolved",
            NOT_RUN: "not run yet"}[claim.verdict]


def _range(values: Sequence[float]) -> str:
    if not values:
        return "n/a"
    lo, hi = min(values), max(values)
    return f"{lo:+.2f}%" if abs(hi - lo) < 0.005 else f"{lo:+.2f}% to {hi:+.2f}%"


def _seeds_for_target(s: Stat, target: float) -> str:
    if s.sd is None:
        return "-"
    n = seeds_for_half_width(s.sd, target)
    return f"> {MAX_SEEDS}" if n is None else str(n)


def _decide_text(c: Comparison) -> str:
    if c.status != "unresolved":
        return "-"
    n = c.seeds_to_decide
    return f"> {MAX_SEEDS}" if n is None else str(n)


def _seeds_needed(claim: Claim) -> str:
    """The seeds that would decide the claim: its costliest open comparison's, with the
    comparisons beyond MAX_SEEDS and those that have no sd yet named beside it."""
    need = claim.seeds_to_decide()
    no_sd = claim.without_sd if claim.verdict not in ("agrees", "disagrees") else 0
    tail = f"{no_sd} comparison{'s' if no_sd != 1 else ''} without an sd yet"
    if need is None:
        return tail if no_sd else "-"
    n, beyond = need
    parts = [] if beyond and not n else [str(n)]
    if beyond:
        parts.append(f"{beyond} comparison{'s' if beyond != 1 else ''} > {MAX_SEEDS}"
                     if n else f"> {MAX_SEEDS}")
    if no_sd:
        parts.append(tail)
    return parts[0] + (f" (and {'; '.join(parts[1:])})" if len(parts) > 1 else "")


def _cell_name(key: CellKey) -> str:
    parts = [ARM_LABEL[key.arm], key.strategy, f"p = {key.p:g}"]
    if key.label:
        parts.append(key.label)
    return " ".join(parts[:2]) + ", " + ", ".join(parts[2:])


def _claim_summary(claim: Claim) -> str:
    stats = [c for c in claim.comparisons if c.stat.n >= 2]
    if not stats:
        if any(c.stat.n for c in claim.comparisons):
            return (f"{len(claim.comparisons)} comparisons, none with 2 seeds yet (one seed "
                    "gives no interval)")
        return "not run yet"
    counts = ", ".join(f"{claim.count(k)} {k}" for k in ("supports", "unresolved", "contradicts",
                                                         "missing") if claim.count(k))
    if claim.tag in ("d", "e"):
        worst = max(stats, key=lambda c: max(abs(c.stat.lo or 0.0), abs(c.stat.hi or 0.0)))
    elif claim.tag == "b":
        worst = min(stats, key=lambda c: c.stat.lo if c.stat.lo is not None else math.inf)
    else:
        worst = max(stats, key=lambda c: c.stat.hi if c.stat.hi is not None else -math.inf)
    return (f"{len(claim.comparisons)} comparisons: {counts}; least favourable: "
            f"{worst.label}: {_pts(worst.stat)}")


def _claim_sentence(claim: Claim) -> str:
    head = f"({claim.tag}) \"{claim.title}\": "
    verdict = claim.verdict
    if verdict == NOT_RUN:
        return head + "not run yet (no comparison has two seeds)."
    listed = "; ".join(f"{c.label}: {_pts(c.stat)}" for c in claim.comparisons
                       if c.status != "missing")
    if verdict == AGREES:
        return head + f"reproduced; every comparison supports it ({listed})."
    against = [c for c in claim.comparisons if c.status == "contradicts"]
    if verdict == DISAGREES:
        return head + ("not reproduced: the data contradict it in "
                       + "; ".join(f"{c.label} ({_pts(c.stat)})" for c in against)
                       + f". All comparisons: {listed}.")
    open_ = [c for c in claim.comparisons if c.status in ("unresolved", "missing")]
    return head + ("not resolved: nothing contradicts it, but these comparisons leave it open "
                   "at 95% (interval across the boundary, or fewer than 2 seeds): "
                   + "; ".join(f"{c.label}: {_pts(c.stat) if c.stat.n else 'not run yet'}"
                               for c in open_) + ".")

"""How many seeds an interval needs: from a measured sd to the seeds that give a 95% t-interval
of a target half-width, or that would decide a claim if the effect is as measured.

Stdlib only (the API may import it). A projection, not a promise: it takes the sd measured on
the seeds at hand as the true one, and an sd from n seeds is itself uncertain (about +-30% at
n = 6, +-17% at n = 20), so a cell reported to need 12 seeds may need 9 or 16.
"""
from __future__ import annotations

import math
from statistics import NormalDist

from crucible.analysis import t_quantile

__all__ = ["half_width", "seeds_for_half_width", "seeds_to_decide", "MAX_SEEDS"]

MAX_SEEDS = 1000      # beyond this a projection is reported as "more than MAX_SEEDS"


def half_width(sd: float, n: int, level: float = 0.95) -> float:
    """Half-width of the `level` Student-t interval of a mean of n values with this sd."""
    if n < 2:
        return math.inf
    return t_quantile(0.5 + level / 2.0, n - 1) * sd / math.sqrt(n)


def seeds_for_half_width(sd: float, target: float, *, at_least: int = 2,
                         cap: int = MAX_SEEDS) -> int | None:
    """The smallest n >= `at_least` whose 95% half-width at this sd is <= `target`; None when
    more than `cap` would be needed (or the target is not positive)."""
    if not (math.isfinite(sd) and sd >= 0) or target <= 0:
        return None
    if sd == 0:
        return max(at_least, 2)
    # the normal approximation is a lower bound; walk up from it (t > z for every n)
    n = max(at_least, 2, math.ceil((NormalDist().inv_cdf(0.975) * sd / target) ** 2))
    while n <= cap:
        if half_width(sd, n) <= target:
            return n
        n += 1
    return None


def seeds_to_decide(mean: float, sd: float, *, margin: float | None = None) -> int | None:
    """Seeds after which, if the mean and sd stay as measured, a 95% interval decides: for a
    sign rule (margin None) it excludes 0; for a band rule (|x| <= margin) it lies wholly
    inside or wholly outside [-margin, margin]. None when more than MAX_SEEDS would be needed
    (an effect at the boundary itself is never decided)."""
    if not (math.isfinite(mean) and math.isfinite(sd)):
        return None
    gap = abs(mean) if margin is None else abs(margin - abs(mean))
    if gap == 0:
        return None
    return seeds_for_half_width(sd, gap)

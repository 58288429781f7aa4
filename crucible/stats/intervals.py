"""Intervals over seeds: the Student-t quantile, a mean with its 95% interval, paired
differences, least-squares slopes, and how many seeds an interval needs.

A projection of seeds is not a promise: it takes the sd measured on the seeds at hand as the
true one, and an sd from n seeds is itself uncertain (about +-30% at n = 6, +-17% at n = 20), so
a cell reported to need 12 seeds may need 9 or 16.
"""
from __future__ import annotations

import functools
import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from statistics import NormalDist

__all__ = ["relative_degradation", "t_quantile", "summarise", "Stat", "stat_of", "paired_stat",
           "slope", "half_width", "seeds_for_half_width", "seeds_to_decide", "MAX_SEEDS",
           "LEVEL", "welch"]

LEVEL = 0.95          # every interval of the project is a two-sided 95% interval
MAX_SEEDS = 1000      # beyond this a projection is reported as "more than MAX_SEEDS"


def relative_degradation(loss: float, baseline: float) -> float:
    """Percentage increase of `loss` over `baseline`: 100 * (loss - baseline) / baseline.

    Raises ValueError for a non-positive or non-finite baseline or a non-finite loss.
    """
    if not (math.isfinite(baseline) and baseline > 0):
        raise ValueError(f"baseline loss must be finite and > 0, got {baseline!r}")
    if not math.isfinite(loss):
        raise ValueError(f"loss must be finite, got {loss!r}")
    return 100.0 * (loss - baseline) / baseline


def _betacf(a: float, b: float, x: float) -> float:
    """Continued fraction of the regularised incomplete beta (modified Lentz)."""
    tiny = 1e-300
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1.0)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 300):
        for num in (m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
                    -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))):
            d = 1.0 + num * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + num / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < 1e-15:
            break
    return h


def _incomplete_beta(a: float, b: float, x: float) -> float:
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    log_front = (math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b)
                 + a * math.log(x) + b * math.log1p(-x))
    if x < (a + 1.0) / (a + b + 2.0):
        return math.exp(log_front) * _betacf(a, b, x) / a
    return 1.0 - math.exp(log_front) * _betacf(b, a, 1.0 - x) / b


def _t_cdf(t: float, df: int) -> float:
    tail = 0.5 * _incomplete_beta(df / 2.0, 0.5, df / (df + t * t))
    return 1.0 - tail if t >= 0 else tail


@functools.lru_cache(maxsize=8192)
def t_quantile(prob: float, df: int) -> float:
    """The `prob` quantile of Student's t with `df` degrees of freedom (bisection on the CDF).
    Cached: a sweep's summary asks for the same few (level, seeds) pairs for every cell, and
    each bisection costs ~1 ms; the study's price section asks for two levels at every df up
    to MAX_SEEDS per comparison (a cache smaller than that recomputed them all, each time)."""
    if not 0.0 < prob < 1.0:
        raise ValueError(f"prob must be in (0, 1), got {prob!r}")
    if df < 1:
        raise ValueError(f"df must be >= 1, got {df!r}")
    lo, hi = -1e3, 1e3
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if mid in (lo, hi):   # lo and hi are adjacent floats: later steps change nothing
            break
        if _t_cdf(mid, df) < prob:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)


def summarise(values: Sequence[float], *, level: float = LEVEL
              ) -> tuple[float, float | None, float | None, int]:
    """Mean of `values` with a two-sided Student-t interval at `level`: (mean, lo, hi, n).

    With n == 1 the bounds are None (no spread to estimate). Raises ValueError for no values.
    """
    n = len(values)
    if n == 0:
        raise ValueError("summarise needs at least one value")
    mean = math.fsum(values) / n
    if n == 1:
        return mean, None, None, 1
    variance = math.fsum((v - mean) ** 2 for v in values) / (n - 1)
    half = t_quantile(0.5 + level / 2.0, n - 1) * math.sqrt(variance / n)
    return mean, mean - half, mean + half, n


@dataclass(frozen=True)
class Stat:
    """Mean of per-seed values with a 95% t-interval (lo/hi None for fewer than 2 seeds)."""
    values: tuple[float, ...] = ()
    seeds: tuple[int, ...] = ()
    mean: float | None = None
    sd: float | None = None
    lo: float | None = None
    hi: float | None = None

    @property
    def n(self) -> int:
        return len(self.values)

    @property
    def half(self) -> float | None:
        return None if self.lo is None or self.hi is None else (self.hi - self.lo) / 2.0

    def seeds_for(self, target: float) -> int | None:
        """Seeds its measured sd says a ±`target` interval needs (None: no sd yet, or more
        than MAX_SEEDS)."""
        return None if self.sd is None else seeds_for_half_width(self.sd, target)

    def to_dict(self) -> dict[str, object]:
        """The REST shape: mean, sd, ci_low, ci_high, half_width, n_seeds, seeds."""
        return {"mean": self.mean, "sd": self.sd, "ci_low": self.lo, "ci_high": self.hi,
                "half_width": self.half, "n_seeds": self.n, "seeds": list(self.seeds)}


def stat_of(by_seed: Mapping[int, float]) -> Stat:
    """Stat of per-seed values: mean, sd and the 95% Student-t interval."""
    seeds = tuple(sorted(by_seed))
    values = tuple(float(by_seed[s]) for s in seeds)
    if not values:
        return Stat()
    mean, lo, hi, _ = summarise(values)
    sd = statistics.stdev(values) if len(values) > 1 else None
    return Stat(values=values, seeds=seeds, mean=mean, sd=sd, lo=lo, hi=hi)


def paired_stat(a: Mapping[int, float], b: Mapping[int, float]) -> Stat:
    """Stat of a - b over the seeds both have."""
    return stat_of({s: a[s] - b[s] for s in a if s in b})


def slope(points: Sequence[tuple[float, float]]) -> float:
    """Least-squares slope of y over x through `points` (at least two distinct x)."""
    mx = statistics.fmean(x for x, _ in points)
    my = statistics.fmean(y for _, y in points)
    sxx = math.fsum((x - mx) ** 2 for x, _ in points)
    return math.fsum((x - mx) * (y - my) for x, y in points) / sxx


def welch(a: Stat, b: Stat) -> tuple[float, float, float] | None:
    """(mean of a - mean of b, lo, hi): the 95% Welch interval of two Stats (floor of the
    Welch-Satterthwaite degrees of freedom, so slightly conservative); None below 2 each."""
    if a.n < 2 or b.n < 2 or a.sd is None or b.sd is None:
        return None
    va, vb = a.sd ** 2 / a.n, b.sd ** 2 / b.n
    se = math.sqrt(va + vb)
    diff = a.mean - b.mean
    if se == 0:
        return diff, diff, diff
    dof = (va + vb) ** 2 / (va ** 2 / (a.n - 1) + vb ** 2 / (b.n - 1))
    t = t_quantile(0.975, max(1, math.floor(dof)))
    return diff, diff - t * se, diff + t * se


def half_width(sd: float, n: int, level: float = LEVEL) -> float:
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

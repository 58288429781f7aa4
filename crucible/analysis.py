"""Robustness analysis of a failure sweep: pure, stdlib-only functions shared by the API and CLI.

A run at failure probability p > 0 is paired with the baseline of the same sweep that has the
same compression arm, seed and failure duration and p == 0. A baseline belongs to no strategy (at
p = 0 nothing fails, so nothing is mitigated; the registry stores its strategy as None): it is
paired with each strategy that a failure run of its arm used, and its own strategy, whatever it
is, never makes a strategy appear. Its relative degradation is 100 * (L - L0) / L0 of the final
validation loss. Per (arm, strategy, duration, p) the paired values are averaged over seeds with a
95% Student-t interval; with a single seed there is no spread to estimate, so both bounds are
None (never a fake zero-width interval).

No torch, no numpy: this module is imported by the API process and the command line.
"""
from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

__all__ = ["relative_degradation", "t_quantile", "summarise", "robustness", "robustness_table",
           "column_name"]

_DONE = "completed"
_UNFINISHED = ("pending", "queued", "running")


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


@functools.lru_cache(maxsize=1024)
def t_quantile(prob: float, df: int) -> float:
    """The `prob` quantile of Student's t with `df` degrees of freedom (bisection on the CDF).
    Cached: a sweep's summary asks for the same few (level, seeds) pairs for every cell, and
    each bisection costs ~3 ms."""
    if not 0.0 < prob < 1.0:
        raise ValueError(f"prob must be in (0, 1), got {prob!r}")
    if df < 1:
        raise ValueError(f"df must be >= 1, got {df!r}")
    lo, hi = -1e3, 1e3
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if _t_cdf(mid, df) < prob:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)


def summarise(values: Sequence[float], *, level: float = 0.95
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


def _is_baseline(run: Mapping[str, Any]) -> bool:
    return float(run["p"]) == 0.0


def _usable(run: Mapping[str, Any]) -> bool:
    loss = run.get("final_val_loss")
    return run.get("status") == _DONE and loss is not None and math.isfinite(loss)


def _baselines(runs: Iterable[Mapping[str, Any]]) -> dict[tuple[str, int, int], Mapping[str, Any]]:
    """First usable p == 0 run per (compression, seed, duration), in input order."""
    found: dict[tuple[str, int, int], Mapping[str, Any]] = {}
    for run in runs:
        if _is_baseline(run) and _usable(run) and run["final_val_loss"] > 0:
            found.setdefault((run["compression"], run["seed"], run["duration"]), run)
    return found


def _item(key: tuple[str, str, int, float], by_seed: Mapping[int, tuple[float, str]]
          ) -> dict[str, Any]:
    compression, strategy, duration, p = key
    seeds = sorted(by_seed)
    mean, lo, hi, n = summarise([by_seed[s][0] for s in seeds])
    return {"compression": compression, "strategy": strategy, "duration": duration, "p": p,
            "mean_pct": mean, "ci_low_pct": lo, "ci_high_pct": hi, "n_seeds": n,
            "seeds": seeds, "run_ids": [by_seed[s][1] for s in seeds]}


def robustness(runs: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Summarise a sweep's runs into robustness items.

    `runs` are dicts with keys id, compression, strategy, p, duration, seed, status,
    final_val_loss, in creation order (a later run of the same cell and seed replaces an earlier
    one). Returns {"items": [...], "missing_baselines": [...], "pending_runs": int,
    "failed_runs": int}; items are sorted by (compression, strategy, duration, p) and include a
    p = 0 row (mean 0, the baselines' run ids) for every arm x strategy x duration that has a
    baseline, where the strategies are those of the arm's failure (p > 0) runs only.
    """
    baselines = _baselines(runs)
    cells: dict[tuple[str, str, int, float], dict[int, tuple[float, str]]] = {}
    missing: dict[tuple[str, int, int], None] = {}
    strategies: dict[tuple[str, int], set[str]] = {}
    for run in runs:
        if _is_baseline(run):
            continue
        strategies.setdefault((run["compression"], run["duration"]), set()).add(run["strategy"])
        if not _usable(run):
            continue
        base = baselines.get((run["compression"], run["seed"], run["duration"]))
        if base is None:
            missing[(run["compression"], run["seed"], run["duration"])] = None
            continue
        value = relative_degradation(run["final_val_loss"], base["final_val_loss"])
        key = (run["compression"], run["strategy"], run["duration"], float(run["p"]))
        cells.setdefault(key, {})[run["seed"]] = (value, str(run["id"]))
    for (compression, seed, duration), base in baselines.items():
        for strategy in strategies.get((compression, duration), ()):
            key = (compression, strategy, duration, 0.0)
            cells.setdefault(key, {})[seed] = (0.0, str(base["id"]))
    return {
        "items": [_item(key, cells[key]) for key in sorted(cells)],
        "missing_baselines": [{"compression": c, "seed": s, "duration": d}
                              for c, s, d in sorted(missing)],
        "pending_runs": sum(1 for r in runs if r.get("status") in _UNFINISHED),
        "failed_runs": sum(1 for r in runs if r.get("status") == "failed"),
    }


def column_name(item: Mapping[str, Any], *, with_duration: bool = False) -> str:
    """Table column of an item: "<compression>/<strategy>", plus "@d<duration>" when asked."""
    name = f"{item['compression']}/{item['strategy']}"
    return f"{name}@d{item['duration']}" if with_duration else name


def robustness_table(items: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The blog's Table-1 shape from robustness items: p rows x arm columns.

    Returns {"columns": [...], "rows": [{"p": p, "cells": {column: {mean_pct, ci_low_pct,
    ci_high_pct, n_seeds} or None}}]}. Columns carry "@d<duration>" only when the items span
    several failure durations.
    """
    with_duration = len({item["duration"] for item in items}) > 1
    columns = sorted({column_name(i, with_duration=with_duration) for i in items})
    by_p: dict[float, dict[str, Any]] = {}
    for item in items:
        cell = {k: item[k] for k in ("mean_pct", "ci_low_pct", "ci_high_pct", "n_seeds")}
        by_p.setdefault(float(item["p"]), {})[column_name(item, with_duration=with_duration)] = cell
    rows = [{"p": p, "cells": {c: by_p[p].get(c) for c in columns}} for p in sorted(by_p)]
    return {"columns": columns, "rows": rows}

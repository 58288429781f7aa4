"""The one baseline-pairing rule, and the robustness of a sweep or study built on it.

A run is described by a mapping with keys id, compression, strategy, p, duration, seed, status,
final_val_loss (and optionally label: a study block's name for baseline-neutral overrides, such
as MAPL's decode variants). Runs are given in creation order.

**The rule.** A run at p > 0 is compared with the p = 0 run of the same sweep that has the same
compression arm, seed and failure duration (every arm and strategy at one seed sees the same
failure schedule, so comparisons are paired by seed). When there are several such runs, the
first *usable* one in creation order is the baseline: completed, with a finite final
validation loss > 0. While none is usable, the first one that is still pending, queued or running
is (so a run page can say where its baseline will come from, and no number is computed from
it); otherwise there is none. The registry stores what this rule says on each run
(`runs.baseline_run_id`), and REST, the dashboards and the study document compute every number
from it, so they cannot disagree. A baseline belongs to no strategy: it serves every strategy of
its arm.

Degradation: 100 (L - L0) / L0 of the final validation loss. A later usable run of the same
cell and seed replaces an earlier one.
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NamedTuple

from crucible.grid.key import CellKey
from crucible.grid.names import COMPLETED, FAILED, UNFINISHED_STATUSES
from crucible.stats.intervals import (
    relative_degradation,
    seeds_for_half_width,
    summarise,
    t_quantile,
)

__all__ = ["GroupKey", "group_key", "is_baseline", "usable", "choose_baselines",
           "baseline_ids", "paired_degradations", "robustness", "robustness_table",
           "column_name", "seeds_wanted"]


class GroupKey(NamedTuple):
    """Which runs pair: the same compression arm, seed and failure duration (in one sweep)."""
    compression: str
    seed: int
    duration: int


def group_key(run: Mapping[str, Any]) -> GroupKey:
    return GroupKey(str(run["compression"]), int(run["seed"]), int(run["duration"]))


def is_baseline(run: Mapping[str, Any]) -> bool:
    return float(run["p"]) == 0.0


def usable(run: Mapping[str, Any]) -> bool:
    """Completed with a finite final validation loss (> 0 for a baseline, which divides)."""
    loss = run.get("final_val_loss")
    if run.get("status") != COMPLETED or loss is None or not math.isfinite(loss):
        return False
    return loss > 0 or not is_baseline(run)


def choose_baselines(runs: Iterable[Mapping[str, Any]]
                     ) -> dict[GroupKey, Mapping[str, Any]]:
    """The baseline of every group that has one, by the rule (module docstring)."""
    first_usable: dict[GroupKey, Mapping[str, Any]] = {}
    first_waiting: dict[GroupKey, Mapping[str, Any]] = {}
    for run in runs:
        if not is_baseline(run):
            continue
        key = group_key(run)
        if usable(run):
            first_usable.setdefault(key, run)
        elif run.get("status") in UNFINISHED_STATUSES:
            first_waiting.setdefault(key, run)
    return {**first_waiting, **first_usable}


def baseline_ids(runs: Sequence[Mapping[str, Any]]) -> dict[str, str | None]:
    """Run id -> its baseline's run id (None where it has none) for every run at p > 0."""
    chosen = choose_baselines(runs)
    return {str(run["id"]): (str(chosen[group_key(run)]["id"])
                             if group_key(run) in chosen else None)
            for run in runs if not is_baseline(run)}


def paired_degradations(runs: Sequence[Mapping[str, Any]]
                        ) -> tuple[dict[CellKey, dict[int, tuple[float, str]]], list[GroupKey]]:
    """(cells, missing): per cell (arm, strategy, p, label, duration) and seed, the usable
    run's degradation against its usable baseline with the run's id; and the groups whose
    usable failure runs have no usable baseline. Every cell some run plans is present (an
    empty dict while none is usable), and every arm's p = 0 row for each strategy its failure
    runs use holds 0 per seed with a usable baseline."""
    chosen = {k: r for k, r in choose_baselines(runs).items() if usable(r)}
    cells: dict[CellKey, dict[int, tuple[float, str]]] = {}
    missing: dict[GroupKey, None] = {}
    strategies: dict[tuple[str, int], dict[tuple[str, str], None]] = {}
    for run in runs:
        if is_baseline(run):
            continue
        key = CellKey.of_row(run, duration=int(run["duration"]))
        strategies.setdefault((key.arm, key.duration), {})[(key.strategy, key.label)] = None
        by_seed = cells.setdefault(key, {})
        if not usable(run):
            continue
        base = chosen.get(group_key(run))
        if base is None:
            missing[group_key(run)] = None
            continue
        value = relative_degradation(run["final_val_loss"], base["final_val_loss"])
        by_seed[int(run["seed"])] = (value, str(run["id"]))
    for group, base in chosen.items():
        # the p = 0 row of each strategy's curve: the baseline, drawn under every strategy
        for strategy, label in strategies.get((group.compression, group.duration), ()):
            key = CellKey(group.compression, strategy, 0.0, label, group.duration)
            cells.setdefault(key, {})[group.seed] = (0.0, str(base["id"]))
    return cells, sorted(missing)


def _item(key: CellKey, by_seed: Mapping[int, tuple[float, str]]) -> dict[str, Any]:
    seeds = sorted(by_seed)
    mean, lo, hi, n = summarise([by_seed[s][0] for s in seeds])
    return {"compression": key.arm, "strategy": key.strategy, "label": key.label,
            "duration": key.duration, "p": key.p, "mean_pct": mean, "ci_low_pct": lo, "ci_high_pct": hi, "n_seeds": n,
            "seeds": seeds, "run_ids": [by_seed[s][1] for s in seeds]}


def robustness(runs: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """A sweep's robustness: {"items": [...], "missing_baselines": [...], "pending_runs": int,
    "failed_runs": int}. Items, sorted by (compression, strategy, label, duration, p), hold the
    mean
    degradation with its 95% interval over seeds (both bounds None with one seed: never a fake
    zero-width interval) and include a p = 0 row (mean 0, the baselines' run ids) for every arm
    x strategy x duration that has a usable baseline."""
    cells, missing = paired_degradations(runs)
    items = [_item(key, by_seed) for key, by_seed in
             sorted(cells.items(), key=lambda kv: (kv[0].arm, kv[0].strategy, kv[0].label,
                                                   kv[0].duration, kv[0].p))
             if by_seed]
    return {
        "items": items,
        "missing_baselines": [{"compression": c, "seed": s, "duration": d}
                              for c, s, d in missing],
        "pending_runs": sum(1 for r in runs if r.get("status") in UNFINISHED_STATUSES),
        "failed_runs": sum(1 for r in runs if r.get("status") == FAILED),
    }


def column_name(item: Mapping[str, Any], *, with_duration: bool = False) -> str:
    """Table column of an item: "<compression>/<strategy>", plus "[<label>]" for a labelled
    block's cells and "@d<duration>" when asked."""
    name = f"{item['compression']}/{item['strategy']}"
    if item.get("label"):
        name += f"[{item['label']}]"
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


def seeds_wanted(items: Sequence[Mapping[str, Any]], *, target: float, max_seeds: int
                 ) -> list[tuple[CellKey, int]]:
    """Seeds by precision: (the cell's key with its duration, seeds to add in the next round)
    for every cell at p > 0 whose paired 95% half-width is above `target` and that has fewer
    than `max_seeds` seeds, widest first (a cell without an interval yet counts
    as widest). It should have what its measured sd says a ±target interval needs
    (`seeds_for_half_width`; 2 while it has no sd), at least one more than its usable seeds,
    at most `max_seeds`: the difference is added (runs that exist but are not usable, a failed
    seed say, do not count as seeds it has). It reads widths only, never a mean: stopping when an effect looks significant
    would bias the estimate (optional stopping), stopping on width does not."""
    wanted = []
    for item in items:
        if float(item["p"]) == 0.0:
            continue
        n = int(item["n_seeds"])
        if n >= max_seeds:
            continue
        lo, hi = item.get("ci_low_pct"), item.get("ci_high_pct")
        half = math.inf if lo is None or hi is None or n < 2 else (hi - lo) / 2.0
        if half <= target:
            continue
        if math.isinf(half):
            need = 2
        else:
            sd = half * math.sqrt(n) / t_quantile(0.975, n - 1)
            need = seeds_for_half_width(sd, target, cap=max_seeds) or max_seeds
        key = CellKey.of_row(item, duration=int(item["duration"]))
        wanted.append((half, key, min(max_seeds, max(n + 1, need)) - n))
    wanted.sort(key=lambda w: (-w[0], w[1]))
    return [(key, count) for _, key, count in wanted]

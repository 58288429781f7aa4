"""Decisions by cost for a sweep: each cell's runs priced on one deployment (crucible.pricing.cost),
then per cell (arm, strategy, p, label) over its seeds: wall-clock, money and final loss, the
time and money to reach the no-failure baseline's final loss, the loss reached on a fixed budget
(the baseline's money), the loss-against-time and loss-against-money curves, and the cheapest
strategy at each p.

Rules, stated once:

- Target. A run's target is the final validation loss of its arm's p = 0 run with the same seed
  (the one pairing rule's baseline, crucible.stats.pairing; the mean of the arm's baselines
  where that seed has none). It is reached where the run's evaluation curve first falls to it,
  interpolated linearly between the two evaluations around the crossing (at the first
  evaluation when that one is already below); a run whose curve never gets there has "not
  reached".
- Budget. The arm's mean baseline money. The loss on that budget is the curve's, interpolated in
  money; a run that ended under budget keeps its final loss; a run with no evaluation inside the
  budget has none.
- Cheapest at p (per arm and label): the strategy with the least mean money to the target among
  those whose every seed reached it; when none did, the strategy with the lowest mean loss on the
  budget (marked so).
- Intervals: mean over seeds with the 95% Student-t interval (crucible.stats.stat_of), none for
  one seed.
"""
from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from crucible.grid.key import BASELINE_NAME, CellKey
from crucible.stats import Stat, stat_of

__all__ = ["CostRow", "cell_key", "loss_at_money", "reach", "sweep_costs"]


@dataclass(frozen=True)
class CostRow:
    key: CellKey
    seed: int
    name: str
    cost: Mapping[str, Any]          # crucible.pricing.cost.run_cost's record


def cell_key(summary: Mapping[str, Any], label: str = "") -> CellKey:
    """The grid cell a run belongs to, from its config: p = 0 is the arm's baseline (strategy
    None, whatever `faults.strategy` its config was run with)."""
    config = summary["config"]
    faults = config.get("faults") or {}
    p = float(faults.get("p", 0.0))
    strategy = None if p == 0.0 else str(faults.get("strategy"))
    if not label and p and faults.get("process", "independent") != "independent":
        label = str(faults["process"])
    return CellKey(config["pipeline"]["compression"], strategy, p, label)


def reach(curve: Sequence[Mapping[str, Any]], target: float) -> dict[str, float] | None:
    """{wall_s, cost} where the curve first falls to `target` (linear between evaluations), or
    None when it never does."""
    previous = None
    for point in curve:
        loss = float(point["val_loss"])
        if loss <= target:
            if previous is None or float(previous["val_loss"]) == loss:
                return {"wall_s": float(point["wall_s"]), "cost": float(point["cost"])}
            a = (float(previous["val_loss"]) - target) / (float(previous["val_loss"]) - loss)
            return {key: float(previous[key]) + a * (float(point[key]) - float(previous[key]))
                    for key in ("wall_s", "cost")}
        previous = point
    return None


def loss_at_money(curve: Sequence[Mapping[str, Any]], budget: float) -> float | None:
    """The curve's loss at `budget` (linear in money between evaluations); the final loss when
    the run ended under budget; None with no evaluation within it."""
    previous = None
    for point in curve:
        spent = float(point["cost"])
        if spent >= budget:
            if spent == budget or previous is None:
                return float(point["val_loss"]) if spent == budget else None
            a = (budget - float(previous["cost"])) / (spent - float(previous["cost"]))
            return float(previous["val_loss"]) + a * (float(point["val_loss"])
                                                      - float(previous["val_loss"]))
        previous = point
    return None if previous is None else float(previous["val_loss"])


def _strategy(key: CellKey) -> str:
    """A cell's strategy as the cost record (REST, the result files) spells it: the baseline's
    is `BASELINE_NAME`."""
    return BASELINE_NAME if key.strategy is None else key.strategy


def _stat(values: Mapping[int, float]) -> dict[str, Any]:
    s: Stat = stat_of(values)
    return {"n": s.n, "mean": s.mean, "lo": s.lo, "hi": s.hi}


def _mean_curve(rows: Sequence[CostRow]) -> list[dict[str, float]]:
    """The cell's curve: per global step evaluated by every seed, the means over seeds."""
    steps = None
    for row in rows:
        mine = {int(p["global_step"]) for p in row.cost["curve"]}
        steps = mine if steps is None else steps & mine
    out = []
    for step in sorted(steps or ()):
        points = [next(p for p in row.cost["curve"] if int(p["global_step"]) == step)
                  for row in rows]
        out.append({"global_step": step,
                    **{key: statistics.fmean(float(p[key]) for p in points)
                       for key in ("wall_s", "cost", "val_loss")}})
    return out


def sweep_costs(rows: Iterable[CostRow]) -> dict[str, Any]:
    """The sweep's cost record (JSON-ready): cells, curves and the cheapest strategy per p."""
    by_key: dict[CellKey, list[CostRow]] = {}
    for row in rows:
        by_key.setdefault(row.key, []).append(row)
    if not by_key:
        return {"cells": [], "cheapest": []}
    first = next(iter(by_key.values()))[0].cost
    baselines = {key.arm: {r.seed: r for r in group} for key, group in by_key.items()
                 if key.is_baseline}
    cells = []
    for key in sorted(by_key, key=lambda k: (k.arm, k.label, k.p, _strategy(k))):
        group = sorted(by_key[key], key=lambda r: r.seed)
        base = baselines.get(key.arm, {})
        losses = [float(b.cost["final_val_loss"]) for b in base.values()
                  if b.cost.get("final_val_loss") is not None]
        mean_target = statistics.fmean(losses) if losses else None
        budget = (statistics.fmean(float(b.cost["cost"]) for b in base.values())
                  if base else None)
        reached: dict[int, dict[str, float]] = {}
        at_budget: dict[int, float] = {}
        for row in group:
            own = base[row.seed].cost.get("final_val_loss") if row.seed in base else None
            target = float(own) if own is not None else mean_target
            if target is not None:
                hit = reach(row.cost["curve"], target)
                if hit is not None:
                    reached[row.seed] = hit
            if budget is not None:
                loss = loss_at_money(row.cost["curve"], budget)
                if loss is not None:
                    at_budget[row.seed] = loss
        cells.append({
            "arm": key.arm, "strategy": _strategy(key), "p": key.p, "label": key.label,
            "seeds": [r.seed for r in group], "runs": [r.name for r in group],
            "global_steps": _stat({r.seed: float(r.cost["global_steps"]) for r in group
                                   if "global_steps" in r.cost}),
            "wall_s": _stat({r.seed: float(r.cost["wall_s"]) for r in group}),
            "accelerator_hours": _stat({r.seed: float(r.cost["accelerator_hours"])
                                        for r in group}),
            "cost": _stat({r.seed: float(r.cost["cost"]) for r in group}),
            "final_val_loss": _stat({r.seed: float(r.cost["final_val_loss"]) for r in group
                                     if r.cost.get("final_val_loss") is not None}),
            "target": {"reached": len(reached), "of": len(group),
                       "wall_s": _stat({s: h["wall_s"] for s, h in reached.items()}),
                       "cost": _stat({s: h["cost"] for s, h in reached.items()})},
            "budget": budget, "loss_at_budget": _stat(at_budget),
            "curve": _mean_curve(group)})
    return {"deployment": first["deployment"], "pricing": first["pricing"],
            "currency": first["currency"], "workload": first.get("workload"),
            "layout": first.get("layout"),
            "cells": cells, "cheapest": _cheapest(cells)}


def _cheapest(cells: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    groups: dict[tuple[str, str, float], list[Mapping[str, Any]]] = {}
    for cell in cells:
        if cell["strategy"] != BASELINE_NAME:
            groups.setdefault((cell["arm"], cell["label"], cell["p"]), []).append(cell)
    out = []
    for (arm, label, p), group in sorted(groups.items()):
        full = [c for c in group if c["target"]["reached"] == c["target"]["of"]
                and c["target"]["cost"]["mean"] is not None]
        if full:
            best = min(full, key=lambda c: (c["target"]["cost"]["mean"], c["strategy"]))
            out.append({"arm": arm, "label": label, "p": p, "strategy": best["strategy"],
                        "by": "target", "cost": best["target"]["cost"]["mean"],
                        "loss_at_budget": best["loss_at_budget"]["mean"]})
            continue
        scored = [c for c in group if c["loss_at_budget"]["mean"] is not None]
        if not scored:
            out.append({"arm": arm, "label": label, "p": p, "strategy": None, "by": "none",
                        "cost": None, "loss_at_budget": None})
            continue
        best = min(scored, key=lambda c: (c["loss_at_budget"]["mean"], c["strategy"]))
        out.append({"arm": arm, "label": label, "p": p, "strategy": best["strategy"],
                    "by": "budget", "cost": best["cost"]["mean"],
                    "loss_at_budget": best["loss_at_budget"]["mean"]})
    return out

"""Synthetic registry-shaped data: for the dashboard tests, the benchmark and page previews.

Numbers are made up but consistent with the registry's contract: the interval always contains the
mean, p = 0 rows are 0, a baseline (p = 0, strategy skip) is shared by every strategy of its arm.
Nothing here touches a database; real sweeps come from `api.dashboards.queries`.
"""
from __future__ import annotations

import uuid
from typing import Any

ARMS: tuple[str, ...] = ("none", "ssn")
STRATEGIES: tuple[str, ...] = ("skip", "drop")
PS: tuple[float, ...] = (0.0, 0.1, 0.2)
SWEEP_ID = "00000000-0000-4000-8000-000000000001"


def _run_id(arm: str, strategy: str, p: float, seed: int) -> str:
    return str(uuid.uuid5(uuid.NAMESPACE_URL, f"{arm}/{strategy}/{p}/{seed}"))


def robustness(*, seeds: int = 2, arms: tuple[str, ...] = ARMS,
               strategies: tuple[str, ...] = STRATEGIES, ps: tuple[float, ...] = PS
               ) -> dict[str, Any]:
    """A robustness summary over arms x strategies x ps; ssn/drop at p = 0.2 has one seed."""
    items = []
    for arm in arms:
        for strategy in strategies:
            for p in ps:
                slope = (4.0 if "drop" in strategy else 1.0) * (0.8 if arm == "ssn" else 1.0)
                mean = slope * 10 * p
                one_seed = arm == "ssn" and strategy == "drop" and p == 0.2
                half = 0.0 if p == 0 else 0.3 * mean
                items.append({
                    "compression": arm, "strategy": strategy, "duration": 6, "p": p,
                    "mean_pct": mean,
                    "ci_low_pct": None if one_seed else mean - half,
                    "ci_high_pct": None if one_seed else mean + half,
                    "n_seeds": 1 if one_seed else seeds,
                    "run_ids": [_run_id(arm, strategy, p, s) for s in range(seeds)],
                })
    return {"sweep_id": SWEEP_ID, "items": items, "missing_baselines": [], "pending_runs": 0}


def table(robust: dict[str, Any] | None = None, *, missing: tuple[str, float] | None = None
          ) -> dict[str, Any]:
    """The Table-1 shape of a robustness summary (default: `robustness()` with the none/drop
    cell at p = 0.2 missing); `missing` names one (column, p) cell to leave empty."""
    if robust is None:
        robust, missing = robustness(), ("none/drop", 0.2)
    columns: list[str] = []
    by_p: dict[float, dict[str, Any]] = {}
    for item in robust["items"]:
        column = f"{item['compression']}/{item['strategy']}"
        if column not in columns:
            columns.append(column)
        if item["p"] > 0:
            cell = None if missing == (column, item["p"]) else {
                k: item[k] for k in ("mean_pct", "ci_low_pct", "ci_high_pct", "n_seeds")}
            by_p.setdefault(item["p"], {})[column] = cell
    rows = [{"p": p, "cells": by_p[p]} for p in sorted(by_p)]
    return {"sweep_id": robust["sweep_id"], "columns": columns, "rows": rows}


def summary(*, p: float, strategy: str, arm: str, steps: int = 20) -> dict[str, Any]:
    """A run's summary.json: evals every 5 steps, bytes, timing, contributions, and two faults
    (12 down stage-replica steps) when p > 0."""
    tokens_per_step = 4096
    lost = 0 if p == 0 or strategy != "drop" else int(p * 10) * tokens_per_step
    faults = [] if p == 0 else [
        {"replica": 1, "stage": 1, "start": 3, "duration": 6},
        {"replica": 3, "stage": 2, "start": 10, "duration": 6},
    ]
    scale = 0.125 if arm == "ssn" else 1.0
    # dropping tokens hurts more than skipping a stage; SSN a little less than uncompressed
    penalty = (2.0 if "drop" in strategy else 0.5) * (0.8 if arm == "ssn" else 1.0)
    return {
        "evals": [{"global_step": s, "tokens": s * tokens_per_step,
                   "val_loss": 4.0 - 0.1 * s + penalty * p * s / steps} for s in range(0, steps + 1, 5)],
        "bytes": {"boundary_forward": 2.0e6 * scale, "boundary_backward": 2.0e6 * scale,
                  "boundary_rerouted": 0, "upload": 3.0e5, "dense_upload_equivalent": 1.9e7,
                  "upload_per_global_step": 3.0e5 / steps},
        # 4 replicas x 4 stages contribute each step; each down step misses one contribution
        "contributions": {"made": 16 * steps - 6 * len(faults), "missed": 6 * len(faults),
                          "rejected": 0},
        "manifests_rejected": 0,
        "skipped_outer_steps": 0,
        "timing": {"inner_s": 31.5, "sync_s": 6.2, "eval_s": 3.1},
        "wall_s": 44.0,
        "faults": faults,
        "tokens_budget": steps * tokens_per_step,
        "tokens_processed": steps * tokens_per_step - lost,
    }


def runs(*, seeds: int = 2, finished: bool = True, arms: tuple[str, ...] = ARMS,
         strategies: tuple[str, ...] = STRATEGIES, ps: tuple[float, ...] = PS
         ) -> list[dict[str, Any]]:
    """Run dicts for every cell; p = 0 runs are the shared baselines (strategy skip)."""
    out = []
    for arm in arms:
        for strategy in strategies:
            for p in ps:
                if p == 0 and strategy != "skip":
                    continue
                for seed in range(seeds):
                    summ = summary(p=p, strategy=strategy, arm=arm)
                    out.append({
                        "id": _run_id(arm, strategy, p, seed), "sweep_id": SWEEP_ID,
                        "status": "completed" if finished else "running",
                        "compression": arm, "strategy": strategy, "p": p, "duration": 6,
                        "seed": seed, "preset": "smoke",
                        "config": {"replicas": 4, "train": {"global_steps": 20},
                                   "pipeline": {"stages": 4, "compression": arm}},
                        "initial_val_loss": 4.0,
                        "final_val_loss": summ["evals"][-1]["val_loss"] if finished else None,
                        "tokens_budget": summ["tokens_budget"],
                        "tokens_processed": summ["tokens_processed"] if finished else None,
                        "summary": summ if finished else {},
                        "baseline_run_id": None if p == 0 else _run_id(arm, "skip", 0.0, seed),
                    })
    return out


# what the trainer logs for each down stage-replica and global step, per strategy
_MITIGATION_EVENT = {"skip": "bypass", "drop": "drop", "drop_extend": "drop", "reroute": "reroute"}


def events(*, strategy: str = "skip") -> list[dict[str, Any]]:
    """Events of the run whose faults are `summary(p>0)`'s, as the trainer logs them: failure_start,
    then per down step what was done (bypass under skip, drop under drop/drop_extend, reroute via
    a donor replica under reroute) and contribution_missing, then rejoin."""
    kind = _MITIGATION_EVENT[strategy]
    rows: list[dict[str, Any]] = []
    for replica, stage, start in ((1, 1, 3), (3, 2, 10)):
        rows.append({"id": f"failure_start:{start}:{replica}:{stage}:0", "kind": "failure_start",
                     "global_step": start, "replica": replica, "stage": stage,
                     "detail": {"duration": 6, "strategy": strategy}})
        for step in range(start, start + 6):
            detail: dict[str, Any] = {"strategy": strategy}
            if kind == "reroute":
                detail["donor"] = (replica + 1) % 4
            rows.append({"id": f"{kind}:{step}:{replica}:{stage}:0", "kind": kind,
                         "global_step": step, "replica": replica, "stage": stage,
                         "detail": detail})
            rows.append({"id": f"contribution_missing:{step}:{replica}:{stage}:0",
                         "kind": "contribution_missing", "global_step": step,
                         "replica": replica, "stage": stage, "detail": {}})
        rows.append({"id": f"rejoin:{start + 6}:{replica}:{stage}:0", "kind": "rejoin",
                     "global_step": start + 6, "replica": replica, "stage": stage, "detail": {}})
    return rows


def train_loss_metrics(*, steps: int = 20, replicas: int = 4) -> list[dict[str, Any]]:
    """`train_loss` rows of every replica for global steps 0..steps-1; the replicas whose stage
    is down in `summary(p>0)` (1 at steps 3-8, 3 at 10-15) stall while it is."""
    down = {1: range(3, 9), 3: range(10, 16)}
    rows = []
    for replica in range(replicas):
        loss = 4.2 + 0.03 * replica
        for step in range(steps):
            if step not in down.get(replica, ()):
                loss -= 0.1
            rows.append({"name": "train_loss", "global_step": step, "tokens": None,
                         "replica": replica, "value": round(loss, 4)})
    return rows


def val_loss_metrics(summ: dict[str, Any]) -> list[dict[str, Any]]:
    """The `val_loss` metric rows matching a summary's evals."""
    return [{"name": "val_loss", "global_step": e["global_step"], "tokens": e["tokens"],
             "replica": None, "value": e["val_loss"]} for e in summ["evals"]]

"""The cost model (crucible.pricing.cost) against measured distributed-mode runs of this machine.

Two steps, both real `crucible launch` runs (one process per replica, CPU, local store):

- `--calibrate`: one short run without faults (`--calibrate-steps` global steps) measures the
  machine: seconds per inner step of a stage (the lead replica's `timing.inner_s` over its
  inner steps and stages), the per-round synchronisation (`timing.sync_s` per round), an
  evaluation token's cost against a training token's, and the start-up (the launcher's wall
  time less the lead replica's phases). It writes them into infra/deployments/this-machine.toml.
- validation (default): runs of a different length and seed, without and with planned SIGKILLs
  (each kill restarted: the others wait out the round deadline), priced with the committed
  this-machine.toml; reported: predicted wall-clock / measured (the launcher's `wall_s`) per run.

    OMP_NUM_THREADS=1 python -m benchmarks.cost_validation --calibrate
    OMP_NUM_THREADS=1 python -m benchmarks.cost_validation [--steps 12] [--timeout 8]

Prints one JSON object. Scratch goes under `--out`.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
from pathlib import Path
from typing import Any

from crucible.config import apply_overrides
from crucible.distributed.launch import launch
from crucible.presets import get_preset
from crucible.pricing.cost import run_cost
from crucible.pricing.deployment import load_deployment

DEPLOYMENT = Path(__file__).resolve().parents[1] / "infra" / "deployments" / "this-machine.toml"
REPLICAS = 3
# the `small` preset at 3 replicas, short: no checkpoints (the distributed mode refuses them),
# a fixed held-out sample, an evaluation every 4 rounds
BASE = [f"replicas={REPLICAS}", "train.checkpoint_every=0", "train.eval_tokens=8192",
        "train.eval_every=4"]

_TEMPLATE = """# This machine as a deployment: the 2-core x86_64 VM the project is developed on, running
# `crucible launch` (one process per replica, CPU, one torch thread each) with the store in a
# local folder. Measured, not assumed: written by `python -m benchmarks.cost_validation
# --calibrate` from one short run without faults ({calibration}); docs/PERFORMANCE.md, "Cost
# model against measured runs", validates it against other runs of the same machine.
name = "this-machine"
description = "the 2-core development VM, distributed mode on CPU, {replicas} processes, local folder store; a notional price"
pricing = "on_demand"
layout = "per_stage"

[compute]
# seconds per inner step of one stage of the `small` preset (batch 4 x 64 tokens), per process
step_s = {step_s:.6f}
eval_fraction = {eval_fraction:.4f}
# encode, decode, the store round trip and the outer step of one round, per process
sync_compute_s = {sync_compute_s:.4f}
# the launcher until the first step: {replicas} elastic agents starting Python and torch
startup_s = {startup_s:.3f}

[network]
# boundaries inside one process: memory, effectively free
boundary_bandwidth_mbps = 1.0e6
boundary_latency_ms = 0.0
# a local folder: its time is in sync_compute_s
store_bandwidth_mbps = 1.0e6
store_latency_ms = 0.0

[recovery]
# a killed worker back, and then holding the global weights: docs/PERFORMANCE.md, "Unplanned
# kills from outside" (commit d2781e8): back 1.27-1.33 s after a kill -9, caught up 0.15-0.48 s
# later
restart_s = 1.3
rejoin_s = 0.3

[price]
accelerators_per_stage = 1
# a notional price, so that the money column has a unit
on_demand_per_hour = 0.05
spot_discount = 0.0
currency = "USD"
"""


def _config(steps: int, seed: int, timeout_s: float) -> Any:
    return apply_overrides(get_preset("small"), [*BASE, f"train.global_steps={steps}",
                                                 f"seed={seed}",
                                                 f"sparseloco.round_timeout_s={timeout_s:g}"])


def _lead(out: Path, summary: dict[str, Any]) -> dict[str, Any]:
    """The lead replica's own summary (its timing is the merged summary's)."""
    first = min(int(r) for r in summary["distributed"]["finished"])
    return json.loads((out / "replicas" / f"replica-{first}" / "summary.json").read_text())


def calibrate(out: Path, *, steps: int, timeout_s: float) -> dict[str, Any]:
    config = _config(steps, seed=100, timeout_s=timeout_s)
    summary = launch(config, out_dir=out / "calibrate")
    lead = _lead(out / "calibrate", summary)
    timing = lead["timing"]
    H, S = config.sparseloco.inner_steps, config.pipeline.stages
    step_s = timing["inner_s"] / (steps * H) / S
    sync_s = timing["sync_s"] / steps
    evals = len(summary["evals"]) + (1 if summary.get("initial_val_loss") is not None else 0)
    tokens = config.train.batch_size * config.model.seq_len
    eval_each = timing["eval_s"] / max(evals, 1)
    eval_fraction = eval_each / (summary["eval_tokens"] * S * step_s / tokens)
    startup_s = summary["wall_s"] - timing["inner_s"] - timing["sync_s"] - timing["eval_s"]
    values = {"step_s": step_s, "sync_compute_s": sync_s, "eval_fraction": eval_fraction,
              "startup_s": startup_s, "replicas": REPLICAS,
              "calibration": f"`small`, {REPLICAS} replicas, {steps} global steps, seed 100"}
    DEPLOYMENT.write_text(_TEMPLATE.format(**values), encoding="utf-8")
    load_deployment(DEPLOYMENT)   # what it wrote must load
    return {"wrote": str(DEPLOYMENT), **values, "measured_wall_s": summary["wall_s"]}


def validate(out: Path, *, steps: int, timeout_s: float, seeds: list[int]) -> dict[str, Any]:
    deployment = load_deployment(DEPLOYMENT)
    cases = [("no faults", [])]
    cases.append(("1 kill", [{"replica": 1, "global_step": steps // 3, "rejoin": True}]))
    cases.append(("2 kills", [{"replica": 1, "global_step": steps // 4, "rejoin": True},
                              {"replica": 2, "global_step": steps // 2, "rejoin": True}]))
    runs = []
    for seed in seeds:
        for name, kills in cases:
            folder = out / f"{name.replace(' ', '-')}-s{seed}"
            summary = launch(_config(steps, seed=seed, timeout_s=timeout_s), out_dir=folder,
                             kills=kills)
            cost = run_cost(summary, deployment)
            waits = summary["distributed"]["round_waits_s"]
            runs.append({"case": name, "seed": seed, "kills": kills,
                         "measured_wall_s": summary["wall_s"], "predicted_wall_s": cost["wall_s"],
                         "ratio": cost["wall_s"] / summary["wall_s"],
                         "predicted_wait_s": cost["breakdown_s"]["wait_s"],
                         "measured_max_wait_s": max((max(w) for w in waits.values() if w),
                                                    default=0.0),
                         "missing_rounds": summary["distributed"]["missing_rounds"],
                         "predicted_wait_rounds": cost["kill_wait_rounds"]})
    by_case = {name: statistics.median(r["ratio"] for r in runs if r["case"] == name)
               for name, _ in cases}
    return {"runs": runs, "median_ratio": by_case, "steps": steps, "round_timeout_s": timeout_s}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.cost_validation",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--calibrate", action="store_true",
                        help="measure this machine and write infra/deployments/this-machine.toml")
    parser.add_argument("--calibrate-steps", type=int, default=4)
    parser.add_argument("--steps", type=int, default=12, help="global steps of each run")
    parser.add_argument("--timeout", type=float, default=8.0,
                        help="sparseloco.round_timeout_s (what each kill costs the others)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[1])
    parser.add_argument("--out", type=Path, default=Path("runs/bench-cost"))
    args = parser.parse_args(argv)
    shutil.rmtree(args.out, ignore_errors=True)
    args.out.mkdir(parents=True)
    load_start = os.getloadavg()[0]
    if args.calibrate:
        result = calibrate(args.out, steps=args.calibrate_steps, timeout_s=args.timeout)
    else:
        result = validate(args.out, steps=args.steps, timeout_s=args.timeout, seeds=args.seeds)
    result.update({"cpu_count": os.cpu_count(), "load_avg_1m_start": load_start,
                   "load_avg_1m_end": os.getloadavg()[0]})
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

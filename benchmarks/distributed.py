"""The distributed mode (`crucible launch`) against the simulator, on one host.

Two measurements, each against a plain reference taken in the same run:

- throughput: the `smoke` preset with R replicas, as one simulator process (`crucible.train`)
  and as R processes (`crucible.distributed.launch`), interleaved `--repeats` times. Reported:
  each side's training wall time (the simulator's `wall_s`; the slowest replica process's
  `wall_s`) and the whole command's (the launcher's wall time includes R agents starting Python
  and torch), the ratio distributed / simulator of each, and whether the final validation loss
  is the same float.
- recovery: R = 3 with `sparseloco.round_timeout_s=T`, replica 1 SIGKILLed at global step 3 and
  replica 2 at step 6, both restarted: seconds from each kill to the process back, to caught
  up and to its first contribution again, and the final loss against the simulator's `drop`
  plan for the same rounds and the no-fault run.
- outside kills (`--only outside`): R = 3, `smoke` for 30 global steps with the deadline T, no
  planned kill; replica 1's worker `kill -9`ed from outside after 10 rounds, inside its upload
  of round 10, or its agent killed; then the same worker kill with the lease off
  (`--lease-s 0`) and with no restart budget (`--restarts 0`), and the run with no kill. Seconds
  from the signal (the outside wall clock) to the process back, caught up and contributing
  again; the survivors' waits in the round of the kill, the next, and at most elsewhere; the
  run's wall time against the no-kill run's.

    OMP_NUM_THREADS=1 python -m benchmarks.distributed [--replicas 2 4] [--repeats 2] \
        [--timeout 10] [--only throughput recovery outside] [--out runs/bench-distributed]

Prints one JSON object. Scratch goes under `--out` (not /tmp: slow to create files here).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import time
from pathlib import Path
from typing import Any

from crucible.config import apply_overrides
from crucible.distributed.launch import launch
from crucible.faults import FaultPlan
from crucible.presets import get_preset
from crucible.train import train


def _throughput(replicas: int, repeat: int, out: Path) -> dict[str, Any]:
    config = apply_overrides(get_preset("smoke"), [f"replicas={replicas}"])
    started = time.perf_counter()
    sim = train(config, out_dir=out / f"sim-{replicas}-{repeat}")
    sim_total = time.perf_counter() - started
    started = time.perf_counter()
    dist = launch(config, out_dir=out / f"dist-{replicas}-{repeat}")
    dist_total = time.perf_counter() - started
    parts = [json.loads((out / f"dist-{replicas}-{repeat}" / "replicas" / f"replica-{r}"
                         / "summary.json").read_text()) for r in range(replicas)]
    dist_train = max(p["wall_s"] for p in parts)
    return {"replicas": replicas, "repeat": repeat, "sim_train_s": sim["wall_s"],
            "sim_total_s": sim_total, "dist_train_s": dist_train, "dist_total_s": dist_total,
            "train_ratio": dist_train / sim["wall_s"], "total_ratio": dist_total / sim_total,
            "same_final_loss": sim["final_val_loss"] == dist["final_val_loss"],
            "tokens": sim["tokens_processed"]}


def _recovery(timeout_s: float, out: Path) -> dict[str, Any]:
    config = apply_overrides(get_preset("smoke"), ["replicas=3",
                                                   f"sparseloco.round_timeout_s={timeout_s:g}"])
    base = train(config, out_dir=out / "kill-base")
    drop = apply_overrides(config, ["faults.strategy=drop", "faults.duration=1"])
    plan = FaultPlan().down(replica=1, stage=1, start=3, steps=1).down(
        replica=2, stage=2, start=6, steps=1)
    sim = train(drop, out_dir=out / "kill-sim", plan=plan)
    started = time.perf_counter()
    dist = launch(config, out_dir=out / "kill-dist",
                  kills=[{"replica": 1, "global_step": 3, "rejoin": True},
                         {"replica": 2, "global_step": 6, "rejoin": True}])
    return {"round_timeout_s": timeout_s, "wall_s": time.perf_counter() - started,
            "recoveries": dist["distributed"]["recoveries"],
            "missing_rounds": dist["distributed"]["missing_rounds"],
            "final_val_loss": {"no_faults": base["final_val_loss"],
                               "simulator_drop": sim["final_val_loss"],
                               "distributed_kills": dist["final_val_loss"]},
            "val_loss_stderr": base["val_loss_stderr"],
            "contributions": {"simulator_drop": sim["contributions"],
                              "distributed_kills": dist["contributions"]}}


def _outside(case: str, timeout_s: float, out: Path) -> dict[str, Any]:
    """One run with an unplanned kill from outside (see the module docstring)."""
    import threading

    from crucible.distributed import outside
    from crucible.distributed.injection import HOLD_UPLOAD_ENV
    from crucible.runfiles import read_jsonl

    steps, at = 30, 10
    config = apply_overrides(get_preset("smoke"), [
        "replicas=3", f"train.global_steps={steps}", f"train.eval_every={steps}",
        "train.eval_tokens=8192", f"sparseloco.round_timeout_s={timeout_s:g}"])
    options = {"lease-off": {"lease_s": 0.0}, "no-budget": {"restarts": 0}}.get(case, {})
    folder = out / f"outside-{case}"
    result: dict[str, Any] = {}
    if case == "upload":
        os.environ[HOLD_UPLOAD_ENV] = f"1:{at}:2"

    def run() -> None:
        try:
            result["summary"] = launch(config, out_dir=folder, **options)
        except BaseException as exc:        # reported, not raised in the thread
            result["error"] = repr(exc)

    thread = threading.Thread(target=run)
    started = time.perf_counter()
    thread.start()
    killed = None
    try:
        if case == "upload":
            outside.wait_for(lambda: outside.holding_upload(folder, replica=1), timeout_s=600,
                             what="the held upload", alive=thread.is_alive)
        elif case != "no-kill":
            outside.wait_for_rounds(folder, replica=1, rounds=at, alive=thread.is_alive)
        if case != "no-kill":
            killed = outside.kill(folder, replica=1,
                                  what="agent" if case == "agent" else "worker")
    finally:
        thread.join()
        os.environ.pop(HOLD_UPLOAD_ENV, None)
    wall_s = time.perf_counter() - started
    if "error" in result:
        return {"case": case, "error": result["error"]}
    dist = result["summary"]["distributed"]
    row: dict[str, Any] = {"case": case, "wall_s": wall_s, "lost": dist["lost"],
                           "missing_rounds_replica_1": dist["missing_rounds"]["1"]}
    if killed is not None:
        records = read_jsonl(folder / "replicas" / "replica-1" / "process.jsonl")
        walls = {k: next((r["wall"] for r in records if r["kind"] == k and r["wall"] > killed),
                         None) for k in ("restart", "caught_up", "first_contribution")}
        row.update({f"kill_to_{k}_s": (w - killed if w is not None else None)
                    for k, w in walls.items()})
        died = dist["recoveries"][0]["killed_at_step"] if dist["recoveries"] else at
        survivors = [dist["round_waits_s"][r] for r in ("0", "2")]
        row.update({"died_in_step": died,
                    "survivor_wait_s_that_round": max(w[died] for w in survivors),
                    "survivor_wait_s_next_round": max(w[died + 1] for w in survivors),
                    "survivor_wait_s_max_elsewhere": max(
                        x for w in survivors for g, x in enumerate(w) if g not in (died, died + 1)),
                    "survivor_rounds_at_deadline": sum(
                        1 for w in survivors[:1] for x in w if x >= 0.9 * timeout_s)})
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.distributed",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--replicas", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=10.0,
                        help="sparseloco.round_timeout_s of the recovery case")
    parser.add_argument("--only", nargs="+", choices=("throughput", "recovery", "outside"),
                        default=["throughput", "recovery"], help="which measurements")
    parser.add_argument("--out", type=Path, default=Path("runs/bench-distributed"))
    args = parser.parse_args(argv)
    shutil.rmtree(args.out, ignore_errors=True)
    args.out.mkdir(parents=True)
    load_start = os.getloadavg()[0]
    result: dict[str, Any] = {}
    if "throughput" in args.only:
        pairs = [_throughput(r, i, args.out) for i in range(args.repeats) for r in args.replicas]
        result["throughput"] = pairs
        result["throughput_median"] = {
            str(r): {key: statistics.median(p[key] for p in pairs if p["replicas"] == r)
                     for key in ("sim_train_s", "dist_train_s", "train_ratio",
                                 "sim_total_s", "dist_total_s", "total_ratio")}
            for r in args.replicas}
    if "recovery" in args.only:
        result["recovery"] = _recovery(args.timeout, args.out)
    if "outside" in args.only:
        result["outside"] = [_outside(case, args.timeout, args.out) for case in
                             ("no-kill", "worker", "upload", "agent", "lease-off", "no-budget")]
    result.update({"cpu_count": os.cpu_count(), "load_avg_1m_start": load_start,
                   "load_avg_1m_end": os.getloadavg()[0]})
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

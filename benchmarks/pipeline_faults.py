"""The pipeline mode measured: boundary bytes per arm, tokens/s against the simulator, and what a
real `kill -9` of an inner stage costs (time to notice, restart and rejoin; tokens/s kept).

Every run is the `smoke` preset with R = 2 replicas and S = 4 stages (8 stage processes) on this
machine, one torch thread each; the simulator (`crucible run`'s `train`, one thread) runs the
same config in this process as the plain reference. A kill is a SIGKILL from outside of stage 1
of replica 0, `--offset` seconds after its second round record (mid-round); the times come from
the launcher's notice (`notices.jsonl`) and the restarted process's journal. On a host with fewer
cores than stage processes the processes share the cores, so tokens/s is that of this host, not
of a pipeline with a machine per stage.

    python -m benchmarks.pipeline_faults [--steps 8] [--offset 0.05] [--out runs/bench-pipeline]
        [--mbps 20] [--latency-ms 5] [--json]

The shaped cases run uncompressed and SSN with every link at `--mbps` and `--latency-ms` (a rate
limiter in the sender, `links.Shaping`): what the boundary compression buys in tokens/s there.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import threading
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks import provenance
from crucible.config import apply_overrides
from crucible.distributed.pipeline.launch import launch_pipeline
from crucible.distributed.pipeline.links import Shaping
from crucible.faults import FaultPlan
from crucible.presets import get_preset
from crucible.train import train


def _config(arm: str, strategy: str, steps: int):
    return apply_overrides(get_preset("smoke"), [
        "replicas=2", f"pipeline.compression={arm}", f"train.global_steps={steps}",
        f"train.eval_every={steps}", "train.eval_tokens=8192", "train.device=cpu",
        "faults.p=0", f"faults.strategy={strategy}"])


def _pipeline(config, out: Path, *, kill_offset: float | None,
              shaping: Shaping | None = None) -> dict[str, Any]:
    """One pipeline run, with a SIGKILL of stage 1 of replica 0 mid-round when asked."""
    shutil.rmtree(out, ignore_errors=True)
    result: dict[str, Any] = {}
    thread = threading.Thread(target=lambda: result.update(
        summary=launch_pipeline(config, out_dir=out, plan=FaultPlan(), link_timeout_s=120,
                                shaping=shaping)))
    thread.start()
    killed_at = None
    if kill_offset is not None:
        rounds = out / "stages" / "r0-s1" / "rounds.jsonl"
        while thread.is_alive() and (not rounds.exists()
                                     or len(rounds.read_text().splitlines()) < 2):
            time.sleep(0.01)
        time.sleep(kill_offset)
        pid = int((rounds.parent / "pid").read_text())
        killed_at = time.time()
        os.kill(pid, signal.SIGKILL)
    thread.join()
    summary = result["summary"]
    # steady state: the rounds after the first, timed by replica 0's first stage's round records
    # (process start-up, the first round's wait for every process and the launcher's evaluation
    # are outside)
    walls = [json.loads(line)["wall"] for line in
             (out / "stages" / "r0-s0" / "rounds.jsonl").read_text().splitlines()]
    round_s = (walls[-1] - walls[0]) / (len(walls) - 1)
    tokens_per_round = config.replicas * config.sparseloco.inner_steps * \
        config.train.batch_size * config.model.seq_len
    row: dict[str, Any] = {
        "round_s": round_s, "steady_tokens_per_s": tokens_per_round / round_s,
        "wall_s": summary["wall_s"], "tokens": summary["tokens_processed"],
        "tokens_per_s": summary["tokens_processed"] / summary["wall_s"],
        "final_val_loss": summary["final_val_loss"],
        "act_payload": summary["pipeline"]["links"]["sent_payload"].get("act", 0),
        "grad_payload": summary["pipeline"]["links"]["sent_payload"].get("grad", 0)}
    if killed_at is not None:
        (notice,) = summary["pipeline"]["notices"]
        journal = [json.loads(line) for line in
                   (out / "stages" / "r0-s1" / "process.jsonl").read_text().splitlines()]
        wall = {r["kind"]: r["wall"] for r in journal}
        stages = summary["pipeline"]["stages"]
        row.update(notice_s=notice["wall"] - killed_at, restart_s=wall["restart"] - killed_at,
                   rejoin_s=wall["rejoin"] - killed_at,
                   retried_steps=max(s["retried_steps"] for s in stages if s["replica"] == 0),
                   dropped_steps=max(s["dropped_steps"] for s in stages if s["replica"] == 0))
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="benchmarks.pipeline_faults")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--offset", type=float, default=0.05)
    parser.add_argument("--out", type=Path, default=Path("runs/bench-pipeline"))
    parser.add_argument("--mbps", type=float, default=20.0,
                        help="the shaped links' bandwidth (the shaped cases)")
    parser.add_argument("--latency-ms", type=float, default=5.0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    rows = []
    for arm in ("none", "ssn", "mapl"):
        config = _config(arm, "skip", args.steps)
        started = time.perf_counter()
        sim = train(config, out_dir=args.out / f"sim-{arm}", plan=FaultPlan())
        sim_wall = time.perf_counter() - started
        sim_round_s = (sim["timing"]["inner_s"] + sim["timing"]["sync_s"]) / args.steps
        row = _pipeline(config, args.out / f"pipe-{arm}", kill_offset=None)
        row.update(arm=arm, case="no kill", sim_wall_s=sim_wall, sim_round_s=sim_round_s,
                   sim_tokens_per_s=row["steady_tokens_per_s"] * row["round_s"] / sim_round_s)
        rows.append(row)
    shaped = Shaping(mbps=args.mbps, latency_ms=args.latency_ms)
    for arm in ("none", "ssn"):
        row = _pipeline(_config(arm, "skip", args.steps), args.out / f"shaped-{arm}",
                        kill_offset=None, shaping=shaped)
        row.update(arm=arm, case=f"link {args.mbps:g} Mbit/s, {args.latency_ms:g} ms")
        rows.append(row)
    for strategy in ("skip", "drop"):
        row = _pipeline(_config("none", strategy, args.steps),
                        args.out / f"kill-{strategy}", kill_offset=args.offset)
        row.update(arm="none", case=f"kill -9 mid-round, {strategy}")
        rows.append(row)
    commit = provenance.commit()
    if args.json:
        print(json.dumps({"commit": commit, "rows": rows}, indent=2))
        return 0
    base = rows[0]["tokens_per_s"]
    print(f"commit {commit}; smoke, R = 2, S = 4, {args.steps} global steps")
    print("| arm | case | round s | steady tokens/s | vs simulator | tokens/s (whole run) | "
          "vs no kill | act bytes | notice s | restart s | rejoin s | retried | dropped |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        sim = r.get("sim_tokens_per_s")
        ratio = "" if sim is None else f"{r['steady_tokens_per_s'] / sim:.2f}"
        print(f"| {r['arm']} | {r['case']} | {r['round_s']:.2f} | "
              f"{r['steady_tokens_per_s']:.0f} | {ratio} | {r['tokens_per_s']:.0f} | "
              f"{r['tokens_per_s'] / base:.2f} | {r['act_payload']} | "
              f"{r.get('notice_s', float('nan')):.2f} | {r.get('restart_s', float('nan')):.2f} | "
              f"{r.get('rejoin_s', float('nan')):.2f} | {r.get('retried_steps', '')} | "
              f"{r.get('dropped_steps', '')} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

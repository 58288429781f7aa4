"""Start a pipeline run: R x S stage processes, supervise them, then merge.

`launch_pipeline(config, out_dir=...)` writes `run.json` (config, run key, store URL, the fault
plan, every stage-replica's link address, micro-batches, lives), starts one process per
stage-replica (`python -m crucible.distributed.pipeline.stage --run-dir DIR --replica R --stage
S`: an operator tells them apart in `ps`; `stages/rR-sS/pid` names the current one), restarts a
process that died while it has lives left (one per planned failure of its stage-replica, plus
`restarts` for unplanned deaths), tells every process of an unplanned death (a `ctl` message on
its link, `notices.jsonl`), and when every process has finished (or is lost) merges their
folders into the run folder:

- `model.pt`: the global weights, stage s from its stage-replicas (which must all hold the same
  bits: the merge checks it, and says so in the summary's `pipeline.replicas_agree`);
- `summary.json`: the validation losses, evaluated here from the global weights each stage saved
  at the run's evaluation steps (the simulator's `Evaluator`, so a score is the simulator's for
  the same weights), the tokens processed, each boundary link's bytes, and per stage-replica
  its lives and link counters (`pipeline`);
- `rounds.jsonl`: every stage-replica's round records.

If the launcher is interrupted (an exception, Ctrl-C, a test's timeout) it kills every stage
process first: no stage trains on, orphaned.
"""
from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import torch
import zmq

from crucible.config import Config, ConfigError
from crucible.distributed.journal import died_in
from crucible.distributed.pipeline.links import LAUNCHER, LinkCounters, Outbox, Shaping
from crucible.distributed.pipeline.stage_model import check_pipeline, stage_dir
from crucible.faults import FaultPlan, plan_for
from crucible.model_file import MODEL_FILE, load_global_weights, save_global_weights
from crucible.runfiles import append_jsonl, read_jsonl, write_json_atomic, write_text_atomic

__all__ = ["launch_pipeline", "run_identity", "stage_command", "free_ports", "DEFAULT_RESTARTS"]

log = logging.getLogger(__name__)
DEFAULT_RESTARTS = 3
_POLL_S = 0.1


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """`n` distinct TCP ports free on `host` now (bound to port 0, then released)."""
    socks, ports = [], []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind((host, 0))
            socks.append(s)
            ports.append(s.getsockname()[1])
    finally:
        for s in socks:
            s.close()
    return ports


def stage_command(run_dir: Path, replica: int, stage: int) -> list[str]:
    return [sys.executable, "-m", "crucible.distributed.pipeline.stage", "--run-dir",
            str(run_dir), "--replica", str(replica), "--stage", str(stage)]


def _start(run_dir: Path, replica: int, stage: int) -> subprocess.Popen[bytes]:
    folder = stage_dir(run_dir, replica, stage)
    folder.mkdir(parents=True, exist_ok=True)
    log_file = open(folder / "stage.log", "ab")   # noqa: SIM115 - the child holds it
    try:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        proc = subprocess.Popen(stage_command(run_dir, replica, stage), stdout=log_file,
                                stderr=subprocess.STDOUT, start_new_session=True, env=env)
        write_text_atomic(folder / "pid", f"{proc.pid}\n")   # which process is this stage now
        return proc
    finally:
        log_file.close()


def _stop(procs: list[subprocess.Popen[bytes]]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
    for proc in procs:
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            log.error("stage process %d did not die", proc.pid)


def run_identity(config: Config, *, plan: FaultPlan, addresses: dict[str, str], store_url: str,
                 micro_batches: int, link_timeout_s: float, restarts: int,
                 shaping: Shaping | None = None, binds: dict[str, str] | None = None,
                 run_key: str | None = None) -> dict[str, Any]:
    """The run's `run.json`, which every stage process reads: config, run key, store, the
    fault plan, each stage-replica's link address (`"r,s"`; `binds`: where it binds instead,
    when its peers reach it by another name) and lives (one per planned failure of it before
    the run's end, plus `restarts`)."""
    R, S = config.replicas, config.pipeline.stages
    planned = {(f.replica, f.stage): 0 for f in plan.failures}
    for f in plan.failures:
        if f.start < config.train.global_steps:
            planned[(f.replica, f.stage)] += 1
    lives = {f"{r},{s}": 1 + planned.get((r, s), 0) + restarts for r in range(R)
             for s in range(S)}
    shaping = shaping or Shaping()
    return {"mode": "pipeline", "run_key": run_key or f"run-{uuid.uuid4().hex[:12]}",
            "store_url": store_url, "config": config.to_dict(), "plan": plan.to_list(),
            "addresses": addresses, **({"binds": binds} if binds else {}),
            "micro_batches": micro_batches, "link_timeout_s": link_timeout_s, "lives": lives,
            "shaping": {"mbps": shaping.mbps, "latency_ms": shaping.latency_ms}}


def launch_pipeline(config: Config, *, out_dir: str | os.PathLike[str],
                    plan: FaultPlan | None = None, micro_batches: int = 1,
                    restarts: int = DEFAULT_RESTARTS, link_timeout_s: float = 120.0,
                    host: str = "127.0.0.1", shaping: Shaping | None = None) -> dict[str, Any]:
    """Run `config` with one process per stage-replica; returns the merged summary (also in
    `out_dir/summary.json`). A stage-replica killed by a signal is restarted while it has
    lives (one per planned failure, plus `restarts`); every process is told of an unplanned
    death (`_notify`), and one with no life left is reported in `pipeline.lost` while the run
    goes on without it. Raises ConfigError for what the pipeline mode cannot run and
    RuntimeError when a stage process fails with an error."""
    check_pipeline(config, micro_batches=micro_batches)
    if restarts < 0:
        raise ConfigError(f"--restarts must be >= 0, got {restarts}")
    if link_timeout_s <= 0:
        raise ConfigError(f"--link-timeout must be > 0 seconds, got {link_timeout_s}")
    R, S = config.replicas, config.pipeline.stages
    if plan is None:
        plan = plan_for(config.faults, seed=config.seed, replicas=R, stages=S,
                        horizon=config.train.global_steps)
    plan.validate(replicas=R, stages=S)
    out = Path(out_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    ports = free_ports(R * S, host)
    addresses = {f"{r},{s}": f"tcp://{host}:{ports[r * S + s]}" for r in range(R)
                 for s in range(S)}
    ident = run_identity(config, plan=plan, addresses=addresses,
                         store_url=config.store.url or (out / "store").as_uri(),
                         micro_batches=micro_batches, link_timeout_s=link_timeout_s,
                         restarts=restarts, shaping=shaping)
    write_json_atomic(out / "run.json", ident)
    lives = ident["lives"]
    started = time.time()
    procs: dict[tuple[int, int], subprocess.Popen[bytes]] = {}
    used = {key: 1 for key in [(r, s) for r in range(R) for s in range(S)]}
    done: set[tuple[int, int]] = set()
    lost: dict[tuple[int, int], dict[str, Any]] = {}
    context = zmq.Context()
    notices = Outbox(context, LAUNCHER, LinkCounters())
    try:
        for r in range(R):
            for s in range(S):
                procs[(r, s)] = _start(out, r, s)
        while len(done) + len(lost) < R * S:
            time.sleep(_POLL_S)
            for key, proc in list(procs.items()):
                if key in done or key in lost or proc.poll() is None:
                    continue
                if proc.returncode == 0:
                    done.add(key)
                    continue
                r, s = key
                if proc.returncode > 0:   # an error, not a kill: restarting would repeat it
                    raise RuntimeError(
                        f"stage {s} of replica {r} failed (exit {proc.returncode}); its log: "
                        f"{stage_dir(out, r, s) / 'stage.log'}")
                gone = used[key] >= lives[f"{r},{s}"]
                if gone or not _planned_death(out, r, s, life=used[key] - 1):
                    _notify(out, notices, addresses, r=r, s=s, gone=gone,
                            exit_code=proc.returncode)
                if gone:
                    log.warning("stage %d of replica %d died (exit %d) with no life left (%d "
                                "used): the run goes on without it", s, r, proc.returncode,
                                used[key])
                    lost[key] = {"replica": r, "stage": s, "exit": proc.returncode,
                                 "lives": used[key]}
                    continue
                log.info("stage %d of replica %d exited %d; restarting (life %d of %d)", s, r,
                         proc.returncode, used[key] + 1, lives[f"{r},{s}"])
                used[key] += 1
                procs[key] = _start(out, r, s)
    except BaseException:
        _stop(list(procs.values()))
        raise
    finally:
        notices.close()
        context.term()
    wall_s = time.time() - started
    summary = merge_pipeline(out, config, wall_s=wall_s, lives_used=used,
                             lost=list(lost.values()))
    summary["pipeline"]["shaping"] = (shaping or Shaping()).to_dict()
    write_json_atomic(out / "summary.json", summary)
    return summary


def _planned_death(out: Path, replica: int, stage: int, *, life: int) -> bool:
    """Whether life `life` of the stage-replica ended by its own planned kill (its journal's
    last record says so): every peer knows that one from the fault plan."""
    path = stage_dir(out, replica, stage) / "process.jsonl"
    records = read_jsonl(path) if path.exists() else []
    last = records[-1] if records else {}
    return bool(last.get("kind") == "kill" and last.get("planned") and last.get("life") == life)


def _notify(out: Path, notices: Outbox, addresses: dict[str, str], *, r: int, s: int,
            gone: bool, exit_code: int) -> None:
    """Tell every stage process that stage `s` of replica `r` died unplanned (in the round
    after its last round record) and whether it comes back; recorded in `notices.jsonl`."""
    control = {"event": "dead", "replica": r, "stage": s,
               "round": died_in(stage_dir(out, r, s)), "gone": gone}
    for key, address in addresses.items():
        if key != f"{r},{s}":
            notices.send(address, "ctl", g=0, h=0, m=0, tensors={}, control=control)
    append_jsonl(out / "notices.jsonl", {**control, "exit": exit_code, "wall": time.time()})


def _stage_weights(out: Path, config: Config, name: str) -> tuple[list[dict[str, torch.Tensor]],
                                                                  bool]:
    """Stage s's weights from the stage-replicas' `name` files (lowest replica first) and
    whether every replica that wrote one holds the same bits."""
    R, S = config.replicas, config.pipeline.stages
    merged: list[dict[str, torch.Tensor]] = []
    agree = True
    for s in range(S):
        copies = []
        for r in range(R):
            path = stage_dir(out, r, s) / name
            if path.is_file():
                copies.append(load_global_weights(path)[s])
        if not copies:
            raise RuntimeError(f"no stage-replica of stage {s} wrote {name}")
        first = copies[0]
        for other in copies[1:]:
            agree = agree and all(torch.equal(first[n], other[n]) for n in first)
        merged.append(first)
    return merged, agree


def _write_records(out: Path, config: Config, evals: list[dict[str, Any]],
                   rounds: list[dict[str, Any]], notices: list[dict[str, Any]],
                   lost: list[dict[str, Any]]) -> None:
    """The run's `metrics.jsonl` and `events.jsonl`, as a simulated run's (what the registry
    ingests): validation losses, each replica's training loss per round (its last stage's),
    the plan's fault events (`strategy.fault_events`, as the simulator reports them), each
    unplanned death's bypass or drop, and the processes' real kills, restarts and rejoins with
    their wall-clock seconds after the kill."""
    from crucible.events import Event, JsonlCallback, Metric
    from crucible.strategy import fault_events, plan_step

    ident = json.loads((out / "run.json").read_text())
    plan = FaultPlan.from_list(ident["plan"])
    R, S = config.replicas, config.pipeline.stages
    for name in ("metrics.jsonl", "events.jsonl"):   # written whole by each merge
        (out / name).unlink(missing_ok=True)
    sink = JsonlCallback(out)
    try:
        for e in evals:
            sink.metric(Metric("val_loss", e["global_step"], e["val_loss"]))
        for row in rounds:
            if row["stage"] == S - 1 and row.get("train_loss") is not None:
                sink.metric(Metric("train_loss", row["global_step"], row["train_loss"],
                                   replica=row["replica"]))
        strategy = config.faults.strategy
        for g in range(config.train.global_steps):
            for event in fault_events(plan, g, plan_step(plan, g, config=config),
                                      strategy=strategy, replicas=list(range(R))):
                sink.event(event)
        for n in notices:
            r, s, d = int(n["replica"]), int(n["stage"]), int(n["round"])
            kind = "bypass" if strategy == "skip" and 0 < s < S - 1 else "drop"
            sink.event(Event(kind, d, replica=r, stage=s,
                             detail={"strategy": strategy, "unplanned": True}))
        for r in range(R):
            for s in range(S):
                for event in _process_events(out, r, s, notices):
                    sink.event(event)
        for row in lost:
            sink.event(Event("process_lost", config.train.global_steps - 1,
                             replica=row["replica"], stage=row["stage"],
                             detail={"lives": row["lives"], "exit": row["exit"]}))
    finally:
        sink.close()


def _process_events(out: Path, r: int, s: int, notices: list[dict[str, Any]]) -> list[Any]:
    """A stage-replica's real kills, restarts and rejoins from its journal: each `kill` (its
    wall-clock: the planned kill's own record, or the launcher's notice of an unplanned one)
    with the `restart` and `rejoin` after it."""
    from crucible.events import Event

    path = stage_dir(out, r, s) / "process.jsonl"
    records = read_jsonl(path) if path.exists() else []
    events = []
    for i, rec in enumerate(records):
        if rec.get("kind") != "kill":
            continue
        g = int(rec["global_step"])
        wall = rec["wall"]
        if not rec.get("planned"):
            seen = [n["wall"] for n in notices
                    if (n["replica"], n["stage"], n["round"]) == (r, s, g)]
            wall = seen[0] if seen else wall
        events.append(Event("process_killed", g, replica=r, stage=s,
                            detail={"killed_at_step": g, "planned": bool(rec.get("planned"))}))
        for later in records[i + 1:]:
            if later.get("kind") == "kill":
                break
            kind = {"restart": "process_restarted", "rejoin": "process_rejoined"}.get(
                later.get("kind"))
            if kind is not None:
                events.append(Event(kind, int(later["global_step"]), replica=r, stage=s,
                                    detail={"killed_at_step": g, "seconds_after_kill":
                                            round(float(later["wall"]) - float(wall), 3)}))
    return events


def merge_pipeline(out: Path, config: Config, *, wall_s: float,
                   lives_used: dict[tuple[int, int], int],
                   lost: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    from crucible.evaluation import Evaluator

    R, S = config.replicas, config.pipeline.stages
    weights, agree = _stage_weights(out, config, MODEL_FILE)
    save_global_weights(out / MODEL_FILE, weights)
    evals = []
    steps = sorted({int(p.stem[1:]) for r in range(R) for s in range(S)
                    for p in (stage_dir(out, r, s) / "global").glob("g*.pt")})
    device = torch.device("cpu")
    evaluator = None
    missing = []
    for g in steps:
        try:
            stage_weights, same = _stage_weights(out, config, f"global/g{g:06d}.pt")
        except RuntimeError:   # no live copy of some stage's weights at this step
            missing.append(g)
            continue
        agree = agree and same
        evaluator = Evaluator.of_weights(config, stage_weights, device=device)
        loss = evaluator.evaluate()
        evals.append({"global_step": g, "val_loss": loss,
                      "val_loss_stderr": evaluator.last_eval_stderr})
    stages = []
    rounds = []
    link: dict[str, Any] = {"sent_bytes": {}, "sent_payload": {}, "refused": 0}
    tokens = 0
    for r in range(R):
        for s in range(S):
            folder = stage_dir(out, r, s)
            if (folder / "rounds.jsonl").exists():
                rounds += read_jsonl(folder / "rounds.jsonl")
            if not (folder / "summary.json").exists():   # lost: it never finished
                continue
            summary = json.loads((folder / "summary.json").read_text())
            links = summary["links"]
            for key in ("sent_bytes", "sent_payload"):
                for kind, n in links[key].items():
                    link[key][kind] = link[key].get(kind, 0) + n
            link["refused"] += sum(links["refused"].values())
            tokens += int(summary["tokens"])
            stages.append({"replica": r, "stage": s, "lives": lives_used[(r, s)],
                           "wall_s": summary["wall_s"], "links": links,
                           "retried_steps": summary.get("retried_steps", 0),
                           "dropped_steps": summary.get("dropped_steps", 0)})
    rounds.sort(key=lambda x: (x["global_step"], x["replica"], x["stage"]))
    notices = read_jsonl(out / "notices.jsonl") if (out / "notices.jsonl").exists() else []
    _write_records(out, config, evals, rounds, notices, lost or [])
    write_text_atomic(out / "rounds.jsonl", "".join(json.dumps(row) + "\n" for row in rounds))
    final = evals[-1] if evals else None
    result = {
        "mode": "pipeline", "replicas": R, "stages": S, "wall_s": wall_s,
        "initial_val_loss": evals[0]["val_loss"] if evals and evals[0]["global_step"] == 0
        else None,
        "final_val_loss": final["val_loss"] if final else None, "evals": evals,
        "tokens_processed": tokens,
        "pipeline": {"replicas_agree": agree, "links": link, "stages": stages,
                     "evals_missing": missing, "lost": lost or [], "notices": notices},
    }
    write_json_atomic(out / "summary.json", result)
    return result

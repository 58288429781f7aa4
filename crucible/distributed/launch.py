"""Start a distributed run: one torch.distributed.elastic agent per replica, then merge.

Each replica gets its own agent (`python -m torch.distributed.run --standalone --nproc-per-node 1
--max-restarts K -m crucible.distributed.worker ...`), not one agent for all: an elastic agent
restarts its whole worker group when one worker dies, and a replica's death must not restart
(and wipe the optimiser state of) the others. The replicas share no process group; they meet
only in the object store. On a host with GPUs, agent r sees GPU r mod n (`CUDA_VISIBLE_DEVICES`)
and its worker runs on `cuda:LOCAL_RANK`.

Unplanned faults recover. Every replica has a restart budget (`restarts`, default 3, on top of
one restart per planned `--kill`): its agent restarts a worker that died for any reason, and the
launcher starts a new agent (with what is left of the budget) for an agent that was itself
killed, after making sure its worker is gone. Survivors read each other's heartbeat leases
(`crucible.distributed.liveness`, `lease_s`) and stop waiting for a peer that is dead, so a dead
replica costs them at most one deadline. A replica that never returns (its budget spent, or
killed for good) is reported (`distributed.lost`, a `process_lost` event) and the run completes
without it, as long as one replica finished.

`launch()` writes `run.json` (config, run key, store URL, fault plan, kill plan, lives per
replica, lease) first, watches every agent until each is done, then merges the per-replica folders into the run folder: `summary.json` (built by
the simulator's builder, `RunCounters.summary`, from counters rebuilt out of the replicas' round
records and the agreed manifests, so it has every key the simulator's has; plus a `distributed`
section),
`events.jsonl`, `metrics.jsonl`, `process.jsonl` (kill / restart / first contribution records
with wall-clock times) and `model.pt` (the global weights), each written atomically. If the
launcher is interrupted while the agents run (an exception, Ctrl-C, a test's timeout; the CLI
turns SIGTERM into one), it stops them first (`_stop`): no replica trains on, orphaned.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from crucible.config import Config, ConfigError
from crucible.distributed.journal import count_lives, died_in
from crucible.distributed.liveness import (
    DEFAULT_LEASE_S,
    DEFAULT_RESTARTS,
    check_recovery,
    read_beat,
)
from crucible.distributed.worker import check_distributed
from crucible.events import Event, Metric
from crucible.faults import FaultPlan
from crucible.gather import MAX_MANIFESTS, manifest_key
from crucible.manifest import InvalidManifest, Manifest
from crucible.model_file import MODEL_FILE
from crucible.runfiles import (
    append_jsonl,
    atomic_file,
    read_jsonl,
    repair_torn_tail,
    write_bytes_atomic,
    write_json_atomic,
)
from crucible.store import KeyNotFound, Store, open_store
from crucible.summary import RunCounters

__all__ = ["Kill", "launch", "agent_command", "check_kills", "check_recovery", "lives_of",
           "merge", "DEFAULT_RESTARTS", "DEFAULT_LEASE_S"]

log = logging.getLogger(__name__)


class Kill(dict):
    """A planned SIGKILL: `Kill(replica=1, global_step=3, rejoin=True)`; `rejoin=False` gives
    the replica's agent no restart for it (the replica never comes back)."""

    def __init__(self, *, replica: int, global_step: int, rejoin: bool = True) -> None:
        super().__init__(replica=replica, global_step=global_step, rejoin=rejoin)


def check_kills(kills: list[dict[str, Any]], config: Config) -> None:
    seen: dict[tuple[int, int], dict[str, Any]] = {}
    for k in kills:
        text = f"{'--kill' if k['rejoin'] else '--kill-forever'} {k['replica']}@{k['global_step']}"
        if not 0 <= k["replica"] < config.replicas:
            raise ConfigError(f"{text}: replica must be in 0..{config.replicas - 1}")
        if not 0 < k["global_step"] < config.train.global_steps:
            raise ConfigError(f"{text}: global_step must be in 1..{config.train.global_steps - 1}"
                              " (a replica killed before the first round has nothing to rejoin)")
        if (k["replica"], k["global_step"]) in seen:
            raise ConfigError(f"{text}: replica {k['replica']} is killed twice at global step "
                              f"{k['global_step']}; give each kill once")
        seen[(k["replica"], k["global_step"])] = k
    for step in sorted({g for (_, g) in seen}):
        if sum(1 for (_, g) in seen if g == step) == config.replicas:
            # nobody is left to agree the round without them: each restarted replica would wait
            # out its catch-up deadline and train that round with fresh state
            raise ConfigError(f"--kill ...@{step}: every replica is killed at global step {step}; "
                              "leave at least one replica running in each round")
    for k in kills:
        later = [g for (r, g) in seen if r == k["replica"] and g > k["global_step"]]
        if not k["rejoin"] and later:
            # its agent would get a restart for the later kill and spend it on this one
            raise ConfigError(f"--kill-forever {k['replica']}@{k['global_step']}: the replica "
                              f"never comes back, so it cannot be killed again at global step "
                              f"{min(later)}; drop the later kill or use --kill")


def lives_of(config: Config, kills: list[dict[str, Any]], *, restarts: int) -> list[int]:
    """Per replica, how many processes (lives) it may have: one, `restarts` more for whatever
    may kill it, and one more per planned kill (a replica killed for good gets one to learn it
    is gone and exit)."""
    return [1 + restarts + sum(1 for k in kills if k["replica"] == r)
            for r in range(config.replicas)]


def agent_command(run_dir: Path, replica: int, *, max_restarts: int) -> list[str]:
    """The torchrun command line of replica `replica`'s elastic agent."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1",
            "--nproc-per-node", "1", "--max-restarts", str(max_restarts),
            "--monitor-interval", "0.1", "-m", "crucible.distributed.run_worker",
            "--run-dir", str(run_dir), "--replica", str(replica)]


def launch(config: Config, *, out_dir: str | os.PathLike[str], plan: FaultPlan | None = None,
           kills: list[dict[str, Any]] | None = None, start_timeout_s: float = 300.0,
           gpus: int | None = None, restarts: int = DEFAULT_RESTARTS,
           lease_s: float = DEFAULT_LEASE_S) -> dict[str, Any]:
    """Run `config` with one process per replica; returns the merged summary (also written to
    `out_dir/summary.json`). `restarts`: per replica, restarts for unplanned deaths of its
    worker or agent; `lease_s`: the heartbeat lease after which peers count a silent replica as
    dead (0: none). Raises ConfigError for what the distributed mode cannot run and
    RuntimeError when no replica finished."""
    check_distributed(config)
    check_recovery(restarts=restarts, lease_s=lease_s)
    kills = [dict(k) for k in (kills or [])]
    check_kills(kills, config)
    out = Path(out_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    run_key = f"run-{uuid.uuid4().hex[:12]}"
    store_url = config.store.url or (out / "store").as_uri()
    lives = lives_of(config, kills, restarts=restarts)
    write_json_atomic(out / "run.json", {
        "run_key": run_key, "store_url": store_url, "config": config.to_dict(),
        "plan": plan.to_list() if plan is not None else None, "kills": kills,
        "start_timeout_s": start_timeout_s, "lives": lives, "lease_s": float(lease_s)})
    if gpus is None:
        import torch
        gpus = torch.cuda.device_count()
    started = time.time()
    agents: dict[int, subprocess.Popen[bytes]] = {}
    try:
        for r in range(config.replicas):
            agents[r] = _start_agent(out, r, max_restarts=lives[r] - 1, gpus=gpus)
        codes = _supervise(out, agents, lives, gpus=gpus)
    except BaseException:   # an interrupt, a test's timeout, a failed start: no orphans
        _stop(list(agents.values()))
        raise
    wall_s = time.time() - started
    summary = merge(out, config, kills=kills, exit_codes=codes, wall_s=wall_s)
    for row in summary["distributed"]["lost"]:
        log.warning("replica %d never came back (%s); the run completed without it",
                    row["replica"], row["reason"])
    return summary


def _start_agent(out: Path, replica: int, *, max_restarts: int,
                 gpus: int) -> subprocess.Popen[bytes]:
    env = dict(os.environ)
    if gpus:
        env["CUDA_VISIBLE_DEVICES"] = str(replica % gpus)
    folder = out / "replicas" / f"replica-{replica}"
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "agent.log", "ab") as log_file:
        agent = subprocess.Popen(agent_command(out, replica, max_restarts=max_restarts),
                                 env=env, stdout=log_file, stderr=subprocess.STDOUT)
    write_json_atomic(folder / "agent.pid", {"pid": agent.pid, "replica": replica})
    return agent


def _supervise(out: Path, agents: dict[int, subprocess.Popen[bytes]], lives: list[int], *,
               gpus: int) -> list[int]:
    """Wait for every agent; an agent killed by a signal (not one that gave up on its worker)
    is replaced while its replica has lives left and has not finished. Returns the exit codes."""
    codes: dict[int, int] = {}
    while len(codes) < len(agents):
        for r, agent in agents.items():
            if r in codes or (code := agent.poll()) is None:
                continue
            folder = out / "replicas" / f"replica-{r}"
            left = lives[r] - count_lives(read_jsonl(folder / "process.jsonl"))
            if code < 0 and not (folder / "summary.json").exists() and left > 0:
                _kill_orphan(out, r)
                log.warning("the agent of replica %d died (signal %d); starting a new one "
                            "(%d lives left)", r, -code, left)
                repair_torn_tail(folder / "process.jsonl")
                append_jsonl(folder / "process.jsonl", {
                    "kind": "agent_lost", "replica": r, "signal": -code, "wall": time.time(),
                    "global_step": -1})
                agents[r] = _start_agent(out, r, max_restarts=left - 1, gpus=gpus)
                continue
            codes[r] = code
            if not (folder / "summary.json").exists():
                _mark_gone(out, r)
        time.sleep(0.1)
    return [codes[r] for r in range(len(agents))]


def _mark_gone(out: Path, replica: int) -> None:
    """Tell the peers in the store that `replica` will not come back (its agent gave up), so
    that none of them waits for it again, even one that never saw it beat."""
    from crucible.distributed.liveness import write_gone

    ident = json.loads((out / "run.json").read_text())
    config = ident["config"]["store"]
    try:
        store = open_store(ident["store_url"], endpoint_url=config.get("endpoint_url"),
                           region=config.get("region"))
        write_gone(store, ident["run_key"], replica)
    except Exception as exc:          # advice to the peers: the run goes on without it
        log.warning("could not mark replica %d gone in the store: %s", replica, exc)


def _kill_orphan(out: Path, replica: int) -> None:
    """SIGKILL every worker of `replica` a dead agent left behind (where `PR_SET_PDEATHSIG`
    did not take), found by command line, and wait until they are gone: two processes must
    never train one replica."""
    from crucible.distributed.outside import worker_pids

    pids = worker_pids(out, replica=replica)
    for pid in pids:
        log.warning("replica %d: killing worker %d, left behind by its dead agent", replica, pid)
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            continue
    deadline = time.monotonic() + 30
    while any(Path(f"/proc/{pid}").exists() for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)


def _stop(agents: list[subprocess.Popen[bytes]], *, grace_s: float = 60.0) -> None:
    """Stop every agent still running and wait for it. SIGTERM first: the agent then stops its
    worker (which torchrun starts in a session of its own, out of reach of a signal to the
    agent's group) before it exits; SIGKILL after `grace_s` (torchrun's own grace is 30 s)."""
    for agent in agents:
        if agent.poll() is None:
            agent.terminate()
    for agent in agents:
        try:
            agent.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            log.warning("agent %d ignored SIGTERM for %.0f s; killing it (its worker may "
                        "outlive it)", agent.pid, grace_s)
            agent.kill()
            agent.wait()


def _jsonl_bytes(records: list[dict[str, Any]]) -> bytes:
    return "".join(json.dumps(r, sort_keys=True) + "\n" for r in records).encode("utf-8")


def merge(out: Path, config: Config, *, kills: list[dict[str, Any]], exit_codes: list[int],
          wall_s: float) -> dict[str, Any]:
    """Merge `out/replicas/replica-*/` into the run folder's summary, records and model.

    Counts come from what survives a SIGKILL: each replica's per-round records (`rounds.jsonl`,
    appended durably after every round, by every life of the process) and the agreed manifests
    in the store (contributions made and missed, also those of a replica that is dead). The
    evaluation and the global weights come from the lowest replica that finished."""
    R, S = config.replicas, config.pipeline.stages
    parts = {r: json.loads(p.read_text()) for r in range(R)
             if (p := out / "replicas" / f"replica-{r}" / "summary.json").exists()}
    if not parts:
        raise RuntimeError(f"no replica of the run in {out} finished; see its agent.log files")
    # evaluations and weights from the lowest replica that finished, one never restarted if any
    # (a restarted process evaluates only after it rejoined)
    first = min(parts, key=lambda r: (parts[r]["restarts"] > 0, r))
    lead = parts[first]
    ident = json.loads((out / "run.json").read_text())
    store = open_store(ident["store_url"], endpoint_url=config.store.endpoint_url,
                       region=config.store.region)
    agreed = _agreed_sets(store, ident["run_key"], steps=lead["global_steps"], stages=S)
    events, metrics, process, rounds = [], [], [], {}
    for r in range(R):
        folder = out / "replicas" / f"replica-{r}"
        events += read_jsonl(folder / "events.jsonl")
        metrics += [m for m in read_jsonl(folder / "metrics.jsonl")
                    if m.get("name") != "val_loss" or r == first]
        process += read_jsonl(folder / "process.jsonl")
        rounds[r] = {x["global_step"]: x for x in read_jsonl(folder / "rounds.jsonl")}
    process += _unrecorded_deaths(out, store, ident["run_key"], R, parts, process)
    # every process reports a `manifest_rejected` it passed over: one event per id
    events = list({e["id"]: e for e in _with_missing_events(events, agreed)}.values())
    events += _process_events(process)
    lost = _lost(R, parts, process, ident.get("lives") or [1] * R, exit_codes)
    events += [Event("process_lost", row["last_step"], replica=row["replica"],
                     detail={"reason": row["reason"], "lives": row["lives"]}).to_dict()
               for row in lost]
    events.sort(key=lambda e: (e["global_step"], e.get("replica") or 0, e["kind"]))
    through = _run_tokens(rounds, steps=lead["global_steps"])
    metrics = _with_run_tokens(metrics, through)
    metrics.sort(key=lambda m: (m["global_step"], m["name"], m.get("replica") or 0))
    process.sort(key=lambda p: p["wall"])
    counters = _merged_counters(config, lead=lead, rounds=rounds, agreed=agreed, events=events,
                                wall_s=wall_s)
    # the simulator's builder, so the merged summary has every key the simulator's has
    summary = counters.summary(config, plan=FaultPlan.from_list(lead["faults"]),
                               tokens_budget=lead["tokens_budget"],
                               global_steps=lead["global_steps"],
                               synced_params=lead["synced_params"])
    # what the lead's `Trainer.run` adds beyond the counters (its evaluations of the global
    # model: eval_tokens, mapl_bases), its versions and the corpus digest
    summary.update({k: v for k, v in lead.items() if k not in summary and k not in _REPLICA_ONLY})
    summary["run_key"], summary["store_url"] = ident["run_key"], ident["store_url"]
    finals = [p["final_val_loss"] for p in parts.values() if p["final_val_loss"] is not None]
    summary["distributed"] = {
        "replicas": R, "exit_codes": exit_codes, "finished": sorted(parts),
        "round_timeout_s": config.sparseloco.round_timeout_s,
        "lease_s": ident.get("lease_s", 0.0), "lives": ident.get("lives") or [1] * R,
        "kills": kills, "recoveries": _recoveries(process),
        "lost": lost,
        "final_val_loss_spread": max(finals) - min(finals) if finals else None,
        "missing_rounds": {str(r): sorted({g for (g, _), m in agreed.items()
                                           if r in m["missing"]}) for r in range(R)},
        "trained_rounds": {str(r): sorted(rounds[r]) for r in range(R)},
        "round_waits_s": {str(r): [rounds[r][g]["wait_s"] for g in sorted(rounds[r])]
                          for r in range(R)},
        "devices": {str(r): p["device"] for r, p in parts.items()},
    }
    write_bytes_atomic(out / "events.jsonl", _jsonl_bytes(events))
    write_bytes_atomic(out / "metrics.jsonl", _jsonl_bytes(metrics))
    write_bytes_atomic(out / "process.jsonl", _jsonl_bytes(process))
    with atomic_file(out / MODEL_FILE) as merged, \
            open(out / "replicas" / f"replica-{first}" / MODEL_FILE, "rb") as lead_model:
        shutil.copyfileobj(lead_model, merged)
    write_json_atomic(out / "summary.json", summary)
    return summary


# keys of a replica's own summary.json that describe the process, not the run (the merged
# summary's `distributed` section has them per replica)
_REPLICA_ONLY = frozenset({"replica", "restarts", "rejoined_at", "round_waits_s", "device"})


def _merged_counters(config: Config, *, lead: dict[str, Any],
                     rounds: dict[int, dict[int, dict[str, Any]]],
                     agreed: dict[tuple[int, int], dict[str, Any]], events: list[dict[str, Any]],
                     wall_s: float) -> RunCounters:
    """The run's `RunCounters` rebuilt from what survives a SIGKILL, for `RunCounters.summary`.

    Per replica and round (`rounds.jsonl`): tokens, inner steps, boundary and upload bytes and
    whether a stage of the replica was down. Per round and stage (the agreed manifests):
    contributions made, missed and rejected, and outer steps skipped (no contribution agreed).
    A round a replica did not train (its process was dead) counts as a down replica-step, as in
    the simulator's equivalent, `drop`. `donor_load` stays zero and `boundary_rerouted` 0:
    reroute, the only strategy with donors, is refused in distributed mode. The evaluations and
    `timing` are the lead replica's (the phases of one process; the processes run in parallel,
    so a sum would exceed the wall clock); `wall_s` is the launcher's."""
    import torch

    R, S, steps = config.replicas, config.pipeline.stages, lead["global_steps"]
    counters = RunCounters.empty(replicas=R, stages=S)
    done = [x for per in rounds.values() for x in per.values()]
    counters.inner_steps = torch.tensor(
        [[sum(x["inner_steps"][s] for x in rounds[r].values()) for s in range(S)]
         for r in range(R)], dtype=torch.long)
    counters.tokens_processed = sum(x["tokens"] for x in done)
    counters.replica_steps = R * steps
    counters.down_replica_steps = sum(1 for r in range(R) for g in range(steps)
                                      if g not in rounds[r] or rounds[r][g].get("down", False))
    made = sum(len(m["included"]) + len(m["rejected"]) for m in agreed.values())
    counters.made, counters.missed = made, R * len(agreed) - made
    counters.rejected = sum(len(m["rejected"]) for m in agreed.values())
    counters.manifests_rejected = sum(1 for e in events if e["kind"] == "manifest_rejected")
    counters.skipped_outer_steps = sum(1 for g in range(steps) for s in range(S)
                                       if not agreed.get((g, s), {}).get("included"))
    counters.bytes_forward = sum(x["boundary_bytes"][0] for x in done)
    counters.bytes_backward = sum(x["boundary_bytes"][1] for x in done)
    counters.bytes_upload = sum(x["upload_bytes"] for x in done)
    counters.bytes_dense = sum(x["dense_bytes"] for x in done)
    counters.initial_val_loss = lead["initial_val_loss"]
    # an evaluation after global step g - 1 is at the run's tokens, not the lead replica's own
    through = _run_tokens(rounds, steps=steps)
    counters.evals = [dict(e, tokens=through[e["global_step"] - 1] if e["global_step"] else 0)
                      for e in lead["evals"]]
    counters.wall_s = wall_s
    counters.timing = dict(lead["timing"])
    return counters


def _run_tokens(rounds: dict[int, dict[int, dict[str, Any]]], *, steps: int) -> list[int]:
    """Tokens the run processed through each global step (inclusive), over every replica."""
    out, total = [], 0
    for g in range(steps):
        total += sum(per[g]["tokens"] for per in rounds.values() if g in per)
        out.append(total)
    return out


def _with_run_tokens(metrics: list[dict[str, Any]], through: list[int]) -> list[dict[str, Any]]:
    """The replicas' metrics with the simulator's `tokens`: the run's count (a process counts
    its own), and the run's `tokens` metric after every global step (a process has none)."""
    out = []
    for m in metrics:
        g = m["global_step"]
        if m["name"] == "val_loss":        # evaluated after global step g - 1
            m = dict(m, tokens=through[g - 1] if g else 0)
        elif m.get("tokens") is not None and g < len(through):
            m = dict(m, tokens=through[g])
        out.append(m)
    out += [Metric("tokens", g, float(n), tokens=n).to_dict() for g, n in enumerate(through)]
    return out


def _agreed_sets(store: Store, run_key: str, *, steps: int,
                 stages: int) -> dict[tuple[int, int], dict[str, Any]]:
    """(global step, stage) -> the agreed manifest's body (the first that parses; in a run of
    honest peers that is `manifest.json`)."""
    out = {}
    for g in range(steps):
        for s in range(stages):
            for version in range(MAX_MANIFESTS):
                try:
                    manifest = Manifest.from_json(
                        store.get(manifest_key(run_key, g, s, version=version)))
                except KeyNotFound:
                    break
                except InvalidManifest:
                    continue
                out[(g, s)] = {"included": manifest.included, "missing": manifest.missing,
                               "rejected": [x.replica for x in manifest.rejected]}
                break
    return out


def _with_missing_events(events: list[dict[str, Any]],
                         agreed: dict[tuple[int, int], dict[str, Any]]) -> list[dict[str, Any]]:
    """`events` plus a `contribution_missing` event for every expected contribution a manifest
    lists as missing (a dead process reports nothing itself)."""
    seen = {e["id"] for e in events}
    out = list(events)
    for (g, s), m in sorted(agreed.items()):
        for r in m["missing"]:
            event = Event("contribution_missing", g, replica=r, stage=s).to_dict()
            if event["id"] not in seen:
                seen.add(event["id"])
                out.append(event)
    return out


def _process_events(process: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The real faults as events beside the simulated ones (so the registry and the dashboards
    see them): `process_killed` at the kill's global step, `process_restarted` when its agent
    started it again and `process_rejoined` at its first contribution after the kill, each with
    `detail.seconds_after_kill` (wall clock) and `detail.killed_at_step`."""
    out = []
    for row in _recoveries(process):
        replica, killed = row["replica"], row["killed_at_step"]
        out.append(Event("process_killed", killed, replica=replica,
                         detail={"killed_at_step": killed, "planned": row["planned"]}).to_dict())
        for kind, name in (("process_restarted", "restart"), ("process_rejoined", "rejoin")):
            if row[f"{name}_step"] is not None:
                out.append(Event(kind, row[f"{name}_step"], replica=replica, detail={
                    "killed_at_step": killed,
                    "seconds_after_kill": round(row[f"kill_to_{name}_s"], 3)}).to_dict())
    return out


def _unrecorded_deaths(out: Path, store: Store, run_key: str, R: int, parts: dict[int, Any],
                       process: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A `kill` record for each replica whose last life died with no life after it to record
    the death (its budget spent): unplanned, at the dead life's last heartbeat."""
    out_records = []
    for r in range(R):
        mine = [p for p in process if p["replica"] == r]
        starts = [p for p in mine if p["kind"] in ("start", "restart")]
        if r in parts or not starts or starts[-1].get("gone"):
            continue
        life = len(starts) - 1
        if any(p["kind"] == "kill" and p.get("life", 0) == life and p.get("planned", True)
               for p in mine):
            continue
        beat = read_beat(store, run_key, r)
        wall = beat["wall"] if beat is not None and beat["life"] == life else max(
            p["wall"] for p in mine)
        out_records.append({"kind": "kill", "global_step": died_in(out / "replicas" /
                                                                    f"replica-{r}"),
                            "replica": r, "wall": wall, "life": life, "planned": False,
                            "rejoin": False, "recorded_by": "launcher"})
    return out_records


def _lost(R: int, parts: dict[int, Any], process: list[dict[str, Any]], lives: list[int],
          exit_codes: list[int]) -> list[dict[str, Any]]:
    """The replicas that did not finish: why, how many lives they had and the global step of
    their last round (from their records)."""
    out = []
    for r in range(R):
        if r in parts:
            continue
        mine = [p for p in process if p["replica"] == r]
        forever = next((p for p in mine if p["kind"] == "kill" and p.get("rejoin") is False
                        and p.get("planned", True)), None)
        used = count_lives(mine)
        if forever is not None:
            reason = f"killed for good at global step {forever['global_step']} (--kill-forever)"
        elif used >= lives[r]:
            reason = (f"its restart budget is spent: {used} lives of {lives[r]} "
                      f"(agent exit code {exit_codes[r]})")
        else:
            reason = f"its agent exited with code {exit_codes[r]} after {used} lives"
        steps = [p["global_step"] for p in mine if p["kind"] in ("kill", "caught_up")]
        out.append({"replica": r, "reason": reason, "lives": used,
                    "last_step": max(steps, default=0)})   # the step it was lost in
    return out


def _recoveries(process: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per kill (planned, or an unplanned death the next life recorded): when the process was
    back, caught up with the global weights and contributed again, in global steps and in
    wall-clock seconds after the kill (for an unplanned one, after the dead life's last
    heartbeat: an upper bound by one beat interval)."""
    out = []
    for kill in (p for p in process if p["kind"] == "kill"):
        mine = [p for p in process if p["replica"] == kill["replica"] and not p.get("gone")]
        if "life" in kill:           # the lives after the one that died
            dead = kill.get("dead_life", kill["life"])
            later = [p for p in mine if p.get("life", -1) > dead]
        else:                        # records from before lives were counted
            later = [p for p in mine if p["wall"] > kill["wall"]]
        row: dict[str, Any] = {"replica": kill["replica"], "killed_at_step": kill["global_step"],
                               "planned": kill.get("planned", True)}
        for kind, name in (("restart", "restart"), ("caught_up", "caught_up"),
                           ("first_contribution", "rejoin")):
            found = next((p for p in later if p["kind"] == kind), None)
            row[f"{name}_step"] = found["global_step"] if found else None
            row[f"kill_to_{name}_s"] = found["wall"] - kill["wall"] if found else None
        out.append(row)
    return out

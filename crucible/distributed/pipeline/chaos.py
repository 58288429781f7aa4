"""Unplanned kills of a running pipeline at a fixed rate, and the failure schedule they made.

The pipeline mode replays a *planned* fault plan to the bit (each planned death at a global-step
boundary); this module makes the other kind, the one the blog's caveat is about: `kill -9` of
inner stage processes at wall-clock moments nobody planned, at a fixed rate.

- `draw_kills(seed=, rate=, ...)`: the kills to attempt, from their own seeded stream
  (`KILL_STREAM`): in every global step after the first, each inner stage-replica is killed with
  probability `rate`, `fraction` of the way through that round (uniform in [0, 1)). First and
  last stages are never chosen: the blog's failures are of inner stages (a first or last stage's
  death drops its replica's tokens, `crucible launch --pipeline` handles it, this schedule does
  not make it).
- `Killer`: a thread that carries the kills out against a live run folder. A kill waits until
  its stage-replica has finished the round before its step, then `fraction` of that stage's
  recent round time, then sends SIGKILL to the process `stages/rR-sS/pid` names (checked against
  `/proc/PID/cmdline`). A stage-replica that is down or still coming back at that moment is not
  killed again: the kill is recorded as `skipped` (a real failure process cannot kill a machine
  that is already dead either), as is one whose replica has another stage down (the
  simulator's plans, like the blog's, fail one stage of a replica at a time).
- `realized_plan(run_dir, ...)`: what the kills did, as a `FaultPlan`: each death from the
  round it happened in to the round its next life rejoined (the stage journals'
  `kill`/`rejoin` records). The simulator replays that plan: the failure schedule the real run
  had, at global-step granularity.
"""
from __future__ import annotations

import logging
import os
import signal
import statistics
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from crucible.distributed.pipeline.stage_model import stage_dir
from crucible.faults import Failure, FaultPlan
from crucible.runfiles import read_jsonl
from crucible.seeding import generator

__all__ = ["Kill", "Killer", "KILL_STREAM", "draw_kills", "realized_plan"]

log = logging.getLogger(__name__)
KILL_STREAM = 0xC4A0
_POLL_S = 0.01


@dataclass(frozen=True)
class Kill:
    """One attempted `kill -9`: stage `stage` of replica `replica`, `fraction` of the way into
    global step `global_step` (by that stage's recent round time)."""
    replica: int
    stage: int
    global_step: int
    fraction: float


def draw_kills(*, seed: int, rate: float, replicas: int, stages: int,
               global_steps: int) -> list[Kill]:
    """The kills to attempt, in the order they come (global step, then fraction). Raises
    ValueError for a rate outside [0, 1] or a pipeline without inner stages."""
    if not 0.0 <= rate <= 1.0:
        raise ValueError(f"rate={rate}: a kill probability per stage-replica and global step "
                         "must be in [0, 1]")
    if stages < 3:
        raise ValueError(f"stages={stages}: unplanned kills hit inner stages; use at least 3")
    gen = generator(seed, KILL_STREAM, round(rate * 1_000_000_000), replicas, stages)
    kills = []
    for g in range(1, global_steps):     # round 0 is start-up for every process
        for r in range(replicas):
            for s in range(1, stages - 1):
                hit, fraction = (float(x) for x in torch.rand(2, generator=gen))
                if hit < rate:
                    kills.append(Kill(replica=r, stage=s, global_step=g, fraction=fraction))
    return sorted(kills, key=lambda k: (k.global_step, k.fraction, k.replica, k.stage))


def _journal(run_dir: Path, replica: int, stage: int) -> list[dict[str, Any]]:
    path = stage_dir(run_dir, replica, stage) / "process.jsonl"
    return read_jsonl(path) if path.exists() else []


def _rounds(run_dir: Path, replica: int, stage: int) -> list[dict[str, Any]]:
    path = stage_dir(run_dir, replica, stage) / "rounds.jsonl"
    return read_jsonl(path) if path.exists() else []


def _live_pid(run_dir: Path, replica: int, stage: int) -> int | None:
    """The stage-replica's current process, if it is alive and really that stage's."""
    folder = stage_dir(run_dir, replica, stage)
    try:
        pid = int((folder / "pid").read_text())
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except (OSError, ValueError):
        return None
    want = [b"crucible.distributed.pipeline.stage", b"--replica", str(replica).encode(),
            b"--stage", str(stage).encode()]
    if not all(w in argv for w in want) or str(Path(run_dir).resolve()).encode() not in argv:
        return None
    return pid


def _training(journal: list[dict[str, Any]]) -> bool:
    """Whether the stage-replica's current life is training: it started, or came back and
    rejoined (not between a death and its rejoin)."""
    return bool(journal) and journal[-1].get("kind") in ("start", "rejoin")


class Killer(threading.Thread):
    """Carries out `kills` against the run in `run_dir` while `alive()` holds; `done` lists
    each kill with what happened (`killed` with its wall-clock, or `skipped` and why)."""

    def __init__(self, run_dir: Path, kills: list[Kill], *, stages: int, alive: Any,
                 timeout_s: float = 600.0) -> None:
        super().__init__(name="pipeline-killer", daemon=True)
        self.run_dir, self.kills, self.alive = Path(run_dir).resolve(), kills, alive
        self.stages = stages
        self.timeout_s = timeout_s
        self.done: list[dict[str, Any]] = []
        self.error: BaseException | None = None
        self.killed: dict[tuple[int, int], float] = {}   # this killer's last kill of each

    def _training(self, r: int, s: int) -> bool:
        """Whether stage-replica (r, s) trains now: its journal says so, and a kill of ours
        is followed by its next life's rejoin (until that life writes, a process killed a
        moment ago still reads as training in its journal)."""
        journal = _journal(self.run_dir, r, s)
        at = self.killed.get((r, s))
        if at is not None and not any(x.get("kind") == "rejoin" and float(x["wall"]) > at
                                      for x in journal):
            return False
        return _training(journal)

    def run(self) -> None:
        try:
            for kill in self.kills:
                if not self.alive():
                    self.done.append({**asdict(kill), "outcome": "skipped",
                                      "why": "the run had ended"})
                    continue
                self.done.append({**asdict(kill), **self._one(kill)})
        except BaseException as exc:       # reported by the caller, never lost in a thread
            self.error = exc

    def _one(self, kill: Kill) -> dict[str, Any]:
        r, s, g = kill.replica, kill.stage, kill.global_step
        deadline = time.monotonic() + self.timeout_s
        while True:             # until the stage-replica finished the round before step g
            rounds = _rounds(self.run_dir, r, s)
            if rounds and int(rounds[-1]["global_step"]) >= g - 1:
                break
            if not self.alive() or time.monotonic() > deadline:
                return {"outcome": "skipped", "why": f"round {g - 1} never ended"}
            time.sleep(_POLL_S)
        if int(rounds[-1]["global_step"]) > g - 1:
            return {"outcome": "skipped", "why": f"already past round {g}"}
        walls = [float(x["wall"]) for x in rounds[-4:]]
        round_s = statistics.median(b - a for a, b in zip(walls, walls[1:], strict=False)) \
            if len(walls) > 1 else 0.3
        time.sleep(kill.fraction * round_s)
        pid = _live_pid(self.run_dir, r, s)
        if pid is None or not self._training(r, s):
            return {"outcome": "skipped", "why": "down or coming back"}
        others = range(1, self.stages - 1)
        if any(not self._training(r, t) for t in others if t != s):
            # the simulator's plans hold one failed stage per replica at a time: a second
            # death in a replica while one is down would make a schedule it cannot replay
            return {"outcome": "skipped", "why": "another stage of the replica is down"}
        at = time.time()
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            return {"outcome": "skipped", "why": "exited meanwhile"}
        self.killed[(r, s)] = at
        log.info("killed stage %d of replica %d (pid %d) in round %d", s, r, pid, g)
        return {"outcome": "killed", "pid": pid, "wall": at, "round_s": round_s}


def realized_plan(run_dir: Path, *, replicas: int, stages: int,
                  global_steps: int) -> FaultPlan:
    """The failures the run's unplanned deaths made, from the stage journals: each from the
    round it died in to the round its next life rejoined (the run's end when none did)."""
    failures = []
    for r in range(replicas):
        for s in range(stages):
            journal = _journal(run_dir, r, s)
            for i, rec in enumerate(journal):
                if rec.get("kind") != "kill" or rec.get("planned"):
                    continue
                dead = int(rec["global_step"])
                back = next((int(x["global_step"]) for x in journal[i + 1:]
                             if x.get("kind") == "rejoin"), global_steps)
                if dead < global_steps and back > dead:
                    failures.append(Failure(replica=r, stage=s, start=dead,
                                            duration=back - dead))
    failures.sort(key=lambda f: (f.start, f.replica, f.stage))
    return FaultPlan(failures).validate(replicas=replicas, stages=stages)

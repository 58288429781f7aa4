"""Fault plans: which inner stage of which replica is down in which global steps, as data.

A `FaultPlan` is a list of `Failure(replica, stage, start, duration)`; the trainer consumes it,
runs store it, and any run can be replayed from its recorded plan. `draw_plan` generates one from
its own random stream seeded by (seed, p, duration, R, S) only, so every strategy and compression
arm at the same p and seed sees the same failures. Tests write plans by hand:

    FaultPlan().down(replica=2, stage=1, start=3, steps=6)

`plan_for(faults, ...)` draws the plan of a config's failure process (`faults.process`):

- `independent` (`draw_plan`, the blog's): each step, each replica that is up fails with
  probability p, at a uniformly drawn inner stage.
- `correlated`: each step, with probability min(1, p R / g), one outage (a zone, a rack) takes
  the same inner stage down in g = `faults.group` replicas drawn at random (those already down
  stay as they are) for one common down time. A replica's failure rate stays about p; only the
  grouping changes.
- `spot`: each step, with probability min(1, p / w), a reclaim wave takes round(w R) replicas
  (w = `faults.wave`, at least one), each at its own inner stage; the wave is announced
  `faults.notice` steps ahead (the failure's `notice`), so it starts that many steps after the
  draw.
- `trace`: the failures of a recorded CSV (`replica,stage,start,end`, end exclusive), read with
  a size limit and validated row by row (`read_trace`).

Down times are `faults.duration` steps, or with `faults.down_times = "pareto"` heavy-tailed:
ceil(x_m U^(-1/a)) steps with shape a = `faults.tail` and x_m = duration (a - 1) / a, so the
mean is about `duration` (the ceiling adds under one step) and a few outages last many times it.
Every drawn process draws the same random numbers each step whatever happened before, so its
plan for the first N steps does not depend on the horizon (drop_extend's longer runs see the
same prefix); p = 0 is no failures in every process (the shared baselines).
"""
from __future__ import annotations

import csv
import hashlib
import io
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from crucible.seeding import FAULT_STREAM, generator

if TYPE_CHECKING:
    from crucible.config import FaultConfig

__all__ = ["Failure", "FaultPlan", "FaultPlanError", "draw_plan", "plan_for", "read_trace",
           "trace_digest", "MAX_TRACE_BYTES", "PROCESS_TAGS"]

MAX_TRACE_BYTES = 16 * 1024 * 1024   # a trace file larger than this is refused before reading
TRACE_HEADER = ("replica", "stage", "start", "end")
# a stream tag per drawn process (independent keeps the blog's untagged stream, bit for bit)
PROCESS_TAGS = {"correlated": 1, "spot": 2}


class FaultPlanError(ValueError):
    """A fault plan that cannot happen (bad indices, outer stages, overlaps)."""


@dataclass(frozen=True)
class Failure:
    replica: int
    stage: int
    start: int       # first global step the stage is down
    duration: int    # global steps it stays down; it rejoins at start + duration
    notice: int = 0  # global steps of warning before `start` (spot reclaims); 0: none

    @property
    def end(self) -> int:
        return self.start + self.duration

    def covers(self, global_step: int) -> bool:
        return self.start <= global_step < self.end


@dataclass
class FaultPlan:
    failures: list[Failure] = field(default_factory=list)

    def down(self, *, replica: int, stage: int, start: int, steps: int) -> FaultPlan:
        """Add a failure (builder style, returns self)."""
        self.failures.append(Failure(replica=replica, stage=stage, start=start, duration=steps))
        self.failures.sort(key=lambda f: (f.start, f.replica))
        return self

    def validate(self, *, replicas: int, stages: int) -> FaultPlan:
        """Raise `FaultPlanError` naming the failure and the rule it breaks; returns self."""
        inner = range(1, stages - 1)
        for f in self.failures:
            if not 0 <= f.replica < replicas:
                raise FaultPlanError(f"{f}: replica {f.replica} out of range 0..{replicas - 1}")
            if not 0 <= f.stage < stages:
                raise FaultPlanError(f"{f}: stage {f.stage} out of range 0..{stages - 1}")
            if f.stage not in inner:
                raise FaultPlanError(f"{f}: only inner stages 1..{stages - 2} can fail; stage 0 "
                                     "holds the embedding and the last stage the head")
            if f.start < 0 or f.duration < 1:
                raise FaultPlanError(f"{f}: start must be >= 0 and duration >= 1")
        by_replica: dict[int, list[Failure]] = {}
        for f in self.failures:
            by_replica.setdefault(f.replica, []).append(f)
        for replica, items in by_replica.items():
            items.sort(key=lambda f: f.start)
            for a, b in zip(items, items[1:], strict=False):
                if b.start < a.end:
                    raise FaultPlanError(f"replica {replica}: failures {a} and {b} overlap; a "
                                         "replica has at most one failed stage at a time")
        return self

    def down_stage(self, *, replica: int, global_step: int) -> int | None:
        for f in self.failures:
            if f.replica == replica and f.covers(global_step):
                return f.stage
        return None

    def down_matrix(self, global_step: int, *, replicas: int, stages: int) -> torch.Tensor:
        """(R, S) bool: True where the stage of that replica is down at `global_step`."""
        down = torch.zeros(replicas, stages, dtype=torch.bool)
        for f in self.failures:
            if f.covers(global_step):
                down[f.replica, f.stage] = True
        return down

    def starting(self, global_step: int) -> list[Failure]:
        return [f for f in self.failures if f.start == global_step]

    def rejoining(self, global_step: int) -> list[Failure]:
        return [f for f in self.failures if f.end == global_step]

    def until(self, global_steps: int) -> FaultPlan:
        """The failures that start before `global_steps`."""
        return FaultPlan([f for f in self.failures if f.start < global_steps])

    def to_list(self) -> list[dict[str, int]]:
        """As records; `notice` only where a failure was announced (plans recorded before it
        existed read the same)."""
        return [{k: v for k, v in asdict(f).items() if k != "notice" or v} for f in self.failures]

    @classmethod
    def from_list(cls, items: list[dict[str, Any]]) -> FaultPlan:
        try:
            return cls([Failure(**{k: int(item[k]) for k in ("replica", "stage", "start", "duration")},
                                notice=int(item.get("notice", 0)))
                        for item in items])
        except (AttributeError, KeyError, TypeError, ValueError) as exc:
            raise FaultPlanError(f"fault plan entries need integer replica, stage, start, duration "
                                 f"(and optionally notice): {exc}") from None


def draw_plan(*, seed: int, p: float, duration: int, replicas: int, stages: int,
              horizon: int) -> FaultPlan:
    """Draw failures for global steps 0..horizon-1.

    Every step draws the same random numbers whatever happened before, so the plan for the first
    N steps does not depend on the horizon (a run extended by drop_extend sees the same prefix).
    """
    if not 0.0 <= p <= 1.0:
        raise FaultPlanError(f"faults.p must be in [0, 1], got {p}")
    plan = FaultPlan()
    if p == 0.0 or stages < 3:
        return plan
    gen = generator(seed, FAULT_STREAM, round(p * 1_000_000_000), duration, replicas, stages)
    busy_until = [0] * replicas
    for step in range(horizon):
        fails = torch.rand(replicas, generator=gen) < p
        where = torch.randint(1, stages - 1, (replicas,), generator=gen)
        for r in range(replicas):
            if step >= busy_until[r] and bool(fails[r]):
                plan.failures.append(Failure(replica=r, stage=int(where[r]), start=step,
                                             duration=duration))
                busy_until[r] = step + duration
    return plan


def plan_for(faults: FaultConfig, *, seed: int, replicas: int, stages: int,
             horizon: int) -> FaultPlan:
    """The plan of `faults.process` for global steps 0..horizon-1 (see the module docstring)."""
    if faults.p == 0.0 or stages < 3:
        return FaultPlan()
    if faults.process == "trace":
        assert faults.trace is not None   # FaultConfig requires it
        return read_trace(faults.trace, replicas=replicas, stages=stages).until(horizon)
    if faults.process == "independent" and faults.down_times == "fixed":
        return draw_plan(seed=seed, p=faults.p, duration=faults.duration, replicas=replicas,
                         stages=stages, horizon=horizon)
    gen = generator(seed, FAULT_STREAM, round(faults.p * 1_000_000_000), faults.duration,
                    replicas, stages, PROCESS_TAGS.get(faults.process, 0),
                    faults.group if faults.process == "correlated" else 0,
                    round(faults.wave * 1_000_000) if faults.process == "spot" else 0,
                    faults.notice if faults.process == "spot" else 0,
                    round(faults.tail * 1_000_000) if faults.down_times == "pareto" else 0)
    plan, busy_until = FaultPlan(), [0] * replicas

    def down(r: int, stage: int, start: int, steps: int, notice: int = 0) -> None:
        if start >= busy_until[r] and start < horizon:
            plan.failures.append(Failure(replica=r, stage=stage, start=start, duration=steps,
                                         notice=notice))
            busy_until[r] = start + steps

    for step in range(horizon):
        if faults.process == "independent":
            fails = torch.rand(replicas, generator=gen) < faults.p
            where = torch.randint(1, stages - 1, (replicas,), generator=gen)
            steps = _down_times(faults, replicas, gen)
            for r in range(replicas):
                if bool(fails[r]):
                    down(r, int(where[r]), step, steps[r])
        elif faults.process == "correlated":
            event = float(torch.rand(1, generator=gen)) < min(1.0, faults.p * replicas / faults.group)
            stage = int(torch.randint(1, stages - 1, (1,), generator=gen))
            who = torch.randperm(replicas, generator=gen)[:faults.group].tolist()
            steps = _down_times(faults, 1, gen)[0]
            if event:
                for r in sorted(who):
                    down(r, stage, step, steps)
        else:   # spot
            size = max(1, round(faults.wave * replicas))
            event = float(torch.rand(1, generator=gen)) < min(1.0, faults.p * replicas / size)
            where = torch.randint(1, stages - 1, (replicas,), generator=gen)
            who = torch.randperm(replicas, generator=gen)[:size].tolist()
            steps = _down_times(faults, replicas, gen)
            if event:
                for r in sorted(who):
                    down(r, int(where[r]), step + faults.notice, steps[r], faults.notice)
    plan.failures.sort(key=lambda f: (f.start, f.replica))
    return plan


def _down_times(faults: FaultConfig, n: int, gen: torch.Generator) -> list[int]:
    """n down times in global steps: `duration` each, or pareto (always n draws, whatever is
    used, so the stream does not depend on what failed)."""
    if faults.down_times == "fixed":
        return [faults.duration] * n
    shape = faults.tail
    scale = faults.duration * (shape - 1) / shape
    u = 1.0 - torch.rand(n, generator=gen, dtype=torch.float64)   # (0, 1]
    return [max(1, math.ceil(scale * float(x) ** (-1.0 / shape))) for x in u]


def _trace_bytes(path: str) -> bytes:
    file = Path(path)
    try:
        size = file.stat().st_size
    except OSError as exc:
        raise FaultPlanError(f"faults.trace={path!r} cannot be read ({exc.strerror}); give the "
                             f"path of a CSV with the header {','.join(TRACE_HEADER)}") from None
    if size > MAX_TRACE_BYTES:
        raise FaultPlanError(f"faults.trace={path!r} is {size} bytes, more than the "
                             f"{MAX_TRACE_BYTES} a trace may have; cut it to the run's steps")
    return file.read_bytes()[:MAX_TRACE_BYTES + 1]


def trace_digest(path: str) -> str:
    """sha256 of the trace file's bytes (part of a trace run's identity)."""
    return hashlib.sha256(_trace_bytes(path)).hexdigest()


def read_trace(path: str, *, replicas: int, stages: int) -> FaultPlan:
    """The failures of a trace CSV (header `replica,stage,start,end`, end exclusive, one row a
    failure), validated for this run's shape; raises FaultPlanError naming the row."""
    try:
        text = _trace_bytes(path).decode("utf-8")
    except UnicodeDecodeError:
        raise FaultPlanError(f"faults.trace={path!r} is not UTF-8 text; write it as a CSV with "
                             f"the header {','.join(TRACE_HEADER)}") from None
    rows = csv.reader(io.StringIO(text))
    header = tuple(h.strip() for h in next(rows, []))
    if header != TRACE_HEADER:
        raise FaultPlanError(f"faults.trace={path!r}: the first line must be "
                             f"{','.join(TRACE_HEADER)}, got {','.join(header) or 'nothing'}")
    plan = FaultPlan()
    for line, row in enumerate(rows, start=2):
        if not row or all(not cell.strip() for cell in row):
            continue
        try:
            if len(row) != len(TRACE_HEADER):
                raise ValueError(f"{len(row)} fields")
            replica, stage, start, end = (int(cell) for cell in row)
        except ValueError as exc:
            raise FaultPlanError(f"faults.trace={path!r} line {line}: {row!r} is not four "
                                 f"integers replica,stage,start,end ({exc})") from None
        if end <= start:
            raise FaultPlanError(f"faults.trace={path!r} line {line}: end {end} must be after "
                                 f"start {start} (end is the first step the stage is back)")
        plan.down(replica=replica, stage=stage, start=start, steps=end - start)
    try:
        return plan.validate(replicas=replicas, stages=stages)
    except FaultPlanError as exc:
        raise FaultPlanError(f"faults.trace={path!r}: {exc}") from None

"""Fault plans: which inner stage of which replica is down in which global steps, as data.

A `FaultPlan` is a list of `Failure(replica, stage, start, duration)`; the trainer consumes it,
runs store it, and any run can be replayed from its recorded plan. `draw_plan` generates one from
its own random stream seeded by (seed, p, duration, R, S) only, so every strategy and compression
arm at the same p and seed sees the same failures. Tests write plans by hand:

    FaultPlan().down(replica=2, stage=1, start=3, steps=6)
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from crucible.seeding import FAULT_STREAM, generator

__all__ = ["Failure", "FaultPlan", "FaultPlanError", "draw_plan"]


class FaultPlanError(ValueError):
    """A fault plan that cannot happen (bad indices, outer stages, overlaps)."""


@dataclass(frozen=True)
class Failure:
    replica: int
    stage: int
    start: int       # first global step the stage is down
    duration: int    # global steps it stays down; it rejoins at start + duration

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
        return [asdict(f) for f in self.failures]

    @classmethod
    def from_list(cls, items: list[dict[str, Any]]) -> FaultPlan:
        try:
            return cls([Failure(**{k: int(item[k]) for k in ("replica", "stage", "start", "duration")})
                        for item in items])
        except (KeyError, TypeError, ValueError) as exc:
            raise FaultPlanError(f"fault plan entries need integer replica, stage, start, duration: "
                                 f"{exc}") from None


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

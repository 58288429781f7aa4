"""What a replica does while one of its stages is down, as per-step masks for the trainer.

`plan_step` turns the fault plan at one global step into a `StepPlan`:

- `skip`: the failed stage is bypassed forward and backward; the replica's other stages train and
  contribute; the failed stage computes nothing and contributes nothing (a passive participant).
- `drop` / `drop_extend`: the replica processes no tokens: no stage of it trains or contributes.
- `reroute`: the replica's micro-batches pass through the same stage of a healthy donor replica
  (least extra load, ties by lower index); the donor's stage accumulates both gradients. With no
  healthy donor left for that stage, the replica falls back to skipping it.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from crucible.config import Config
from crucible.events import Event
from crucible.faults import FaultPlan

__all__ = ["StepPlan", "plan_step", "fault_events"]


@dataclass
class StepPlan:
    down: torch.Tensor          # (R, S) bool: stage down at this step
    bypass: torch.Tensor        # (R, S) bool: stage skipped in the forward/backward pass
    active: torch.Tensor        # (R, S) bool: stage-replica trains (and so contributes)
    loss_weight: torch.Tensor   # (R,) float: 1 if the replica processes its tokens, else 0
    route: dict[int, torch.Tensor] = field(default_factory=dict)   # stage -> (R,) weight index
    donors: dict[tuple[int, int], int] = field(default_factory=dict)  # (replica, stage) -> donor
    extra_load: torch.Tensor | None = None   # (R, S) long: foreign micro-batches per inner step

    @property
    def contributes(self) -> torch.Tensor:
        return self.active

    def down_pairs(self) -> list[tuple[int, int]]:
        return [(int(r), int(s)) for r, s in torch.nonzero(self.down).tolist()]

    def rerouted_crossings(self) -> torch.Tensor:
        """(R,) boundary crossings per token that go to or come from a donor's stage: two per
        rerouted stage (into the donor and back out). They are among `crossings()`: a reroute
        changes where a crossing goes, not how many there are."""
        count = torch.zeros(self.down.shape[0], dtype=torch.long)
        for replica, _stage in self.donors:
            count[replica] += 2
        return count

    def crossings(self) -> torch.Tensor:
        """(R,) boundary crossings per token: S-1, one fewer per bypassed stage, 0 if dropped."""
        S = self.down.shape[1]
        per_replica = (S - 1) - self.bypass.sum(dim=1)
        return per_replica * (self.loss_weight > 0)


def plan_step(plan: FaultPlan, global_step: int, *, config: Config) -> StepPlan:
    R, S = config.replicas, config.pipeline.stages
    down = plan.down_matrix(global_step, replicas=R, stages=S)
    strategy = config.faults.strategy
    none = torch.zeros(R, S, dtype=torch.bool)
    if strategy in ("drop", "drop_extend"):
        dropped = down.any(dim=1)
        active = ~dropped[:, None].expand(R, S)
        return StepPlan(down=down, bypass=none, active=active.clone(),
                        loss_weight=(~dropped).float())
    if strategy == "skip":
        return StepPlan(down=down, bypass=down.clone(), active=~down, loss_weight=torch.ones(R))
    return _reroute(down, R=R, S=S)


def _reroute(down: torch.Tensor, *, R: int, S: int) -> StepPlan:
    bypass = torch.zeros(R, S, dtype=torch.bool)
    extra = torch.zeros(R, S, dtype=torch.long)
    route: dict[int, torch.Tensor] = {}
    donors: dict[tuple[int, int], int] = {}
    for s in range(S):
        failed = [r for r in range(R) if bool(down[r, s])]
        if not failed:
            continue
        healthy = [r for r in range(R) if not bool(down[r, s])]
        index = torch.arange(R)
        for r in failed:
            if not healthy:
                bypass[r, s] = True
                continue
            donor = min(healthy, key=lambda d: (int(extra[d, s]), d))
            extra[donor, s] += 1
            index[r] = donor
            donors[(r, s)] = donor
        if any(index[r] != r for r in failed):
            route[s] = index
    return StepPlan(down=down, bypass=bypass, active=~down, loss_weight=torch.ones(R),
                    route=route, donors=donors, extra_load=extra)


def fault_events(plan: FaultPlan, global_step: int, step: StepPlan, *, strategy: str,
                 replicas: list[int]) -> list[Event]:
    """The fault events of one global step for the replicas in `replicas` (the step plan's rows,
    in order): a `failure_start` for each failure that begins, and for each down stage-replica
    one event saying what was done about it (`reroute` with its donor, `bypass` or `drop`).
    The simulator's trainer and the pipeline mode's merge report the same events."""
    out = []
    for failure in plan.starting(global_step):
        if failure.replica in replicas:
            out.append(Event("failure_start", global_step, replica=failure.replica,
                             stage=failure.stage,
                             detail={"duration": failure.duration, "strategy": strategy}))
    for row, stage in step.down_pairs():
        donor = step.donors.get((row, stage))
        if donor is not None:
            kind, detail = "reroute", {"strategy": strategy, "donor": donor}
        elif bool(step.bypass[row, stage]):
            kind, detail = "bypass", {"strategy": strategy}
        else:
            kind, detail = "drop", {"strategy": strategy}
        out.append(Event(kind, global_step, replica=replicas[row], stage=stage, detail=detail))
    return out

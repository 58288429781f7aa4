"""The unplanned deaths a stage process has heard of, and the round's step plan as it sees them.

The launcher (or a pod's supervisor) reports each unplanned death of a stage-replica over the
link (a `ctl` message, `_control`) and in `notices.jsonl` (read by a life that starts later,
`_read_notices`): the round it died in and whether it comes back. From the fault plan and those
deaths `_effective` derives the round's step plan (`crucible.strategy.StepPlan`) as this process
knows it now: under skip a dead inner stage is bypassed; otherwise its replica drops its tokens
for the rest of the round, as does every replica whose micro-batches pass through a dropped one
as a donor. The rest answers who does what in that plan: whose micro-batches this process runs
(`_owners`), through which processes (`_chain`, `_neighbours`), which deaths concern it
(`_chain_dead`), and who contributes to the outer round (`_contributes`, `DeathWatch`).

`DeathBook` is a part of `stage.StageWorker` (the mixin the others build on): it keeps no state
of its own, it reads and writes the worker's (named below, set in the worker's `__init__`).
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from crucible.config import Config
from crucible.distributed.pipeline.links import Inbox, Outbox
from crucible.faults import FaultPlan
from crucible.strategy import StepPlan, plan_step

__all__ = ["DeathBook", "DeathWatch"]

log = logging.getLogger(__name__)


class DeathWatch:
    """What the outer round's wait asks of its peers (`ReplicaSync.watch`): a stage-replica the
    launcher reported dead in a round is not waited for in it (nor after, when it is gone)."""

    def __init__(self, worker: DeathBook) -> None:
        self.worker = worker

    def refresh(self) -> None:
        self.worker.inbox.drain()

    def waits_for(self, replica: int, global_step: int) -> bool:
        return ((replica, self.worker.s) not in self.worker._dead_now(global_step)
                and not self.worker._dropped_by_death(replica, global_step))

    def round_over(self, global_step: int) -> None:
        """Nothing to forget: a death is tied to its round."""


class DeathBook:
    """Stage `s` of replica `r`'s view of the deaths and of the round's plan. A death of its
    replica's first stage is handed to the verdict protocol built on it
    (`verdicts.Verdicts._report_verdicts`)."""

    r: int
    s: int
    R: int
    S: int
    config: Config
    plan: FaultPlan
    addresses: dict[str, str]       # "replica,stage" -> where its inbox is reached
    inbox: Inbox
    outbox: Outbox
    notices: Path                   # the run's notices.jsonl
    # unplanned deaths the launcher reported: (replica, stage) -> (round died in, gone)
    deaths: dict[tuple[int, int], tuple[int, bool]]
    round: int                      # the round this process is in
    resend_to: set[str]             # peers that died and came back: what was sent goes again
    position: tuple[int, int, int] | None   # the inner step's attempt (g, h, v) it is in
    round_dropped: bool             # an unplanned death dropped an inner step of the round
    _dropped_memo: tuple[tuple[int, frozenset[tuple[int, int]]], set[int]] | None

    # -- deaths the launcher reports ---------------------------------------------------------
    def _control(self, control: dict[str, Any]) -> None:
        """A control message: an unplanned death of a stage-replica (`dead`), with the round
        it died in and whether it will come back (`gone`: no life left)."""
        if control.get("event") != "dead":
            return
        try:
            q, t, d = int(control["replica"]), int(control["stage"]), int(control["round"])
            gone = bool(control.get("gone", False))
        except (KeyError, TypeError, ValueError):
            log.warning("refused a control message: %r", control)
            return
        if not (0 <= q < self.R and 0 <= t < self.S) or (q, t) == (self.r, self.s):
            return
        self.deaths[(q, t)] = (d, gone)
        if (q, t) == (self.r, 0) and self.s != 0 and self.position is not None:
            self._report_verdicts()
        if d < self.round and not gone:
            # it died after its last round and is back in this one: what this process sent
            # it in this step died with it, so it goes again to its next life
            self.resend_to.add(self.addresses[f"{q},{t}"])
        log.info("r%d s%d: stage %d of replica %d died in global step %d%s", self.r, self.s, t,
                 q, d, " for good" if gone else "")

    def _resend(self) -> None:
        for address in sorted(self.resend_to):
            if address in self.outbox.sockets:
                count = self.outbox.resend(address)
                if count:
                    log.info("r%d s%d: sent %d messages again to %s", self.r, self.s, count,
                             address)
        self.resend_to.clear()

    def _read_notices(self) -> None:
        """The launcher's notices of unplanned deaths so far (`notices.jsonl`; `_control`)."""
        if self.notices.exists():
            from crucible.runfiles import read_jsonl
            for notice in read_jsonl(self.notices):
                self._control(notice)

    def _dead_now(self, g: int) -> set[tuple[int, int]]:
        """The stage-replicas that are down in round g by an unplanned death: in the round
        they died in, and in every later one when they will not come back."""
        return {key for key, (d, gone) in self.deaths.items() if g == d or (gone and g > d)}

    def _contributes(self, g: int, base: StepPlan) -> torch.Tensor:
        """Who contributes to round g's outer round: the plan's, less its own replica when an
        unplanned death dropped one of its inner steps of the round (as the simulator's drop: a
        dropped replica contributes nothing, its partial round is discarded). Every live stage
        of the replica took the same outcome of every inner step (`_clip`), so they all
        contribute or none does, whenever the notice of the death reached each; a peer that
        has heard of the death does not wait for the replica's contribution."""
        contributes = base.contributes.clone()
        if self.round_dropped:
            contributes[self.r] = False
        return contributes

    def _dropped_by_death(self, replica: int, g: int) -> bool:
        """Whether an unplanned death known now (not the plan) dropped `replica`'s tokens in
        round g. The outer round's wait asks it of every peer at every poll, so the answer
        is kept until the round or the deaths known in it change."""
        key = (g, frozenset(self._dead_now(g)))
        if self._dropped_memo is None or self._dropped_memo[0] != key:
            seen, planned = self._effective(g), plan_step(self.plan, g, config=self.config)
            self._dropped_memo = (key, {p for p in range(self.R) if bool(
                seen.loss_weight[p] == 0) and not bool(planned.loss_weight[p] == 0)})
        return replica in self._dropped_memo[1]

    def _chain_dead(self, g: int, step: StepPlan) -> set[tuple[int, int]]:
        """The unplanned deaths of round g in the chains this process runs micro-batches for:
        a stage of its replica, or a donor stage one of those micro-batches passes through.
        A death elsewhere changes nothing here. Under reroute a death anywhere in a donor
        replica counts: it drops that replica, whose stages then serve nobody."""
        needed = set(self._owners(step)) | {self.r}
        while True:                       # the replicas whose stages these chains pass through
            more = {int(idx[o]) for idx in step.route.values() for o in needed} - needed
            if not more:
                break
            needed |= more
        return {(q, t) for q, t in self._dead_now(g) if q in needed}

    def _effective(self, g: int) -> StepPlan:
        """The round's step plan with the unplanned deaths known now: under skip an inner
        stage is bypassed (the replica's other stages go on); otherwise (drop, reroute, or a
        first or last stage) the replica drops its tokens for the rest of the round, as does
        every replica whose micro-batches pass through a stage of a dropped replica as a
        donor."""
        step = plan_step(self.plan, g, config=self.config)
        dead = self._dead_now(g)
        if not dead:
            return step
        step = StepPlan(down=step.down.clone(), bypass=step.bypass.clone(),
                        active=step.active.clone(), loss_weight=step.loss_weight.clone(),
                        route={t: idx.clone() for t, idx in step.route.items()},
                        donors=dict(step.donors), extra_load=step.extra_load)
        strategy = self.config.faults.strategy
        for q, t in sorted(dead):
            step.down[q, t] = True
            step.active[q, t] = False
            if strategy == "skip" and 0 < t < self.S - 1:
                step.bypass[q, t] = True
                continue
            dropped = {q}
            route = step.route.get(t)
            if route is not None:
                dropped |= {p for p in range(self.R) if int(route[p]) == q}
            # a dropped replica's stages serve nobody for the rest of the round, so a replica
            # whose micro-batches pass through any of them as a donor drops too (or it would
            # wait for its donor until the link timeout); to a fixed point, donors of donors
            while True:
                more = {p for idx in step.route.values() for p in range(self.R)
                        if int(idx[p]) in dropped and p not in dropped}
                if not more:
                    break
                dropped |= more
            for p in dropped:
                step.loss_weight[p] = 0.0
                step.active[p] = False
        return step

    # -- who does what this round -----------------------------------------------------------
    @staticmethod
    def _server(step: StepPlan, replica: int, stage: int) -> int:
        """The replica whose stage `stage` runs `replica`'s micro-batches (reroute: a donor)."""
        route = step.route.get(stage)
        return replica if route is None else int(route[replica])

    def _chain(self, step: StepPlan, owner: int) -> list[tuple[int, int]]:
        """The processes `owner`'s micro-batches pass through this round, in order: every
        stage not bypassed, each at its server."""
        return [(self._server(step, owner, t), t) for t in range(self.S)
                if not bool(step.bypass[owner, t])]

    def _neighbours(self, step: StepPlan, owner: int) -> tuple[tuple[int, int] | None,
                                                               tuple[int, int] | None]:
        chain = self._chain(step, owner)
        at = chain.index((self.r, self.s))
        return (chain[at - 1] if at > 0 else None,
                chain[at + 1] if at + 1 < len(chain) else None)

    def _owners(self, step: StepPlan) -> list[int]:
        """Whose micro-batches this process runs this round: its own replica's (when that
        processes tokens), then every replica it is the donor for, ascending."""
        owners = [] if bool(step.loss_weight[self.r] == 0) else [self.r]
        route = step.route.get(self.s)
        if route is not None:
            owners += [q for q in range(self.R) if q != self.r and int(route[q]) == self.r
                       and bool(step.loss_weight[q] > 0)]
        # ascending: a donor's gradient sums its batches in replica order, as the simulator's
        # gather does
        return sorted(owners)

    def _address(self, replica: int, stage: int) -> str:
        return self.addresses[f"{replica},{stage}"]

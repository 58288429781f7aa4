"""The verdict of an inner step: its replica's first stage decides, for every live stage of the
replica, whether the step completed (and by what factor its gradients are clipped) or runs again.

Each other live stage sends the first stage its per-tensor gradient norms (`norms`); the first
stage answers each with the clipping factor at the simulator's width (a down stage's tensors as
zeros, the simulator's tensor order: clipping by the replica's whole-model norm), or with a
retry (a factor of -1) naming the stages down when one died before it had done its part
(`clip`). A message carries its attempt, so a retried step's messages never mix with the last
attempt's.

That verdict is the attempt's one outcome at every live stage, whatever deaths the launcher
reports meanwhile: a stage that sent its norms takes the verdict even when a death has dropped
its replica (`_decide`, `_abandon`), a stage that met a death mid-step tells the first it cannot
finish (norms of -1), and when the first stage itself dies the survivors tell each other what
they hold of its verdicts and take the one any of them got (`_report_verdicts`,
`_survivors_verdict`).

`Verdicts` is a part of `stage.StageWorker` (a mixin over `deaths.DeathBook`): it keeps no state
of its own, it reads and writes the worker's (named below, set in the worker's `__init__`).
"""
from __future__ import annotations

import logging
import time

import torch

from crucible.distributed.pipeline.deaths import DeathBook
from crucible.distributed.pipeline.links import Expect, Interrupted, LinkTimeout, Received
from crucible.distributed.worker import clip_coefficient
from crucible.optim import ReplicaAdamW
from crucible.strategy import StepPlan

__all__ = ["Verdicts", "GRACE_S"]

# the `coef` of a sibling's report that it holds no verdict of the attempt (`_report_verdicts`)
_NO_VERDICT = -2.0
# after a death notice, how long the first stage waits for a message the dead stage may have sent
# just before it died (it travels on another connection than the launcher's notice)
GRACE_S = 0.3

log = logging.getLogger(__name__)


class Verdicts(DeathBook):
    """Stage `s` of replica `r`'s part in its replica's verdicts: the first stage's decision
    (`_decide`), every other stage's wait for it (`_await_verdict`)."""

    timeout_s: float                # how long a link wait lasts
    optimizer: ReplicaAdamW
    adamw_counts: list[int]         # per stage: its tensors that AdamW steps (the norms sent)
    attempt: int                    # this inner step's attempt (messages carry it)
    # the last verdict this stage took, and what it told its siblings when the first stage died
    last_verdict: tuple[tuple[int, int, int], Received] | None
    reported: dict[tuple[int, int, int], Received | None]

    @torch.no_grad()
    def _clip(self, g: int, h: int, step: StepPlan) -> bool:
        """Global-norm clipping over the replica's whole model, decided by its first stage:
        every other live stage sends its per-tensor norms to it, and it answers each with the
        clipping factor (computed at the simulator's width, a down stage's tensors as zeros,
        in the simulator's tensor order). A factor below 0 says the step runs again (a stage
        of the chain died before it had done its part). Returns whether the step completed
        (its gradients then clipped).

        The verdict is the attempt's one outcome at every live stage of the replica: a stage
        that sent its norms takes the verdict even when a death has dropped the replica
        meanwhile (the first stage answers every stage it asked, `_decide` and `_abandon`),
        and when the first stage itself died the survivors take the verdict any of them got
        (`_survivors_verdict`)."""
        params = self.optimizer.parameters()
        grads = [p.grad for p in params if p.grad is not None]
        mine = torch.stack([torch.linalg.vector_norm(g_.flatten(1), dim=1)[0] for g_ in grads])
        v = self.attempt
        if self.s != 0:
            if self.r not in self._owners(step):
                return False   # a donor of a dropped replica: its first stage decides nothing
            self.outbox.send(self._address(self.r, 0), "norms", g=g, h=h, m=0, owner=self.r,
                             v=v, tensors={"norms": mine})
            coef = self._await_verdict(g, h)
        else:
            coef = self._decide(g, h, step, mine)
        if coef is None:
            return False
        if bool((coef < 1.0).any()):
            for g_ in grads:
                g_.mul_(coef.view(-1, *([1] * (g_.dim() - 1))))
        return True

    def _await_verdict(self, g: int, h: int) -> torch.Tensor | None:
        """The first stage's answer for this attempt: the factor, or None (run it again, with
        the deaths it names). It comes unless the first stage dies; then the answer is the
        one some survivor of the replica took, or None if none did (`_survivors_verdict`)."""
        try:
            got: Received | None = self.inbox.receive(
                "clip", (self.r, 0), g=g, h=h, m=0, owner=self.r, v=self.attempt,
                expect=self._verdict_expect(), timeout_s=self.timeout_s,
                valid=lambda: (self.r, 0) not in self._dead_now(g))
        except Interrupted:
            got = self._survivors_verdict(g, h)
        if got is None:
            return None
        self.last_verdict = ((g, h, self.attempt), got)
        for t in torch.nonzero(got.tensors["dead"]).flatten().tolist():
            self.deaths.setdefault((self.r, int(t)), (g, False))
        coef = got.tensors["coef"]
        return None if float(coef[0]) < 0 else coef

    def _report_verdicts(self) -> None:
        """The first stage of this replica died (the launcher's notice): tell every live
        sibling what this stage holds of its verdicts, once per attempt. The verdict of the
        attempt it is in, if it took it or it has arrived, else `_NO_VERDICT`, after which a
        copy still arriving from the dead stage is not used (the siblings may have decided
        without it); and the last verdict it took, if for an earlier attempt (a sibling may
        still be waiting for it)."""
        assert self.position is not None
        at = self.position
        if at in self.reported:
            return
        g, h, v = at
        held = self.last_verdict[1] if self.last_verdict and self.last_verdict[0] == at else None
        if held is None:
            arrived = self.inbox.waiting.get(("clip", (self.r, 0), g, h, 0, self.r, v))
            held = arrived[1] if arrived is not None and arrived[0] is None else None
        self.reported[at] = held
        reports = {at: held.tensors if held is not None else {
            "coef": torch.full((1,), _NO_VERDICT), "dead": torch.zeros(self.S, dtype=torch.uint8)}}
        if self.last_verdict is not None and self.last_verdict[0] != at:
            reports[self.last_verdict[0]] = self.last_verdict[1].tensors
        for t in range(1, self.S):
            if t == self.s or (self.r, t) in self._dead_now(g):
                continue
            for (g_, h_, v_), tensors in reports.items():
                self.outbox.send(self._address(self.r, t), "clip", g=g_, h=h_, m=0,
                                 owner=self.r, v=v_, tensors=tensors)

    def _survivors_verdict(self, g: int, h: int) -> Received | None:
        """The verdict of this attempt when the first stage died before this stage took it:
        the one this stage had when it heard (`_report_verdicts`), else the one any live
        sibling reports, else None (no survivor has one: the first stage cannot have answered
        any). Each live sibling reports this attempt, or an earlier one it is still in (then
        it never sent this attempt's norms, so no verdict of it exists)."""
        v = self.attempt
        at = (g, h, v)
        if at not in self.reported:
            self._report_verdicts()
        if self.reported[at] is not None:
            return self.reported[at]
        pending = set(range(1, self.S)) - {self.s}
        deadline = time.monotonic() + self.timeout_s
        while True:
            pending = {t for t in pending if (self.r, t) not in self._dead_now(g)}
            for key, entry in list(self.inbox.waiting.items()):
                kind, (q, t), g_, h_, _, owner, v_ = key
                if (kind != "clip" or q != self.r or t not in pending or owner != self.r
                        or entry[0] is not None or (g_, h_, v_) > at):
                    continue
                if (g_, h_, v_) == at and float(entry[1].tensors["coef"][0]) != _NO_VERDICT:
                    log.info("r%d s%d: the verdict of inner step %d.%d attempt %d from stage %d "
                             "(the first stage died)", self.r, self.s, g, h, v, t)
                    return entry[1]
                pending.discard(t)
            if not pending:
                return None
            if time.monotonic() >= deadline:
                raise LinkTimeout(f"stages {sorted(pending)} of replica {self.r} did not report "
                                  f"their verdicts of step {g}.{h} attempt {v} within "
                                  f"{self.timeout_s:.1f} s of its first stage's death")
            self.inbox.drain(timeout_s=0.05)

    def _decide(self, g: int, h: int, step: StepPlan, mine: torch.Tensor) -> torch.Tensor | None:
        """The first stage's verdict for this attempt, sent to every live stage of the
        replica: the clipping factor when every live stage sent its norms (a stage that died
        after sending them had done its part), else a retry."""
        v = self.attempt
        live = [t for t in range(1, self.S) if not bool(step.down[self.r, t])]
        parts: dict[int, torch.Tensor] = {0: mine}
        complete = True
        for t in live:
            expect = {"norms": Expect(torch.float32, (self.adamw_counts[t],))}
            try:
                got = self.inbox.receive("norms", (self.r, t), g=g, h=h, m=0, owner=self.r,
                                         v=v, expect=expect, timeout_s=self.timeout_s,
                                         valid=lambda t=t: (self.r, t) not in self._dead_now(g))
            except Interrupted:   # it died: did its norms make it out first?
                time.sleep(GRACE_S)
                got = self.inbox.take("norms", (self.r, t), g=g, h=h, m=0, owner=self.r, v=v,
                                      expect=expect)
                if got is None:
                    complete = False
                    continue
            if bool((got.tensors["norms"] < 0).any()):   # it could not finish the step
                complete = False
                continue
            parts[t] = got.tensors["norms"]
        coef = None
        if complete:
            column = [parts.get(t, torch.zeros(self.adamw_counts[t])) for t in range(self.S)]
            coef = clip_coefficient(torch.cat(column), self.config.train.grad_clip,
                                    replica=self.r, replicas=self.R)
        self._send_verdict(g, h, live, coef)
        return coef

    def _send_verdict(self, g: int, h: int, live: list[int], coef: torch.Tensor | None) -> None:
        dead = torch.zeros(self.S, dtype=torch.uint8)
        for q, t in self._dead_now(g):
            if q == self.r:
                dead[t] = 1
        verdict = {"coef": coef if coef is not None else torch.full((1,), -1.0),
                   "dead": dead}
        if coef is None:
            log.info("r%d: inner step %d.%d attempt %d runs again (stages %s down)", self.r, g,
                     h, self.attempt, torch.nonzero(dead).flatten().tolist())
        for t in live:
            if (self.r, t) not in self._dead_now(g):
                self.outbox.send(self._address(self.r, t), "clip", g=g, h=h, m=0, owner=self.r,
                                 v=self.attempt, tensors=verdict)

    def _abandon(self, g: int, h: int, step: StepPlan) -> bool:
        """This attempt met a death in its chain before the stage finished its part: the
        first stage answers every live stage with a retry (a stage that sent its norms waits
        for it, even when the replica drops); any other stage tells the first it cannot
        finish (norms of -1) and, unless the replica drops, takes its verdict (the deaths it
        names). Returns False (not done), or True if the first stage says the step completed
        (it cannot: without this stage's norms there is no complete verdict)."""
        dropped = bool(self._effective(g).loss_weight[self.r] == 0)
        if self.s == 0:
            if not dropped:
                # a peer's abort may come before the launcher's notice of the death behind
                # it: let the notice land, so that the retry names the dead stage
                time.sleep(GRACE_S)
                self.inbox.drain()
            live = [t for t in range(1, self.S) if not bool(step.down[self.r, t])]
            self._send_verdict(g, h, live, None)
            return False
        log.info("r%d s%d: inner step %d.%d attempt %d met a death; telling the first stage",
                 self.r, self.s, g, h, self.attempt)
        marker = -torch.ones(self.adamw_counts[self.s])
        self.outbox.send(self._address(self.r, 0), "norms", g=g, h=h, m=0, owner=self.r,
                         v=self.attempt, tensors={"norms": marker})
        if dropped:
            return False
        return self._await_verdict(g, h) is not None

    def _abort_waiting(self, g: int, h: int) -> bool:
        """Whether this attempt is over already, so waiting for anything else in it is
        pointless: on the first stage, a stage of its replica said it cannot finish it (norms
        of -1); on any other, the first stage's retry verdict for it has arrived."""
        for key, entry in self.inbox.waiting.items():
            if (key[1][0] != self.r or key[2:4] != (g, h) or key[6] != self.attempt
                    or entry[0] is not None):
                continue
            if self.s == 0 and key[0] == "norms" and bool(
                    (entry[1].tensors["norms"] < 0).any()):
                return True
            if self.s != 0 and key[0] == "clip" and float(entry[1].tensors["coef"][0]) < 0:
                return True
        return False

    def _verdict_expect(self) -> dict[str, Expect]:
        return {"coef": Expect(torch.float32, (1,)), "dead": Expect(torch.uint8, (self.S,))}

"""One stage-replica of a pipeline run: stage s of replica r in its own OS process.

    python -m crucible.distributed.pipeline.stage --run-dir DIR --replica R --stage S

The process holds only its stage: that stage's weights (one replica row, the simulator's
`ReplicatedPipeline` row), its AdamW moments, its error-feedback buffers and, for MAPL, its
boundary basis and Stiefel momentum. Each inner step it runs the replica's micro-batches through
its stage, fill-drain: every micro-batch forward (stage 0 reads the replica's data stream; the
others receive the previous stage's boundary message over a link, `links`), then every
micro-batch backward (the last stage computes the loss; the others receive the gradient of what
they sent). What crosses a boundary is what the simulator's forward passes between stages: the
arm's encoded message (SSN and MAPL: k of d values per token) in the dtype it is computed in,
with the token ids for a compressed arm (its receiver needs them) and, for MAPL, the sender's
basis (the receiver decodes with it, and returns its gradient with the message's). A replica's
stages exchange their per-tensor gradient norms, so clipping is by the replica's whole-model norm
as in the simulator. Then the stage's AdamW (and Stiefel) step; after H inner steps the outer
round of its stage (`ReplicaSync` holding one stage), through the object store.

Planned failures (the run's fault plan, `skip` or `drop`): a stage-replica whose failure starts
at global step g records a `kill` in its journal and SIGKILLs itself at the start of g; the
launcher starts it again, and the new life waits until the round before its rejoin step is
agreed, restores its stage's global weights (`ReplicaSync.catch_up`), and trains from the rejoin
step with fresh AdamW moments, error feedback and Stiefel momentum: what the simulator's rejoin
resets. Meanwhile its replica applies the strategy from the same plan: `skip` sends the previous
stage's message to the next live stage (MAPL decodes it with the sender's basis, the `sender`
bypass decode), `drop` idles the whole replica for the round. Only inner stages fail.

With one micro-batch per inner step (`--micro-batches 1`, the default) the arithmetic is the
simulator's, operation for operation, on one replica row: the run ends on the simulator's bits
where the two run on one arithmetic. More micro-batches sum per-micro-batch gradients (fp32
round-off from the whole-batch gradient).
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import zmq
from torch import nn

from crucible import boundary
from crucible.config import Config, ConfigError
from crucible.data import TokenData, load_tokens
from crucible.distributed.journal import Journal, died_in
from crucible.distributed.pipeline.links import (
    Expect,
    Inbox,
    Interrupted,
    LinkCounters,
    LinkTimeout,
    Outbox,
    Received,
    Shaping,
    ids_dtype,
)
from crucible.distributed.sync import ReplicaSync
from crucible.distributed.worker import clip_coefficient
from crucible.errors import TrainingDiverged
from crucible.faults import FaultPlan
from crucible.model import (
    block_forward,
    embed_forward,
    head_losses,
    layers_of,
    reparametrised,
    rope_tables,
    stage_layout,
)
from crucible.model_file import save_global_weights
from crucible.optim import ReplicaAdamW, lr_at
from crucible.pipeline import initial_tensor
from crucible.runfiles import append_jsonl, write_json_atomic
from crucible.store import open_store
from crucible.strategy import StepPlan, plan_step

__all__ = ["StageModel", "StageWorker", "check_pipeline", "stage_dir", "main", "GRACE_S"]

# the `coef` of a sibling's report that it holds no verdict of the attempt (`_report_verdicts`)
_NO_VERDICT = -2.0
# after a death notice, how long the first stage waits for a message the dead stage may have sent
# just before it died (it travels on another connection than the launcher's notice)
GRACE_S = 0.3

log = logging.getLogger(__name__)


def stage_dir(run_dir: Path, replica: int, stage: int) -> Path:
    return run_dir / "stages" / f"r{replica}-s{stage}"


def check_pipeline(config: Config, *, micro_batches: int = 1) -> None:
    """Refuse what the pipeline mode cannot run, naming the key and the fix."""
    pipe = config.pipeline
    if micro_batches < 1 or config.train.batch_size % micro_batches:
        raise ConfigError(f"--micro-batches={micro_batches} must be >= 1 and divide "
                          f"train.batch_size={config.train.batch_size}; pick a divisor")
    if pipe.stages < 2:
        raise ConfigError(f"pipeline.stages={pipe.stages}: the pipeline mode needs at least 2 "
                          "stages (a process per stage); use pipeline.stages >= 2")
    if config.faults.p > 0 and config.faults.strategy == "skip" and pipe.stages < 3:
        raise ConfigError("faults.strategy=skip needs an inner stage to skip: "
                          f"pipeline.stages={pipe.stages}; use pipeline.stages >= 3")
    if config.faults.p > 0 and config.faults.strategy == "drop_extend":
        raise ConfigError("faults.strategy=drop_extend extends the run by a token count summed "
                          "over every replica, which no stage process knows; use skip, drop or "
                          "reroute (or the simulator, `crucible run`)")
    if (config.faults.p > 0 and config.faults.strategy in ("skip", "reroute")
            and pipe.compression == "mapl" and pipe.bypass_decode != "sender"):
        raise ConfigError(f"pipeline.bypass_decode={pipe.bypass_decode} needs the skipped "
                          "stage's basis, which lives in the dead process; the pipeline mode "
                          "decodes a bypassed MAPL message with its sender's basis: use "
                          "pipeline.bypass_decode=sender")
    if config.sparseloco.method != "sparseloco":
        raise ConfigError(f"sparseloco.method={config.sparseloco.method} is not supported in the "
                          "pipeline mode; use sparseloco.method=sparseloco or the simulator")
    if config.train.device == "cuda":
        raise ConfigError("train.device=cuda: the pipeline mode runs its stages on the CPU; "
                          "use train.device=auto or cpu")
    for key, value in (("store.keep_rounds", config.store.keep_rounds),
                       ("train.checkpoint_every", config.train.checkpoint_every),
                       ("train.tail_average", config.train.tail_average)):
        if value:
            raise ConfigError(f"{key} must be 0 in the pipeline mode (a restarted stage "
                              "restores the global weights from the store); use the simulator "
                              "for it")


class StageModel(nn.Module):
    """Stage `stage` of one replica: its tensors with a replica axis of 1, the simulator's row.

    It offers what `crucible.sync.OuterSync` asks of a model (`R`, `stage_params`,
    `replica_weights`, `set_stage`) for its own stage; every other stage is empty."""

    def __init__(self, config: Config, stage: int) -> None:
        super().__init__()
        self.config, self.stage, self.R = config, stage, 1
        self.layout = stage_layout(config, stage)
        self.params = nn.ParameterDict({
            spec.name: nn.Parameter(initial_tensor(config, spec, stage=stage)[None].clone())
            for spec in self.layout})

    def stage_params(self, stage: int) -> dict[str, nn.Parameter]:
        return dict(self.params.items()) if stage == self.stage else {}

    def replica_weights(self, *, replica: int, stage: int) -> dict[str, torch.Tensor]:
        return {n: p.detach()[replica].clone() for n, p in self.stage_params(stage).items()}

    @torch.no_grad()
    def set_stage(self, stage: int, weights: dict[str, torch.Tensor],
                  replicas: torch.Tensor | None = None) -> None:
        for name, param in self.stage_params(stage).items():
            param.copy_(weights[name].expand_as(param))


@dataclass
class _InFlight:
    """A micro-batch between its forward and its backward on this stage."""
    owner: int                            # the replica whose micro-batch it is
    m: int
    output: torch.Tensor                  # where its backward starts: the loss, or the message sent
    leaves: dict[str, torch.Tensor]       # the message (and basis) received; the basis sent
    loss: float | None = None             # its mean training loss (the last stage)


class _DeathWatch:
    """What the outer round's wait asks of its peers (`ReplicaSync.watch`): a stage-replica the
    launcher reported dead in a round is not waited for in it (nor after, when it is gone)."""

    def __init__(self, worker: StageWorker) -> None:
        self.worker = worker

    def refresh(self) -> None:
        self.worker.inbox.drain()

    def waits_for(self, replica: int, global_step: int) -> bool:
        return ((replica, self.worker.s) not in self.worker._dead_now(global_step)
                and not self.worker._dropped_by_death(replica, global_step))

    def round_over(self, global_step: int) -> None:
        """Nothing to forget: a death is tied to its round."""


class StageWorker:
    """Stage `stage` of replica `replica` of the run in `run_dir` (its `run.json`)."""

    def __init__(self, run_dir: Path, replica: int, stage: int) -> None:
        ident = json.loads((run_dir / "run.json").read_text())
        self.ident = ident
        self.config = config = Config.from_dict(ident["config"])
        check_pipeline(config, micro_batches=int(ident.get("micro_batches", 1)))
        self.r, self.s = replica, stage
        self.S, self.R, self.H = config.pipeline.stages, config.replicas, config.sparseloco.inner_steps
        self.M = int(ident.get("micro_batches", 1))
        self.kind = config.pipeline.compression
        self.out = stage_dir(run_dir, replica, stage)
        self.out.mkdir(parents=True, exist_ok=True)
        self.journal = Journal(self.out, replica)
        self.plan = FaultPlan.from_list(ident["plan"])
        self.addresses: dict[str, str] = ident["addresses"]
        self.timeout_s = float(ident.get("link_timeout_s", 120.0))
        self.store = open_store(ident["store_url"], endpoint_url=config.store.endpoint_url,
                                region=config.store.region)
        self.run_key = ident["run_key"]
        self.model = StageModel(config, stage)
        self.params = self.model.stage_params(stage)
        self.optimizer = ReplicaAdamW([self.params], [self.model.layout], train=config.train,
                                      replicas=1)
        self.adamw_counts = [sum(1 for spec in stage_layout(config, t) if spec.inner == "adamw")
                             for t in range(self.S)]
        self.momentum = torch.zeros_like(self.params["basis"]) if "basis" in self.params else None
        self.sync = ReplicaSync(config, self.model, store=self.store, run_key=self.run_key,
                                replica=replica, stages=[stage])
        self.sync.watch = _DeathWatch(self)
        self.fixed = boundary.fixed_tensors(config)
        hd = config.model.d_model // config.model.heads
        self.rope = rope_tables(config.model.seq_len, hd, config.model.rope_base)
        self.data = None
        if stage in (0, self.S - 1):   # the ends read the replica's stream: ids, and targets
            tokens = load_tokens(config.data.path, vocab_size=config.model.vocab_size)
            self.data = TokenData(tokens, model=config.model, data=config.data,
                                  replicas=config.replicas, seed=config.seed)
        self.counters = LinkCounters()
        self.context = zmq.Context()
        # unplanned deaths the launcher reported: (replica, stage) -> (round died in, gone)
        self.deaths: dict[tuple[int, int], tuple[int, bool]] = {}
        self.round = 0                             # the round this process is in
        self.resend_to: set[str] = set()
        # the verdicts of its first stage (`_await_verdict`): the attempt (g, h, v) it is in,
        # the last verdict it took, and what it told its siblings when the first stage died
        self.position: tuple[int, int, int] | None = None
        self.last_verdict: tuple[tuple[int, int, int], Received] | None = None
        self.reported: dict[tuple[int, int, int], Received | None] = {}
        self.round_dropped = False         # an unplanned death dropped an inner step of it
        self._dropped_memo: tuple[tuple[int, frozenset[tuple[int, int]]], set[int]] | None = None
        self.notices = run_dir / "notices.jsonl"
        self._read_notices()     # deaths before this life began (a restarted process)
        self.attempt = 0                   # this inner step's attempt (messages carry it)
        self.retried = 0                   # inner steps run again after a death
        self.dropped = 0                   # inner steps dropped after a death
        # the inbox binds where its peers reach it, unless the run names another address
        # (a Kubernetes pod binds 0.0.0.0 and is reached by its DNS name: infra/k8s)
        bind = ident.get("binds", {}).get(f"{replica},{stage}") or self._address(replica, stage)
        self.inbox = Inbox(self.context, bind, self.counters,
                           max_bytes=self._max_message_bytes(), on_control=self._control,
                           expect_for=self._expect_for,
                           max_waiting=8 * self.M * (self.R + self.S) + 64,
                           on_poll=self._resend)
        self.shaping = Shaping(**ident.get("shaping", {}))
        self.outbox = Outbox(self.context, (replica, stage), self.counters, self.shaping)
        self.tokens = 0
        self.next_step = 0

    # -- shapes the links expect -------------------------------------------------------------
    def _width(self) -> int:
        return boundary.message_width(self.config)

    def _micro(self) -> int:
        return self.config.train.batch_size // self.M

    def _act_expect(self) -> dict[str, Expect]:
        m, T = self.config.model, self.config.model.seq_len
        shape = (1, self._micro(), T)
        out = {"message": Expect(torch.float32, (*shape, self._width()))}
        if self.kind != "none":
            out["ids"] = Expect(ids_dtype(m.vocab_size), shape, below=m.vocab_size)
        if self.kind == "mapl":
            out["basis"] = Expect(torch.float32, (1, m.d_model, self._width()))
        return out

    def _grad_expect(self) -> dict[str, Expect]:
        act = self._act_expect()
        out = {"message": act["message"]}
        if self.kind == "mapl":
            out["basis"] = act["basis"]
        return out

    def _expect_for(self, header: dict[str, Any]) -> dict[str, Expect] | None:
        """What a message must hold, by its kind and sender (None: not expected from it)."""
        q, t = header["src"]
        if not (0 <= q < self.R and 0 <= t < self.S) or (q, t) == (self.r, self.s):
            return None
        kind = header["kind"]
        if kind == "act" and t < self.s:
            return self._act_expect()
        if kind == "grad" and t > self.s:
            return self._grad_expect()
        if kind == "norms" and q == self.r and self.s == 0:
            return {"norms": Expect(torch.float32, (self.adamw_counts[t],))}
        if kind == "clip" and q == self.r and self.s != 0:   # the first stage's, or a report
            return self._verdict_expect()
        return None

    def _max_message_bytes(self) -> int:
        def size(e: Expect) -> int:
            n = 1
            for d in e.shape:
                n *= d
            return n * torch.empty(0, dtype=e.dtype).element_size()
        most = sum(size(e) for e in self._act_expect().values())
        return max(most, 8 * (sum(self.adamw_counts) + 1))

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
    def _own_live(self, step: StepPlan) -> list[int]:
        """This replica's stages whose processes are up this round (they exchange norms)."""
        return [t for t in range(self.S) if not bool(step.down[self.r, t])]

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

    # -- a life ---------------------------------------------------------------------------------
    def start(self) -> None:
        """First life: from step 0. A later life (after a planned kill): wait until the round
        before the stage's rejoin step is agreed, restore the stage's global weights."""
        life = self.journal.life
        if life == 0:
            self.journal.record("start", 0, stage=self.s)
            return
        records = self.journal.records()
        last = records[-1] if records else {}
        if last.get("kind") == "kill" and last.get("planned") and last.get("life") == life - 1:
            dead = rejoin = int(last["global_step"])      # the plan's: down from that round
        else:   # unplanned: it dies in the round after its last round record
            dead = died_in(self.out)
            self.journal.record("kill", dead, stage=self.s, planned=False, rejoin=True,
                                life=life - 1)
            rejoin = dead + 1
        while rejoin < self.config.train.global_steps and bool(
                self.plan.down_matrix(rejoin, replicas=self.R, stages=self.S)[self.r, self.s]):
            rejoin += 1
        self.journal.record("restart", dead, stage=self.s, rejoin=rejoin)
        through = self._restore(rejoin, dead)
        if self.next_step <= through:   # (rounds after `through` changed nothing of it)
            raise RuntimeError(
                f"stage {self.s} of replica {self.r}: its peers had not agreed global step "
                f"{through} within {self.timeout_s + 60.0:.0f} s, so this life cannot restore "
                f"the weights it rejoins with at step {rejoin}; it stops rather than train on "
                "stale weights")
        if self.next_step > rejoin:
            log.warning("r%d s%d: caught up to step %d, past the rejoin step %d", self.r, self.s,
                        self.next_step, rejoin)
        self.next_step = rejoin
        for g in range(through + 1, rejoin + 1):   # rounds that changed nothing of the stage:
            if self._evaluates(g):                  # its weights then are these (and perhaps
                self._save_global(g)                # no live peer of the stage saved them)
        if self.data is not None:
            for _ in range(rejoin * self.H):
                self.data.batch(replica=self.r, batch_size=self.config.train.batch_size)
        self.journal.record("rejoin", rejoin, stage=self.s)

    def _read_notices(self) -> None:
        """The launcher's notices of unplanned deaths so far (`notices.jsonl`; `_control`)."""
        if self.notices.exists():
            from crucible.runfiles import read_jsonl
            for notice in read_jsonl(self.notices):
                self._control(notice)

    def _trained_through(self, rejoin: int, dead: int) -> int:
        """The last round before `rejoin` in which some stage-replica of this stage trained
        it, by the plan and the unplanned deaths known now (this life's predecessor died in
        round `dead`): its agreement (and snapshot) holds the global weights, and the rounds
        after it change nothing of them. A round in which every replica of the stage died
        or dropped has no agreement at all: nobody made one."""
        for g in range(rejoin - 1, -1, -1):
            trained = self._effective(g).contributes[:, self.s].clone()
            if g == dead:
                trained[self.r] = False
            if bool(trained.any()):
                return g
        return -1

    def _restore(self, rejoin: int, dead: int) -> int:
        """Wait until the round this life restores from is agreed, and restore it; returns
        that round. A peer of this stage may die meanwhile in that round (then it is never
        agreed): the launcher's notices are read again while waiting."""
        deadline = time.monotonic() + self.timeout_s + 60.0
        while True:
            self._read_notices()
            through = self._trained_through(rejoin, dead)
            left = deadline - time.monotonic()
            self.next_step = self.sync.catch_up(through=through, timeout_s=min(0.5, left))
            if self.next_step > through or left <= 0:
                return through

    def run(self) -> dict[str, Any]:
        started = time.perf_counter()
        steps = self.config.train.global_steps
        if self.next_step == 0 and self._evaluates(0):
            self._save_global(0)
        for g in range(self.next_step, steps):
            self.round = g
            self.inbox.prune(g)
            step = plan_step(self.plan, g, config=self.config)
            if self._killed_at(g):
                self.journal.record("kill", g, stage=self.s, planned=True, rejoin=True)
                os.kill(os.getpid(), signal.SIGKILL)
            inner_started = time.perf_counter()
            losses = self._inner_steps(g)
            inner_s = time.perf_counter() - inner_started
            results = self.sync.synchronise(g, self._contributes(g, step))
            self.next_step = g + 1
            seen = self._effective(g)   # the plan and the deaths known by the round's end
            append_jsonl(self.out / "rounds.jsonl", {
                "global_step": g, "replica": self.r, "stage": self.s,
                "trained": bool(seen.active[self.r, self.s]),
                "dropped": bool(step.loss_weight[self.r] == 0) or self.round_dropped,
                "bypassed": [t for t in range(self.S) if bool(seen.bypass[self.r, t])],
                "train_loss": losses, "inner_s": inner_s,
                "upload_bytes": sum(x.upload_bytes for x in results),
                "wait_s": self.sync.waits_s[-1] if self.sync.waits_s else 0.0,
                "wall": time.time()})
            if self._evaluates(g + 1):
                self._save_global(g + 1)
        wall = time.perf_counter() - started
        summary = {"replica": self.r, "stage": self.s, "life": self.journal.life,
                   "wall_s": wall, "links": self.counters.to_dict(),
                   "retried_steps": self.retried, "dropped_steps": self.dropped,
                   "tokens": self.tokens, "codec_s": self.sync.codec_s,
                   "round_waits_s": self.sync.waits_s}
        save_global_weights(self.out / "model.pt", self.sync.global_weights)
        write_json_atomic(self.out / "summary.json", summary)
        return summary

    def close(self) -> None:
        self.inbox.close()
        self.outbox.close()
        self.context.term()

    def _killed_at(self, g: int) -> bool:
        return any(f.replica == self.r and f.stage == self.s and f.start == g
                   for f in self.plan.starting(g))

    def _evaluates(self, g: int) -> bool:
        train = self.config.train
        if g == 0:
            return train.eval_initial
        return g % train.eval_every == 0 or g == train.global_steps

    def _save_global(self, g: int) -> None:
        """The stage's global weights after `g` rounds, for the launcher's evaluation."""
        save_global_weights(self.out / "global" / f"g{g:06d}.pt", self.sync.global_weights)

    # -- inner steps ----------------------------------------------------------------------------
    def _batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        assert self.data is not None
        ids, targets = self.data.batch(replica=self.r, batch_size=self.config.train.batch_size)
        return ids[None], targets[None]

    def _inner_steps(self, g: int) -> float | None:
        """The round's H inner steps. An unplanned death in the replica's chain mid-step ends
        the step's attempt everywhere in the replica: under skip the replica's first stage
        decides (`_verdict`) whether the step completed (the dead stage had done its part) or
        runs again with the stage bypassed (the micro-batches in flight retried, counted in
        `retried_steps`); when the replica drops instead, its remaining inner steps of the
        round are dropped (`dropped_steps`)."""
        base = plan_step(self.plan, g, config=self.config)
        planned_drop = bool(base.loss_weight[self.r] == 0)
        self.round_dropped = False
        total, counted = 0.0, 0
        for h in range(self.H):
            batch = self._batch() if self.data is not None else None   # the stream moves on
            if planned_drop:
                continue
            lr = lr_at(float(g * self.H + h), train=self.config.train,
                       total_steps=self.config.train.global_steps * self.H)
            self.attempt = 0
            while True:
                self.outbox.begin()
                self.inbox.drain()               # deaths reported so far take effect
                step = self._effective(g)
                if not self._owners(step):        # dropped (or nothing to run) from here on
                    if bool(step.loss_weight[self.r] == 0):
                        self.dropped += 1
                        self.round_dropped = True
                    break
                self.position = (g, h, self.attempt)
                dead = self._chain_dead(g, step)
                try:
                    loss = self._micro_batches(g, h, step, batch, dead)
                    done = self._clip(g, h, step)
                except Interrupted:
                    self.model.zero_grad(set_to_none=True)
                    done = self._abandon(g, h, step)
                if done:
                    self._update(lr)
                    if loss is not None:
                        total += loss
                        counted += 1
                    if self.s == 0 and bool(step.loss_weight[self.r] > 0):
                        self.tokens += self.config.train.batch_size * self.config.model.seq_len
                    break
                self.model.zero_grad(set_to_none=True)
                if bool(self._effective(g).loss_weight[self.r] == 0):
                    self.dropped += 1
                    self.round_dropped = True
                    break
                self.retried += 1
                self.attempt += 1
                self.inbox.forget(self.r, g=g, h=h, below=self.attempt)
        return total / counted if counted else None

    def _micro_batches(self, g: int, h: int, step: StepPlan,
                       batch: tuple[torch.Tensor, torch.Tensor] | None,
                       dead: set[tuple[int, int]]) -> float | None:
        """Fill-drain: every micro-batch this process runs (its replica's, then those it is the
        donor for) forward, then every one backward. Returns the mean training loss of its own
        micro-batches on the last stage (None elsewhere). Raises Interrupted when a death in
        the chains it runs (since the attempt began, `dead`) or the first stage's retry makes
        a message it waits for never come."""
        def valid() -> bool:   # nothing in the chains it runs died since the attempt began
            return self._chain_dead(g, step) == dead and not self._abort_waiting(g, h)

        # fill
        in_flight = [self._forward(g, h, step, owner, m, batch, valid)
                     for owner in self._owners(step) for m in range(self.M)]
        # drain
        for micro in in_flight:
            self._backward(g, h, step, micro, valid)
        self._average_donor_gradients(step)
        losses = [micro.loss for micro in in_flight if micro.loss is not None]
        return sum(losses) / len(losses) if losses else None

    def _view(self, owner: int) -> int:
        """The view a message of `owner`'s micro-batch carries: this replica's attempt for its
        own; 0 for one it is the donor for (that replica's retries are not known here)."""
        return self.attempt if owner == self.r else 0

    def _forward(self, g: int, h: int, step: StepPlan, owner: int, m: int,
                 batch: tuple[torch.Tensor, torch.Tensor] | None,
                 valid: Callable[[], bool]) -> _InFlight:
        """Micro-batch m of `owner` through this stage: its input (the replica's tokens on the
        first stage, else the previous stage's message, decoded), the stage's blocks, then
        the loss (last stage) or the encoded message sent to the next stage."""
        prev, nxt = self._neighbours(step, owner)
        params = self._params_used(step)
        leaves: dict[str, torch.Tensor] = {}
        if "basis" in params:
            leaves["sent_basis"] = params["basis"]
        if self.s == 0:
            assert batch is not None and owner == self.r
            ids = self._micro_slice(batch[0], m)
            x = embed_forward(params, ids,
                              subspace=self.fixed.subspace if self.kind == "ssn" else None,
                              token_table=self.fixed.token_table)
        else:
            assert prev is not None
            x, ids = self._received(g, h, m, owner, prev, params, batch, leaves, valid)
        subspace = self.fixed.subspace if reparametrised(self.config, self.s) else None
        for layer in layers_of(self.config, self.s):
            x = block_forward(params, layer, x, config=self.config, rope=self.rope,
                              subspace=subspace)
        if self.s == self.S - 1:
            assert batch is not None and owner == self.r
            loss, mean = self._loss(g, h, step, owner, params, x, self._micro_slice(batch[1], m))
            return _InFlight(owner, m, loss, leaves, mean)
        assert nxt is not None
        sent = boundary.encode(self.kind, x, ids, sender=params, stage=self.s, fixed=self.fixed)
        out = {"message": sent}
        if self.kind != "none":
            out["ids"] = ids.to(ids_dtype(self.config.model.vocab_size))
        if self.kind == "mapl":
            out["basis"] = params["basis"]
        self.outbox.send(self._address(*nxt), "act", g=g, h=h, m=m, owner=owner,
                         v=self._view(owner), tensors=out)
        return _InFlight(owner, m, sent, leaves)

    def _micro_slice(self, rows: torch.Tensor, m: int) -> torch.Tensor:
        """Micro-batch m's rows of the replica's batch (ids or targets)."""
        b = self._micro()
        return rows[:, m * b:(m + 1) * b]

    def _received(self, g: int, h: int, m: int, owner: int, prev: tuple[int, int],
                  params: dict[str, torch.Tensor],
                  batch: tuple[torch.Tensor, torch.Tensor] | None,
                  leaves: dict[str, torch.Tensor],
                  valid: Callable[[], bool]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The previous stage's message for micro-batch m, decoded: (x, the token ids). The
        message (and a MAPL basis) become the leaves whose gradients go back (`leaves`)."""
        got = self.inbox.receive("act", prev, g=g, h=h, m=m, owner=owner, v=self._view(owner),
                                 expect=self._act_expect(), timeout_s=self.timeout_s,
                                 valid=valid)
        message = got.tensors["message"].requires_grad_(True)
        leaves["message"] = message
        ids = (got.tensors["ids"].long() if "ids" in got.tensors
               else self._micro_slice(batch[0], m) if batch is not None else None)
        basis = None
        if self.kind == "mapl":
            basis = got.tensors["basis"].requires_grad_(True)
            leaves["basis"] = basis
        x = boundary.decode(self.kind, message, ids, receiver=params, stage=self.s,
                            basis=basis, fixed=self.fixed)
        return x, ids

    def _loss(self, g: int, h: int, step: StepPlan, owner: int, params: dict[str, torch.Tensor],
              x: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, float]:
        """The last stage's loss of a micro-batch, weighted as the step plan weighs its
        replica and divided by the micro-batches (what its backward starts from), and its
        mean training loss."""
        mean = head_losses(params, x, targets)
        if not bool(torch.isfinite(mean).all()):
            raise TrainingDiverged(f"non-finite training loss at global step {g}, "
                                   f"inner step {h}: {mean.tolist()}")
        loss = (mean * step.loss_weight[owner:owner + 1].float()).sum()
        return (loss / self.M if self.M > 1 else loss), float(mean.detach())

    def _backward(self, g: int, h: int, step: StepPlan, micro: _InFlight,
                  valid: Callable[[], bool]) -> None:
        """Micro-batch `micro` back through this stage: from its loss (last stage) or the
        gradient the next stage returns for the message sent, then the gradient of what this
        stage received goes to the previous stage."""
        prev, nxt = self._neighbours(step, micro.owner)
        v = self._view(micro.owner)
        if self.s == self.S - 1:
            micro.output.backward()
        else:
            assert nxt is not None
            got = self.inbox.receive("grad", nxt, g=g, h=h, m=micro.m, owner=micro.owner, v=v,
                                     expect=self._grad_expect(), timeout_s=self.timeout_s,
                                     valid=valid)
            if self.kind == "mapl":
                # the receiver's decode gradient of the basis it was sent joins the encode's in
                # one backward, summed where the simulator sums them
                torch.autograd.backward([micro.output, micro.leaves["sent_basis"]],
                                        [got.tensors["message"], got.tensors["basis"]])
            else:
                micro.output.backward(got.tensors["message"])
        if self.s != 0:
            assert prev is not None
            grads = {"message": micro.leaves["message"].grad}
            if self.kind == "mapl":
                grads["basis"] = micro.leaves["basis"].grad
            self.outbox.send(self._address(*prev), "grad", g=g, h=h, m=micro.m,
                             owner=micro.owner, v=v, tensors=grads)

    def _params_used(self, step: StepPlan) -> dict[str, torch.Tensor]:
        """The stage's tensors as the forward uses them: a round that reroutes through this
        stage gathers every replica's tensors of it by the route (the simulator's
        `_gathered`), which copies them (a MAPL basis then leaves its column-major layout, and
        its products round otherwise): the same gather here, of the one row."""
        if self.s not in step.route:
            return self.params
        row = torch.zeros(1, dtype=torch.long)
        return {n: p[row] for n, p in self.params.items()}

    @torch.no_grad()
    def _average_donor_gradients(self, step: StepPlan) -> None:
        """A donor's stage holds the gradients of its own micro-batch and of each replica it
        served: divided by the number of batches, as the simulator's trainer does."""
        if step.extra_load is None or not int(step.extra_load[self.r, self.s]):
            return
        load = step.extra_load[self.r:self.r + 1, self.s]
        scale = (1.0 / (1.0 + load.double())).float()
        for p in self.params.values():
            if p.grad is not None:
                p.grad.mul_(scale.view(-1, *([1] * (p.dim() - 1))))

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

    def _update(self, lr: float) -> None:
        active = torch.ones(1, 1, dtype=torch.bool)
        self.optimizer.step(lr=lr, active=active)
        basis = self.params.get("basis")
        if basis is not None and basis.grad is not None:
            self._stiefel_as_batched(basis, lr)
        self.model.zero_grad(set_to_none=True)

    @torch.no_grad()
    def _stiefel_as_batched(self, basis: torch.Tensor, lr: float) -> None:
        """This boundary's SPEL step, bit for bit the simulator's: the simulator steps every
        boundary of every replica as one ((S-1) x R, d, k) batch (`boundary.stiefel_steps`),
        and the CPU kernels round a lone matrix (with the gradient's column-major layout)
        otherwise than the same matrix inside that contiguous batch. So the row is placed at
        its place in a zero batch of the simulator's shape and only it is stepped (a zero row
        stays zero): (S-1) x R small matrices instead of one, the price of the oracle."""
        pipe = self.config.pipeline
        assert self.momentum is not None
        n = (self.S - 1) * self.R
        at = self.s * self.R + self.r
        wide = [torch.zeros(n, *basis.shape[1:], dtype=basis.dtype) for _ in range(3)]
        wide[0][at] = basis.data[0]
        wide[1][at] = basis.grad[0]
        wide[2][at] = self.momentum[0]
        mask = torch.zeros(n, dtype=torch.bool)
        mask[at] = True
        boundary.stiefel_step(wide[0], wide[1], wide[2], lr=lr * pipe.mapl_lr_scale,
                              beta=pipe.mapl_momentum, steps=pipe.mapl_ns_steps, mask=mask)
        basis.data[0] = wide[0][at]
        self.momentum[0] = wide[2][at]


# the round a stage process that died unplanned was in (the launcher and the next life both
# read it so): the replica mode's rule, `journal.died_in`, under the name its importers use
died_in_round = died_in


def _die_with_launcher() -> None:
    """Ask Linux to SIGKILL this process when the launcher dies (PR_SET_PDEATHSIG): a killed
    launcher leaves no stage training on, orphaned."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)
    except (OSError, AttributeError) as exc:
        log.warning("cannot ask to die with the launcher (%s)", exc)
        return
    if os.getppid() == 1:   # the launcher died before the request took effect
        os._exit(1)


def run_stage(run_dir: Path, replica: int, stage: int) -> dict[str, Any]:
    _die_with_launcher()
    torch.set_num_threads(int(os.environ.get("CRUCIBLE_TORCH_THREADS", "1")))
    worker = StageWorker(run_dir, replica, stage)
    try:
        if (worker.out / "summary.json").exists():
            return json.loads((worker.out / "summary.json").read_text())
        worker.start()
        return worker.run()
    finally:
        worker.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="crucible.distributed.pipeline.stage")
    parser.add_argument("--run-dir", required=True, type=Path)
    parser.add_argument("--replica", required=True, type=int)
    parser.add_argument("--stage", required=True, type=int)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO,
                        format=f"%(asctime)s r{args.replica}-s{args.stage} %(levelname)s "
                               "%(name)s: %(message)s")
    run_stage(args.run_dir, args.replica, args.stage)
    return 0


if __name__ == "__main__":
    sys.exit(main())

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

`StageWorker` is this process: its links and state, its lives (`start`, the restore after a
restart) and its rounds (`run`: the inner steps, each with its AdamW and Stiefel step, then the
outer round). Its parts, each a mixin it builds on: `schedule` (one inner step's micro-batches,
fill-drain), `verdicts` (the first stage's clip-or-retry verdict of each inner step), `deaths`
(the unplanned deaths heard of and the round's step plan they make); `stage_model` holds the
stage's model, the run's checks and the stage's folder.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import torch
import zmq

from crucible import boundary
from crucible.config import Config
from crucible.data import TokenData, load_tokens
from crucible.distributed.journal import Journal, died_in
from crucible.distributed.pipeline.deaths import DeathWatch
from crucible.distributed.pipeline.links import (
    Expect,
    Inbox,
    Interrupted,
    LinkCounters,
    Outbox,
    Received,
    Shaping,
)
from crucible.distributed.pipeline.schedule import MicroBatches
from crucible.distributed.pipeline.stage_model import StageModel, check_pipeline, stage_dir
from crucible.distributed.sync import ReplicaSync
from crucible.faults import FaultPlan
from crucible.model import rope_tables, stage_layout
from crucible.model_file import save_global_weights
from crucible.optim import ReplicaAdamW, lr_at
from crucible.runfiles import append_jsonl, write_json_atomic
from crucible.store import open_store
from crucible.strategy import plan_step

__all__ = ["StageWorker", "run_stage", "main"]

log = logging.getLogger(__name__)


class StageWorker(MicroBatches):
    """Stage `stage` of replica `replica` of the run in `run_dir` (its `run.json`). It holds
    the state its parts read and write: `MicroBatches` over `Verdicts` over `DeathBook`."""

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
        self._stiefel_work = boundary.Workspace()   # the SPEL step's scratch, reused every step
        self.sync = ReplicaSync(config, self.model, store=self.store, run_key=self.run_key,
                                replica=replica, stages=[stage])
        self.sync.watch = DeathWatch(self)
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

    # -- what the inbox accepts -----------------------------------------------------------
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
                              beta=pipe.mapl_momentum, steps=pipe.mapl_ns_steps, mask=mask,
                              work=self._stiefel_work)
        basis.data[0] = wide[0][at]
        self.momentum[0] = wide[2][at]


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

"""One replica of a distributed run: its S stages in one OS process, started by torchrun.

    python -m torch.distributed.run --standalone --nproc-per-node 1 --max-restarts K \\
        -m crucible.distributed.run_worker --run-dir DIR --replica r

The process is the simulator's replica r, restricted to it: the same model code with one replica
row (`ReplicatedPipeline` with R' = 1), the same data stream (`generator(seed, DATA_STREAM, r)`),
the same initial weights, the same fault plan (drawn for all R replicas; the process applies its
own row) and the same trainer: `ReplicaTrainer` is `crucible.train.Trainer` holding replica r
(its constructor, global step, rejoin resets, evaluation and summary, with the replica's data
view, outer round and step-plan row injected). Only the outer round differs: contributions
travel through the store to peers in other processes, with a deadline
(`crucible.distributed.sync`). The run's identity and plan come from `DIR/run.json`, written by
`crucible.distributed.launch`; the process writes `DIR/replicas/replica-<r>/` (its events,
metrics and, at the end, `summary.json`, atomically).

Strategies: `skip` and `drop` run inside the process (a down stage of this replica is bypassed,
or the whole replica idles for the round). `reroute` needs another replica's stage and
`drop_extend` a run-wide token count, so they are refused; so are `diloco` and `ddp` (no process
group yet) and `store.keep_rounds` (a peer may still need a round another has finished).

Real faults. Planned ones (`kills` in run.json): at the start of a planned global step the
process records a `kill` record and SIGKILLs itself. Unplanned ones: anything that ends the
process (an outside `kill -9`, the OOM killer, a crash) or its agent. Either way the elastic agent
starts it again (every replica has a restart budget, `lives` in run.json; the launcher restarts
an agent that was itself killed), and the new process, its next *life*, restores the current
global weights from the store (`ReplicaSync.catch_up`, once the round the last life died in is
agreed without it) with fresh AdamW state and error feedback, then trains from the next round.
A life counts its predecessors in its journal (`crucible.distributed.journal`, `process.jsonl`:
a `start` or `restart` record each); a death no `kill` record explains is recorded by the next
life as an unplanned `kill`, at the last heartbeat of the dead life (so the recovery times it gives are upper bounds by one beat
interval, `lease_s / 4`). Each life keeps a heartbeat lease in the store
(`crucible.distributed.liveness`), which its peers read to stop waiting for it once it is dead.
A replica killed for good (`--kill-forever`) says so in its last beat (`gone`); its next life
exits at once.

The process dies with its agent (`PR_SET_PDEATHSIG` on Linux, armed by its entry point
`crucible.distributed.run_worker` before anything is imported), so a killed agent leaves no
orphan training on beside its replacement.
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

from crucible.arithmetic import arithmetic
from crucible.boundary import wire_bytes
from crucible.config import Config, ConfigError
from crucible.data import TokenData, token_digest
from crucible.distributed import injection
from crucible.distributed.journal import Journal, died_in, restart_count
from crucible.distributed.liveness import Heartbeat, PeerWatch, read_beat
from crucible.distributed.sync import ReplicaSync
from crucible.events import JsonlCallback
from crucible.faults import FaultPlan
from crucible.model_file import MODEL_FILE, save_global_weights
from crucible.runfiles import append_jsonl, write_json_atomic
from crucible.store import Store, open_store
from crucible.strategy import StepPlan
from crucible.sync import StageSyncResult
from crucible.train import Trainer, _versions

__all__ = ["ReplicaTrainer", "check_distributed", "clip_as_batched", "clip_coefficient", "main"]

log = logging.getLogger(__name__)
READY_PREFIX = "ready"


def check_distributed(config: Config) -> None:
    """Refuse what the distributed mode cannot run, naming the key and the alternative."""
    if config.faults.strategy in ("reroute", "drop_extend") and config.faults.p > 0:
        raise ConfigError(
            f"faults.strategy={config.faults.strategy} is not supported in distributed mode: "
            + ("reroute sends a replica's micro-batches through another replica's stage, which "
               "lives in another process" if config.faults.strategy == "reroute" else
               "drop_extend extends the run by a token count summed over every replica")
            + "; use faults.strategy=skip or drop (or the simulator, `crucible run`)")
    if config.sparseloco.method != "sparseloco":
        raise ConfigError(f"sparseloco.method={config.sparseloco.method} is not supported in "
                          "distributed mode (it would need a process group); use "
                          "sparseloco.method=sparseloco or the simulator")
    if config.store.keep_rounds:
        raise ConfigError("store.keep_rounds must be 0 in distributed mode: a slower or "
                          "restarted peer may still read a round another peer has finished")
    if config.train.checkpoint_every:
        raise ConfigError("train.checkpoint_every must be 0 in distributed mode: a replica "
                          "restarts from the global weights in the store, not a checkpoint")
    if config.train.tail_average:
        raise ConfigError("train.tail_average must be 0 in distributed mode: a restarted "
                          "replica would lose its tail sum; use the simulator (`crucible run`)")


class _ReplicaData:
    """`TokenData` seen by one replica: `batches(replicas=1)` is replica r's micro-batch."""

    def __init__(self, data: TokenData, replica: int) -> None:
        self.data, self.replica = data, replica

    def batches(self, *, replicas: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        assert replicas == 1
        ids, targets = self.data.batch(replica=self.replica, batch_size=batch_size)
        return ids[None], targets[None]                        # (1, B, T)

    def skip(self, *, batches: int, batch_size: int) -> None:
        """Advance the stream past `batches` micro-batches (a restarted replica's missed ones)."""
        for _ in range(batches):
            self.data.batch(replica=self.replica, batch_size=batch_size)

    def validation(self, **kwargs: Any):
        return self.data.validation(**kwargs)

    def digest(self) -> str:
        """The corpus's `token_digest` (the simulator's summary has it as `data_digest`)."""
        return token_digest(self.data.train.numpy(), self.data.val.numpy())

    def state_dict(self):
        return self.data.state_dict()


def _row(step: StepPlan, replica: int) -> StepPlan:
    """Replica `replica`'s row of a run-wide step plan, as a one-replica plan."""
    assert not step.route, "reroute is refused in distributed mode"
    keep = slice(replica, replica + 1)
    return StepPlan(down=step.down[keep], bypass=step.bypass[keep], active=step.active[keep],
                    loss_weight=step.loss_weight[keep])


class ReplicaTrainer(Trainer):
    """The simulator's `Trainer` holding replica `replica` only (one model row): it injects that
    replica's view of the data, its `ReplicaSync` and its row of each step plan; what is its own
    is the planned kill, the rejoin of a restarted process, the round record and the clipping
    at the simulator's width."""

    def __init__(self, config: Config, *, replica: int, store: Store, run_key: str,
                 callback: JsonlCallback, device: torch.device, plan: FaultPlan | None = None,
                 kills: list[int] | None = None, rejoin_after: int | None = None,
                 heartbeat: Heartbeat | None = None, forever: frozenset[int] = frozenset(),
                 journal: Journal | None = None) -> None:
        """`rejoin_after`: for a restarted process, the global step its last life died in (the
        new life waits until the peers agreed it, then catches up); None for the first life.
        `forever`: the planned kills after which the replica does not come back. `journal`:
        where this life records its kill, rejoin and first contribution (`callback`'s folder's
        by default)."""
        check_distributed(config)
        self.replica = replica
        self.journal = journal or Journal(Path(callback.out_dir), replica)
        self.kills = sorted(kills or [])
        self.forever = forever
        self.heartbeat = heartbeat
        self.rejoined_at: int | None = None
        self.contributed = False
        super().__init__(config, store=store, run_key=run_key, callback=callback, plan=plan,
                         device=device, replicas=[replica])
        if rejoin_after is not None:
            self._rejoin(rejoin_after)

    # -- what it injects into the simulator's trainer --------------------------------------------
    def _data_view(self, data: TokenData) -> _ReplicaData:
        return _ReplicaData(data, self.replica)

    def _make_sync(self) -> ReplicaSync:
        return ReplicaSync(self.config, self.model, store=self.store, run_key=self.run_key,
                           replica=self.replica)

    def _local_step(self, step: StepPlan) -> StepPlan:
        return _row(step, self.replica)

    def _report_tokens(self, g: int) -> None:
        """None: the run's token count is the sum over the processes (the merged summary's
        `tokens_processed`, from `rounds.jsonl`); this process knows only its own."""

    def _clip(self) -> None:
        clip_as_batched(self.optimizer.parameters(), self.config.train.grad_clip,
                        replica=self.replica, replicas=self.config.replicas)

    # -- its own: kill, rejoin, round record -----------------------------------------------------
    def _rejoin(self, dead_round: int) -> None:
        """A restarted process: the current global weights from the store (once the round its
        last life died in is agreed without it), fresh AdamW state and error feedback (as built),
        the data stream moved past the rounds it missed. A life that died after the last round
        (in the final evaluation) leaves only that evaluation to do (`run`)."""
        last = self.config.train.global_steps - 1
        self.next_step = self.sync.catch_up(
            through=min(dead_round, last),
            timeout_s=2 * self.config.sparseloco.round_timeout_s + 60)
        self.rejoined_at = self.next_step
        if self.heartbeat is not None:
            self.heartbeat.update(state="training", **{"from": self.next_step})
        self.data.skip(batches=self.next_step * self.H, batch_size=self.config.train.batch_size)
        self.config = self.config.replace(train=_no_initial_eval(self.config))

    def run(self, **kwargs: Any) -> dict[str, Any]:
        if self.rejoined_at is not None and self.next_step >= self.config.train.global_steps:
            from crucible.presets import tokens_per_global_step
            # every round is agreed: what the last life left undone is the final evaluation
            self._maybe_evaluate(tokens_per_global_step(self.config)
                                 * self.config.train.global_steps)
        return super().run(**kwargs)

    def _round_starts(self, g: int) -> None:
        """The heartbeat names the round; a planned kill: record it, then SIGKILL this process
        (the elastic agent restarts it; a replica killed for good says so in its last beat)."""
        if self.heartbeat is not None:
            self.heartbeat.update(round=g)
        if g in self.kills and not self.journal.fired(g):
            self.journal.record("kill", g, planned=True, rejoin=g not in self.forever)
            self.callback.flush()
            if self.heartbeat is not None and g in self.forever:
                self.heartbeat.stop("gone")
            os.kill(os.getpid(), signal.SIGKILL)

    def _round_done(self, g: int, step: StepPlan, results: list[StageSyncResult]) -> None:
        """`rounds.jsonl` (what the merged summary counts: it survives a SIGKILL) and the first
        contribution after a rejoin."""
        made = any(r.made for r in results)
        if self.rejoined_at is not None and not self.contributed and made:
            self.journal.record("first_contribution", g)
        self.contributed = self.contributed or made
        tokens = self._tokens_per_replica()
        crossings = int(step.crossings()[0]) * tokens
        append_jsonl(Path(self.callback.out_dir) / "rounds.jsonl", {
            "global_step": g, "replica": self.replica,
            "tokens": tokens * int(step.loss_weight[0] > 0),
            "inner_steps": (step.active[0].long() * self.H).tolist(),
            "down": bool(step.down[0].any()),
            "boundary_bytes": [n * crossings for n in wire_bytes(self.config)],
            "upload_bytes": sum(r.upload_bytes for r in results),
            "dense_bytes": sum(r.dense_bytes for r in results),
            "wait_s": self.sync.waits_s[-1], "restart": restart_count()})


@torch.no_grad()
def clip_as_batched(params: list[torch.Tensor], max_norm: float, *, replica: int,
                    replicas: int) -> None:
    """`optim.clip_per_replica` for one replica row, bit for bit what the simulator computes
    for row `replica` of `replicas`: the sum of squared per-tensor norms is reduced over a
    (tensors, replicas) matrix, and torch's CPU reduction order over that non-contiguous column
    depends on the number of columns (a lone column is summed in another order, and differs by
    about 1e-7 relative), so the row is placed in a zero matrix of the simulator's width."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return
    per_tensor = torch.stack([torch.linalg.vector_norm(g.flatten(1), dim=1) for g in grads])
    coef = clip_coefficient(per_tensor[:, 0], max_norm, replica=replica, replicas=replicas)
    if bool((coef < 1.0).any()):
        for g in grads:
            g.mul_(coef.view(-1, *([1] * (g.dim() - 1))))


def clip_coefficient(norms: torch.Tensor, max_norm: float, *, replica: int,
                     replicas: int) -> torch.Tensor:
    """The clipping factor (1,) of one replica whose per-tensor gradient norms (every tensor
    `optim.clip_per_replica` sees, in its order) are `norms`, bit for bit the simulator's for
    row `replica` of `replicas` (`clip_as_batched` says why the width matters)."""
    wide = torch.zeros(norms.shape[0], replicas, dtype=norms.dtype, device=norms.device)
    wide[:, replica] = norms
    total = wide.pow(2).sum(0).sqrt()[replica:replica + 1]
    return (max_norm / (total + 1e-6)).clamp(max=1.0)


def _no_initial_eval(config: Config):
    from dataclasses import replace
    return replace(config.train, eval_initial=False)


def _device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}")
    return torch.device("cpu")


def _wait_ready(store: Store, run_key: str, *, replicas: int, timeout_s: float) -> None:
    """Start barrier: every replica has built its model (importing torch on a busy host takes
    seconds, which must not count against the first round's deadline)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if len(store.list(f"{run_key}/{READY_PREFIX}/")) >= replicas:
            return
        time.sleep(0.05)
    log.warning("start barrier: not every replica is ready after %.0f s; starting", timeout_s)


def run_replica(run_dir: Path, replica: int) -> dict[str, Any] | None:
    """Run replica `replica` of the run described by `run_dir/run.json`; returns its summary,
    or None when the replica was killed for good in an earlier life (this life exits at once)."""
    ident = json.loads((run_dir / "run.json").read_text())
    config = Config.from_dict(ident["config"])

    def connect() -> Store:
        return open_store(ident["store_url"], endpoint_url=config.store.endpoint_url,
                          region=config.store.region)

    store = connect()
    run_key = ident["run_key"]
    out = run_dir / "replicas" / f"replica-{replica}"
    out.mkdir(parents=True, exist_ok=True)
    callback = JsonlCallback(out)
    write_json_atomic(out / "worker.pid", {"pid": os.getpid(), "replica": replica})
    plan = FaultPlan.from_list(ident["plan"]) if ident.get("plan") is not None else None
    mine = [k for k in ident.get("kills", []) if k["replica"] == replica]
    kills = [k["global_step"] for k in mine]
    forever = frozenset(k["global_step"] for k in mine if not k["rejoin"])
    lives = ident.get("lives") or [1] * config.replicas
    lease_s = float(ident.get("lease_s") or 0.0)
    device = _device()
    journal = Journal(out, replica)
    life = journal.life
    if (out / "summary.json").exists():   # an earlier life finished and died on its way out
        log.info("replica %d already finished (an earlier life wrote its summary)", replica)
        callback.close()
        return json.loads((out / "summary.json").read_text())
    if life >= lives[replica]:            # a restart nobody budgeted (a pod started anew)
        log.warning("replica %d has had its %d lives; not starting another", replica,
                    lives[replica])
        journal.record("over_budget", -1)
        callback.close()
        return None
    dead_round = None
    if life > 0:   # the process is back (its agent started it again)
        dead_round = died_in(out)
        ended = journal.explained(life - 1)
        if ended is not None and not ended.get("rejoin", True):
            log.info("replica %d was killed for good at global step %d; not rejoining",
                     replica, ended["global_step"])
            journal.record("restart", ended["global_step"], gone=True)
            callback.close()
            return None
        # unplanned, and not recorded by a life that died since
        if ended is None and not journal.recorded_death(life - 1):
            beat = read_beat(store, run_key, replica)
            last = beat["wall"] if beat is not None and beat["life"] == life - 1 else None
            journal.record("kill", dead_round, planned=False, wall=last, rejoin=True,
                           dead_life=life - 1, life=life - 1)
        journal.record("restart", dead_round)
    else:
        journal.record("start", 0)
    heartbeat = None
    if lease_s > 0:
        heartbeat = Heartbeat(connect, run_key, replica=replica, life=life, lease_s=lease_s,
                              start_from=0 if dead_round is None else dead_round + 1,
                              state="training" if dead_round is None else "catching_up").start()
    trainer = ReplicaTrainer(config, replica=replica, store=store, run_key=run_key,
                             callback=callback, device=device, plan=plan, kills=kills,
                             rejoin_after=dead_round, heartbeat=heartbeat, forever=forever,
                             journal=journal)
    if lease_s > 0:
        trainer.sync.watch = PeerWatch(store, run_key, replicas=config.replicas, me=replica,
                                       lease_s=lease_s, lives=lives)
    if injection.armed():   # test fault injection, asked for by an environment variable
        injection.arm(trainer, out, replica=replica, life=life)
    ready = f"{run_key}/{READY_PREFIX}/replica-{replica}"
    store.put(ready, b"1")
    if life > 0:   # it holds the current global weights: it trains from next_step
        journal.record("caught_up", trainer.next_step)
    else:
        _wait_ready(store, run_key, replicas=config.replicas,
                    timeout_s=float(ident.get("start_timeout_s", 300.0)))
    summary = trainer.run()
    callback.flush()
    summary.update(replica=replica, restarts=life, rejoined_at=trainer.rejoined_at,
                   round_waits_s=trainer.sync.waits_s, device=str(device),
                   versions=_versions(device), data_digest=trainer.data.digest(),
                   arithmetic=arithmetic(device))
    save_global_weights(out / MODEL_FILE, trainer.sync.global_weights)
    write_json_atomic(out / "summary.json", summary)
    if heartbeat is not None:
        heartbeat.stop("done")
    callback.close()
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="crucible.distributed.worker")
    parser.add_argument("--run-dir", required=True, type=Path)
    parser.add_argument("--replica", required=True, type=int)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s replica-{args.replica} "
                                                   "%(levelname)s %(name)s: %(message)s")
    run_replica(args.run_dir, args.replica)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""One replica of a distributed run: its S stages in one OS process, started by torchrun.

    python -m torch.distributed.run --standalone --nproc-per-node 1 --max-restarts K \\
        -m crucible.distributed.worker --run-dir DIR --replica r

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

Real faults (`kills` in run.json): at the start of a planned global step the process records a
`kill` record and SIGKILLs itself; the elastic agent starts it again, and the new process
restores the current global weights from the store (`ReplicaSync.catch_up`) with fresh AdamW
state and error feedback, then trains from the next round the peers have not agreed yet.
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

from crucible.boundary import wire_bytes
from crucible.config import Config, ConfigError
from crucible.data import TokenData, token_digest
from crucible.distributed.sync import ReplicaSync
from crucible.events import JsonlCallback
from crucible.faults import FaultPlan
from crucible.model_file import MODEL_FILE, save_global_weights
from crucible.store import Store, open_store
from crucible.strategy import StepPlan
from crucible.summary import write_json_atomic
from crucible.sync import StageSyncResult
from crucible.train import Trainer, _versions

__all__ = ["ReplicaTrainer", "check_distributed", "clip_as_batched", "main"]

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
                 kills: list[int] | None = None, rejoined: bool = False) -> None:
        check_distributed(config)
        self.replica = replica
        self.kills = sorted(kills or [])
        self.rejoined_at: int | None = None
        self.contributed = False
        super().__init__(config, store=store, run_key=run_key, callback=callback, plan=plan,
                         device=device, replicas=[replica])
        if rejoined:
            self._rejoin()

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
    def _rejoin(self) -> None:
        """A restarted process: the current global weights from the store (once the round it
        was killed in is agreed without it), fresh AdamW state and error feedback (as built),
        the data stream moved past the rounds it missed."""
        killed = [g for g in self.kills if _fired(self.callback.out_dir, g)]
        self.next_step = self.sync.catch_up(
            through=max(killed, default=-1),
            timeout_s=2 * self.config.sparseloco.round_timeout_s + 60)
        self.rejoined_at = self.next_step
        self.data.skip(batches=self.next_step * self.H, batch_size=self.config.train.batch_size)
        self.config = self.config.replace(train=_no_initial_eval(self.config))

    def _round_starts(self, g: int) -> None:
        """A planned kill: record it, then SIGKILL this process (the elastic agent restarts it)."""
        if g in self.kills and not _fired(self.callback.out_dir, g):
            _record(self.callback, "kill", g, self.replica)
            self.callback.flush()
            os.kill(os.getpid(), signal.SIGKILL)

    def _round_done(self, g: int, step: StepPlan, results: list[StageSyncResult]) -> None:
        """`rounds.jsonl` (what the merged summary counts: it survives a SIGKILL) and the first
        contribution after a rejoin."""
        made = any(r.made for r in results)
        if self.rejoined_at is not None and not self.contributed and made:
            _record(self.callback, "first_contribution", g, self.replica)
        self.contributed = self.contributed or made
        tokens = self._tokens_per_replica()
        crossings = int(step.crossings()[0]) * tokens
        _append(Path(self.callback.out_dir) / "rounds.jsonl", {
            "global_step": g, "replica": self.replica,
            "tokens": tokens * int(step.loss_weight[0] > 0),
            "inner_steps": (step.active[0].long() * self.H).tolist(),
            "down": bool(step.down[0].any()),
            "boundary_bytes": [n * crossings for n in wire_bytes(self.config)],
            "upload_bytes": sum(r.upload_bytes for r in results),
            "dense_bytes": sum(r.dense_bytes for r in results),
            "wait_s": self.sync.waits_s[-1], "restart": _restart_count()})


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
    wide = torch.zeros(per_tensor.shape[0], replicas, dtype=per_tensor.dtype,
                       device=per_tensor.device)
    wide[:, replica] = per_tensor[:, 0]
    norms = wide.pow(2).sum(0).sqrt()[replica:replica + 1]
    coef = (max_norm / (norms + 1e-6)).clamp(max=1.0)
    if bool((coef < 1.0).any()):
        for g in grads:
            g.mul_(coef.view(-1, *([1] * (g.dim() - 1))))


def _no_initial_eval(config: Config):
    from dataclasses import replace
    return replace(config.train, eval_initial=False)


# -- records of real faults (not simulator events: they live beside them, in process.jsonl) ----
def _restart_count() -> int:
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def _record(callback: JsonlCallback, kind: str, g: int, replica: int) -> None:
    _append(Path(callback.out_dir) / "process.jsonl", {
        "kind": kind, "global_step": g, "replica": replica, "wall": time.time(),
        "restart": _restart_count()})


def _append(path: Path, line: dict[str, Any]) -> None:
    """One JSON line, durable before the call returns (a SIGKILL may follow)."""
    with open(path, "a", encoding="utf-8") as fh:
        fh.write(json.dumps(line) + "\n")
        fh.flush()
        os.fsync(fh.fileno())


def _fired(out_dir: Path, g: int) -> bool:
    path = Path(out_dir) / "process.jsonl"
    if not path.exists():
        return False
    return any(json.loads(line).get("kind") == "kill" and json.loads(line)["global_step"] == g
               for line in path.read_text().splitlines() if line.strip())


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


def run_replica(run_dir: Path, replica: int) -> dict[str, Any]:
    """Run replica `replica` of the run described by `run_dir/run.json`; returns its summary."""
    ident = json.loads((run_dir / "run.json").read_text())
    config = Config.from_dict(ident["config"])
    store = open_store(ident["store_url"], endpoint_url=config.store.endpoint_url,
                       region=config.store.region)
    out = run_dir / "replicas" / f"replica-{replica}"
    callback = JsonlCallback(out)
    restart = _restart_count()
    plan = FaultPlan.from_list(ident["plan"]) if ident.get("plan") is not None else None
    kills = [k["global_step"] for k in ident.get("kills", []) if k["replica"] == replica]
    device = _device()
    if restart > 0:   # the process is back (the elastic agent started it again)
        _record(callback, "restart", max((g for g in kills if _fired(out, g)), default=-1),
                replica)
    trainer = ReplicaTrainer(config, replica=replica, store=store, run_key=ident["run_key"],
                             callback=callback, device=device, plan=plan, kills=kills,
                             rejoined=restart > 0)
    ready = f"{ident['run_key']}/{READY_PREFIX}/replica-{replica}"
    store.put(ready, b"1")
    if restart > 0:   # it holds the current global weights: it trains from next_step
        _record(callback, "caught_up", trainer.next_step, replica)
    else:
        _wait_ready(store, ident["run_key"], replicas=config.replicas,
                    timeout_s=float(ident.get("start_timeout_s", 300.0)))
    summary = trainer.run()
    callback.flush()
    summary.update(replica=replica, restarts=restart, rejoined_at=trainer.rejoined_at,
                   round_waits_s=trainer.sync.waits_s, device=str(device),
                   versions=_versions(device), data_digest=trainer.data.digest())
    save_global_weights(out / MODEL_FILE, trainer.sync.global_weights)
    write_json_atomic(out / "summary.json", summary)
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

"""The outer round of one replica process: upload, wait until the deadline, agree, apply.

`ReplicaSync` is the simulator's round (`crucible.sync.OuterSync`) in a process that holds one
replica (its model has one replica row): it encodes only its own pseudo-gradients (the batched
encoder on that one row, bit-for-bit the simulator's row) and uploads them create-only; then,
stage by stage, it waits until every contribution the fault plan expects is in the store (less
those of peers whose heartbeat lease says they are gone, `liveness.PeerWatch`), a manifest of
the round exists (another peer has agreed) or the round's deadline
(`sparseloco.round_timeout_s` after its first stage's upload) has passed, and agrees with
`late_ok`: a contribution that lands after another peer wrote the manifest is simply missing
from that round. Encoding, agreement, aggregation and the outer step are the simulator's code.

After each round the lowest replica in stage 0's agreed set writes the new global weights as a
snapshot (`<run>/global/<step:08d>`); a restarted replica starts from the newest snapshot and
replays the agreed rounds after it (`catch_up`), so it holds the weights every peer holds.
"""
from __future__ import annotations

import io
import logging
import time

import torch

from crucible.config import Config
from crucible.distributed.liveness import PeerWatch
from crucible.gather import MAX_MANIFESTS, contribution_key, load_agreed, manifest_key
from crucible.manifest import Manifest, manifest_events, manifest_limit
from crucible.pipeline import ReplicatedPipeline
from crucible.store import InvalidObject, KeyNotFound, ObjectTooLarge, Store
from crucible.sync import OuterSync, StageSyncResult

__all__ = ["ReplicaSync", "snapshot_key", "stage_snapshot_key"]

log = logging.getLogger(__name__)
_POLL_S = 0.02


def snapshot_key(run: str, global_step: int) -> str:
    """Key of the global weights after `global_step`'s outer round."""
    return f"{run}/global/{global_step:08d}"


def stage_snapshot_key(run: str, stage: int, global_step: int) -> str:
    """Key of one stage's global weights after `global_step`'s round (the pipeline mode)."""
    return f"{run}/global/stage-{stage}/{global_step:08d}"


class ReplicaSync(OuterSync):
    """`OuterSync` holding one replica row: its own contribution, created only if absent, the
    wait for the peers' (`_await_peers`), late ones refused (`late_ok`), this replica's part of
    the round's results (`_report`) and the snapshot after the round (`_round_over`)."""

    create_only = True
    late_ok = True

    def __init__(self, config: Config, model: ReplicatedPipeline, *, store: Store, run_key: str,
                 replica: int, stages: list[int] | None = None) -> None:
        """`stages`: the stages this process holds (all by default; a stage process of the
        pipeline mode holds one, and its snapshots are that stage's, `snapshot_prefix`)."""
        super().__init__(config, model, store=store, run_key=run_key, replicas=[replica],
                         stages=stages)
        self.replica = replica
        self.timeout_s = config.sparseloco.round_timeout_s
        self.waits_s: list[float] = []       # per round: time spent waiting for peers
        self.watch: PeerWatch | None = None  # the peers' leases (the worker sets it)
        self._deadline = 0.0

    # -- one round: what differs from the simulator's ---------------------------------------------
    def _await_peers(self, global_step: int, stage: int, made: list[int]) -> None:
        """Poll the store until every expected contribution still worth waiting for is in (with
        a `watch`, a peer known to be gone is not: `crucible.distributed.liveness`), a manifest
        of the round exists or the round's deadline (`sparseloco.round_timeout_s` after this
        replica's first stage is uploaded) has passed; the wait is added to `waits_s`."""
        started = time.monotonic()
        if stage == self.stages[0]:
            self._deadline = started + self.timeout_s
            self.waits_s.append(0.0)
        manifest = manifest_key(self.run_key, global_step, stage)
        prefix = manifest.rsplit("/", 1)[0] + "/"
        while True:
            present = set(self.store.sizes(prefix))
            if manifest in present or time.monotonic() >= self._deadline:
                break
            if self.watch is not None:
                self.watch.refresh()
            wanted = {contribution_key(self.run_key, global_step, stage, r) for r in made
                      if r == self.replica or self.watch is None
                      or self.watch.waits_for(r, global_step)}
            if wanted <= present:
                break
            time.sleep(_POLL_S)
        self.waits_s[-1] += time.monotonic() - started

    def _report(self, result: StageSyncResult, manifest: Manifest, made: list[int]) -> None:
        """Only what happened to this replica's contribution (the run's totals are the sum over
        the processes); every peer walks the same manifest keys, so the merge keeps one
        `manifest_rejected` event per id."""
        mine = self.replica
        if mine in manifest.included or any(x.replica == mine for x in manifest.rejected):
            result.made.append(mine)
        else:
            result.missing.append(mine)
        result.rejected = {x.replica: x.reason for x in manifest.rejected if x.replica == mine}
        result.manifest_events = [e for e in manifest_events(manifest)
                                  if e.kind == "manifest_rejected"]

    def _round_over(self, global_step: int, manifests: list[Manifest]) -> None:
        if self.watch is not None:
            self.watch.round_over(global_step)
        self._maybe_snapshot(global_step, manifests[0].included)

    # -- snapshots and catching up ---------------------------------------------------------------
    def _maybe_snapshot(self, global_step: int, included: list[int]) -> None:
        if included and self.replica != min(included):
            return   # one writer per round; without one (nobody agreed), every peer tries
        buffer = io.BytesIO()
        torch.save([{n: t.detach().cpu() for n, t in w.items()} for w in self.global_weights],
                   buffer)
        self.store.put_if_absent(self._snapshot_key(global_step), buffer.getvalue())

    def _snapshot_key(self, global_step: int) -> str:
        """Where this process's snapshots go: the run's (every stage), or one stage's."""
        if len(self.stages) == self.config.pipeline.stages:
            return snapshot_key(self.run_key, global_step)
        return stage_snapshot_key(self.run_key, self.stages[0], global_step)

    def catch_up(self, *, through: int = -1, timeout_s: float = 0.0) -> int:
        """Restore the global weights of the newest round the store has agreed: the newest
        snapshot, then every later round whose manifests all exist, replayed. First waits (up
        to `timeout_s`) until round `through` is agreed: a replica killed in that round does
        not contribute to it. Returns the next global step to train."""
        held = self.stages
        deadline = time.monotonic() + timeout_s
        while through >= 0 and time.monotonic() < deadline and not all(
                self.store.exists(manifest_key(self.run_key, through, s)) for s in held):
            time.sleep(_POLL_S * 5)
        prefix = self._snapshot_key(0).rsplit("/", 1)[0] + "/"
        snapshots = sorted(k for k in self.store.list(prefix) if "/" not in k[len(prefix):])
        start = 0
        if snapshots:
            key = snapshots[-1]
            stages = torch.load(io.BytesIO(self.store.get(key)), weights_only=True)
            for ours, theirs in zip(self.global_weights, stages, strict=True):
                for n, t in ours.items():
                    t.copy_(theirs[n])
            start = int(key.rsplit("/", 1)[1]) + 1
        g = start
        while True:
            keys = [manifest_key(self.run_key, g, s) for s in held]
            if not all(self.store.exists(k) for k in keys):
                break
            for stage in held:
                self._apply(stage, self._replayed(g, stage))
            g += 1
        for stage in held:
            self.model.set_stage(stage, self.global_weights[stage])
        log.info("replica %d caught up: snapshot %d, replayed to global step %d", self.replica,
                 start - 1, g)
        return g

    def _replayed(self, global_step: int, stage: int) -> Manifest:
        """The manifest the peers agreed for a past round: the first versioned key holding a
        manifest that parses and whose agreed blobs are all there, unchanged and valid (with
        honest peers, `manifest.json`). Simpler than `agree`'s walk: a forged manifest that
        passes these checks but differs from the peers' derivation would be followed."""
        limit = manifest_limit(self.config.replicas)
        for version in range(MAX_MANIFESTS):
            key = manifest_key(self.run_key, global_step, stage, version=version)
            try:
                manifest = Manifest.from_json(self.store.get(key, max_bytes=limit))
                load_agreed(self.store, manifest, self._decoder(global_step, stage))
            except KeyNotFound:
                break
            except (ValueError, ObjectTooLarge, InvalidObject) as exc:
                log.warning("replay: passing over %r: %s", key, exc)
                continue
            return manifest
        raise RuntimeError(f"no usable manifest for global step {global_step} stage {stage} "
                           "in the store: this replica cannot restore the global weights")

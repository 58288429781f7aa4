"""The outer round of one replica process: upload, wait until the deadline, agree, apply.

`ReplicaSync` is `crucible.sync.OuterSync` for a process that holds one replica (its model has
one replica row): it encodes only its own pseudo-gradients (with `encode_contributions_batched`
for that one replica, which is bit-for-bit the simulator's row), uploads every stage's blob
first, then, stage by stage, waits until every contribution the fault plan expects is in the
store (less those of peers whose heartbeat lease says they are gone, `liveness.PeerWatch`),
a manifest of the round exists (another peer has agreed) or the round's deadline
(`sparseloco.round_timeout_s` after the uploads) has passed, and agrees with
`gather.agree(..., late_ok=True)`: a contribution that lands after another peer wrote the
manifest is simply missing from that round. Aggregation and the outer step are the simulator's.

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
from crucible.gather import (
    MAX_MANIFESTS,
    agree,
    contribution_key,
    load_agreed,
    manifest_key,
)
from crucible.manifest import Manifest, manifest_events, manifest_limit
from crucible.pipeline import ReplicatedPipeline
from crucible.sparseloco.codec import encode_contributions_batched
from crucible.store import InvalidObject, KeyNotFound, ObjectTooLarge, Store
from crucible.sync import OuterSync, StageSyncResult

__all__ = ["ReplicaSync", "snapshot_key"]

log = logging.getLogger(__name__)
_POLL_S = 0.02


def snapshot_key(run: str, global_step: int) -> str:
    """Key of the global weights after `global_step`'s outer round."""
    return f"{run}/global/{global_step:08d}"


class ReplicaSync(OuterSync):
    """Global weights, this replica's error buffers and the outer optimisers, in one process."""

    def __init__(self, config: Config, model: ReplicatedPipeline, *, store: Store, run_key: str,
                 replica: int) -> None:
        super().__init__(config, model, store=store, run_key=run_key)
        assert model.R == 1, "a replica process holds one replica row"
        self.replica = replica
        self.timeout_s = config.sparseloco.round_timeout_s
        # one error buffer row: this replica's (the base class holds R rows)
        self.errors = [{n: buf[:1].clone() for n, buf in errors.items()} for errors in self.errors]
        self.waits_s: list[float] = []       # per round: time spent waiting for peers
        self.watch: PeerWatch | None = None  # the peers' leases (the worker sets it)

    # -- one round -------------------------------------------------------------------------------
    def synchronise(self, global_step: int, contributes: torch.Tensor) -> list[StageSyncResult]:
        """The outer round; `contributes` (R, S) is the fault plan's, for every replica. Returns,
        per stage, what happened to this replica's contribution only (the run's totals are the
        sum over the processes)."""
        S = self.config.pipeline.stages
        results = [StageSyncResult(stage=s) for s in range(S)]
        with self._transfers() as pool:  # a stage uploads while the next one encodes
            uploads = {}
            for stage in range(S):
                if bool(contributes[self.replica, stage]):
                    with self._phase("encode"):
                        blob = self._encode_own(global_step, stage)
                    # create only: a process killed after uploading and restarted into the
                    # same round must not replace a blob a peer may already have agreed on
                    uploads[stage] = pool.submit(self._upload, global_step, stage, self.replica,
                                                 blob, if_absent=True)
                    results[stage].upload_bytes = len(blob)
                    results[stage].dense_bytes = 4 * sum(
                        t.numel() for t in self.global_weights[stage].values())
            with self._phase("upload_wait"):
                for stage, future in uploads.items():
                    seconds, written = future.result()
                    self.codec_s["upload"] += seconds
                    if not written:
                        log.warning("step %d stage %d: this replica's contribution exists "
                                    "(uploaded before a restart); it stands", global_step, stage)
        deadline = time.monotonic() + self.timeout_s
        waited = 0.0
        agreed = []
        for stage in range(S):
            made = [r for r in range(self.config.replicas) if bool(contributes[r, stage])]
            waited += self._wait(global_step, stage, made, deadline)
            manifest = self._agree(global_step, stage, made)
            self._apply(stage, manifest)
            results[stage].applied = bool(manifest.included)
            # every peer walks the same manifest keys: the merge keeps one event per id
            results[stage].manifest_events = [e for e in manifest_events(manifest)
                                              if e.kind == "manifest_rejected"]
            mine = self.replica
            if mine in manifest.included or any(x.replica == mine for x in manifest.rejected):
                results[stage].made.append(mine)
            else:
                results[stage].missing.append(mine)
            results[stage].rejected = {x.replica: x.reason for x in manifest.rejected
                                       if x.replica == mine}
            agreed.append(manifest)
        self.waits_s.append(waited)
        if self.watch is not None:
            self.watch.round_over(global_step)
        self._maybe_snapshot(global_step, agreed[0].included)
        return results

    def _encode_own(self, global_step: int, stage: int) -> bytes:
        """This replica's blob for `stage`, encoded on the weights' device."""
        weights = self.model.stage_params(stage)
        delta = {n: (g - weights[n].detach()).float()                 # (1, ...)
                 for n, g in self.global_weights[stage].items()}
        errors = self.errors[stage]
        sl = self.config.sparseloco
        blobs, new_error = encode_contributions_batched(
            delta, errors, beta=sl.beta, stage=stage, replicas=[self.replica],
            global_step=global_step, chunk=sl.chunk, topk=sl.topk, run_tag=self.run_tag)
        for n in errors:
            errors[n] = new_error[n]
        return blobs[0]

    def _wait(self, global_step: int, stage: int, made: list[int], deadline: float) -> float:
        """Poll the store until every expected contribution still worth waiting for is in (with
        a `watch`, a peer known to be gone is not: `crucible.distributed.liveness`), a manifest
        of the round exists or the deadline has passed; returns the seconds waited."""
        started = time.monotonic()
        manifest = manifest_key(self.run_key, global_step, stage)
        prefix = manifest.rsplit("/", 1)[0] + "/"
        while True:
            present = set(self.store.sizes(prefix))
            if manifest in present or time.monotonic() >= deadline:
                return time.monotonic() - started
            if self.watch is not None:
                self.watch.refresh()
            wanted = {contribution_key(self.run_key, global_step, stage, r) for r in made
                      if r == self.replica or self.watch is None
                      or self.watch.waits_for(r, global_step)}
            if wanted <= present:
                return time.monotonic() - started
            time.sleep(_POLL_S)

    def _agree(self, global_step: int, stage: int, made: list[int]) -> Manifest:
        idle = {r: (f"the run's fault plan has replica {r} idle at stage {stage} in global step "
                    f"{global_step}: it trained nothing, so this object is not its contribution")
                for r in range(self.config.replicas) if r not in made}
        return agree(self.store, self.run_key, global_step, stage, expected_replicas=made,
                     idle=idle, decode=self._decoder(global_step, stage),
                     max_blob_bytes=self.max_blob_bytes[stage],
                     decode_many=self._batch_decoder(global_step, stage),
                     max_norm_ratio=self.config.sparseloco.max_norm_ratio, late_ok=True)

    def _apply(self, stage: int, manifest: Manifest) -> None:
        """The outer step of `stage` with the agreed set; every replica row takes the result."""
        contributions = load_agreed(self.store, manifest,
                                    self._decoder(manifest.global_step, stage))
        if contributions:
            self._outer_step(stage, contributions)
        self.model.set_stage(stage, self.global_weights[stage])

    # -- snapshots and catching up ---------------------------------------------------------------
    def _maybe_snapshot(self, global_step: int, included: list[int]) -> None:
        if included and self.replica != min(included):
            return   # one writer per round; without one (nobody agreed), every peer tries
        buffer = io.BytesIO()
        torch.save([{n: t.detach().cpu() for n, t in w.items()} for w in self.global_weights],
                   buffer)
        self.store.put_if_absent(snapshot_key(self.run_key, global_step), buffer.getvalue())

    def catch_up(self, *, through: int = -1, timeout_s: float = 0.0) -> int:
        """Restore the global weights of the newest round the store has agreed: the newest
        snapshot, then every later round whose manifests all exist, replayed. First waits (up
        to `timeout_s`) until round `through` is agreed: a replica killed in that round does
        not contribute to it. Returns the next global step to train."""
        S = self.config.pipeline.stages
        deadline = time.monotonic() + timeout_s
        while through >= 0 and time.monotonic() < deadline and not all(
                self.store.exists(manifest_key(self.run_key, through, s)) for s in range(S)):
            time.sleep(_POLL_S * 5)
        snapshots = sorted(self.store.list(f"{self.run_key}/global/"))
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
            keys = [manifest_key(self.run_key, g, s) for s in range(S)]
            if not all(self.store.exists(k) for k in keys):
                break
            for stage in range(S):
                self._apply(stage, self._replayed(g, stage))
            g += 1
        for stage in range(S):
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

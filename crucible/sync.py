"""The outer synchronisation of one global step, stage by stage, through the object store.

For every stage s: each replica whose stage trained this round encodes its pseudo-gradient
`theta_global - theta_r` (SparseLoCo: error feedback, top-k, 2 bits; DiLoCo: dense fp32) and
uploads it; the agreed set is fixed once in a manifest; every peer aggregates exactly that set;
the outer SGD step updates the global weights; every replica of the stage, including a passive
(failed) one, takes the new global weights. `ddp` has no outer round: its gradients are averaged
every inner step, and here only the global copy is refreshed.

What the gather is told (`crucible.gather`): the replicas the fault plan has training the stage
(any object in another replica's slot is rejected), the run's tag (written into every blob's
header), the exact size of a valid blob of the stage (a larger object is refused unread) and
`sparseloco.max_norm_ratio`. With `store.keep_rounds` = N > 0 the objects of rounds older than
the last N are deleted after each round.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from crucible import boundary
from crucible.config import Config
from crucible.errors import TrainingDiverged
from crucible.events import Event
from crucible.gather import agree, load_agreed, prune_rounds, upload_contribution
from crucible.manifest import manifest_events
from crucible.pipeline import ReplicatedPipeline
from crucible.sparseloco import (
    OuterSGD,
    aggregate,
    contribution_bytes,
    decode_contribution,
    decode_contributions,
    decode_dense,
    dense_bytes,
    encode_dense,
    run_tag,
)
from crucible.sparseloco.codec import encode_contributions_batched
from crucible.store import Store

__all__ = ["StageSyncResult", "OuterSync"]

log = logging.getLogger(__name__)


@dataclass
class StageSyncResult:
    stage: int
    made: list[int] = field(default_factory=list)             # replicas that uploaded
    missing: list[int] = field(default_factory=list)          # replicas that did not
    rejected: dict[int, str] = field(default_factory=dict)    # replica -> reason
    upload_bytes: int = 0
    dense_bytes: int = 0
    applied: bool = False
    manifest_events: list[Event] = field(default_factory=list)  # manifest_rejected events


class OuterSync:
    """Holds the global weights, the error buffers and the outer optimisers of every stage."""

    def __init__(self, config: Config, model: ReplicatedPipeline, *, store: Store, run_key: str) -> None:
        self.config, self.model, self.store, self.run_key = config, model, store, run_key
        self.method = config.sparseloco.method
        self.run_tag = run_tag(run_key)
        S, R = config.pipeline.stages, config.replicas
        self.global_weights = [model.replica_weights(replica=0, stage=s) for s in range(S)]
        self.shapes = [{n: tuple(t.shape) for n, t in w.items()} for w in self.global_weights]
        sl = config.sparseloco
        self.max_blob_bytes = [dense_bytes(shapes) if self.method == "diloco" else
                               contribution_bytes(shapes, chunk=sl.chunk, topk=sl.topk)
                               for shapes in self.shapes]
        # error buffers (R, ...) per stage and parameter, fp32, on the training device
        self.errors = [{n: torch.zeros((R, *t.shape), dtype=torch.float32, device=t.device)
                        for n, t in w.items()} for w in self.global_weights]
        momentum = config.sparseloco.outer_momentum if self.method == "diloco" else 0.0
        self.codec_s = {"encode": 0.0, "decode": 0.0}
        self.outer = [OuterSGD(lr=config.sparseloco.resolved_outer_lr, momentum=momentum,
                               nesterov=momentum > 0) for _ in range(S)]

    def reset_error(self, *, replica: int, stage: int) -> None:
        for buf in self.errors[stage].values():
            buf[replica].zero_()

    def param_count(self) -> int:
        return sum(t.numel() for w in self.global_weights for t in w.values())

    # -- one round -------------------------------------------------------------------------------
    def synchronise(self, global_step: int, contributes: torch.Tensor) -> list[StageSyncResult]:
        """Run the outer round for every stage; `contributes` (R, S) says which stage-replicas
        trained this round and so upload a contribution."""
        results = []
        for stage in range(self.config.pipeline.stages):
            if self.method == "ddp":
                results.append(self._ddp_refresh(stage, contributes[:, stage]))
            else:
                results.append(self._sync_stage(global_step, stage, contributes[:, stage]))
        keep = self.config.store.keep_rounds
        if keep and self.method != "ddp":
            prune_rounds(self.store, self.run_key, keep_from=global_step + 1 - keep)
        return results

    def _sync_stage(self, global_step: int, stage: int, contributes: torch.Tensor) -> StageSyncResult:
        result = StageSyncResult(stage=stage)
        dense_per = 4 * sum(t.numel() for t in self.global_weights[stage].values())
        made = [r for r in range(self.config.replicas) if bool(contributes[r])]
        idle = {r: (f"the run's fault plan has replica {r} idle at stage {stage} in global step "
                    f"{global_step} (down, or dropped with its replica): it trained nothing, so "
                    "this object is not its contribution")
                for r in range(self.config.replicas) if r not in made}
        started = time.perf_counter()
        blobs = self._encode(global_step, stage, made) if made else []
        self.codec_s["encode"] += time.perf_counter() - started
        for replica, blob in zip(made, blobs, strict=True):
            upload_contribution(self.store, self.run_key, global_step, stage, replica, blob)
            result.made.append(replica)
            result.upload_bytes += len(blob)
            result.dense_bytes += dense_per
        decode = self._decoder(global_step, stage)
        manifest = agree(self.store, self.run_key, global_step, stage, expected_replicas=made,
                         idle=idle, decode=decode, max_blob_bytes=self.max_blob_bytes[stage],
                         decode_many=self._batch_decoder(global_step, stage),
                         max_norm_ratio=self.config.sparseloco.max_norm_ratio)
        result.missing = sorted(set(idle) | set(manifest.missing))
        result.rejected = {r.replica: r.reason for r in manifest.rejected}
        result.manifest_events = [e for e in manifest_events(manifest)
                                  if e.kind == "manifest_rejected"]
        contributions = load_agreed(self.store, manifest, decode)
        if contributions:
            mode = self.config.sparseloco.aggregate
            update = aggregate(contributions, self.shapes[stage], mode=mode,
                               clip=self.method == "sparseloco",
                               granularity=self.config.sparseloco.clip_granularity)
            device = next(iter(self.global_weights[stage].values())).device
            self.outer[stage].step(self.global_weights[stage],
                                   {n: u.to(device) for n, u in update.items()})
            self._retract(stage)
            result.applied = True
        self.model.set_stage(stage, self.global_weights[stage])
        return result

    def _encode(self, global_step: int, stage: int, replicas: list[int]) -> list[bytes]:
        """One blob per replica in `replicas` (ascending); SparseLoCo encodes them all in one
        batched call and writes their new error buffers back."""
        everyone = replicas == list(range(self.config.replicas))
        idx = torch.tensor(replicas, dtype=torch.int64)
        weights = self.model.stage_params(stage)

        def rows(t: torch.Tensor) -> torch.Tensor:  # the contributing replicas' rows of (R, ...)
            return t if everyone else t[idx.to(t.device)]

        # pseudo-gradients (R', ...): theta_global - theta_r of every contributing replica
        delta = {n: (g - rows(weights[n].detach())).float().cpu()
                 for n, g in self.global_weights[stage].items()}
        if self.method == "diloco":
            try:
                return [encode_dense({n: d[i] for n, d in delta.items()}, stage=stage,
                                     replica=r, global_step=global_step, run_tag=self.run_tag)
                        for i, r in enumerate(replicas)]
            except ValueError as exc:
                raise TrainingDiverged(str(exc)) from exc
        sl = self.config.sparseloco
        errors = self.errors[stage]
        error = {n: rows(buf).cpu() for n, buf in errors.items()}
        try:
            blobs, new_error = encode_contributions_batched(
                delta, error, beta=sl.beta, stage=stage, replicas=replicas,
                global_step=global_step, chunk=sl.chunk, topk=sl.topk, run_tag=self.run_tag)
        except ValueError as exc:  # a non-finite pseudo-gradient: the replica diverged
            raise TrainingDiverged(str(exc)) from exc
        for n, buf in errors.items():
            if everyone and buf.device == new_error[n].device:
                errors[n] = new_error[n]   # fresh tensors the encoder made: adopt, no copy
            else:
                buf[idx.to(buf.device)] = new_error[n].to(buf.device)
        return blobs

    def _decoder(self, global_step: int, stage: int):
        shapes, sl = self.shapes[stage], self.config.sparseloco

        def decode(blob: bytes):
            if self.method == "diloco":
                return decode_dense(blob, shapes, stage=stage, global_step=global_step)
            return decode_contribution(blob, shapes, stage=stage, global_step=global_step,
                                       chunk=sl.chunk, topk=sl.topk)

        return self._timed_decode(decode)

    def _batch_decoder(self, global_step: int, stage: int):
        """All of a round's sparse blobs in one call (None for dense: one blob at a time)."""
        if self.method != "sparseloco":
            return None
        shapes, sl = self.shapes[stage], self.config.sparseloco

        def decode_many(blobs):
            return decode_contributions(blobs, shapes, stage=stage, global_step=global_step,
                                        chunk=sl.chunk, topk=sl.topk)

        return self._timed_decode(decode_many)

    def _timed_decode(self, fn):
        """`fn` with its time added to the run's decode total."""
        def timed(arg):
            started = time.perf_counter()
            try:
                return fn(arg)
            finally:
                self.codec_s["decode"] += time.perf_counter() - started

        return timed

    def _retract(self, stage: int) -> None:
        weights = self.global_weights[stage]
        if "basis" in weights:  # MAPL: back onto the Stiefel manifold after the outer step
            steps = self.config.pipeline.mapl_ns_steps
            weights["basis"].copy_(boundary.retract(weights["basis"][None], steps)[0])

    def _ddp_refresh(self, stage: int, trained: torch.Tensor) -> StageSyncResult:
        # ddp replicas that trained hold identical weights (same averaged gradients each step)
        result = StageSyncResult(stage=stage, applied=bool(trained.any()))
        result.made = [r for r in range(self.config.replicas) if bool(trained[r])]
        result.missing = [r for r in range(self.config.replicas) if not bool(trained[r])]
        if result.applied:
            source = int(torch.nonzero(trained)[0])
            self.global_weights[stage] = self.model.replica_weights(replica=source, stage=stage)
        self.model.set_stage(stage, self.global_weights[stage])
        return result

    def state_dict(self) -> dict[str, object]:
        return {"global_weights": self.global_weights, "errors": self.errors,
                "codec_s": dict(self.codec_s),
                "outer": [o.state_dict() for o in self.outer]}

    def load_state_dict(self, state: dict[str, object]) -> None:
        self.global_weights = [{n: t.clone() for n, t in w.items()} for w in state["global_weights"]]  # type: ignore[union-attr]
        self.errors = [{n: t.clone() for n, t in e.items()} for e in state["errors"]]  # type: ignore[union-attr]
        self.codec_s = dict(state.get("codec_s", self.codec_s))  # type: ignore[arg-type]
        for opt, st in zip(self.outer, state["outer"], strict=True):  # type: ignore[arg-type]
            opt.load_state_dict(st)

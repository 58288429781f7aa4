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

Where it runs: the whole round stays on the device that holds the weights (pseudo-gradients,
error feedback, top-k, quantisation, decoding, validation of the decoded values, clipping,
aggregation and the outer step); only the packed blobs cross to the host, for the store. Every
stage is encoded and handed to `transfer_threads` upload threads first, so a stage's uploads run
beside the next stage's encoding; each stage's round then waits for its own uploads before it
agrees, so what is aggregated is exactly what it was with the uploads inline. `codec_s` times
the phases: `encode`, `upload` (the threads' own time), `upload_wait` (the part of it the round
waited for: what overlap did not hide), `decode`, `aggregate` and `outer`.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from crucible import boundary
from crucible.config import Config
from crucible.errors import TrainingDiverged
from crucible.events import Event
from crucible.gather import agree, load_agreed, prune_rounds, upload_contribution
from crucible.manifest import Manifest, manifest_events
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

__all__ = ["StageSyncResult", "OuterSync", "TRANSFER_THREADS", "PHASES"]

log = logging.getLogger(__name__)

# store uploads in flight at once beside the round's compute (0: inline, one after another)
TRANSFER_THREADS = 4
# the round's phases `OuterSync.codec_s` times (the run summary's `timing.<phase>_s`)
PHASES = ("encode", "upload", "upload_wait", "decode", "aggregate", "outer")


class _Deferred:
    """A call that runs when its result is first asked for: an upload without a thread runs
    when the round waits for it, so `upload_wait` is its whole time."""

    def __init__(self, fn: Callable[..., Any], args: tuple, kwargs: dict[str, Any]) -> None:
        self._call, self._ran, self._value = (fn, args, kwargs), False, None

    def result(self) -> Any:
        if not self._ran:
            fn, args, kwargs = self._call
            self._value, self._ran = fn(*args, **kwargs), True
        return self._value


class _Inline:
    """The executor of `transfer_threads = 0`: every call deferred to its `result()`."""

    def submit(self, fn: Callable[..., Any], *args: object, **kwargs: Any) -> _Deferred:
        return _Deferred(fn, args, kwargs)


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

    # what a subclass that runs beside peers in other processes changes (crucible.distributed):
    # a contribution is created only if absent (a restarted process must not replace a blob a
    # peer may have agreed on), and one that lands after a peer wrote the manifest is late
    create_only = False
    late_ok = False

    def __init__(self, config: Config, model: ReplicatedPipeline, *, store: Store, run_key: str,
                 transfer_threads: int = TRANSFER_THREADS,
                 replicas: list[int] | None = None, stages: list[int] | None = None) -> None:
        """`replicas`: the replicas whose rows `model` holds, in row order (all R by default;
        a replica process holds one); `stages`: the stages it holds (all S by default; a stage
        process of the pipeline mode holds one). A stage not held has no global weights here
        (an empty dict) and takes no part in the round."""
        if transfer_threads < 0:
            raise ValueError(f"transfer_threads must be >= 0, got {transfer_threads}")
        self.config, self.model, self.store, self.run_key = config, model, store, run_key
        self.transfer_threads = transfer_threads
        self.method = config.sparseloco.method
        self.run_tag = run_tag(run_key)
        S = config.pipeline.stages
        held = list(range(config.replicas)) if replicas is None else list(replicas)
        if len(held) != model.R:
            raise ValueError(f"the model holds {model.R} replica rows, not {len(held)}")
        self.rows = {replica: row for row, replica in enumerate(held)}   # replica -> its row
        self.stages = list(range(S)) if stages is None else sorted(stages)
        self.global_weights = [model.replica_weights(replica=0, stage=s) if s in self.stages
                               else {} for s in range(S)]
        self.shapes = [{n: tuple(t.shape) for n, t in w.items()} for w in self.global_weights]
        sl = config.sparseloco
        self.max_blob_bytes = [dense_bytes(shapes) if self.method == "diloco" else
                               contribution_bytes(shapes, chunk=sl.chunk, topk=sl.topk)
                               for shapes in self.shapes]
        # error buffers (rows, ...) per stage and parameter, fp32, on the training device
        self.errors = [{n: torch.zeros((len(held), *t.shape), dtype=torch.float32,
                                       device=t.device)
                        for n, t in w.items()} for w in self.global_weights]
        momentum = config.sparseloco.outer_momentum if self.method == "diloco" else 0.0
        self.device = next(iter(self.global_weights[self.stages[0]].values())).device
        self.codec_s = dict.fromkeys(PHASES, 0.0)
        self.outer = [OuterSGD(lr=config.sparseloco.resolved_outer_lr, momentum=momentum,
                               nesterov=momentum > 0) for _ in range(S)]

    def reset_error(self, *, replica: int, stage: int) -> None:
        for buf in self.errors[stage].values():
            buf[self.rows[replica]].zero_()

    def param_count(self) -> int:
        return sum(t.numel() for w in self.global_weights for t in w.values())

    # -- one round -------------------------------------------------------------------------------
    def synchronise(self, global_step: int, contributes: torch.Tensor) -> list[StageSyncResult]:
        """Run the outer round for every stage; `contributes` (R, S) says which stage-replicas
        trained this round and so upload a contribution (this object uploads those of the
        replicas it holds). Every stage is encoded and its uploads handed to the transfer
        threads first; then, stage by stage: its own uploads are waited for, the peers
        (`_await_peers`), the agreed set is fixed, aggregated and applied."""
        stages = self.stages
        if self.method == "ddp":
            return [self._ddp_refresh(stage, contributes[:, stage]) for stage in stages]
        results = {stage: StageSyncResult(stage=stage) for stage in stages}
        # per stage, the replicas that trained it this round and so contribute, ascending
        made = {stage: [r for r in range(self.config.replicas) if bool(contributes[r, stage])]
                for stage in stages}
        manifests = []
        with self._transfers() as pool:  # leaving it waits for every upload, even on an error
            pending = {stage: self._encode_and_upload(pool, global_step, stage,
                                                      [r for r in made[stage] if r in self.rows],
                                                      results[stage]) for stage in stages}
            for stage in stages:
                with self._phase("upload_wait"):
                    for future in pending[stage]:
                        seconds, written = future.result()   # an upload's error is raised here
                        self.codec_s["upload"] += seconds
                        if not written:
                            log.warning("step %d stage %d: a contribution exists already "
                                        "(uploaded before a restart); it stands", global_step,
                                        stage)
                self._await_peers(global_step, stage, made[stage])
                manifest = self._agree(global_step, stage, made[stage])
                results[stage].applied = self._apply(stage, manifest)
                self._report(results[stage], manifest, made[stage])
                manifests.append(manifest)
        keep = self.config.store.keep_rounds
        if keep:
            prune_rounds(self.store, self.run_key, keep_from=global_step + 1 - keep)
        self._round_over(global_step, manifests)
        return [results[stage] for stage in stages]

    # -- what a round beside peers in other processes changes (no-ops here) -----------------------
    def _await_peers(self, global_step: int, stage: int, made: list[int]) -> None:
        """Before `stage` is agreed: every contribution was made here, so nothing to wait for."""

    def _round_over(self, global_step: int, manifests: list[Manifest]) -> None:
        """After every stage of the round is applied."""

    def _report(self, result: StageSyncResult, manifest: Manifest, made: list[int]) -> None:
        """What `result` says of the stage: every replica's contribution, held here."""
        result.made = list(made)
        result.missing = sorted({r for r in range(self.config.replicas) if r not in made}
                                | set(manifest.missing))
        result.rejected = {r.replica: r.reason for r in manifest.rejected}
        result.manifest_events = [e for e in manifest_events(manifest)
                                  if e.kind == "manifest_rejected"]

    @contextmanager
    def _transfers(self) -> Iterator[ThreadPoolExecutor | _Inline]:
        if not self.transfer_threads:
            yield _Inline()
            return
        pool = ThreadPoolExecutor(max_workers=self.transfer_threads,
                                  thread_name_prefix="crucible-upload")
        try:
            yield pool
        except BaseException:
            # the round failed: uploads not started yet are dropped, the running ones finish
            pool.shutdown(wait=True, cancel_futures=True)
            raise
        pool.shutdown(wait=True)

    @contextmanager
    def _phase(self, name: str) -> Iterator[None]:
        """Add the block's time to `codec_s[name]`; on a GPU, the work it queued is waited for,
        so each phase is charged its own kernels."""
        started = time.perf_counter()
        try:
            yield
        finally:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self.codec_s[name] += time.perf_counter() - started

    def _upload(self, global_step: int, stage: int, replica: int, blob: bytes, *,
                if_absent: bool = False) -> tuple[float, bool]:
        """Upload one blob (on a transfer thread; `if_absent`: create only, see
        `gather.upload_contribution`); returns the seconds it took and whether it was written."""
        started = time.perf_counter()
        written = upload_contribution(self.store, self.run_key, global_step, stage, replica,
                                      blob, if_absent=if_absent) is not None
        return time.perf_counter() - started, written

    def _encode_and_upload(self, pool: ThreadPoolExecutor | _Inline, global_step: int,
                           stage: int, made: list[int],
                           result: StageSyncResult) -> list[Future | _Deferred]:
        """Encode the contributions of the replicas in `made` (held here) and hand each blob to
        `pool`; returns the uploads."""
        with self._phase("encode"):
            blobs = self._encode(global_step, stage, made) if made else []
        dense_per = 4 * sum(t.numel() for t in self.global_weights[stage].values())
        uploads = []
        for replica, blob in zip(made, blobs, strict=True):
            uploads.append(pool.submit(self._upload, global_step, stage, replica, blob,
                                       if_absent=self.create_only))
            result.upload_bytes += len(blob)
            result.dense_bytes += dense_per
        return uploads

    def _agree(self, global_step: int, stage: int, made: list[int]) -> Manifest:
        """Fix the stage's agreed set among the replicas in `made` (`gather.agree`)."""
        idle = {r: (f"the run's fault plan has replica {r} idle at stage {stage} in global step "
                    f"{global_step} (down, or dropped with its replica): it trained nothing, so "
                    "this object is not its contribution")
                for r in range(self.config.replicas) if r not in made}
        return agree(self.store, self.run_key, global_step, stage, expected_replicas=made,
                     idle=idle, decode=self._decoder(global_step, stage),
                     max_blob_bytes=self.max_blob_bytes[stage],
                     decode_many=self._batch_decoder(global_step, stage),
                     max_norm_ratio=self.config.sparseloco.max_norm_ratio, late_ok=self.late_ok)

    def _apply(self, stage: int, manifest: Manifest) -> bool:
        """Aggregate the agreed set and take the outer step; every replica row of the stage then
        holds the new global weights. True when anything was applied."""
        contributions = load_agreed(self.store, manifest,
                                    self._decoder(manifest.global_step, stage))
        if contributions:
            self._outer_step(stage, contributions)
        self.model.set_stage(stage, self.global_weights[stage])
        return bool(contributions)

    def _outer_step(self, stage: int, contributions: list) -> None:
        """Aggregate the agreed contributions on the weights' device and apply the outer step."""
        with self._phase("aggregate"):
            update = aggregate(contributions, self.shapes[stage],
                               mode=self.config.sparseloco.aggregate,
                               clip=self.method == "sparseloco",
                               granularity=self.config.sparseloco.clip_granularity,
                               device=self.device)
        with self._phase("outer"):
            self.outer[stage].step(self.global_weights[stage], update)
            self._retract(stage)

    def _encode(self, global_step: int, stage: int, replicas: list[int]) -> list[bytes]:
        """One blob per replica in `replicas` (ascending, held here); SparseLoCo encodes them all
        in one batched call and writes their new error buffers back."""
        rows = [self.rows[r] for r in replicas]
        everyone = rows == list(range(len(self.rows)))
        idx = torch.tensor(rows, dtype=torch.int64)
        weights = self.model.stage_params(stage)

        def held(t: torch.Tensor) -> torch.Tensor:  # the contributing replicas' rows
            return t if everyone else t[idx.to(t.device)]

        # pseudo-gradients (R', ...): theta_global - theta_r of every contributing replica, on
        # the weights' device (only a dense blob's values go to the host, to be written out)
        delta = {n: (g - held(weights[n].detach())).float()
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
        error = {n: held(buf) for n, buf in errors.items()}
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
                return decode_dense(blob, shapes, stage=stage, global_step=global_step,
                                    device=self.device)
            return decode_contribution(blob, shapes, stage=stage, global_step=global_step,
                                       chunk=sl.chunk, topk=sl.topk, device=self.device)

        return self._timed_decode(decode)

    def _batch_decoder(self, global_step: int, stage: int):
        """All of a round's sparse blobs in one call (None for dense: one blob at a time)."""
        if self.method != "sparseloco":
            return None
        shapes, sl = self.shapes[stage], self.config.sparseloco

        def decode_many(blobs):
            return decode_contributions(blobs, shapes, stage=stage, global_step=global_step,
                                        chunk=sl.chunk, topk=sl.topk, device=self.device)

        return self._timed_decode(decode_many)

    def _timed_decode(self, fn):
        """`fn` with its time added to the run's decode total."""
        def timed(arg):
            with self._phase("decode"):
                return fn(arg)

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
        """Restore from `state_dict`'s tensors wherever they were loaded (a checkpoint is read
        onto the CPU): the weights, error buffers and outer momentum go to this round's device."""
        def here(t: torch.Tensor) -> torch.Tensor:
            return t.to(self.device, copy=True)

        self.global_weights = [{n: here(t) for n, t in w.items()} for w in state["global_weights"]]  # type: ignore[union-attr]
        self.errors = [{n: here(t) for n, t in e.items()} for e in state["errors"]]  # type: ignore[union-attr]
        # a checkpoint from before the phases were split times only encode and decode
        self.codec_s = {**dict.fromkeys(PHASES, 0.0), **state.get("codec_s", {})}  # type: ignore[dict-item]
        for opt, st in zip(self.outer, state["outer"], strict=True):  # type: ignore[arg-type]
            opt.load_state_dict(st)
            opt.buffers = {n: b.to(self.device) for n, b in opt.buffers.items()}

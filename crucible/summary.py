"""Run accounting (tokens, inner steps, contributions, bytes, faults) and `summary.json`."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from crucible.config import Config
from crucible.events import Callback, Event
from crucible.runfiles import git_sha as _git_sha
from crucible.runfiles import write_bytes_atomic, write_json_atomic

# torch (and the modules that need it) load with the first RunCounters call, not with this module:
# `git_sha` and the file helpers (re-exported from crucible.runfiles) are used by the CLI, the
# study and the flows, which must not pull torch in
if TYPE_CHECKING:
    import torch

    from crucible.faults import FaultPlan
    from crucible.strategy import StepPlan
    from crucible.sync import StageSyncResult

__all__ = ["RunCounters", "write_bytes_atomic", "write_json_atomic", "git_sha"]


def git_sha() -> str:
    """The commit of the crucible checkout (`crucible.runfiles.git_sha`), or 'unknown' outside
    a git checkout: what `summary.json` records."""
    return _git_sha() or "unknown"


@dataclass
class RunCounters:
    inner_steps: torch.Tensor                 # (R, S) inner steps taken
    donor_load: torch.Tensor                  # (R, S) foreign micro-batches processed
    tokens_processed: int = 0
    replica_steps: int = 0
    down_replica_steps: int = 0
    made: int = 0
    missed: int = 0
    rejected: int = 0
    manifests_rejected: int = 0
    bytes_forward: int = 0
    bytes_backward: int = 0
    bytes_rerouted: int = 0
    bytes_upload: int = 0
    bytes_dense: int = 0
    skipped_outer_steps: int = 0
    initial_val_loss: float | None = None
    evals: list[dict[str, Any]] = field(default_factory=list)
    wall_s: float = 0.0
    timing: dict[str, float] = field(default_factory=lambda: {"inner_s": 0.0, "sync_s": 0.0,
                                                              "eval_s": 0.0})

    @classmethod
    def empty(cls, *, replicas: int, stages: int) -> RunCounters:
        import torch

        return cls(inner_steps=torch.zeros(replicas, stages, dtype=torch.long),
                   donor_load=torch.zeros(replicas, stages, dtype=torch.long))

    def record_step(self, step: StepPlan, *, h: int, tokens_per_replica: int,
                    config: Config) -> None:
        processing = step.loss_weight > 0
        tokens = int(processing.sum()) * tokens_per_replica
        self.tokens_processed += tokens
        self.inner_steps += step.active.long() * h
        self.replica_steps += step.down.shape[0]
        self.down_replica_steps += int(step.down.any(dim=1).sum())
        if step.extra_load is not None:
            self.donor_load += step.extra_load * h
        from crucible.boundary import wire_bytes

        forward, backward = wire_bytes(config)
        crossings_tokens = int(step.crossings().sum()) * tokens_per_replica
        self.bytes_forward += crossings_tokens * forward
        self.bytes_backward += crossings_tokens * backward
        rerouted_tokens = int(step.rerouted_crossings().sum()) * tokens_per_replica
        self.bytes_rerouted += rerouted_tokens * (forward + backward)

    def record_sync(self, global_step: int, results: list[StageSyncResult], callback: Callback) -> None:
        for result in results:
            self.made += len(result.made)
            self.missed += len(result.missing)
            self.rejected += len(result.rejected)
            self.bytes_upload += result.upload_bytes
            self.bytes_dense += result.dense_bytes
            self.skipped_outer_steps += 0 if result.applied else 1
            for replica in result.missing:
                callback.event(Event("contribution_missing", global_step, replica=replica,
                                     stage=result.stage))
            for replica, reason in sorted(result.rejected.items()):
                callback.event(Event("contribution_rejected", global_step, replica=replica,
                                     stage=result.stage, detail={"reason": reason}))
            self.manifests_rejected += len(result.manifest_events)
            for event in result.manifest_events:
                callback.event(event)

    def summary(self, config: Config, *, plan: FaultPlan, tokens_budget: int, global_steps: int,
                synced_params: int) -> dict[str, Any]:
        final = self.evals[-1]["val_loss"] if self.evals else None
        normal_batches = int(self.inner_steps.sum()) or 1
        return {
            "config": config.to_dict(),
            "preset": config.preset,
            "seed": config.seed,
            "initial_val_loss": self.initial_val_loss,
            "final_val_loss": final,
            "val_loss_stderr": self.evals[-1].get("val_loss_stderr") if self.evals else None,
            "evals": self.evals,
            "global_steps": global_steps,
            "tokens_budget": tokens_budget,
            "tokens_processed": self.tokens_processed,
            "budget_met": self.tokens_processed >= tokens_budget,
            "inner_steps": self.inner_steps.tolist(),
            "contributions": {"made": self.made, "missed": self.missed, "rejected": self.rejected},
            "manifests_rejected": self.manifests_rejected,
            "skipped_outer_steps": self.skipped_outer_steps,
            "bytes": {
                "boundary_forward": self.bytes_forward,
                "boundary_backward": self.bytes_backward,
                "boundary_rerouted": self.bytes_rerouted,   # part of the two above
                "upload": self.bytes_upload,
                "dense_upload_equivalent": self.bytes_dense,
                "upload_per_global_step": self.bytes_upload / max(global_steps, 1),
            },
            "synced_params": synced_params,
            "faults": plan.to_list(),
            "replica_down_fraction": self.down_replica_steps / max(self.replica_steps, 1),
            "donor_load": self.donor_load.tolist(),
            "donor_extra_fraction": int(self.donor_load.sum()) / normal_batches,
            "wall_s": self.wall_s,
            "timing": dict(self.timing),
        }

    def state_dict(self) -> dict[str, Any]:
        return {k: (dict(v) if isinstance(v, dict) else v) for k, v in self.__dict__.items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        import torch

        for key, value in state.items():
            setattr(self, key, value.clone() if isinstance(value, torch.Tensor) else value)

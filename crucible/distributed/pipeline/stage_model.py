"""What every process of a pipeline run agrees on about a stage: its folder, the run's refusal of
what the pipeline mode cannot run, and the stage's model.

- `stage_dir`: stage s of replica r's folder in the run folder (`stages/rR-sS`), where its
  journal, round records, pid, log and global weights live; the launcher, the pod supervisors,
  the chaos killer and the stage process itself all find it here.
- `check_pipeline`: a `ConfigError` naming the key and the fix for a run the pipeline mode
  refuses, raised before any process starts (and again by each stage process).
- `StageModel`: the one stage a stage process holds, as the simulator's `ReplicatedPipeline` row
  of it (a replica axis of 1), shaped for `crucible.sync.OuterSync`.
"""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from crucible.config import Config, ConfigError
from crucible.model import stage_layout
from crucible.pipeline import initial_tensor

__all__ = ["StageModel", "check_pipeline", "stage_dir"]


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

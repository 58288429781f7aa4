"""R replicas x S pipeline stages in one module, every tensor batched over replicas.

`ReplicatedPipeline.forward` runs a micro-batch per replica through the stages and returns each
replica's mean loss. What a fault changes is passed in as data:

- `bypass` (R, S) bool: the stage is skipped for that replica. The message it would have received
  is forwarded unchanged to the next stage, which decodes it with the basis it was encoded with
  (`pipeline.bypass_decode = "sender"`) or, naively, with its own expected one (`"receiver"`).
- `route` {stage: (R,) long}: replica r's micro-batch passes through stage s of replica
  `route[s][r]` (reroute); gradients of both replicas accumulate in the donor's stage.
- `select` (R',) long: run only these replicas' weights (validation of the global model).

Stage parameters live in one `ParameterDict` per stage, each tensor shaped (R, ...).
"""
from __future__ import annotations

import torch
from torch import nn

from crucible import boundary
from crucible.config import Config
from crucible.model import (
    ParamSpec,
    block_forward,
    embed_forward,
    head_losses,
    layers_of,
    reparametrised,
    rope_tables,
    stage_layout,
)
from crucible.seeding import INIT_STREAM, generator

__all__ = ["ReplicatedPipeline"]


class ReplicatedPipeline(nn.Module):
    def __init__(self, config: Config) -> None:
        super().__init__()
        self.config = config
        self.S = config.pipeline.stages
        self.R = config.replicas
        self.kind = config.pipeline.compression
        self.layouts: list[list[ParamSpec]] = [stage_layout(config, s) for s in range(self.S)]
        self.stages = nn.ModuleList()
        for s, layout in enumerate(self.layouts):
            params = nn.ParameterDict()
            for spec in layout:
                value = self._initial(spec, s)
                params[spec.name] = nn.Parameter(value.expand(self.R, *spec.shape).clone())
            self.stages.append(params)
        self.fixed = boundary.fixed_tensors(config)
        hd = config.model.d_model // config.model.heads
        cos, sin = rope_tables(config.model.seq_len, hd, config.model.rope_base)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def _initial(self, spec: ParamSpec, stage: int) -> torch.Tensor:
        # one stream per (seed, stage, tensor): adding a tensor never shifts the others
        gen = generator(self.config.seed, INIT_STREAM, stage, sum(map(ord, spec.name)), len(spec.name))
        if spec.init == "ones":
            return torch.ones(spec.shape)
        if spec.init == "zeros":
            return torch.zeros(spec.shape)
        if spec.init == "stiefel":
            return boundary.initial_basis(self.config, stage)
        return torch.randn(spec.shape, generator=gen) * spec.std

    def to_device(self, device: torch.device) -> ReplicatedPipeline:
        self.to(device)
        self.fixed = self.fixed.to(device)
        return self

    # -- views ---------------------------------------------------------------------------------
    def stage_params(self, stage: int) -> dict[str, nn.Parameter]:
        return dict(self.stages[stage].items())

    def replica_weights(self, *, replica: int, stage: int) -> dict[str, torch.Tensor]:
        """Detached copies of one replica's weights of one stage (unbatched shapes)."""
        return {n: p.detach()[replica].clone() for n, p in self.stages[stage].items()}

    @torch.no_grad()
    def set_stage(self, stage: int, weights: dict[str, torch.Tensor],
                  replicas: torch.Tensor | None = None) -> None:
        """Copy global `weights` into the stage of every replica (or of `replicas`)."""
        for name, param in self.stages[stage].items():
            if replicas is None:
                param.copy_(weights[name].expand_as(param))
            else:
                param[replicas] = weights[name].to(param.dtype)

    # -- forward -------------------------------------------------------------------------------
    def _gathered(self, stage: int, index: torch.Tensor | None) -> dict[str, torch.Tensor]:
        params = dict(self.stages[stage].items())
        if index is None:
            return params
        return {n: p[index] for n, p in params.items()}

    def forward(self, ids: torch.Tensor, targets: torch.Tensor, *, bypass: torch.Tensor | None = None,
                route: dict[int, torch.Tensor] | None = None, select: torch.Tensor | None = None,
                passthrough: bool = False) -> torch.Tensor:
        """Per-replica mean loss (R',) for ids/targets (R', B, T).

        `passthrough=True` replaces every encode/decode by the identity (a reference model with
        the same weights and no codec, for tests)."""
        route = route or {}
        if bypass is not None and bypass.any():
            assert not bypass[:, 0].any() and not bypass[:, -1].any(), "only inner stages bypass"
        params = [self._gathered(s, route.get(s, select)) for s in range(self.S)]
        fixed = self.fixed
        rope = (self.rope_cos, self.rope_sin)
        kind = "none" if passthrough else self.kind
        x = embed_forward(params[0], ids, subspace=fixed.subspace if self.kind == "ssn" else None,
                          token_table=fixed.token_table)
        message = None
        for s in range(self.S):
            if s > 0:
                x = boundary.decode(kind, message, ids, receiver=params[s], stage=s,
                                    basis=self._decode_basis(params, s, bypass), fixed=fixed)
            subspace = fixed.subspace if reparametrised(self.config, s) else None
            for layer in layers_of(self.config, s):
                x = block_forward(params[s], layer, x, config=self.config, rope=rope, subspace=subspace)
            if s == self.S - 1:
                return head_losses(params[s], x, targets)
            sent = boundary.encode(kind, x, ids, sender=params[s], stage=s, fixed=fixed)
            if bypass is not None and s > 0 and bypass[:, s].any():
                keep = bypass[:, s][:, None, None, None]
                sent = torch.where(keep, message, sent)
            message = sent
        raise AssertionError("unreachable: the last stage returns")

    def _decode_basis(self, params: list[dict[str, torch.Tensor]], stage: int,
                      bypass: torch.Tensor | None) -> torch.Tensor | None:
        if self.kind != "mapl":
            return None
        basis = params[stage - 1]["basis"]
        if (bypass is None or stage < 2 or self.config.pipeline.bypass_decode != "sender"
                or not bypass[:, stage - 1].any()):
            return basis
        # the message skipped stage-1: it is still in the coordinates of boundary stage-2
        skipped = bypass[:, stage - 1][:, None, None]
        return torch.where(skipped, params[stage - 2]["basis"], basis)

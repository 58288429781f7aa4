"""R replicas x S pipeline stages in one module, every tensor batched over replicas.

`ReplicatedPipeline.forward` runs a micro-batch per replica through the stages and returns each
replica's mean loss. What a fault changes is passed in as data:

- `bypass` (R, S) bool: the stage is skipped for that replica. The message it would have received
  is forwarded to the next stage. With MAPL the next stage expects boundary s's basis while the
  message is in boundary s-1's: `pipeline.bypass_decode = "identity"` re-expresses it in boundary
  s's basis (what the skipped stage would send were it the identity), `"sender"` decodes it with
  the basis it was encoded with, `"receiver"` (naive) with the receiver's own.
- `route` {stage: (R,) long}: replica r's micro-batch passes through stage s of replica
  `route[s][r]` (reroute); gradients of both replicas accumulate in the donor's stage.
- `select` (R',) long: run only these replicas' weights (validation of the global model).

Stage parameters live in one `ParameterDict` per stage, each tensor shaped (R, ...).
"""
from __future__ import annotations

import torch
from torch import nn

from crucible import boundary
from crucible.config import Config, ConfigError
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
from crucible.seeding import INIT_STREAM, generator, name_seed

__all__ = ["ReplicatedPipeline", "initial_tensor", "resolve_device"]


def resolve_device(name: str) -> torch.device:
    """The device `train.device` names (`auto`: the GPU when there is one)."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("train.device=cuda but no CUDA device is available here; use "
                          "train.device=auto (the GPU when there is one) or cpu")
    return torch.device(name)


def initial_tensor(config: Config, spec: ParamSpec, *, stage: int) -> torch.Tensor:
    """One stage tensor's starting value (unbatched; every replica starts from it).

    One stream per (seed, stage, full tensor name), so adding a tensor never shifts the others
    and no two tensors share their draws."""
    if spec.init == "ones":
        return torch.ones(spec.shape)
    if spec.init == "zeros":
        return torch.zeros(spec.shape)
    if spec.init == "stiefel":
        return boundary.initial_basis(config, stage)
    gen = generator(config.seed, INIT_STREAM, stage, name_seed(spec.name))
    return torch.randn(spec.shape, generator=gen) * spec.std


class ReplicatedPipeline(nn.Module):
    def __init__(self, config: Config) -> None:
        super().__init__()
        self.config = config
        self.S = config.pipeline.stages
        self.R = config.replicas
        self.kind = config.pipeline.compression
        self.bypass_decode = config.pipeline.bypass_decode   # settable: bypass-damage compares
        self.layouts: list[list[ParamSpec]] = [stage_layout(config, s) for s in range(self.S)]
        self.stages = nn.ModuleList()
        for s, layout in enumerate(self.layouts):
            params = nn.ParameterDict()
            for spec in layout:
                value = initial_tensor(config, spec, stage=s)
                params[spec.name] = nn.Parameter(value.expand(self.R, *spec.shape).clone())
            self.stages.append(params)
        self.fixed = boundary.fixed_tensors(config)
        hd = config.model.d_model // config.model.heads
        cos, sin = rope_tables(config.model.seq_len, hd, config.model.rope_base)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

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
        if index.numel() == 1 and not torch.is_grad_enabled():
            # one replica's weights without gradients (every evaluation of the global model): a
            # view of its row, not a copy of every parameter per forward; the same contiguous
            # values at an aligned offset, so the same bits
            row = int(index)
            return {n: p[row:row + 1] for n, p in params.items()}
        return {n: p[index] for n, p in params.items()}

    def forward(self, ids: torch.Tensor, targets: torch.Tensor, *, bypass: torch.Tensor | None = None,
                route: dict[int, torch.Tensor] | None = None, select: torch.Tensor | None = None,
                passthrough: bool = False, per_sequence: bool = False,
                taps: dict[int, torch.Tensor] | None = None,
                inputs: dict[int, torch.Tensor] | None = None,
                messages: dict[int, torch.Tensor] | None = None,
                resume: tuple[int, torch.Tensor] | None = None,
                last: int | None = None) -> torch.Tensor | None:
        """Per-replica mean loss (R',) for ids/targets (R', B, T), or (R', B) per sequence.

        `passthrough=True` replaces every encode/decode by the identity (a reference model with
        the same weights and no codec, for tests). `taps`, when given, receives each boundary's
        activation before encoding: {boundary s: X (R', B, T, d)}; `inputs` each stage's residual
        stream after decoding its message: {stage s > 0: X (R', B, T, d)}; `messages` what
        crossed each boundary: {boundary s: message}. `resume=(s, message)` starts at stage s > 0
        from the message that crossed boundary s-1 (one that `messages` took from an earlier
        forward of the same ids and weights): stages 0..s-1 are not run again, and the result is
        the same, bit for bit, as the whole forward's. `last=s < S-1` runs stages 0..s only and
        returns None: for what `taps`/`inputs`/`messages` take of them (the values are the whole
        forward's; the later stages and the loss are not computed).

        Without gradients or autocast, and with no `taps`/`inputs` asked for, a stage that every
        selected replica bypasses is not computed at all (its output would be replaced whole by
        the bypass): the same values, bit for bit. With gradients it is, so that its parameters
        get their (zero) gradients as before."""
        route = route or {}
        if bypass is not None and bypass.any():
            assert not bypass[:, 0].any() and not bypass[:, -1].any(), "only inner stages bypass"
        params = [self._gathered(s, route.get(s, select)) for s in range(self.S)]
        fixed = self.fixed
        rope = (self.rope_cos, self.rope_sin)
        kind = "none" if passthrough else self.kind
        first = 0 if resume is None else resume[0]
        assert resume is None or 0 < first < self.S, f"resume at stage {first} of {self.S}"
        assert last is None or first <= last < self.S - 1, f"last stage {last} of {self.S}"
        skip_whole = (bypass is not None and taps is None and inputs is None
                      and not torch.is_grad_enabled()
                      and not torch.is_autocast_enabled(ids.device.type))
        # mapl: a stage's anchor term is looked up once, for its decode and its encode (the same
        # values); with gradients through `anchor_twice`, which gives the anchor table the
        # gradient of two lookups, summed as it always was
        share_anchor = self.kind == "mapl" and not passthrough
        twice = share_anchor and torch.is_grad_enabled()
        if resume is None:
            x = embed_forward(params[0], ids, subspace=fixed.subspace if self.kind == "ssn" else None,
                              token_table=fixed.token_table)
            message = None
        else:
            x, message = None, resume[1]
        for s in range(first, self.S):
            if skip_whole and 0 < s < self.S - 1 and bool(bypass[:, s].all()):  # type: ignore[index]
                message = self._bypassed(message, params, s)
                if messages is not None:
                    messages[s] = message
                continue
            anchor = for_encode = None
            if s > 0:
                if twice and s < self.S - 1:
                    anchor, for_encode = boundary.anchor_twice(params[s], ids, stage=s, fixed=fixed)
                elif share_anchor:
                    anchor = for_encode = boundary.anchor_term(params[s], ids, stage=s, fixed=fixed)
                x = boundary.decode(kind, message, ids, receiver=params[s], stage=s,
                                    basis=self._decode_basis(params, s, bypass), fixed=fixed,
                                    anchor=anchor)
                if inputs is not None:
                    inputs[s] = x.detach()
            subspace = fixed.subspace if reparametrised(self.config, s) else None
            for layer in layers_of(self.config, s):
                x = block_forward(params[s], layer, x, config=self.config, rope=rope, subspace=subspace)
            if s == self.S - 1:
                return head_losses(params[s], x, targets, per_sequence=per_sequence)
            if taps is not None:
                taps[s] = x.detach()
            sent = boundary.encode(kind, x, ids, sender=params[s], stage=s, fixed=fixed,
                                   anchor=for_encode)
            if bypass is not None and s > 0 and bypass[:, s].any():
                keep = bypass[:, s][:, None, None, None]
                sent = torch.where(keep, self._bypassed(message, params, s), sent)
            message = sent
            if messages is not None:
                messages[s] = message
            if s == last:
                return None
        raise AssertionError("unreachable: the last stage returns")

    def window_losses(self, ids: torch.Tensor, targets: torch.Tensor, *,
                      select: torch.Tensor, bypass: torch.Tensor | None = None,
                      taps: dict[int, torch.Tensor] | None = None) -> torch.Tensor:
        """Mean loss of every window (R', B) of the `select`ed replicas' weights (`taps`: as
        `forward`'s)."""
        return self(ids, targets, select=select, bypass=bypass, per_sequence=True, taps=taps)

    def _bypassed(self, message: torch.Tensor, params: list[dict[str, torch.Tensor]],
                  stage: int) -> torch.Tensor:
        """What crosses boundary `stage` when `stage` is skipped: the message it received, or
        (MAPL, `bypass_decode=identity`) that message re-expressed in boundary `stage`'s basis,
        Z A_{s-1}^T A_s: exactly what the skipped stage would send if its blocks were the
        identity. A_s is the global basis every peer holds; the skipped stage takes no gradient."""
        if self.kind != "mapl" or self.bypass_decode != "identity":
            return message
        relay = params[stage - 1]["basis"].transpose(1, 2) @ params[stage]["basis"].detach()
        R, B, T, k = message.shape
        return torch.matmul(message.reshape(R, B * T, k), relay).view(R, B, T, -1)

    def _decode_basis(self, params: list[dict[str, torch.Tensor]], stage: int,
                      bypass: torch.Tensor | None) -> torch.Tensor | None:
        if self.kind != "mapl":
            return None
        basis = params[stage - 1]["basis"]
        if bypass is None or stage < 2 or not bypass[:, stage - 1].any():
            return basis
        skipped = bypass[:, stage - 1][:, None, None]
        if self.bypass_decode == "identity":
            # the message was re-expressed in the skipped stage's basis, which decodes it here:
            # that stage is down and takes no gradient
            return torch.where(skipped, basis.detach(), basis)
        if self.bypass_decode != "sender":
            return basis
        # the message skipped stage-1: it is still in the coordinates of boundary stage-2
        return torch.where(skipped, params[stage - 2]["basis"], basis)

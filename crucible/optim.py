"""The inner optimiser: AdamW over replica-batched parameters, one step count per (replica, stage).

Each tensor (R, ...) belongs to one stage; `step(active=...)` updates only the (replica, stage)
pairs that trained this inner step (a failed or dropped stage takes no step, so its moments,
step count and weights stay untouched). `reset(replica=, stage=)` zeroes moments and step count
of one stage-replica (rejoin after a failure). Gradient clipping is per replica, over all of
that replica's stages, as on a real pipeline where each replica clips its own model.
"""
from __future__ import annotations

import math

import torch

from crucible.config import TrainConfig
from crucible.model import ParamSpec

__all__ = ["ReplicaAdamW", "lr_at", "clip_per_replica"]


def lr_at(step: int, *, train: TrainConfig, total_steps: int) -> float:
    """Linear warm-up, then cosine decay to `min_lr_ratio * lr` at `total_steps` (held after)."""
    if train.warmup_steps and step < train.warmup_steps:
        return train.lr * (step + 1) / train.warmup_steps
    span = max(1, total_steps - train.warmup_steps)
    progress = min(1.0, (step - train.warmup_steps) / span)
    floor = train.min_lr_ratio
    return train.lr * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))


@torch.no_grad()
def clip_per_replica(params: list[torch.Tensor], max_norm: float) -> torch.Tensor:
    """Scale each replica's gradients so its total L2 norm is at most `max_norm`; returns the
    pre-clip norms (R,)."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.zeros(0)
    squares = torch.stack([g.pow(2).flatten(1).sum(1) for g in grads]).sum(0)
    norms = squares.sqrt()
    coef = (max_norm / (norms + 1e-6)).clamp(max=1.0)
    for g in grads:
        g.mul_(coef.view(-1, *([1] * (g.dim() - 1))))
    return norms


class ReplicaAdamW:
    """AdamW (decoupled weight decay) over stacked stage parameters with per-pair masks."""

    def __init__(self, stages: list[dict[str, torch.nn.Parameter]], layouts: list[list[ParamSpec]],
                 *, train: TrainConfig, replicas: int) -> None:
        self.train = train
        self.stages = [{spec.name: params[spec.name] for spec in layout if spec.inner == "adamw"}
                       for params, layout in zip(stages, layouts, strict=True)]
        self.decay = {spec.name for layout in layouts for spec in layout if spec.decay}
        device = next(iter(stages[0].values())).device
        self.steps = torch.zeros(replicas, len(stages), dtype=torch.long, device=device)
        self.exp_avg = [{n: torch.zeros_like(p) for n, p in s.items()} for s in self.stages]
        self.exp_avg_sq = [{n: torch.zeros_like(p) for n, p in s.items()} for s in self.stages]

    def parameters(self) -> list[torch.nn.Parameter]:
        return [p for stage in self.stages for p in stage.values()]

    @torch.no_grad()
    def step(self, *, lr: float, active: torch.Tensor) -> None:
        """One AdamW step for every (replica, stage) with `active[r, s]` True."""
        b1, b2, eps, wd = self.train.beta1, self.train.beta2, self.train.eps, self.train.weight_decay
        self.steps += active.long()
        for s, params in enumerate(self.stages):
            mask = active[:, s]
            if not bool(mask.any()):
                continue
            t = self.steps[:, s].clamp(min=1).double()
            bc1 = (1 - b1 ** t).float()
            bc2_sqrt = (1 - b2 ** t).sqrt().float()
            full = bool(mask.all())
            for name, p in params.items():
                if p.grad is None:
                    continue
                view = (-1,) + (1,) * (p.dim() - 1)
                m, v = self.exp_avg[s][name], self.exp_avg_sq[s][name]
                m_new = torch.lerp(m, p.grad, 1 - b1)
                v_new = torch.lerp(v, p.grad * p.grad, 1 - b2)
                denom = (v_new.sqrt() / bc2_sqrt.view(view)).add_(eps)
                update = (m_new / bc1.view(view)) / denom
                if name in self.decay and wd:
                    update = update + wd * p
                if full:
                    m.copy_(m_new)
                    v.copy_(v_new)
                    p.sub_(lr * update)
                else:
                    keep = mask.view(view)
                    m.copy_(torch.where(keep, m_new, m))
                    v.copy_(torch.where(keep, v_new, v))
                    p.copy_(torch.where(keep, p - lr * update, p))

    @torch.no_grad()
    def reset(self, *, replica: int, stage: int) -> None:
        """Forget one stage-replica's moments and step count (a node restored after a failure)."""
        self.steps[replica, stage] = 0
        for name in self.stages[stage]:
            self.exp_avg[stage][name][replica].zero_()
            self.exp_avg_sq[stage][name][replica].zero_()

    def state_dict(self) -> dict[str, object]:
        return {"steps": self.steps.clone(), "exp_avg": self.exp_avg, "exp_avg_sq": self.exp_avg_sq}

    def load_state_dict(self, state: dict[str, object]) -> None:
        self.steps.copy_(state["steps"])  # type: ignore[arg-type]
        for ours, theirs in ((self.exp_avg, state["exp_avg"]), (self.exp_avg_sq, state["exp_avg_sq"])):
            for s, tensors in enumerate(ours):
                for name, value in tensors.items():
                    value.copy_(theirs[s][name])  # type: ignore[index]

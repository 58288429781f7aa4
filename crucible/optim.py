"""The inner optimiser: AdamW over replica-batched parameters, one step count per (replica, stage).

Each tensor (R, ...) belongs to one stage; `step(active=...)` updates only the (replica, stage)
pairs that trained this inner step (a failed or dropped stage takes no step, so its moments,
step count and weights stay untouched). `reset(replica=, stage=)` zeroes moments and step count
of one stage-replica (rejoin after a failure). Gradient clipping is per replica, over all of
that replica's stages, as on a real pipeline where each replica clips its own model.

The update itself is torch's fused AdamW kernel (one pass over each tensor instead of a dozen
full-size temporaries, which on a CPU cost more than the model's own matmuls); the stage-replica
masks and per-pair step counts are kept by passing it whole (R, ...) tensors when every replica
of a stage is active at the same step count, and single-replica views otherwise.
"""
from __future__ import annotations

import math

import torch

from crucible.config import TrainConfig
from crucible.model import ParamSpec

__all__ = ["ReplicaAdamW", "lr_at", "clip_per_replica"]

# torch's fused AdamW kernel (what `torch.optim.AdamW(fused=True)` calls); None if this build
# lacks it, and then the op-by-op update runs
_fused_adamw = getattr(torch, "_fused_adamw_", None)


class _FusedLists:
    """Parallel tensor lists for one fused AdamW call; `index` selects one replica's view."""

    def __init__(self) -> None:
        self.params: list[torch.Tensor] = []
        self.grads: list[torch.Tensor] = []
        self.exp_avgs: list[torch.Tensor] = []
        self.exp_avg_sqs: list[torch.Tensor] = []
        self.steps: list[torch.Tensor] = []

    def add(self, p: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
            exp_avg_sq: torch.Tensor, step: torch.Tensor, index: int | None) -> None:
        pick = (lambda t: t) if index is None else (lambda t: t[index])  # noqa: E731
        self.params.append(pick(p))
        self.grads.append(pick(grad))
        self.exp_avgs.append(pick(exp_avg))
        self.exp_avg_sqs.append(pick(exp_avg_sq))
        self.steps.append(step)


def lr_at(step: float, *, train: TrainConfig, total_steps: int) -> float:
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
    # vector_norm reduces in one pass; g.pow(2) would first write a gradient-sized temporary
    per_tensor = torch.stack([torch.linalg.vector_norm(g.flatten(1), dim=1) for g in grads])
    norms = per_tensor.pow(2).sum(0).sqrt()
    coef = (max_norm / (norms + 1e-6)).clamp(max=1.0)
    if bool((coef < 1.0).any()):  # else every factor is 1: nothing to scale
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
        self.steps += active.long()
        if _fused_adamw is None:
            self._step_unfused(lr=lr, active=active)
            return
        groups: dict[bool, _FusedLists] = {True: _FusedLists(), False: _FusedLists()}
        steps = self.steps.tolist()
        for s, params in enumerate(self.stages):
            for index, step_t in self._replica_groups(s, active[:, s], steps):
                for name, p in params.items():
                    if p.grad is None:
                        continue
                    groups[name in self.decay].add(p, p.grad, self.exp_avg[s][name],
                                                   self.exp_avg_sq[s][name], step_t, index)
        t = self.train
        for decay, lists in groups.items():
            if lists.params:
                # the fused kernel is one pass over memory instead of ~10 (temporaries of the
                # size of every parameter): on CPU the unfused step cost more than the model
                _fused_adamw(lists.params, lists.grads, lists.exp_avgs, lists.exp_avg_sqs, [],
                             lists.steps, lr=lr, beta1=t.beta1, beta2=t.beta2,
                             weight_decay=t.weight_decay if decay else 0.0, eps=t.eps,
                             amsgrad=False, maximize=False)

    def _replica_groups(self, stage: int, mask: torch.Tensor,
                        steps: list[list[int]]) -> list[tuple[int | None, torch.Tensor]]:
        """(replica index or None for all replicas, step-count tensor) for the active replicas
        of `stage`: the whole (R, ...) tensors at once when every replica is active at the same
        step count (the common case), else one replica view at a time."""
        counts = [steps[r][stage] for r in range(len(steps))]
        device = self.steps.device
        if bool(mask.all()) and len(set(counts)) == 1:
            return [(None, torch.tensor(float(counts[0]), device=device))]
        return [(r, torch.tensor(float(counts[r]), device=device))
                for r in torch.nonzero(mask).flatten().tolist()]

    @torch.no_grad()
    def _step_unfused(self, *, lr: float, active: torch.Tensor) -> None:
        # the same update as the fused kernel, op by op (for torch builds without it)
        b1, b2, eps, wd = self.train.beta1, self.train.beta2, self.train.eps, self.train.weight_decay
        for s, params in enumerate(self.stages):
            mask = active[:, s]
            if not bool(mask.any()):
                continue
            t = self.steps[:, s].clamp(min=1).double()
            bc1 = (1 - b1 ** t).float()
            bc2_sqrt = (1 - b2 ** t).sqrt().float()
            keep = mask
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
                where = keep.view(view)
                m.copy_(torch.where(where, m_new, m))
                v.copy_(torch.where(where, v_new, v))
                p.copy_(torch.where(where, p - lr * update, p))

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

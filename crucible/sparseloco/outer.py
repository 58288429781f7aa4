"""Outer optimiser: SGD on the global weights with the aggregated pseudo-gradient.

`sparseloco` uses plain SGD (lr 1.0, no momentum), applied once per global step - the error
feedback is not a second momentum. `diloco` uses SGD with Nesterov momentum 0.9 and lr 0.6 (the
SparseLoCo paper's DiLoCo setting), with PyTorch's convention:
`buf <- mu * buf + g; update = g + mu * buf` (or `buf` without Nesterov).
Every update is computed and checked for finiteness before any weight changes, so a non-finite
aggregate leaves the weights and the momentum untouched.
"""
from __future__ import annotations

from collections.abc import Mapping, MutableMapping
from typing import Any

import torch

__all__ = ["OuterSGD", "NonFiniteUpdate"]


class NonFiniteUpdate(ValueError):
    """The outer update holds NaN or inf; nothing was applied."""


class OuterSGD:
    """SGD on a stage's global weights (name -> fp32 tensor).

    `step` updates `theta_global` in place (and returns it). `momentum == 0` is plain SGD.
    """

    def __init__(self, *, lr: float, momentum: float = 0.0, nesterov: bool = False) -> None:
        if not lr > 0:
            raise ValueError(f"sparseloco.outer_lr must be > 0, got {lr}")
        if not 0 <= momentum < 1:
            raise ValueError(f"sparseloco.outer_momentum must be in [0, 1), got {momentum}")
        if nesterov and momentum == 0:
            raise ValueError("Nesterov momentum needs sparseloco.outer_momentum > 0")
        self.lr, self.momentum, self.nesterov = lr, momentum, nesterov
        self.buffers: dict[str, torch.Tensor] = {}

    def step(self, theta_global: MutableMapping[str, torch.Tensor],
             aggregate: Mapping[str, torch.Tensor]) -> MutableMapping[str, torch.Tensor]:
        """Apply `theta <- theta - lr * update(aggregate)`; raises KeyError-free ValueError if the
        names differ and `NonFiniteUpdate` if any update is not finite (nothing applied)."""
        if set(aggregate) != set(theta_global):
            raise ValueError(f"aggregate has parameters {sorted(aggregate)}, the stage has "
                             f"{sorted(theta_global)}")
        updates, buffers = {}, {}
        for name, grad in aggregate.items():
            grad = grad.detach().to(torch.float32)
            update = grad
            if self.momentum:
                prev = self.buffers.get(name)
                buf = grad.clone() if prev is None else self.momentum * prev + grad
                buffers[name] = buf
                update = grad + self.momentum * buf if self.nesterov else buf
            updates[name] = update
        # one copy to the host for all of the stage's checks (on a GPU, one wait, not one each)
        finite = (torch.stack([torch.isfinite(u).all() for u in updates.values()]).tolist()
                  if updates else [])
        for name, ok in zip(updates, finite, strict=True):
            if not ok:
                raise NonFiniteUpdate(f"outer update of {name!r} is not finite; "
                                      "refusing to apply the outer step")
        with torch.no_grad():
            for name, update in updates.items():
                theta_global[name].sub_(self.lr * update.to(theta_global[name].dtype))
        self.buffers.update(buffers)
        return theta_global

    def state_dict(self) -> dict[str, Any]:
        return {"lr": self.lr, "momentum": self.momentum, "nesterov": self.nesterov,
                "buffers": {n: b.clone() for n, b in self.buffers.items()}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.lr, self.momentum = float(state["lr"]), float(state["momentum"])
        self.nesterov = bool(state["nesterov"])
        self.buffers = {n: b.detach().to(torch.float32).clone()
                        for n, b in state["buffers"].items()}

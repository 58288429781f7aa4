"""The micro-batch schedule of one inner step on one stage, fill-drain: every micro-batch this
process runs forward, then every one backward.

A micro-batch's forward starts from the replica's tokens (the first stage) or the previous
stage's boundary message (`_received`, decoded), runs the stage's blocks, and ends in the loss
(the last stage) or the encoded message sent to the next stage; its backward starts from that
loss or from the gradient the next stage returns, and sends the gradient of what the stage
received back. What crosses a boundary is what the simulator's forward passes between stages:
the arm's encoded message in the dtype it is computed in, with the token ids for a compressed
arm and, for MAPL, the sender's basis (`_act_expect`, `_grad_expect`: the shapes the links
check). Under reroute a donor stage also runs the micro-batches of each replica it serves, in
replica order, and averages the gradients over the batches as the simulator's trainer does.

`MicroBatches` is a part of `stage.StageWorker` (a mixin over `verdicts.Verdicts`, whose
`_abort_waiting` ends a wait the first stage's retry made pointless): it keeps no state of its
own, it reads the worker's (named below, set in the worker's `__init__`).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from crucible import boundary
from crucible.distributed.pipeline.links import Expect, ids_dtype
from crucible.distributed.pipeline.verdicts import Verdicts
from crucible.errors import TrainingDiverged
from crucible.model import (
    block_forward,
    embed_forward,
    head_losses,
    layers_of,
    reparametrised,
)
from crucible.strategy import StepPlan

__all__ = ["MicroBatches"]


@dataclass
class _InFlight:
    """A micro-batch between its forward and its backward on this stage."""
    owner: int                            # the replica whose micro-batch it is
    m: int
    output: torch.Tensor                  # where its backward starts: the loss, or the message sent
    leaves: dict[str, torch.Tensor]       # the message (and basis) received; the basis sent
    loss: float | None = None             # its mean training loss (the last stage)


class MicroBatches(Verdicts):
    """Stage `s` of replica `r`'s micro-batches of an inner step (`_micro_batches`)."""

    M: int                          # micro-batches per inner step
    kind: str                       # the boundary compression: none, ssn or mapl
    params: dict[str, torch.nn.Parameter]   # the stage's tensors, a replica axis of 1
    fixed: boundary.FixedTensors    # the run's fixed boundary tensors (subspace, token table)
    rope: tuple[torch.Tensor, torch.Tensor]

    # -- shapes the links expect -------------------------------------------------------------
    def _width(self) -> int:
        return boundary.message_width(self.config)

    def _micro(self) -> int:
        return self.config.train.batch_size // self.M

    def _act_expect(self) -> dict[str, Expect]:
        m, T = self.config.model, self.config.model.seq_len
        shape = (1, self._micro(), T)
        out = {"message": Expect(torch.float32, (*shape, self._width()))}
        if self.kind != "none":
            out["ids"] = Expect(ids_dtype(m.vocab_size), shape, below=m.vocab_size)
        if self.kind == "mapl":
            out["basis"] = Expect(torch.float32, (1, m.d_model, self._width()))
        return out

    def _grad_expect(self) -> dict[str, Expect]:
        act = self._act_expect()
        out = {"message": act["message"]}
        if self.kind == "mapl":
            out["basis"] = act["basis"]
        return out

    # -- one inner step: fill, then drain ---------------------------------------------------
    def _micro_batches(self, g: int, h: int, step: StepPlan,
                       batch: tuple[torch.Tensor, torch.Tensor] | None,
                       dead: set[tuple[int, int]]) -> float | None:
        """Fill-drain: every micro-batch this process runs (its replica's, then those it is the
        donor for) forward, then every one backward. Returns the mean training loss of its own
        micro-batches on the last stage (None elsewhere). Raises Interrupted when a death in
        the chains it runs (since the attempt began, `dead`) or the first stage's retry makes
        a message it waits for never come."""
        def valid() -> bool:   # nothing in the chains it runs died since the attempt began
            return self._chain_dead(g, step) == dead and not self._abort_waiting(g, h)

        # fill
        in_flight = [self._forward(g, h, step, owner, m, batch, valid)
                     for owner in self._owners(step) for m in range(self.M)]
        # drain
        for micro in in_flight:
            self._backward(g, h, step, micro, valid)
        self._average_donor_gradients(step)
        losses = [micro.loss for micro in in_flight if micro.loss is not None]
        return sum(losses) / len(losses) if losses else None

    def _view(self, owner: int) -> int:
        """The view a message of `owner`'s micro-batch carries: this replica's attempt for its
        own; 0 for one it is the donor for (that replica's retries are not known here)."""
        return self.attempt if owner == self.r else 0

    def _forward(self, g: int, h: int, step: StepPlan, owner: int, m: int,
                 batch: tuple[torch.Tensor, torch.Tensor] | None,
                 valid: Callable[[], bool]) -> _InFlight:
        """Micro-batch m of `owner` through this stage: its input (the replica's tokens on the
        first stage, else the previous stage's message, decoded), the stage's blocks, then
        the loss (last stage) or the encoded message sent to the next stage."""
        prev, nxt = self._neighbours(step, owner)
        params = self._params_used(step)
        leaves: dict[str, torch.Tensor] = {}
        if "basis" in params:
            leaves["sent_basis"] = params["basis"]
        if self.s == 0:
            assert batch is not None and owner == self.r
            ids = self._micro_slice(batch[0], m)
            x = embed_forward(params, ids,
                              subspace=self.fixed.subspace if self.kind == "ssn" else None,
                              token_table=self.fixed.token_table)
        else:
            assert prev is not None
            x, ids = self._received(g, h, m, owner, prev, params, batch, leaves, valid)
        subspace = self.fixed.subspace if reparametrised(self.config, self.s) else None
        for layer in layers_of(self.config, self.s):
            x = block_forward(params, layer, x, config=self.config, rope=self.rope,
                              subspace=subspace)
        if self.s == self.S - 1:
            assert batch is not None and owner == self.r
            loss, mean = self._loss(g, h, step, owner, params, x, self._micro_slice(batch[1], m))
            return _InFlight(owner, m, loss, leaves, mean)
        assert nxt is not None
        sent = boundary.encode(self.kind, x, ids, sender=params, stage=self.s, fixed=self.fixed)
        out = {"message": sent}
        if self.kind != "none":
            out["ids"] = ids.to(ids_dtype(self.config.model.vocab_size))
        if self.kind == "mapl":
            out["basis"] = params["basis"]
        self.outbox.send(self._address(*nxt), "act", g=g, h=h, m=m, owner=owner,
                         v=self._view(owner), tensors=out)
        return _InFlight(owner, m, sent, leaves)

    def _micro_slice(self, rows: torch.Tensor, m: int) -> torch.Tensor:
        """Micro-batch m's rows of the replica's batch (ids or targets)."""
        b = self._micro()
        return rows[:, m * b:(m + 1) * b]

    def _received(self, g: int, h: int, m: int, owner: int, prev: tuple[int, int],
                  params: dict[str, torch.Tensor],
                  batch: tuple[torch.Tensor, torch.Tensor] | None,
                  leaves: dict[str, torch.Tensor],
                  valid: Callable[[], bool]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The previous stage's message for micro-batch m, decoded: (x, the token ids). The
        message (and a MAPL basis) become the leaves whose gradients go back (`leaves`)."""
        got = self.inbox.receive("act", prev, g=g, h=h, m=m, owner=owner, v=self._view(owner),
                                 expect=self._act_expect(), timeout_s=self.timeout_s,
                                 valid=valid)
        message = got.tensors["message"].requires_grad_(True)
        leaves["message"] = message
        ids = (got.tensors["ids"].long() if "ids" in got.tensors
               else self._micro_slice(batch[0], m) if batch is not None else None)
        basis = None
        if self.kind == "mapl":
            basis = got.tensors["basis"].requires_grad_(True)
            leaves["basis"] = basis
        x = boundary.decode(self.kind, message, ids, receiver=params, stage=self.s,
                            basis=basis, fixed=self.fixed)
        return x, ids

    def _loss(self, g: int, h: int, step: StepPlan, owner: int, params: dict[str, torch.Tensor],
              x: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, float]:
        """The last stage's loss of a micro-batch, weighted as the step plan weighs its
        replica and divided by the micro-batches (what its backward starts from), and its
        mean training loss."""
        mean = head_losses(params, x, targets)
        if not bool(torch.isfinite(mean).all()):
            raise TrainingDiverged(f"non-finite training loss at global step {g}, "
                                   f"inner step {h}: {mean.tolist()}")
        loss = (mean * step.loss_weight[owner:owner + 1].float()).sum()
        return (loss / self.M if self.M > 1 else loss), float(mean.detach())

    def _backward(self, g: int, h: int, step: StepPlan, micro: _InFlight,
                  valid: Callable[[], bool]) -> None:
        """Micro-batch `micro` back through this stage: from its loss (last stage) or the
        gradient the next stage returns for the message sent, then the gradient of what this
        stage received goes to the previous stage."""
        prev, nxt = self._neighbours(step, micro.owner)
        v = self._view(micro.owner)
        if self.s == self.S - 1:
            micro.output.backward()
        else:
            assert nxt is not None
            got = self.inbox.receive("grad", nxt, g=g, h=h, m=micro.m, owner=micro.owner, v=v,
                                     expect=self._grad_expect(), timeout_s=self.timeout_s,
                                     valid=valid)
            if self.kind == "mapl":
                # the receiver's decode gradient of the basis it was sent joins the encode's in
                # one backward, summed where the simulator sums them
                torch.autograd.backward([micro.output, micro.leaves["sent_basis"]],
                                        [got.tensors["message"], got.tensors["basis"]])
            else:
                micro.output.backward(got.tensors["message"])
        if self.s != 0:
            assert prev is not None
            grads = {"message": micro.leaves["message"].grad}
            if self.kind == "mapl":
                grads["basis"] = micro.leaves["basis"].grad
            self.outbox.send(self._address(*prev), "grad", g=g, h=h, m=micro.m,
                             owner=micro.owner, v=v, tensors=grads)

    def _params_used(self, step: StepPlan) -> dict[str, torch.Tensor]:
        """The stage's tensors as the forward uses them: a round that reroutes through this
        stage gathers every replica's tensors of it by the route (the simulator's
        `_gathered`), which copies them (a MAPL basis then leaves its column-major layout, and
        its products round otherwise): the same gather here, of the one row."""
        if self.s not in step.route:
            return self.params
        row = torch.zeros(1, dtype=torch.long)
        return {n: p[row] for n, p in self.params.items()}

    @torch.no_grad()
    def _average_donor_gradients(self, step: StepPlan) -> None:
        """A donor's stage holds the gradients of its own micro-batch and of each replica it
        served: divided by the number of batches, as the simulator's trainer does."""
        if step.extra_load is None or not int(step.extra_load[self.r, self.s]):
            return
        load = step.extra_load[self.r:self.r + 1, self.s]
        scale = (1.0 / (1.0 + load.double())).float()
        for p in self.params.values():
            if p.grad is not None:
                p.grad.mul_(scale.view(-1, *([1] * (p.dim() - 1))))

"""A replica process clips its gradients to the bit as the simulator clips that replica's row:
`clip_as_batched` against `optim.clip_per_replica` (the reference), for several widths R."""
from __future__ import annotations

import pytest
import torch

from crucible.distributed.worker import clip_as_batched
from crucible.optim import clip_per_replica

SHAPES = [(64, 64), (64,), (256, 64), (64, 172), (3, 17)] * 8   # many tensors: a long sum


def _params(replicas: int, seed: int) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    params = []
    for shape in SHAPES:
        p = torch.nn.Parameter(torch.zeros(replicas, *shape))
        p.grad = torch.randn(replicas, *shape, generator=gen)
        params.append(p)
    return params


@pytest.mark.parametrize("replicas", [2, 3, 4, 8])
def test_one_row_clips_exactly_like_the_batched_reference(replicas: int) -> None:
    batched = _params(replicas, seed=replicas)
    clip_per_replica(batched, 1.0)                   # the norms are far above 1: it clips
    for r in range(replicas):
        row = _params(replicas, seed=replicas)
        lone = [torch.nn.Parameter(p.detach()[r:r + 1].clone()) for p in row]
        for p, q in zip(lone, row, strict=True):
            p.grad = q.grad[r:r + 1].clone()
        clip_as_batched(lone, 1.0, replica=r, replicas=replicas)
        for p, q in zip(lone, batched, strict=True):
            assert torch.equal(p.grad[0], q.grad[r]), (replicas, r)

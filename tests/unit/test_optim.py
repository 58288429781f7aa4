"""Per-replica gradient clipping: each replica is clipped by its own total norm, against
`torch.nn.utils.clip_grad_norm_` run on that replica alone."""
from __future__ import annotations

import torch

from crucible.optim import clip_per_replica


def _params(scales: list[float]) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.zeros(len(scales), *shape)) for shape in ((5, 7), (3,))]
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen)
        for r, scale in enumerate(scales):
            p.grad[r] *= scale
    return params


def test_each_replica_is_clipped_by_its_own_norm_as_torch_would() -> None:
    scales = [0.01, 1.0, 50.0]                    # below, around and far above the limit
    params = _params(scales)
    before = [p.grad.clone() for p in params]
    norms = clip_per_replica(params, max_norm=1.0)
    for r in range(len(scales)):
        alone = [torch.nn.Parameter(b[r].clone()) for b in before]
        for a, b in zip(alone, before, strict=True):
            a.grad = b[r].clone()
        want = torch.nn.utils.clip_grad_norm_(alone, max_norm=1.0)
        torch.testing.assert_close(norms[r], want)
        for p, a in zip(params, alone, strict=True):
            torch.testing.assert_close(p.grad[r], a.grad)
    assert float(norms[0]) < 1.0 < float(norms[2])
    assert torch.equal(params[0].grad[0], before[0][0])      # under the limit: untouched


def test_no_replica_over_the_limit_leaves_every_gradient_bit_identical() -> None:
    params = _params([0.01, 0.02])
    before = [p.grad.clone() for p in params]
    clip_per_replica(params, max_norm=1.0)
    assert all(torch.equal(p.grad, b) for p, b in zip(params, before, strict=True))

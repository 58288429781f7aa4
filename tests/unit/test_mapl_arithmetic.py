"""MAPL's arithmetic where it was made cheaper (issue 38) is what it was, bit for bit, so every
committed MAPL cell re-runs to the bit on its CPU kind:
- the SPEL step (crucible/boundary.py) written into reused buffers is the formula written out
  (the reference below is the step as it was written before the buffers: one line per formula,
  a fresh tensor per operation);
- a stage's anchor term looked up once for its decode and its encode (`anchor_twice`) gives the
  loss and every gradient that two lookups of their own gave."""
from __future__ import annotations

import pytest
import torch

from crucible import boundary
from crucible.pipeline import ReplicatedPipeline
from tests.unit.helpers import tiny


def _msign(m: torch.Tensor, steps: int) -> torch.Tensor:
    a, b, c = 3.4445, -4.7750, 2.0315
    x = m / (m.flatten(1).norm(dim=1)[:, None, None] + 1e-7)
    for _ in range(steps):
        gram = x.transpose(1, 2) @ x
        x = a * x + x @ (b * gram + c * gram @ gram)
    return x


def _retract(a: torch.Tensor, steps: int) -> torch.Tensor:
    x = a
    for _ in range(steps):
        x = 1.5 * x - 0.5 * x @ (x.transpose(1, 2) @ x)
    return x


def _step(basis, grad, momentum, *, lr, beta, steps, mask) -> None:
    if not bool(mask.any()):
        return
    sym = basis.transpose(1, 2) @ grad
    sym = 0.5 * (sym + sym.transpose(1, 2))
    riemannian = grad - basis @ sym
    new_momentum = beta * momentum + (1 - beta) * riemannian
    new_basis = _retract(basis - lr * _msign(new_momentum, steps), steps)
    keep = mask[:, None, None]
    momentum.copy_(torch.where(keep, new_momentum, momentum))
    basis.copy_(torch.where(keep, new_basis, basis))


def _inputs(n: int, R: int = 4, d: int = 32, k: int = 8, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    bases = [_retract(torch.linalg.qr(torch.randn(R, d, k, generator=gen))[0], 5).contiguous()
             for _ in range(n)]
    grads = [torch.randn(R, d, k, generator=gen) for _ in range(n)]
    momenta = [0.1 * torch.randn(R, d, k, generator=gen) for _ in range(n)]
    return bases, grads, momenta


@pytest.mark.parametrize("steps", [0, 1, 5, 8])
def test_msign_and_retract_are_the_formula_and_leave_their_input(steps: int) -> None:
    gen = torch.Generator().manual_seed(steps)
    m = torch.randn(6, 32, 8, generator=gen)
    a = _retract(torch.linalg.qr(torch.randn(6, 32, 8, generator=gen))[0], 3) * 1.01
    m_before, a_before = m.clone(), a.clone()
    assert torch.equal(boundary.msign(m, steps), _msign(m, steps))
    assert torch.equal(boundary.retract(a, steps), _retract(a, steps))
    assert torch.equal(m, m_before) and torch.equal(a, a_before)
    # the results are the caller's own tensors, not scratch that a later call overwrites
    first = boundary.msign(m, steps)
    boundary.msign(2 * m, steps)
    assert torch.equal(first, _msign(m, steps))


@pytest.mark.parametrize("shape", [(1, 128, 16), (24, 128, 16), (3, 64, 8)])
def test_column_major_inputs_keep_the_formulas_layout_and_bits(shape) -> None:
    """The outer step retracts the global basis as QR left it, column-major: the buffers take
    the layout the formula's elementwise results have, so its matmuls see the same operands."""
    gen = torch.Generator().manual_seed(shape[0])
    a = torch.linalg.qr(torch.randn(shape, generator=gen))[0] * 1.01
    m = torch.randn(shape[0], shape[2], shape[1], generator=gen).transpose(1, 2)
    assert not a.is_contiguous() and not m.is_contiguous()
    ours, theirs = boundary.retract(a, 8), _retract(a, 8)
    assert torch.equal(ours, theirs) and ours.stride() == theirs.stride()
    ours, theirs = boundary.msign(m, 8), _msign(m, 8)
    assert torch.equal(ours, theirs) and ours.stride() == theirs.stride()
    work = boundary.Workspace()   # a buffer is reused only for the layout it was made for
    assert work("b", a) is work("b", a) and work("b", a).stride() == a.stride()
    assert work("b", a.contiguous()).is_contiguous() and work("c", a, (2, 3)).shape == (2, 3)


def test_scalars_of_a_reduced_dtype_stay_python_numbers() -> None:
    assert isinstance(boundary._scalar(0.9, torch.zeros(1, dtype=torch.bfloat16)), float)
    t = boundary._scalar(0.9, torch.zeros(1))
    assert isinstance(t, torch.Tensor) and t.dtype == torch.float32
    x = torch.randn(64)
    assert torch.equal(torch.mul(x, t), x * 0.9)


def test_stiefel_steps_with_one_workspace_are_the_formula_step_after_step() -> None:
    """Twelve inner steps of three boundaries through one reused workspace, every replica
    stepping, some masked off, a whole boundary masked off, and a change of the Newton-Schulz
    count: equal to the bit to the formula stepped boundary by boundary in one batch."""
    bases, grads, momenta = _inputs(3)
    ours = [b.clone() for b in bases], [m.clone() for m in momenta]
    theirs = [b.clone() for b in bases], [m.clone() for m in momenta]
    R = bases[0].shape[0]
    work = boundary.Workspace()
    for i in range(12):
        masks = [torch.ones(R, dtype=torch.bool) for _ in range(3)]
        if i % 3 == 1:
            masks = [torch.tensor([True, False, True, True]), torch.zeros(R, dtype=torch.bool),
                     torch.ones(R, dtype=torch.bool)]
        steps = 5 if i % 4 == 3 else 8
        scaled = [g * (1 + 0.1 * i) for g in grads]
        boundary.stiefel_steps(ours[0], scaled, ours[1], masks, lr=0.01, beta=0.9, steps=steps,
                               work=work)
        basis, momentum = torch.cat(theirs[0]), torch.cat(theirs[1])
        _step(basis, torch.cat(scaled), momentum, lr=0.01, beta=0.9, steps=steps,
              mask=torch.cat(masks))
        for j in range(3):
            theirs[0][j].copy_(basis[j * R:(j + 1) * R])
            theirs[1][j].copy_(momentum[j * R:(j + 1) * R])
        for a, b in zip(ours[0] + ours[1], theirs[0] + theirs[1], strict=True):
            assert torch.equal(a, b), f"inner step {i}"
    assert not torch.equal(ours[0][0], bases[0])


def test_a_lone_column_major_boundary_is_the_formula_on_contiguous_copies() -> None:
    """One boundary (S = 2) with its basis and gradient column-major, as QR and backward leave
    them: the step works on contiguous copies, the layout every batched step has (on an AVX2
    CPU the formula on column-major operands rounds otherwise; no committed MAPL cell has a
    lone boundary), and writes back into the caller's tensors."""
    bases, grads, momenta = _inputs(1, seed=3)
    basis = bases[0].transpose(1, 2).contiguous().transpose(1, 2)
    grad = grads[0].transpose(1, 2).contiguous().transpose(1, 2)
    assert not basis.is_contiguous() and not grad.is_contiguous()
    ours = (basis.clone(memory_format=torch.preserve_format), momenta[0].clone())
    assert not ours[0].is_contiguous()
    theirs = (basis.contiguous(), momenta[0].clone())
    mask = torch.tensor([True, True, False, True])
    work = boundary.Workspace()
    for _ in range(3):
        boundary.stiefel_steps([ours[0]], [grad], [ours[1]], [mask], lr=0.02, beta=0.8, steps=6,
                               work=work)
        _step(theirs[0], grad.contiguous(), theirs[1], lr=0.02, beta=0.8, steps=6, mask=mask)
    assert torch.equal(ours[0], theirs[0]) and torch.equal(ours[1], theirs[1])
    assert torch.equal(ours[0][2], basis[2]) and not torch.equal(ours[0][0], basis[0])


def _two_lookups(params, ids, *, stage, fixed):
    """The anchor terms as the forward made them before `anchor_twice`: a lookup per use."""
    return (boundary.anchor_term(params, ids, stage=stage, fixed=fixed),
            boundary.anchor_term(params, ids, stage=stage, fixed=fixed))


def _losses_and_grads(model: ReplicatedPipeline, ids, targets, **kwargs):
    model.zero_grad(set_to_none=True)
    losses = model(ids, targets, **kwargs)
    (losses * torch.arange(1, losses.shape[0] + 1)).sum().backward()
    grads = {f"{s}.{n}": p.grad.clone() for s in range(model.S)
             for n, p in model.stage_params(s).items() if p.grad is not None}
    return losses.detach(), grads


@pytest.mark.parametrize("case", ["intact", "skip", "reroute"])
def test_one_anchor_lookup_per_stage_gives_two_lookups_losses_and_gradients(
        case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    config = tiny(**{"pipeline.compression": "mapl", "pipeline.stages": 4, "replicas": 3,
                     "pipeline.bypass_decode": "sender"})
    model = ReplicatedPipeline(config)
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():   # anchor tables away from their initial values, so every term counts
        for s in range(1, model.S):
            model.stage_params(s)["anchor"].add_(torch.randn(
                model.stage_params(s)["anchor"].shape, generator=gen))
    R, T, V = config.replicas, config.model.seq_len, config.model.vocab_size
    tokens = torch.randint(V, (R, 2, T + 1), generator=gen)
    ids, targets = tokens[..., :-1].contiguous(), tokens[..., 1:].contiguous()
    kwargs: dict = {}
    if case == "skip":
        bypass = torch.zeros(R, model.S, dtype=torch.bool)
        bypass[1, 1] = bypass[2, 2] = True
        kwargs["bypass"] = bypass
    if case == "reroute":
        kwargs["route"] = {2: torch.tensor([0, 0, 2])}   # replica 1 goes through replica 0's stage 2
    calls: list[int] = []
    shared = boundary.anchor_twice

    def counted(params, ids, *, stage, fixed):
        calls.append(stage)
        return shared(params, ids, stage=stage, fixed=fixed)

    monkeypatch.setattr(boundary, "anchor_twice", counted)
    ours = _losses_and_grads(model, ids, targets, **kwargs)
    assert calls == [1, 2]   # the inner stages, which both decode and encode
    monkeypatch.setattr(boundary, "anchor_twice", _two_lookups)
    theirs = _losses_and_grads(model, ids, targets, **kwargs)
    assert torch.equal(ours[0], theirs[0])
    assert ours[1].keys() == theirs[1].keys() and {"1.anchor", "2.anchor"} <= ours[1].keys()
    for name, grad in ours[1].items():
        assert torch.equal(grad, theirs[1][name]), name


def test_anchor_twice_is_two_lookups_and_counts_both_uses() -> None:
    config = tiny(**{"pipeline.compression": "mapl"})
    model = ReplicatedPipeline(config)
    params = model.stage_params(1)
    ids = torch.randint(config.model.vocab_size, (config.replicas, 2, config.model.seq_len),
                        generator=torch.Generator().manual_seed(1))
    first, second = boundary.anchor_twice(params, ids, stage=1, fixed=model.fixed)
    assert torch.equal(first, boundary.anchor_term(params, ids, stage=1, fixed=model.fixed))
    assert torch.equal(first, second)
    (3 * first.sum() - second.sum()).backward()
    both = params["anchor"].grad.clone()
    params["anchor"].grad = None
    (2 * boundary.anchor_term(params, ids, stage=1, fixed=model.fixed).sum()).backward()
    assert torch.allclose(both, params["anchor"].grad)
    assert both.abs().sum() > 0

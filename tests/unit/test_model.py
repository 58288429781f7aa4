"""The staged model against references: stage splits, subspace codec, bypass, MAPL manifold."""
import torch
from torch.testing import assert_close

from crucible import boundary
from crucible.optim import ReplicaAdamW
from crucible.pipeline import ReplicatedPipeline
from tests.unit.helpers import tiny


def _batch(cfg, seed=0):
    gen = torch.Generator().manual_seed(seed)
    shape = (cfg.replicas, cfg.train.batch_size, cfg.model.seq_len)
    return (torch.randint(0, 256, shape, generator=gen), torch.randint(0, 256, shape, generator=gen))


def _copy_weights(src: ReplicatedPipeline, dst: ReplicatedPipeline) -> None:
    flat = {n: p for s in range(src.S) for n, p in src.stage_params(s).items()}
    with torch.no_grad():
        for s in range(dst.S):
            for name, p in dst.stage_params(s).items():
                p.copy_(flat[name])


def _grads(model):
    return {n: p.grad.clone() for s in range(model.S) for n, p in model.stage_params(s).items()}


def test_four_stages_equal_one_stage_with_the_same_weights():
    staged = ReplicatedPipeline(tiny(**{"pipeline.stages": 4}))
    single = ReplicatedPipeline(tiny(**{"pipeline.stages": 1}))
    _copy_weights(staged, single)
    ids, targets = _batch(staged.config)
    loss4, loss1 = staged(ids, targets), single(ids, targets)
    assert_close(loss4, loss1)
    loss4.sum().backward()
    loss1.sum().backward()
    g4, g1 = _grads(staged), _grads(single)
    assert g4.keys() == g1.keys()
    for name in g4:
        assert_close(g4[name], g1[name], msg=name)


def test_ssn_gradients_equal_the_uncompressed_model_with_the_same_weights():
    model = ReplicatedPipeline(tiny(**{"pipeline.compression": "ssn"}))
    ids, targets = _batch(model.config)
    loss = model(ids, targets)
    loss.sum().backward()
    compressed = _grads(model)
    model.zero_grad()
    reference = model(ids, targets, passthrough=True)
    reference.sum().backward()
    assert_close(loss, reference, rtol=1e-5, atol=1e-5)
    for name, grad in _grads(model).items():
        assert_close(compressed[name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_ssn_sends_k_values_and_an_id_per_token():
    none_cfg, ssn_cfg = tiny(), tiny(**{"pipeline.compression": "ssn", "pipeline.factor": 8})
    d, k = 32, 4
    fwd_none, bwd_none = boundary.wire_bytes(none_cfg)
    fwd_ssn, bwd_ssn = boundary.wire_bytes(ssn_cfg)
    assert fwd_none == 2 * d and bwd_none == 2 * d                 # bf16 values
    assert fwd_ssn == 2 * k + 1 and bwd_ssn == 2 * k               # k bf16 values + a byte id
    assert fwd_ssn / fwd_none == (k + 0.5) / d


def test_bypass_blocks_gradient_to_the_failed_stage_only():
    cfg = tiny(**{"replicas": 2})
    model = ReplicatedPipeline(cfg)
    ids, targets = _batch(cfg)
    bypass = torch.zeros(2, 4, dtype=torch.bool)
    bypass[1, 1] = True
    model(ids, targets, bypass=bypass).sum().backward()
    qkv = model.stage_params(1)["h1_qkv"].grad
    assert torch.count_nonzero(qkv[1]) == 0 and torch.count_nonzero(qkv[0]) > 0
    assert torch.count_nonzero(model.stage_params(2)["h2_qkv"].grad[1]) > 0


def test_mapl_bases_stay_orthonormal_and_loss_falls_over_200_updates():
    cfg = tiny(**{"pipeline.compression": "mapl", "replicas": 1, "model.layers": 4})
    model = ReplicatedPipeline(cfg)
    optimizer = ReplicaAdamW([model.stage_params(s) for s in range(4)], model.layouts,
                             train=cfg.train, replicas=1)
    momenta = {s: torch.zeros_like(model.stage_params(s)["basis"]) for s in range(3)}
    ids, targets = _batch(cfg)
    active = torch.ones(1, 4, dtype=torch.bool)
    first = None
    for _ in range(200):
        loss = model(ids, targets)
        first = float(loss.detach()) if first is None else first
        loss.sum().backward()
        optimizer.step(lr=3e-3, active=active)
        for s, m in momenta.items():
            basis = model.stage_params(s)["basis"]
            boundary.stiefel_step(basis.data, basis.grad, m, lr=3e-3 * cfg.pipeline.mapl_lr_scale,
                                  beta=cfg.pipeline.mapl_momentum, steps=8, mask=active[:, s])
        model.zero_grad()
    last = float(model(ids, targets).detach())
    assert last < 0.5 * first
    eye = torch.eye(cfg.model.d_model // cfg.pipeline.factor)
    for s in range(3):
        a = model.stage_params(s)["basis"].detach()[0]
        assert float(torch.linalg.matrix_norm(a.T @ a - eye)) < 1e-4
        # it turned: 200 SPEL steps of at most lr radians each (0.6 rad = 34 degrees in all)
        angle = boundary.largest_angle_deg(boundary.initial_basis(cfg, s), a)
        assert angle > 5.0   # measured 10.7-14.7 at the default scale, ~1 at the old 0.1


def test_mapl_forward_without_gradients_shares_anchors_and_gives_the_same_bits():
    # each inner stage's anchor term is computed once for its decode and its encode: without
    # gradients by one `anchor_term`, with them by `anchor_twice` (tests/unit/
    # test_mapl_arithmetic.py holds its gradients to two lookups'); the losses (and every
    # boundary's message) are the same either way
    cfg = tiny(**{"pipeline.compression": "mapl", "pipeline.stages": 4})
    model = ReplicatedPipeline(cfg)
    ids, targets = _batch(cfg)
    built = []
    anchor_term = boundary.anchor_term

    def counted(*args, **kwargs):
        built.append(kwargs["stage"])
        return anchor_term(*args, **kwargs)

    boundary.anchor_term = counted
    try:
        with_grad: dict[int, torch.Tensor] = {}
        losses = model(ids, targets, messages=with_grad)
        per_use = list(built)
        built.clear()
        with torch.no_grad():
            without: dict[int, torch.Tensor] = {}
            shared = model(ids, targets, messages=without)
    finally:
        boundary.anchor_term = anchor_term
    assert per_use == [0, 3] and built == [0, 1, 2, 3]   # with gradients: the ends' only
    assert torch.equal(shared, losses.detach())
    assert all(torch.equal(without[s], with_grad[s].detach()) for s in with_grad)


def test_one_selected_replica_without_gradients_is_read_in_place_with_the_same_bits():
    # an evaluation (no gradients, one replica selected) runs on a view of that replica's row
    # instead of a copy of every parameter per forward; the losses are the copying path's
    for kind in ("none", "ssn", "mapl"):
        cfg = tiny(**{"pipeline.compression": kind, "pipeline.stages": 4})
        model = ReplicatedPipeline(cfg)
        gen = torch.Generator().manual_seed(1)
        with torch.no_grad():  # every replica row its own weights
            for s in range(model.S):
                for p in model.stage_params(s).values():
                    p.add_(torch.randn(p.shape, generator=gen) * 1e-2)
        ids, targets = _batch(cfg)
        for row in (0, cfg.replicas - 1):
            select = torch.tensor([row])
            window_ids, window_targets = ids[row][None], targets[row][None]
            with torch.no_grad():
                viewed = model.window_losses(window_ids, window_targets, select=select)
                params = model._gathered(1, select)
            copied = model.window_losses(window_ids, window_targets, select=select).detach()
            assert torch.equal(viewed, copied), (kind, row)
            own = model.stage_params(1)
            assert all(p.data_ptr() == own[n][row].data_ptr() for n, p in params.items())

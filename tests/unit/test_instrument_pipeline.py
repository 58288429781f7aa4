"""Instrumentation and exactness of the pipeline: MAPL basis learning and its report, the three
MAPL bypass decodes and `crucible bypass-damage`, reroute gradient and byte accounting, SSN
exactness on a trained model's real activations, and ReplicaAdamW against torch's AdamW."""
from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys

import pytest
import torch
from torch.testing import assert_close

from crucible import boundary
from crucible.config import PipelineConfig, apply_overrides
from crucible.events import MultiCallback
from crucible.faults import FaultPlan
from crucible.model import (
    ParamSpec,
    block_forward,
    embed_forward,
    head_losses,
    layers_of,
    reparametrised,
)
from crucible.optim import ReplicaAdamW
from crucible.pipeline import ReplicatedPipeline
from crucible.presets import get_preset
from crucible.store import LocalStore
from crucible.strategy import plan_step
from crucible.train import Trainer, train
from tests.unit.helpers import tiny

CLI = [sys.executable, "-c", "from cli.main import main; main()"]


def _crucible(*args):
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=600)


def _trainer(tmp_path, cfg, plan=None):
    return Trainer(cfg, store=LocalStore(tmp_path / "store"), run_key="t",
                   callback=MultiCallback(), plan=plan)


def _batch(cfg, seed=0):
    gen = torch.Generator().manual_seed(seed)
    shape = (cfg.replicas, cfg.train.batch_size, cfg.model.seq_len)
    V = cfg.model.vocab_size
    return (torch.randint(0, V, shape, generator=gen), torch.randint(0, V, shape, generator=gen))


def _orthonormal(d, k, gen):
    q, _ = torch.linalg.qr(torch.randn(d, k, generator=gen, dtype=torch.float64))
    return q.float()


@torch.no_grad()
def _perturb(model: ReplicatedPipeline, seed=0, scale=0.05):
    """Make every replica's weights different (bases: a fresh orthonormal basis per replica;
    anchors: large enough that getting them wrong shows)."""
    gen = torch.Generator().manual_seed(seed)
    for s in range(model.S):
        for name, p in model.stage_params(s).items():
            if name == "basis":
                for r in range(p.shape[0]):
                    p[r] = _orthonormal(p.shape[1], p.shape[2], gen)
            elif name == "anchor":
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
            else:
                p.add_(torch.randn(p.shape, generator=gen) * scale)


# ------------------------------------------------------------------------------------------------
# 1. MAPL learns: principal angles, energy kept, the Stiefel step size
# ------------------------------------------------------------------------------------------------

def test_largest_angle_is_zero_for_one_span_and_exact_for_a_rotated_column():
    gen = torch.Generator().manual_seed(0)
    d, k = 10, 4
    q = _orthonormal(d, k + 1, gen)
    a = q[:, :k]
    assert boundary.largest_angle_deg(a, a) == pytest.approx(0.0, abs=1e-3)
    # the same span in other coordinates (a k x k rotation of the columns) is the same subspace
    rot = _orthonormal(k, k, gen)
    assert boundary.largest_angle_deg(a, a @ rot) == pytest.approx(0.0, abs=1e-3)
    # all columns shared but the last, which is turned fully out of span(a): 90 degrees
    b90 = torch.cat([q[:, :k - 1], q[:, k:k + 1]], dim=1)
    assert boundary.largest_angle_deg(a, b90) == pytest.approx(90.0, abs=1e-6)
    # the last column turned 30 degrees towards a direction orthogonal to span(a)
    theta = math.radians(30)
    turned = math.cos(theta) * q[:, k - 1] + math.sin(theta) * q[:, k]
    b30 = torch.cat([q[:, :k - 1], turned[:, None]], dim=1)
    assert boundary.largest_angle_deg(a, b30) == pytest.approx(30.0, abs=1e-4)
    assert boundary.largest_angle_deg(b30, a) == pytest.approx(30.0, abs=1e-4)


def test_energy_kept_is_one_inside_the_span_and_exact_for_constructed_data():
    gen = torch.Generator().manual_seed(1)
    d, k = 8, 3
    a = _orthonormal(d, k, gen)
    inside = torch.randn(2, 5, 7, k, generator=gen) @ a.T           # (R, B, T, d) in span(a)
    assert boundary.energy_kept(inside, a) == pytest.approx(1.0, abs=1e-6)
    # orthogonal to span(a): nothing kept
    outside = torch.randn(2, 5, 7, d, generator=gen) @ (torch.eye(d) - a @ a.T)
    assert boundary.energy_kept(outside, a) == pytest.approx(0.0, abs=1e-6)
    # half the energy inside, half outside: one half kept
    half = inside / inside.norm() + outside / outside.norm()
    assert boundary.energy_kept(half, a) == pytest.approx(0.5, abs=1e-5)
    # the d unit vectors (isotropic data): exactly k/d for any orthonormal basis
    iso = torch.eye(d).reshape(1, 1, d, d)
    assert boundary.energy_kept(iso, a) == pytest.approx(k / d, abs=1e-6)
    # rows (3, 0, 0, 0) and (0, 4, 0, 0), basis e1: kept 9 / 25; basis (e1 + e2)/sqrt2: 25/2/25
    c = torch.tensor([[3.0, 0, 0, 0], [0, 4.0, 0, 0]]).reshape(1, 1, 2, 4)
    e1 = torch.tensor([[1.0], [0], [0], [0]])
    assert boundary.energy_kept(c, e1) == pytest.approx(9 / 25, abs=1e-9)
    diag = torch.tensor([[1.0], [1.0], [0], [0]]) / math.sqrt(2)
    assert boundary.energy_kept(c, diag) == pytest.approx((9 + 16) / 2 / 25, abs=1e-6)
    assert math.isnan(boundary.energy_kept(torch.zeros(1, 1, 2, 4), e1))


@pytest.mark.parametrize("scale", [None, 0.25])
def test_stiefel_step_is_mapl_lr_scale_times_the_inner_lr(tmp_path, monkeypatch, scale):
    assert PipelineConfig().mapl_lr_scale == 1.0                      # the new default
    overrides = {"pipeline.compression": "mapl", "train.global_steps": 2}
    if scale is not None:
        overrides["pipeline.mapl_lr_scale"] = scale
    trainer = _trainer(tmp_path, tiny(**overrides))
    adam_lrs, stiefel_lrs = [], []
    inner_step = trainer.optimizer.step

    def adam_step(*, lr, active):
        adam_lrs.append(lr)
        inner_step(lr=lr, active=active)

    real_stiefel = boundary.stiefel_step

    batch_rows = []

    def stiefel(*args, lr, **kwargs):
        stiefel_lrs.append(lr)
        batch_rows.append(args[0].shape[0])
        real_stiefel(*args, lr=lr, **kwargs)

    monkeypatch.setattr(trainer.optimizer, "step", adam_step)
    monkeypatch.setattr(boundary, "stiefel_step", stiefel)
    trainer.global_step(0)
    trainer.global_step(1)
    H, boundaries = trainer.H, trainer.S - 1
    # one batched SPEL step per inner step, holding every boundary's bases of every replica
    assert len(adam_lrs) == 2 * H and len(stiefel_lrs) == 2 * H
    assert batch_rows == [trainer.R * boundaries] * (2 * H)
    assert len(set(adam_lrs)) > 1                                     # warm-up: lr changes
    want = 1.0 if scale is None else scale
    for i, lr in enumerate(adam_lrs):
        assert stiefel_lrs[i] == pytest.approx(want * lr, rel=1e-12)


def test_basis_report_of_an_untrained_model_shows_no_movement(tmp_path):
    trainer = _trainer(tmp_path, tiny(**{"pipeline.compression": "mapl"}))
    rows = trainer.evaluator.basis_report()
    assert [r["boundary"] for r in rows] == list(range(trainer.S - 1))
    for r in rows:
        assert r["angle_deg"] == pytest.approx(0.0, abs=1e-2)
        assert r["energy_kept"] == pytest.approx(r["energy_kept_initial"], abs=1e-6)
        assert 0.0 < r["energy_kept"] < 1.0


def test_the_basis_report_takes_the_final_evaluations_activations(tmp_path, monkeypatch):
    """A MAPL run's basis report reads the boundary activations its final evaluation computed
    (four held-out batches here) instead of running a forward of its own: the run's numbers are
    those of a run that does not (the evaluation only keeps references), and the report is the
    one its own forward gives."""
    import crucible.train as train_module

    cfg = tiny(**{"pipeline.compression": "mapl", "train.eval_batch_size": 4,
                  "train.eval_every": 2, "train.global_steps": 3})
    own_forwards = []
    real_forward = ReplicatedPipeline.forward

    def counting(self, *args, **kwargs):
        if kwargs.get("last") is not None:
            own_forwards.append(kwargs["last"])
        return real_forward(self, *args, **kwargs)

    monkeypatch.setattr(ReplicatedPipeline, "forward", counting)
    reused = _trainer(tmp_path / "a", cfg)
    assert len(reused.validation) == 4
    summary = reused.run()
    assert own_forwards == []                             # no forward of the report's own
    assert reused.evaluator.last_taps is None             # let go once the report is made
    assert summary["mapl_bases"] == reused.evaluator.basis_report()
    assert own_forwards == [reused.S - 2]                 # that one ran its own

    monkeypatch.setattr(train_module, "BASIS_WINDOWS", 0)  # a run that keeps nothing
    plain = _trainer(tmp_path / "b", cfg).run()
    assert own_forwards == [reused.S - 2] * 2
    for key in ("final_val_loss", "evals", "mapl_bases", "tokens_processed"):
        assert plain[key] == summary[key], key


@pytest.mark.slow
def test_mapl_bases_learn_a_different_subspace_that_keeps_more_energy(tmp_path):
    """~30 s a seed: the lead's measured configuration (fewer held-out tokens for speed). One
    seed is not a finding, and which seed shows what depends on the CPU (training is chaotic:
    docs/ALGORITHMS.md, "Reproducibility across CPUs"): on an AMD EPYC seed 0's boundary 1 kept
    0.11 *less* energy than its initial basis, while seeds 0-3 gained +0.18 on average at
    boundaries 1 and 2. So every run's bases must have moved, and the gain of boundaries 1 and
    2 is asserted on the mean over seeds 0-2."""
    gains: dict[int, list[float]] = {1: [], 2: []}
    for seed in (0, 1, 2):
        cfg = apply_overrides(get_preset("smoke"), {
            "pipeline.compression": "mapl", "sparseloco.inner_steps": 16,
            "train.global_steps": 40, "train.eval_every": 40, "train.eval_tokens": 16384,
            "seed": seed})
        out = tmp_path / f"s{seed}"
        summary = train(cfg, out_dir=out)
        on_disk = json.loads((out / "summary.json").read_text())
        assert on_disk["mapl_bases"] == summary["mapl_bases"]
        rows = {r["boundary"]: r for r in summary["mapl_bases"]}
        assert sorted(rows) == [0, 1, 2]
        for b, row in rows.items():
            assert row["angle_deg"] >= 30.0, (seed, b, row)
            assert 0.0 < row["energy_kept"] <= 1.0 and 0.0 < row["energy_kept_initial"] <= 1.0
        for b in gains:
            gains[b].append(rows[b]["energy_kept"] - rows[b]["energy_kept_initial"])
    for b, values in gains.items():
        assert sum(values) / len(values) >= 0.06, (b, values)


# ------------------------------------------------------------------------------------------------
# 2. MAPL bypass decode options and `crucible bypass-damage`
# ------------------------------------------------------------------------------------------------

def _mapl_model(**extra):
    cfg = tiny(**{"pipeline.compression": "mapl", "replicas": 2, **extra})
    model = ReplicatedPipeline(cfg)
    _perturb(model)
    return model


def _record_decodes(monkeypatch):
    calls: dict[int, torch.Tensor] = {}
    real = boundary.decode

    def decode(*args, stage, **kwargs):
        out = real(*args, stage=stage, **kwargs)
        calls[stage] = out.detach().clone()
        return out

    monkeypatch.setattr(boundary, "decode", decode)
    return calls


@pytest.mark.parametrize("skipped", [1, 2])
def test_each_bypass_decode_feeds_the_next_stage_its_formula(monkeypatch, skipped):
    model = _mapl_model()
    ids, targets = _batch(model.config)
    calls = _record_decodes(monkeypatch)
    bypass = torch.zeros(2, model.S, dtype=torch.bool)
    bypass[1, skipped] = True
    P = model.fixed.anchors_fixed
    params = [{n: p.detach() for n, p in model.stage_params(s).items()} for s in range(model.S)]

    def anchor(stage, r):
        return params[stage]["anchor"][r][ids[r]] @ P[stage]

    s, nxt = skipped, skipped + 1
    decoded = {}
    for option in ("identity", "sender", "receiver"):
        model.bypass_decode = option
        taps: dict[int, torch.Tensor] = {}
        with torch.no_grad():
            model(ids, targets, bypass=bypass, taps=taps)
        # the skipped replica: the message stage s received, Z = (X_{s-1} - E_{s-1} P_{s-1}) A_{s-1}
        r = 1
        a_prev, a_s = params[s - 1]["basis"][r], params[s]["basis"][r]
        z = (taps[s - 1][r] - anchor(s - 1, r)) @ a_prev
        if option == "identity":
            want = z @ a_prev.T @ a_s @ a_s.T
        elif option == "sender":
            want = z @ a_prev.T
        else:
            want = z @ a_s.T
        want = want + anchor(nxt, r)
        assert_close(calls[nxt][r], want, rtol=1e-5, atol=1e-5, msg=option)
        decoded[option] = calls[nxt][r]
        # the healthy replica decodes what its stage s sent, with A_s, whatever the option
        h = 0
        a_h = params[s]["basis"][h]
        healthy = (taps[s][h] - anchor(s, h)) @ a_h @ a_h.T + anchor(nxt, h)
        assert_close(calls[nxt][h], healthy, rtol=1e-5, atol=1e-5, msg=option)
    # the three options are three different inputs (bases differ), so the test discriminates
    for x, y in (("identity", "sender"), ("identity", "receiver"), ("sender", "receiver")):
        assert float((decoded[x] - decoded[y]).abs().max()) > 1e-3, (x, y)


@pytest.mark.parametrize("skipped", [1, 2])
def test_bypass_decodes_agree_when_the_two_bases_are_equal(skipped):
    model = _mapl_model()
    ids, targets = _batch(model.config)
    bypass = torch.zeros(2, model.S, dtype=torch.bool)
    bypass[1, skipped] = True
    losses = {}
    for option in ("identity", "sender", "receiver"):
        model.bypass_decode = option
        with torch.no_grad():
            losses[option] = model(ids, targets, bypass=bypass)
    assert abs(float(losses["identity"][1] - losses["receiver"][1])) > 1e-4   # bases differ
    with torch.no_grad():
        model.stage_params(skipped)["basis"].copy_(model.stage_params(skipped - 1)["basis"])
    equal = {}
    for option in ("identity", "sender", "receiver"):
        model.bypass_decode = option
        with torch.no_grad():
            equal[option] = model(ids, targets, bypass=bypass)
    assert_close(equal["identity"], equal["sender"], rtol=1e-5, atol=1e-5)
    assert_close(equal["identity"], equal["receiver"], rtol=1e-5, atol=1e-5)


def _bypass_grads(option, skipped=2, r=1):
    model = _mapl_model()
    ids, targets = _batch(model.config)
    bypass = torch.zeros(2, model.S, dtype=torch.bool)
    bypass[r, skipped] = True
    model.bypass_decode = option
    model(ids, targets, bypass=bypass).sum().backward()
    return model


@pytest.mark.parametrize("option", ["identity", "sender"])
def test_skipped_stage_blocks_and_anchor_take_no_gradient(option):
    skipped, r = 2, 1
    model = _bypass_grads(option, skipped, r)
    for name, p in model.stage_params(skipped).items():
        if name == "basis" and option == "identity":
            continue      # see test_skipped_stage_basis_takes_no_gradient_under_identity
        assert p.grad is None or torch.count_nonzero(p.grad[r]) == 0, name
    # the healthy replica's same stage, and the bypassed replica's neighbours, do train
    assert torch.count_nonzero(model.stage_params(skipped)["basis"].grad[0]) > 0
    assert torch.count_nonzero(model.stage_params(skipped)["h2_qkv"].grad[0]) > 0
    assert torch.count_nonzero(model.stage_params(skipped - 1)["basis"].grad[r]) > 0
    assert torch.count_nonzero(model.stage_params(skipped + 1)["h3_qkv"].grad[r]) > 0


def test_skipped_stage_basis_takes_no_gradient_under_identity():
    skipped, r = 2, 1
    model = _bypass_grads("identity", skipped, r)
    grad = model.stage_params(skipped)["basis"].grad
    assert grad is None or torch.count_nonzero(grad[r]) == 0


@pytest.fixture(scope="module")
def finished_runs(tmp_path_factory):
    runs = {}
    for codec in ("mapl", "none"):
        out = tmp_path_factory.mktemp(f"run-{codec}")
        summary = train(tiny(**{"pipeline.compression": codec, "train.eval_tokens": 512}),
                        out_dir=out)
        runs[codec] = (out, summary)
    return runs


@pytest.mark.parametrize("codec", ["mapl", "none"])
def test_bypass_damage_cli_scores_every_inner_stage_and_decode(finished_runs, codec):
    out, summary = finished_runs[codec]
    done = _crucible("bypass-damage", str(out), "--json")
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    S = summary["config"]["pipeline"]["stages"]
    decodes = ["identity", "sender", "receiver"] if codec == "mapl" else ["-"]
    assert [(row["stage"], row["decode"]) for row in result["rows"]] == \
        [(s, d) for s in range(1, S - 1) for d in decodes]
    # the same held-out windows as the run's last evaluation: the same loss
    assert result["eval_tokens"] == summary["eval_tokens"]
    assert result["intact"] == pytest.approx(summary["final_val_loss"], abs=1e-6)
    for row in result["rows"]:
        assert math.isfinite(row["val_loss"]) and row["val_loss"] != result["intact"]
        # damage is the paired mean difference over windows relative to the intact mean
        assert row["damage_pct"] == pytest.approx(
            (row["val_loss"] - result["intact"]) / result["intact"] * 100, rel=1e-6, abs=1e-9)
        assert row["damage_stderr_pct"] >= 0
    if codec == "mapl":   # the options read the message differently: different losses
        for s in range(1, S - 1):
            losses = {row["decode"]: row["val_loss"] for row in result["rows"] if row["stage"] == s}
            assert len(set(losses.values())) == 3, losses


def test_bypass_damage_cli_refuses_unfinished_or_corrupt_runs(finished_runs, tmp_path):
    out, _ = finished_runs["none"]
    empty = tmp_path / "empty"
    empty.mkdir()
    no_model = tmp_path / "no-model"
    no_model.mkdir()
    shutil.copy(out / "summary.json", no_model / "summary.json")
    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    shutil.copy(out / "summary.json", corrupt / "summary.json")
    (corrupt / "model.pt").write_bytes(b"this is not a torch file\x00\x01" * 10)
    wrong = tmp_path / "wrong-format"
    wrong.mkdir()
    shutil.copy(out / "summary.json", wrong / "summary.json")
    torch.save({"something": torch.zeros(2)}, wrong / "model.pt")
    for folder, needle in ((empty, "summary.json"), (no_model, "model.pt"),
                           (corrupt, "not a Crucible model file"),
                           (wrong, "not a Crucible model file")):
        done = _crucible("bypass-damage", str(folder), "--json")
        assert done.returncode == 2, (folder.name, done.stderr)
        assert needle in done.stderr, (folder.name, done.stderr)
        assert "Traceback" not in done.stderr and "Traceback" not in done.stdout, folder.name
        assert done.stdout.strip() == "", folder.name


def test_evaluate_cli_rescores_the_final_model_with_its_standard_error(finished_runs):
    out, summary = finished_runs["none"]
    done = _crucible("evaluate", str(out), "--json")
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    # the run's own setting: the same windows as its last evaluation, the same loss and s.e.
    assert result["eval_tokens"] == summary["eval_tokens"]
    assert result["val_loss"] == pytest.approx(summary["final_val_loss"], abs=1e-6)
    assert result["val_loss_stderr"] == pytest.approx(summary["val_loss_stderr"], rel=1e-6)
    assert result["stderr_pct"] == pytest.approx(
        100 * result["val_loss_stderr"] / result["val_loss"], rel=1e-9)
    # fewer tokens: fewer windows, a larger standard error
    fewer = json.loads(_crucible("evaluate", str(out), "--eval-tokens", "128", "--json").stdout)
    assert fewer["eval_tokens"] < result["eval_tokens"]
    assert fewer["val_loss_stderr"] > result["val_loss_stderr"]
    bad = _crucible("evaluate", str(out), "--eval-tokens", "-1")
    assert bad.returncode == 2 and "--eval-tokens" in bad.stderr and "Traceback" not in bad.stderr


# ------------------------------------------------------------------------------------------------
# 3. Reroute: the donor's gradient is a mean over the batches it carried; reroute bytes
# ------------------------------------------------------------------------------------------------

def _stage_grads(model, replica, stage):
    return {n: (torch.zeros_like(p[replica]) if p.grad is None else p.grad[replica].clone())
            for n, p in model.stage_params(stage).items()}


@pytest.mark.parametrize("failed", [[1], [1, 2]])
def test_donor_stage_gradient_is_the_mean_over_the_batches_it_carried(tmp_path, failed):
    stage = 2
    cfg = tiny(**{"replicas": 3, "faults.strategy": "reroute"})
    plan = FaultPlan()
    for r in failed:
        plan.down(replica=r, stage=stage, start=0, steps=1)
    trainer = _trainer(tmp_path, cfg, plan)
    step = plan_step(trainer.plan, 0, config=cfg)
    donors = {r: step.donors[(r, stage)] for r in failed}
    assert set(donors.values()) == {0}                     # replica 0 serves every failed one
    model = trainer.model
    _perturb(model, seed=3)
    ids, targets = _batch(cfg, seed=5)

    model(ids, targets, route=step.route).sum().backward()
    trainer._average_donor_gradients(step)
    got = {(r, s): _stage_grads(model, r, s) for r in range(cfg.replicas) for s in range(model.S)}

    # reference without routing: a copy in which each failed replica's stage holds the donor's
    # weights, so that replica's batch runs through exactly the weights it was routed through
    reference = ReplicatedPipeline(cfg)
    reference.load_state_dict(model.state_dict())
    for r, d in donors.items():
        reference.set_stage(stage, model.replica_weights(replica=d, stage=stage),
                            replicas=torch.tensor([r]))
    reference.zero_grad(set_to_none=True)
    reference(ids, targets).sum().backward()   # replicas are independent: one pass, R losses
    own = {(r, s): _stage_grads(reference, r, s) for r in range(cfg.replicas)
           for s in range(model.S)}

    donor = 0
    carried = [donor, *failed]
    for name, g in got[(donor, stage)].items():
        want = sum(own[(r, stage)][name] for r in carried) / len(carried)
        assert_close(g, want, rtol=1e-5, atol=1e-7, msg=name)
        # not the sum: that would be len(carried) times larger
        assert float(g.abs().max()) > 0
    for r in failed:
        for s in range(model.S):
            for name, g in got[(r, s)].items():
                if s == stage:   # its own stage was not used at all
                    assert torch.count_nonzero(g) == 0, (r, s, name)
                else:            # its other stages: its own batch's gradient, unscaled
                    assert_close(g, own[(r, s)][name], rtol=1e-5, atol=1e-7,
                                 msg=f"{r} {s} {name}")
    for r in range(cfg.replicas):
        if r in carried:
            continue
        for s in range(model.S):
            for name, g in got[(r, s)].items():
                assert_close(g, own[(r, s)][name], rtol=1e-5, atol=1e-7, msg=f"{r} {s} {name}")
    for s in range(model.S):       # the donor's other stages are its own batch's, unscaled
        if s != stage:
            for name, g in got[(donor, s)].items():
                assert_close(g, own[(donor, s)][name], rtol=1e-5, atol=1e-7, msg=f"{s} {name}")


def test_reroute_bytes_count_two_crossings_per_rerouted_stage(tmp_path):
    cfg = tiny(**{"pipeline.compression": "ssn", "faults.strategy": "reroute",
                  "train.global_steps": 3})
    plan = (FaultPlan().down(replica=1, stage=1, start=0, steps=2)
            .down(replica=0, stage=2, start=1, steps=1))
    rerouted_pair_steps = 2 + 1                  # (1, 1) at steps 0 and 1, (0, 2) at step 1
    faulty = train(cfg, out_dir=tmp_path / "faulty", plan=plan)
    clean = train(cfg, out_dir=tmp_path / "clean", plan=FaultPlan())
    H, B, T = cfg.sparseloco.inner_steps, cfg.train.batch_size, cfg.model.seq_len
    R, S, G = cfg.replicas, cfg.pipeline.stages, cfg.train.global_steps
    forward, backward = boundary.wire_bytes(cfg)
    assert (forward, backward) == (2 * 4 + 1, 2 * 4)     # k = 32 / 8 bf16 values, a byte id
    tokens = H * B * T
    assert faulty["bytes"]["boundary_rerouted"] == \
        rerouted_pair_steps * 2 * tokens * (forward + backward)
    assert clean["bytes"]["boundary_rerouted"] == 0
    # a reroute changes where a crossing goes, not how many there are
    assert clean["bytes"]["boundary_forward"] == G * R * (S - 1) * tokens * forward
    assert faulty["bytes"]["boundary_forward"] == clean["bytes"]["boundary_forward"]
    assert faulty["bytes"]["boundary_backward"] == clean["bytes"]["boundary_backward"]
    assert faulty["bytes"]["boundary_rerouted"] <= \
        faulty["bytes"]["boundary_forward"] + faulty["bytes"]["boundary_backward"]


# ------------------------------------------------------------------------------------------------
# 4. SSN exactness on a trained model's real activations
# ------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def trained_ssn(tmp_path_factory):
    # a high lr so that 4 global steps make every block matter to the loss
    cfg = tiny(**{"pipeline.compression": "ssn", "train.global_steps": 4, "train.lr": 2e-2})
    trainer = _trainer(tmp_path_factory.mktemp("ssn"), cfg)
    initial = {n: p.detach().clone() for s in range(trainer.S)
               for n, p in trainer.model.stage_params(s).items()}
    for g in range(4):
        trainer.global_step(g)
    moved = [n for s in range(trainer.S) for n, p in trainer.model.stage_params(s).items()
             if not torch.equal(p.detach(), initial[n])]
    assert len(moved) == len(initial)          # every tensor trained: these are real weights
    ids, targets = trainer.data.batches(replicas=trainer.R, batch_size=cfg.train.batch_size)
    return trainer.model, ids, targets


def test_ssn_codec_is_exact_on_a_trained_models_boundary_activations(trained_ssn):
    model, ids, targets = trained_ssn
    fixed = model.fixed
    taps: dict[int, torch.Tensor] = {}
    with torch.no_grad():
        model(ids, targets, taps=taps)
    assert sorted(taps) == list(range(model.S - 1))
    k = model.config.model.d_model // model.config.pipeline.factor
    for s, x in taps.items():
        message = boundary.encode("ssn", x, ids, sender={}, stage=s, fixed=fixed)
        assert message.shape == (*x.shape[:3], k)
        back = boundary.decode("ssn", message, ids, receiver={}, stage=s + 1, basis=None,
                               fixed=fixed)
        rel = float((back - x).norm() / x.norm())
        assert rel < 1e-5, (s, rel)
        # equivalently: X - Tfix[ids] has no component outside span(U)
        off = (x - fixed.token_table[ids]) @ (torch.eye(x.shape[-1]) - fixed.subspace @ fixed.subspace.T)
        assert float(off.norm() / x.norm()) < 1e-5, s


def _by_hand(model, ids, targets, *, without: int | None, per_sequence=False):
    """The uncompressed model run stage by stage with the kernels of crucible.model, leaving out
    the blocks of stage `without`."""
    params = [{n: p.detach() for n, p in model.stage_params(s).items()} for s in range(model.S)]
    cfg, fixed = model.config, model.fixed
    rope = (model.rope_cos, model.rope_sin)
    x = embed_forward(params[0], ids, subspace=fixed.subspace, token_table=fixed.token_table)
    for s in range(model.S):
        if s == without:
            continue
        subspace = fixed.subspace if reparametrised(cfg, s) else None
        for layer in layers_of(cfg, s):
            x = block_forward(params[s], layer, x, config=cfg, rope=rope, subspace=subspace)
    return head_losses(params[-1], x, targets, per_sequence=per_sequence)


@pytest.mark.parametrize("skipped", [1, 2])
def test_ssn_bypass_equals_the_trained_model_without_that_stages_blocks(trained_ssn, skipped):
    model, ids, targets = trained_ssn
    with torch.no_grad():
        full = _by_hand(model, ids, targets, without=None, per_sequence=True)
        # the by-hand reference is the model: with no stage skipped the codec changes nothing
        assert_close(model(ids, targets, per_sequence=True), full, rtol=0, atol=1e-6)
        bypass = torch.zeros(model.R, model.S, dtype=torch.bool)
        bypass[1, skipped] = True
        skipped_loss = model(ids, targets, bypass=bypass, per_sequence=True)
        reference = _by_hand(model, ids, targets, without=skipped, per_sequence=True)
    assert_close(skipped_loss[1], reference[1], rtol=0, atol=1e-6)
    assert_close(skipped_loss[0], full[0], rtol=0, atol=1e-6)
    # leaving the blocks out changes the loss by far more than the tolerance above
    assert float((reference[1] - full[1]).abs().max()) > 1e-4


# ------------------------------------------------------------------------------------------------
# 5. ReplicaAdamW against one torch.optim.AdamW per (replica, stage)
# ------------------------------------------------------------------------------------------------

_LAYOUTS = [
    [ParamSpec("w0", (5, 3), "normal", 1.0), ParamSpec("g0", (5,), "ones", decay=False)],
    [ParamSpec("w1", (4, 6), "normal", 1.0), ParamSpec("b1", (6,), "zeros", decay=True),
     ParamSpec("g1", (4,), "ones", decay=False),
     ParamSpec("basis", (4, 2), "stiefel", decay=False, inner="stiefel")],
]


def _torch_adamw(tensors, decay, train_cfg):
    decayed = [t for n, t in tensors.items() if n in decay]
    plain = [t for n, t in tensors.items() if n not in decay]
    return torch.optim.AdamW([{"params": decayed, "weight_decay": train_cfg.weight_decay},
                              {"params": plain, "weight_decay": 0.0}],
                             lr=1.0, betas=(train_cfg.beta1, train_cfg.beta2), eps=train_cfg.eps)


@pytest.mark.parametrize("fused", [True, False])
def test_replica_adamw_matches_torch_adamw_per_replica_and_stage(monkeypatch, fused):
    if not fused:
        monkeypatch.setattr("crucible.optim._fused_adamw", None)
    R = 3
    train_cfg = apply_overrides(get_preset("smoke"), {
        "train.weight_decay": 0.3, "train.beta1": 0.8, "train.beta2": 0.97,
        "train.eps": 1e-6}).train
    gen = torch.Generator().manual_seed(0)
    stages = [{spec.name: torch.nn.Parameter(torch.randn(R, *spec.shape, generator=gen))
               for spec in layout} for layout in _LAYOUTS]
    opt = ReplicaAdamW(stages, _LAYOUTS, train=train_cfg, replicas=R)
    decay = {spec.name for layout in _LAYOUTS for spec in layout if spec.decay}
    assert decay == {"w0", "w1", "b1"}

    adam_names = [[spec.name for spec in layout if spec.inner == "adamw"] for layout in _LAYOUTS]
    refs, ref_opts = {}, {}

    def fresh(r, s):
        refs[(r, s)] = {n: torch.nn.Parameter(stages[s][n].detach()[r].clone())
                        for n in adam_names[s]}
        ref_opts[(r, s)] = _torch_adamw(refs[(r, s)], decay, train_cfg)

    for r in range(R):
        for s in range(len(_LAYOUTS)):
            fresh(r, s)
    basis_before = stages[1]["basis"].detach().clone()
    counts = torch.zeros(R, len(_LAYOUTS), dtype=torch.long)

    # steps 0-2: everyone (one fused call per stage); then pairs skip; reset (1, 0) after step 4
    schedule = [
        [[1, 1], [1, 1], [1, 1]],
        [[1, 1], [1, 1], [1, 1]],
        [[1, 1], [1, 1], [1, 1]],
        [[1, 0], [1, 1], [0, 1]],
        [[1, 1], [0, 1], [0, 0]],
        [[1, 1], [1, 1], [1, 1]],
        [[0, 1], [1, 0], [1, 1]],
        [[1, 1], [1, 1], [1, 1]],
    ]
    for i, mask in enumerate(schedule):
        if i == 5:
            opt.reset(replica=1, stage=0)
            counts[1, 0] = 0
            fresh(1, 0)                              # a fresh AdamW from the current weights
        active = torch.tensor(mask, dtype=torch.bool)
        lr = 0.05 * (1 + 0.3 * math.sin(i))
        before = {s: {n: p.detach().clone() for n, p in stages[s].items()}
                  for s in range(len(_LAYOUTS))}
        moments = [{n: (opt.exp_avg[s][n].clone(), opt.exp_avg_sq[s][n].clone())
                    for n in adam_names[s]} for s in range(len(_LAYOUTS))]
        for params in stages:
            for p in params.values():
                p.grad = torch.randn(p.shape, generator=gen)
        opt.step(lr=lr, active=active)
        counts += active.long()
        assert torch.equal(opt.steps.cpu(), counts), i
        for r in range(R):
            for s in range(len(_LAYOUTS)):
                if not mask[r][s]:
                    # skipped: weights and moments untouched
                    for n in stages[s]:
                        assert torch.equal(stages[s][n].detach()[r], before[s][n][r]), (i, r, s, n)
                    for n in adam_names[s]:
                        assert torch.equal(opt.exp_avg[s][n][r], moments[s][n][0][r])
                        assert torch.equal(opt.exp_avg_sq[s][n][r], moments[s][n][1][r])
                    continue
                ref_opt = ref_opts[(r, s)]
                for group in ref_opt.param_groups:
                    group["lr"] = lr
                for n, ref in refs[(r, s)].items():
                    ref.grad = stages[s][n].grad[r].clone()
                ref_opt.step()
        for r in range(R):
            for s in range(len(_LAYOUTS)):
                for n, ref in refs[(r, s)].items():
                    assert_close(stages[s][n].detach()[r], ref.detach(), rtol=1e-6, atol=1e-6,
                                 msg=f"step {i} replica {r} stage {s} {n}")
                    state = ref_opts[(r, s)].state.get(ref)
                    if state:
                        assert_close(opt.exp_avg[s][n][r], state["exp_avg"], rtol=1e-6,
                                     atol=1e-7)
                        assert_close(opt.exp_avg_sq[s][n][r], state["exp_avg_sq"], rtol=1e-6,
                                     atol=1e-9)
                        assert int(state["step"]) == int(counts[r, s])
    # the Stiefel-managed basis is not AdamW's to touch
    assert torch.equal(stages[1]["basis"].detach(), basis_before)

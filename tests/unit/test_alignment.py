"""The alignment report (crucible/alignment.py) and the batched Stiefel step: CKA and principal
angles against cases with known answers, the report's bypass damage against the trainer's own
evaluation with a stage skipped, and one batch of every boundary's SPEL step equal to the bit
to one step per boundary."""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from crucible import boundary
from crucible.alignment import alignment_report, linear_cka
from crucible.boundary import principal_angles_deg
from crucible.config import apply_overrides
from crucible.events import MultiCallback
from crucible.store import LocalStore
from crucible.train import Trainer
from tests.unit.helpers import tiny


def test_linear_cka_known_cases() -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2000, 16, generator=gen)
    q, _ = torch.linalg.qr(torch.randn(16, 16, generator=gen))
    assert linear_cka(x, x) == pytest.approx(1.0, abs=1e-12)
    assert linear_cka(x, 3.0 * x @ q + 5.0) == pytest.approx(1.0, abs=1e-9)   # rotation, scale
    independent = linear_cka(x, torch.randn(2000, 16, generator=gen))
    assert 0.0 <= independent < 0.05          # ~ d / N for independent Gaussians
    # keeping half the coordinates keeps half of an isotropic signal's CKA... about 1/sqrt(2)
    half = x.clone()
    half[:, 8:] = 0
    assert linear_cka(x, half) == pytest.approx(1 / math.sqrt(2), abs=0.03)


def test_principal_angles_known_cases() -> None:
    eye = torch.eye(6)
    assert principal_angles_deg(eye[:, :3], eye[:, :3]).max() == pytest.approx(0.0, abs=1e-5)
    assert principal_angles_deg(eye[:, :3], eye[:, 3:]).min() == pytest.approx(90.0, abs=1e-5)
    c, s = math.cos(math.radians(30)), math.sin(math.radians(30))
    tilted = torch.zeros(6, 3)
    tilted[0, 0], tilted[3, 0] = c, s          # one direction turned by 30 degrees
    tilted[1, 1] = tilted[2, 2] = 1.0
    angles = principal_angles_deg(eye[:, :3], tilted)
    assert angles.tolist() == pytest.approx([0.0, 0.0, 30.0], abs=1e-4)


def _trained(tmp_path: Path, compression: str) -> Trainer:
    cfg = tiny(**{"pipeline.compression": compression, "pipeline.factor": 4})
    trainer = Trainer(cfg, store=LocalStore(tmp_path / f"store-{compression}"),
                      run_key=compression, callback=MultiCallback())
    trainer.run()
    return trainer


@pytest.mark.parametrize("compression", ["none", "ssn", "mapl"])
def test_report_damage_is_the_trainers_own_skip_evaluation(tmp_path: Path, compression) -> None:
    trainer = _trained(tmp_path, compression)
    windows = sum(ids.shape[0] for ids, _ in trainer.validation)
    report = alignment_report(trainer.evaluator, windows=windows)
    assert report["windows"] == windows
    intact = trainer.evaluator.window_losses()
    assert [row["stage"] for row in report["stages"]] == list(range(1, trainer.S - 1))
    for row in report["stages"]:
        skip = torch.zeros(1, trainer.S, dtype=torch.bool)
        skip[0, row["stage"]] = True
        damaged = trainer.evaluator.window_losses(bypass=skip)
        expected = float(((damaged - intact) / intact.mean() * 100).mean())
        assert row["bypass_damage_pct"] == pytest.approx(expected, rel=1e-6, abs=1e-9)
        assert 0.0 <= row["cka"] <= 1.0 + 1e-9 and row["update_ratio"] > 0
        if compression == "ssn":
            assert row["angle_mean_deg"] == 0.0
        if compression == "mapl":
            assert set(row["bypass_damage_by_decode"]) == {"identity", "sender", "receiver"}
            assert row["bypass_damage_by_decode"][trainer.model.bypass_decode] == \
                row["bypass_damage_pct"]
            assert 0.0 <= row["angle_mean_deg"] <= row["angle_max_deg"] <= 90.0
        if compression == "none":
            assert "angle_mean_deg" not in row
    assert trainer.model.bypass_decode == trainer.config.pipeline.bypass_decode   # restored


def test_a_run_records_its_alignment_when_asked(tmp_path: Path) -> None:
    """`train(alignment=True)` (what a study asks of its baselines) adds the report; a run
    nobody asks it of does not pay for it, and the report reads the same weights either way."""
    cfg = tiny(**{"pipeline.compression": "ssn", "pipeline.factor": 4})
    from crucible.train import train

    summary = train(cfg, out_dir=tmp_path / "run", progress=False, alignment=True)
    assert len(summary["alignment"]["stages"]) == cfg.pipeline.stages - 2
    plain = train(cfg, out_dir=tmp_path / "plain", progress=False)
    assert "alignment" not in plain and "alignment_s" not in plain["timing"]
    assert plain["final_val_loss"] == summary["final_val_loss"]
    # the report of the model file, without a trainer, is the trainer's to the bit
    from crucible.evaluation import Evaluator
    from crucible.model_file import MODEL_FILE, load_global_weights
    again = alignment_report(Evaluator.of_weights(cfg, load_global_weights(
        tmp_path / "plain" / MODEL_FILE)))
    again.pop("seconds")
    assert again == summary["alignment"]
    failing = apply_overrides(cfg, ["faults.p=0.3", "faults.strategy=skip"])
    assert "alignment" in train(failing, out_dir=tmp_path / "failing", progress=False,
                                alignment=True)
    assert summary["timing"]["alignment_s"] > 0 and "seconds" not in summary["alignment"]
    assert summary["data_digest"].startswith("sha256:") and len(summary["data_digest"]) == 71


def test_batched_stiefel_step_equals_one_step_per_boundary_to_fp32_round_off() -> None:
    """Batching the boundaries changes only the batch count of each matmul. On an Intel Xeon
    (AVX-512 MKL kernels) that was bit-identical; on an AMD EPYC (AVX2) 2 of these 6 tensors
    differ in their last bit (1.2e-7), so what holds on every CPU is agreement to a few ulps,
    and the mask is obeyed exactly."""
    gen = torch.Generator().manual_seed(0)
    R, d, k = 4, 32, 8
    bases = [boundary.retract(torch.linalg.qr(torch.randn(R, d, k, generator=gen))[0], 5)
             for _ in range(3)]
    grads = [torch.randn(R, d, k, generator=gen) for _ in range(3)]
    momenta = [0.1 * torch.randn(R, d, k, generator=gen) for _ in range(3)]
    masks = [torch.tensor([True, False, True, True]), torch.zeros(R, dtype=torch.bool),
             torch.ones(R, dtype=torch.bool)]
    one = [b.clone() for b in bases], [m.clone() for m in momenta]
    for b, g, m, mask in zip(*one[:1], grads, one[1], masks, strict=True):
        boundary.stiefel_step(b, g, m, lr=0.01, beta=0.9, steps=5, mask=mask)
    batched = [b.clone() for b in bases], [m.clone() for m in momenta]
    boundary.stiefel_steps(batched[0], grads, batched[1], masks, lr=0.01, beta=0.9, steps=5)
    ulp = torch.finfo(torch.float32).eps
    for a, b in zip(one[0] + one[1], batched[0] + batched[1], strict=True):
        assert (a - b).abs().max().item() <= 4 * ulp * max(1.0, a.abs().max().item())
    assert torch.equal(batched[0][1], bases[1])        # a boundary with no active replica
    assert torch.equal(batched[1][1], momenta[1])
    # replica 1 of boundary 0 is masked off: its basis and momentum stay exactly as they were
    assert torch.equal(batched[0][0][1], bases[0][1]) and torch.equal(batched[1][0][1],
                                                                       momenta[0][1])
    assert not torch.equal(batched[0][2], bases[2])


def test_report_windows_are_evenly_spaced_and_batched(tmp_path: Path) -> None:
    from crucible.alignment import CkaMoments, _windows

    trainer = _trained(tmp_path, "none")
    every = torch.cat([x for x, _ in trainer.validation])
    batches = _windows(trainer, 5)
    picked = torch.cat([x for x, _ in batches])
    step = every.shape[0] / 5
    assert torch.equal(picked, every[[int(i * step) for i in range(5)]])
    # moments summed over batches give the CKA of the whole
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(300, 8, generator=gen), torch.randn(300, 8, generator=gen)
    y = y + 2 * x
    moments = CkaMoments(8, torch.device("cpu"))
    for i in range(0, 300, 64):
        moments.add(x[i:i + 64], y[i:i + 64])
    assert moments.cka() == pytest.approx(linear_cka(x, y), rel=1e-10)


def _whole_forward(monkeypatch: pytest.MonkeyPatch, model: torch.nn.Module) -> None:
    """`model`'s forward as before the shortcuts: every stage computed from the embedding on
    (a `taps` dict turns the bypassed stage's shortcut off; `resume` is ignored)."""
    forward = type(model).forward

    def whole(self, *args, resume=None, taps=None, **kwargs):
        return forward(self, *args, taps={} if taps is None else taps, **kwargs)

    monkeypatch.setattr(type(model), "forward", whole)


@pytest.mark.parametrize("compression", ["none", "ssn", "mapl"])
def test_bypassed_forwards_resumed_and_shortcut_are_the_whole_forward_bit_for_bit(
        tmp_path: Path, compression) -> None:
    from crucible.evaluation import bypass_mask, decoding

    trainer = _trained(tmp_path, compression)
    model, S = trainer.model, trainer.S
    select = torch.tensor([0])
    ids, targets = next(iter(trainer.validation))
    ids, targets = ids[None], targets[None]
    decodes = ("identity", "sender", "receiver") if compression == "mapl" else (None,)
    with torch.no_grad():
        messages: dict[int, torch.Tensor] = {}
        intact = model(ids, targets, select=select, messages=messages, per_sequence=True)
        assert torch.equal(intact, model(ids, targets, select=select, per_sequence=True))
        assert sorted(messages) == list(range(S - 1))
        for s in range(1, S - 1):
            skip = bypass_mask(S, s, "cpu")
            for decode in decodes:
                with decoding(model, decode):
                    whole = model(ids, targets, select=select, bypass=skip, per_sequence=True,
                                  taps={})
                    shortcut = model(ids, targets, select=select, bypass=skip, per_sequence=True)
                    resumed = model(ids, targets, select=select, bypass=skip, per_sequence=True,
                                    resume=(s, messages[s - 1]))
                assert not torch.equal(whole, intact)
                assert torch.equal(shortcut, whole) and torch.equal(resumed, whole)


@pytest.mark.parametrize("compression", ["none", "mapl"])
def test_report_is_the_one_of_whole_forwards_bit_for_bit(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, compression) -> None:
    trainer = _trained(tmp_path, compression)
    report = alignment_report(trainer.evaluator, windows=64)
    _whole_forward(monkeypatch, trainer.model)
    whole = alignment_report(trainer.evaluator, windows=64)
    report.pop("seconds"), whole.pop("seconds")
    assert report == whole


def test_the_basis_report_stops_after_the_last_boundary_and_is_the_whole_forwards(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    trainer = _trained(tmp_path, "mapl")
    model, S = trainer.model, trainer.S
    ids = torch.cat([x for x, _ in trainer.validation])[None]
    select = torch.tensor([0])
    with torch.no_grad():
        taps: dict[int, torch.Tensor] = {}
        whole: dict[int, torch.Tensor] = {}
        assert model(ids, ids, select=select, taps=taps, last=S - 2) is None
        model(ids, ids, select=select, taps=whole)
    assert sorted(taps) == list(range(S - 1))
    assert all(torch.equal(taps[s], whole[s]) for s in whole)
    stopped = trainer.evaluator.basis_report()
    forward = type(model).forward
    ran = []

    def counted(self, *args, last=None, **kwargs):   # the report again, from whole forwards
        ran.append(last)
        return forward(self, *args, last=None, **kwargs)

    monkeypatch.setattr(type(model), "forward", counted)
    assert trainer.evaluator.basis_report() == stopped and ran == [S - 2]

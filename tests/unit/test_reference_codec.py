"""The plain loop with MAPL's boundaries (benchmarks/reference.py, `codec="mapl"`): the codec is
really in the forward (with zero anchors, lossless at factor 1 and not at factor 8), its bases take SPEL steps and stay
orthonormal, and sim_throughput pairs the mapl arm with it under `--reference codec`, or with it
and the plain loop in the same runs under `--reference both`."""
from pathlib import Path

import pytest
import torch

from benchmarks import reference, sim_throughput
from benchmarks.reference import ReferenceLoop, ReferenceModel, _spel_step
from benchmarks.sim_throughput import also_codec, measure, reference_codec
from crucible import boundary
from crucible.presets import get_preset


def _batch(config, n: int = 3, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(config.model.vocab_size, (n, config.model.seq_len + 1), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]


def test_mapl_boundaries_are_in_the_forward() -> None:
    config = get_preset("smoke")
    ids, targets = _batch(config)
    torch.manual_seed(0)
    plain = ReferenceModel(config.model)
    for factor, lossless in ((1, True), (8, False)):
        coded = ReferenceModel(config.model, mapl=(config.pipeline.stages, factor))
        coded.load_state_dict(plain.state_dict(), strict=False)   # the same blocks
        for table in coded.anchors:   # a stage adds its own anchor back, the sender's came off:
            torch.nn.init.zeros_(table.weight)   # zero anchors, so that only the bases act
        with torch.no_grad():
            same = torch.allclose(coded(ids, targets), plain(ids, targets), rtol=1e-5, atol=1e-5)
        assert same == lossless, f"factor {factor}"


def test_the_reference_spel_step_is_the_simulators() -> None:
    gen = torch.Generator().manual_seed(2)
    basis = torch.linalg.qr(torch.randn(64, 8, generator=gen))[0].contiguous()
    grad = torch.randn(64, 8, generator=gen)
    momentum = 0.1 * torch.randn(64, 8, generator=gen)
    theirs = [basis[None].clone(), momentum[None].clone()]
    boundary.stiefel_step(theirs[0], grad[None], theirs[1], lr=0.02, beta=0.9, steps=5,
                          mask=torch.ones(1, dtype=torch.bool))
    _spel_step(basis, grad, momentum, lr=0.02, beta=0.9, steps=5)
    assert torch.allclose(basis, theirs[0][0], atol=1e-5)
    assert torch.allclose(momentum, theirs[1][0], atol=1e-6)
    assert not torch.allclose(basis, theirs[0][0] - 0.01, atol=1e-5)


def test_a_mapl_reference_step_trains_anchors_and_steps_bases_on_the_manifold(
        monkeypatch: pytest.MonkeyPatch) -> None:
    config = get_preset("smoke")
    clipped: list[list[torch.Tensor]] = []
    clip = torch.nn.utils.clip_grad_norm_

    def spy(parameters, max_norm):
        parameters = list(parameters)
        clipped.append(parameters)
        return clip(parameters, max_norm)

    monkeypatch.setattr(reference.nn.utils, "clip_grad_norm_", spy)
    loop = ReferenceLoop(config, total_steps=10, codec="mapl")
    model = loop.model
    assert len(model.bases) == config.pipeline.stages - 1
    assert len(model.anchors) == config.pipeline.stages
    bases = [b.detach().clone() for b in model.bases]
    anchors = [a.weight.detach().clone() for a in model.anchors]
    for _ in range(2):
        loop.step()
    eye = torch.eye(bases[0].shape[1])
    for before, after in zip(bases, model.bases, strict=True):
        assert not torch.equal(before, after.detach())
        assert torch.allclose(after.detach().T @ after.detach(), eye, atol=1e-4)
    assert all(not torch.equal(a, t.weight.detach()) for a, t in zip(anchors, model.anchors,
                                                                      strict=True))
    # the bases are not AdamW's: their only update is the SPEL step
    adamw = {id(p) for group in loop.opt.param_groups for p in group["params"]}
    assert not adamw & {id(b) for b in model.bases}
    # and they are not clipped with AdamW's gradients (the simulator does not clip them)
    assert len(clipped) == 2 and {id(p) for p in clipped[0]} == adamw
    with pytest.raises(ValueError, match="codec"):
        ReferenceLoop(config, total_steps=1, codec="ssn")


def test_sim_throughput_pairs_only_the_mapl_arm_with_the_codec_reference(tmp_path: Path) -> None:
    assert reference_codec("mapl", "codec") == "mapl"
    assert {reference_codec(a, "codec") for a in ("none", "ssn", "skip_p0.2")} == {"none"}
    assert reference_codec("mapl", "plain") == "none"
    with pytest.raises(ValueError, match="reference"):
        reference_codec("mapl", "fused")
    result = measure("smoke", arms=["mapl"], repeats=1, global_steps=1, phases=False,
                     scratch=tmp_path, reference="codec")
    arm = result["arms"]["mapl"]
    assert arm["ratio"] > 0 and arm["reference_tokens_per_s"] > 0
    assert result["reference"] == "codec" and arm["reference_codec"] == "mapl"


def test_both_pairs_the_mapl_arm_with_each_loop_in_the_same_runs(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert also_codec("mapl", "both") == "mapl" and reference_codec("mapl", "both") == "none"
    assert {also_codec(a, r) for a in ("none", "ssn", "skip_p0.2") for r in ("plain", "codec", "both")} \
        | {also_codec("mapl", "plain"), also_codec("mapl", "codec")} == {None}
    built: list[ReferenceLoop] = []
    init = ReferenceLoop.__init__

    def spy(self, *args, **kwargs):
        init(self, *args, **kwargs)
        built.append(self)

    monkeypatch.setattr(ReferenceLoop, "__init__", spy)
    result = measure("smoke", arms=["none", "mapl"], repeats=2, global_steps=1, phases=False,
                     scratch=tmp_path, reference="both")
    # per repeat: one plain loop for none; a plain and a codec loop for mapl, run alike
    assert [loop.model.stages > 1 for loop in built] == [False, False, True] * 2
    assert built[1].done == built[2].done > 1
    mapl, none = result["arms"]["mapl"], result["arms"]["none"]
    assert "against_codec" not in none and "also_codec" not in none
    assert mapl["reference_codec"] == "none" and mapl["also_codec"] == "mapl"
    coded = mapl["against_codec"]
    assert len(coded["ratios"]) == len(mapl["ratios"]) == 2 and coded["interval"]["n"] == 2
    # each pair's two ratios and the loops' speeds are one run's: ratio_plain / ratio_codec is
    # the codec loop's speed over the plain loop's, pair by pair
    cost = mapl["codec_loop_over_plain"]["ratios"]
    for plain, codec, c in zip(mapl["ratios"], coded["ratios"], cost, strict=True):
        assert plain / codec == pytest.approx(c, rel=1e-3)   # (the timing itself: next test)
    assert result["reference"] == "both" and result["worst_arm"] in ("none", "mapl")
    with pytest.raises(ValueError, match="interleav"):
        measure("smoke", arms=["mapl"], repeats=1, global_steps=1, phases=False,
                scratch=tmp_path, reference="both", interleave=False)


class _Loop:
    """A reference loop whose steps and evaluations take a known time on the test's clock."""

    def __init__(self, clock: list[float], seconds: float) -> None:
        self.clock, self.seconds, self.done, self.tokens_per_step = clock, seconds, 1, 1000

    def step(self) -> None:
        self.clock[0] += self.seconds
        self.done += 1

    def evaluate(self, windows) -> float:
        self.clock[0] += 2 * self.seconds
        return 0.0


def test_each_interleaved_loop_is_timed_apart_and_taken_out_of_the_run(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # the clock the benchmark (and the trainer) reads: real time plus what the loops "spend"
    clock = [0.0]
    real = sim_throughput.time.perf_counter
    monkeypatch.setattr(sim_throughput.time, "perf_counter", lambda: real() + clock[0])
    config = sim_throughput.arm_config("smoke", "mapl", global_steps=2)
    plain, coded = _Loop(clock, 100.0), _Loop(clock, 300.0)
    run = sim_throughput.crucible_run(config, scratch=tmp_path, reference=plain, also=coded)
    steps = config.train.global_steps * config.sparseloco.inner_steps
    assert plain.done == coded.done == steps + 1
    # each loop's speed is its own time's (its evaluations included), not the other's
    assert run["reference_tokens_per_s"] / run["also_tokens_per_s"] == pytest.approx(3, rel=1e-4)
    assert run["reference_tokens_per_s"] < steps * 1000 / (100.0 * steps)
    # and neither loop's 400 * steps "seconds" is left in the run's own wall time
    assert 0 < run["wall_s"] < 100 and 0 < run["loop_s"] < 100
    alone = sim_throughput.crucible_run(config, scratch=tmp_path, reference=_Loop(clock, 100.0))
    assert "also_tokens_per_s" not in alone and 0 < alone["wall_s"] < 100
    with pytest.raises(ValueError, match="second reference"):
        sim_throughput.crucible_run(config, scratch=tmp_path, also=coded)


def test_both_without_interleaving_is_refused_on_the_command_line(
        capsys: pytest.CaptureFixture[str]) -> None:
    for argv, named in ((["--reference", "both", "--separate"], "--separate"),
                        (["--reference", "both", "--arms", "none"], "add mapl"),
                        (["--reference", "codec", "--arms", "ssn"], "add mapl")):
        with pytest.raises(SystemExit) as stop:
            sim_throughput.main(argv)
        assert stop.value.code == 2
        assert named in capsys.readouterr().err

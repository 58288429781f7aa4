"""The outer round on the training device: the same bits on the CPU, fp32 round-off on a GPU,
and overlapped uploads that never change what is aggregated.

The CPU tests run everywhere. The `gpu` tests need a CUDA device and are skipped without one;
`benchmarks/gpu_check.sh` runs them on a machine that has one.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from crucible.events import NullCallback
from crucible.sparseloco import aggregate, decode_contribution, decode_contributions
from crucible.sparseloco.codec import encode_contribution, encode_contributions_batched
from crucible.sparseloco.outer import NonFiniteUpdate, OuterSGD
from crucible.store import LocalStore, StoreError
from crucible.sync import PHASES
from crucible.train import Trainer
from tests.unit.helpers import tiny


def gpu(test):
    """A test that needs a CUDA device (marked `gpu`, skipped without one)."""
    skip = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
    return pytest.mark.gpu(skip(test))


# a stage-like mix: repeated shapes, non-multiples of 64, 1-D, a long row (the serial path)
SHAPES = {"wq": (64, 128), "wk": (64, 128), "w1": (100, 70), "norm": (64,), "bias": (100,),
          "scalar": (), "long": (1, 40_000)}


def _stage(n_rep: int, seed: int, scale: float) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {n: torch.randn((n_rep, *s), generator=gen) * scale for n, s in SHAPES.items()}


def _encode(delta, error, replicas):
    return encode_contributions_batched(delta, error, beta=0.95, stage=1, replicas=replicas,
                                        global_step=3, run_tag=11)


# -- the CPU: bit for bit ------------------------------------------------------------------------
def test_the_round_on_cpu_is_todays_codec_bit_for_bit() -> None:
    """Encode, batch decode and aggregate of the device-resident code, on the CPU, against the
    one-replica reference codec and decoder: the same bytes, buffers, values and aggregate."""
    replicas = [0, 2, 5]
    delta, error = _stage(3, 0, 1e-3), _stage(3, 1, 1e-2)
    blobs, new_error = _encode(delta, error, replicas)
    singles = []
    for i, replica in enumerate(replicas):
        blob, want_error = encode_contribution(
            {n: d[i] for n, d in delta.items()}, {n: e[i] for n, e in error.items()},
            beta=0.95, stage=1, replica=replica, global_step=3, run_tag=11)
        assert blobs[i] == blob
        assert all(torch.equal(new_error[n][i], want_error[n]) for n in SHAPES)
        singles.append(decode_contribution(blob, SHAPES, stage=1))
    batch = decode_contributions(blobs, SHAPES, stage=1, device="cpu")
    for got, want in zip(batch, singles, strict=True):
        for name in SHAPES:
            g, w = got.params[name], want.params[name]
            assert torch.equal(g.indices, w.indices) and torch.equal(g.values, w.values)
            # the norm the batch decoder took is the one the lazy path takes
            assert g.norm_sq() == float(torch.sum(w.values.double() ** 2))
    for mode in ("selected_mean", "mean_over_all"):
        a = aggregate(batch, SHAPES, mode=mode, device="cpu")
        b = aggregate(singles, SHAPES, mode=mode)
        assert all(torch.equal(a[n], b[n]) for n in SHAPES)


def test_a_contribution_decoded_elsewhere_is_aggregated_on_the_given_device() -> None:
    delta, error = _stage(2, 2, 1e-3), _stage(2, 3, 0.0)
    blobs, _ = _encode(delta, error, [0, 1])
    contributions = [decode_contribution(b, SHAPES, stage=1) for b in blobs]
    update = aggregate(contributions, SHAPES, device=torch.device("cpu"))
    assert {t.device.type for t in update.values()} == {"cpu"}
    assert set(update) == set(SHAPES) and all(update[n].shape == SHAPES[n] for n in SHAPES)


def test_the_outer_step_checks_every_update_before_it_applies_one() -> None:
    theta = {"a": torch.ones(3), "b": torch.ones(2)}
    with pytest.raises(NonFiniteUpdate, match="'b'"):
        OuterSGD(lr=1.0).step(theta, {"a": torch.ones(3), "b": torch.tensor([1.0, float("nan")])})
    assert torch.equal(theta["a"], torch.ones(3)) and torch.equal(theta["b"], torch.ones(2))


def _run(tmp_path: Path, name: str, threads: int, **overrides: object) -> Trainer:
    trainer = Trainer(tiny(**overrides), store=LocalStore(tmp_path / name), run_key="r",
                      callback=NullCallback())
    trainer.sync.transfer_threads = threads
    trainer.run()
    return trainer


@pytest.mark.parametrize("compression", ["none", "mapl"])
def test_overlapped_uploads_leave_every_number_as_inline_uploads(tmp_path: Path,
                                                                  compression: str) -> None:
    """Uploads on four threads beside the next stage's encoding, against none: the same global
    weights and losses to the bit, with faults (a skipped stage: fewer uploads in a round)."""
    overrides = {"pipeline.compression": compression, "faults.p": 0.3,
                 "faults.strategy": "skip", "pipeline.stages": 4}
    inline = _run(tmp_path, "inline", 0, **overrides)
    threaded = _run(tmp_path, "threaded", 4, **overrides)
    for a, b in zip(inline.sync.global_weights, threaded.sync.global_weights, strict=True):
        assert all(torch.equal(a[n], b[n]) for n in a)
    assert inline.counters.evals == threaded.counters.evals
    assert sorted(p.relative_to(tmp_path / "inline") for p in (tmp_path / "inline").rglob("*")) \
        == sorted(p.relative_to(tmp_path / "threaded") for p in (tmp_path / "threaded").rglob("*"))


def test_the_round_times_its_phases_inside_the_sync(tmp_path: Path) -> None:
    """Every phase is timed; the ones the round's own thread spends add up to at most the sync
    time (uploads on threads are counted apart: `upload`; what the round waited, `upload_wait`);
    inline, the round waits for all of the upload time."""
    for threads in (0, 4):
        trainer = _run(tmp_path, f"t{threads}", threads)
        codec, timing = trainer.sync.codec_s, trainer.counters.timing
        assert set(codec) == set(PHASES)
        assert all(v > 0 for v in codec.values()), codec
        assert sum(codec[p] for p in PHASES if p != "upload") <= timing["sync_s"]
        assert all(timing[f"{p}_s"] == codec[p] for p in PHASES)
        if threads == 0:
            assert codec["upload_wait"] >= codec["upload"]


class _FailingStore(LocalStore):
    """Refuses the upload of one contribution key; counts the others."""

    def __init__(self, root: Path, refuse: str) -> None:
        super().__init__(root)
        self.refuse, self.puts = refuse, []

    def put(self, key: str, data: bytes, *, durable: bool = True) -> None:
        if key.endswith(self.refuse):
            raise StoreError(f"refused {key}")
        super().put(key, data, durable=durable)
        self.puts.append(key)


@pytest.mark.parametrize("threads", [0, 4])
def test_an_upload_error_on_a_thread_fails_the_round_and_nothing_is_agreed(
        tmp_path: Path, threads: int) -> None:
    store = _FailingStore(tmp_path / "store", "00000000/stage-1/replica-1")
    trainer = Trainer(tiny(**{"pipeline.stages": 4}), store=store, run_key="r",
                      callback=NullCallback())
    trainer.sync.transfer_threads = threads
    with pytest.raises(StoreError, match="refused"):
        trainer.global_step(0)
    # stage 0 was agreed before stage 1's upload was waited for; no stage after it was
    assert not any("manifest" in k and "/stage-1/" in k for k in store.puts)
    assert not any("manifest" in k and "/stage-2/" in k for k in store.puts)


def test_a_checkpoint_that_timed_only_encode_and_decode_still_loads(tmp_path: Path) -> None:
    trainer = Trainer(tiny(), store=LocalStore(tmp_path / "s"), run_key="c",
                      callback=NullCallback())
    state = trainer.sync.state_dict()
    state["codec_s"] = {"encode": 1.5, "decode": 0.5}
    trainer.sync.load_state_dict(state)
    assert trainer.sync.codec_s == {**dict.fromkeys(PHASES, 0.0), "encode": 1.5, "decode": 0.5}


# -- a GPU: fp32 round-off -----------------------------------------------------------------------
@gpu
@pytest.mark.parametrize("seed", [0, 1])
def test_gpu_encode_selects_the_same_values_and_agrees_to_round_off(seed: int) -> None:
    replicas = [0, 1, 3, 4]
    delta, error = _stage(4, seed, 1e-3), _stage(4, seed + 10, 1e-2)
    cpu_blobs, cpu_error = _encode(delta, error, replicas)
    dev = {n: t.cuda() for n, t in delta.items()}
    gpu_blobs, gpu_error = _encode(dev, {n: t.cuda() for n, t in error.items()}, replicas)
    assert all(t.device.type == "cuda" for t in gpu_error.values())
    cpu = decode_contributions(cpu_blobs, SHAPES, stage=1)
    gpu = decode_contributions(gpu_blobs, SHAPES, stage=1, device="cuda")
    for c, g in zip(cpu, gpu, strict=True):
        for name in SHAPES:
            assert torch.equal(c.params[name].indices, g.params[name].indices.cpu()), name
            torch.testing.assert_close(g.params[name].values.cpu(), c.params[name].values,
                                       rtol=1e-5, atol=1e-9)
    for name in SHAPES:
        # e_new + decoded == beta * e + delta holds on the device as on the CPU
        torch.testing.assert_close(gpu_error[name].cpu(), cpu_error[name], rtol=1e-5, atol=1e-8)
    for mode in ("selected_mean", "mean_over_all"):
        a = aggregate(gpu, SHAPES, mode=mode, device="cuda")
        b = aggregate(cpu, SHAPES, mode=mode)
        for name in SHAPES:
            assert a[name].device.type == "cuda"
            torch.testing.assert_close(a[name].cpu(), b[name], rtol=1e-5, atol=1e-8)
    # and on the device, the same inputs give the same bits every time
    again, _ = _encode(dev, {n: t.cuda() for n, t in error.items()}, replicas)
    assert again == gpu_blobs


@gpu
def test_gpu_batch_decode_is_the_single_decoder_bit_for_bit() -> None:
    blobs, _ = _encode(_stage(3, 5, 1e-3), _stage(3, 6, 1e-2), [0, 1, 2])
    gpu = decode_contributions(blobs, SHAPES, stage=1, device="cuda")
    for blob, g in zip(blobs, gpu, strict=True):
        want = decode_contribution(blob, SHAPES, stage=1)
        for name in SHAPES:  # integer unpacking and one fp32 add: exact on any device
            assert torch.equal(g.params[name].values.cpu(), want.params[name].values)
            assert torch.equal(g.params[name].indices.cpu(), want.params[name].indices)


@gpu
def test_gpu_outer_round_agrees_with_the_cpus_to_round_off(tmp_path: Path) -> None:
    """The whole round (encode, store, batch decode, aggregate, outer step) of the same weights
    on each device: the same initial weights (built on the host), the same local steps (added
    from one generator), so the pseudo-gradients are the same values and the selections the
    same; the new global weights agree to fp32 round-off of the quantisation statistics."""
    syncs = {}
    for device in ("cpu", "cuda"):
        trainer = Trainer(tiny(**{"train.device": device, "pipeline.stages": 4}),
                          store=LocalStore(tmp_path / device), run_key="r",
                          callback=NullCallback())
        gen = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for stage in range(4):
                for param in trainer.model.stage_params(stage).values():
                    param.add_(torch.randn(param.shape, generator=gen).to(param.device) * 1e-3)
        contributes = torch.ones((trainer.R, trainer.S), dtype=torch.bool)
        trainer.sync.synchronise(0, contributes)
        assert trainer.sync.device.type == device
        syncs[device] = trainer.sync
    for c, g in zip(syncs["cpu"].global_weights, syncs["cuda"].global_weights, strict=True):
        for name in c:
            assert g[name].device.type == "cuda"
            torch.testing.assert_close(g[name].cpu(), c[name], rtol=1e-5, atol=1e-7)
    for c, g in zip(syncs["cpu"].errors, syncs["cuda"].errors, strict=True):
        for name in c:
            torch.testing.assert_close(g[name].cpu(), c[name], rtol=1e-5, atol=1e-8)


@gpu
def test_gpu_resume_puts_the_round_back_on_the_device(tmp_path: Path) -> None:
    """A checkpoint is read onto the CPU; the resumed round's weights, error buffers and outer
    momentum go back to the GPU, and the next round runs (DiLoCo: momentum buffers too)."""
    config = tiny(**{"train.device": "cuda", "sparseloco.method": "diloco"})
    first = Trainer(config, store=LocalStore(tmp_path / "a"), run_key="r",
                    callback=NullCallback())
    first.global_step(0)
    state = first.sync.state_dict()
    on_cpu = {"global_weights": [{n: t.cpu() for n, t in w.items()}
                                 for w in state["global_weights"]],
              "errors": [{n: t.cpu() for n, t in e.items()} for e in state["errors"]],
              "codec_s": state["codec_s"],
              "outer": [{**o, "buffers": {n: b.cpu() for n, b in o["buffers"].items()}}
                        for o in state["outer"]]}
    first.sync.load_state_dict(on_cpu)
    assert all(t.device.type == "cuda" for w in first.sync.global_weights for t in w.values())
    assert all(b.device.type == "cuda" for o in first.sync.outer for b in o.buffers.values())
    first.global_step(1)

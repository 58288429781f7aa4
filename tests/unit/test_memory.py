"""The memory estimate: its activation count against what autograd really saves, the machine's
available memory from cgroup files, and the refusal of a run that cannot fit."""
from __future__ import annotations

import pytest
import torch

import crucible.memory
from crucible.config import ConfigError, apply_overrides
from crucible.memory import (
    MemoryBusy,
    _cgroup_room,
    _gpu_free,
    _saved_bytes_per_token,
    available,
    check_fits,
    estimate,
    total,
)
from crucible.pipeline import ReplicatedPipeline
from crucible.presets import get_preset


def _autograd_saved_bytes(config, *, replicas: int, batch: int) -> int:
    """Bytes of the distinct tensors one forward of the real model saves for backward
    (parameters and buffers excluded)."""
    model = ReplicatedPipeline(config)
    ids = torch.randint(0, config.model.vocab_size, (replicas, batch, config.model.seq_len))
    own = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in own:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(ids, ids)
    return sum(saved.values())


@pytest.mark.parametrize("overrides", [
    ["pipeline.compression=none"],
    ["pipeline.compression=ssn", "model.d_model=128", "model.seq_len=64"],
    ["pipeline.compression=mapl", "model.layers=8"],
    ["model.mlp=gelu"],
])
def test_activation_count_matches_what_autograd_saves(overrides):
    config = apply_overrides(get_preset("smoke"), ["replicas=2", "train.batch_size=8",
                                                   *overrides])
    tokens = 2 * 8 * config.model.seq_len
    counted = tokens * _saved_bytes_per_token(config, bf16=False)
    measured = _autograd_saved_bytes(config, replicas=2, batch=8)
    assert abs(counted - measured) / measured < 0.08, (counted, measured)


def test_cgroup_limits_are_read_without_page_cache(tmp_path):
    v2 = tmp_path / "v2"
    v2.mkdir()
    (v2 / "memory.max").write_text("1073741824\n")
    (v2 / "memory.current").write_text("536870912\n")
    (v2 / "memory.stat").write_text("anon 1\ninactive_file 104857600\n")
    assert _cgroup_room(v2) == 1073741824 - 536870912 + 104857600
    (v2 / "memory.max").write_text("max\n")
    assert _cgroup_room(v2) is None
    v1 = tmp_path / "v1" / "memory"
    v1.mkdir(parents=True)
    (v1 / "memory.limit_in_bytes").write_text("2147483648\n")
    (v1 / "memory.usage_in_bytes").write_text("1073741824\n")
    (v1 / "memory.stat").write_text("total_inactive_file 0\n")
    assert _cgroup_room(tmp_path / "v1") == 1073741824
    (v1 / "memory.limit_in_bytes").write_text("9223372036854771712\n")   # v1's "no limit"
    assert _cgroup_room(tmp_path / "v1") is None


def test_run_that_cannot_fit_is_refused_with_both_numbers():
    room, source = available()
    assert room is not None and room > 0 and source
    config = apply_overrides(get_preset("smoke"), ["train.batch_size=1000000",
                                                   "data.allow_repeat=true"])
    assert estimate(config).phase == "training step"
    with pytest.raises(ConfigError) as caught:
        check_fits(config, device=torch.device("cpu"))
    message = str(caught.value)
    assert "not enough memory" in message and "GiB is available" in message
    assert "lower train.batch_size" in message and "--skip-memory-check" in message


def test_every_preset_fits_the_machine_it_is_meant_for():
    # the CPU presets fit a laptop (well under 2 GiB); paper-178m fits an H200 (141 GiB) in
    # bf16 on the GPU, as it was measured there (docs/PERFORMANCE.md: 131.3 GiB allocated)
    for name in ("smoke", "small", "study"):
        assert estimate(get_preset(name)).host_bytes < 2 << 30
    paper = estimate(get_preset("paper-178m"), on_gpu=True)
    assert 120 << 30 < paper.device_bytes < 141 << 30


def test_on_a_shared_machine_a_run_that_fits_alone_waits_and_one_that_never_fits_is_refused(
        monkeypatch):
    """While other runs hold the memory (`available` reports 1 MiB), a flow's run that this
    machine could hold alone is told to wait (MemoryBusy, which the flows retry); one larger
    than the machine is refused (ConfigError, never retried); `crucible run` (not shared)
    refuses both at once, as before."""
    from flows.errors import is_transient

    machine, _ = total()
    assert machine is not None and machine >= available()[0]
    small = apply_overrides(get_preset("smoke"), ["replicas=2"])
    huge = apply_overrides(get_preset("smoke"), ["train.batch_size=1000000",
                                                 "data.allow_repeat=true"])
    assert estimate(small).host_bytes < machine < estimate(huge).host_bytes
    monkeypatch.setattr(crucible.memory, "available", lambda: (1 << 20, "MemAvailable"))
    cpu = torch.device("cpu")
    with pytest.raises(MemoryBusy, match="fits this machine alone") as busy:
        check_fits(small, device=cpu, shared=True)
    assert is_transient(busy.value)
    with pytest.raises(ConfigError, match="lower train.batch_size") as refused:
        check_fits(huge, device=cpu, shared=True)
    assert not is_transient(refused.value)
    for config in (small, huge):
        with pytest.raises(ConfigError, match="not enough memory"):
            check_fits(config, device=cpu)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_what_the_allocator_caches_counts_as_free_on_the_gpu():
    """An earlier run in the same process (an embedded sweep's cell) leaves its blocks cached
    by PyTorch: the driver reports them taken, yet the next run's allocations reuse them."""
    device = torch.device("cuda")
    torch.cuda.empty_cache()
    before, size = _gpu_free(device)
    block = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    del block
    assert torch.cuda.mem_get_info(device)[0] <= before - (1 << 30)   # the driver: still taken
    assert abs(_gpu_free(device)[0] - before) < 64 << 20 and size >= before

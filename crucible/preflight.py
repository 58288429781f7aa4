"""Can this run start here? The checks a command or a flow makes on the machine that will train,
before anything is written, so that a run that cannot work fails in a second with one message
instead of a traceback minutes later (or the kernel's OOM killer with none).

- the token budget fits the data (`crucible.data.check_config_budget`);
- a `trace` failure process's CSV is there and valid for the run (`check_trace`);
- the device exists (`train.device=cuda` on a host without CUDA);
- the output folder and a local store's folder can be created and written (not a file, not a
  read-only or pseudo-filesystem location);
- the estimated peak memory fits what the machine has left (`crucible.memory`);
- an S3 store answers (one LIST), so an unreachable endpoint or a missing bucket shows at once.

Every failure is a `ConfigError` naming the option or key and the fix (the CLI exits 2, the
flows do not retry it), except the S3 probe's `StoreError` (the CLI exits 1, the flows retry a
transient one) and `check_memory(..., shared=True)`'s `MemoryBusy`.

A flow runs the memory check apart (`check_can_start(..., memory_check=False)` first, then
`check_memory(config, shared=True)` once it holds its GPU slot): measured while it queues, the
memory would be what the run ahead of it holds while training.
"""
from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from crucible.config import Config, ConfigError, apply_overrides
from crucible.memory import MemoryEstimate, check_fits
from crucible.store import open_store, parse_store_url

if TYPE_CHECKING:
    from crucible.grid.spec import SweepSpec

__all__ = ["check_writable_dir", "check_machine", "check_trace", "check_spec_here",
           "check_memory", "check_can_start"]

_PROBE_PREFIX = ".crucible-probe/"   # a LIST under it proves the bucket answers; nothing is there


def check_writable_dir(path: str | os.PathLike[str], *, field: str) -> Path:
    """Create `path` (and its parents) if needed and prove it is a writable folder by creating
    and removing a file in it; returns it. Raises ConfigError naming `field` otherwise."""
    folder = Path(path)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise ConfigError(f"{field}={str(folder)!r} is a file, not a folder; give a folder "
                          "path (it is created if missing)") from None
    except NotADirectoryError:
        raise ConfigError(f"{field}={str(folder)!r}: a part of the path is a file, not a "
                          "folder; give a folder path") from None
    except OSError as exc:
        raise ConfigError(f"{field}={str(folder)!r} cannot be created ({exc.strerror}); give a "
                          "folder you can write to") from None
    try:
        with tempfile.TemporaryFile(dir=folder, prefix=".crucible-probe-"):
            pass
    except OSError as exc:
        raise ConfigError(f"{field}={str(folder)!r} is not writable ({exc.strerror}); give a "
                          "folder you can write to") from None
    return folder


def check_trace(config: Config) -> None:
    """A `trace` failure process's file exists, fits the size limit and is a valid plan for
    this run's replicas and stages (`crucible.faults.read_trace`); raises ConfigError."""
    if config.faults.process != "trace" or config.faults.p == 0 or config.faults.trace is None:
        return
    from crucible.faults import FaultPlanError, read_trace

    try:
        read_trace(config.faults.trace, replicas=config.replicas, stages=config.pipeline.stages)
    except FaultPlanError as exc:
        raise ConfigError(str(exc)) from None


def check_machine(config: Config, *, memory_check: bool = True) -> MemoryEstimate | None:
    """The checks that need no folder: the token budget, the device, the memory estimate
    (skipped with `memory_check=False`; then None is returned). Raises ConfigError."""
    from crucible.data import check_config_budget
    from crucible.pipeline import resolve_device  # torch: only where a run is about to start

    check_config_budget(config)
    check_trace(config)
    device = resolve_device(config.train.device)
    return check_fits(config, device=device) if memory_check else None


def check_spec_here(spec: SweepSpec, *, memory_check: bool = True) -> None:
    """`check_machine` for every distinct configuration of the cells a sweep or study runs now
    (`SweepSpec.runs_now`; the seed aside: it changes neither the device nor the memory),
    before any of them starts; each run checks again for itself. Raises ConfigError naming the
    cell."""
    from crucible.presets import get_preset

    base, seen = get_preset(spec.preset), set()
    for cell in spec.runs_now():
        config = apply_overrides(base, [o for o in cell.overrides(spec)
                                        if not o.startswith("seed=")])
        key = config.to_json()
        if key not in seen:
            seen.add(key)
            try:
                check_machine(config, memory_check=memory_check)
            except ConfigError as exc:
                raise ConfigError(f"cell {cell.id}: {exc}") from None


def check_memory(config: Config, *, shared: bool = False) -> MemoryEstimate:
    """The memory estimate against what is free now on the host and on the current CUDA
    device (the slot's, inside `flows.gpu.gpu_slot`). Raises ConfigError for a run that cannot
    fit; with `shared`, MemoryBusy for one that would fit this machine alone
    (`crucible.memory.check_fits`)."""
    from crucible.pipeline import resolve_device

    return check_fits(config, device=resolve_device(config.train.device), shared=shared)


def check_can_start(config: Config, *, out_dir: str | os.PathLike[str],
                    out_field: str = "--out", memory_check: bool = True) -> MemoryEstimate | None:
    """Run every check of the module docstring for `config` writing into `out_dir` (named
    `out_field` in messages); returns the memory estimate (None with `memory_check=False`).
    Raises ConfigError for the first check that fails, StoreError when an S3 store does not
    answer."""
    estimate = check_machine(config, memory_check=memory_check)
    scheme, location, _prefix = parse_store_url(config.store.url or "file:///")
    if config.store.url is not None and scheme == "s3":
        # one LIST now rather than a StoreError after the first global step
        open_store(config.store.url, endpoint_url=config.store.endpoint_url,
                   region=config.store.region).list(_PROBE_PREFIX)
    # folders only now: a run refused above has created nothing
    check_writable_dir(out_dir, field=out_field)
    if config.store.url is not None and scheme == "file":
        check_writable_dir(location, field="store.url")
    return estimate

"""GPU slots: one Prefect global concurrency limit per host, so a worker never oversubscribes its
devices.

The limit is named `gpu:<hostname>` and created on first use with as many slots as the host has
CUDA devices (1 on a CPU-only machine: one training run at a time already saturates its cores).
An existing limit is left as it is, so an operator can raise or lower it in the Prefect UI
(`Concurrency` page) and the change sticks. Every training run holds one slot while it trains.

The slot says how many runs may train on a host, not which device each gets: on a multi-GPU
host `gpu_slot` also claims one device index through an exclusive file lock per device and makes
it the thread's current CUDA device, so two runs never share a GPU while another idles.

A slot is released when its run ends for any reason: the block's `finally` on success, failure
and in-process cancellation (Prefect raises a termination signal through the flow), and
`release_slots` from the flows' cancellation/crash hooks when the worker killed the run's
process. Each held slot leaves a small holder file (lease id, flow run, run label, pid) in the
system temp folder (or `CRUCIBLE_GPU_SLOTS_DIR`) so that those hooks, and a run waiting for the slot ("waiting for gpu:HOST
(held by RUN)"), know who holds it. A process killed where no hook runs still loses its slot
when its lease expires (`_LEASE_S`).
"""
from __future__ import annotations

import fcntl
import json
import logging
import os
import socket
import tempfile
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from uuid import UUID

from prefect.client.orchestration import get_client
from prefect.client.schemas.actions import (
    GlobalConcurrencyLimitCreate,
    GlobalConcurrencyLimitUpdate,
)
from prefect.concurrency._leases import maintain_concurrency_lease
from prefect.concurrency._sync import (
    acquire_concurrency_slots_with_lease,
    release_concurrency_slots_with_lease,
)
from prefect.exceptions import ObjectAlreadyExists, ObjectNotFound

# (private modules above: the public `concurrency()` never tells the lease id a hook releases)
__all__ = ["gpu_limit_name", "local_device_count", "ensure_gpu_limit", "set_gpu_limit", "gpu_slot",
           "claim_device_index", "slot_holders", "release_slots"]

_log = logging.getLogger(__name__)

# A lease is renewed in the background while the slot is held; this only bounds how long a slot
# of a hard-killed worker stays taken before the server frees it.
_LEASE_S = 300.0


def gpu_limit_name(host: str | None = None) -> str:
    """`gpu:<host>`; the host name defaults to this machine's."""
    return f"gpu:{host or socket.gethostname()}"


def local_device_count() -> int:
    """Number of CUDA devices here, at least 1 (a CPU machine runs one job at a time)."""
    try:
        import torch
    except ImportError:  # flows without torch installed (e.g. a UI-only process)
        return 1
    return max(1, torch.cuda.device_count() if torch.cuda.is_available() else 0)


def ensure_gpu_limit(name: str | None = None, slots: int | None = None) -> int:
    """Create the global concurrency limit `name` (default `gpu:<hostname>`) with `slots` slots
    (default `local_device_count()`) unless it exists; return its current number of slots.

    Must be called with a reachable Prefect API (a server, the ephemeral one or the test harness).
    """
    name = name or gpu_limit_name()
    wanted = slots if slots is not None else local_device_count()
    with get_client(sync_client=True) as client:
        try:
            return client.read_global_concurrency_limit_by_name(name).limit
        except ObjectNotFound:
            pass
        try:
            client.create_global_concurrency_limit(
                GlobalConcurrencyLimitCreate(name=name, limit=wanted))
            _log.info("created global concurrency limit %s with %d slot(s)", name, wanted)
            return wanted
        except ObjectAlreadyExists:  # another run on this host created it first
            return client.read_global_concurrency_limit_by_name(name).limit


def set_gpu_limit(slots: int, name: str | None = None) -> None:
    """Make this host's limit `slots` slots, creating or changing it: for a Prefect database of
    one's own (the embedded stack's), where a CPU-only host trains several one-thread runs at
    once. A shared server's limit is the operator's: never call this against one."""
    name = name or gpu_limit_name()
    if ensure_gpu_limit(name, slots) != slots:
        with get_client(sync_client=True) as client:
            client.update_global_concurrency_limit(
                name, GlobalConcurrencyLimitUpdate(limit=slots))
        _log.info("set global concurrency limit %s to %d slot(s)", name, slots)


@contextmanager
def gpu_slot(name: str | None = None, timeout_s: float | None = None, *,
             run: str | None = None, flow_run_id: str | None = None,
             log: Any = None) -> Iterator[str]:
    """Hold one slot of this host's GPU limit for the duration of the block; yields the limit's name.

    Waits (forever by default, else up to `timeout_s`, raising TimeoutError) for a free slot;
    when none is free it first logs "waiting for gpu:HOST (held by RUN)" to `log` (default this
    module's logger). `run` (a label such as the registry id) and `flow_run_id` name the holder,
    so that waiters can say who holds the slot and `release_slots(flow_run_id)` can free it.
    """
    name = name or gpu_limit_name()
    ensure_gpu_limit(name)
    with get_client(sync_client=True) as client:
        limit = client.read_global_concurrency_limit_by_name(name)
    if limit.active_slots >= limit.limit:
        # none known: the holders' files are in another temp folder (another container)
        holders = [h.get("run") or "?" for h in slot_holders(name)] or ["an unknown run"]
        (log or _log).info("waiting for %s (held by %s)", name, ", ".join(holders))
    lease = acquire_concurrency_slots_with_lease([name], 1, timeout_seconds=timeout_s,
                                                 lease_duration=_LEASE_S, strict=True)
    holder_file = _holder_dir() / f"{lease.lease_id}.json"
    holder_file.write_text(json.dumps({"limit": name, "lease_id": str(lease.lease_id),
                                       "flow_run_id": flow_run_id, "run": run,
                                       "pid": os.getpid()}))
    try:
        with maintain_concurrency_lease(lease.lease_id, _LEASE_S,
                                        raise_on_lease_renewal_failure=True):
            with claim_device_index(_cuda_count()) as index:
                _use_device(index)
                yield name
    finally:
        _release(lease.lease_id, holder_file)


def _holder_dir() -> Path:
    """`CRUCIBLE_GPU_SLOTS_DIR`, else `<system temp>/crucible-gpu-slots`: one folder per host
    (a test session points it at its own folder, so another session's holders on the same
    host are not mistaken for its own)."""
    configured = os.environ.get("CRUCIBLE_GPU_SLOTS_DIR")
    folder = Path(configured) if configured else Path(tempfile.gettempdir()) / "crucible-gpu-slots"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:   # someone else's process: alive
        return True
    return True


def _holder_files() -> Iterator[tuple[Path, dict[str, Any]]]:
    """Every slot held on this host: (its file, its record); files of dead processes are
    removed (their lease expires on the server by itself)."""
    for path in sorted(_holder_dir().glob("*.json")):
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):   # being written or removed right now
            continue
        if not _alive(int(record.get("pid") or 0)):
            path.unlink(missing_ok=True)
            continue
        yield path, record


def slot_holders(name: str | None = None) -> list[dict[str, Any]]:
    """The live holders of limit `name` (default `gpu:<hostname>`) on this host: records with
    lease_id, flow_run_id, run and pid."""
    name = name or gpu_limit_name()
    return [record for _path, record in _holder_files() if record.get("limit") == name]


def release_slots(flow_run_ids: Iterable[str]) -> int:
    """Release every GPU slot on this host held by one of `flow_run_ids` (a flow run that was
    cancelled or crashed, whose own process may be gone); returns how many were released.
    Releasing a lease that already ended is harmless."""
    wanted = {str(i) for i in flow_run_ids}
    released = 0
    for path, record in list(_holder_files()):
        if record.get("flow_run_id") in wanted:
            _release(UUID(record["lease_id"]), path)
            released += 1
    return released


def _release(lease_id: UUID, holder_file: Path) -> None:
    holder_file.unlink(missing_ok=True)
    try:
        release_concurrency_slots_with_lease(lease_id)
    except ObjectNotFound:   # released already (by a hook) or expired
        pass


def _cuda_count() -> int:
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@contextmanager
def claim_device_index(count: int, lock_dir: Path | None = None) -> Iterator[int | None]:
    """Hold an exclusive lock on one of `count` device indexes for the block; yields the index
    (None when there is nothing to choose: fewer than 2 devices).

    Takes the first free index; if all are held (an operator raised the limit above the device
    count), waits for index 0 rather than oversubscribe silently. Locks live in `lock_dir`
    (default: the system temp folder) and die with the process, so a crash frees them.
    """
    if count < 2:
        yield None
        return
    folder = lock_dir or Path(tempfile.gettempdir())
    handles = [open(folder / f"crucible-gpu-{index}.lock", "a+b") for index in range(count)]
    chosen = None
    try:
        for index, handle in enumerate(handles):
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue
            chosen = index
            break
        if chosen is None:
            fcntl.flock(handles[0], fcntl.LOCK_EX)
            chosen = 0
        yield chosen
    finally:
        for handle in handles:
            handle.close()          # closing releases the lock


def _use_device(index: int | None) -> None:
    if index is None:
        return
    import torch

    torch.cuda.set_device(index)    # per thread: `cuda` without an index now means this one
    _log.info("training on cuda:%d", index)

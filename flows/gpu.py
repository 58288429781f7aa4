"""GPU slots: one Prefect global concurrency limit per host, so a worker never oversubscribes its
devices.

The limit is named `gpu:<hostname>` and created on first use with as many slots as the host has
CUDA devices (1 on a CPU-only machine: one training run at a time already saturates its cores).
An existing limit is left as it is, so an operator can raise or lower it in the Prefect UI
(`Concurrency` page) and the change sticks. Every training run holds one slot while it trains.

The slot says how many runs may train on a host, not which device each gets: on a multi-GPU
host `gpu_slot` also claims one device index through an exclusive file lock per device and makes
it the thread's current CUDA device, so two runs never share a GPU while another idles.

Holders and waiters are files in one folder per host (the system temp folder's
`crucible-gpu-slots`, or `CRUCIBLE_GPU_SLOTS_DIR`), each naming its Prefect server, process (pid
and start time, so a reused pid is not mistaken for it), flow run and run label:

- Waiters queue: each takes a ticket, and only the oldest live ticket of its limit asks the
  server for a slot, so slots are granted in arrival order (the limit is per host, so its
  waiters all share this folder).
- A slot is released when its run ends for any reason: the block's `finally` on success, failure
  and in-process cancellation, `release_slots` from the flows' cancellation/crash hooks, and,
  for a holder whose process is dead (SIGKILL, OOM) where no hook ran, by the next waiter at
  once. Only a holder whose whole host is gone keeps its slot until its lease expires
  (`_LEASE_S`).
- The lease is renewed in the background through any outage of the Prefect API: a renewal that
  fails is logged and tried again, never ends the training; a lease that expired meanwhile is
  taken again once the server answers.
- Only this server's holders are named ("waiting for gpu:HOST (held by RUN)") or released: the
  folder is shared with other Prefect servers on the host (other stacks, embedded sweeps).
"""
from __future__ import annotations

import fcntl
import json
import logging
import os
import socket
import tempfile
import threading
import time
import uuid
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from uuid import UUID

import httpx
from prefect.client.orchestration import get_client
from prefect.client.schemas.actions import (
    GlobalConcurrencyLimitCreate,
    GlobalConcurrencyLimitUpdate,
)
from prefect.client.schemas.responses import ConcurrencyLimitWithLeaseResponse
from prefect.exceptions import ObjectAlreadyExists, ObjectNotFound

from crucible.runfiles import write_text_atomic
from flows.processes import prefect_server, process_alive, process_start

__all__ = ["gpu_limit_name", "local_device_count", "ensure_gpu_limit", "set_gpu_limit", "gpu_slot",
           "claim_device_index", "slot_holders", "release_slots", "release_dead_holders"]


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

    Waits in arrival order (forever by default, else up to `timeout_s`, raising TimeoutError)
    for a free slot; when none is free it first logs "waiting for gpu:HOST (held by RUN)" to
    `log` (default this module's logger). `run` (a label such as the registry id) and
    `flow_run_id` name the holder, so that waiters can say who holds the slot and
    `release_slots(flow_run_id)` can free it. An unreachable Prefect API while waiting or
    holding is logged and outlasted, never raised.
    """
    name = name or gpu_limit_name()
    logger = log or _log
    ensure_gpu_limit(name)
    me = {"limit": name, "server": prefect_server(), "run": run, "flow_run_id": flow_run_id,
          "pid": os.getpid(), "started": process_start(os.getpid())}
    lease_id = _wait_for_lease(name, me, timeout_s, logger)
    holder_file = _holder_dir() / f"{lease_id}.json"
    _write_record(holder_file, {**me, "lease_id": str(lease_id)})
    keeper = _LeaseKeeper(name, lease_id, holder_file, me, logger)
    try:
        keeper.start()
        with claim_device_index(_cuda_count()) as index:
            _use_device(index)
            yield name
    finally:
        keeper.stop()
        _release(keeper.lease_id, keeper.holder_file)


# Seconds between two looks at the queue or two requests for a slot; how long a renewal waits
# after a failure at most (the back-off doubles from 1 s).
_POLL_S = 0.5
_RETRY_MAX_S = 30.0


def _wait_for_lease(name: str, me: dict[str, Any], timeout_s: float | None,
                    logger: Any) -> UUID:
    """Queue behind earlier waiters of limit `name`, then take a slot; returns the lease id."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    queue = _holder_dir() / "queue"
    queue.mkdir(exist_ok=True)
    ticket = queue / f"{time.time_ns():020d}-{os.getpid()}-{uuid.uuid4().hex[:8]}.json"
    _write_record(ticket, me)
    told, failures = False, 0
    try:
        with get_client(sync_client=True) as client:
            while True:
                release_dead_holders(name)
                if _first_in_queue(queue, me) == ticket:
                    try:
                        lease_id = _try_lease(client, name)
                        failures = 0
                    except _UNREACHABLE as exc:
                        _raise_unless_unreachable(exc)
                        failures += 1
                        logger.warning("waiting for %s: Prefect API unreachable (attempt %d: "
                                       "%s); trying again", name, failures, _describe(exc))
                        lease_id = None
                    if lease_id is not None:
                        return lease_id
                if not told:
                    told = True
                    # none known: the holders' files are in another temp folder (a container)
                    holders = [h.get("run") or "?" for h in slot_holders(name)]
                    ahead = _ahead(queue, me, ticket)
                    logger.info("waiting for %s (held by %s%s)", name,
                                ", ".join(holders) or "an unknown run",
                                f"; {ahead} waiting ahead" if ahead else "")
                if deadline is not None and time.monotonic() > deadline:
                    raise TimeoutError(f"no slot of {name} within {timeout_s} s")
                time.sleep(min(_POLL_S * 2 ** failures, _RETRY_MAX_S))
    finally:
        ticket.unlink(missing_ok=True)


def _first_in_queue(queue: Path, me: dict[str, Any]) -> Path | None:
    """The oldest live ticket for the same limit and server as `me`; dead waiters' tickets
    are removed."""
    for path in sorted(queue.glob("*.json")):
        record = _read_record(path)
        if record is None or record.get("limit") != me["limit"] \
                or record.get("server") != me["server"]:
            continue
        if not process_alive(record):
            path.unlink(missing_ok=True)
            continue
        return path
    return None


def _ahead(queue: Path, me: dict[str, Any], ticket: Path) -> int:
    """How many live waiters of the same limit and server arrived before `ticket`."""
    return sum(1 for path in sorted(queue.glob("*.json")) if path.name < ticket.name
               and (record := _read_record(path)) is not None
               and record.get("limit") == me["limit"] and record.get("server") == me["server"]
               and process_alive(record))


def _try_lease(client: Any, name: str) -> UUID | None:
    """One request for a slot: the lease id, or None while every slot is taken."""
    try:
        response = client.increment_concurrency_slots_with_lease(
            names=[name], slots=1, mode="concurrency", lease_duration=_LEASE_S)
    except httpx.HTTPStatusError as exc:
        if exc.response.status_code == 423:      # all slots taken
            return None
        raise
    granted = ConcurrencyLimitWithLeaseResponse.model_validate(response.json())
    if not granted.limits:
        raise RuntimeError(f"the global concurrency limit {name} was deleted while a run "
                           f"waited for it; create it again (Concurrency -> Global)")
    return granted.lease_id


class _LeaseKeeper:
    """Renews a slot's lease every quarter lease from a thread. A failed renewal is logged and
    tried again with a bounded back-off, never raised into the training; a lease the server
    no longer knows is taken again (it expired during an outage) unless a hook released it
    (the holder file is gone: the run was cancelled or crashed)."""

    def __init__(self, name: str, lease_id: UUID, holder_file: Path, me: dict[str, Any],
                 logger: Any) -> None:
        self.name, self.lease_id, self.holder_file = name, lease_id, holder_file
        self.me, self.logger = me, logger
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"lease {name}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _loop(self) -> None:
        failures, wait_s = 0, _LEASE_S / 4
        with get_client(sync_client=True) as client:
            while not self._stop.wait(wait_s):
                try:
                    self._renew(client)
                except (*_UNREACHABLE, _NoFreeSlot) as exc:
                    _raise_unless_unreachable(exc)
                    failures += 1
                    wait_s = min(2.0 ** failures, _RETRY_MAX_S)
                    self.logger.warning("lease of %s not renewed (attempt %d: %s); the run goes "
                                        "on, trying again in %g s", self.name, failures,
                                        _describe(exc), wait_s)
                    continue
                if failures:
                    self.logger.info("lease of %s renewed after %d failed attempt(s)",
                                     self.name, failures)
                failures, wait_s = 0, _LEASE_S / 4

    def _renew(self, client: Any) -> None:
        try:
            client.renew_concurrency_lease(lease_id=self.lease_id, lease_duration=_LEASE_S)
            return
        except httpx.HTTPStatusError as exc:
            if exc.response.status_code != 404:
                raise
        if not self.holder_file.exists():     # released by a cancellation or crash hook
            self._stop.set()
            return
        lease_id = _try_lease(client, self.name)
        if lease_id is None:
            self.logger.warning("the lease of %s expired while the Prefect API was unreachable "
                                "and every slot is taken now; this run trains over the limit "
                                "until one is free", self.name)
            raise _NoFreeSlot(self.name)
        new_file = self.holder_file.with_name(f"{lease_id}.json")
        _write_record(new_file, {**self.me, "lease_id": str(lease_id)})
        self.holder_file.unlink(missing_ok=True)
        self.lease_id, self.holder_file = lease_id, new_file
        self.logger.warning("the lease of %s had expired (the Prefect API was unreachable "
                            "longer than %g s); took the slot again", self.name, _LEASE_S)


def _holder_dir() -> Path:
    """`CRUCIBLE_GPU_SLOTS_DIR`, else `<system temp>/crucible-gpu-slots`: one folder per host
    (a test session points it at its own folder)."""
    configured = os.environ.get("CRUCIBLE_GPU_SLOTS_DIR")
    folder = Path(configured) if configured else Path(tempfile.gettempdir()) / "crucible-gpu-slots"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def _write_record(path: Path, record: dict[str, Any]) -> None:
    """Write a holder or ticket file whole (temporary file, then rename): a reader never sees
    half of one."""
    write_text_atomic(path, json.dumps(record))


def _read_record(path: Path) -> dict[str, Any] | None:
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):   # removed right now
        return None
    return record if isinstance(record, dict) else None


def _holder_files(name: str | None = None) -> Iterator[tuple[Path, dict[str, Any]]]:
    """Every slot of this Prefect server held on this host, living or dead holder: (its file,
    its record); of limit `name` only when given."""
    server = prefect_server()
    for path in sorted(_holder_dir().glob("*.json")):
        record = _read_record(path)
        if record is None or record.get("server") != server or "lease_id" not in record:
            continue
        if name is None or record.get("limit") == name:
            yield path, record


def slot_holders(name: str | None = None) -> list[dict[str, Any]]:
    """The live holders of limit `name` (default `gpu:<hostname>`) of this Prefect server on
    this host: records with lease_id, flow_run_id, run, pid and server."""
    name = name or gpu_limit_name()
    return [record for _path, record in _holder_files(name) if process_alive(record)]


def release_slots(flow_run_ids: Iterable[str]) -> int:
    """Release every GPU slot on this host held by one of `flow_run_ids` (a flow run that was
    cancelled or crashed: its process is usually dead by now, killed by the runner or from
    outside); returns how many were released. Releasing a lease that already ended is
    harmless."""
    wanted = {str(i) for i in flow_run_ids}
    released = 0
    for path, record in list(_holder_files()):
        if record.get("flow_run_id") in wanted:
            _release(UUID(record["lease_id"]), path)
            released += 1
    return released


def release_dead_holders(name: str | None = None) -> int:
    """Release the slots (of limit `name`, or all) whose holder process on this host is dead,
    killed where no hook ran; returns how many."""
    released = 0
    for path, record in list(_holder_files(name)):
        if not process_alive(record):
            _log.info("releasing %s held by dead process %s (run %s)", record.get("limit"),
                      record.get("pid"), record.get("run"))
            _release(UUID(record["lease_id"]), path)
            released += 1
    return released


# what an unreachable Prefect API raises (connection errors, timeouts, 5xx after the client's
# own retries); `_raise_unless_unreachable` lets any other HTTP error through
_UNREACHABLE = (httpx.TransportError, httpx.HTTPStatusError, OSError)


class _NoFreeSlot(Exception):
    """Every slot is taken when a run whose lease expired asks for one again."""


def _raise_unless_unreachable(exc: BaseException) -> None:
    if isinstance(exc, httpx.HTTPStatusError) and exc.response.status_code < 500 \
            and exc.response.status_code not in (408, 429):
        raise exc


def _describe(exc: BaseException) -> str:
    if isinstance(exc, httpx.HTTPStatusError):
        return f"HTTP {exc.response.status_code}"
    return f"{type(exc).__name__}: {exc}"[:200]


def _release(lease_id: UUID, holder_file: Path) -> None:
    holder_file.unlink(missing_ok=True)
    try:
        with get_client(sync_client=True) as client:
            client.release_concurrency_slots_with_lease(lease_id)
    except (ObjectNotFound, httpx.HTTPStatusError) as exc:
        # 404: released already (by a hook) or expired; else the lease expires by itself
        if not isinstance(exc, ObjectNotFound) and exc.response.status_code != 404:
            _log.warning("could not release lease %s (%s); it expires within %g s",
                         lease_id, _describe(exc), _LEASE_S)
    except (httpx.TransportError, OSError) as exc:
        _log.warning("could not release lease %s (%s); it expires within %g s",
                     lease_id, _describe(exc), _LEASE_S)


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

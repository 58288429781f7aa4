"""Which process runs each flow run on this host, and what becomes of the flow runs whose process
is gone.

Prefect cannot tell that a flow run's process died where no hook ran (the process or serve
SIGKILLed, serve ended by an outage, the host rebooted): the run stays `Running` for ever. So
every `train-run`, `failure-sweep` and `distributed-run` flow run records its process when it
starts (`flow_process`): `<work_dir>/flow-runs/<flow run id>.json` with the pid, the process's
start time (a reused pid is another process), its process group, the host and the Prefect
server; the record is removed when the flow run ends. Then:

- `reconcile` (at `infra/stack.sh start` and `stop`, or `crucible reconcile`) finds the flow
  runs of this server that are `Running`, `Pending` or `Cancelling` and whose recorded process
  on this host is dead, sets their state (`Crashed`, or `Cancelled` when the stack is stopped,
  with the reason) and runs the flow's own crash or cancellation hooks for them, which record
  the registry's runs and sweep `failed` / `cancelled` with the reason and release their GPU
  slots. A flow run recorded on another host, or alive, is left alone; one with no record at all
  (its process died before it recorded itself) only with `unrecorded=True`, for a server no
  other runner uses (the stack's, while its serve is stopped).
- `end_processes` ends the live recorded processes (their process groups: a distributed run's
  agents and workers too), SIGTERM first, SIGKILL after a grace period.
- `run_folder_lock` is the run folder's exclusive lock (`flock` on `<run folder>/.train.lock`):
  two processes never train one run at once, on one host. A re-run of a sweep while an orphaned
  process of an earlier flow run still trains a cell waits for it, then finds its summary.
- `training_journal` records each training of a run folder in `<run folder>/trainings.jsonl`: a
  `start` line before it and an `end` line with its outcome after it (a killed process leaves a
  start with no end), so how many times a cell was trained, and by which processes, is on disk.
"""
from __future__ import annotations

import fcntl
import json
import logging
import os
import signal
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from crucible.runfiles import append_jsonl, repair_torn_tail, write_text_atomic

__all__ = ["process_start", "process_alive", "prefect_server", "flow_process", "reconcile",
           "end_processes", "run_folder_lock", "live_records", "end_prefect_flow_runs",
           "training_journal", "TRAININGS_FILE"]

_log = logging.getLogger(__name__)

_OPEN = ("RUNNING", "PENDING", "CANCELLING")
# each training of a run folder, one JSON line as it starts and one as it ends
TRAININGS_FILE = "trainings.jsonl"


def _records_dir(work_dir: Path) -> Path:
    return work_dir.resolve() / "flow-runs"


def _stat(pid: int) -> list[str] | None:
    """/proc/PID/stat's fields after the command name (state first); None when there is no
    such process or no /proc."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()


def process_start(pid: int) -> str | None:
    """When process `pid` started (clock ticks since boot, /proc/PID/stat field 22); None when
    there is no such process or no /proc."""
    fields = _stat(pid)
    return None if fields is None else fields[19]


def process_alive(record: dict[str, Any]) -> bool:
    """Whether the process a record names (`pid`, and `started` where known) still runs: its
    pid exists, is not a zombie (a process that exited and that its parent has not reaped yet:
    a flow run orphaned by a killed serve, under an init that reaps late) and started when the
    record says (a reused pid is another process)."""
    pid = int(record.get("pid") or 0)
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:   # someone else's process: alive
        pass
    fields = _stat(pid)
    if fields is not None and fields[0] in ("Z", "X"):
        return False
    started = record.get("started")
    return started is None or fields is None or fields[19] == started


def prefect_server() -> str:
    """The Prefect server this process talks to (its API URL; an ephemeral server by its
    database): holders of one server's limit are told apart from another's by it."""
    from prefect.settings import (
        PREFECT_API_URL,
        PREFECT_HOME,
        PREFECT_SERVER_DATABASE_CONNECTION_URL,
    )

    url = PREFECT_API_URL.value()
    if url:
        return str(url).rstrip("/")
    return f"ephemeral:{PREFECT_SERVER_DATABASE_CONNECTION_URL.value() or PREFECT_HOME.value()}"



def _here(record: dict[str, Any]) -> bool:
    return (record.get("host") == socket.gethostname()
            and record.get("server") == prefect_server())


@contextmanager
def flow_process(work_dir: Path, flow_run_id: str | None, flow: str) -> Iterator[None]:
    """Record this process as flow run `flow_run_id`'s for the block (nothing without an id)."""
    if flow_run_id is None:
        yield
        return
    folder = _records_dir(work_dir)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{flow_run_id}.json"
    record = {"flow_run_id": flow_run_id, "flow": flow, "pid": os.getpid(),
              "started": process_start(os.getpid()), "pgid": os.getpgrp(),
              "host": socket.gethostname(), "server": prefect_server()}
    write_text_atomic(path, json.dumps(record))
    try:
        yield
    finally:
        path.unlink(missing_ok=True)


def _records(work_dir: Path) -> dict[str, tuple[Path, dict[str, Any]]]:
    """flow run id -> (record file, record), for the records of this host and server."""
    found: dict[str, tuple[Path, dict[str, Any]]] = {}
    folder = _records_dir(work_dir)
    for path in sorted(folder.glob("*.json")) if folder.is_dir() else []:
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(record, dict) and _here(record):
            found[str(record.get("flow_run_id"))] = (path, record)
    return found


def live_records(work_dir: Path) -> list[dict[str, Any]]:
    """The recorded flow-run processes of this host and server that still run."""
    return [record for _path, record in _records(work_dir).values() if process_alive(record)]


def end_processes(work_dir: Path, *, grace_s: float = 30.0) -> list[dict[str, Any]]:
    """End every live recorded flow-run process of this host and server with its process group
    (SIGTERM, then SIGKILL after `grace_s`); never this process's own group. Returns the
    records of the processes ended."""
    live = live_records(work_dir)
    own = os.getpgrp()

    def signal_all(sig: int) -> None:
        for record in live:
            if not process_alive(record):
                continue
            pgid = int(record.get("pgid") or 0)
            try:
                if pgid > 0 and pgid != own:
                    os.killpg(pgid, sig)
                else:
                    os.kill(int(record["pid"]), sig)
            except ProcessLookupError:
                pass

    signal_all(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while any(process_alive(r) for r in live) and time.monotonic() < deadline:
        time.sleep(0.25)
    if any(process_alive(r) for r in live):
        signal_all(signal.SIGKILL)
    for record in live:
        _log.info("ended flow run %s (%s, pid %s)", record["flow_run_id"], record["flow"],
                  record["pid"])
    return live


def _flows() -> dict[str, Any]:
    from flows.distributed_flow import distributed_run
    from flows.run_flow import train_run
    from flows.sweep_flow import failure_sweep

    return {f.name: f for f in (train_run, failure_sweep, distributed_run)}


def _open_flow_runs(client: Any) -> list[Any]:
    from prefect.client.schemas.filters import (
        FlowRunFilter,
        FlowRunFilterState,
        FlowRunFilterStateType,
    )
    from prefect.client.schemas.objects import StateType

    flow_filter = FlowRunFilter(state=FlowRunFilterState(type=FlowRunFilterStateType(
        any_=[StateType[name] for name in _OPEN])))
    runs, offset = [], 0
    while True:
        page = client.read_flow_runs(flow_run_filter=flow_filter, limit=200, offset=offset)
        runs += page
        if len(page) < 200:
            return runs
        offset += len(page)


def reconcile(work_dir: Path, *, cancelled: bool = False, reason: str,
              unrecorded: bool = False) -> list[str]:
    """Mark each open flow run of this Prefect server whose process on this host is dead (module
    docstring) `Crashed` (`Cancelled` with `cancelled`) with `reason`, and run its flow's crash
    (cancellation) hooks; returns the names of the flow runs marked. With `unrecorded`, a flow
    run with no process record counts as dead too."""
    from prefect.client.orchestration import get_client
    from prefect.states import Cancelled, Crashed

    records = _records(work_dir)
    flows: dict[str, Any] | None = None    # imported only for a flow run to mark (seconds)
    marked: list[str] = []
    with get_client(sync_client=True) as client:
        for flow_run in _open_flow_runs(client):
            entry = records.get(str(flow_run.id))
            if entry is None and not unrecorded:
                continue
            if entry is not None and process_alive(entry[1]):
                continue
            state = (Cancelled if cancelled else Crashed)(message=reason)
            client.set_flow_run_state(flow_run.id, state, force=True)
            flows = _flows() if flows is None else flows
            flow = flows.get(client.read_flow(flow_run.flow_id).name)
            hooks = [] if flow is None else (flow.on_cancellation_hooks if cancelled
                                             else flow.on_crashed_hooks)
            for hook in hooks:
                try:
                    hook(flow, flow_run, state)
                except Exception:   # noqa: BLE001 - one run's hook must not stop the others
                    _log.exception("hook %s of flow run %s failed", hook.__name__, flow_run.name)
            if entry is not None:
                entry[0].unlink(missing_ok=True)
            marked.append(flow_run.name)
            _log.info("flow run %s (%s): %s, %s", flow_run.name, flow_run.id,
                      state.type.value, reason)
    for path, record in records.values():      # records of runs that ended some other way
        if path.exists() and not process_alive(record):
            path.unlink(missing_ok=True)
    return marked


def end_prefect_flow_runs(flow_run_ids: list[str], *, cancelled: bool, reason: str) -> None:
    """Set each of `flow_run_ids` that is still open in Prefect `Cancelled` / `Crashed`: the
    cells' flow runs of a sweep whose process is gone (they ran inside it, and no runner ends
    them); a Prefect API that cannot be reached is logged, and `reconcile` ends them later."""
    from prefect.client.orchestration import get_client
    from prefect.states import Cancelled, Crashed

    try:
        with get_client(sync_client=True) as client:
            for flow_run_id in flow_run_ids:
                flow_run = client.read_flow_run(flow_run_id)
                if flow_run.state is None or flow_run.state.type.name not in _OPEN:
                    continue
                client.set_flow_run_state(
                    flow_run_id, (Cancelled if cancelled else Crashed)(message=reason),
                    force=True)
    except Exception as exc:   # noqa: BLE001 - the registry's records matter more; logged
        _log.warning("could not end flow runs %s in Prefect: %s", ", ".join(flow_run_ids), exc)


@contextmanager
def run_folder_lock(out_dir: Path, log: Any = None) -> Iterator[bool]:
    """Hold `<out_dir>/.train.lock` exclusively for the block; yields whether it had to wait for
    another process (which was training this run). The lock dies with its process."""
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(out_dir / ".train.lock", "a+") as handle:
        waited = False
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            waited = True
            handle.seek(0)
            holder = handle.read().strip() or "unknown"
            (log or _log).warning("run folder %s is being trained by another process (%s); "
                                  "waiting for it to finish", out_dir, holder)
            fcntl.flock(handle, fcntl.LOCK_EX)
        handle.seek(0)
        handle.truncate()
        handle.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
        handle.flush()
        yield waited


@contextmanager
def training_journal(out_dir: Path, flow_run_id: str | None) -> Iterator[None]:
    """Record the training the block does in `<out_dir>/trainings.jsonl`: before it a line
    `{"event": "start", "pid", "host", "flow_run_id", "at"}` (durable before training begins),
    after it `{"event": "end", ..., "outcome"}` with "completed" or the exception's type (a
    failure, a cancellation). A process killed meanwhile leaves the start with no end."""
    path = out_dir / TRAININGS_FILE
    repair_torn_tail(path)              # a process killed while writing its line
    who = {"pid": os.getpid(), "host": socket.gethostname(), "flow_run_id": flow_run_id}
    append_jsonl(path, {"event": "start", **who, "at": time.time()})
    outcome = "completed"
    try:
        yield
    except BaseException as exc:
        outcome = type(exc).__name__
        raise
    finally:
        append_jsonl(path, {"event": "end", **who, "at": time.time(), "outcome": outcome})

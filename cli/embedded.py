"""The embedded stack behind `crucible sweep`: everything a sweep needs, in this process, with no
server to start.

- Prefect: ephemeral (Prefect starts its own temporary API when `PREFECT_API_URL` is unset), its
  database in `<work_dir>/prefect` so runs do not pile up in the user's home.
- Registry: the Crucible API app on a free loopback port in a background thread, over SQLite in
  `<work_dir>/registry.db`, migrated to head, with a random write token for this session.
- Store: a local folder per run (the trainer's default) unless a store URL is given.

It composes the flows, the registry service (`api`, `db`) and the offline report
(`api.dashboards.export`), so it lives in the command line, the one place where they meet: used by
`crucible sweep` and `crucible study run`, never by the flows themselves.
"""
from __future__ import annotations

import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from crucible.grid.spec import SweepSpec

__all__ = ["EmbeddedRegistry", "embedded_registry", "embedded_prefect", "flow_environment",
           "SweepReport", "run_sweep_embedded"]

_log = logging.getLogger(__name__)
_STARTUP_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class EmbeddedRegistry:
    """A running in-process registry: where to reach it and the database behind it."""

    api_url: str
    token: str
    database_url: str


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextmanager
def embedded_registry(work_dir: Path) -> Iterator[EmbeddedRegistry]:
    """Serve the registry API over SQLite in `work_dir` until the block exits."""
    import uvicorn

    from api.app import create_app
    from api.settings import Settings
    from db.migrate import upgrade

    work_dir.mkdir(parents=True, exist_ok=True)
    database_url = f"sqlite:///{(work_dir / 'registry.db').resolve()}"
    upgrade(database_url)
    token = secrets.token_urlsafe(24)
    app = create_app(Settings(database_url=database_url, api_token=token))
    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                           access_log=False))
    thread = threading.Thread(target=server.run, name="crucible-api", daemon=True)
    thread.start()
    deadline = time.monotonic() + _STARTUP_TIMEOUT_S
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError(f"the embedded registry API did not start on port {port}")
        time.sleep(0.05)
    _log.info("embedded registry at http://127.0.0.1:%d (%s)", port, database_url)
    try:
        yield EmbeddedRegistry(f"http://127.0.0.1:{port}", token, database_url)
    finally:
        server.should_exit = True
        thread.join(timeout=10)


@contextmanager
def embedded_prefect(work_dir: Path) -> Iterator[None]:
    """Ephemeral Prefect with its state in `work_dir/prefect`; a configured server
    (`PREFECT_API_URL`) is used as it is."""
    import prefect.settings as ps

    if ps.PREFECT_API_URL.value():
        yield
        return
    home = (work_dir / "prefect").resolve()
    home.mkdir(parents=True, exist_ok=True)
    updates = {
        ps.PREFECT_HOME: str(home),
        ps.PREFECT_SERVER_DATABASE_CONNECTION_URL: f"sqlite+aiosqlite:///{home / 'prefect.db'}",
        # a busy 2-core machine can take longer than the default 20 s to start the server
        ps.PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS: 180,
        # the telemetry heartbeat only contends for the SQLite lock (and logs when it loses)
        ps.PREFECT_SERVER_ANALYTICS_ENABLED: False,
    }
    prefect_log = logging.getLogger("prefect")
    prefect_log.addFilter(_server_notice_first_line)
    try:
        with ps.temporary_settings(updates=updates):
            yield
    finally:
        prefect_log.removeFilter(_server_notice_first_line)


def _server_notice_first_line(record: logging.LogRecord) -> bool:
    """Keep "Starting temporary server on URL" but drop the advertisement under it (a link to
    running a dedicated server): the embedded sweep means to be temporary."""
    if isinstance(record.msg, str) and record.msg.startswith("Starting temporary server"):
        record.msg = record.msg.split("\n", 1)[0]
    return True


@contextmanager
def flow_environment(api_url: str, token: str | None, work_dir: Path,
                     store_url: str | None = None,
                     extra: dict[str, str] | None = None) -> Iterator[None]:
    """Point `flows.settings.FlowSettings` (read from `CRUCIBLE_*`) at this registry and work
    folder for the duration of the block, restoring the previous values after. A None value
    leaves that variable as the user set it."""
    values = {"CRUCIBLE_API_URL": api_url, "CRUCIBLE_API_TOKEN": token,
              "CRUCIBLE_WORK_DIR": str(work_dir.resolve()), "CRUCIBLE_STORE_URL": store_url}
    values = {key: value for key, value in {**values, **(extra or {})}.items()
              if value is not None}
    with temporary_environ(values):
        yield


@contextmanager
def temporary_environ(values: dict[str, str]) -> Iterator[None]:
    """Set environment variables for the block and restore the previous values after."""
    saved = {key: os.environ.get(key) for key in values}
    try:
        os.environ.update(values)
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@dataclass(frozen=True)
class SweepReport:
    """What an embedded sweep leaves behind."""

    sweep_id: str
    report_path: Path
    table: dict[str, Any]
    outcome: dict[str, Any] | None     # None when the sweep flow failed (some cells failed)
    message: str | None
    claims: dict[str, Any] | None = None   # GET /sweeps/{id}/claims; None with several durations


def _has_cuda() -> bool:
    import torch

    return bool(torch.cuda.is_available())


def run_sweep_embedded(spec: SweepSpec, work_dir: Path, report_path: Path | None = None,
                       *, torch_threads: int | None = 1,
                       skip_memory_check: bool = False) -> SweepReport:
    """Run `spec` through the `failure-sweep` flow on the embedded stack and write the offline
    dashboard (default `<work_dir>/report-<sweep>.html`). The report is written even when some
    cells failed; a sweep that never registered raises the flow's error. `skip_memory_check`
    lets cells start whatever their memory estimate (FlowSettings.skip_memory_check)."""
    from api.dashboards.export import write_report
    from crucible.registry.reporting import ApiClient
    from flows.sweep_flow import failure_sweep, find_sweep

    work_dir = work_dir.resolve()
    own_prefect = not os.environ.get("PREFECT_API_URL")     # else a server's: its limits stay
    threads = {"CRUCIBLE_TORCH_THREADS": str(torch_threads)} if torch_threads else {}
    if skip_memory_check:
        threads["CRUCIBLE_SKIP_MEMORY_CHECK"] = "true"
    with embedded_registry(work_dir) as registry, embedded_prefect(work_dir), \
            flow_environment(registry.api_url, registry.token, work_dir, extra=threads):
        if own_prefect and torch_threads == 1 and not _has_cuda():
            # this Prefect database is the stack's own: on a CPU-only host, as many one-thread
            # cells train at once as the sweep runs (one slot would run them one at a time)
            from flows.gpu import set_gpu_limit

            set_gpu_limit(spec.max_concurrent_runs)
        state = failure_sweep(spec=spec, return_state=True)
        outcome = state.result(raise_on_failure=False) if state.is_completed() else None
        with ApiClient(registry.api_url, registry.token) as client:
            sweep_id = outcome["sweep_id"] if outcome else find_sweep(
                client, spec.name, spec.identity())
            if sweep_id is None:
                state.result()          # re-raises why the sweep could not even start
                raise RuntimeError("the sweep flow failed before registering the sweep")
            table = client.table(sweep_id)
            claims = _claims(client, sweep_id)
        path = report_path or work_dir / f"report-{sweep_id[:8]}.html"
        write_report(sweep_id, path, database_url=registry.database_url)
    return SweepReport(sweep_id, path.resolve(), table, outcome,
                       None if outcome else (state.message or "the sweep failed"), claims)


def _claims(client: Any, sweep_id: str) -> dict[str, Any] | None:
    """The sweep's claims, or None where it has none (422: several failure durations)."""
    from crucible.registry.client import ApiError, ApiUnavailable

    try:
        return dict(client.claims(sweep_id))
    except ApiError as exc:
        if isinstance(exc, ApiUnavailable) or exc.status_code != 422:
            raise
        return None

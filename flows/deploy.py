"""Deployments of the flows (train-run, failure-sweep, distributed-run), so users start them from
the Prefect UI.

Two ways to put them on a Prefect server (`PREFECT_API_URL`):

- `serve_deployments()` (`crucible deploy`): creates the deployments and serves them from this
  process (`prefect.serve`): it polls for scheduled runs and runs each in a subprocess. One
  command per GPU host; the `gpu:<hostname>` limit keeps each host within its devices. Serve
  outlasts a Prefect outage of any length: Prefect's runner gives up after 3 failed polls
  (`critical_service_loop`), so serve polls through `patient_service_loop` instead, which
  logs each failed poll and backs off to at most `POLL_BACKOFF_MAX_S`.
- `deploy_to_pool(pool)` (`crucible deploy --pool NAME`): registers the deployments on a work
  pool (a process pool, or a Kubernetes pool whose base job template requests GPUs, see
  `infra/k8s-gpu-base-job-template.json`); workers started with `prefect worker start --pool
  NAME` on any number of machines run them. `--image` names the container image for a
  Kubernetes/Docker pool; the code is then loaded from `--source` inside the image.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio
import httpx
from prefect import Flow
from prefect.deployments.runner import RunnerDeployment

from crucible.grid.spec import DEMO_SPEC
from crucible.registry.identity import code_version
from flows.distributed_flow import distributed_run
from flows.run_flow import train_run
from flows.sweep_flow import failure_sweep

__all__ = ["DEPLOYMENTS", "build_deployments", "serve_deployments", "deploy_to_pool",
           "REPO_ROOT", "patient_service_loop", "POLL_BACKOFF_MAX_S"]

_log = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parent.parent
TAGS = ["crucible"]

# (flow, deployment name, entrypoint relative to the repository root, description)
DEPLOYMENTS: list[tuple[Flow[Any, Any], str, str, str]] = [
    (train_run, "train-run", "flows/run_flow.py:train_run",
     "One training run of a preset with overrides, recorded in the Crucible registry; "
     "retries transient errors and resumes from its last checkpoint."),
    (failure_sweep, "failure-sweep", "flows/sweep_flow.py:failure_sweep",
     "A failure-rate sweep: compression arms x strategies x failure probabilities x seeds, "
     "each against its own p = 0 baseline; posts the robustness table and dashboard link."),
    (distributed_run, "distributed-run", "flows/distributed_flow.py:distributed_run",
     "One run in distributed mode: a torch.distributed.elastic agent per replica on the worker "
     "host, contributions through the store, planned SIGKILLs (kills); recorded in the registry "
     "with the merged summary."),
]


def _sweep_defaults() -> dict[str, Any]:
    """The sweep form's pre-filled values: the demo grid, so "Run" works out of the box."""
    return {"spec": dict(DEMO_SPEC)}


def build_deployments() -> list[RunnerDeployment]:
    """The deployments, ready for `prefect.serve`."""
    deployments = []
    for flow_obj, name, _entry, description in DEPLOYMENTS:
        parameters = _sweep_defaults() if name == "failure-sweep" else None
        # _sync: Prefect dispatches to the async variant whenever it detects an async context
        # (e.g. a loop left running by an earlier caller); this function is synchronous.
        deployments.append(flow_obj.to_deployment(
            name=name, description=description, tags=TAGS, version=code_version(),
            parameters=parameters, _sync=True))
    return deployments


# the longest wait between two polls of an unreachable Prefect API
POLL_BACKOFF_MAX_S = 60.0


async def patient_service_loop(workload: Callable[[], Awaitable[Any]], interval: float, *,
                               run_once: bool = False, **_prefect_options: Any) -> None:
    """Prefect's `critical_service_loop` for serve's poll, without its exit: call `workload`
    every `interval` seconds; a poll that cannot reach the API (connection errors, timeouts,
    5xx, after the client's own retries) is logged, one line per failed poll, and the next one
    waits twice as long, up to `POLL_BACKOFF_MAX_S`, until the API answers again. Any other
    error is raised (a bug, not an outage)."""
    failures = 0
    while True:
        try:
            await workload()
        except (httpx.TransportError, httpx.HTTPStatusError) as exc:
            if isinstance(exc, httpx.HTTPStatusError) and exc.response.status_code < 500:
                raise
            failures += 1
            wait_s = min(interval * 2 ** min(failures - 1, 16), POLL_BACKOFF_MAX_S)
            what = (f"HTTP {exc.response.status_code}" if isinstance(exc, httpx.HTTPStatusError)
                    else type(exc).__name__)
            _log.warning("serve: Prefect API unreachable (failed poll %d: %s); polling again "
                         "in %.0f s", failures, what, wait_s)
        else:
            if failures:
                _log.info("serve: Prefect API reachable again after %d failed poll(s)",
                          failures)
            failures, wait_s = 0, interval
        if run_once:
            return
        await anyio.sleep(wait_s)


def _poll_patiently() -> None:
    """Make this process's runner poll through `patient_service_loop` (the name Prefect's
    poller module calls; refuse to serve if a Prefect upgrade moved it, rather than give up on
    the first outage again)."""
    from prefect.runner import _scheduled_run_poller

    if not hasattr(_scheduled_run_poller, "critical_service_loop"):
        raise RuntimeError("prefect.runner._scheduled_run_poller.critical_service_loop is gone "
                           "(a Prefect upgrade): update flows.deploy._poll_patiently")
    _scheduled_run_poller.critical_service_loop = patient_service_loop  # type: ignore[assignment]


def serve_deployments(limit: int | None = None) -> None:
    """Create the deployments on the configured Prefect server and serve them until stopped
    (SIGTERM or SIGINT: serve cancels its flow runs, whose hooks record them cancelled),
    through Prefect outages of any length.

    `limit` caps the flow runs this process runs at once (default: unlimited; GPU slots still
    bound the training runs).
    """
    from prefect import serve

    _poll_patiently()
    deployments = build_deployments()
    _log.info("serving %s", ", ".join(f"{d.flow_name}/{d.name}" for d in deployments))
    attempt = 0
    while True:
        try:
            serve(*deployments, limit=limit)
            return
        except Exception as exc:   # applying the deployments met an outage: apply them again
            if not _transient(exc):
                raise
            attempt += 1
            delay = min(APPLY_BACKOFF_MAX_S, 2.0 ** attempt)
            _log.warning("applying the deployments failed (%s: %s); attempt %d, trying again "
                         "in %.0f s", type(exc).__name__, exc, attempt, delay)
            time.sleep(delay)


# the longest wait between two tries at applying the deployments during an outage
APPLY_BACKOFF_MAX_S = 30.0


def _transient(exc: BaseException) -> bool:
    """An error an outage of the Prefect server or its database explains: no connection, a
    timeout, or a 5xx answer (a 503 while its database restarts)."""
    if isinstance(exc, httpx.TransportError):
        return True
    if isinstance(exc, httpx.HTTPStatusError):
        return exc.response.status_code >= 500
    cause = exc.__cause__ or exc.__context__
    return cause is not None and cause is not exc and _transient(cause)


def deploy_to_pool(pool: str, *, image: str | None = None, source: str | None = None,
                   job_variables: dict[str, Any] | None = None) -> list[str]:
    """Register the deployments on work pool `pool`; returns their ids.

    `source` is where a worker finds the code (default: this checkout, right for a process pool
    on this machine; for a container pool, the path of the code inside `image`).
    """
    ids = []
    for flow_obj, name, entrypoint, description in DEPLOYMENTS:
        loaded = flow_obj.from_source(source=source or str(REPO_ROOT), entrypoint=entrypoint,
                                      _sync=True)
        parameters = _sweep_defaults() if name == "failure-sweep" else None
        deployment_id = loaded.deploy(
            name=name, work_pool_name=pool, image=image, build=False, push=False,
            description=description, tags=TAGS, version=code_version(), parameters=parameters,
            job_variables=job_variables or {}, print_next_steps=False, _sync=True)
        ids.append(str(deployment_id))
        _log.info("deployed %s/%s to work pool %s", flow_obj.name, name, pool)
    return ids

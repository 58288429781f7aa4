"""Settings of the process that runs flows (a Prefect worker or `flow.serve`), read once from the
environment. Flow and task code receives a `FlowSettings`; it never reads `os.environ` itself.

Secrets (the API token) come from here, never from flow parameters, which the Prefect UI shows.
The client fields (the registry, the store, the work folder and spools, the dashboards' URL) are
`crucible.registry.settings.ReporterSettings`'s, shared with `crucible run --api` and
`crucible api replay`; the four that reach the registry and the store are `ClientSettings`'s,
shared with the registry service's settings and the `crucible api` client commands.
"""
from __future__ import annotations

from pydantic import Field

from crucible.registry.settings import ReporterSettings

__all__ = ["FlowSettings"]


class FlowSettings(ReporterSettings):
    """`CRUCIBLE_*` variables the flows read: the client settings (`CRUCIBLE_API_URL`,
    `CRUCIBLE_API_TOKEN`, `CRUCIBLE_STORE_URL`, `CRUCIBLE_S3_ENDPOINT_URL`, `CRUCIBLE_WORK_DIR`,
    `CRUCIBLE_SPOOL_DIR`, `CRUCIBLE_REPLAY_TIMEOUT_S`, `CRUCIBLE_PUBLIC_URL`) and the worker's."""

    torch_threads: int | None = Field(
        None, ge=1, description="torch intra-op threads per training run (unset: torch's "
                                "default); 1 avoids oversubscribing a shared CPU machine.")
    skip_memory_check: bool = Field(
        False, description="Start runs even when their estimated peak memory exceeds what "
                           "the worker has left (crucible.memory; `crucible run "
                           "--skip-memory-check`).")

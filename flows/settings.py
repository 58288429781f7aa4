"""Settings of the process that runs flows (a Prefect worker or `flow.serve`), read once from the
environment. Flow and task code receives a `FlowSettings`; it never reads `os.environ` itself.

Secrets (the API token) come from here, never from flow parameters, which the Prefect UI shows.
The four client fields are `crucible.registry.settings.ClientSettings`'s, shared with the registry
service's settings and the `crucible api` client commands.
"""
from __future__ import annotations

from pathlib import Path

from pydantic import Field

from crucible.registry.settings import ClientSettings

__all__ = ["FlowSettings"]


class FlowSettings(ClientSettings):
    """`CRUCIBLE_*` variables the flows read: the client settings (`CRUCIBLE_API_URL`,
    `CRUCIBLE_API_TOKEN`, `CRUCIBLE_STORE_URL`, `CRUCIBLE_S3_ENDPOINT_URL`) and the worker's."""

    work_dir: Path = Field(Path("crucible-work"),
                           description="Where runs write summary.json, jsonl files and spools.")
    spool_dir: Path | None = Field(
        None, description="Spool root: metrics, events and final states the registry has not "
                          "stored yet, one folder per run; every reporter, flow start and "
                          "`crucible api replay` drains it (unset: <work_dir>/spool).")
    replay_timeout_s: float = Field(
        60.0, gt=0, description="How long a flow spends replaying spools, at its start and "
                                "before recording a run's final state, per attempt.")
    torch_threads: int | None = Field(
        None, ge=1, description="torch intra-op threads per training run (unset: torch's "
                                "default); 1 avoids oversubscribing a shared CPU machine.")
    public_url: str | None = Field(
        None, description="Browser-facing base URL of the API for dashboard links "
                          "(default: api_url).")
    skip_memory_check: bool = Field(
        False, description="Start runs even when their estimated peak memory exceeds what "
                           "the worker has left (crucible.memory; `crucible run "
                           "--skip-memory-check`).")

    @property
    def spool_root(self) -> Path:
        """Where every reporter of this work folder spools, and every replay looks."""
        return (self.spool_dir or self.work_dir / "spool").resolve()

    @property
    def dashboard_base(self) -> str:
        return (self.public_url or self.api_url).rstrip("/")

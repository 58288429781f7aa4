"""Settings of the process that runs flows (a Prefect worker or `flow.serve`), read once from the
environment. Flow and task code receives a `FlowSettings`; it never reads `os.environ` itself.

Secrets (the API token) come from here, never from flow parameters, which the Prefect UI shows.
"""
from __future__ import annotations

from pathlib import Path

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

__all__ = ["FlowSettings"]


class FlowSettings(BaseSettings):
    """`CRUCIBLE_*` variables the flows read."""

    model_config = SettingsConfigDict(env_prefix="CRUCIBLE_", extra="ignore")

    api_url: str = Field("http://127.0.0.1:8000",
                         description="Base URL of the Crucible registry API (without /api/v1).")
    api_token: str | None = Field(None, description="Bearer token for registry writes.")
    store_url: str | None = Field(
        None, description="Default object store (file:///path or s3://bucket/prefix) when a run "
                          "or sweep does not name one; unset: a folder beside each run.")
    s3_endpoint_url: str | None = Field(None, description="S3 endpoint (MinIO, R2, moto).")
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

    @field_validator("api_url")
    @classmethod
    def _no_trailing_slash(cls, value: str) -> str:
        if not value.startswith(("http://", "https://")):
            raise ValueError(f"CRUCIBLE_API_URL={value!r} must start with http:// or https://")
        return value.rstrip("/")

    @field_validator("store_url")
    @classmethod
    def _store_scheme(cls, value: str | None) -> str | None:
        if not value:
            return None
        from crucible.store import parse_store_url  # the one check `store.url` gets too

        parse_store_url(value, field="CRUCIBLE_STORE_URL")
        return value.rstrip("/")

    @property
    def spool_root(self) -> Path:
        """Where every reporter of this work folder spools, and every replay looks."""
        return (self.spool_dir or self.work_dir / "spool").resolve()

    @property
    def dashboard_base(self) -> str:
        return (self.public_url or self.api_url).rstrip("/")

"""Client settings: how a process reaches the registry and the object store, read once from the
environment (`CRUCIBLE_API_URL`, `CRUCIBLE_API_TOKEN`, `CRUCIBLE_STORE_URL`,
`CRUCIBLE_S3_ENDPOINT_URL`), and where a process that reports runs keeps what it still owes.

`ClientSettings`: one class for every reader of these four variables: `ReporterSettings` and the
registry service's `api.settings.Settings` extend it, and the `crucible api` client commands
read it directly. The token is a `SecretStr` (its repr hides it); `token` is its plain text for
an HTTP client.

`ReporterSettings`: the client settings of a process that reports runs (`crucible run --api`,
`crucible api replay`, and the flows' `flows.settings.FlowSettings`, which extends it): its
work folder and spool root, how long it replays spools, the dashboards' browser-facing URL.
Imports pydantic, never torch.
"""
from __future__ import annotations

from pathlib import Path

from pydantic import Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

__all__ = ["ClientSettings", "ReporterSettings"]


class ClientSettings(BaseSettings):
    """`CRUCIBLE_*` variables of a registry and store client."""

    model_config = SettingsConfigDict(env_prefix="CRUCIBLE_", extra="ignore")

    api_url: str = Field("http://127.0.0.1:8000",
                         description="Base URL of the Crucible registry API (without /api/v1).")
    api_token: SecretStr | None = Field(
        None, description="Bearer token: clients send it for registry writes; the registry "
                          "service also accepts it for writes.")
    store_url: str | None = Field(
        None, description="Default object store (file:///path or s3://bucket/prefix) when a run "
                          "or sweep does not name one; unset: a folder beside each run.")
    s3_endpoint_url: str | None = Field(None, description="S3 endpoint (MinIO, R2, moto).")

    # the validators have names of their own: a subclass method of the same name replaces one
    @field_validator("api_url")
    @classmethod
    def _api_http_url(cls, value: str) -> str:
        if not value.startswith(("http://", "https://")):
            raise ValueError(f"CRUCIBLE_API_URL={value!r} must start with http:// or https://")
        return value.rstrip("/")

    @field_validator("store_url")
    @classmethod
    def _client_store_url(cls, value: str | None) -> str | None:
        if not value:
            return None
        from crucible.store import parse_store_url  # the one check `store.url` gets too

        parse_store_url(value, field="CRUCIBLE_STORE_URL")
        return value.rstrip("/")

    @property
    def token(self) -> str | None:
        """The API token in plain text, or None."""
        return self.api_token.get_secret_value() if self.api_token else None


class ReporterSettings(ClientSettings):
    """`CRUCIBLE_*` variables of a process that reports runs to the registry: the client
    settings and where its runs and spools live (`CRUCIBLE_WORK_DIR`, `CRUCIBLE_SPOOL_DIR`),
    how long it replays (`CRUCIBLE_REPLAY_TIMEOUT_S`), the dashboards' URL
    (`CRUCIBLE_PUBLIC_URL`)."""

    work_dir: Path = Field(Path("crucible-work"),
                           description="Where runs write summary.json, jsonl files and spools.")
    spool_dir: Path | None = Field(
        None, description="Spool root: metrics, events and final states the registry has not "
                          "stored yet, one folder per run; every reporter, flow start and "
                          "`crucible api replay` drains it (unset: <work_dir>/spool).")
    replay_timeout_s: float = Field(
        60.0, gt=0, description="How long a flow spends replaying spools, at its start and "
                                "before recording a run's final state, per attempt.")
    public_url: str | None = Field(
        None, description="Browser-facing base URL of the API for dashboard links "
                          "(default: api_url).")

    @property
    def spool_root(self) -> Path:
        """Where every reporter of this work folder spools, and every replay looks."""
        return (self.spool_dir or self.work_dir / "spool").resolve()

    @property
    def dashboard_base(self) -> str:
        return (self.public_url or self.api_url).rstrip("/")

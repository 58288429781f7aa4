"""Client settings: how a process reaches the registry and the object store, read once from the
environment (`CRUCIBLE_API_URL`, `CRUCIBLE_API_TOKEN`, `CRUCIBLE_STORE_URL`,
`CRUCIBLE_S3_ENDPOINT_URL`).

One class for every reader of these four variables: the flows' `flows.settings.FlowSettings`
and the registry service's `api.settings.Settings` extend it, and the `crucible api` client
commands read it directly. The token is a `SecretStr` (its repr hides it); `token` is its
plain text for an HTTP client. Imports pydantic, never torch.
"""
from __future__ import annotations

from pydantic import Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

__all__ = ["ClientSettings"]


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

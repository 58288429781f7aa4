"""Service settings: the one pydantic-settings class every registry component reads.

Values come from `CRUCIBLE_*` environment variables (or a `.env` file); route and task code never
reads `os.environ` itself. The embedded default is an SQLite file in the working folder.
"""
from __future__ import annotations

from functools import lru_cache
from urllib.parse import urlsplit

from pydantic import Field, SecretStr, field_validator
from pydantic_settings import SettingsConfigDict

from crucible.registry.settings import ClientSettings

__all__ = ["Settings", "get_settings"]


class Settings(ClientSettings):
    """Registry service settings (env prefix `CRUCIBLE_`): the client settings
    (`crucible.registry.settings.ClientSettings`: `api_url`, `api_token` - which the server also
    accepts for writes -, `store_url`, `s3_endpoint_url`) and the service's own."""

    model_config = SettingsConfigDict(env_prefix="CRUCIBLE_", env_file=".env", extra="ignore")

    database_url: str = Field("sqlite:///./crucible.db",
                              description="SQLAlchemy URL of the registry database")
    reads_require_token: bool = Field(
        False, description="close reads (GET endpoints, dashboards) to anonymous users; browsers "
                           "sign in at /login")
    max_body_bytes: int = Field(
        32 * 1024 * 1024, gt=0, description="caps every endpoint's own body limit "
                                            "(api.middleware.BODY_LIMITS); larger bodies get a 413")
    session_secret: SecretStr | None = Field(
        None, min_length=32, description="signs browser session cookies (32+ characters, e.g. "
                                         "`openssl rand -hex 32`); unset: a random secret per "
                                         "process (sessions end when the API restarts)")
    session_ttl_s: int = Field(12 * 3600, gt=0, description="how long a browser session lasts "
                                                            "(never past its token's expiry)")
    migrate_on_start: bool = Field(False, description="run migrations to head when the app starts")
    prefect_ui_url: str | None = Field(
        None, description="the Prefect UI's base URL, e.g. http://127.0.0.1:4200; pages then link "
                          "a flow run as {prefect_ui_url}/runs/flow-run/{id} (unset: no links)")

    @field_validator("prefect_ui_url")
    @classmethod
    def _http_url(cls, value: str | None) -> str | None:
        """An http(s) URL without its trailing slash; '' counts as unset."""
        if value is None or not value.strip():
            return None
        url = value.strip().rstrip("/")
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise ValueError(f"CRUCIBLE_PREFECT_UI_URL={value!r} is not an http(s) URL; give "
                             "the Prefect UI's address, e.g. http://127.0.0.1:4200")
        return url


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    """The process-wide settings, read once from the environment."""
    return Settings()

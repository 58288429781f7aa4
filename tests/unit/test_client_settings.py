"""One client-settings class: `CRUCIBLE_API_URL`, `CRUCIBLE_API_TOKEN`, `CRUCIBLE_STORE_URL` and
`CRUCIBLE_S3_ENDPOINT_URL` are declared once (`crucible.registry.settings.ClientSettings`) and read
the same way by the flows' settings, the registry service's settings and the `crucible api`
client commands."""
from __future__ import annotations

import pytest
from pydantic import ValidationError

from api.settings import Settings
from crucible.registry.settings import ClientSettings
from flows.settings import FlowSettings

CLIENT_FIELDS = {"api_url", "api_token", "store_url", "s3_endpoint_url"}
READERS = [ClientSettings, FlowSettings, Settings]


def _read(cls):
    return cls(_env_file=None)     # the environment only (the service also reads a .env file)


def test_the_client_fields_are_declared_once():
    assert set(ClientSettings.model_fields) == CLIENT_FIELDS
    for cls in (FlowSettings, Settings):
        assert issubclass(cls, ClientSettings)
        # inherited, not declared again (with another type, default or check)
        assert not CLIENT_FIELDS & set(vars(cls).get("__annotations__", {})), cls
        for name in CLIENT_FIELDS:
            ours, base = cls.model_fields[name], ClientSettings.model_fields[name]
            assert (ours.annotation, ours.default) == (base.annotation, base.default), name


@pytest.mark.parametrize("cls", READERS)
def test_every_reader_takes_the_same_environment_variables(cls, monkeypatch, tmp_path):
    monkeypatch.setenv("CRUCIBLE_API_URL", "https://registry.example:8000/")
    monkeypatch.setenv("CRUCIBLE_API_TOKEN", "crc_secret-token")
    monkeypatch.setenv("CRUCIBLE_STORE_URL", f"file://{tmp_path}/store/")
    monkeypatch.setenv("CRUCIBLE_S3_ENDPOINT_URL", "http://minio:9000")
    settings = _read(cls)
    assert settings.api_url == "https://registry.example:8000"       # without the slash
    assert settings.token == "crc_secret-token"
    assert "crc_secret-token" not in repr(settings)                    # a SecretStr
    assert settings.store_url == f"file://{tmp_path}/store"
    assert settings.s3_endpoint_url == "http://minio:9000"


@pytest.mark.parametrize("cls", READERS)
def test_defaults_without_the_variables(cls, monkeypatch):
    for name in CLIENT_FIELDS:
        monkeypatch.delenv(f"CRUCIBLE_{name.upper()}", raising=False)
    settings = _read(cls)
    assert (settings.api_url, settings.token, settings.store_url, settings.s3_endpoint_url) == (
        "http://127.0.0.1:8000", None, None, None)


@pytest.mark.parametrize("cls", READERS)
@pytest.mark.parametrize(("variable", "value"), [
    ("CRUCIBLE_API_URL", "registry.example:8000"),
    ("CRUCIBLE_STORE_URL", "ftp://nowhere/runs"),
])
def test_a_bad_value_fails_naming_the_variable(cls, variable, value, monkeypatch):
    monkeypatch.setenv(variable, value)
    with pytest.raises(ValidationError, match=variable):
        _read(cls)


def test_the_service_accepts_the_same_token_clients_send(monkeypatch):
    from api.deps import static_token

    monkeypatch.setenv("CRUCIBLE_API_TOKEN", "crc_shared")
    assert static_token(_read(Settings)) == _read(FlowSettings).token == "crc_shared"


def test_crucible_api_client_commands_refuse_a_bad_url_naming_the_variable(monkeypatch):
    from typer.testing import CliRunner

    from cli.main import _register_packages, app

    _register_packages()
    monkeypatch.setenv("CRUCIBLE_API_URL", "registry.example:8000")
    done = CliRunner().invoke(app, ["api", "note", "run", "some-run"])
    assert done.exit_code == 2
    assert "CRUCIBLE_API_URL" in done.output

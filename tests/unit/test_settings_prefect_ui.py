"""`CRUCIBLE_PREFECT_UI_URL`: optional, an http(s) URL, kept without its trailing slash so pages
can append `/runs/flow-run/{id}`; anything else fails at start-up naming the variable."""
from __future__ import annotations

import pytest
from pydantic import ValidationError

from api.settings import Settings


def test_prefect_ui_url_is_optional(monkeypatch):
    monkeypatch.delenv("CRUCIBLE_PREFECT_UI_URL", raising=False)
    assert Settings(_env_file=None).prefect_ui_url is None
    monkeypatch.setenv("CRUCIBLE_PREFECT_UI_URL", "")
    assert Settings(_env_file=None).prefect_ui_url is None


@pytest.mark.parametrize(("given", "kept"), [
    ("http://127.0.0.1:4200", "http://127.0.0.1:4200"),
    ("https://prefect.example.org/ui/", "https://prefect.example.org/ui"),
    (" http://host:4200// ", "http://host:4200"),
])
def test_prefect_ui_url_from_the_environment_loses_its_trailing_slash(monkeypatch, given, kept):
    monkeypatch.setenv("CRUCIBLE_PREFECT_UI_URL", given)
    assert Settings(_env_file=None).prefect_ui_url == kept


@pytest.mark.parametrize("bad", ["127.0.0.1:4200", "ftp://host/ui", "http://", "prefect"])
def test_a_prefect_ui_url_that_is_not_http_fails_naming_the_variable(monkeypatch, bad):
    monkeypatch.setenv("CRUCIBLE_PREFECT_UI_URL", bad)
    with pytest.raises(ValidationError, match="CRUCIBLE_PREFECT_UI_URL"):
        Settings(_env_file=None)

"""Shared pytest set-up. Each real part the tests need has its own fixture plugin module."""
from __future__ import annotations

import pytest

pytest_plugins = [
    "tests.fixtures.postgres",
    "tests.fixtures.s3",
    "tests.fixtures.browser",
    "tests.fixtures.prefect",
]


@pytest.fixture(autouse=True)
def _isolated_cache(monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory) -> None:
    """Keep every test's working folder private; the corpus cache stays the user's."""
    monkeypatch.setenv("CRUCIBLE_LOG_LEVEL", "WARNING")

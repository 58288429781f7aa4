"""Shared pytest set-up. Each real part the tests need has its own fixture plugin module."""
from __future__ import annotations

import os
import tempfile

import pytest
import torch

# One torch thread per process: the suite shares two cores with the servers it starts (Postgres,
# moto, uvicorn, Prefect, Chromium), and oversubscribed threads make training several times
# slower. Subprocesses (the CLI tests) inherit it through the environment.
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)
# GPU slot holder files are per host (flows.gpu): this session's own folder, so a slot another
# session on the same machine holds (a developer's run, a second checkout's tests) is not
# reported as held in this session's Prefect. Subprocesses inherit it.
os.environ["CRUCIBLE_GPU_SLOTS_DIR"] = tempfile.mkdtemp(prefix="crucible-gpu-slots-")

pytest_plugins = [
    "tests.fixtures.postgres",
    "tests.fixtures.s3",
    "tests.fixtures.browser",
    "tests.fixtures.prefect",
]


_FOLDER_MARKERS = {"unit": ("unit",), "integration": ("integration",),
                   "browser": ("browser", "integration")}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Markers by folder: tests/unit -> unit (no Postgres, no S3 server, no Prefect, no
    browser), tests/integration -> integration, tests/browser -> browser and integration; so
    `-m unit` is the fast lane and a test's folder says what it needs."""
    root = config.rootpath / "tests"
    for item in items:
        try:
            folder = item.path.relative_to(root).parts[0]
        except ValueError:
            continue
        for name in _FOLDER_MARKERS.get(folder, ()):
            item.add_marker(name)


@pytest.fixture(autouse=True)
def _isolated_cache(monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory) -> None:
    """Keep every test's working folder private; the corpus cache stays the user's."""
    monkeypatch.setenv("CRUCIBLE_LOG_LEVEL", "WARNING")
    # a user's shell (`eval "$(infra/stack.sh env)"`) must not make every CLI test report
    monkeypatch.delenv("CRUCIBLE_API_URL", raising=False)

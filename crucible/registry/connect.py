"""The one door to the registry from settings: a client, a run's metric/event callback, and the
browser URLs of its dashboard pages.

Kept in one place so the flows and `crucible run --api` do not repeat how
`crucible.registry.reporting` is constructed, nor where the dashboards live.
"""
from __future__ import annotations

from typing import Any

from crucible.events import Callback
from crucible.registry.settings import ReporterSettings

__all__ = ["make_client", "make_callback", "run_page", "sweep_page"]

# where the API serves the dashboards (api.dashboards.routes; the client does not import the API)
_SWEEP_PATH = "/dashboards/sweeps/{sweep_id}"
_RUN_PATH = "/dashboards/runs/{run_id}"


def make_client(settings: ReporterSettings) -> Any:
    """A `crucible.registry.reporting.ApiClient` for the configured API and token."""
    from crucible.registry.reporting import ApiClient

    return ApiClient(settings.api_url, settings.token)


def make_callback(settings: ReporterSettings, run_id: str) -> Callback:
    """The registry callback of run `run_id`: sends from a background thread, spools under
    `settings.spool_root` while the API is unreachable, replays every spool there."""
    from crucible.registry.reporting import ApiCallback

    return ApiCallback(make_client(settings), run_id, spool_dir=settings.spool_root)


def sweep_page(settings: ReporterSettings, sweep_id: str) -> str:
    """The browser URL of sweep `sweep_id`'s dashboard page."""
    return settings.dashboard_base + _SWEEP_PATH.format(sweep_id=sweep_id)


def run_page(settings: ReporterSettings, run_id: str) -> str:
    """The browser URL of run `run_id`'s dashboard page."""
    return settings.dashboard_base + _RUN_PATH.format(run_id=run_id)

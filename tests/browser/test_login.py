"""Closed mode in a real headless Chromium: a dashboard link sends the browser to /login; after
signing in with a token it lands on the page it asked for, fully drawn (plotly.js included,
fetched with the session cookie), and signing out closes it again."""
from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests.browser.test_dashboards import SWEEP_FIGURES, _assert_rendered, _seed_sweep
from tests.fixtures.browser import serve_in_thread

pytestmark = [pytest.mark.browser, pytest.mark.integration]

TOKEN = "crc_closed-mode-browser-token"


@pytest.fixture(scope="module")
def closed_url(pg_url: str) -> Iterator[str]:
    """The registry with `reads_require_token` under uvicorn in a thread."""
    from api.app import create_app
    from api.settings import Settings

    app = create_app(Settings(database_url=pg_url, api_token=TOKEN, reads_require_token=True))
    with serve_in_thread(app, name="closed-uvicorn") as url:
        yield url


def test_browser_signs_in_and_reaches_a_closed_dashboard(closed_url: str,
                                                          browser_page: Any) -> None:
    sweep_id = _seed_sweep(closed_url, TOKEN, name="closed sweep")
    page = browser_page.page
    dashboard = f"{closed_url}/dashboards/sweeps/{sweep_id}"
    page.goto(dashboard)
    assert page.url.startswith(f"{closed_url}/login?next=")
    page.fill("#token", "crc_not-a-token")
    page.click("button[type=submit]")
    assert "invalid, revoked or expired" in page.locator(".error").inner_text()

    page.fill("#token", TOKEN)
    page.click("button[type=submit]")
    page.wait_for_url(dashboard)
    # the failed attempt's 401 is the one console error; the dashboard itself logs none
    browser_page.errors[:] = [e for e in browser_page.errors if "401" not in e]
    _assert_rendered(browser_page, SWEEP_FIGURES)
    cookie = next(c for c in page.context.cookies() if c["name"] == "crucible_session")
    assert cookie["httpOnly"] and cookie["sameSite"] == "Strict" and TOKEN not in cookie["value"]

    page.goto(f"{closed_url}/logout")
    page.goto(dashboard)
    assert page.url.startswith(f"{closed_url}/login?next=")

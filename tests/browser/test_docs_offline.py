"""/docs (Swagger UI) and /redoc (ReDoc) in a real headless Chromium on an air-gapped page:
every request to a host other than 127.0.0.1 is aborted, and the pages must still draw the
API's operations with a clean console."""
from __future__ import annotations

from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

import pytest

from tests.fixtures.browser import serve_in_thread

pytestmark = [pytest.mark.browser, pytest.mark.integration]


@pytest.fixture(scope="module")
def docs_url(pg_url: str) -> Iterator[str]:
    from api.app import create_app
    from api.settings import Settings

    app = create_app(Settings(database_url=pg_url, api_token="crc_docs-browser-token"))
    with serve_in_thread(app, name="docs-uvicorn") as url:
        yield url


def _offline(page: Any) -> list[str]:
    """Abort every request whose host is not 127.0.0.1; returns the list of aborted URLs."""
    blocked: list[str] = []

    def route(r: Any) -> None:
        url = r.request.url
        if urlsplit(url).hostname == "127.0.0.1":
            r.continue_()
        else:
            blocked.append(url)
            r.abort()

    page.route("**/*", route)
    return blocked


def test_swagger_ui_renders_offline(docs_url: str, browser_page: Any) -> None:
    page = browser_page.page
    blocked = _offline(page)
    page.goto(f"{docs_url}/docs")
    page.locator(".opblock-summary-path[data-path='/api/v1/runs']").first.wait_for()
    assert page.locator(".opblock").count() > 5
    assert blocked == []
    assert browser_page.errors == []


def test_redoc_renders_offline(docs_url: str, browser_page: Any) -> None:
    page = browser_page.page
    blocked = _offline(page)
    page.goto(f"{docs_url}/redoc")
    menu = page.locator("[role=menuitem]", has_text="List runs")
    menu.first.wait_for()
    assert page.locator(".api-content").count() == 1
    assert blocked == []
    assert browser_page.errors == []

"""/docs (Swagger UI) and /redoc (ReDoc) are served without any remote host: their HTML points
only at the server's own paths, and every asset it names is served locally. Closed mode keeps
them public, like /openapi.json. The browser test (tests/browser/test_docs_offline.py) proves
the pages render with the network cut off."""
from __future__ import annotations

import re
import warnings
from collections.abc import Iterator
from typing import Any

import pytest

pytestmark = pytest.mark.integration

_ABSOLUTE_URL = re.compile(r"""(?:https?:)?//[^\s"'<>)]+""")
_LOCAL_REF = re.compile(r"""(?:src|href|url)\s*[=:]\s*['"](/[^'"]*)['"]""")


def _absolute_urls(html: str) -> list[str]:
    return _ABSOLUTE_URL.findall(html)


@pytest.mark.parametrize("page", ["/docs", "/redoc"])
def test_docs_page_names_no_remote_url_and_its_assets_are_served(registry: Any, page: str) -> None:
    response = registry.get(page)
    assert response.status_code == 200, response.text
    html = response.text
    assert _absolute_urls(html) == []
    local = _LOCAL_REF.findall(html)
    assert "/openapi.json" in local
    assets = [ref for ref in local if ref.startswith("/static/")]
    assert any(ref.endswith(".js") for ref in assets), local
    for ref in assets:
        asset = registry.get(ref)
        assert asset.status_code == 200, ref
        assert len(asset.content) > 0, ref


@pytest.fixture
def closed_client(pg_db: str) -> Iterator[Any]:
    """A client without any token on the registry with `reads_require_token`."""
    from api.app import create_app
    from api.settings import Settings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from fastapi.testclient import TestClient

    app = create_app(Settings(database_url=pg_db, api_token="crc_docs-closed-token",
                              reads_require_token=True))
    with TestClient(app) as client:
        yield client
    app.state.engine.dispose()


def test_closed_mode_keeps_docs_public_like_the_schema(closed_client: Any) -> None:
    assert closed_client.get("/api/v1/runs").status_code == 401
    for path in ("/openapi.json", "/docs", "/redoc", "/static/api-docs/swagger-ui-bundle.js"):
        assert closed_client.get(path).status_code == 200, path

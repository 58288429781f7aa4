"""List filters of the registry API: `sweeps?name=` (case-insensitive substring) and unknown
query parameters refused with a 422 that names them."""
from __future__ import annotations

import pytest

from crucible.config import Config

pytestmark = pytest.mark.integration

V1 = "/api/v1"


def _sweep(registry, name):
    response = registry.post(f"{V1}/sweeps", json={"name": name})
    assert response.status_code == 201, response.text
    return response.json()["id"]


def test_sweeps_name_filter_matches_substrings_case_insensitively(registry):
    wanted = {_sweep(registry, "Alpha grid 10%"), _sweep(registry, "alpha-baselines")}
    _sweep(registry, "beta grid")
    listed = registry.get(f"{V1}/sweeps", params={"name": "ALPHA"}).json()["items"]
    assert {s["id"] for s in listed} == wanted
    # % and _ are taken literally, not as LIKE wildcards
    literal = registry.get(f"{V1}/sweeps", params={"name": "10%"}).json()["items"]
    assert [s["name"] for s in literal] == ["Alpha grid 10%"]
    assert registry.get(f"{V1}/sweeps", params={"name": "a_p"}).json()["items"] == []


@pytest.mark.parametrize(("path", "typo"), [("/runs", "compresion"), ("/sweeps", "nmae"),
                                            ("/sweeps/00000000-0000-4000-8000-000000000001",
                                             "verbose")])
def test_unknown_query_parameter_is_a_422_naming_it(registry, path, typo):
    response = registry.get(V1 + path, params={typo: "mapl"})
    assert response.status_code == 422, response.text
    body = response.json()
    assert [e["field"] for e in body["errors"]] == [f"query.{typo}"]
    assert typo in body["detail"] and "allowed" in body["detail"]


def test_runs_typo_no_longer_returns_everything(registry):
    sweep_id = _sweep(registry, "typo check")
    config = Config()
    config.pipeline.compression = "ssn"
    assert registry.post(f"{V1}/runs", json={"sweep_id": sweep_id,
                                             "config": config.to_dict()}).status_code == 201
    response = registry.get(f"{V1}/runs", params={"compresion": "mapl"})
    assert response.status_code == 422
    assert "compression" in response.json()["detail"]  # the allowed names are listed
    assert registry.get(f"{V1}/runs", params={"compression": "mapl"}).json()["items"] == []


def test_closed_index_sends_an_anonymous_browser_to_login(pg_db):
    from fastapi.testclient import TestClient

    from api.app import create_app
    from api.settings import Settings

    app = create_app(Settings(database_url=pg_db, api_token="crc_index-closed",
                              reads_require_token=True))
    try:
        client = TestClient(app)
        for path in ("/", "/dashboards"):
            response = client.get(path, follow_redirects=False)
            assert (response.status_code, response.headers["location"]) == (
                303, f"/login?next={path}")
        signed = client.get("/", headers={"Authorization": "Bearer crc_index-closed"})
        assert signed.status_code == 200 and "<h1>Crucible</h1>" in signed.text
    finally:
        app.state.engine.dispose()

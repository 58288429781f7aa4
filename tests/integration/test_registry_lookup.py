"""Sweeps by name: GET /sweeps/{sweep_ref} (and /robustness, /table, PATCH) take a sweep's UUID or
its exact name (the newest sweep of that name); a name that matches nothing is a 404 naming it.
`crud.resolve_sweep` and `ApiClient.get_sweep` follow the same rule."""
from __future__ import annotations

import uuid

import pytest

from api import crud
from api.errors import NotFoundError
from crucible.config import Config
from db.session import make_engine, make_session_factory

pytestmark = pytest.mark.integration

V1 = "/api/v1"


def _sweep(registry, name):
    response = registry.post(f"{V1}/sweeps", json={"name": name})
    assert response.status_code == 201, response.text
    return response.json()


def test_sweep_by_uuid_and_by_exact_name(registry):
    sweep = _sweep(registry, "grid A")
    _sweep(registry, "grid AB")
    assert registry.get(f"{V1}/sweeps/{sweep['id']}").json()["id"] == sweep["id"]
    by_name = registry.get(f"{V1}/sweeps/grid A")
    assert by_name.status_code == 200, by_name.text
    assert by_name.json()["id"] == sweep["id"]
    # exact, case-sensitive: no prefix or case-folded match
    assert registry.get(f"{V1}/sweeps/grid").status_code == 404
    assert registry.get(f"{V1}/sweeps/GRID A").status_code == 404


def test_the_newest_sweep_of_a_name_wins(registry):
    _sweep(registry, "rerun")
    newest = _sweep(registry, "rerun")
    assert registry.get(f"{V1}/sweeps/rerun").json()["id"] == newest["id"]


def test_unknown_name_is_a_404_naming_it(registry):
    response = registry.get(f"{V1}/sweeps/no such sweep")
    assert response.status_code == 404
    body = response.json()
    assert "'no such sweep'" in body["detail"] and body["errors"][0]["type"] == "NotFoundError"
    missing = str(uuid.uuid4())
    unknown_id = registry.get(f"{V1}/sweeps/{missing}")
    assert unknown_id.status_code == 404 and missing in unknown_id.json()["detail"]


def test_robustness_table_and_patch_take_a_name(registry):
    sweep = _sweep(registry, "named-sweep")
    config = Config().to_dict()
    assert registry.post(f"{V1}/runs", json={"sweep_id": sweep["id"],
                                             "config": config}).status_code == 201
    robustness = registry.get(f"{V1}/sweeps/named-sweep/robustness")
    assert robustness.status_code == 200 and robustness.json()["sweep_id"] == sweep["id"]
    assert robustness.json()["pending_runs"] == 1
    table = registry.get(f"{V1}/sweeps/named-sweep/table")
    assert table.status_code == 200 and table.json()["sweep_id"] == sweep["id"]
    for path in ("robustness", "table"):
        assert registry.get(f"{V1}/sweeps/nope/{path}").status_code == 404
    patched = registry.patch(f"{V1}/sweeps/named-sweep", json={"add_tags": ["found"]})
    assert patched.status_code == 200 and patched.json()["id"] == sweep["id"]
    assert patched.json()["tags"] == ["found"]


def test_a_name_with_nul_is_a_422(registry):
    response = registry.get(f"{V1}/sweeps/a%00b")
    assert response.status_code == 422
    assert response.json()["errors"][0]["field"] == "path.sweep_ref"


def test_resolve_sweep(pg_db):
    engine = make_engine(pg_db)
    try:
        with make_session_factory(engine)() as session:
            old = crud.create_sweep(session, name="same")
            new = crud.create_sweep(session, name="same")
            assert crud.resolve_sweep(session, str(old.id)).id == old.id
            assert crud.resolve_sweep(session, "same").id == new.id
            with pytest.raises(NotFoundError, match="'other'"):
                crud.resolve_sweep(session, "other")
            with pytest.raises(NotFoundError):
                crud.resolve_sweep(session, str(uuid.uuid4()))
    finally:
        engine.dispose()


def test_client_get_sweep_by_name(api_server):
    import httpx

    from crucible.registry.client import ApiClient, ApiError

    name = f"client lookup {uuid.uuid4().hex[:6]}"
    with ApiClient(api_server.url, api_server.token) as client:
        sweep = client.create_sweep(name, tags=["c"], notes="by client")
        assert client.get_sweep(name)["id"] == sweep["id"]
        assert client.get_sweep(name)["tags"] == ["c"]
        with pytest.raises(ApiError) as refused:
            client.get_sweep(f"{name} missing")
    assert refused.value.status_code == 404
    assert httpx.get(f"{api_server.url}{V1}/sweeps/{sweep['id']}").json()["notes"] == "by client"

"""Security and input validation: tokens, 404s, 413s and 422s that name the field."""
from __future__ import annotations

import json
import uuid

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import create_engine, func, select
from typer.testing import CliRunner

from api.app import create_app
from api.settings import Settings
from db.models import ApiToken, Metric

pytestmark = pytest.mark.integration

V1 = "/api/v1"


def _run_id(registry):
    return registry.post(f"{V1}/runs", json={"config": {"seed": 0}}).json()["id"]


def _metric_rows(url):
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            return conn.scalar(select(func.count()).select_from(Metric))
    finally:
        engine.dispose()


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"},
                                     {"Authorization": "Basic dXNlcjpwdw=="}])
def test_writes_without_a_valid_token_get_401(registry_app, headers):
    client = TestClient(registry_app)
    for method, path, body in [("POST", f"{V1}/sweeps", {"name": "s"}),
                               ("POST", f"{V1}/runs", {"config": {}}),
                               ("PATCH", f"{V1}/runs/{uuid.uuid4()}", {"status": "failed"}),
                               ("POST", f"{V1}/runs/{uuid.uuid4()}/metrics:batch", {"items": []})]:
        response = client.request(method, path, json=body, headers=headers)
        assert response.status_code == 401, (path, response.text)
        assert "token" in response.json()["detail"]
    assert client.get(f"{V1}/sweeps").status_code == 200  # reads are open by default


def test_token_from_cli_is_accepted_and_stored_hashed(registry_app, pg_db, monkeypatch):
    import typer

    from api.cli import register

    monkeypatch.setenv("CRUCIBLE_DATABASE_URL", pg_db)
    app = typer.Typer()
    app.callback()(lambda: None)
    register(app)
    result = CliRunner().invoke(app, ["api", "token", "create", "--name", "ci"])
    assert result.exit_code == 0, result.output
    token = result.output.strip().splitlines()[-1]
    client = TestClient(registry_app, headers={"Authorization": f"Bearer {token}"})
    assert client.post(f"{V1}/sweeps", json={"name": "s"}).status_code == 201
    engine = create_engine(pg_db)
    with engine.connect() as conn:
        hashes = conn.scalars(select(ApiToken.token_hash)).all()
    engine.dispose()
    assert hashes and token not in hashes and all(len(h) == 64 for h in hashes)


def test_reads_can_be_closed_with_a_setting(pg_db):
    app = create_app(Settings(database_url=pg_db, api_token="t0k", reads_require_token=True))
    client = TestClient(app)
    assert client.get(f"{V1}/sweeps").status_code == 401
    assert client.get(f"{V1}/sweeps", headers={"Authorization": "Bearer t0k"}).status_code == 200
    app.state.engine.dispose()


def test_forged_ids_get_404(registry):
    forged = uuid.uuid4()
    assert registry.get(f"{V1}/runs/{forged}").status_code == 404
    assert registry.get(f"{V1}/sweeps/{forged}").status_code == 404
    assert registry.patch(f"{V1}/runs/{forged}", json={"status": "failed"}).status_code == 404
    response = registry.post(f"{V1}/runs/{forged}/metrics:batch",
                             json={"items": [{"name": "val_loss", "global_step": 0, "value": 1}]})
    assert response.status_code == 404 and str(forged) in response.json()["detail"]
    assert registry.get(f"{V1}/runs/{forged}/events").status_code == 404
    response = registry.post(f"{V1}/runs", json={"sweep_id": str(forged), "config": {}})
    assert response.status_code == 404


def test_batch_over_the_limit_is_refused_whole(registry, pg_db):
    run_id = _run_id(registry)
    items = [{"name": "train_loss", "global_step": i, "replica": 0, "value": 1.0}
             for i in range(20_001)]
    response = registry.post(f"{V1}/runs/{run_id}/metrics:batch", json={"items": items})
    assert response.status_code == 413 and "10000" in response.json()["detail"]
    assert _metric_rows(pg_db) == 0
    ok = registry.post(f"{V1}/runs/{run_id}/metrics:batch", json={"items": items[:10_000]})
    assert ok.status_code == 200 and ok.json()["inserted"] == 10_000


def test_body_over_the_byte_limit_gets_413(pg_db):
    app = create_app(Settings(database_url=pg_db, api_token="t", max_body_bytes=1000))
    client = TestClient(app, headers={"Authorization": "Bearer t"})
    response = client.post(f"{V1}/sweeps", json={"name": "s", "spec": {"x": "y" * 2000}})
    assert response.status_code == 413 and "bytes" in response.json()["detail"]
    app.state.engine.dispose()


@pytest.mark.parametrize("value", ["NaN", "Infinity", "-Infinity"])
def test_non_finite_values_get_422_naming_the_field(registry, value):
    run_id = _run_id(registry)
    body = '{"items": [{"name": "val_loss", "global_step": 1, "value": VALUE}]}'.replace(
        "VALUE", value)
    response = registry.post(f"{V1}/runs/{run_id}/metrics:batch", content=body,
                             headers={"content-type": "application/json"})
    assert response.status_code == 422
    assert "body.items.0.value" in response.json()["detail"]
    patch = registry.patch(f"{V1}/runs/{run_id}", content=f'{{"final_val_loss": {value}}}',
                           headers={"content-type": "application/json"})
    assert patch.status_code == 422 and "final_val_loss" in patch.json()["detail"]
    spec = registry.post(f"{V1}/sweeps", content=f'{{"name": "s", "spec": {{"x": {value}}}}}',
                         headers={"content-type": "application/json"})
    assert spec.status_code == 422 and "spec" in spec.json()["detail"]


@pytest.mark.parametrize("path,body,field", [
    ("metrics:batch", {"items": [{"name": "loss", "global_step": 1, "value": 1}]},
     "body.items.0.name"),
    ("events:batch", {"items": [{"id": "x", "kind": "explode", "global_step": 1}]},
     "body.items.0.kind"),
    ("events:batch", {"items": [{"id": "x" * 201, "kind": "bypass", "global_step": 1}]},
     "body.items.0.id"),
    ("events:batch", {"items": [{"id": "a\x00b", "kind": "bypass", "global_step": 1}]},
     "body.items.0.id"),
    ("metrics:batch", {"items": [{"name": "val_loss", "global_step": -1, "value": 1}]},
     "body.items.0.global_step"),
])
def test_bad_items_get_422_naming_the_field(registry, pg_db, path, body, field):
    run_id = _run_id(registry)
    response = registry.post(f"{V1}/runs/{run_id}/{path}", json=body)
    assert response.status_code == 422, response.text
    assert field in response.json()["detail"]


def test_bad_run_and_sweep_bodies_get_422_naming_the_field(registry):
    cases = [
        ("POST", f"{V1}/sweeps", {"name": "n" * 201}, "body.name"),
        ("POST", f"{V1}/sweeps", {"name": "ok", "colour": "red"}, "body.colour"),
        ("POST", f"{V1}/runs", {"config": {"faults": {"strategy": "pray"}}}, "faults.strategy"),
        ("POST", f"{V1}/runs", {"config": {"modle": {}}}, "modle"),
        ("POST", f"{V1}/runs", {"config": {"seed": 2**70}}, "config"),
        ("PATCH", f"{V1}/runs/{_run_id(registry)}", {"status": "exploded"}, "body.status"),
        ("GET", f"{V1}/runs?compression=zip", None, "query.compression"),
        ("GET", f"{V1}/runs?cursor=not-a-cursor", None, "cursor"),
    ]
    for method, path, body, field in cases:
        response = registry.request(method, path,
                                    content=None if body is None else json.dumps(body),
                                    headers={"content-type": "application/json"})
        assert response.status_code == 422, (path, response.text)
        assert field in response.json()["detail"], response.json()


def test_bad_items_deep_in_a_full_batch_get_422_naming_their_index(registry, pg_db):
    run_id = _run_id(registry)
    items = [{"name": "train_loss", "global_step": i, "replica": 0, "value": 1.0}
             for i in range(10_000)]
    items[7321] = {"name": "train_loss", "global_step": 7321, "replica": 0}
    items[9999] = {**items[9999], "colour": "red"}
    items[42] = 5
    response = registry.post(f"{V1}/runs/{run_id}/metrics:batch", json={"items": items})
    assert response.status_code == 422, response.text
    fields = [e["field"] for e in response.json()["errors"]]
    assert fields == ["body.items.42", "body.items.7321.value", "body.items.9999.colour"]
    assert "body.items.7321.value: Field required" in response.json()["detail"]
    assert _metric_rows(pg_db) == 0


@pytest.mark.parametrize("item", [
    {"name": "val_loss", "global_step": 1, "replica": 2**40, "value": 1.0},   # beyond integer
    {"name": "val_loss", "global_step": 2**64, "value": 1.0},                 # beyond bigint
    {"name": "x" * 40, "global_step": 1, "value": 1.0},                       # beyond varchar(32)
    {"name": "val_loss", "global_step": "1", "value": 1.0},                   # not a number
])
def test_values_the_api_would_refuse_are_refused_by_crud_too(registry, pg_db, item):
    """Callers of records.insert_metrics that skip the API's validation get a DataError (a 422
    through the API), never a silently truncated value (the binary COPY must not wrap ints)."""
    from sqlalchemy.exc import DataError

    from api import records
    from db.session import make_engine, make_session_factory

    run_id = uuid.UUID(_run_id(registry))
    engine = make_engine(pg_db)
    try:
        with make_session_factory(engine)() as session, pytest.raises(DataError):
            records.insert_metrics(session, run_id=run_id, items=[item])
    finally:
        engine.dispose()
    assert _metric_rows(pg_db) == 0

"""One error contract: the published OpenAPI document and the responses agree. Every error has
the `ErrorResponse` shape and is documented on the routes that send it; numbers are strict (JSON
numbers only, whole floats for integers as JSON Schema reads them); cursors and JSON documents
are described exactly. (The schemathesis run in test_registry_fuzz.py checks all of it by
generation; these are the fast, named cases.)"""
from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from api.app import create_app
from api.settings import Settings

pytestmark = pytest.mark.integration

V1 = "/api/v1"
ERROR_REF = {"$ref": "#/components/schemas/ErrorResponse"}


def _run_id(registry):
    return registry.post(f"{V1}/runs", json={"config": {}}).json()["id"]


def _post(registry, path, body):
    return registry.post(path, content=body, headers={"content-type": "application/json"})


@pytest.mark.parametrize("item,field", [
    ('{"name": "val_loss", "global_step": 1, "value": "1.5"}', "body.items.0.value"),
    ('{"name": "val_loss", "global_step": 1, "value": true}', "body.items.0.value"),
    ('{"name": "val_loss", "global_step": "1", "value": 1.5}', "body.items.0.global_step"),
    ('{"name": "val_loss", "global_step": false, "value": 1.5}', "body.items.0.global_step"),
    ('{"name": "val_loss", "global_step": 1.5, "value": 1.5}', "body.items.0.global_step"),
    ('{"name": "val_loss", "global_step": 1, "tokens": "64", "value": 1}', "body.items.0.tokens"),
    ('{"name": "val_loss", "global_step": 1, "replica": true, "value": 1}', "body.items.0.replica"),
])
def test_strings_and_booleans_are_not_numbers(registry, item, field):
    response = _post(registry, f"{V1}/runs/{_run_id(registry)}/metrics:batch",
                     f'{{"items": [{item}]}}')
    assert response.status_code == 422, response.text
    assert [e["field"] for e in response.json()["errors"]] == [field]


def test_json_numbers_are_accepted_as_json_schema_reads_them(registry):
    """An integer field takes 3.0 (a whole number, `type: integer` in JSON Schema); a number
    field takes 2 (an integer is a number)."""
    run_id = _run_id(registry)
    body = '{"items": [{"name": "val_loss", "global_step": 3.0, "replica": 1.0, "value": 2}]}'
    response = _post(registry, f"{V1}/runs/{run_id}/metrics:batch", body)
    assert response.status_code == 200, response.text
    (metric,) = registry.get(f"{V1}/runs/{run_id}/metrics").json()["items"]
    assert (metric["global_step"], metric["replica"], metric["value"]) == (3, 1, 2.0)
    patch = registry.patch(f"{V1}/runs/{run_id}",
                           content='{"final_val_loss": 2, "tokens_processed": 640.0}',
                           headers={"content-type": "application/json"})
    assert patch.status_code == 200, patch.text
    for bad in ('{"final_val_loss": "2.5"}', '{"tokens_processed": true}'):
        refused = registry.patch(f"{V1}/runs/{run_id}", content=bad,
                                 headers={"content-type": "application/json"})
        assert refused.status_code == 422, (bad, refused.text)


def test_every_error_is_documented_with_the_error_model(registry_app):
    document = TestClient(registry_app).get("/openapi.json").json()
    schemas = document["components"]["schemas"]
    assert "HTTPValidationError" not in schemas
    assert set(schemas["ErrorResponse"]["properties"]) == {"detail", "errors"}
    for path, item in document["paths"].items():
        if path == "/readyz":  # its 503 is the readiness report itself, not an error
            continue
        for method, operation in item.items():
            codes = set(operation["responses"])
            for code in codes - {"200", "201", "303"}:
                content = operation["responses"][code].get("content", {})
                if "text/html" in content:  # a dashboard's 404 page
                    continue
                assert content["application/json"]["schema"] == ERROR_REF, (method, path, code)
            if path.startswith(V1):
                expected = ({"400", "401", "413", "422", "503"} if method != "get"
                            else {"401", "422", "503"})
                if "{" in path or path == f"{V1}/runs" and method == "post":
                    expected.add("404")
                assert expected <= codes, (method, path, sorted(codes))


def test_unknown_paths_and_methods_answer_the_error_model(registry):
    for response in (registry.get(f"{V1}/nothing-here"), registry.delete(f"{V1}/sweeps")):
        assert response.status_code in (404, 405)
        assert set(response.json()) == {"detail", "errors"}
    assert "GET" in registry.delete(f"{V1}/sweeps").headers["allow"]


def test_reads_declare_auth_only_when_they_require_it(pg_db, registry_app):
    open_doc = TestClient(registry_app).get("/openapi.json").json()
    closed_app = create_app(Settings(database_url=pg_db, api_token="t", reads_require_token=True))
    closed_doc = TestClient(closed_app).get("/openapi.json").json()
    closed_app.state.engine.dispose()
    assert open_doc["paths"][f"{V1}/sweeps"]["get"]["security"][0] == {}  # optional
    assert {} not in closed_doc["paths"][f"{V1}/sweeps"]["get"]["security"]
    assert {} not in open_doc["paths"][f"{V1}/sweeps"]["post"]["security"]


@pytest.mark.parametrize("path,cursor,status", [
    ("/sweeps", "0" * 48, 200), ("/sweeps", "f" * 48, 200), ("/sweeps", "0" * 32, 422),
    ("/sweeps", "not-a-cursor", 422), ("/runs", "7" * 48, 200), ("/runs", "g" * 48, 422),
])
def test_every_cursor_the_schema_allows_is_a_position(registry, path, cursor, status):
    """A cursor is the hex of a fixed-width sort key, so any string of the right length and
    alphabet is a valid position (perhaps past the end) and nothing else is."""
    response = registry.get(f"{V1}{path}", params={"cursor": cursor})
    assert response.status_code == status, response.text
    if status == 422:
        assert response.json()["errors"][0]["field"] == "query.cursor"


@pytest.mark.parametrize("spec,field", [
    ({"a\x00b": 1}, "body.spec"), ({"x": ["ok", "a\x00"]}, "body.spec"),
    ({"x": 10**309}, "body.spec"),
])
def test_json_documents_refuse_what_their_schema_excludes(registry, spec, field):
    response = _post(registry, f"{V1}/sweeps", json.dumps({"name": "s", "spec": spec}))
    assert response.status_code == 422, response.text
    assert response.json()["errors"][0]["field"] == field


def test_json_documents_take_every_number_a_double_holds(registry):
    spec = {"big": 2**70, "small": -(10**300), "float": 1.5e308}
    response = registry.post(f"{V1}/sweeps", json={"name": "s", "spec": spec})
    assert response.status_code == 201, response.text
    assert response.json()["spec"] == spec

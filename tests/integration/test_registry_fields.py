"""REST shape: `fields=` on GET /runs and GET /sweeps returns only the named top-level fields
(id always; unknown names are a 422 that names them and lists the allowed ones), and a served run
does not repeat its config inside its summary."""
from __future__ import annotations

import pytest

from api.schemas import RunPublic, SweepPublic
from crucible.config import Config

pytestmark = pytest.mark.integration

V1 = "/api/v1"


@pytest.fixture
def sweep_with_run(registry):
    sweep = registry.post(f"{V1}/sweeps", json={"name": "shape", "tags": ["t"]}).json()
    run = registry.post(f"{V1}/runs", json={"sweep_id": sweep["id"],
                                            "config": Config().to_dict()}).json()
    return sweep, run


def test_runs_fields_selects_top_level_fields(registry, sweep_with_run):
    _, run = sweep_with_run
    items = registry.get(f"{V1}/runs", params={"fields": "status,p,tags"}).json()["items"]
    assert items == [{"id": run["id"], "status": "pending", "p": run["p"], "tags": []}]
    only_id = registry.get(f"{V1}/runs", params={"fields": "id"}).json()["items"]
    assert only_id == [{"id": run["id"]}]
    full = registry.get(f"{V1}/runs").json()["items"]
    assert set(full[0]) == set(RunPublic.model_fields)


def test_sweeps_fields_selects_top_level_fields(registry, sweep_with_run):
    sweep, _ = sweep_with_run
    items = registry.get(f"{V1}/sweeps", params={"fields": "name,tags"}).json()["items"]
    assert items == [{"id": sweep["id"], "name": "shape", "tags": ["t"]}]
    assert set(registry.get(f"{V1}/sweeps").json()["items"][0]) == set(SweepPublic.model_fields)


@pytest.mark.parametrize(("path", "fields", "unknown"), [
    ("/runs", "id,stauts", "stauts"), ("/runs", "status,", ""), ("/sweeps", "spec,config", "config"),
    ("/sweeps", " name", " name"),
])
def test_unknown_field_is_a_422_naming_it_and_the_allowed(registry, path, fields, unknown):
    response = registry.get(V1 + path, params={"fields": fields})
    assert response.status_code == 422, response.text
    body = response.json()
    assert [e["field"] for e in body["errors"]] == ["query.fields"]
    assert f"unknown field {unknown!r}" in body["detail"]
    assert "created_at" in body["detail"]  # the allowed ones are listed


def test_openapi_documents_fields_and_partial_items(registry):
    schema = registry.get("/openapi.json").json()
    params = {p["name"]: p for p in schema["paths"][f"{V1}/runs"]["get"]["parameters"]}
    assert "final_val_loss" in params["fields"]["schema"]["pattern"]
    assert "tag" in params
    partial = schema["components"]["schemas"]["RunFields"]
    assert "required" not in partial and set(partial["properties"]) == set(RunPublic.model_fields)


def test_summary_does_not_repeat_the_config(registry, sweep_with_run):
    _, run = sweep_with_run
    url = f"{V1}/runs/{run['id']}"
    summary = {"config": run["config"], "final_val_loss": 3.5, "steps": 12}
    patched = registry.patch(url, json={"summary": summary}).json()
    assert patched["summary"] == {"final_val_loss": 3.5, "steps": 12}
    assert registry.get(url).json()["summary"] == {"final_val_loss": 3.5, "steps": 12}
    listed = registry.get(f"{V1}/runs", params={"fields": "summary"}).json()["items"]
    assert listed[0]["summary"] == {"final_val_loss": 3.5, "steps": 12}
    # a summary whose config differs from the run's keeps it (it is information then)
    other = {**summary, "config": {**run["config"], "seed": run["config"]["seed"] + 1}}
    kept = registry.patch(url, json={"summary": other}).json()["summary"]
    assert kept["config"]["seed"] == run["config"]["seed"] + 1

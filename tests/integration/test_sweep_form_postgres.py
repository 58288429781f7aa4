"""The sweep form keeps the model's field order on a Postgres-backed Prefect (issue 37, item 5).

A Postgres-backed Prefect server stores a deployment's parameter schema as JSONB, whose object
keys come back sorted by length and bytes (arms, grid, name, tags, ...), not in the order they
were sent; the UI's form orders its fields by each property's `position`. Real parts: the
schema the deployment sends, through the test Postgres server's own JSONB. (The chaos test,
tests/integration/test_stack_chaos.py, reads it back from the stack's Prefect server.)
"""
from __future__ import annotations

import json

from sqlalchemy import create_engine, text

from crucible.grid.spec import GridBlock, SweepSpec
from db.session import normalise_url
from flows.deploy import build_deployments
from tests.unit.test_sweepspec_deployments import _field_names


def form_order(properties: dict) -> list[str]:
    """The order the Prefect UI shows a schema's properties in: by `position` (both UIs sort
    by it; a property without one comes after those with one in the first)."""
    return sorted(properties, key=lambda name: properties[name].get("position", float("inf")))


def test_the_sweep_form_keeps_the_models_order_through_postgres_jsonb(pg_admin_url: str) -> None:
    sweep = {d.name: d for d in build_deployments()}["failure-sweep"]
    sent = sweep._parameter_openapi_schema.model_dump(mode="json")
    engine = create_engine(normalise_url(pg_admin_url))
    try:
        with engine.connect() as conn:
            stored = conn.execute(text("SELECT CAST(:schema AS jsonb)"),
                                  {"schema": json.dumps(sent)}).scalar_one()
    finally:
        engine.dispose()
    for model in (SweepSpec, GridBlock):
        properties = stored["definitions"][model.__name__]["properties"]
        assert list(properties) != _field_names(model)    # JSONB's own order: what broke it
        assert form_order(properties) == _field_names(model), model.__name__
    spec = stored["definitions"]["SweepSpec"]["properties"]
    assert form_order(spec)[:5] == ["name", "preset", "arms", "strategies",
                                    "failure_probabilities"]

"""The deployments render SweepSpec as a usable Prefect UI form."""
from __future__ import annotations

from typing import Any

from crucible.grid.spec import DEMO_SPEC
from flows.deploy import build_deployments


def _resolve(schema: dict, node: dict) -> dict:
    ref = node.get("$ref") or (node.get("allOf") or [{}])[0].get("$ref")
    if ref:
        return schema["definitions"][ref.rsplit("/", 1)[-1]]
    return node


def test_both_deployments_and_the_sweep_form() -> None:
    deployments = {d.name: d for d in build_deployments()}
    assert set(deployments) == {"train-run", "failure-sweep", "distributed-run"}
    sweep = deployments["failure-sweep"]
    schema = sweep._parameter_openapi_schema.model_dump()
    spec = _resolve(schema, schema["properties"]["spec"])
    props = spec["properties"]
    assert props["preset"]["enum"] == ["smoke", "small", "study", "study-d128", "paper-178m"]
    assert props["arms"]["items"]["enum"] == ["none", "ssn", "mapl"]
    assert props["strategies"]["items"]["enum"] == ["skip", "drop", "drop_extend", "reroute"]
    assert all(p.get("description") for p in props.values())
    assert sweep.parameters["spec"] == DEMO_SPEC                   # pre-filled demo grid
    train = deployments["train-run"]._parameter_openapi_schema.model_dump()
    assert {"preset", "overrides", "sweep_id", "store_url"} <= set(train["properties"])


def _field_names(model: type) -> list[str]:
    """The model's fields in their order, by the names the form shows (`set` for a block's
    `overrides`: its first validation alias)."""
    def shown(name: str, field: Any) -> str:
        choices = getattr(field.validation_alias, "choices", None)
        return str(choices[0]) if choices else field.alias or name

    return [shown(name, field) for name, field in model.model_fields.items()]


def test_every_form_field_carries_its_position_in_the_model() -> None:
    """The Prefect UI orders a form's fields by each property's `position`; a Postgres-backed
    server stores the schema as JSONB, whose keys come back sorted by length, so without it the
    form shows arms, grid, name, tags, ... (tests/integration/test_sweep_form_postgres.py reads
    it back through Postgres)."""
    from crucible.grid.spec import GridBlock, Reference, StudyFiles, SweepSpec

    sweep = {d.name: d for d in build_deployments()}["failure-sweep"]
    definitions = sweep._parameter_openapi_schema.model_dump()["definitions"]
    for model in (SweepSpec, GridBlock, Reference, StudyFiles):
        props = definitions[model.__name__]["properties"]
        shuffled = dict(sorted(props.items()))              # any key order a backend returns
        by_position = sorted(shuffled, key=lambda name: shuffled[name]["position"])
        assert by_position == _field_names(model), model.__name__
        assert [props[n]["position"] for n in by_position] == list(range(len(props)))

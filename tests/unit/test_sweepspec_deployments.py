"""The deployments render SweepSpec as a usable Prefect UI form."""
from __future__ import annotations

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

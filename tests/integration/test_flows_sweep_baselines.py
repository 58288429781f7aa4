"""A sweep of only drop_extend and reroute, under a real Prefect server and registry: its
baselines carry no strategy in the registry, its Prefect table artifact lists only the two
strategies, and a re-run still finds its completed baselines (their fingerprint is unchanged)."""
from __future__ import annotations

import json

import pytest

from crucible.registry.reporting import ApiClient
from flows.sweep_flow import failure_sweep
from tests.integration.test_flows_sweep import _artifacts, _spec

pytestmark = pytest.mark.integration


def test_sweep_without_skip_has_no_skip_and_reuses_its_baselines(prefect_harness: None,
                                                                 flow_client: ApiClient) -> None:
    spec = _spec(name="no-skip", arms=["ssn"], strategies=["drop_extend", "reroute"])
    outcome = failure_sweep(spec)
    runs = flow_client.list_runs(sweep_id=outcome["sweep_id"])
    assert sorted((r["p"], r["strategy"] or "") for r in runs) == [
        (0.0, ""), (0.5, "drop_extend"), (0.5, "reroute")]
    (baseline,) = (r for r in runs if r["p"] == 0)
    assert baseline["strategy"] is None and baseline["status"] == "completed"

    robustness = flow_client.robustness(outcome["sweep_id"])
    assert {(i["strategy"], i["p"]) for i in robustness["items"]} == {
        (s, p) for s in ("drop_extend", "reroute") for p in (0.0, 0.5)}
    (artifact,) = _artifacts(f"sweep-{outcome['sweep_id'][:8]}-robustness")
    table = artifact.data if isinstance(artifact.data, list) else json.loads(artifact.data)
    assert sorted(r["strategy"] for r in table) == ["drop_extend", "reroute"]
    assert "skip" not in json.dumps(table)

    again = failure_sweep(spec)
    assert again["sweep_id"] == outcome["sweep_id"]
    assert again["skipped"] == again["runs"] == 3 and again["completed"] == 0

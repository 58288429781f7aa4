"""Names, tags and links of a sweep in Prefect, read back from a real (temporary) Prefect server:
the sweep's flow run carries the sweep's name, each cell's flow run a name and tags that identify
sweep and cell, the dashboard link is posted before the first cell starts, and each cell's flow
run links to its run page. The registry gets the sweep's tags and notes."""
from __future__ import annotations

import uuid

import pytest
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import (
    ArtifactFilter,
    ArtifactFilterFlowRunId,
    ArtifactFilterKey,
    FlowRunFilter,
    FlowRunFilterTags,
)

from crucible.grid.spec import SweepSpec
from crucible.registry.reporting import ApiClient
from flows.sweep_flow import cell_run_name, failure_sweep

pytestmark = pytest.mark.integration

TINY = ["replicas=2", "sparseloco.inner_steps=2", "train.batch_size=2", "model.seq_len=32",
        "model.d_model=32", "train.eval_tokens=64"]


def test_sweep_and_cell_flow_runs_are_named_tagged_and_linked(prefect_harness: None,
                                                              flow_client: ApiClient) -> None:
    name = f"names {uuid.uuid4().hex[:6]}"
    spec = SweepSpec(name=name, arms=["ssn"], strategies=["drop"], failure_probabilities=[0.5],
                     seeds=[0], global_steps=2, duration=1, overrides=TINY,
                     max_concurrent_runs=1, tags=["paper/fig3"], notes="why this sweep")
    outcome = failure_sweep(spec)
    sweep_id = outcome["sweep_id"]
    sweep = flow_client.get_sweep(sweep_id)
    runs = {run["prefect_flow_run_id"]: run for run in flow_client.list_runs(sweep_id=sweep_id)}
    assert sweep["tags"] == ["paper/fig3"] and sweep["notes"] == "why this sweep"
    assert all(run["tags"] == ["paper/fig3"] for run in runs.values())
    labels = {cell.label: cell_run_name(spec, cell) for cell in spec.cells()}
    assert sorted(run["name"] for run in runs.values()) == sorted(labels.values())

    with get_client(sync_client=True) as prefect:
        parent = prefect.read_flow_run(sweep["prefect_flow_run_id"])
        cells = prefect.read_flow_runs(flow_run_filter=FlowRunFilter(tags=FlowRunFilterTags(
            all_=[f"sweep-id:{sweep_id[:8]}", "cell:ssn/drop/p=0.5/seed=0"])))
        tagged = prefect.read_flow_runs(flow_run_filter=FlowRunFilter(
            tags=FlowRunFilterTags(all_=[f"sweep:{name}"])))
        dashboard = prefect.read_artifacts(artifact_filter=ArtifactFilter(
            key=ArtifactFilterKey(any_=[f"sweep-{sweep_id[:8]}-dashboard"])))
        run_links = {str(flow_run.id): prefect.read_artifacts(artifact_filter=ArtifactFilter(
            flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run.id])))
            for flow_run in tagged if flow_run.id != parent.id}

    # the sweep's flow run: its name, found by the sweep's tags too
    assert parent.name == name
    assert {f"sweep:{name}", f"sweep-id:{sweep_id[:8]}", "tag:paper/fig3"} <= set(parent.tags)
    # each cell's flow run: named after sweep and cell, tagged so the runs list filters by both
    assert [flow_run.name for flow_run in cells] == [f"{name} · ssn/drop/p=0.5/seed=0"]
    assert {f"sweep:{name}", f"sweep-id:{sweep_id[:8]}", "cell:ssn/drop/p=0.5/seed=0",
            "arm:ssn", "strategy:drop", "p:0.5", "tag:paper/fig3"} <= set(cells[0].tags)
    children = [flow_run for flow_run in tagged if flow_run.id != parent.id]
    assert sorted(flow_run.name for flow_run in children) == sorted(labels.values())
    assert {str(flow_run.id) for flow_run in children} == set(runs)
    baseline = next(f for f in children if "strategy:baseline" in f.tags)
    assert {"cell:ssn/baseline/p=0/seed=0", "p:0", "arm:ssn"} <= set(baseline.tags)

    # the dashboard link, posted before the first cell started
    assert len(dashboard) == 1 and dashboard[0].type == "markdown"
    assert f"/dashboards/sweeps/{sweep_id}" in str(dashboard[0].data)
    first_start = min(flow_run.start_time for flow_run in children)
    assert dashboard[0].created is not None and dashboard[0].created <= first_start
    # each cell's flow run links to its run page
    for flow_run_id, artifacts in run_links.items():
        page = f"/dashboards/runs/{runs[flow_run_id]['id']})"
        assert [a.key for a in artifacts if page in str(a.data)] == \
            [f"run-{runs[flow_run_id]['id'][:8]}-dashboard"]

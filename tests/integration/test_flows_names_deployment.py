"""A sweep whose cells run as `train-run` deployment runs (`use_deployment`), served by a real
Prefect runner in this process (each run in its own subprocess, as `crucible deploy` does): the
cells' flow runs are named and tagged after sweep and cell, and each links to its run page."""
from __future__ import annotations

import asyncio
import threading
import uuid

import pytest
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import (
    ArtifactFilter,
    ArtifactFilterFlowRunId,
    FlowRunFilter,
    FlowRunFilterTags,
)
from prefect.runner import Runner

from crucible.grid.spec import SweepSpec
from crucible.registry.reporting import ApiClient
from flows.run_flow import train_run
from flows.sweep_flow import TRAIN_RUN_DEPLOYMENT, cell_run_name, failure_sweep

pytestmark = [pytest.mark.integration, pytest.mark.slow]

TINY = ["replicas=2", "sparseloco.inner_steps=2", "train.batch_size=2", "model.seq_len=32",
        "model.d_model=32", "train.eval_tokens=64"]


class _ServedDeployment:
    """`train-run` served by a Prefect runner on its own event loop in a background thread."""

    def __init__(self) -> None:
        self._loop = asyncio.new_event_loop()
        self._runner: Runner | None = None
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._loop.run_until_complete,
                                        args=(self._serve(),), daemon=True)

    async def _serve(self) -> None:
        runner = Runner(name=f"names-{uuid.uuid4().hex[:6]}", query_seconds=1)
        deployment = await train_run.to_deployment(name=TRAIN_RUN_DEPLOYMENT.split("/")[1])
        await runner.aadd_deployment(deployment)
        self._runner = runner
        self._ready.set()
        await runner.start(webserver=False)

    def __enter__(self) -> _ServedDeployment:
        self._thread.start()
        assert self._ready.wait(timeout=120), "the runner did not register the deployment"
        return self

    def __exit__(self, *_exc: object) -> None:
        if self._runner is not None and self._runner.started:
            asyncio.run_coroutine_threadsafe(self._runner.astop(), self._loop).result(timeout=60)
        self._thread.join(timeout=60)


@pytest.mark.timeout(900)
def test_deployment_cells_are_named_tagged_and_linked(prefect_harness: None,
                                                      flow_client: ApiClient) -> None:
    name = f"deployed {uuid.uuid4().hex[:6]}"
    spec = SweepSpec(name=name, arms=["ssn"], strategies=["skip"], failure_probabilities=[0.5],
                     seeds=[0], global_steps=2, duration=1, overrides=TINY,
                     max_concurrent_runs=2, use_deployment=True, tags=["via-deployment"])
    with _ServedDeployment():
        outcome = failure_sweep(spec)
    sweep_id = outcome["sweep_id"]
    assert outcome["completed"] == outcome["runs"] == 2
    runs = {run["prefect_flow_run_id"]: run for run in flow_client.list_runs(sweep_id=sweep_id)}

    with get_client(sync_client=True) as prefect:
        cells = prefect.read_flow_runs(flow_run_filter=FlowRunFilter(
            tags=FlowRunFilterTags(all_=[f"sweep-id:{sweep_id[:8]}", "tag:via-deployment"])))
        cells = [flow_run for flow_run in cells if flow_run.deployment_id is not None]
        links = {str(flow_run.id): prefect.read_artifacts(artifact_filter=ArtifactFilter(
            flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run.id]))) for flow_run in cells}

    assert sorted(flow_run.name for flow_run in cells) == sorted(
        cell_run_name(spec, cell) for cell in spec.cells())
    assert {str(flow_run.id) for flow_run in cells} == set(runs)
    for flow_run in cells:
        run = runs[str(flow_run.id)]
        cell = next(c for c in spec.cells() if cell_run_name(spec, c) == flow_run.name)
        assert {f"sweep:{name}", f"cell:{cell.label}", "arm:ssn", f"p:{cell.p:g}",
                f"strategy:{cell.strategy or 'baseline'}"} <= set(flow_run.tags)
        assert any(f"/dashboards/runs/{run['id']})" in str(a.data) for a in links[str(flow_run.id)])

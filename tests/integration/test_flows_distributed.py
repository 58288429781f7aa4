"""The `distributed-run` flow (issue 16 item 5): a distributed run (one process per replica, a real
SIGKILL) started by a Prefect flow, registered, reported and finished through the registry."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from crucible.registry.reporting import ApiClient
from flows.deploy import build_deployments
from flows.distributed_flow import distributed_run

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

# 3 global steps, replica 1 killed at step 1: the others wait out a short round deadline
STEPS = ["train.global_steps=3", "train.eval_every=3", "train.eval_tokens=8192",
         "sparseloco.round_timeout_s=8"]


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _completed(state, flow_client: ApiClient) -> tuple[dict, Path, dict, dict]:
    """(the flow's result, the run folder, its merged summary, the registry's run) of a flow
    run, which completed in the flow and in the registry, with the merged final loss."""
    result = state.result()
    out = Path(result["out_dir"])
    merged = json.loads((out / "summary.json").read_text())
    run = flow_client.get_run(result["run_id"])
    assert result["status"] == "completed" and run["status"] == "completed"
    assert run["final_val_loss"] == merged["final_val_loss"] == result["final_val_loss"]
    return result, out, merged, run


def _registered_events(flow_client: ApiClient, result: dict, out: Path) -> list[dict]:
    """The run's events in the registry: every merged record of `events.jsonl`, once."""
    events = flow_client.list_events(result["run_id"])
    assert {e["id"] for e in events} == {e["id"] for e in _jsonl(out / "events.jsonl")}
    assert events
    return events


@pytest.mark.slow
def test_distributed_run_is_registered_killed_rejoined_and_finished(
        prefect_harness: None, flow_client: ApiClient) -> None:
    state = distributed_run(preset="smoke", overrides=STEPS, nproc=2, kills=["1@1"],
                            return_state=True)
    result, out, merged, run = _completed(state, flow_client)
    assert run["prefect_flow_run_id"] == str(state.state_details.flow_run_id)
    assert run["config"]["replicas"] == 2
    assert run["tokens_processed"] == merged["tokens_processed"]
    assert run["summary"]["contributions"] == merged["contributions"]
    assert run["summary"]["distributed"]["exit_codes"] == [0, 0]
    # the planned kill fired, and the replica came back and contributed again
    [recovery] = result["recoveries"]
    assert recovery["replica"] == 1 and recovery["killed_at_step"] == 1
    assert recovery["rejoin_step"] is not None
    assert merged["contributions"]["missed"] >= 1
    # every merged record reached the registry, once
    _registered_events(flow_client, result, out)
    metrics = sorted((m["name"], m["global_step"], m["replica"])
                     for m in flow_client.list_metrics(result["run_id"]))
    assert metrics == sorted((m["name"], m["global_step"], m["replica"])
                             for m in _jsonl(out / "metrics.jsonl"))


@pytest.mark.slow
def test_a_pipeline_run_is_registered_with_its_real_stage_kills(
        prefect_harness: None, flow_client: ApiClient) -> None:
    """pipeline=true: a process per stage-replica; the fault plan's stage failures are real
    kills, and their events (with wall-clock seconds) reach the registry like a simulated run's."""
    overrides = [*STEPS, "faults.p=0.3", "faults.strategy=skip"]
    state = distributed_run(preset="smoke", overrides=overrides, nproc=2, pipeline=True,
                            return_state=True)
    result, out, _merged, run = _completed(state, flow_client)
    assert run["summary"]["pipeline"]["replicas_agree"]
    assert result["recoveries"] and not result["lost"]
    kinds = {e["kind"] for e in _registered_events(flow_client, result, out)}
    assert {"failure_start", "bypass", "process_killed", "process_restarted",
            "process_rejoined"} <= kinds


def test_refused_configs_fail_before_anything_is_registered(prefect_harness: None,
                                                            flow_client: ApiClient) -> None:
    before = len(flow_client.list_runs())
    cases = [({"nproc": 0}, "nproc must be >= 1"),
             ({"kills": ["1-3"]}, "kills: '1-3' is not REPLICA@GLOBAL_STEP"),
             ({"kills": ["2@1"]}, "--kill 2@1: replica must be in 0..1"),
             ({"overrides": ["faults.strategy=reroute", "faults.p=0.1"]},
              "faults.strategy=reroute is not supported in distributed mode"),
             ({"restarts": -1}, "restarts (--restarts) must be a whole number >= 0"),
             ({"pipeline": True, "kills": ["1@1"]}, "with pipeline=true the fault plan"),
             ({"pipeline": True, "overrides": ["sparseloco.method=diloco"]},
              "sparseloco.method=diloco is not supported in the pipeline mode")]
    for params, message in cases:
        state = distributed_run(preset="smoke", **{"nproc": 2, **params}, return_state=True)
        assert state.is_failed()
        assert message in state.message, (params, state.message)
    assert len(flow_client.list_runs()) == before


def test_the_flow_is_a_deployment_with_its_parameters() -> None:
    deployments = {d.name: d for d in build_deployments()}
    schema = deployments["distributed-run"]._parameter_openapi_schema.model_dump()
    assert {"preset", "overrides", "nproc", "kills", "kills_forever", "store_url", "run_id",
            "sweep_id"} <= set(schema["properties"])

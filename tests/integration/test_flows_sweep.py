"""The failure-sweep flow under a real (temporary) Prefect server and a real registry API."""
from __future__ import annotations

import json
from typing import Any

import pytest
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

from crucible.grid.spec import SweepSpec
from crucible.registry.reporting import ApiClient
from flows.sweep_flow import failure_sweep

pytestmark = pytest.mark.integration

# a tiny model so the whole grid trains in seconds; faults still need 4 stages
TINY = ["replicas=2", "sparseloco.inner_steps=2", "train.batch_size=2", "model.seq_len=32",
        "model.d_model=32", "train.eval_tokens=64"]


def _spec(**changes: Any) -> SweepSpec:
    base = dict(name="tiny", arms=["ssn", "mapl"], strategies=["skip", "drop"],
                failure_probabilities=[0.5], seeds=[0], global_steps=2, duration=1,
                overrides=TINY, max_concurrent_runs=2)
    return SweepSpec(**{**base, **changes})


def _artifacts(key: str) -> list[Any]:
    with get_client(sync_client=True) as client:
        return client.read_artifacts(artifact_filter=ArtifactFilter(
            key=ArtifactFilterKey(any_=[key])))


def test_tiny_sweep_registers_each_cell_once_with_its_data(prefect_harness: None,
                                                           flow_client: ApiClient) -> None:
    outcome = failure_sweep(_spec())
    runs = flow_client.list_runs(sweep_id=outcome["sweep_id"])
    assert outcome["runs"] == len(runs) == 2 + 2 * 2            # baselines shared by strategies
    assert all(run["status"] == "completed" for run in runs)
    baselines = [run for run in runs if run["p"] == 0.0]
    assert sorted(run["compression"] for run in baselines) == ["mapl", "ssn"]
    cells = {(run["compression"], run["strategy"], run["p"]) for run in runs if run["p"] > 0}
    assert cells == {(a, s, 0.5) for a in ("ssn", "mapl") for s in ("skip", "drop")}
    for run in runs:
        val = flow_client.list_metrics(run["id"], name="val_loss")
        assert [m["global_step"] for m in val][-1] == 2
        assert val[-1]["value"] == pytest.approx(run["final_val_loss"])
        train_loss = flow_client.list_metrics(run["id"], name="train_loss")
        assert len(train_loss) == len({(m["global_step"], m["replica"]) for m in train_loss}) > 0
    logged: dict[str, set[str]] = {"skip": set(), "drop": set()}  # what each strategy logged
    for run in (run for run in runs if run["p"] > 0):
        kinds = {e["kind"] for e in flow_client.list_events(run["id"])}
        logged[run["strategy"]] |= kinds & {"bypass", "drop", "reroute"}
    # p = 0.5 over 2 steps x 2 replicas: stages went down, and a drop run dropped, never bypassed
    assert logged == {"skip": {"bypass"}, "drop": {"drop"}}

    rows = outcome["rows"]
    assert {(r["compression"], r["strategy"], r["p"]) for r in rows} == cells
    prefix = f"sweep-{outcome['sweep_id'][:8]}"
    artifacts = _artifacts(f"{prefix}-robustness")
    link = _artifacts(f"{prefix}-dashboard")
    progress = _artifacts(f"{prefix}-progress")
    assert len(artifacts) == 1 and artifacts[0].type == "table"
    table = artifacts[0].data if isinstance(artifacts[0].data, list) else json.loads(artifacts[0].data)
    assert sorted((r["compression"], r["strategy"], r["p"]) for r in table) == sorted(cells)
    assert link and outcome["sweep_id"] in str(link[0].data)
    assert progress and float(progress[0].data) == 100.0
    # the claims table: REST's claims, one row per comparison (here one seed: none decided)
    [claims] = _artifacts(f"{prefix}-claims")
    claim_table = claims.data if isinstance(claims.data, list) else json.loads(claims.data)
    served = flow_client.claims(outcome["sweep_id"])["claims"]
    assert {r["claim"][:3]: r["verdict"] for r in claim_table} == {
        f"({c['tag']})": c["verdict"] for c in served}
    skip_drop = [r for r in claim_table if r["claim"].startswith("(a)")]
    assert {r["comparison"] for r in skip_drop} == {"SSN, p = 0.5", "MAPL, p = 0.5"}
    assert all(r["status"] == "missing" for r in skip_drop)      # one seed: no interval

    # re-running the same sweep trains nothing again and adds no records
    again = failure_sweep(_spec())
    assert again["sweep_id"] == outcome["sweep_id"]
    assert again["skipped"] == again["runs"] == 6 and again["completed"] == 0
    assert len(flow_client.list_runs(sweep_id=outcome["sweep_id"])) == 6


def test_seeds_by_precision_add_seeds_only_while_a_cell_is_wider_than_the_target(
        prefect_harness: None, flow_client: ApiClient) -> None:
    loose = failure_sweep(_spec(name="loose", arms=["ssn"], strategies=["skip"], seeds=[0, 1],
                                max_seeds=3, target_half_width=100.0))
    assert loose["precision_rounds"] == [] and loose["runs"] == 4   # every cell within ±100
    tight = failure_sweep(_spec(name="tight", arms=["ssn"], strategies=["skip"], seeds=[0, 1],
                                max_seeds=3, target_half_width=0.001))
    # one round: the cell is wider than ±0.001 with 2 seeds, gets a third seed and its
    # baseline, and then has the budget's 3 seeds, so no second round
    assert tight["precision_rounds"] == [{"round": 1, "cells": 1, "runs": 2}]
    runs = flow_client.list_runs(sweep_id=tight["sweep_id"])
    assert tight["runs"] == len(runs) == 6 and all(r["status"] == "completed" for r in runs)
    assert sorted((r["p"], r["seed"]) for r in runs) == [
        (p, seed) for p in (0.0, 0.5) for seed in (0, 1, 2)]
    [cell] = [i for i in flow_client.robustness(tight["sweep_id"])["items"] if i["p"] == 0.5]
    assert cell["n_seeds"] == 3
    # the re-run continues the sweep and trains nothing: every wanted seed is there
    again = failure_sweep(_spec(name="tight", arms=["ssn"], strategies=["skip"], seeds=[0, 1],
                                max_seeds=3, target_half_width=0.001))
    assert again["sweep_id"] == tight["sweep_id"] and again["completed"] == 0
    assert len(flow_client.list_runs(sweep_id=tight["sweep_id"])) == 6


def test_a_study_grid_with_a_labelled_block_runs_as_one_sweep(prefect_harness: None,
                                                              flow_client: ApiClient) -> None:
    """A study's grid (crucible.grid.spec): a labelled block of MAPL's sender decode beside the
    unlabelled cells at the same arm, strategy and p. The registry keeps them apart (its own
    robustness row), both pair with the arm's one shared baseline, and the claims read only
    the unlabelled cells."""
    spec = SweepSpec(name="tiny-grid", seeds=[0], global_steps=2, duration=1, overrides=TINY,
                     max_concurrent_runs=2, grid=[
                         {"arms": ["mapl"], "strategies": ["skip"], "p": [0.5]},
                         {"arms": ["mapl"], "strategies": ["skip"], "p": [0.5],
                          "label": "decode_sender", "set": ["pipeline.bypass_decode=sender"]}])
    outcome = failure_sweep(spec)
    runs = flow_client.list_runs(sweep_id=outcome["sweep_id"])
    assert outcome["runs"] == len(runs) == 3 and outcome["failed"] == 0
    by_label = {run["label"]: run for run in runs if run["p"] > 0}
    assert set(by_label) == {"", "decode_sender"}
    assert by_label["decode_sender"]["config"]["pipeline"]["bypass_decode"] == "sender"
    assert by_label[""]["config"]["pipeline"]["bypass_decode"] != "sender"
    [baseline] = [run for run in runs if run["p"] == 0.0]
    assert baseline["label"] == ""
    assert {run["baseline_run_id"] for run in by_label.values()} == {baseline["id"]}
    assert by_label["decode_sender"]["name"] == "tiny-grid · mapl/skip/p=0.5/decode_sender/seed=0"
    items = [i for i in flow_client.robustness(outcome["sweep_id"])["items"] if i["p"] > 0]
    assert sorted(i["label"] for i in items) == ["", "decode_sender"]
    for item in items:
        [run] = [r for r in by_label.values() if r["label"] == item["label"]]
        expected = 100 * (run["final_val_loss"] - baseline["final_val_loss"]) \
            / baseline["final_val_loss"]
        assert item["mean_pct"] == pytest.approx(expected)
    assert sorted(r["label"] for r in outcome["rows"]) == ["", "decode_sender"]


def test_run_seeds_runs_part_of_the_grid_and_the_same_sweep_completes_it(
        prefect_harness: None, flow_client: ApiClient) -> None:
    """`run_seeds` (crucible study run --seeds): some seeds now, the rest later, one sweep."""
    spec = _spec(name="tiny-seeds", arms=["ssn"], strategies=["skip"], seeds=[0, 1])
    first = failure_sweep(spec.model_copy(update={"run_seeds": [1]}))
    runs = flow_client.list_runs(sweep_id=first["sweep_id"])
    assert first["runs"] == 2 and sorted((r["p"], r["seed"]) for r in runs) == [(0.0, 1), (0.5, 1)]
    assert flow_client.get_sweep(first["sweep_id"])["status"] == "pending"   # seed 0 owed
    second = failure_sweep(spec)
    assert second["sweep_id"] == first["sweep_id"]
    assert second["skipped"] == 2 and second["completed"] == 2     # seed 1 was run already
    runs = flow_client.list_runs(sweep_id=first["sweep_id"])
    assert sorted((r["p"], r["seed"]) for r in runs) == [(0.0, 0), (0.0, 1), (0.5, 0), (0.5, 1)]
    assert flow_client.get_sweep(first["sweep_id"])["status"] == "completed"
    again = failure_sweep(spec.model_copy(update={"run_seeds": [0]}))   # nothing left to run
    assert again["skipped"] == 2 and again["completed"] == 0
    assert flow_client.get_sweep(first["sweep_id"])["status"] == "completed"

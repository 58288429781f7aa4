"""The registry API end to end on a real Postgres: sweeps, runs, ingestion, reads, robustness."""
from __future__ import annotations

import math
import statistics
import uuid

import pytest

from crucible.config import Config
from crucible.events import Event, Metric

pytestmark = pytest.mark.integration

V1 = "/api/v1"


def _config(*, p, seed, compression="ssn", strategy="skip", duration=6):
    config = Config()
    config.pipeline.compression = compression
    config.faults.p, config.faults.strategy, config.faults.duration = p, strategy, duration
    config.seed = seed
    return config.to_dict()


def _sweep(registry, name="grid"):
    response = registry.post(f"{V1}/sweeps", json={"name": name, "spec": {"seeds": [0, 1]}})
    assert response.status_code == 201, response.text
    return response.json()


def _run(registry, sweep_id, *, loss=None, status="completed", **cell):
    response = registry.post(f"{V1}/runs", json={"sweep_id": sweep_id, "config": _config(**cell)})
    assert response.status_code == 201, response.text
    run = response.json()
    if loss is not None or status != "pending":
        patch = registry.patch(f"{V1}/runs/{run['id']}",
                               json={"status": status, "final_val_loss": loss})
        assert patch.status_code == 200, patch.text
    return run


def test_health_and_readiness(registry):
    assert registry.get("/healthz").json() == {"status": "ok"}
    ready = registry.get("/readyz")
    assert ready.status_code == 200 and ready.json()["status"] == "ready"


def test_sweep_create_get_list_update(registry):
    sweep = _sweep(registry)
    assert uuid.UUID(sweep["id"]) and sweep["status"] == "pending"
    assert sweep["spec"] == {"seeds": [0, 1]}
    patched = registry.patch(f"{V1}/sweeps/{sweep['id']}",
                             json={"status": "running", "prefect_flow_run_id": "fr-1"}).json()
    assert (patched["status"], patched["prefect_flow_run_id"]) == ("running", "fr-1")
    assert registry.get(f"{V1}/sweeps/{sweep['id']}").json()["status"] == "running"
    listed = registry.get(f"{V1}/sweeps", params={"status": "running"}).json()
    assert [s["id"] for s in listed["items"]] == [sweep["id"]] and listed["next_cursor"] is None


def test_run_create_extracts_indexed_columns_and_links_baseline(registry):
    sweep = _sweep(registry)
    faulty = _run(registry, sweep["id"], p=0.2, seed=3, strategy="drop", duration=4,
                  status="pending")
    assert (faulty["compression"], faulty["strategy"], faulty["p"], faulty["duration"],
            faulty["seed"], faulty["preset"]) == ("ssn", "drop", 0.2, 4, 3, "custom")
    assert faulty["config"] == _config(p=0.2, seed=3, strategy="drop", duration=4)
    assert faulty["baseline_run_id"] is None
    base = _run(registry, sweep["id"], p=0.0, seed=3, duration=4, status="pending")
    assert registry.get(f"{V1}/runs/{faulty['id']}").json()["baseline_run_id"] == base["id"]
    later = _run(registry, sweep["id"], p=0.5, seed=3, duration=4, status="pending")
    assert later["baseline_run_id"] == base["id"]


def test_run_update_stores_results_and_summary(registry):
    run = _run(registry, None, p=0.0, seed=0, status="pending")
    body = {"status": "completed", "initial_val_loss": 5.5, "final_val_loss": 2.5,
            "tokens_budget": 1000, "tokens_processed": 990,
            "summary": {"wall_s": 1.5, "events": [{"kind": "bypass"}]},
            "prefect_flow_run_id": "abc"}
    updated = registry.patch(f"{V1}/runs/{run['id']}", json=body).json()
    assert {k: updated[k] for k in body} == body
    again = registry.patch(f"{V1}/runs/{run['id']}", json={"status_reason": "done"}).json()
    assert again["final_val_loss"] == 2.5 and again["status_reason"] == "done"


def test_run_list_filters_and_keyset_pagination(registry):
    sweep = _sweep(registry)
    created = [_run(registry, sweep["id"], p=p, seed=s, status="pending",
                    strategy="skip" if s % 2 else "drop")
               for p in (0.0, 0.1) for s in range(3)]
    body = {"config": _config(p=0.1, seed=9), "config_hash": "h-123", "code_version": "v1"}
    hashed = registry.post(f"{V1}/runs", json=body).json()
    seen, cursor = [], None
    while True:
        page = registry.get(f"{V1}/runs", params={"sweep_id": sweep["id"], "limit": 4,
                                                  **({"cursor": cursor} if cursor else {})}).json()
        seen += [r["id"] for r in page["items"]]
        cursor = page["next_cursor"]
        if cursor is None:
            break
    assert seen == [r["id"] for r in created]
    skip = registry.get(f"{V1}/runs", params={"sweep_id": sweep["id"], "strategy": "skip",
                                              "p": 0.1}).json()["items"]
    assert [r["seed"] for r in skip] == [1]
    by_hash = registry.get(f"{V1}/runs", params={"config_hash": "h-123",
                                                 "code_version": "v1"}).json()["items"]
    assert [r["id"] for r in by_hash] == [hashed["id"]]


def test_metrics_and_events_round_trip(registry):
    run = _run(registry, None, p=0.1, seed=0, status="running")
    metrics = [Metric("train_loss", step, 3.0 - step / 10, tokens=100 * step, replica=r).to_dict()
               for step in range(5) for r in range(2)]
    metrics += [Metric("val_loss", step, 2.5 - step / 10).to_dict() for step in range(5)]
    events = [Event("failure_start", 1, replica=0, stage=1, detail={"duration": 6}).to_dict(),
              Event("bypass", 2, replica=0, stage=1).to_dict(),
              Event("drop", 3, replica=1, stage=2, detail={"strategy": "drop"}).to_dict(),
              Event("reroute", 4, replica=0, stage=1,
                    detail={"strategy": "reroute", "donor": 1}).to_dict(),
              Event("rejoin", 7, replica=0, stage=1).to_dict()]
    m = registry.post(f"{V1}/runs/{run['id']}/metrics:batch", json={"items": metrics}).json()
    e = registry.post(f"{V1}/runs/{run['id']}/events:batch", json={"items": events}).json()
    assert m == {"received": 15, "inserted": 15} and e == {"received": 5, "inserted": 5}
    val = registry.get(f"{V1}/runs/{run['id']}/metrics", params={"name": "val_loss"}).json()
    assert [(x["global_step"], x["value"], x["replica"]) for x in val["items"]] == \
        [(s, pytest.approx(2.5 - s / 10), None) for s in range(5)]
    allm = registry.get(f"{V1}/runs/{run['id']}/metrics", params={"limit": 6}).json()
    assert len(allm["items"]) == 6 and allm["next_cursor"]
    bypass = registry.get(f"{V1}/runs/{run['id']}/events", params={"kind": "bypass"}).json()
    assert bypass["items"] == [{**events[1], "detail": {}}]   # neither the drop nor the reroute
    for kind, expected in (("drop", events[2]), ("reroute", events[3])):
        page = registry.get(f"{V1}/runs/{run['id']}/events", params={"kind": kind}).json()
        assert page["items"] == [expected]
    unknown = registry.get(f"{V1}/runs/{run['id']}/events", params={"kind": "dropped"})
    assert unknown.status_code == 422
    spec = registry.get("/openapi.json").json()
    (kind,) = [q for q in spec["paths"][f"{V1}/runs/{{run_id}}/events"]["get"]["parameters"]
               if q["name"] == "kind"]
    assert "drop (the replica's tokens were dropped)" in kind["description"]
    every = registry.get(f"{V1}/runs/{run['id']}/events").json()["items"]
    assert [x["id"] for x in every] == [x["id"] for x in events]
    assert every[0]["detail"] == {"duration": 6}


def test_robustness_returns_hand_computed_numbers_and_missing_baseline(registry):
    sweep = _sweep(registry)
    sid = sweep["id"]
    b0 = _run(registry, sid, p=0.0, seed=0, loss=2.0)
    b1 = _run(registry, sid, p=0.0, seed=1, loss=2.5)
    s0 = _run(registry, sid, p=0.1, seed=0, loss=2.1)    # +5 %
    s1 = _run(registry, sid, p=0.1, seed=1, loss=2.75)   # +10 %
    d0 = _run(registry, sid, p=0.1, seed=0, loss=2.4, strategy="drop")  # +20 %
    _run(registry, sid, p=0.1, seed=2, loss=2.6)         # seed 2 has no baseline
    _run(registry, sid, p=0.3, seed=0, status="running")
    out = registry.get(f"{V1}/sweeps/{sid}/robustness").json()
    assert out["sweep_id"] == sid and out["pending_runs"] == 1
    assert out["missing_baselines"] == [{"compression": "ssn", "seed": 2, "duration": 6}]
    items = {(i["strategy"], i["p"]): i for i in out["items"]}
    assert set(items) == {("drop", 0.0), ("drop", 0.1), ("skip", 0.0), ("skip", 0.1)}
    skip = items[("skip", 0.1)]
    half = 12.706204736 * statistics.stdev([5.0, 10.0]) / math.sqrt(2)
    assert skip["mean_pct"] == pytest.approx(7.5)
    assert (skip["ci_low_pct"], skip["ci_high_pct"]) == (pytest.approx(7.5 - half),
                                                         pytest.approx(7.5 + half))
    assert skip["n_seeds"] == 2 and skip["run_ids"] == [s0["id"], s1["id"]]
    drop = items[("drop", 0.1)]
    assert (drop["mean_pct"], drop["ci_low_pct"], drop["n_seeds"]) == (pytest.approx(20.0), None, 1)
    assert drop["run_ids"] == [d0["id"]]
    assert items[("skip", 0.0)]["mean_pct"] == 0 and \
        items[("skip", 0.0)]["run_ids"] == [b0["id"], b1["id"]]
    table = registry.get(f"{V1}/sweeps/{sid}/table").json()
    assert table["columns"] == ["ssn/drop", "ssn/skip"]
    assert [r["p"] for r in table["rows"]] == [0.0, 0.1]
    assert table["rows"][1]["cells"]["ssn/skip"]["mean_pct"] == pytest.approx(7.5)
    assert table["rows"][1]["cells"]["ssn/drop"]["n_seeds"] == 1


def test_robustness_of_empty_or_unknown_sweep(registry):
    sweep = _sweep(registry)
    out = registry.get(f"{V1}/sweeps/{sweep['id']}/robustness").json()
    assert (out["items"], out["missing_baselines"], out["pending_runs"]) == ([], [], 0)
    assert registry.get(f"{V1}/sweeps/{uuid.uuid4()}/robustness").status_code == 404
    assert registry.get(f"{V1}/sweeps/{uuid.uuid4()}/table").status_code == 404


def test_embedded_sqlite_default_serves_the_same_api(tmp_path):
    from fastapi.testclient import TestClient

    from api.app import create_app
    from api.settings import Settings

    settings = Settings(database_url=f"sqlite:///{tmp_path / 'crucible.db'}", api_token="t",
                        migrate_on_start=True)
    with TestClient(create_app(settings), headers={"Authorization": "Bearer t"}) as client:
        assert client.get("/readyz").json()["status"] == "ready"
        run = client.post(f"{V1}/runs", json={"config": _config(p=0.1, seed=0)}).json()
        items = [Metric("val_loss", s, 1.0).to_dict() for s in range(3)] * 2
        result = client.post(f"{V1}/runs/{run['id']}/metrics:batch", json={"items": items})
        assert result.json() == {"received": 6, "inserted": 3}
        events = [Event("rejoin", 4, replica=1, stage=2, detail={"a": [1]}).to_dict()]
        for _ in range(2):
            client.post(f"{V1}/runs/{run['id']}/events:batch", json={"items": events})
        stored = client.get(f"{V1}/runs/{run['id']}/events").json()["items"]
        assert stored == events


def _orm_sweep_run_rows(session, sweep_id):
    """The implementation sweep_run_rows had before it selected columns: full ORM rows."""
    from sqlalchemy import select

    from db.models import Run

    query = select(Run).where(Run.sweep_id == sweep_id).order_by(Run.created_at, Run.id)
    return [{"id": str(r.id), "compression": r.compression, "strategy": r.strategy, "p": r.p,
             "label": r.label, "duration": r.duration, "seed": r.seed, "status": r.status,
             "final_val_loss": r.final_val_loss, "initial_val_loss": r.initial_val_loss}
            for r in session.scalars(query)]


def test_robustness_and_table_match_the_orm_implementation(registry, registry_app):
    from api.analysis import sweep_run_rows
    from api.analysis_schemas import RobustnessPublic, TablePublic
    from crucible import stats as analysis

    sid = _sweep(registry)["id"]
    other = _sweep(registry, "other")["id"]
    for k, (compression, strategy, p, seed, duration) in enumerate(
            (c, s, p, seed, d) for c in ("none", "ssn") for s in ("skip", "drop")
            for p in (0.0, 0.1, 0.3) for seed in range(3) for d in (4, 6)):
        status = {0: "failed", 4: "running"}.get(k % 9, "completed")
        loss = None if k % 11 == 5 else 2.0 + 0.05 * seed + p * (1 + k % 4) + 0.001 * duration
        _run(registry, sid, loss=loss, status=status, compression=compression,
             strategy=strategy, p=p, seed=seed, duration=duration)
    _run(registry, sid, loss=2.9, p=0.1, seed=1, duration=6)        # a rerun replaces seed 1
    _run(registry, sid, loss=3.5, p=0.3, seed=7, compression="none")  # no baseline for seed 7
    _run(registry, other, loss=9.0, p=0.1, seed=0)                    # another sweep
    _run(registry, None, loss=9.0, p=0.0, seed=0)                     # no sweep

    with registry_app.state.session_factory() as session:
        before = _orm_sweep_run_rows(session, uuid.UUID(sid))
        assert sweep_run_rows(session, sweep_id=uuid.UUID(sid)) == before
    assert len(before) == 74 and {r["status"] for r in before} >= {"failed", "running"}
    expected = {"sweep_id": sid, **analysis.robustness(before)}
    assert expected["items"] and expected["missing_baselines"] and expected["failed_runs"]
    got = registry.get(f"{V1}/sweeps/{sid}/robustness").json()
    assert got == RobustnessPublic.model_validate(expected).model_dump(mode="json")
    table = {"sweep_id": sid, **analysis.robustness_table(expected["items"])}
    got = registry.get(f"{V1}/sweeps/{sid}/table").json()
    assert got == TablePublic.model_validate(table).model_dump(mode="json")


def test_labelled_runs_are_their_own_robustness_cells_against_the_shared_baseline(registry):
    """A study block's label keeps its runs apart from the unlabelled cell of the same arm,
    strategy and p; both pair with the arm's one baseline; a labelled baseline is refused."""
    sweep = _sweep(registry)
    for seed, (base, plain, labelled) in enumerate(((2.0, 2.1, 2.4), (3.0, 3.3, 3.0))):
        _run(registry, sweep["id"], p=0.0, seed=seed, loss=base)
        _run(registry, sweep["id"], p=0.2, seed=seed, loss=plain)
        response = registry.post(f"{V1}/runs", json={
            "sweep_id": sweep["id"], "config": _config(p=0.2, seed=seed), "label": "variant"})
        assert response.status_code == 201, response.text
        assert response.json()["label"] == "variant"
        registry.patch(f"{V1}/runs/{response.json()['id']}",
                       json={"status": "completed", "final_val_loss": labelled})
    items = {i["label"]: i for i in registry.get(
        f"{V1}/sweeps/{sweep['id']}/robustness").json()["items"] if i["p"] > 0}
    assert items[""]["mean_pct"] == pytest.approx((5.0 + 10.0) / 2)
    assert items["variant"]["mean_pct"] == pytest.approx((20.0 + 0.0) / 2)
    table = registry.get(f"{V1}/sweeps/{sweep['id']}/table").json()
    assert sorted(table["columns"]) == ["ssn/skip", "ssn/skip[variant]"]
    refused = registry.post(f"{V1}/runs", json={
        "sweep_id": sweep["id"], "config": _config(p=0.0, seed=5), "label": "variant"})
    assert refused.status_code == 422 and "label" in refused.text
    bad = registry.post(f"{V1}/runs", json={
        "sweep_id": sweep["id"], "config": _config(p=0.2, seed=5), "label": "Two Words"})
    assert bad.status_code == 422

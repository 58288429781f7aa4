"""What the live pages poll (`/dashboards/runs/{id}/state`, `/dashboards/sweeps/{ref}/state`),
the sweep page by name, and the run view's bounds for a big run, over the real Postgres."""
from __future__ import annotations

import uuid
from typing import Any

import pytest

from api.dashboards import queries
from dashboards import sample
from db.session import make_engine, make_session_factory

pytestmark = pytest.mark.integration

V1 = "/api/v1"
_CONFIG = {"seed": 0, "replicas": 4, "faults": {"p": 0.1, "strategy": "skip", "duration": 4},
           "pipeline": {"compression": "ssn"}}


def _sweep_with_run(registry: Any, name: str) -> tuple[str, str]:
    sweep_id = registry.post(f"{V1}/sweeps", json={"name": name}).json()["id"]
    run = registry.post(f"{V1}/runs", json={"sweep_id": sweep_id, "config": _CONFIG})
    assert run.status_code == 201, run.text
    return sweep_id, run.json()["id"]


def test_run_state_version_moves_with_every_change_and_finishes(registry: Any) -> None:
    _sweep_id, run_id = _sweep_with_run(registry, "state")
    url = f"/dashboards/runs/{run_id}/state"
    seen = [registry.get(url).json()]
    assert seen[0]["status"] == "pending" and seen[0]["finished"] is False

    def changed(step: Any) -> dict[str, Any]:
        step.raise_for_status() if hasattr(step, "raise_for_status") else None
        state = registry.get(url).json()
        assert state["version"] not in {s["version"] for s in seen}, state
        seen.append(state)
        return state

    changed(registry.patch(f"{V1}/runs/{run_id}", json={"status": "running"}))
    state = changed(registry.post(f"{V1}/runs/{run_id}/metrics:batch",
                                  json={"items": sample.train_loss_metrics(steps=2)}))
    assert state["metrics"] == 8
    state = changed(registry.post(f"{V1}/runs/{run_id}/events:batch",
                                  json={"items": sample.events()[:3]}))
    assert state["events"] == 3
    assert registry.get(url).json()["version"] == state["version"]  # nothing new: same version
    state = changed(registry.patch(f"{V1}/runs/{run_id}", json={"status": "completed"}))
    assert state["finished"] is True


def test_state_endpoints_refuse_unknown_ids_and_parameters(registry: Any) -> None:
    missing = registry.get(f"/dashboards/runs/{uuid.uuid4()}/state")
    assert missing.status_code == 404 and missing.json()["errors"][0]["field"] == "run_id"
    assert registry.get("/dashboards/runs/not-a-uuid/state").status_code == 422
    assert registry.get("/dashboards/sweeps/no such sweep/state").status_code == 404
    sweep_id, _run = _sweep_with_run(registry, "params")
    typo = registry.get(f"/dashboards/sweeps/{sweep_id}/state", params={"verison": "1"})
    assert typo.status_code == 422 and "verison" in typo.text


def test_sweep_state_and_page_accept_the_sweep_name(registry: Any) -> None:
    sweep_id, run_id = _sweep_with_run(registry, "grid by name")
    registry.patch(f"{V1}/sweeps/{sweep_id}", json={"status": "running"}).raise_for_status()
    by_name = registry.get("/dashboards/sweeps/grid by name/state").json()
    assert by_name == registry.get(f"/dashboards/sweeps/{sweep_id}/state").json()
    assert by_name["runs"] == 1 and by_name["runs_active"] == 1 and not by_name["finished"]

    page = registry.get("/dashboards/sweeps/grid by name")
    assert page.status_code == 200 and f"<code>{sweep_id}</code>" in page.text
    assert 'data-live-url="/dashboards/sweeps/grid%20by%20name/state"' in page.text
    assert registry.get("/dashboards/sweeps/grid by nam").status_code == 404

    registry.patch(f"{V1}/runs/{run_id}", json={"status": "completed"}).raise_for_status()
    after = registry.get(f"/dashboards/sweeps/{sweep_id}/state").json()
    assert after["version"] != by_name["version"] and after["runs_active"] == 0
    assert not after["finished"]  # the sweep itself still says running
    registry.patch(f"{V1}/sweeps/{sweep_id}", json={"status": "completed"}).raise_for_status()
    assert registry.get(f"/dashboards/sweeps/{sweep_id}/state").json()["finished"] is True
    assert "data-live-url" not in registry.get(f"/dashboards/sweeps/{sweep_id}").text


def test_run_page_links_the_prefect_flow_run_when_the_ui_is_configured(
        registry: Any, pg_db: str) -> None:
    from fastapi.testclient import TestClient

    from api.app import create_app
    from api.settings import Settings

    _sweep_id, run_id = _sweep_with_run(registry, "prefect")
    registry.patch(f"{V1}/runs/{run_id}", json={"prefect_flow_run_id": "abc-123"}
                   ).raise_for_status()
    assert 'Prefect flow run <code>abc-123</code>' in registry.get(
        f"/dashboards/runs/{run_id}").text
    app = create_app(Settings(database_url=pg_db, prefect_ui_url="http://prefect.test:4200/"))
    with TestClient(app) as client:
        page = client.get(f"/dashboards/runs/{run_id}").text
    app.state.engine.dispose()
    assert '<a href="http://prefect.test:4200/runs/flow-run/abc-123">Prefect flow run</a>' in page


def test_run_view_stays_bounded_for_a_long_run(registry: Any, pg_db: str) -> None:
    _sweep_id, run_id = _sweep_with_run(registry, "long")
    steps = 3 * queries.MAX_TRAIN_STEPS + 7
    rows = [{"name": "train_loss", "global_step": s, "replica": r, "value": 1.0 + s / steps}
            for s in range(steps) for r in range(2)]
    registry.post(f"{V1}/runs/{run_id}/metrics:batch", json={"items": rows}).raise_for_status()
    events = [{"id": f"bypass:{s}:1:0:0", "kind": "bypass", "global_step": s, "replica": 1,
               "stage": 0} for s in range(1500)]
    registry.post(f"{V1}/runs/{run_id}/events:batch", json={"items": events}).raise_for_status()
    engine = make_engine(pg_db)
    try:
        with make_session_factory(engine)() as session:
            view = queries.run_view(session, run_id=uuid.UUID(run_id))
    finally:
        engine.dispose()
    for replica in (0, 1):
        kept = [r["global_step"] for r in view["train_loss"] if r["replica"] == replica]
        assert len(kept) <= queries.MAX_TRAIN_STEPS + 1
        assert kept[0] == 0 and kept[-1] == steps - 1 and kept == sorted(kept)
    assert view["event_counts"] == {"bypass": 1500}

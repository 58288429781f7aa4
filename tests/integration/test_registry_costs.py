"""Costs in the registry (real API under uvicorn on Postgres): `crucible cost --api` puts each
run's record, GET /runs/{id}/costs reads it back, a second put of the same deployment replaces
it, GET /sweeps/{ref}/costs decides by cost from the stored records, and bad records are 422."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from crucible.pricing.cost import run_cost
from crucible.pricing.cost_sweep import CostRow, cell_key, sweep_costs
from crucible.pricing.deployment import load_deployment
from crucible.registry.reporting import ApiClient, ApiError
from tests.unit.test_cli import _crucible_here

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
SPOT = ROOT / "infra" / "deployments" / "cloud-8x4-spot.toml"
DEMAND = ROOT / "infra" / "deployments" / "cloud-8x4-on-demand.toml"
CELLS = ("none-base-s0", "none-base-s1", "none-skip-p0.1-s0", "none-skip-p0.1-s1",
         "none-drop-p0.1-s0", "none-drop-p0.1-s1")


@pytest.fixture
def client(api_server):
    with ApiClient(api_server.url, api_server.token, timeout_s=5.0, retries=1,
                   backoff_s=0.05) as api:
        yield api


def _registered_sweep(client, api_server, tmp_path, name="costs"):
    sweep = client.create_sweep(name)
    folder = tmp_path / "sweep"
    ids = {}
    for cell in CELLS:
        run_dir = folder / cell
        run_dir.mkdir(parents=True)
        shutil.copyfile(ROOT / "results" / "processes" / f"{cell}.json", run_dir / "summary.json")
        summary = json.loads((run_dir / "summary.json").read_text())
        run = client.create_run(summary["config"], sweep_id=sweep["id"], name=cell)
        client.update_run(run["id"], status="completed",
                          final_val_loss=summary["final_val_loss"], summary=summary)
        (run_dir / "registry.json").write_text(json.dumps({"api_url": api_server.url,
                                                           "run_id": run["id"]}))
        ids[cell] = run["id"]
    return sweep, folder, ids


def test_cost_cli_puts_records_and_the_sweep_decides_from_them(client, api_server, tmp_path):
    sweep, folder, ids = _registered_sweep(client, api_server, tmp_path)
    env = {"CRUCIBLE_API_TOKEN": api_server.token}
    result = _crucible_here("cost", folder, "--deployment", SPOT, "--api", api_server.url,
                            env=env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("sent to registry run") == len(CELLS)
    stored = client.run_costs(ids["none-skip-p0.1-s0"])
    local = json.loads((folder / "none-skip-p0.1-s0" / "cost.json").read_text())
    assert [c["deployment"] for c in stored] == ["cloud-8x4-spot"]
    assert stored[0]["record"] == local
    assert stored[0]["cost"] == pytest.approx(local["cost"])
    assert stored[0]["pricing"] == "spot"
    # the same deployment again replaces; another deployment adds a row
    again = client.put_run_cost(ids["none-skip-p0.1-s0"], {**local, "cost": 1.5})
    assert again["cost"] == 1.5
    result = _crucible_here("cost", folder, "--deployment", DEMAND, "--api", api_server.url,
                            env=env)
    assert result.returncode == 0, result.stderr
    assert [c["deployment"] for c in client.run_costs(ids["none-skip-p0.1-s0"])] == [
        "cloud-8x4-on-demand", "cloud-8x4-spot"]
    # the sweep's decisions: as crucible.pricing.cost_sweep decides on the local records
    with pytest.raises(ApiError) as info:
        client.sweep_costs(sweep["id"])
    assert info.value.status_code == 422 and "pass deployment=NAME" in str(info.value.detail)
    remote = client.sweep_costs(sweep["id"], deployment="cloud-8x4-on-demand")
    deployment = load_deployment(DEMAND)
    rows = []
    for cell in CELLS:
        summary = json.loads((folder / cell / "summary.json").read_text())
        rows.append(CostRow(key=cell_key(summary), seed=summary["seed"], name=cell,
                            cost=run_cost(summary, deployment)))
    expected = json.loads(json.dumps(sweep_costs(rows)))
    assert remote["cheapest"] == expected["cheapest"]
    assert [(c["strategy"], c["cost"]["mean"]) for c in remote["cells"]] == [
        (c["strategy"], pytest.approx(c["cost"]["mean"])) for c in expected["cells"]]
    assert remote["deployments"] == ["cloud-8x4-on-demand", "cloud-8x4-spot"]


def test_bad_cost_records_are_refused(client, api_server, tmp_path):
    run = client.create_run({"seed": 1})
    with pytest.raises(ApiError) as info:
        client.put_run_cost(run["id"], {"deployment": "x"})
    assert info.value.status_code == 422 and "model" in str(info.value.detail)
    good = {"deployment": "x", "model": "crucible.cost/1", "pricing": "spot",
            "currency": "USD", "wall_s": 1.0, "accelerator_hours": 1.0, "cost": 1.0}
    with pytest.raises(ApiError) as info:
        client.put_run_cost(run["id"], {**good, "cost": -1})
    assert info.value.status_code == 422 and "greater than or equal to 0" in str(info.value.detail)
    with pytest.raises(ApiError) as info:
        client.put_run_cost("00000000-0000-0000-0000-000000000000", good)
    assert info.value.status_code == 404
    with pytest.raises(ApiError) as info:
        client.sweep_costs(client.create_sweep("unpriced")["id"])
    assert info.value.status_code == 404
    assert client.put_run_cost(run["id"], good)["deployment"] == "x"


def test_cost_of_a_registry_sweep_by_name_prices_the_stored_summaries(client, api_server,
                                                                      tmp_path):
    sweep, folder, ids = _registered_sweep(client, api_server, tmp_path, name="costs by name")
    env = {"CRUCIBLE_API_TOKEN": api_server.token}
    result = _crucible_here("cost", "costs by name", "--deployment", SPOT, "--api",
                            api_server.url, env=env, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("sent to registry run") == len(CELLS)
    summary = json.loads((folder / "none-drop-p0.1-s1" / "summary.json").read_text())
    [stored] = client.run_costs(ids["none-drop-p0.1-s1"])
    expected = json.loads(json.dumps(run_cost(summary, load_deployment(SPOT))))
    assert stored["record"] == expected
    assert not list(tmp_path.glob("**/cost.json"))     # nothing written locally
    result = _crucible_here("cost", "no such sweep", "--deployment", SPOT, "--api",
                            api_server.url, env=env, cwd=tmp_path)
    assert result.returncode == 2 and "no sweep or run of that name" in result.stderr

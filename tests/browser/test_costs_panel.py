"""The sweep page's cost panel in a real headless Chromium, served by the real API (uvicorn over
Postgres): a sweep whose runs were priced by `crucible cost --api` shows, per deployment, the
cheapest strategy at each p (as GET /sweeps/{id}/costs says) and two drawn figures, loss against
wall-clock and against money, one curve per cell; an unpriced sweep says how to price it."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from crucible.pricing.cost import run_cost
from crucible.pricing.deployment import load_deployment
from tests.fixtures.browser import serve_in_thread

pytestmark = [pytest.mark.browser, pytest.mark.integration]

ROOT = Path(__file__).resolve().parents[2]
CELLS = ("none-base-s0", "none-base-s1", "none-skip-p0.1-s0", "none-skip-p0.1-s1",
         "none-drop-p0.1-s0", "none-drop-p0.1-s1", "none-reroute-p0.1-s0",
         "none-reroute-p0.1-s1")
_FIGURES_JS = """() => Array.from(document.querySelectorAll('#costs [data-figure]')).map(sec => {
  const gd = sec.querySelector('.js-plotly-plot');
  return {id: sec.dataset.figure, traces: gd && gd.data ? gd.data.length : 0,
          drawn: gd ? gd.querySelectorAll('g.trace').length : 0,
          width: gd ? gd.getBoundingClientRect().width : 0};
})"""


@pytest.fixture(scope="module")
def served(pg_url: str) -> Any:
    from api.app import create_app
    from api.settings import Settings

    token = "crc_cost-browser-tests"
    app = create_app(Settings(database_url=pg_url, api_token=token))
    with serve_in_thread(app, name="cost-uvicorn") as url:
        yield url, token


def _priced_sweep(client: httpx.Client, name: str, *, price: bool) -> str:
    sweep_id = client.post("/api/v1/sweeps", json={"name": name}).raise_for_status().json()["id"]
    deployment = load_deployment(ROOT / "infra" / "deployments" / "cloud-8x4-spot.toml")
    for cell in CELLS:
        summary = json.loads((ROOT / "results" / "processes" / f"{cell}.json").read_text())
        run = client.post("/api/v1/runs", json={"sweep_id": sweep_id, "name": cell,
                                                 "config": summary["config"]}
                          ).raise_for_status().json()
        client.patch(f"/api/v1/runs/{run['id']}", json={
            "status": "completed", "final_val_loss": summary["final_val_loss"]}
                     ).raise_for_status()
        if price:
            client.put(f"/api/v1/runs/{run['id']}/costs",
                       json=run_cost(summary, deployment)).raise_for_status()
    client.patch(f"/api/v1/sweeps/{sweep_id}", json={"status": "completed"}).raise_for_status()
    return sweep_id


def test_cost_panel_draws_loss_against_time_and_money_and_names_the_cheapest(
        served: Any, browser_page: Any, artifacts_dir: Path) -> None:
    url, token = served
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"},
                      timeout=30) as client:
        sweep_id = _priced_sweep(client, "priced sweep", price=True)
        unpriced = _priced_sweep(client, "unpriced sweep", price=False)
        decided = client.get(f"/api/v1/sweeps/{sweep_id}/costs").raise_for_status().json()
    page = browser_page.page
    page.goto(f"{url}/dashboards/sweeps/{sweep_id}")
    page.wait_for_function("document.querySelectorAll('#costs [data-figure] .js-plotly-plot')"
                           ".length === 2")
    figures = page.evaluate(_FIGURES_JS)
    assert [f["id"] for f in figures] == ["fig-cost-wall-0", "fig-cost-money-0"]
    for figure in figures:   # one curve per cell: baseline, skip, drop, reroute
        assert figure["traces"] == 4 and figure["drawn"] == 4, figure
        assert figure["width"] > 300, figure
    names = page.evaluate("() => document.getElementById('fig-cost-money-0').data"
                          ".map(t => t.name)")
    assert sorted(names) == ["uncompressed · baseline", "uncompressed · drop · p = 0.1",
                             "uncompressed · reroute · p = 0.1", "uncompressed · skip · p = 0.1"]
    # the money axis is the served record's: the baseline's last point is its mean cost
    base = next(c for c in decided["cells"] if c["strategy"] == "base")
    drawn = page.evaluate("() => document.getElementById('fig-cost-money-0').data"
                          ".find(t => t.name === 'uncompressed · baseline').x.slice(-1)[0]")
    assert drawn == pytest.approx(base["curve"][-1]["cost"])
    shown = page.locator("#costs [data-cheapest]").first.get_attribute("data-cheapest")
    assert shown == decided["cheapest"][0]["strategy"]
    assert page.locator("#costs h3").inner_text().startswith("cloud-8x4-spot")
    assert browser_page.errors == [], f"console errors: {browser_page.errors}"
    page.locator("#costs").screenshot(path=str(artifacts_dir / "dashboard-costs.png"))
    assert (artifacts_dir / "dashboard-costs.png").stat().st_size > 5_000

    page.goto(f"{url}/dashboards/sweeps/{unpriced}")
    page.wait_for_selector("#costs")
    assert "No run of this sweep is priced yet" in page.locator("#costs").inner_text()
    assert page.locator("#costs [data-figure]").count() == 0

"""The index page (/ and /dashboards) in a real headless Chromium, served by the real API over
Postgres: it lists the sweeps and recent runs put in through the registry's HTTP API, its search
and filters narrow both lists through a plain GET form, and its links lead to the pages."""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.fixtures.browser import serve_in_thread

pytestmark = [pytest.mark.browser, pytest.mark.integration]

TOKEN = "crc_index-browser-tests"


def _config(*, compression: str, p: float, strategy: str = "skip") -> dict[str, Any]:
    return {"preset": "smoke", "seed": 0, "replicas": 4, "train": {"global_steps": 20},
            "faults": {"p": p, "strategy": strategy, "duration": 4},
            "pipeline": {"compression": compression}}


def _seed(client: httpx.Client, *, name: str, compression: str, completed: int) -> str:
    """A sweep of three runs of one arm (p = 0, 0.1, 0.2), the first `completed` of them done."""
    sweep_id = client.post("/api/v1/sweeps", json={"name": name}).raise_for_status().json()["id"]
    for index, p in enumerate((0.0, 0.1, 0.2)):
        run = client.post("/api/v1/runs", json={
            "sweep_id": sweep_id, "config": _config(compression=compression, p=p)})
        run_id = run.raise_for_status().json()["id"]
        if index < completed:
            client.patch(f"/api/v1/runs/{run_id}",
                         json={"status": "completed", "final_val_loss": 3.0 + p}
                         ).raise_for_status()
    client.patch(f"/api/v1/sweeps/{sweep_id}", json={"status": "running"}).raise_for_status()
    return sweep_id


@pytest.fixture(scope="module")
def served(pg_url: str) -> Iterator[tuple[str, dict[str, str]]]:
    """The registry app under uvicorn, with two sweeps: "index ssn grid" (2/3 completed) and
    "index mapl grid" (1/3). Returns (url, {sweep name: id})."""
    from api.app import create_app
    from api.settings import Settings

    app = create_app(Settings(database_url=pg_url, api_token=TOKEN))
    with serve_in_thread(app, name="index-uvicorn") as url:
        with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {TOKEN}"},
                          timeout=30) as client:
            ids = {"index ssn grid": _seed(client, name="index ssn grid", compression="ssn",
                                           completed=2),
                   "index mapl grid": _seed(client, name="index mapl grid", compression="mapl",
                                            completed=1)}
        yield url, ids


def _sweep_names(page: Any) -> list[str]:
    return page.locator("#sweeps tr td:first-child a").all_inner_texts()


def _run_arms(page: Any) -> set[str]:
    return set(page.locator("#recent-runs tr td:nth-child(2)").all_inner_texts())


def test_index_lists_sweeps_and_runs_and_its_filters_narrow_them(
        served: tuple[str, dict[str, str]], browser_page: Any, artifacts_dir: Path) -> None:
    url, ids = served
    page = browser_page.page
    page.goto(f"{url}/")
    assert {"index ssn grid", "index mapl grid"} <= set(_sweep_names(page))
    ssn_row = page.locator("#sweeps tr", has_text="index ssn grid")
    assert "2/3 completed" in ssn_row.inner_text() and "SSN" in ssn_row.inner_text()
    assert {"SSN", "MAPL"} <= _run_arms(page)
    page.screenshot(path=str(artifacts_dir / "dashboard-index.png"), full_page=True)

    # search by name, through the form
    page.fill("input[name=q]", "MAPL GRID")
    page.click("form.filters button[type=submit]")
    page.wait_for_url("**/?*q=MAPL+GRID*")
    assert _sweep_names(page) == ["index mapl grid"]
    assert page.locator("#recent-runs tr").count() == 1 + 3  # header + the sweep's runs

    # a filter on the arm: only ssn runs at p = 0.1, and the sweeps holding such runs
    page.goto(f"{url}/dashboards")
    page.select_option("select[name=compression]", "ssn")
    page.fill("input[name=p]", "0.1")
    page.click("form.filters button[type=submit]")
    page.wait_for_url("**/dashboards?*compression=ssn*")
    assert "index mapl grid" not in _sweep_names(page)
    assert "index ssn grid" in _sweep_names(page)
    runs = page.locator("#recent-runs tr td:nth-child(4)").all_inner_texts()
    assert runs and set(runs) == {"10%"} and _run_arms(page) == {"SSN"}

    # links lead to the sweep's and the run's pages
    page.click("#sweeps a:text('index ssn grid')")
    page.wait_for_url(f"**/dashboards/sweeps/{ids['index ssn grid']}")
    assert page.locator("h1").inner_text() == "Sweep: index ssn grid"
    page.go_back()
    page.click("#recent-runs tr:nth-child(2) a")
    page.wait_for_url("**/dashboards/runs/*")
    assert page.locator("h1").inner_text().startswith("Run: SSN")
    assert browser_page.errors == [], f"console errors: {browser_page.errors}"


def test_index_names_a_bad_filter_and_ignores_it(served: tuple[str, dict[str, str]]) -> None:
    url, _ids = served
    response = httpx.get(f"{url}/", params={"compression": "mapple", "colour": "red"})
    assert response.status_code == 200 and response.headers["content-type"].startswith(
        "text/html")
    assert "compression: &#x27;mapple&#x27; is not one of none, ssn, mapl" in response.text
    assert "unknown filter colour" in response.text
    assert "index ssn grid" in response.text  # the bad filter was ignored

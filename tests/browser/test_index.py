"""The index page (/ and /dashboards) in a real headless Chromium, served by the real API over
Postgres: it lists the sweeps and recent runs put in through the registry's HTTP API (each run
with its sweep, tags on both), its search and filters (tag included) narrow both lists through a
plain GET form, its links lead to the pages, and a cancelled sweep reads as cancelled on the
index and on its own page."""
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


def _seed(client: httpx.Client, *, name: str, compression: str, completed: int,
          tags: tuple[str, ...] = (), status: str = "running") -> str:
    """A sweep of three runs of one arm (p = 0, 0.1, 0.2), the first `completed` of them done
    and the rest left as they are (pending) or, for a cancelled sweep, cancelled. The sweep
    carries `tags`; its p = 0.1 run carries `tags` and "p10"."""
    sweep_id = client.post("/api/v1/sweeps", json={"name": name, "tags": list(tags)}
                           ).raise_for_status().json()["id"]
    for index, p in enumerate((0.0, 0.1, 0.2)):
        run = client.post("/api/v1/runs", json={
            "sweep_id": sweep_id, "config": _config(compression=compression, p=p),
            "tags": [*tags, "p10"] if p == 0.1 else []})
        run_id = run.raise_for_status().json()["id"]
        if index < completed:
            client.patch(f"/api/v1/runs/{run_id}",
                         json={"status": "completed", "final_val_loss": 3.0 + p}
                         ).raise_for_status()
        elif status == "cancelled":
            client.patch(f"/api/v1/runs/{run_id}", json={"status": "cancelled"}
                         ).raise_for_status()
    client.patch(f"/api/v1/sweeps/{sweep_id}", json={"status": status}).raise_for_status()
    return sweep_id


@pytest.fixture(scope="module")
def served(pg_url: str) -> Iterator[tuple[str, dict[str, str]]]:
    """The registry app under uvicorn, with three sweeps: "index ssn grid" (2/3 completed,
    tagged "index-paper"), "index mapl grid" (1/3) and "index stopped grid" (1/3, then cancelled).
    Returns (url, {sweep name: id})."""
    from api.app import create_app
    from api.settings import Settings

    app = create_app(Settings(database_url=pg_url, api_token=TOKEN))
    with serve_in_thread(app, name="index-uvicorn") as url:
        with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {TOKEN}"},
                          timeout=30) as client:
            ids = {"index ssn grid": _seed(client, name="index ssn grid", compression="ssn",
                                           completed=2, tags=("index-paper",)),
                   "index mapl grid": _seed(client, name="index mapl grid", compression="mapl",
                                            completed=1),
                   "index stopped grid": _seed(client, name="index stopped grid",
                                               compression="mapl", completed=1,
                                               status="cancelled")}
        yield url, ids


def _sweep_names(page: Any) -> list[str]:
    return page.locator("#sweeps tr td:first-child a").all_inner_texts()


# recent-runs columns: select, run, sweep, arm, strategy, p, seed, preset, status, loss, tags
def _run_column(page: Any, column: int) -> list[str]:
    return page.locator(f"#recent-runs tr td:nth-child({column})").all_inner_texts()


def _run_arms(page: Any) -> set[str]:
    return set(_run_column(page, 4))


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
    runs = _run_column(page, 6)
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


def test_index_shows_each_runs_sweep_and_tags_and_filters_by_tag(
        served: tuple[str, dict[str, str]], browser_page: Any) -> None:
    url, ids = served
    page = browser_page.page
    page.goto(f"{url}/")
    ssn_row = page.locator("#sweeps tr", has_text="index ssn grid")
    assert ssn_row.locator(".tag").all_inner_texts() == ["index-paper"]
    tagged_run = page.locator("#recent-runs tr", has_text="p10").first
    assert tagged_run.locator("td:nth-child(3)").inner_text() in {
        "index ssn grid", "index mapl grid", "index stopped grid"}

    # the tag filter keeps the objects that carry the tag: one sweep, one run
    page.fill("input[name=tag]", "index-paper")
    page.click("form.filters button[type=submit]")
    page.wait_for_url("**/?*tag=index-paper*")
    assert _sweep_names(page) == ["index ssn grid"]
    assert _run_column(page, 3) == ["index ssn grid"] and _run_column(page, 6) == ["10%"]
    assert page.locator("#recent-runs .tag").all_inner_texts() == ["index-paper", "p10"]

    # the run's sweep column leads to its sweep's page
    page.click("#recent-runs td:nth-child(3) a")
    page.wait_for_url(f"**/dashboards/sweeps/{ids['index ssn grid']}")
    assert page.locator("#sweep-tags .tag").all_inner_texts() == ["index-paper"]
    assert browser_page.errors == [], f"console errors: {browser_page.errors}"


def test_cancelled_sweep_reads_cancelled_on_the_index_and_its_page(
        served: tuple[str, dict[str, str]], browser_page: Any, artifacts_dir: Path) -> None:
    url, ids = served
    page = browser_page.page
    page.goto(f"{url}/?q=index+&status=cancelled")  # this module's sweeps, only cancelled
    assert _sweep_names(page) == ["index stopped grid"]
    status = page.locator("#sweeps tr", has_text="index stopped grid").locator("td:nth-child(2)")
    assert status.inner_text() == "cancelled"
    assert "status-cancelled" in (status.get_attribute("class") or "")
    assert set(_run_column(page, 9)) == {"cancelled"} and len(_run_column(page, 9)) == 2

    page.click("#sweeps a:text('index stopped grid')")
    page.wait_for_url(f"**/dashboards/sweeps/{ids['index stopped grid']}")
    assert page.locator("p.meta b").first.inner_text() == "cancelled"
    assert "Cancelled." in page.locator(".banner.warn").inner_text()
    assert "still running" not in page.locator("main").inner_text()
    statuses = page.locator("#runs tr td.status-cancelled").all_inner_texts()
    assert statuses == ["cancelled", "cancelled"]
    page.screenshot(path=str(artifacts_dir / "dashboard-sweep-cancelled.png"), full_page=True)
    assert browser_page.errors == [], f"console errors: {browser_page.errors}"


def test_index_names_a_bad_filter_and_ignores_it(served: tuple[str, dict[str, str]]) -> None:
    url, _ids = served
    response = httpx.get(f"{url}/", params={"compression": "mapple", "colour": "red"})
    assert response.status_code == 200 and response.headers["content-type"].startswith(
        "text/html")
    assert "compression: &#x27;mapple&#x27; is not one of none, ssn, mapl" in response.text
    assert "unknown filter colour" in response.text
    assert "index ssn grid" in response.text  # the bad filter was ignored
